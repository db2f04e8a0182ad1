"""The tiny SD3 pipeline the trainer's tests load, saved once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from mogo_diffusion import models


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding :func:`mogo_diffusion.models.tiny_sd3` ``"smoke"`` (its tokenizers,
    text encoders, VAE, transformer and scheduler), saved as a pipeline is: what a config's
    ``model.pretrained`` names and the trainer loads, as a user's would be. Read-only: shared by
    every test of the session."""
    path = tmp_path_factory.mktemp("tiny-sd3")
    models.tiny_sd3("smoke").save_pretrained(path)
    return path
