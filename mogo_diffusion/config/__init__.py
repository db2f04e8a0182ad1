"""Run configuration: typed nested dataclasses, YAML files and dotted command-line overrides.

.. code-block:: python

    config = load_config("run.yaml", ["train.lr=1e-4", "rewards.0.weight=2"])
    config.save(out_dir / "config.yaml")

Three modules, each importing only the ones before it:

* :mod:`~mogo_diffusion.config.typed`: plain data into typed dataclasses, generic over the schema
  (types, unknown keys with a did-you-mean, tagged unions, removed fields).
* :mod:`~mogo_diffusion.config.schema`: the run's fields, their defaults and ranges, and the checks
  across fields (:meth:`Config.validate`).
* :mod:`~mogo_diffusion.config.loading`: the YAML reader and the ``KEY=VALUE`` overrides
  (:func:`load_config`, :func:`add_config_arguments`).

A file sets any subset of the fields; the rest keep their defaults. Every error is a
:class:`ConfigError` whose message starts with the dotted field.

Why dataclasses and not pydantic v2 (decided for issue 41, on its merits). Pydantic would give the
ranges (``Field(gt=0)``) and a JSON schema for free, but:

* the messages users see are the contract here: the first error, its dotted path, a did-you-mean
  for a misspelt key or choice, "this field was removed: why", a YAML line for a key given twice.
  Pydantic reports every error at once as ``loc`` tuples with its own wording ("Extra inputs are
  not permitted"), so keeping ours means a translation layer about the size of
  :mod:`~mogo_diffusion.config.typed` (130 lines) on top of it;
* its default (lax) mode converts ``"3"`` to ``3`` and ``1.0`` for an ``int`` field; its strict
  mode takes what ours takes (an ``int`` for a ``float`` field, nothing else converted), so on
  types the two would agree;
* ``strategy`` is an open tagged union (any weighting registered in :data:`mogo.WEIGHTINGS` is a
  strategy name); pydantic's discriminated unions want closed ``Literal`` tags, so this needs a
  callable discriminator either way;
* it would be a new direct dependency (today only ``typer`` pulls it in, for the hub's command
  line) for a schema of 13 records, with no JSON-schema user yet.

Should a JSON schema be wanted, it is a walk over ``dataclasses.fields`` and their ``check``
metadata, as :func:`~mogo_diffusion.config.typed.build` already does.
"""

from mogo_diffusion.config.loading import add_config_arguments, config_from_args, load_config
from mogo_diffusion.config.schema import (
    LORA_TARGETS,
    MAX_DEPTH,
    REMOVED,
    Config,
    FamoConfig,
    HarmonizedConfig,
    MarbleConfig,
    MarbleReleasedConfig,
    ModelConfig,
    NFTConfig,
    NormalizeThenSumConfig,
    PromptSource,
    RewardSpec,
    SamplingConfig,
    SequentialConfig,
    SingleConfig,
    StageConfig,
    StrategyConfig,
    TrainConfig,
    WeightedSumConfig,
)
from mogo_diffusion.config.typed import ConfigError

__all__ = [
    "LORA_TARGETS",
    "MAX_DEPTH",
    "REMOVED",
    "Config",
    "ConfigError",
    "FamoConfig",
    "HarmonizedConfig",
    "MarbleConfig",
    "MarbleReleasedConfig",
    "ModelConfig",
    "NFTConfig",
    "NormalizeThenSumConfig",
    "PromptSource",
    "RewardSpec",
    "SamplingConfig",
    "SequentialConfig",
    "SingleConfig",
    "StageConfig",
    "StrategyConfig",
    "TrainConfig",
    "WeightedSumConfig",
    "add_config_arguments",
    "config_from_args",
    "load_config",
]
