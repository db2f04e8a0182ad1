"""mogo: multi-objective gradient optimization for PyTorch."""

from mogo.amortize import AmortizedWeights
from mogo.diagnostics import ConflictMeter, ConflictReport
from mogo.distributed import DataParallel, ShardedParameters, sharded_gramian
from mogo.gram import NormalizedGram, gramian, normalize_gram
from mogo.jacobian import objective_grads
from mogo.optim import HarmonizedOptimizer
from mogo.registry import WEIGHTINGS, make_weighting, register_weighting
from mogo.solvers import MinNormResult, SolverError, min_norm
from mogo.weighting import MinNorm, WeightedSum, Weighting, Weights

__version__ = "0.1.0"

__all__ = [
    "WEIGHTINGS",
    "AmortizedWeights",
    "ConflictMeter",
    "ConflictReport",
    "DataParallel",
    "HarmonizedOptimizer",
    "MinNorm",
    "MinNormResult",
    "NormalizedGram",
    "ShardedParameters",
    "SolverError",
    "WeightedSum",
    "Weighting",
    "Weights",
    "gramian",
    "make_weighting",
    "min_norm",
    "normalize_gram",
    "objective_grads",
    "register_weighting",
    "sharded_gramian",
]
