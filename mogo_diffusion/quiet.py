"""Third-party output that says nothing to a run's user, kept off its terminal.

* :func:`quiet_loading`: while models load, transformers' and diffusers' progress bars
  ("Loading weights", "Loading pipeline components") are off, through their public logging
  switches; the previous settings come back afterwards.
* :func:`quiet_backend_notice`: transformers' notice that an image processor falls back to its PIL
  backend for want of torchvision, logged when diffusers' pipelines are imported. The PIL backend
  is the one the rewards use, so the notice asks nothing of the user; the commands
  (``python -m mogo_diffusion.X``, ``mogo-train``) leave it out (``mogo_diffusion/__init__.py``,
  before anything imports diffusers). Every other message, ours and theirs, stays.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["BACKEND_NOTICE", "quiet_backend_notice", "quiet_loading"]

BACKEND_NOTICE = "requires torchvision (not installed); falling back to"
"""What transformers' notice of the PIL fallback says (``transformers.utils.import_utils``)."""


class _WithoutBackendNotice(logging.Filter):
    """Drops the records that carry :data:`BACKEND_NOTICE`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return BACKEND_NOTICE not in record.getMessage()


def quiet_backend_notice() -> None:
    """Leave transformers' PIL-fallback notice (:data:`BACKEND_NOTICE`) out of this process's log;
    once is enough (a second call adds nothing)."""
    logger = logging.getLogger("transformers.utils.import_utils")
    if not any(isinstance(f, _WithoutBackendNotice) for f in logger.filters):
        logger.addFilter(_WithoutBackendNotice())


@contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' and diffusers' progress bars off inside the block, as they were after it."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    switches = [
        module for module in (transformers_logging, diffusers_logging) if module.is_progress_bar_enabled()
    ]
    for module in switches:
        module.disable_progress_bar()
    try:
        yield
    finally:
        for module in switches:
            module.enable_progress_bar()
