"""The run's schema: typed nested dataclasses with their defaults, ranges and cross-field checks.

Every field's default follows the published SD3.5-Medium multi-reward DiffusionNFT recipe.
:meth:`~mogo_diffusion.config.Config.from_dict` builds a config from plain data
(:func:`~mogo_diffusion.config.typed.build`) and :meth:`~mogo_diffusion.config.Config.validate`
checks it, every error a :class:`~mogo_diffusion.config.ConfigError` naming the dotted field:
types and unknown keys (with the closest known key), removed keys (:data:`REMOVED`, naming what
replaces them), ranges (each field's ``check``), finite numbers in ``options``, reward weights
against the strategy, sequential stages and the single strategy's reward against the configured
rewards, and a local model directory that does not exist.

``strategy`` is a tagged union keyed by ``strategy.name`` (``StrategyConfig``): each strategy
has its own fields (:class:`MarbleConfig`, :class:`WeightedSumConfig`, :class:`SequentialConfig`,
:class:`SingleConfig`, :class:`NormalizeThenSumConfig`, :class:`MarbleReleasedConfig`,
:class:`FamoConfig`, and :class:`HarmonizedConfig` for any other name, a weighting registered in
:data:`mogo.WEIGHTINGS`).

This module imports neither torch nor the rewards: reward names and options, weighting names, and
what needs the file system or the model are checked by :func:`mogo_diffusion.checks.check_config`,
which the trainer and ``--check`` both run.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mogo_diffusion.config.typed import ConfigError, build, closest, join
from mogo_diffusion.hub import HUB_ID

Check = tuple[str, Callable[[Any], bool]]
POSITIVE: Check = ("> 0", lambda x: x > 0)
NON_NEGATIVE: Check = (">= 0", lambda x: x >= 0)
FRACTION: Check = ("in (0, 1]", lambda x: 0 < x <= 1)
DECAY: Check = ("in [0, 1)", lambda x: 0 <= x < 1)
NON_EMPTY: Check = ("non-empty", bool)
_FLOAT32_MAX = 3.4028234663852886e38  # the rewards are weighed in float32

MAX_DEPTH = 32
"""Levels of nesting a config value may have, counted in keys of its dotted path (the schema uses
four, ``rewards.0.options.<key>``; free-form ``options`` may nest further)."""

REMOVED: dict[str, str] = {
    "sampling.steps_per_epoch": "nothing read it; train.steps_per_epoch is the field (optimizer steps "
    "per epoch)",
}
"""Fields that were removed, with why and what replaces them. Setting one is a
:class:`~mogo_diffusion.config.ConfigError` that says so; ``null`` (how every run directory saved
before the removal holds it) is ignored."""


def _field(default: Any = dataclasses.MISSING, *, check: Check) -> Any:
    """A dataclass field whose value (when not None) must pass ``check``."""
    return field(default=default, metadata={"check": check})


LORA_TARGETS: tuple[str, ...] = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)
"""The attention projections that carry LoRA (image and text streams of every joint block)."""


@dataclass
class ModelConfig:
    """The pretrained SD3 pipeline and the trained LoRA adapter.

    Attributes:
        pretrained: a hub id (``org/name``) or a local directory (``/...``, ``./...``, ``~/...``).
        revision: the hub revision (branch, tag or commit), or None.
        variant: the weights variant (e.g. ``"fp16"``), or None.
        dtype: the dtype of the frozen weights.
        lora_rank, lora_alpha: the adapter's rank r and scale alpha.
        lora_targets: the attention projections that get an adapter.
        max_sequence_length: T5 tokens per prompt (16 to 32 suit tiny models).
    """

    pretrained: str = _field("stabilityai/stable-diffusion-3.5-medium", check=NON_EMPTY)
    revision: str | None = None
    variant: str | None = None
    dtype: Literal["float32", "float16", "bfloat16"] = "float16"
    lora_rank: int = _field(32, check=POSITIVE)
    lora_alpha: float = _field(64.0, check=POSITIVE)
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS), metadata={"check": NON_EMPTY})
    max_sequence_length: int = _field(256, check=POSITIVE)


@dataclass
class PromptSource:
    """One source of a mixed prompt pool, an entry of ``sampling.prompts`` given as a list
    (see :func:`mogo_diffusion.prompts.load_prompt_pool`).

    Attributes:
        source: a source of :func:`mogo_diffusion.prompts.load_prompt_set` (a text file, a GenEval
            ``.jsonl``, ``shapes:train``, ``ocr:N``, ``geneval:N``).
        weight: its share of each epoch's prompts, relative to the other entries' (> 0): of
            ``prompts_per_epoch`` prompts it gives ``floor`` or ``ceil`` of
            ``prompts_per_epoch * weight / sum of weights``, that many in expectation.
        reward: the specialist reward its prompts are for: ``"ocr"`` (each prompt has a text to
            render), ``"geneval"`` (each has GenEval metadata) or ``"general"`` (neither: ``ocr``
            and ``geneval`` are NaN on them); None infers it from the prompts' metadata.
    """

    source: str = _field(check=NON_EMPTY)
    weight: float = _field(1.0, check=POSITIVE)
    reward: Literal["ocr", "geneval", "general"] | None = None


@dataclass
class SamplingConfig:
    """Sampling from the old policy (CFG-free, deterministic).

    Attributes:
        num_steps: sampler steps per image in training (10 single-reward, 25 multi-reward).
        eval_num_steps: sampler steps in evaluation.
        solver: the ODE solver.
        resolution: the side in pixels of the square images sampled in training and evaluation, a
            multiple of 16: the latents are ``resolution / vae_scale_factor`` on a side
            (:func:`mogo_diffusion.models.latent_size`, which the trainer checks against the
            model when it starts).
        group_size: images per prompt, G >= 2 (advantages are relative to the group).
        prompts_per_epoch: prompt groups sampled per epoch.
        prompts: the training prompts: a source of :func:`mogo_diffusion.prompts.load_prompt_set`
            (a text file, a GenEval ``.jsonl``, ``shapes:train``), a list of
            :class:`PromptSource` (a mixed pool, drawn by weight), or None for a small built-in set.
        eval_prompts: the held-out prompts of the evaluation, a source as ``prompts``; None: none.
        batch_size: images per sampler call.
    """

    num_steps: int = _field(25, check=POSITIVE)
    eval_num_steps: int = _field(40, check=POSITIVE)
    solver: Literal["euler", "dpmpp2m"] = "dpmpp2m"
    resolution: int = _field(512, check=("a positive multiple of 16", lambda x: x > 0 and x % 16 == 0))
    group_size: int = _field(24, check=(">= 2", lambda x: x >= 2))
    prompts_per_epoch: int = _field(48, check=POSITIVE)
    prompts: str | list[PromptSource] | None = field(default=None, metadata={"check": NON_EMPTY})
    eval_prompts: str | None = None
    batch_size: int = _field(9, check=POSITIVE)


@dataclass
class NFTConfig:
    """The DiffusionNFT loss and the advantages (see :mod:`mogo_diffusion.nft`).

    Attributes:
        beta: the mixing strength of the implicit positive and negative policies, in (0, 1].
        adv_clip: C, the advantage clip and the loss scale ``C / beta``.
        kl_coef: the weight of ``mean (v - v_ref)^2`` (0 skips the reference forward).
        std_scope: the advantages' std over the whole ``"batch"`` or each prompt ``"group"``.
        nonapplicable: a reward that does not apply to a sample (NaN) leaves it out of that
            reward's loss (``"exclude"``) or counts it with advantage 0 (``"neutral"``, as
            DiffusionNFT's masking does); see :func:`mogo_diffusion.nft.nft_coefficients`.
    """

    beta: float = _field(0.1, check=FRACTION)
    adv_clip: float = _field(5.0, check=POSITIVE)
    kl_coef: float = _field(1e-4, check=NON_NEGATIVE)
    std_scope: Literal["batch", "group"] = "batch"
    nonapplicable: Literal["exclude", "neutral"] = "exclude"


@dataclass
class RewardSpec:
    """One reward: its registered ``name``, a ``weight`` (>= 0) and its factory's ``options``."""

    name: str
    weight: float | None = _field(None, check=NON_NEGATIVE)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class StageConfig:
    """A stage of the sequential strategy: train on ``reward`` for ``epochs`` epochs."""

    reward: str
    epochs: int = _field(check=POSITIVE)


