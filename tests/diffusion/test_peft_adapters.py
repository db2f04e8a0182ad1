"""peft_adapters: the one module that switches peft's adapters through its private attributes.

These tests fail loudly when a peft release renames or repurposes ``_active_adapter`` or
``_disable_adapters``: peft's public read-outs (``active_adapters``, ``disable_adapters``) and the
layer's forward must follow what the switch sets, and nothing that trains may change.
"""

from __future__ import annotations

import torch
from peft.tuners.lora import LoraLayer

from mogo_diffusion import models
from mogo_diffusion.peft_adapters import selected, selection


def lora_transformer():
    transformer = models.tiny_sd3("smoke").transformer
    models.add_lora(transformer, 4, 8)
    with torch.no_grad():  # a non-zero trained adapter, so that the switch changes the output
        for p in models.lora_parameters(transformer, models.TRAINED):
            p.add_(0.1)
    return transformer


def test_peft_reads_back_what_the_switch_sets_and_restores_it():
    transformer = lora_transformer()
    layers = [m for m in transformer.modules() if isinstance(m, LoraLayer)]
    before = [selection(layer) for layer in layers]
    grads = [p.requires_grad for p in transformer.parameters()]
    for name, disabled in ((models.OLD, False), (None, True), (models.TRAINED, False)):
        with selected(layers, name):
            for layer in layers:
                assert layer.disable_adapters is disabled  # peft's public property
                if name is not None:
                    assert layer.active_adapters == [name]  # peft's public property
            assert [p.requires_grad for p in transformer.parameters()] == grads
    assert [selection(layer) for layer in layers] == before


def test_the_forward_computes_the_selected_adapter():
    transformer = lora_transformer()
    layer = next(m for m in transformer.modules() if isinstance(m, LoraLayer))
    x = torch.randn(3, layer.in_features)
    base = layer.get_base_layer()(x)
    with torch.no_grad():
        with selected([layer], None):
            assert torch.equal(layer(x), base)
        for name in (models.TRAINED, models.OLD):
            with selected([layer], name):
                expected = base + layer.scaling[name] * layer.lora_B[name](layer.lora_A[name](x))
                torch.testing.assert_close(layer(x), expected)
