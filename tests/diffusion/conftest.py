"""The tiny SD3 that the strategy tests train, saved once per test module."""

from __future__ import annotations

import pytest

from mogo_diffusion import models


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A ``"smoke"`` tiny SD3 pipeline saved to disk (modules that define their own keep theirs)."""
    path = tmp_path_factory.mktemp("tiny-sd3")
    models.tiny_sd3("smoke").save_pretrained(path)
    return path