@dataclass
class MarbleConfig:
    """``marble``: the K per-reward NFT losses into :class:`mogo.HarmonizedOptimizer` with
    :class:`mogo.MinNorm` (unit-norm gradients, min-norm point, mean-norm scale).

    Attributes:
        harmonize_every: N, optimizer steps between harmonizations.
        alpha_ema: rho, the EMA decay of the reused alpha, in [0, 1).
        estimate: an optimizer step accumulates one ``backward`` per trained timestep; alpha is
            estimated on the ``"first"`` of them or on the whole ``"window"``.
        grad_mode, nonfinite: passed to :class:`mogo.HarmonizedOptimizer` (``train.mixed_precision:
            fp16`` needs ``nonfinite: skip``, so that an overflowing step is skipped).
        gram: what the weighting weighs: the ``"same_batch"`` Gram matrix of the micro-batch's K
            gradients, or the ``"cross_fitted"`` estimate ``(G_12 + G_21) / 2`` from the two
            halves of its rows, free of the batch's own noise (:func:`mogo.cross_fitted_gram`;
            needs ``train.batch_size >= 2``); it adds the cross-batch conflict metrics.
        grad_ema: beta in [0, 1): the weighting weighs the Gram matrix of an EMA of each reward's
            gradient across harmonizations (MoCo; memory: K, or 2K with halves, gradients of the
            adapter); 0 tracks nothing.
        smooth_harmonized: a harmonization applies the EMA-smoothed alpha too, not its own
            (CR-MOGM; with ``harmonize_every: 1`` every step's weights are the average).
    """

    name: Literal["marble"] = "marble"
    harmonize_every: int = _field(10, check=POSITIVE)
    alpha_ema: float = _field(0.9, check=DECAY)
    estimate: Literal["first", "window"] = "first"
    grad_mode: Literal["auto", "batched", "sequential"] = "auto"
    nonfinite: Literal["raise", "skip", "drop"] = "raise"
    gram: Literal["same_batch", "cross_fitted"] = "same_batch"
    grad_ema: float = _field(0.0, check=DECAY)
    smooth_harmonized: bool = False


