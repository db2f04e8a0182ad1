"""The contract of a run directory (``train.out_dir``): which run it holds, who writes it, and when
that run is finished.

Beside ``config.yaml``, ``checkpoints/``, ``samples.png`` and ``curves.png``, a run directory holds:

* ``run.json``, the run's record, written when the run starts and again when it is resumed: its
  config and the :func:`fingerprint` of the run-defining part of it, the config but for
  :data:`RESUME_MAY_CHANGE` (what a resume may change). A directory that holds a run belongs to
  it: a fresh run into it is refused (:func:`start`), and only a run of the same fingerprint
  continues it.
* ``run.lock``, the claim (:func:`claim`): the process that trains into the directory holds an
  exclusive ``fcntl.flock`` on it while it runs. The kernel releases it when the process ends,
  however it ends, so a killed run leaves no stale claim. Where Python has no ``fcntl``
  (Windows), no claim is taken and :func:`claim` warns so: run one process per directory there.
* ``metrics.jsonl``, one JSON record per logged epoch, in increasing epochs: a run resumed at
  epoch ``e`` first keeps the records of the epochs before ``e`` only, so no epoch is logged
  twice, and :func:`read_metrics` drops a last line that a kill cut off, with a warning. The
  record of epoch ``e`` holds what epoch ``e`` measured and the evaluation after it; a fresh run
  first logs the pretrained model's evaluation as epoch :data:`PRETRAINED_EPOCH`.
* ``finished.json``, the marker (:func:`mark_finished`), written last and atomically, after the
  final checkpoint and the figures: the fingerprint, the epochs trained, and the final
  checkpoint's name and digest. A run without it is unfinished, however far its metrics go.

A finished run also has a compact form (:func:`compact`): its record, its marker, the fields of
its metrics that comparisons read (:data:`KEPT_METRICS`) and its final evaluation's means, a few
kilobytes where the directory holds megabytes of checkpoints. :func:`write_packed` writes the
compact runs of a comparison into one xz-compressed JSON file (``runs.json.xz``), which
:func:`read_packed` reads back: what a comparison commits instead of its run directories.

Paths to files shipped in the ``mogo_diffusion`` package are recorded relative to it
(``mogo_diffusion/shapes/pipeline``; :func:`portable`), so a run directory means the same in every
checkout; any other path is compared as written.

>>> from mogo_diffusion.config import Config
>>> config = Config.from_dict({"rewards": [{"name": "sharpness"}], "train": {"epochs": 3}})
>>> longer = Config.from_dict({"rewards": [{"name": "sharpness"}], "train": {"epochs": 9}})
>>> fingerprint(config) == fingerprint(longer)  # a resume may run it longer
True
>>> slower = Config.from_dict({"rewards": [{"name": "sharpness"}], "train": {"lr": 0.5}})
>>> defining_differences(config.to_dict(), slower.to_dict())
[('train.lr', 0.0003, 0.5)]
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mogo_diffusion.checkpoint import checkpoint_digest, list_checkpoints
from mogo_diffusion.config import Config

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

__all__ = [
    "CONFLICT_METRICS",
    "FINISHED",
    "KEPT_METRICS",
    "LOCK",
    "METRICS",
    "PACKED_FORMAT",
    "PRETRAINED_EPOCH",
    "RECORD",
    "RESUME_MAY_CHANGE",
    "RunDirError",
    "append_metrics",
    "claim",
    "claimed_by",
    "compact",
    "config_differences",
    "defining_differences",
    "fingerprint",
    "finishes",
    "holds_run",
    "is_finished",
    "mark_finished",
    "portable",
    "read_marker",
    "read_metrics",
    "read_packed",
    "read_record",
    "start",
    "write_json",
    "write_packed",
]

RECORD = "run.json"
"""The file of the run's record, its config and fingerprint."""
LOCK = "run.lock"
"""The file a training process holds its claim on (its pid inside, for the messages of others)."""
METRICS = "metrics.jsonl"
"""One JSON record per logged epoch."""
PRETRAINED_EPOCH = -1
"""The epoch of the metrics record of the pretrained model's evaluation, logged before epoch 0's
record (which holds the evaluation after epoch 0's training)."""
FINISHED = "finished.json"
"""The marker of a finished run, written last."""
_FORMAT = "mogo-run/1"
_RUN_FILES = (RECORD, FINISHED, "config.yaml", METRICS)
_OUTPUTS = (*_RUN_FILES, "samples.png", "curves.png")
_FOLDERS = ("checkpoints", "trackers")
_PACKAGE = Path(__file__).resolve().parent
_ABSENT = "(absent)"

