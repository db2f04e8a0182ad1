"""SD3.5-Medium's size on a CPU: the trainer's own code on the real transformer, each phase's time
and peak memory beside ``--check``'s estimate.

Nothing is downloaded. The transformer is SD3.5-M's, built from
:data:`mogo_diffusion.preflight.SD35M_TRANSFORMER` with random weights in bfloat16 (2.24B
parameters; ``benchmarks/gpu_check.py`` builds it); the text encoders and the VAE are tiny random
stand-ins of SD3.5's output widths (:func:`mogo_diffusion.models.tiny_pipeline`: 77 CLIP and 128
T5 tokens of 4096, pooled 2048, a VAE of scale factor 8), so the images mean nothing but have
the configs' size. The run is ``configs/sd35m_marble.yaml`` scaled to a CPU (:data:`OVERRIDES`:
one group of 2 images at its 512 px, 3 sampler steps, one image and one timestep a step) with
five rule-based rewards, through :class:`mogo_diffusion.train.Trainer` (given the pipeline):

1. build the transformer, the stand-ins and the trainer (the recipe's LoRA, rank 32);
2. epoch 0 of amortized MARBLE (N = 10): sample, score the K = 5 rewards, step 1 (a
   harmonization: K + 1 gradients with the KL term's, min-norm weights) and step 2 (amortized:
   one backward);
3. save a checkpoint, train epoch 1 (two amortized steps);
4. a fresh trainer on a fresh pipeline resumes the checkpoint and trains epoch 1: its adapters,
   evaluation EMA and MARBLE state must equal the first trainer's bit for bit;
5. the checkpoint's ``lora/`` loaded by diffusers' ``load_lora_weights`` into a fresh pipeline of
   the real transformer: its adapter weights must equal the trainer's and its velocity match;
6. a weighted-sum step on epoch 0's samples, on that pipeline (the loaded LoRA unloaded).

Each phase's wall time and peak resident memory (``VmHWM``, reset at each phase's start, when the
allocator's free pages have been given back), and the estimate of
:func:`mogo_diffusion.preflight.estimate_memory` term by term beside what was measured: the
weights (resident memory of the built pipeline), the LoRA and AdamW state (the bytes of its
tensors), the K + 1 gradient buffers (what the harmonization step keeps, less its gradient and
AdamW moments) and the merged adapter with the activations (the amortized step's peak over its
start).
Writes ``real_size.json`` and ``real_size.rst`` (the tables of docs/benchmarks.rst) to ``--out``.

    python benchmarks/real_size.py --out docs/_generated    # 11 to 13 minutes on 2 cores, 12 GB
    python benchmarks/real_size.py --tiny --out /tmp/tiny   # the same code on the tiny SD3 (a test)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
from diffusers import StableDiffusion3Pipeline
from peft.utils import get_peft_model_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gpu_check import build_transformer
from benchmarks.machine import describe
from mogo_diffusion import models
from mogo_diffusion.config import Config, load_config
from mogo_diffusion.preflight import MemoryEstimate, estimate_memory
from mogo_diffusion.train import Batch, MicroBatch, Trainer

ROOT = Path(__file__).resolve().parent.parent
REWARDS = ["jpeg_compressibility", "sharpness", "color_match", "shapes_color", "shapes_shape"]
OVERRIDES = [
    f"rewards=[{', '.join(f'{{name: {name}, weight: 1.0}}' for name in REWARDS)}]",
    "sampling.prompts=shapes:train",
    "sampling.eval_prompts=null",
    "sampling.group_size=2",
    "sampling.prompts_per_epoch=1",
    "sampling.num_steps=3",
    "sampling.batch_size=2",
    "train.batch_size=1",
    "train.steps_per_epoch=2",
    "train.timestep_fraction=0.34",
]
"""``configs/sd35m_marble.yaml`` on a CPU: five rule-based rewards on the shapes world's prompts,
one group of 2 images sampled in 3 steps, each image one step of one trained timestep."""
MARBLE = ["strategy.grad_mode=sequential"]
"""MARBLE's K + 1 gradients one backward at a time (``auto`` takes the batched backward, which on
the CPU keeps K + 1 rows of the backward's intermediates: see docs/benchmarks.rst)."""
TINY = [
    "model.dtype=float32",
    "model.lora_rank=4",
    "model.lora_alpha=8",
    "model.max_sequence_length=16",
    "sampling.resolution=32",
    "train.mixed_precision='no'",
]
"""What ``--tiny`` changes besides the transformer: the tiny model's sizes."""
GB = 1e9