@dataclass
class HarmonizedConfig(MarbleConfig):
    """Any other ``name``: the weighting registered under it in :data:`mogo.WEIGHTINGS`
    (``min_norm``, or one you register with :func:`mogo.register_weighting`), built with
    ``options``, in place of MARBLE's; the other fields are MARBLE's.

    The name is checked against the registry when the trainer is built. ``weighted_sum`` names
    the trainer's own baseline (:class:`WeightedSumConfig`), not mogo's ``weighted_sum`` weighting.
    """

    name: str = "min_norm"  # type: ignore[assignment]
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightedSumConfig:
    """``weighted_sum``: DiffusionNFT's baseline, one NFT loss from the advantage of
    ``sum_k w_k R_k`` (every reward needs a weight).

    Attributes:
        reward_scale: add the ``"raw"`` rewards or their batch ``"zscore"``-s
            (:func:`mogo_diffusion.advantages.zscore_rewards`).
        nan: a NaN reward counts as ``"zero"`` or ``"raise"``-s (see
            :func:`mogo_diffusion.advantages.weighted_sum_advantages`).
    """

    name: Literal["weighted_sum"] = "weighted_sum"
    reward_scale: Literal["raw", "zscore"] = "raw"
    nan: Literal["zero", "raise"] = "zero"


@dataclass
class NormalizeThenSumConfig:
    """``normalize_then_sum``: GDPO / TRL's ``multi_objective_aggregation="normalize_then_sum"``,
    one NFT loss from :func:`mogo_diffusion.advantages.normalize_then_sum` of the rewards, weighted
    by ``rewards[*].weight`` (1 each when no reward has one).

    Attributes:
        std_scope: each reward's std within its prompt ``"group"`` (TRL) or over the ``"batch"``;
            it replaces ``nft.std_scope`` (the per-reward strategies' choice) for this strategy.
        bessel: the Bessel-corrected std (``n - 1``, TRL's), or the population std.
        batch_norm: re-normalise the weighted sum over the batch (TRL always does).
        rescale_masked: divide a reward's normalised values by the share of the batch it applies
            to, so that a reward measured on a third of the samples counts as much as the others.
    """

    name: Literal["normalize_then_sum"] = "normalize_then_sum"
    std_scope: Literal["group", "batch"] = "group"  # this strategy's, in place of nft.std_scope
    bessel: bool = True
    batch_norm: bool = True
    rescale_masked: bool = False