RESUME_MAY_CHANGE: frozenset[str] = frozenset(
    {"train.epochs", "train.eval_every", "train.checkpoint_every", "train.log_every", "train.log_with",
     "train.out_dir", "train.reward_threads", "sampling.eval_prompts", "sampling.eval_num_steps"}
)  # fmt: skip
"""The config fields (``section.key``) a resumed run may set apart from its checkpoint's: what is
logged, evaluated and saved, and how long it runs. Every other field defines the run
(:func:`fingerprint`)."""


class RunDirError(RuntimeError):
    """A run directory holds another run, is claimed by another process, or is damaged; the
    message names the directory (or file) and what to do."""


def config_differences(saved: Any, current: Any, field: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted field, saved value, current value)`` wherever two ``Config.to_dict()`` trees differ
    (a list of another length differs as a whole)."""
    if isinstance(saved, dict) and isinstance(current, dict):
        keys = [*saved, *(key for key in current if key not in saved)]
        return [
            difference
            for key in keys
            for difference in config_differences(
                saved.get(key, _ABSENT), current.get(key, _ABSENT), f"{field}.{key}" if field else str(key)
            )
        ]
    if isinstance(saved, list | tuple) and isinstance(current, list | tuple) and len(saved) == len(current):
        return [
            difference
            for i, (a, b) in enumerate(zip(saved, current, strict=True))
            for difference in config_differences(a, b, f"{field}.{i}")
        ]
    return [] if saved == current else [(field, saved, current)]


def _may_change(field: str) -> bool:
    return any(field == f or field.startswith(f + ".") for f in RESUME_MAY_CHANGE)


def defining_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """:func:`config_differences` of two ``Config.to_dict()`` trees (in :func:`portable` form) in
    the fields that define a run, those not in :data:`RESUME_MAY_CHANGE`."""
    return [d for d in config_differences(portable(saved), portable(current)) if not _may_change(d[0])]


def portable(value: Any) -> Any:
    """``value`` (plain data) with every absolute path into the ``mogo_diffusion`` package
    written relative to it, ``mogo_diffusion/<path inside>``: the same in every checkout."""
    if isinstance(value, dict):
        return {key: portable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [portable(item) for item in value]
    if isinstance(value, str) and os.path.isabs(value) and Path(value).is_relative_to(_PACKAGE):
        return (Path(_PACKAGE.name) / Path(value).relative_to(_PACKAGE)).as_posix()
    return value


def fingerprint(config: Config | Mapping[str, Any]) -> str:
    """The SHA-256 (hex) of the run-defining part of ``config`` (a
    :class:`~mogo_diffusion.config.Config` or its ``to_dict()``): every field but
    :data:`RESUME_MAY_CHANGE`, paths in :func:`portable` form. Two configs have the same
    fingerprint exactly when a resume of one may continue the other."""
    data = portable(config.to_dict() if isinstance(config, Config) else dict(config))  # a fresh tree
    for field in RESUME_MAY_CHANGE:  # all of them "section.key"
        section, key = field.split(".")
        if isinstance(data.get(section), dict):
            data[section].pop(key, None)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# ---- the claim ----------------------------------------------------------------------------------


@contextmanager
def claim(directory: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``directory``'s claim (creating the directory) for the ``with`` block: one process at
    a time; released when the block ends or the process dies.

    Raises:
        RunDirError: another process holds it; the message names its pid.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        warnings.warn(
            f"no fcntl on this platform: {str(directory)!r} is not claimed, and a second run started "
            "on it would not be stopped",
            stacklevel=3,
        )
        yield
        return
    with (directory / LOCK).open("a+") as handle:
        if (holder := _lock(handle)) is not None:
            raise RunDirError(
                f"{str(directory)!r} is in use by another process (pid {holder}): wait until it ends, "
                "or use another directory"
            )
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def claimed_by(directory: str | os.PathLike[str]) -> str | None:
    """The pid (as its lock file says) of the process that holds ``directory``'s claim, or None
    when no process does (always None without ``fcntl``)."""
    lock = Path(directory) / LOCK
    if fcntl is None or not lock.is_file():
        return None
    with lock.open("a+") as handle:
        return _lock(handle)  # closing the file releases a lock taken here


def _lock(handle: Any) -> str | None:
    """Take the exclusive lock of the open lock file ``handle``: None when taken, else the pid
    its holder wrote."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        return handle.read().strip() or "?"
    return None


