"""The README's examples run, and every public name is documented."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import mogo

ROOT = Path(__file__).resolve().parent.parent
README_BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_readme_has_examples():
    assert README_BLOCKS


@pytest.mark.parametrize("block", README_BLOCKS, ids=[f"block{i}" for i in range(len(README_BLOCKS))])
def test_readme_example_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {"__name__": "__readme__"})


@pytest.mark.parametrize("name", mogo.__all__)
def test_public_name_is_in_the_api_reference(name):
    api = (ROOT / "docs" / "api.rst").read_text()
    assert re.search(rf"(auto\w+|py:data):: mogo\.{name}\b", api), f"mogo.{name} is missing from docs/api.rst"


DIFFUSION_MODULES = (
    "hub",
    "models",
    "tokenizers",
    "sampling",
    "attention",
    "peft_adapters",
    "nft",
    "advantages",
    "rewards",
    "config",
    "checkpoint",
    "run_dir",
    "train",
    "checks",
    "compilation",
    "resumable",
    "progress",
    "quiet",
    "evaluate",
    "prompts",
    "rewards.clip",
    "rewards.hps",
    "rewards.ocr",
    "rewards.geneval",
    "rewards.shapes",
    "shapes.scenes",
    "shapes.detect",
    "shapes.pretrain",
    "shapes.recipe",
    "compare",
    "strategies",
    "streams",
    "bootstrap",
    "analysis",
    "tables",
    "figures",
    "study",
    "preflight",
    "released_marble",
    "reward_rates",
    "soups",
    "noise",
)


def _diffusion_names() -> list[str]:
    pytest.importorskip("diffusers")
    names = []
    for module in DIFFUSION_MODULES:
        public = importlib.import_module(f"mogo_diffusion.{module}").__all__
        names += [f"{module}.{name}" for name in public]
    return names


@pytest.mark.parametrize("name", _diffusion_names())
def test_diffusion_public_name_is_in_the_api_reference(name):
    """Under its public path, or under the submodule that defines it (a package's re-exported
    constants, whose doc comments Sphinx reads at their definition)."""
    api = (ROOT / "docs" / "api_diffusion.rst").read_text()
    module, _, attribute = name.rpartition(".")
    path = rf"mogo_diffusion\.{re.escape(module)}(\.\w+)?\.{re.escape(attribute)}\b"
    assert re.search(rf"(auto\w+|data):: {path}", api), f"{name} is missing"
