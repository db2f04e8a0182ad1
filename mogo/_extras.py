"""The optional dependencies and the one-line error that names how to install them.

Each optional feature checks its modules with :func:`require` before importing them, so a missing
package ends in ``<feature> needs the <extra> extra (missing: <module>): pip install 'mogo[<extra>]'``
instead of a bare ``ModuleNotFoundError``. :func:`require` only looks the modules up
(``importlib.util.find_spec``), it imports nothing.
"""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["EXTRAS", "MissingExtraError", "require"]

EXTRAS: dict[str, tuple[tuple[str, ...], str]] = {
    "diffusion": (
        (
            "diffusers",
            "transformers",
            "accelerate",
            "peft",
            "safetensors",
            "yaml",
            "tqdm",
            "PIL",
            "matplotlib",
        ),
        "pip install 'mogo[diffusion]'",
    ),
    "ocr": (("rapidocr_onnxruntime", "cv2"), "pip install 'mogo[ocr]'"),
    "qp": (("qpth",), "pip install 'mogo[qp]'"),
    "tracking": (("tensorboard",), "pip install 'mogo[tracking]'"),
    "torchjd": (("torchjd",), "pip install torchjd"),
}
"""Extra name to (the top-level modules it provides, the command that installs them); the first
four are ``pyproject.toml``'s optional dependencies, ``torchjd`` a plain package."""


def _installed(name: str) -> bool:
    """Whether top-level module ``name`` can be imported (``sys.modules[name] = None`` blocks it)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message says which and how to install it."""


def require(feature: str, extra: str) -> None:
    """Raise :class:`MissingExtraError` if a module of ``extra`` (a key of :data:`EXTRAS`) is not
    installed, e.g. ``mogo_diffusion needs the diffusion extra (missing: accelerate): pip install
    'mogo[diffusion]'``.

    Example:
        >>> try:
        ...     EXTRAS["nothing"] = (("no_such_module_here",), "pip install nothing")
        ...     require("this example", "nothing")
        ... except MissingExtraError as error:
        ...     print(error)
        ... finally:
        ...     del EXTRAS["nothing"]
        this example needs the nothing package (missing: no_such_module_here): pip install nothing
    """
    modules, command = EXTRAS[extra]
    missing = [name for name in modules if not _installed(name)]
    if missing:
        kind = "extra" if command.endswith(f"[{extra}]'") else "package"
        raise MissingExtraError(
            f"{feature} needs the {extra} {kind} (missing: {', '.join(missing)}): {command}", name=missing[0]
        )