# ---- the record and the marker -------------------------------------------------------------------


def write_json(path: str | os.PathLike[str], value: Any) -> None:
    """Write ``value`` as JSON to ``path`` atomically: a kill leaves the old file or the new one."""
    path = Path(path)
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(partial, path)


def _read_json(path: Path, what: str, fields: tuple[str, ...]) -> dict[str, Any] | None:
    """The object in ``path``, None if there is no such file.

    Raises:
        RunDirError: the file is not a JSON object of this format with ``fields``."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise RunDirError(f"{str(path)!r}, the {what}, is damaged: {error}") from None
    if not isinstance(value, dict) or value.get("format") != _FORMAT:
        raise RunDirError(f"{str(path)!r} is not a {what} of format {_FORMAT}")
    if missing := [field for field in fields if field not in value]:
        raise RunDirError(f"{str(path)!r}, the {what}, lacks {', '.join(missing)}")
    return value


def read_record(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run record of ``directory`` (``{"format", "fingerprint", "config"}``, the config in
    :func:`portable` form), or None when it has none.

    Raises:
        RunDirError: the record is damaged."""
    return _read_json(Path(directory) / RECORD, "run record", ("fingerprint", "config"))


def read_marker(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The finished marker of ``directory`` (``{"format", "fingerprint", "epochs", "checkpoint",
    "checkpoint_sha256"}``), or None when the run is unfinished.

    Raises:
        RunDirError: the marker is damaged."""
    fields = ("fingerprint", "epochs", "checkpoint", "checkpoint_sha256")
    return _read_json(Path(directory) / FINISHED, "finished marker", fields)


def finishes(marker: Mapping[str, Any] | None, config: Config) -> bool:
    """Whether the finished ``marker`` (:func:`read_marker`; None: unfinished) is that of the run of
    ``config`` (its fingerprint) after ``config.train.epochs`` epochs."""
    return (
        marker is not None
        and marker["fingerprint"] == fingerprint(config)
        and marker["epochs"] == config.train.epochs
    )


def is_finished(directory: str | os.PathLike[str], config: Config) -> bool:
    """Whether ``directory`` holds the run of ``config`` (its fingerprint) finished after
    ``config.train.epochs`` epochs.

    Raises:
        RunDirError: the marker is damaged."""
    return finishes(read_marker(directory), config)


def mark_finished(directory: str | os.PathLike[str], config: Config, epochs: int, checkpoint: Path) -> None:
    """Mark ``directory``'s run of ``config`` finished after ``epochs`` epochs, ``checkpoint``
    its final checkpoint; call it last, when every output of the run is written."""
    write_json(
        Path(directory) / FINISHED,
        {"format": _FORMAT, "fingerprint": fingerprint(config), "epochs": epochs,
         "checkpoint": checkpoint.name, "checkpoint_sha256": checkpoint_digest(checkpoint)},
    )  # fmt: skip


def holds_run(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds (part of) a run: a record, marker, config, metrics or checkpoint."""
    directory = Path(directory)
    return any((directory / name).is_file() for name in _RUN_FILES) or bool(
        list_checkpoints(directory / "checkpoints")
    )


def _progress(directory: Path) -> str:
    """What ``directory``'s run has done, in words, for messages."""
    try:
        marker = read_marker(directory)
    except RunDirError as error:
        return str(error)
    if marker is not None:
        return f"finished, train.epochs={marker['epochs']}"
    checkpoints = list_checkpoints(directory / "checkpoints")
    return f"unfinished, latest checkpoint {checkpoints[-1][1].name}" if checkpoints else "unfinished"


def start(
    directory: str | os.PathLike[str], config: Config, *, resumed_at: int | None, overwrite: bool = False
) -> None:
    """Make ``directory`` the run of ``config`` before the run writes anything else (under
    :func:`claim`): a fresh run (``resumed_at`` None) needs a directory that holds no run, or
    ``overwrite``, which first deletes the run it holds (its record, marker, config, metrics,
    figures, checkpoints and trackers; other files stay); a run resumed at epoch ``resumed_at``
    needs the fingerprint of the run the directory holds, if any, and drops its finished marker and
    the metrics records of epoch ``resumed_at`` on. Then the record is (re)written.

    Raises:
        RunDirError: the directory holds another run (or a damaged record); the message names it
            and what to do.
    """
    directory = Path(directory)
    if overwrite:
        for name in _OUTPUTS:
            (directory / name).unlink(missing_ok=True)
        for name in _FOLDERS:
            shutil.rmtree(directory / name, ignore_errors=True)
    elif resumed_at is None and holds_run(directory):
        raise RunDirError(
            f"{str(directory)!r} holds a run already ({_progress(directory)}): continue it with "
            "--resume latest, train this run in another train.out_dir, or pass --overwrite to delete "
            "that run and start this one"
        )
    elif resumed_at is not None:
        record = read_record(directory)
        if record is not None and record["fingerprint"] != fingerprint(config):
            differences = defining_differences(record["config"], config.to_dict())
            raise RunDirError(
                f"{str(directory)!r} holds another run: "
                + "; ".join(f"{f}: {saved!r} there, {now!r} now" for f, saved, now in differences)
                + ". Resume a checkpoint of that run into it, or train this one in another train.out_dir"
            )
        (directory / FINISHED).unlink(missing_ok=True)
        _keep_metrics_before(directory, resumed_at)
    write_json(
        directory / RECORD,
        {"format": _FORMAT, "fingerprint": fingerprint(config), "config": portable(config.to_dict())},
    )


# ---- metrics.jsonl --------------------------------------------------------------------------------


def append_metrics(directory: str | os.PathLike[str], record: Mapping[str, Any]) -> None:
    """Append one epoch's ``record`` (with its ``"epoch"``) to ``directory/metrics.jsonl``."""
    with (Path(directory) / METRICS).open("a") as file:
        file.write(json.dumps(record) + "\n")


def read_metrics(directory: str | os.PathLike[str], *, pretrained: bool = False) -> list[dict[str, Any]]:
    """The records of ``directory/metrics.jsonl``, one per logged epoch, in increasing epochs; with
    ``pretrained``, the pretrained model's evaluation (the record of epoch
    :data:`~mogo_diffusion.run_dir.PRETRAINED_EPOCH`) first, where the run logged one. Without,
    the epochs' alone: what comparisons read.

    A last line that is not a whole record (the run was killed while writing it) is left out with
    a warning. A record of an epoch at or before its predecessor's (a run resumed before runs kept
    one record per epoch) replaces the records from that epoch on, with a warning: the later
    attempt of an epoch is the one its checkpoints continue.

    Raises:
        FileNotFoundError: there is no metrics file.
        RunDirError: a line before the last is not a record (names the file and line).
    """
    path = Path(directory) / METRICS
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {str(path)!r}")
    lines = path.read_text().splitlines()
    records: list[dict[str, Any]] = []
    replaced: set[int] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            epoch = record["epoch"]
            if type(epoch) is not int:
                raise TypeError(f"epoch {epoch!r} is not an integer")
        except (ValueError, TypeError, KeyError) as error:
            if number == len(lines):
                warnings.warn(
                    f"{str(path)!r}: its last line is cut off (the run was stopped while writing it), "
                    "and left out",
                    stacklevel=2,
                )
                break
            raise RunDirError(f"{str(path)!r}: line {number} is not a metrics record: {error}") from None
        while records and records[-1]["epoch"] >= epoch:
            replaced.add(records.pop()["epoch"])
        records.append(record)
    if replaced:
        warnings.warn(
            f"{str(path)!r} logs epochs {sorted(replaced)} more than once (a run resumed by an earlier "
            "version): the last attempt of each is read",
            stacklevel=2,
        )
    return records if pretrained else [record for record in records if record["epoch"] != PRETRAINED_EPOCH]


def _keep_metrics_before(directory: Path, epoch: int) -> None:
    """Rewrite ``directory/metrics.jsonl`` (atomically) with the records of the epochs before ``epoch``."""
    path = directory / METRICS
    if not path.is_file():
        return
    kept = [record for record in read_metrics(directory, pretrained=True) if record["epoch"] < epoch]
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text("".join(json.dumps(record) + "\n" for record in kept))
    os.replace(partial, path)


# ---- the compact form ------------------------------------------------------------------------------

CONFLICT_METRICS: tuple[str, ...] = ("conflict_rate", "worst_cosine_weighted_sum", "worst_cosine_marble")
"""The conflict statistics a harmonized run logs each epoch (:class:`mogo.ConflictReport`), of the
micro-batch's own gradients; with ``gram: cross_fitted`` also each with the suffix ``_cross``:
across the micro-batch's two halves, free of the bias of a gradient's own noise."""

KEPT_METRICS: tuple[str, ...] = (
    "epoch", "seconds", "images_per_second", *CONFLICT_METRICS,
    *(f"{name}_cross" for name in CONFLICT_METRICS), "eval/", "alpha/",
)  # fmt: skip
"""The metrics a compact run keeps of each epoch (a name ending in ``/``: every metric it starts):
what comparisons read, held-out means for the curves, times for the throughput, weights and
conflict statistics; the training rewards, losses and diagnostics stay in the run directory."""

PACKED_FORMAT = "mogo-runs/1"
"""The format tag of a packed file (:func:`write_packed`)."""


def _kept(name: str) -> bool:
    return any(name.startswith(kept) if kept.endswith("/") else name == kept for kept in KEPT_METRICS)


def compact(directory: str | os.PathLike[str], final: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The compact form of the run in ``directory``: ``{"record", "marker"}`` (None for a run
    written before records, or unfinished), ``"metrics"`` (:func:`read_metrics`, each record cut
    to :data:`KEPT_METRICS`) and ``"final"``, the run's final evaluation ``final`` (an
    :func:`~mogo_diffusion.evaluate.evaluate_run` result) cut to what is needed to judge and check
    it: its means, the digests of its checkpoint and prompts, and its numbers of prompts and steps.

    Raises:
        FileNotFoundError: the run has no metrics.
        RunDirError: its record, marker or metrics are damaged.
    """
    kept = ("metrics", "checkpoint_sha256", "prompts_sha256", "num_prompts", "eval_num_steps")
    return {
        "record": read_record(directory),
        "marker": read_marker(directory),
        "metrics": [{k: v for k, v in record.items() if _kept(k)} for record in read_metrics(directory)],
        "final": None if final is None else {key: final.get(key) for key in kept},
    }


def write_packed(path: str | os.PathLike[str], runs: Mapping[str, Mapping[str, Any]]) -> None:
    """Write the compact ``runs`` (a name, the run's directory relative to the comparison's
    ``runs/``, to its :func:`compact` form) to ``path`` as xz-compressed JSON, atomically; the
    same runs give the same bytes."""
    path = Path(path)
    text = json.dumps({"format": PACKED_FORMAT, "runs": dict(runs)}, sort_keys=True, separators=(",", ":"))
    partial = path.with_name(f"{path.name}.partial")
    partial.write_bytes(lzma.compress(text.encode(), preset=9 | lzma.PRESET_EXTREME))
    os.replace(partial, path)


def read_packed(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The compact runs of the packed file ``path`` (:func:`write_packed`), by name; empty when
    there is no such file.

    Raises:
        RunDirError: the file is damaged or not a packed file (names it).
    """
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        value = json.loads(lzma.decompress(path.read_bytes()))
    except (lzma.LZMAError, ValueError, UnicodeDecodeError) as error:
        raise RunDirError(f"{str(path)!r}, a packed file of runs, is damaged: {error}") from None
    if (
        not isinstance(value, dict)
        or value.get("format") != PACKED_FORMAT
        or not isinstance(value.get("runs"), dict)
    ):
        raise RunDirError(f"{str(path)!r} is not a packed file of runs of format {PACKED_FORMAT}")
    runs, fields = value["runs"], ("record", "marker", "metrics", "final")
    for name, run in runs.items():
        if not isinstance(run, dict) or (missing := [f for f in fields if f not in run]):
            raise RunDirError(f"{str(path)!r}: the run {name!r} is not a compact run (it lacks {missing})")
    return runs
