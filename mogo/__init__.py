"""mogo: multi-objective gradient optimization for PyTorch."""

from mogo.gram import NormalizedGram, gramian, normalize_gram
from mogo.solvers import MinNormResult, SolverError, min_norm

__version__ = "0.1.0"

__all__ = ["MinNormResult", "NormalizedGram", "SolverError", "gramian", "min_norm", "normalize_gram"]
