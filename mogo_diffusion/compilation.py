"""The transformer compiled once, for every adapter role and batch size (``train.compile``).

:func:`compile_transformer` compiles the transformer's forward with ``torch.compile``
(``nn.Module.compile``, inductor) and a dynamic batch dimension. The trainer's adapter switches
(the old adapter merged into the weights for sampling, the reference model with the adapters off,
the evaluation EMA merged, the trained adapter fused for the loss;
:mod:`mogo_diffusion.models`) swap weight data and flags that no compiled guard reads, so the few
graphs of a run's first epochs (with and without gradients, in training and evaluation mode)
serve them all, at every batch size: nothing recompiles after them
(``tests/diffusion/test_compile.py`` proves it with ``torch.compiler.set_stance("fail_on_recompile")``).

The first compile takes minutes on a CPU; inductor keeps what it compiled on disk
(``TORCHINDUCTOR_CACHE_DIR``, by default ``/tmp/torchinductor_<user>``), so later runs on the same
machine, the runs of a study included, load it, though dynamo still traces the graphs again in
every new process (docs/benchmarks.rst, "Training speed", has the times).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from torch import nn

__all__ = ["AUTO_MIN_EPOCHS", "compile_transformer", "cpuinfo", "should_compile"]

AUTO_MIN_EPOCHS = 20
"""``train.compile: auto`` compiles runs of at least this many epochs: below it the first
compile (minutes on a CPU without a cache) costs more than it saves."""


def cpuinfo(key: str) -> str:
    """The value of the first ``key`` line of ``/proc/cpuinfo`` (``cpuinfo("vendor_id")`` is
    ``"GenuineIntel"`` or ``"AuthenticAMD"``), or ``""`` where it does not say."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return ""


def should_compile(
    setting: Literal["auto", "no", "yes"],
    epochs: int,
    device: str,
    precision: str,
    vendor: str | None = None,
) -> bool:
    """``train.compile`` resolved for a run of ``epochs`` on ``device`` (``"cpu"``, ``"cuda"``)
    under the resolved ``train.mixed_precision``; ``vendor`` defaults to the CPU's
    (:func:`cpuinfo`).

    ``"auto"`` compiles where it was measured to pay (docs/benchmarks.rst, "Training speed"), in
    runs of at least :data:`AUTO_MIN_EPOCHS` epochs: on an Intel CPU, on an AMD one under a
    bfloat16 autocast only (in float32 the gain there is small against a first compile of
    minutes), and on CUDA (a choice, not a measurement: no GPU has been lent to the project)."""
    if setting != "auto":
        return setting == "yes"
    if epochs < AUTO_MIN_EPOCHS:
        return False
    if device == "cuda" or precision == "bf16":
        return True
    return precision == "no" and (cpuinfo("vendor_id") if vendor is None else vendor) == "GenuineIntel"


def compile_transformer(transformer: nn.Module) -> None:
    """Compile ``transformer``'s forward in place, its batch dimension dynamic (the sampler's,
    the loss's and the evaluation's batch sizes share its graphs). Call it after the adapters and
    the attention processors are installed: they are part of the graphs."""
    transformer.compile(dynamic=True)
