"""Checkpoints: round trip, hashes, finiteness, extra files in the rename, and kill -9 at every write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mogo_diffusion import checkpoint
from mogo_diffusion.checkpoint import (
    MANIFEST,
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)

ROOT = Path(__file__).resolve().parents[2]


def state(seed: int) -> dict:
    """A small state of every kind a checkpoint holds, different for each ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "epoch": seed,
        "trained": [torch.randn(3, 4, generator=generator), torch.randn(5, generator=generator)],
        "optimizer": {
            "state": {
                0: {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(3, 4, generator=generator)}
            },
            "param_groups": [{"lr": 0.01, "params": [0, 1], "betas": (0.9, 0.999)}],
        },
        "half": torch.randn(2, 2, generator=generator).to(torch.bfloat16),
        "counts": torch.arange(seed, seed + 3),
        "none": None,
        "name": f"run-{seed}",
    }


def assert_same(a, b, where="state"):
    """``a`` and ``b`` are equal, tensors bit for bit and of the same dtype, containers of the same type."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, where


def test_a_state_comes_back_bit_identical_with_its_manifest(tmp_path):
    path = save_checkpoint(tmp_path, 7, state(7))
    assert path == checkpoint_path(tmp_path, 7) == tmp_path / "step-000007"
    assert_same(load_checkpoint(path), state(7))
    listed = json.loads((path / MANIFEST).read_text())["files"]
    assert sorted(listed) == ["state.json", "tensors.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000007"]  # nothing left over


def test_corrupt_bytes_in_the_tensors_are_refused_naming_the_file(tmp_path):
    """D10: 64 bytes overwritten in the middle of tensors.safetensors used to load as wrong numbers."""
    save_checkpoint(tmp_path, 1, state(1))
    path = save_checkpoint(tmp_path, 2, state(2))
    tensors = path / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    middle = len(data) // 2
    data[middle - 32 : middle + 32] = b"\xff" * 64  # 0xffff... is NaN in float32 and bfloat16
    tensors.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step-000002/tensors\.safetensors' differs from its hash"):
        load_checkpoint(path)
    with pytest.warns(UserWarning, match=r"skipping a damaged checkpoint: .*step-000002/tensors"):
        assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
    (checkpoint_path(tmp_path, 1) / "state.json").write_text("{}")
    with (
        pytest.warns(UserWarning, match="skipping a damaged checkpoint"),
        pytest.raises(CheckpointError, match=r"no intact checkpoint .*state\.json"),
    ):
        latest_checkpoint(tmp_path)


def test_non_finite_tensors_are_refused_on_save_and_on_load(tmp_path):
    """D10: a checkpoint that hashes well but holds NaN (written by a faulty run) must not resume."""
    bad = state(1)
    bad["trained"][1][2] = float("nan")
    with pytest.raises(CheckpointError, match=r"non-finite values in state\.trained\.1"):
        save_checkpoint(tmp_path, 1, bad)
    assert list(tmp_path.iterdir()) == []
    path = save_checkpoint(tmp_path, 1, state(1))
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "tensors.safetensors")
    tensors["state.optimizer.state.0.exp_avg"][0, 0] = float("inf")
    save_file(tensors, path / "tensors.safetensors")
    checkpoint._write_manifest(path)  # as the faulty run's own save would have hashed it
    with pytest.raises(
        CheckpointError,
        match=r"tensors\.safetensors' holds non-finite values in state\.optimizer\.state\.0\.exp_avg",
    ):
        load_checkpoint(path)


def test_extra_files_are_published_and_verified_with_the_rest(tmp_path):
    """D14: the LoRA export used to be written after the rename, unhashed; a kill left an empty lora/."""

    def export(staging: Path) -> None:
        (staging / "lora").mkdir()
        (staging / "lora" / "adapter.safetensors").write_bytes(b"weights" * 100)

    path = save_checkpoint(tmp_path, 3, state(3), write_extra=export)
    assert (path / "lora" / "adapter.safetensors").read_bytes() == b"weights" * 100
    assert "lora/adapter.safetensors" in json.loads((path / MANIFEST).read_text())["files"]
    verify_checkpoint(path)
    (path / "lora" / "adapter.safetensors").write_bytes(b"weight!" * 100)
    with pytest.raises(CheckpointError, match=r"lora/adapter\.safetensors' differs from its hash"):
        verify_checkpoint(path)
    (path / "lora" / "adapter.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"lora/adapter\.safetensors' is missing"):
        load_checkpoint(path)


def test_latest_skips_a_step_folder_without_a_manifest(tmp_path):
    """D14: a step-N/ with an empty lora/ (the old save killed after its rename) was chosen as latest."""
    save_checkpoint(tmp_path, 1, state(1))
    (tmp_path / "step-000002" / "lora").mkdir(parents=True)
    (tmp_path / "step-000003.tmp").mkdir()  # an unfinished save is not even considered
    with pytest.warns(UserWarning, match=r"step-000002' has no manifest\.json"):
        assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"step-000002' has no manifest\.json"):
        load_checkpoint(tmp_path / "step-000002")
    assert latest_checkpoint(tmp_path / "absent") is None
    with pytest.raises(CheckpointError, match=r"step-000009' does not exist or is not a directory"):
        load_checkpoint(tmp_path / "step-000009")


def test_a_failed_rename_of_a_resave_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """D15: re-saving a step deleted the old folder before the rename; a failure in between lost it."""
    save_checkpoint(tmp_path, 2, state(2))
    replace = os.replace

    def failing_publish(source, target):
        if str(source).endswith(".tmp"):
            raise OSError(28, "No space left on device")
        replace(source, target)

    monkeypatch.setattr(checkpoint.os, "replace", failing_publish)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, 2, state(20))
    monkeypatch.undo()
    assert_same(load_checkpoint(checkpoint_path(tmp_path, 2)), state(2))
    save_checkpoint(tmp_path, 2, state(20))  # the next save cleans up and succeeds
    assert_same(load_checkpoint(checkpoint_path(tmp_path, 2)), state(20))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]


def test_leftovers_of_an_interrupted_save_are_listed_right_and_tidied(tmp_path):
    save_checkpoint(tmp_path, 1, state(1))
    save_checkpoint(tmp_path, 2, state(2))
    os.replace(tmp_path / "step-000002", tmp_path / "step-000002.old")  # killed between the renames
    (tmp_path / "step-000002.tmp").mkdir()
    (tmp_path / "step-000001.old").mkdir()  # killed before deleting the old version
    assert list_checkpoints(tmp_path) == [(1, tmp_path / "step-000001"), (2, tmp_path / "step-000002.old")]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000002.old"
    save_checkpoint(tmp_path, 3, state(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000002", "step-000003"]
    assert_same(load_checkpoint(tmp_path / "step-000002"), state(2))


# A child process (torch imported once) forks one grandchild per write boundary n: it saves with
# checkpoint._boundary replaced by one that records the boundary's name and sends itself SIGKILL at
# the n-th; the child stops at the first n the save survives. Each job: STEP:SOURCE, saved over a
# fresh copy of TEMPLATE in WORK/<job>/<n>.
KILLER = r"""
import os, shutil, signal, sys
from pathlib import Path
from mogo_diffusion import checkpoint

