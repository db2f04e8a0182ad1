"""The run directory's contract: the fingerprint, the claim, the record, the marker and the metrics file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mogo_diffusion import run_dir
from mogo_diffusion.checkpoint import save_checkpoint
from mogo_diffusion.config import Config
from mogo_diffusion.run_dir import RESUME_MAY_CHANGE, RunDirError
from tests.diffusion.test_checkpoint import state

CONFIG = Config.from_dict({"rewards": [{"name": "sharpness"}, {"name": "color_match"}]})
DATA = CONFIG.to_dict()


def leaves(value, prefix=""):
    """The dotted fields of a ``Config.to_dict()`` tree and their values."""
    if isinstance(value, dict):
        return [leaf for key, item in value.items() for leaf in leaves(item, f"{prefix}{key}.")]
    if isinstance(value, list) and value:
        return [leaf for i, item in enumerate(value) for leaf in leaves(item, f"{prefix}{i}.")]
    return [(prefix[:-1], value)]


def replaced(data, field, value):
    """A deep copy of ``data`` with the dotted ``field`` set to ``value``."""
    copy = json.loads(json.dumps(data))
    *path, last = field.split(".")
    node = copy
    for key in path:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return copy


FIELDS = [field for field, _ in leaves(DATA)]


@given(
    field=st.sampled_from(FIELDS),
    value=st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=8), st.none()),
)
def test_the_fingerprint_changes_with_every_run_defining_field_and_no_other(field, value):
    before = dict(leaves(DATA))[field]
    if value == before:  # no change (1 == 1.0 == True: values of one config field have one type)
        return
    changed = replaced(DATA, field, value)
    defining = field not in RESUME_MAY_CHANGE
    # distinct SHA-256 of distinct texts: a collision has probability 2**-256
    assert (run_dir.fingerprint(changed) != run_dir.fingerprint(CONFIG)) == defining
    expected = [(field, before, value)] if defining else []
    assert run_dir.defining_differences(DATA, changed) == expected


def test_every_field_a_resume_may_change_is_a_config_field():
    assert set(FIELDS) >= RESUME_MAY_CHANGE


def test_paths_into_the_package_are_recorded_relative_to_it(tmp_path):
    package = Path(run_dir.__file__).resolve().parent
    data = {"model": str(package / "shapes" / "pipeline"), "elsewhere": str(tmp_path), "name": "shapes"}
    assert run_dir.portable(data) == {
        "model": "mogo_diffusion/shapes/pipeline",  # the same in every checkout
        "elsewhere": str(tmp_path),
        "name": "shapes",
    }
    other_checkout = replaced(DATA, "model.pretrained", str(package / "shapes" / "pipeline"))
    relative = replaced(DATA, "model.pretrained", "mogo_diffusion/shapes/pipeline")
    assert run_dir.fingerprint(other_checkout) == run_dir.fingerprint(relative)


def test_a_directory_is_claimed_by_one_holder_at_a_time(tmp_path):
    with run_dir.claim(tmp_path / "run"):
        assert run_dir.claimed_by(tmp_path / "run") == str(os.getpid())
        in_use = rf"run' is in use by another process \(pid {os.getpid()}\)"
        with pytest.raises(RunDirError, match=in_use), run_dir.claim(tmp_path / "run"):
            pass
    assert run_dir.claimed_by(tmp_path / "run") is None
    assert run_dir.claimed_by(tmp_path / "never") is None
    with run_dir.claim(tmp_path / "run"):  # released: claimed again
        pass


def test_without_fcntl_the_claim_warns_and_takes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(run_dir, "fcntl", None)  # as on Windows
    with pytest.warns(UserWarning, match="no fcntl on this platform"), run_dir.claim(tmp_path):
        assert run_dir.claimed_by(tmp_path) is None


def write_run(directory: Path, epochs: int = 3) -> None:
    """A run of ``CONFIG`` started, with checkpoint 1 and ``epochs`` metrics records."""
    run_dir.start(directory, CONFIG, resumed_at=None)
    save_checkpoint(directory / "checkpoints", 1, state(1))
    for epoch in range(epochs):
        run_dir.append_metrics(directory, {"epoch": epoch, "seconds": 1.0 + epoch})


def test_a_fresh_run_is_refused_in_a_directory_that_holds_one_and_overwrite_replaces_it(tmp_path):
    write_run(tmp_path)
    (tmp_path / "log.txt").write_text("not the run's")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(
        RunDirError, match=r"holds a run already \(unfinished, latest checkpoint step-000001\)"
    ):
        run_dir.start(tmp_path, CONFIG, resumed_at=None)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    run_dir.start(tmp_path, CONFIG, resumed_at=None, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt", "run.json"]
    assert run_dir.read_record(tmp_path)["fingerprint"] == run_dir.fingerprint(CONFIG)


def test_a_resume_keeps_the_metrics_before_its_epoch_and_drops_the_marker(tmp_path):
    write_run(tmp_path, epochs=3)
    run_dir.mark_finished(tmp_path, CONFIG, 3, tmp_path / "checkpoints" / "step-000001")
    assert not run_dir.is_finished(tmp_path, CONFIG)  # CONFIG runs train.epochs, not 3
    longer = Config.from_dict({**DATA, "train": {**DATA["train"], "epochs": 9}})
    run_dir.start(tmp_path, longer, resumed_at=1)  # a resume may run longer
    assert run_dir.read_marker(tmp_path) is None
    assert [r["epoch"] for r in run_dir.read_metrics(tmp_path)] == [0]
    assert run_dir.read_record(tmp_path)["config"]["train"]["epochs"] == 9
    other = Config.from_dict({**DATA, "train": {**DATA["train"], "lr": 0.5}})
    with pytest.raises(RunDirError, match=r"holds another run: train\.lr: 0\.0003 there, 0\.5 now"):
        run_dir.start(tmp_path, other, resumed_at=1)


def test_the_pretrained_record_is_read_on_request_and_kept_by_a_resume(tmp_path):
    """The pretrained model's evaluation is logged first, as epoch -1: comparisons, which read the
    epochs, do not see it; the run's figures and summary ask for it; a resume keeps it."""
    write_run(tmp_path, epochs=3)
    text = (tmp_path / "metrics.jsonl").read_text()
    pretrained = {"epoch": run_dir.PRETRAINED_EPOCH, "eval/sharpness": 0.25}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(pretrained) + "\n" + text)
    assert [r["epoch"] for r in run_dir.read_metrics(tmp_path)] == [0, 1, 2]
    assert run_dir.read_metrics(tmp_path, pretrained=True)[0] == pretrained
    run_dir.start(tmp_path, CONFIG, resumed_at=1)
    assert [r["epoch"] for r in run_dir.read_metrics(tmp_path, pretrained=True)] == [-1, 0]


def test_the_marker_names_the_final_checkpoints_content(tmp_path):
    write_run(tmp_path)
    final = save_checkpoint(tmp_path / "checkpoints", CONFIG.train.epochs, state(2))
    run_dir.mark_finished(tmp_path, CONFIG, CONFIG.train.epochs, final)
    marker = run_dir.read_marker(tmp_path)
    assert run_dir.is_finished(tmp_path, CONFIG)
    assert marker["checkpoint"] == final.name
    resaved = save_checkpoint(tmp_path / "checkpoints", CONFIG.train.epochs, state(3))
    run_dir.mark_finished(tmp_path, CONFIG, CONFIG.train.epochs, resaved)
    assert run_dir.read_marker(tmp_path)["checkpoint_sha256"] != marker["checkpoint_sha256"]
    (tmp_path / run_dir.FINISHED).write_text('{"format": "mogo-run/1", "finger')
    with pytest.raises(RunDirError, match=r"finished\.json', the finished marker, is damaged"):
        run_dir.is_finished(tmp_path, CONFIG)
