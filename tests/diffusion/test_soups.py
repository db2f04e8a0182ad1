"""Rewarded soups on tiny specialist runs: a vertex of the simplex is its specialist exactly, the
merge is linear, the soup loads and evaluates as a run, and mismatched specialists are named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mogo_diffusion import models, soups
from mogo_diffusion.checkpoint import latest_checkpoint, load_checkpoint
from mogo_diffusion.config import Config
from mogo_diffusion.evaluate import evaluate_run
from mogo_diffusion.soups import LORA_FILE, merge_tensors, simplex_grid, write_soup
from mogo_diffusion.train import Trainer
from tests.diffusion.test_evaluate import _run_config


@pytest.fixture(scope="module")
def specialists(tmp_path_factory):
    """Two one-epoch specialists of the same tiny model and seed, one per reward."""
    tiny = tmp_path_factory.mktemp("tiny-sd3")
    models.tiny_sd3("smoke").save_pretrained(tiny)
    root = tmp_path_factory.mktemp("specialists")
    runs = []
    for reward in ("jpeg_compressibility", "sharpness"):
        run = root / reward
        Trainer.from_config(_run_config(tiny, run, {"name": "single", "reward": reward}, epochs=1)).train()
        runs.append(run)
    return tiny, runs


def final_state(run):
    checkpoint = latest_checkpoint(run / "checkpoints")
    return checkpoint, load_checkpoint(checkpoint)


def test_a_vertex_of_the_simplex_is_its_specialist_exactly(specialists, tmp_path):
    _, runs = specialists
    for k, run in enumerate(runs):
        lambdas = [1.0 if i == k else 0.0 for i in range(len(runs))]
        soup = write_soup(runs, lambdas, tmp_path / f"vertex{k}")
        (checkpoint, expected), (_, merged) = final_state(run), final_state(soup)
        for key in ("trained", "old", "eval_ema"):
            for a, b in zip(merged[key], expected[key], strict=True):
                assert torch.equal(a, b)
        lora, reference = (
            load_file(soup / "checkpoints" / checkpoint.name / "lora" / LORA_FILE),
            load_file(checkpoint / "lora" / LORA_FILE),
        )
        assert lora.keys() == reference.keys()
        assert all(torch.equal(lora[name], reference[name]) for name in lora)
    assert json.loads((tmp_path / "vertex1" / "soup.json").read_text())["lambda"] == [0.0, 1.0]


def test_the_merge_is_linear_in_the_adapters_tensors(specialists, tmp_path):
    _, runs = specialists
    soup = write_soup(runs, [0.3, 0.7], tmp_path / "soup")
    states = [final_state(run)[1] for run in runs]
    merged = final_state(soup)[1]
    for key in ("trained", "old", "eval_ema"):
        for i, tensor in enumerate(merged[key]):
            a, b = (state[key][i].double() for state in states)
            # the float64 sum of two terms, rounded once to float32
            torch.testing.assert_close(tensor, (0.3 * a + 0.7 * b).float(), rtol=0, atol=0)
    assert merged["optimizer"]["state"] == {}  # a soup was never trained
    assert merge_tensors([torch.ones(2), torch.full((2,), 3.0)], [0.25, 0.75]).tolist() == [2.5, 2.5]


def test_a_soup_loads_into_the_pipeline_and_evaluates_as_its_specialist(specialists, tmp_path):
    tiny, runs = specialists
    results = soups.main(
        [*map(str, runs), "--lambdas", "1,0", "--lambdas", "0.5,0.5", "--out", str(tmp_path)]
    )
    vertex = results[0]
    specialist = evaluate_run(runs[0])
    assert vertex["metrics"] == specialist["metrics"]  # the same weights, prompts and noise
    assert vertex["lambda"] == [1.0, 0.0]
    assert (tmp_path / "soups.md").is_file()
    assert [r["name"] for r in json.loads((tmp_path / "soups.json").read_text())] == [
        "soup-1-0",
        "soup-0.5-0.5",
    ]
    pipeline = models.load_pipeline(str(tiny), torch_dtype=torch.float32)
    checkpoint = latest_checkpoint(tmp_path / "soup-0.5-0.5" / "checkpoints")
    pipeline.load_lora_weights(checkpoint / "lora")  # the diffusers format, as a run's export
    loaded = {name for name, _ in pipeline.transformer.named_parameters() if "lora" in name}
    assert loaded


def test_bad_weights_and_mismatched_specialists_are_named(specialists, tmp_path, capsys):
    tiny, runs = specialists
    with pytest.raises(ValueError, match="lambda has 3 weights for 2 specialists"):
        write_soup(runs, [0.2, 0.3, 0.5], tmp_path / "a")
    with pytest.raises(ValueError, match="lambda must be non-negative weights that sum to 1"):
        write_soup(runs, [1.5, -0.5], tmp_path / "b")
    wider = tmp_path / "wider"
    data = _run_config(tiny, wider, {"name": "single", "reward": "sharpness"}, epochs=1).to_dict()
    data["model"]["lora_rank"] = 8  # the others' is 4
    Trainer.from_config(Config.from_dict(data)).train()
    with pytest.raises(ValueError, match=r"its config's 'model' differs"):
        write_soup([runs[0], wider], [0.5, 0.5], tmp_path / "c")
    with pytest.raises(SystemExit):
        soups.main(
            [str(runs[0]), str(tmp_path / "missing"), "--lambdas", "0.5,0.5", "--out", str(tmp_path / "d")]
        )
    assert "has no checkpoint" in capsys.readouterr().err


def test_the_sweep_is_the_simplex_grid():
    assert simplex_grid(3, 1) == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    grid = simplex_grid(3, 4)
    assert len(grid) == 15  # compositions of 4 into 3 parts
    assert all(abs(sum(p) - 1) < 1e-12 for p in grid)
