"""Which LoRA adapter a peft layer computes, switched without touching what trains.

peft's public switches (``set_adapter``, ``enable_adapters``) walk the model and reset every
adapter parameter's ``requires_grad`` to "active trains, inactive does not", while the trainer
decides what trains itself, and switches several times per step (old, reference, trained):
resetting ``requires_grad`` there would both undo that decision and change what a compiled graph
is guarded on. A :class:`~peft.tuners.tuners_utils.BaseTunerLayer` keeps its selection in two
private attributes, ``_active_adapter`` and ``_disable_adapters``; this module is the one place
that reads or writes them (``tests/test_no_private_api.py`` keeps it so), and
``tests/diffusion/test_peft_adapters.py`` fails loudly when a peft release changes them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from peft.tuners.tuners_utils import BaseTunerLayer

__all__ = ["selected", "selection"]


def selection(layer: BaseTunerLayer) -> tuple[list[str], bool]:
    """``layer``'s active adapter names (its own list, as it holds it) and whether its adapters
    are disabled."""
    return layer._active_adapter, layer._disable_adapters


@contextmanager
def selected(layers: Sequence[BaseTunerLayer], name: str | None) -> Iterator[None]:
    """A context in which every layer of ``layers`` computes adapter ``name`` alone (``None``: no
    adapter, the base layer); each layer's selection is restored on exit, so contexts nest.

    ``name`` is not checked here: the caller knows the model's adapters.
    """
    saved = [selection(layer) for layer in layers]
    try:
        for layer in layers:
            if name is not None:
                layer._active_adapter = [name]
            layer._disable_adapters = name is None
        yield
    finally:
        for layer, (active, disabled) in zip(layers, saved, strict=True):
            layer._active_adapter, layer._disable_adapters = active, disabled
