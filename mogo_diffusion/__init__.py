"""mogo_diffusion: multi-reward RL fine-tuning of Stable Diffusion 3 with the DiffusionNFT loss.

Modules: ``models`` (loading, tiny SD3, LoRA), ``sampling``, ``nft``, ``advantages``, ``rewards``,
``config``, ``checkpoint``, ``preflight`` and ``train`` (``python -m mogo_diffusion.train``, or
``mogo-train``). Importing the package imports none of them, so ``import mogo_diffusion.rewards``
stays light. It depends on :mod:`mogo`, never the reverse.

Without the ``diffusion`` extra, importing it raises ``mogo._extras.MissingExtraError`` (an
``ImportError``) saying ``pip install 'mogo[diffusion]'``; a command (``python -m
mogo_diffusion.X``, ``mogo-train``) prints that one line instead and exits with status 1.
"""

import os as _os
import sys as _sys

from mogo._extras import MissingExtraError as _MissingExtraError
from mogo._extras import require as _require

try:
    _require("mogo_diffusion", "diffusion")
except _MissingExtraError as _error:
    # While ``python -m`` imports a module's parent package, ``sys.argv[0]`` is "-m" (see the
    # Python docs of ``-m``); ``mogo-train`` is the console script.
    if _sys.argv[:1] == ["-m"] or _os.path.basename(_sys.argv[0] if _sys.argv else "") == "mogo-train":
        raise SystemExit(str(_error)) from None
    raise