@dataclass
class MarbleReleasedConfig:
    """``marble_released``: MARBLE as the released code (aim-uofa/MARBLE) trains, micro-step by
    micro-step (:mod:`mogo_diffusion.released_marble`). Its advantages are
    ``nft.std_scope: batch`` and its solves ``nft.nonapplicable: exclude``, which it needs.

    Attributes:
        harmonize_every: N: a micro-step solves when ``N`` optimizer steps have passed since the
            last solve (the release's ``amortize_every_n``, 10).
        warmup_steps: optimizer steps whose every micro-step solves (``amortize_warmup``, 1).
        alpha_ema: the decay of the cached alpha, blended at every solve (``alpha_ema_decay``, 0.7).
        solver: ``"slsqp"`` (scipy's SLSQP, as released) or ``"exact"`` (:func:`mogo.min_norm`).
        alpha: ``"solved"`` (the QP), ``"equal"`` (``1/K``, never solved: the release's equal-alpha
            ablation) or K fixed non-negative values (its ``fixed_alphas``), used as given.
    """

    name: Literal["marble_released"] = "marble_released"
    harmonize_every: int = _field(10, check=POSITIVE)
    warmup_steps: int = _field(1, check=NON_NEGATIVE)
    alpha_ema: float = _field(0.7, check=DECAY)
    solver: Literal["slsqp", "exact"] = "slsqp"
    alpha: Literal["solved", "equal"] | list[float] = "solved"


@dataclass
class FamoConfig:
    """``famo``: a weighted sum of the rewards (as ``weighted_sum``) whose weights move each epoch
    from the rewards' improvement rates over the last ``window`` epochs, FAMO-style
    (:mod:`mogo_diffusion.reward_rates`); they start at ``rewards[*].weight`` (equal without).

    Attributes:
        window: epochs (>= 2) whose per-reward batch means give each reward's improvement rate
            (the least-squares slope; more epochs, less noise, slower to react).
        lr: the step size in logits per unit of rate (a rate is a reward's change per epoch in
            units of its within-epoch std: a lag of 0.02 std an epoch behind four equally
            weighted others moves its logit up by about ``lr * 0.2 * 0.02`` an epoch).
        reward_scale, nan: as :class:`WeightedSumConfig`'s.
    """

    name: Literal["famo"] = "famo"
    window: int = _field(8, check=(">= 2", lambda x: x >= 2))
    lr: float = _field(5.0, check=POSITIVE)
    reward_scale: Literal["raw", "zscore"] = "zscore"
    nan: Literal["zero", "raise"] = "zero"


@dataclass
class SequentialConfig:
    """``sequential``: one reward at a time, by ``stages`` in order, cycling."""

    name: Literal["sequential"] = "sequential"
    stages: list[StageConfig] = field(default_factory=list, metadata={"check": NON_EMPTY})


@dataclass
class SingleConfig:
    """``single``: one ``reward`` throughout (the specialist)."""

    name: Literal["single"] = "single"
    reward: str = ""


# How the K reward losses become one update: one record per strategy, tagged by ``name``.
StrategyConfig = (
    MarbleConfig
    | WeightedSumConfig
    | SequentialConfig
    | SingleConfig
    | NormalizeThenSumConfig
    | MarbleReleasedConfig
    | FamoConfig
    | HarmonizedConfig
)