template, work = Path(sys.argv[1]), Path(sys.argv[2])
for job, spec in enumerate(sys.argv[3:]):
    step, source = spec.split(":", 1)
    state = checkpoint.load_checkpoint(source)
    for n in range(100):
        root = work / str(job) / str(n)
        shutil.copytree(template, root)
        pid = os.fork()
        if pid == 0:
            calls = []
            def kill_at(name):
                calls.append(name)
                if len(calls) == n + 1:
                    (root.parent / f"{n}.boundary").write_text(name)
                    os.kill(os.getpid(), signal.SIGKILL)
            checkpoint._boundary = kill_at
            checkpoint.save_checkpoint(root, int(step), state)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            (root.parent / "survived").write_text(str(n))
            break
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
"""


@pytest.mark.spawns
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_kill_9_at_every_write_boundary_loses_no_complete_checkpoint(tmp_path):
    """Over steps 1-3: a new step 4, and a re-save of step 2 with new content, each killed by
    SIGKILL at every boundary between its writes. Every checkpoint complete before the save stays
    loadable bit for bit, the saved step is the old or the new version (never missing, never
    mixed), and the next save leaves exactly the step folders."""
    template, sources = tmp_path / "template", tmp_path / "sources"
    for step in (1, 2, 3):
        save_checkpoint(template, step, state(step))
    jobs = {4: save_checkpoint(sources, 4, state(4)), 2: save_checkpoint(sources, 20, state(20))}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    specs = [f"{step}:{source}" for step, source in jobs.items()]
    subprocess.run(
        [sys.executable, "-c", KILLER, str(template), str(tmp_path / "work"), *specs], check=True, env=env
    )
    for job, (step, source) in enumerate(jobs.items()):
        runs = tmp_path / "work" / str(job)
        survived = int((runs / "survived").read_text())
        boundaries = [(runs / f"{n}.boundary").read_text() for n in range(survived)]
        # the writes: staging, tensors, state, manifest, then (re-save) aside, rename, cleanup
        assert boundaries == ["staging", "tensors", "state", "manifest", *(["aside"] if step == 2 else []),
                              "rename", *(["cleanup"] if step == 2 else [])]  # fmt: skip
        new = load_checkpoint(source)
        for n in range(survived + 1):
            root = runs / str(n)
            expected = {1: state(1), 2: state(2), 3: state(3)}
            if n >= boundaries.index("rename"):  # killed after the rename, or survived
                expected[step] = new
            listed = dict(list_checkpoints(root))
            assert sorted(listed) == sorted(expected), n
            for s, value in expected.items():
                assert_same(load_checkpoint(listed[s]), value, f"boundary {n}, step {s}")
            assert latest_checkpoint(root) == listed[max(expected)]
            save_checkpoint(root, 5, state(5))  # recovers whatever the kill left
            assert sorted(p.name for p in root.iterdir()) == [
                f"step-00000{s}" for s in sorted({*expected, 5})
            ]
            for s, value in expected.items():
                assert_same(load_checkpoint(checkpoint_path(root, s)), value, f"after recovery {n}, step {s}")
