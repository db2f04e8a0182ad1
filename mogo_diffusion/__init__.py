"""mogo_diffusion: multi-reward RL fine-tuning of Stable Diffusion 3 with the DiffusionNFT loss.

Modules: ``models`` (loading, tiny SD3, LoRA), ``sampling``, ``nft``, ``advantages``, ``rewards``,
``config``, ``checkpoint``, ``preflight`` and ``train`` (``python -m mogo_diffusion.train``, or
``mogo-train``). Importing the package imports none of them, nor torch, so
``import mogo_diffusion.config`` stays light. It depends on :mod:`mogo`, never the reverse.

Without the ``diffusion`` extra, importing it raises an ``ImportError`` (a ``MissingExtraError``)
saying ``pip install 'mogo[diffusion]'``; a command (``python -m mogo_diffusion.X``,
``mogo-train``) prints that one line instead and exits with status 1. A command also leaves
transformers' notice of its PIL fallback out of its output
(:func:`mogo_diffusion.quiet.quiet_backend_notice`).
"""

import importlib.util as _util
import os as _os
import sys as _sys


def _require_diffusion_extra() -> None:
    """``mogo._extras.require("mogo_diffusion", "diffusion")``, run from that file without
    ``mogo/__init__.py`` (which imports torch): a copy of the module used for this check only."""
    (location,) = _util.find_spec("mogo").submodule_search_locations  # finds mogo, does not import it
    spec = _util.spec_from_file_location("mogo_diffusion._mogo_extras", _os.path.join(location, "_extras.py"))
    extras = _util.module_from_spec(spec)
    spec.loader.exec_module(extras)
    extras.require("mogo_diffusion", "diffusion")


# While ``python -m`` imports a module's parent package, ``sys.argv[0]`` is "-m" (see the Python
# docs of ``-m``); ``mogo-train`` is the console script.
_COMMAND = _sys.argv[:1] == ["-m"] or _os.path.basename(_sys.argv[0] if _sys.argv else "") == "mogo-train"
try:
    _require_diffusion_extra()
except ImportError as _error:
    if _COMMAND:
        raise SystemExit(str(_error)) from None
    raise
if _COMMAND:
    from mogo_diffusion.quiet import quiet_backend_notice as _quiet_backend_notice

    _quiet_backend_notice()