@dataclass
class TrainConfig:
    """The optimisation loop.

    Attributes:
        lr, weight_decay: AdamW's learning rate and weight decay.
        grad_clip: the gradient-norm clip (of the unscaled gradient), or None.
        epochs: sampling-and-training rounds.
        batch_size: samples per training forward.
        steps_per_epoch: optimizer steps per epoch: the epoch's training batches are split into
            this many groups of consecutive batches, each group's mean gradient one step
            (DiffusionNFT's ``gradient_step_per_epoch``); None: one step per batch. At most the
            batches each process trains per epoch.
        timestep_fraction: the fraction of the sampler's timesteps trained per sample
            (``int(fraction * num_steps)`` of them, at least one).
        old_decay_rate, old_decay_max: the old policy follows the trained one by EMA with decay
            ``min(old_decay_rate * step, old_decay_max)``.
        eval_ema_decay: the decay of the separate evaluation EMA, in [0, 1).
        mixed_precision: the autocast of every transformer forward (sampling, evaluation, the
            old, reference and trained velocities): ``"bf16"`` (on a CPU, with the attention's
            softmax product in float32: :mod:`mogo_diffusion.attention`), ``"fp16"`` (with a
            ``GradScaler``: gradients unscaled before clipping, overflowing steps skipped), ``"no"``,
            or ``"auto"``: bf16 on a CUDA device that supports it, else no. The LoRA weights, the
            optimizer's state, the losses, the advantages and the QP stay float32.
        compile: compile the transformer (:mod:`mogo_diffusion.compilation`): ``"yes"``, ``"no"``,
            or ``"auto"``: where it was measured to pay
            (:func:`~mogo_diffusion.compilation.should_compile`).
        reward_threads: rewards scored at once (see :class:`mogo_diffusion.rewards.MultiReward`).
        seed, out_dir: the random seed (in [0, 2**63)) and the run directory.
        log_every, eval_every, checkpoint_every: periods in epochs.
        log_with: accelerate trackers that also receive the metrics (e.g. ``["tensorboard"]``,
            written under ``out_dir/trackers``); the JSONL file is always written.
    """

    lr: float = _field(3e-4, check=POSITIVE)
    weight_decay: float = _field(1e-4, check=NON_NEGATIVE)
    grad_clip: float | None = _field(1.0, check=POSITIVE)
    epochs: int = _field(1000, check=POSITIVE)
    batch_size: int = _field(9, check=POSITIVE)
    steps_per_epoch: int | None = _field(None, check=POSITIVE)
    timestep_fraction: float = _field(0.99, check=FRACTION)
    old_decay_rate: float = _field(0.001, check=NON_NEGATIVE)
    old_decay_max: float = _field(0.5, check=DECAY)
    eval_ema_decay: float = _field(0.9, check=DECAY)
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = "auto"
    compile: Literal["auto", "no", "yes"] = "auto"
    reward_threads: int = _field(1, check=POSITIVE)
    seed: int = _field(42, check=NON_NEGATIVE)
    out_dir: str = _field("runs/marble", check=NON_EMPTY)
    log_every: int = _field(1, check=POSITIVE)
    eval_every: int = _field(10, check=POSITIVE)
    checkpoint_every: int = _field(30, check=POSITIVE)
    log_with: list[str] = field(default_factory=list)


@dataclass
class Config:
    """A whole run: ``model``, ``sampling``, ``nft``, ``rewards``, ``strategy``, ``train``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    nft: NFTConfig = field(default_factory=NFTConfig)
    rewards: list[RewardSpec] = field(default_factory=list)
    strategy: StrategyConfig = field(default_factory=MarbleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build and :meth:`validate` a config from plain data (missing fields keep defaults)."""
        config = build(cls, data, "", REMOVED)
        config.validate()
        return config

    def to_dict(self) -> dict[str, Any]:
        """Plain data (dicts, lists, scalars) that :meth:`from_dict` turns back into this config."""
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The config as YAML that :func:`~mogo_diffusion.config.load_config` reads back."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | os.PathLike) -> None:
        """Write the config as YAML, e.g. next to a run's checkpoints."""
        Path(path).write_text(self.to_yaml())

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid field."""
        _check_ranges(self, "")
        _check_model_path(self.model.pretrained)
        if not self.rewards:
            raise ConfigError("rewards: at least one reward is needed")
        _check_pool(self.sampling.prompts)
        _check_strategy(self)


def _check_free_form(value: Any, path: str) -> None:
    """A value the schema does not type (``options``): nested at most :data:`MAX_DEPTH` keys deep
    (deeper ones overflow the recursion of saving and copying), its numbers finite, as typed
    floats must be (an infinite weighting scale or reward option breaks training later)."""
    if len(path.split(".")) > MAX_DEPTH:
        raise ConfigError(f"{path}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path}: must be finite, got {value!r}")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        _check_free_form(item, join(path, key))


def _check_ranges(node: Any, path: str) -> None:
    """The fields' ``check`` metadata, through nested dataclasses and lists of them, and the
    free-form mappings in them (:func:`_check_free_form`)."""
    if isinstance(node, dict):
        _check_free_form(node, path)
        return
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_ranges(item, join(path, i))
        return
    if not dataclasses.is_dataclass(node):
        return
    for f in dataclasses.fields(node):
        value, where = getattr(node, f.name), join(path, f.name)
        check = f.metadata.get("check")
        if check is not None and value is not None and not check[1](value):
            raise ConfigError(f"{where}: must be {check[0]}, got {value!r}")
        _check_ranges(value, where)


def _check_model_path(pretrained: str) -> None:
    """A hub id passes; a path (absolute, ``./``, ``~``, several ``/``) must be a directory."""
    path = os.path.expanduser(pretrained)
    if os.path.isdir(path):
        return
    looks_local = (
        pretrained.startswith(("/", ".", "~", "\\"))
        or os.path.isabs(pretrained)
        or pretrained.count("/") > 1
        or "\\" in pretrained
    )
    if looks_local:
        raise ConfigError(f"model.pretrained: local directory {pretrained!r} does not exist")
    if not HUB_ID.fullmatch(pretrained):
        raise ConfigError(
            f"model.pretrained: {pretrained!r} is neither an existing directory nor a hub id like 'org/name'"
        )


def _check_pool(prompts: str | list[PromptSource] | None) -> None:
    """A pool's sources are distinct (the files themselves are read by the trainer and ``--check``)."""
    sources = [entry.source for entry in prompts] if isinstance(prompts, list) else []
    for i, source in enumerate(sources):
        if source in sources[:i]:
            raise ConfigError(
                f"sampling.prompts.{i}.source: {source!r} is already sampling.prompts.{sources.index(source)}"
            )


