"""A compiled transformer (``train.compile``): every adapter role and batch size through the
graphs of a run's first epochs, and eager's numbers.

The trainer switches adapters several times per step (the old adapter merged for sampling and for
the loss's old velocity, the base model for the KL anchor, the evaluation EMA merged for
evaluation, the trained adapter fused into its weights for the loss); compiled, those switches
swap weight data and flags that no guard reads, so after a run's first epochs nothing recompiles:
one compiled MARBLE run is the fixture, and every test below runs under
``torch.compiler.set_stance("fail_on_recompile")``.

Compiled and eager float32 differ by the order of their sums only. Each is within its float32
rounding error of the exact result, whose size the float64 computation of the same model shows:
``||compiled - eager|| <= 4 ||eager - eager64||`` (twice each one's error, with a factor 2 for a
reordering's error exceeding eager's), for outputs, gradients and sampled latents alike. The eager
twin is the same module under ``set_stance("force_eager")``.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch

from mogo_diffusion import models
from mogo_diffusion.compilation import AUTO_MIN_EPOCHS, should_compile
from mogo_diffusion.config import Config
from mogo_diffusion.sampling import sample
from mogo_diffusion.train import Trainer

BATCHES = (4, 6)  # the run's sampling batch, and one it never used
STEPS = 3
TOKENS = 32  # the tiny pipeline's prompt embeddings at max_sequence_length 16


@contextmanager
def stance(name: str):
    torch.compiler.set_stance(name)
    try:
        yield
    finally:
        torch.compiler.set_stance("default")


def inputs(transformer, batch: int, dtype: torch.dtype = torch.float32) -> dict:
    generator = torch.Generator().manual_seed(batch)
    config = transformer.config
    size = config.sample_size
    return {
        "hidden_states": torch.randn(batch, config.in_channels, size, size, generator=generator, dtype=dtype),
        # as the sampler and the trainer pass it: an element of the grid of timesteps, repeated
        "timestep": torch.linspace(100.0, 900.0, STEPS, dtype=dtype)[1].repeat(batch),
        "encoder_hidden_states": torch.randn(
            batch, TOKENS, config.joint_attention_dim, generator=generator, dtype=dtype
        ),
        "pooled_projections": torch.randn(
            batch, config.pooled_projection_dim, generator=generator, dtype=dtype
        ),
        "return_dict": False,
    }


def velocities(transformer, batch: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The loss's velocities on one batch (old, reference, trained), and the trained adapter's
    gradients of a loss of the trained one."""
    data = inputs(transformer, batch, dtype)
    out = {}
    with torch.no_grad():
        with models.merged(transformer, models.OLD):
            out["old"] = transformer(**data)[0]
        with models.reference(transformer):
            out["reference"] = transformer(**data)[0]
    params = models.lora_parameters(transformer, models.TRAINED)
    with models.fused(transformer, models.TRAINED):
        out["trained"] = transformer(**data)[0]
    grads = torch.autograd.grad(out["trained"].square().mean(), params)
    out["gradient"] = torch.cat([g.reshape(-1) for g in grads])
    out["trained"] = out["trained"].detach()
    return out