# ---- memory of this process ----------------------------------------------------------------------


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``: resident now, ``VmHWM``: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Start ``VmHWM`` afresh at the resident memory now (Linux's ``clear_refs``, mode 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def _release_free_memory() -> None:
    """Collect garbage and give the allocator's free pages back (glibc's ``malloc_trim``), so that
    resident memory is live memory: glibc keeps freed blocks below its mmap threshold (up to
    32 MB) in its heap, where they stay resident."""
    gc.collect()
    with suppress(OSError, AttributeError):  # not glibc: resident memory includes its free pages
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class Phases:
    """Wall time and peak resident memory of named phases, one at a time: a phase started inside
    another is part of it."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._depth = 0
        self._open: tuple[str, float, int] = ("", 0.0, 0)

    def start(self, name: str) -> None:
        self._depth += 1
        if self._depth == 1:
            _release_free_memory()
            _reset_peak()
            self._open = (name, time.perf_counter(), _status("VmRSS"))

    def stop(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            name, started, resident = self._open
            seconds, peak = time.perf_counter() - started, _status("VmHWM")
            _release_free_memory()
            row = {"phase": name, "seconds": seconds, "start_bytes": resident, "end_bytes": _status("VmRSS"),
                   "peak_bytes": peak}  # fmt: skip
            self.rows.append(row)
            print(f"{name}: {row['seconds']:.1f} s, peak {row['peak_bytes'] / GB:.2f} GB", file=sys.stderr)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop()

    def row(self, name: str) -> dict[str, Any]:
        return next(row for row in self.rows if row["phase"] == name)


class MeasuredTrainer(Trainer):
    """The trainer, the steps of its epochs measured: ``sample``, ``score`` and each optimizer step
    (``gradients`` then ``update``), named by ``step_names`` in order; keeps the last scored batch."""

    phases: Phases
    step_names: list[str]
    last_batch: Batch

    def sample(self, epoch: int) -> Batch:
        s = self.config.sampling
        images = s.prompts_per_epoch * s.group_size
        with self.phases(f"sample {images} images, {s.resolution} px, {s.num_steps} steps"):
            return super().sample(epoch)

    def score(self, batch: Batch) -> Batch:
        with self.phases(f"score K = {len(self.names)} rewards"):
            self.last_batch = super().score(batch)
        return self.last_batch

    def gradients(self, batch: Batch, parts: list[MicroBatch]) -> torch.Tensor:
        self.phases.start(self.step_names.pop(0) if self.step_names else "step")
        return super().gradients(batch, parts)

    def update(self) -> None:
        super().update()
        self.phases.stop()


def measured(config: Config, pipeline: StableDiffusion3Pipeline, phases: Phases, steps: list[str]) -> Trainer:
    trainer = MeasuredTrainer.from_config(config, pipeline=pipeline)
    trainer.phases, trainer.step_names = phases, steps
    return trainer


# ---- the run -------------------------------------------------------------------------------------


def build_pipeline(args: argparse.Namespace) -> StableDiffusion3Pipeline:
    """The transformer (seeded: every build is the same) in a pipeline of tiny stand-ins."""
    transformer = build_transformer(args.tiny, torch.device("cpu"), seed=args.seed)
    if args.tiny:
        return models.tiny_pipeline(transformer, vae_scale_factor=4, clip_length=16, t5_length=16)
    return models.tiny_pipeline(transformer)  # SD3.5's widths and 77 CLIP tokens, a VAE of scale 8


def frozen_values(pipeline: StableDiffusion3Pipeline) -> int:
    modules = [m for m in pipeline.components.values() if isinstance(m, torch.nn.Module)]
    return sum(t.numel() for m in modules for t in (*m.parameters(), *m.buffers()))


def state(trainer: Trainer) -> dict[str, list[torch.Tensor]]:
    """What a resumed run must reproduce: the adapters, the evaluation EMA, the MARBLE state."""
    amortizer = trainer.optimizer.state_dict()["mogo"]["amortizer"]
    return {
        "trained": [p.detach().clone() for p in trainer.params],
        "old": [p.detach().clone() for p in models.lora_parameters(trainer.transformer, models.OLD)],
        "eval_ema": [t.clone() for t in trainer.eval_ema.shadow_params],
        "amortizer": [torch.as_tensor(value) for _, value in sorted(amortizer.items())],
    }


def step_state_bytes(trainer: Trainer) -> int:
    """The bytes that the first optimizer step allocates and keeps: the gradient, AdamW's moments."""
    moments = [value for s in trainer.optimizer.state.values() for value in s.values()]
    tensors = [p.grad for p in trainer.params if p.grad is not None]
    return sum(t.nbytes for t in [*tensors, *moments] if isinstance(t, torch.Tensor))


def lora_state_bytes(trainer: Trainer) -> int:
    """The bytes of the LoRA and AdamW state: trained (and its gradient), old, evaluation EMA, the
    optimizer's moments."""
    tensors = [
        *trainer.params,
        *models.lora_parameters(trainer.transformer, models.OLD),
        *trainer.eval_ema.shadow_params,
    ]
    return sum(t.nbytes for t in tensors) + step_state_bytes(trainer)


def velocity(transformer: torch.nn.Module, seed: int) -> torch.Tensor:
    """The transformer's velocity (its active adapter's) on fixed small random inputs (64 image
    tokens, 8 text tokens)."""
    c = transformer.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, c.in_channels, 16, 16, generator=g).to(transformer.dtype)
    embeds = torch.randn(1, 8, c.joint_attention_dim, generator=g).to(transformer.dtype)
    pooled = torch.randn(1, c.pooled_projection_dim, generator=g).to(transformer.dtype)
    with torch.no_grad():
        return transformer(x, embeds, pooled, torch.tensor([500.0]), return_dict=False)[0].float()