def _check_strategy(config: Config) -> None:
    strategy, rewards = config.strategy, config.rewards
    names = [spec.name for spec in rewards]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"rewards.{i}.name: {name!r} is already rewards.{names.index(name)}")
    weighted = [spec.weight is not None for spec in rewards]
    if isinstance(strategy, WeightedSumConfig):
        if not all(weighted):
            raise ConfigError(
                f"rewards.{weighted.index(False)}.weight: the weighted_sum strategy needs a weight for "
                "every reward"
            )
        if not any(spec.weight for spec in rewards):
            raise ConfigError("rewards: the weighted_sum strategy needs a positive weight")
    elif any(weighted) and not all(weighted):
        raise ConfigError(
            f"rewards.{weighted.index(False)}.weight: give a weight for every reward or for none "
            f"(rewards.{weighted.index(True)} has one)"
        )
    elif all(weighted) and isinstance(strategy, MarbleConfig) and not any(spec.weight for spec in rewards):
        raise ConfigError(
            f"rewards: every weight is 0; the {strategy.name} strategy weighs the weighted-sum baseline "
            "of its conflict diagnostics by them and needs a positive one (or give no weights)"
        )
    _check_weight_scale(rewards)

    def check_reward(name: str, where: str) -> None:
        if name not in names:
            raise ConfigError(
                f"{where}: {name!r} is not a configured reward{closest(name, names)}; rewards: {names}"
            )

    if isinstance(strategy, SequentialConfig):
        for i, stage in enumerate(strategy.stages):
            check_reward(stage.reward, f"strategy.stages.{i}.reward")
    if isinstance(strategy, SingleConfig):
        if not strategy.reward:
            raise ConfigError("strategy.reward: the single strategy needs the name of its reward")
        check_reward(strategy.reward, "strategy.reward")
    fp16 = config.train.mixed_precision == "fp16"
    if isinstance(strategy, MarbleConfig) and fp16 and strategy.nonfinite != "skip":
        raise ConfigError(
            f"strategy.nonfinite: train.mixed_precision 'fp16' needs 'skip' (an overflowing step is "
            f"skipped and the GradScaler lowers its scale), got {strategy.nonfinite!r}"
        )


def _check_weight_scale(rewards: list[RewardSpec]) -> None:
    """The weights sum to a float32 number: the trainer weighs the rewards in float32 (a larger
    weight becomes inf there, and the advantages NaN). Weights are relative: scale them down."""
    weights = [spec.weight for spec in rewards if spec.weight is not None]
    if weights and sum(weights) > _FLOAT32_MAX:
        largest = max(range(len(weights)), key=weights.__getitem__)
        raise ConfigError(
            f"rewards.{largest}.weight: the weights sum to {sum(weights):g}, beyond float32's largest "
            f"number {_FLOAT32_MAX:.4g}, in which the trainer weighs the rewards; they are relative: "
            f"scale them down"
        )