def sampled(pipeline, batch: int, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Latents sampled with adapter ``name`` merged (the old one samples, the trained one evaluates)."""
    data = inputs(pipeline.transformer, batch, dtype)
    embeds, pooled = data["encoder_hidden_states"], data["pooled_projections"]
    with torch.no_grad(), models.merged(pipeline.transformer, name):
        noise = data["hidden_states"].float()
        return sample(pipeline.transformer, pipeline.scheduler, embeds, pooled, STEPS, latents=noise).latents


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_dir):
    """A compiled MARBLE run after two epochs and an evaluation, which of its steps harmonized,
    and an uncompiled copy of its pipeline (for the exact results): every graph a run needs is
    compiled by then."""
    tmp = tmp_path_factory.mktemp("compiled")
    (tmp / "eval.txt").write_text("a red circle\na blue square\n")
    config = Config.from_dict({
        "model": {"pretrained": str(tiny_dir), "dtype": "float32", "lora_rank": 4, "lora_alpha": 8,
                  "max_sequence_length": 16},
        "sampling": {"num_steps": 2, "resolution": 32, "group_size": 2, "prompts_per_epoch": 2,
                     "batch_size": 4, "solver": "euler", "eval_prompts": str(tmp / "eval.txt")},
        "nft": {"kl_coef": 0.1},
        "rewards": [{"name": "jpeg_compressibility"}, {"name": "sharpness"}],
        "strategy": {"name": "marble", "harmonize_every": 2},
        "train": {"epochs": 4, "batch_size": 2, "steps_per_epoch": 1,  # a step: two micro-batches
                  "lr": 1e-2, "mixed_precision": "no", "compile": "yes", "out_dir": str(tmp / "run")},
    })  # fmt: skip
    pipeline = models.load_pipeline(tiny_dir, torch_dtype=torch.float32)
    uncompiled = copy.deepcopy(pipeline)
    models.add_lora(uncompiled.transformer, 4, 8, targets=config.model.lora_targets)
    trainer = Trainer.from_config(config, pipeline=pipeline)
    solves = []
    for epoch in range(2):  # step 0 harmonizes on its first micro-batch, step 1 does not
        solves.append(trainer.strategy.traverses_twice())
        trainer.train_epoch(epoch)
    trainer.evaluate()
    return trainer, solves, uncompiled


@pytest.fixture(scope="module")
def twins(run):
    """The run's pipeline (compiled), and a float64 copy of it, never compiled."""
    trainer, _, exact = run
    exact.transformer.load_state_dict(trainer.transformer.state_dict())
    exact.transformer.double()
    return trainer.pipeline, exact


def assert_within_reordering(compiled: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor) -> None:
    error = float((eager.double() - exact).norm())
    assert float((compiled.double() - eager.double()).norm()) <= 4 * error + torch.finfo(torch.float64).tiny


def test_a_compiled_marble_run_recompiles_nothing_after_its_first_epochs(run):
    """Both kinds of MARBLE step (a harmonization, whose trained forward runs eagerly for its K
    backward passes, and an amortized one), and the evaluation, run from the compiled graphs."""
    trainer, solves, _ = run
    with stance("fail_on_recompile"):
        solves.append(trainer.strategy.traverses_twice())
        trainer.train_epoch(2)
        solves.append(trainer.strategy.traverses_twice())
        trainer.train_epoch(3)
        trainer.evaluate()
    assert solves == [True, False, True, False]


@pytest.mark.parametrize("batch", BATCHES)
def test_every_role_and_the_gradients_equal_eagers_to_float32_round_off(twins, batch):
    pipeline, exact = twins
    with stance("fail_on_recompile"):
        ours = velocities(pipeline.transformer, batch)
    with stance("force_eager"):
        theirs = velocities(pipeline.transformer, batch)
        truth = velocities(exact.transformer, batch, torch.float64)
    for role in theirs:
        assert_within_reordering(ours[role], theirs[role], truth[role])


@pytest.mark.parametrize("name", [models.OLD, models.TRAINED])
def test_sampling_from_the_same_noise_gives_eagers_latents_to_float32_round_off(twins, name):
    pipeline, exact = twins
    with stance("fail_on_recompile"):
        ours = sampled(pipeline, BATCHES[1], name)
    with stance("force_eager"):
        theirs = sampled(pipeline, BATCHES[1], name)
        truth = sampled(exact, BATCHES[1], name, torch.float64)
    assert_within_reordering(ours, theirs, truth)


@pytest.mark.parametrize(
    ("setting", "epochs", "device", "precision", "vendor", "compiled"),
    [
        ("yes", 1, "cpu", "bf16", "AuthenticAMD", True),
        ("no", 1000, "cuda", "no", "GenuineIntel", False),
        ("auto", AUTO_MIN_EPOCHS - 1, "cuda", "bf16", "GenuineIntel", False),
        ("auto", AUTO_MIN_EPOCHS, "cuda", "bf16", "AuthenticAMD", True),
        ("auto", AUTO_MIN_EPOCHS, "cpu", "no", "GenuineIntel", True),
        ("auto", AUTO_MIN_EPOCHS, "cpu", "bf16", "AuthenticAMD", True),
        ("auto", AUTO_MIN_EPOCHS, "cpu", "no", "AuthenticAMD", False),
        ("auto", AUTO_MIN_EPOCHS, "cpu", "no", "", False),
    ],
)
def test_auto_compiles_where_it_was_measured_to_pay(setting, epochs, device, precision, vendor, compiled):
    assert should_compile(setting, epochs, device, precision, vendor) is compiled
