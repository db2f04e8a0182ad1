"""The transformer compiled once, for every adapter role and batch size (``train.compile``).

:func:`compile_transformer` compiles the transformer's forward with ``torch.compile``
(``nn.Module.compile``, inductor) and a dynamic batch dimension. The trainer's adapter switches
(the old adapter merged into the weights for sampling, the reference model with the adapters off,
the evaluation EMA merged, the trained adapter fused for the loss;
:mod:`mogo_diffusion.models`) swap weight data and flags that no compiled guard reads, so one
graph without gradients (sampling, old and reference velocities) and one with them (the trained
velocity) serve them all, at every batch size: nothing recompiles after the first pass over them
(``tests/diffusion/test_compile.py`` proves it with ``torch.compiler.set_stance("fail_on_recompile")``).

The first compile of each graph takes tens of seconds on a CPU; inductor keeps what it compiled
on disk (``TORCHINDUCTOR_CACHE_DIR``, by default ``/tmp/torchinductor_<user>``), so later runs on
the same machine, the runs of a study included, load it in seconds (docs/benchmarks.rst,
"Training speed").
"""

from __future__ import annotations

from typing import Literal

from torch import nn

__all__ = ["AUTO_MIN_EPOCHS", "compile_transformer", "should_compile"]

AUTO_MIN_EPOCHS = 20
"""``train.compile: auto`` compiles runs of at least this many epochs: below it the first
compile (about two minutes on a CPU without a cache) costs more than it saves."""


def should_compile(setting: Literal["auto", "no", "yes"], epochs: int) -> bool:
    """``train.compile`` resolved: ``"auto"`` compiles a run of at least :data:`AUTO_MIN_EPOCHS`
    epochs, on every device (a documented choice for CUDA, where no measurement was possible)."""
    if setting == "auto":
        return epochs >= AUTO_MIN_EPOCHS
    return setting == "yes"


def compile_transformer(transformer: nn.Module) -> None:
    """Compile ``transformer``'s forward in place, its batch dimension dynamic (the sampler's,
    the loss's and the evaluation's batch sizes share one graph). Call it after the adapters and
    the attention processors are installed: they are part of the graph."""
    transformer.compile(dynamic=True)