def weighted_sum_step(trainer: Trainer, batch: Batch, seed: int) -> None:
    """One optimizer step of ``trainer`` on the first local row of ``batch`` at one timestep."""
    advantages = trainer.advantages(batch, 0)[batch.local]
    g = torch.Generator().manual_seed(seed)
    index = torch.tensor([0])
    noise = torch.randn((1, *batch.latents[index].shape), generator=g)
    trainer.gradients(batch, [MicroBatch(index, advantages[index], [0], noise)])
    trainer.update()


def run(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    overrides = [
        *OVERRIDES,
        *(TINY if args.tiny else []),
        f"train.out_dir={out_dir}",
        f"train.seed={args.seed}",
    ]
    config = load_config(ROOT / "configs" / "sd35m_marble.yaml", [*overrides, *MARBLE])
    weighted = load_config(ROOT / "configs" / "sd35m_weighted_sum.yaml", overrides)
    phases = Phases()
    harmonization, amortized = "MARBLE step 1: harmonization", "MARBLE step 2: amortized"

    with phases("build the transformer and the stand-ins"):
        pipeline = build_pipeline(args)
    frozen, scale = frozen_values(pipeline), pipeline.vae_scale_factor
    with phases("build the trainer (LoRA adapters)"):
        first = measured(config, pipeline, phases, [harmonization, amortized])
    first.train_epoch(0)
    lora_bytes, step_bytes = lora_state_bytes(first), step_state_bytes(first)
    estimate = estimate_memory(config, first.transformer, frozen, scale)
    first.epoch = 1
    with phases("save a checkpoint"):
        checkpoint = first.save()
    with phases("epoch 1: sample, score, 2 amortized steps"):
        first.train_epoch(1)
    expected = state(first)
    del first, pipeline

    with phases("resume on a fresh pipeline"):
        second = measured(config, build_pipeline(args), phases, [])
        second.resume(checkpoint)
    exported = {key: t.clone() for key, t in get_peft_model_state_dict(second.transformer).items()}
    with models.adapter(second.transformer, models.TRAINED):
        trained_velocity = velocity(second.transformer, args.seed)  # the checkpoint's adapter
    with phases("resumed epoch 1"):
        second.train_epoch(1)
    resumed = state(second)
    batch = second.last_batch
    del second

    fresh = build_pipeline(args)
    with phases("load_lora_weights into a fresh pipeline, a forward"):
        fresh.load_lora_weights(checkpoint / "lora")
        loaded_velocity = velocity(fresh.transformer, args.seed)
    (name,) = fresh.transformer.peft_config
    loaded = get_peft_model_state_dict(fresh.transformer, adapter_name=name)
    fresh.unload_lora_weights()
    with phases("build a weighted-sum trainer"):
        summed = measured(weighted, fresh, phases, ["weighted-sum step"])
    weighted_sum_step(summed, batch, args.seed)
    del summed, fresh
    return {
        "machine": describe(),
        "transformer": "tiny smoke" if args.tiny else "SD3.5-M (SD35M_TRANSFORMER, random bfloat16 weights)",
        "overrides": [*overrides[:-2], *MARBLE],
        "phases": phases.rows,
        "resumed_bit_for_bit": {
            key: all(torch.equal(a, b) for a, b in zip(expected[key], resumed[key], strict=True))
            for key in resumed
        },
        "lora_loaded": {
            "dtype": str(next(iter(loaded.values())).dtype),
            # the checkpoint's float32 adapter, in the dtype diffusers loads it in
            "tensors_equal": loaded.keys() == exported.keys()
            and all(torch.equal(loaded[key], t.to(loaded[key].dtype)) for key, t in exported.items()),
            "velocity_max_difference": float((loaded_velocity - trained_velocity).abs().max()),
            "velocity_max": float(trained_velocity.abs().max()),
        },
        "estimate": {term: getattr(estimate, term) for term in MemoryEstimate.TERMS},
        "counted": estimate.counted,
        "measured": measured_terms(phases, lora_bytes, step_bytes, harmonization, amortized),
    }


def measured_terms(
    phases: Phases, lora_bytes: int, step_bytes: int, harmonization: str, amortized: str
) -> dict[str, int]:
    """The estimate's terms as measured (see the module)."""
    build, first, step = phases.rows[0], phases.row(harmonization), phases.row(amortized)
    return {
        "weights": build["end_bytes"] - build["start_bytes"],
        "lora": lora_bytes,
        "buffers": first["end_bytes"] - first["start_bytes"] - step_bytes,
        "merged and activations": step["peak_bytes"] - step["start_bytes"],
        "peak": max(row["peak_bytes"] for row in phases.rows),
    }


# ---- the tables ----------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]], align: str) -> list[str]:
    """An RST simple table, each column aligned by ``align`` (``"l"`` left, ``"r"`` right)."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    rule = "  ".join("=" * width for width in widths)

    def line(cells: list[str]) -> str:
        columns = zip(cells, widths, align, strict=True)
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in columns).rstrip()

    return [rule, line(header), rule, *map(line, rows), rule]


MEASURED_AS = {
    "weights": "resident memory of the built pipeline",
    "lora": "bytes of the trainer's LoRA, gradient, AdamW, old, EMA tensors",
    "buffers": "kept by the harmonization step, less its gradient and AdamW moments",
    "merged and activations": "amortized step's peak over its start",
    "peak": "peak resident memory of the run",
}


def rst(result: dict[str, Any]) -> str:
    """The tables of docs/benchmarks.rst: the phases, then the estimate beside the measurement."""
    phases = [
        [
            row["phase"],
            f"{row['seconds']:.1f}",
            f"{row['start_bytes'] / GB:.2f}",
            f"{row['peak_bytes'] / GB:.2f}",
        ]
        for row in result["phases"]
    ]
    total = sum(row["seconds"] for row in result["phases"])
    phases.append(["all phases", f"{total:.0f}", "", f"{result['measured']['peak'] / GB:.2f}"])
    estimate, measured = result["estimate"], result["measured"]
    terms = [
        ["weights", estimate["weights"], measured["weights"], "weights"],
        ["LoRA and AdamW", estimate["lora"], measured["lora"], "lora"],
        ["gradient buffers", estimate["buffers"], measured["buffers"], "buffers"],
        ["merged adapter + activations", estimate["merged"] + estimate["activations"],
         measured["merged and activations"], "merged and activations"],
        ["all terms; the peak", sum(estimate.values()), measured["peak"], "peak"],
    ]  # fmt: skip
    loaded, same = result["lora_loaded"], result["resumed_bit_for_bit"]
    lines = [
        f"Measured {result['machine']}; {result['transformer']}.",
        "",
        *_table(["phase", "seconds", "start GB", "peak GB"], phases, "lrrr"),
        "",
        *_table(
            ["term", "estimate GB", "measured GB", "measured as"],
            [[name, f"{e / GB:.2f}", f"{m / GB:.2f}", MEASURED_AS[key]] for name, e, m, key in terms],
            "lrrl",
        ),
        "",
        f"Resumed bit for bit: {', '.join(f'{key} {value}' for key, value in same.items())}. The "
        f"exported LoRA loaded by ``load_lora_weights`` (as {loaded['dtype']}): tensors equal "
        f"{loaded['tensors_equal']}; its velocity differs from the trainer's by at most "
        f"{loaded['velocity_max_difference']:.3g} (largest value {loaded['velocity_max']:.3g}).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny", action="store_true", help="the tiny SD3 transformer (a test of this script)"
    )
    parser.add_argument("--out", type=Path, default=Path("."), help="where real_size.json and .rst go")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="real_size_") as out_dir:
        result = run(args, Path(out_dir))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "real_size.json").write_text(json.dumps(result, indent=2))
    (args.out / "real_size.rst").write_text(rst(result))
    print(rst(result))
    return result


if __name__ == "__main__":
    main()
