"""mogo: multi-objective gradient optimization for PyTorch."""

from mogo import registry
from mogo.aligned_mtl import AlignedMTL
from mogo.amortize import AmortizedWeights
from mogo.cagrad import CAGrad
from mogo.cross_fit import cross_fitted_gram
from mogo.diagnostics import ConflictMeter, ConflictReport
from mogo.distributed import DataParallel, ShardedParameters, sharded_gramian
from mogo.dual_cone import DualConeResult, project_dual_cone
from mogo.gated import GatedProjection
from mogo.gram import CheckedGram, GramEstimate, NormalizedGram, check_gram, gramian, normalize_gram
from mogo.imtl_g import IMTLG
from mogo.jacobian import objective_grads
from mogo.modo import MoDo
from mogo.nash_mtl import NashMTL
from mogo.optim import HarmonizedOptimizer
from mogo.pcgrad import PCGrad
from mogo.registry import Registry, make_weighting, register_weighting
from mogo.sdmgrad import SDMGrad
from mogo.solvers import MinNormResult, SolverError, min_norm
from mogo.torchjd_weighting import TorchJDWeighting
from mogo.upgrad import UPGrad
from mogo.weighting import Certificate, CheckedWeighting, MinNorm, WeightedSum, Weighting, Weights

#: Every registered weighting, a :class:`mogo.Registry` of name to factory; the factory takes the
#: weighting's options as keyword arguments (see :func:`mogo.make_weighting`).
WEIGHTINGS = registry.WEIGHTINGS

__version__ = "0.1.0"

__all__ = [
    "IMTLG",
    "WEIGHTINGS",
    "AlignedMTL",
    "AmortizedWeights",
    "CAGrad",
    "Certificate",
    "CheckedGram",
    "CheckedWeighting",
    "ConflictMeter",
    "ConflictReport",
    "DataParallel",
    "DualConeResult",
    "GatedProjection",
    "GramEstimate",
    "HarmonizedOptimizer",
    "MinNorm",
    "MinNormResult",
    "MoDo",
    "NashMTL",
    "NormalizedGram",
    "PCGrad",
    "Registry",
    "SDMGrad",
    "ShardedParameters",
    "SolverError",
    "TorchJDWeighting",
    "UPGrad",
    "WeightedSum",
    "Weighting",
    "Weights",
    "check_gram",
    "cross_fitted_gram",
    "gramian",
    "make_weighting",
    "min_norm",
    "normalize_gram",
    "objective_grads",
    "project_dual_cone",
    "register_weighting",
    "sharded_gramian",
]
