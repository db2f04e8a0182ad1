"""The conflict-aware weightings against TorchJD's implementations of the same methods.

Both sides get the same float64 Gram matrices (``mogo.testing`` families) in one run; each
measurement is the median seconds per call within interleaved rounds (ours, TorchJD's, ours, ...)
so that the machine's drift cancels. Three tables:

* time per call, ours and TorchJD's, and their ratio, for K in {2, 5, 10, 32};
* UPGrad's K projections (``mogo.project_dual_cone``, one batched solve) against one
  ``mogo.min_norm`` solve on the same Gram matrix (the target is at most 2x);
* ``--agreement``: on every family, K in {2, 3, 5, 10, 32} and scales 1e-12..1e12 of the
  gradients, how often TorchJD's answer is certified accurate and then agrees with ours to 1e-6,
  how often it fails or is inexact, and whether ours is certified everywhere. The certificates
  are those of the property tests (tests/test_weightings.py).

    python benchmarks/weightings.py               # timings (about two minutes)
    python benchmarks/weightings.py --quick       # K in {2, 5}, fewer rounds
    python benchmarks/weightings.py --agreement   # also the agreement table (several minutes)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torchjd.aggregation as tjd

import mogo
from mogo.testing import FAMILIES, gradient_family

ONES = {K: torch.ones(K, dtype=torch.float64) for K in range(1, 65)}


def ours_and_theirs(name: str, K: int, J: torch.Tensor) -> tuple[Callable, Callable]:
    """Callables of the Gram matrix: mogo's weighting and TorchJD's for the same method."""
    ours = mogo.make_weighting(name, **({"max_norm": 0.0} if name == "nash_mtl" else {}))
    theirs = {
        "upgrad": tjd.UPGradWeighting,
        "cagrad": lambda: tjd.CAGradWeighting(0.5),
        "imtl_g": tjd.IMTLGWeighting,
        "aligned_mtl": tjd.AlignedMTLWeighting,
        "pcgrad": tjd.PCGradWeighting,
        "mgda": tjd.MGDAWeighting,
    }
    if name == "nash_mtl":  # TorchJD's Nash-MTL weighs the Jacobian, not its Gram matrix
        weighting = tjd.NashMTL(n_tasks=K, max_norm=0.0).weighting
        return (lambda G: ours(G, ONES[K])), (lambda G: weighting(J))
    weighting = theirs[name]()
    return (lambda G: ours(G, ONES[K])), weighting


def per_call(fn: Callable, G: torch.Tensor, budget: float) -> float:
    """Seconds per call: as many calls as fit in ``budget`` seconds (at least one)."""
    calls, start = 0, time.perf_counter()
    while True:
        fn(G)
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed > budget:
            return elapsed / calls


def compare(
    first: Callable, second: Callable, G: torch.Tensor, rounds: int, budget: float
) -> tuple[float, float]:
    """Median seconds per call of ``first`` and ``second``, measured in interleaved rounds."""
    a, b = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first(G), second(G)  # warm up
        for _ in range(rounds):
            a.append(per_call(first, G, budget))
            b.append(per_call(second, G, budget))
    return statistics.median(a), statistics.median(b)


NAMES = ["upgrad", "mgda", "cagrad", "nash_mtl", "imtl_g", "aligned_mtl", "pcgrad"]


def timings(sizes: list[int], rounds: int, budget: float) -> None:
    print(f"time per call on the 'conflicting' family (median of {rounds} interleaved rounds)")
    print(f"{'weighting':<12} {'K':>3} {'mogo':>10} {'TorchJD':>10} {'TorchJD/mogo':>13}")
    for name in NAMES:
        for K in sizes:
            J, G = gradient_family("conflicting", K, seed=0)
            ours, theirs = ours_and_theirs(name, K, J)
            slow = name in ("cagrad", "nash_mtl")
            t_ours, t_theirs = compare(ours, theirs, G, 1 if slow else rounds, budget)
            ratio = t_theirs / t_ours
            print(f"{name:<12} {K:>3} {t_ours * 1e6:>8.0f}us {t_theirs * 1e6:>8.0f}us {ratio:>13.1f}")


def projections(rounds: int, budget: float) -> None:
    print("\nUPGrad's K = 5 projections (one batched project_dual_cone) against one min_norm solve")
    print(f"{'family':<16} {'projections':>12} {'min_norm':>10} {'ratio':>6}")
    for family in ("gaussian", "conflicting", "low_rank", "opposite", "duplicates", "collinear"):
        _, G = gradient_family(family, 5, seed=0)
        t_cone, t_min = compare(mogo.project_dual_cone, mogo.min_norm, G, rounds, budget)
        print(f"{family:<16} {t_cone * 1e6:>10.0f}us {t_min * 1e6:>8.0f}us {t_cone / t_min:>6.2f}")


def agreement(seeds: int) -> None:
    """Counts over problems of: compared and agreed, compared and disagreed, TorchJD inexact by
    its certificate, TorchJD failed (raised); and problems where ours is not certified."""
    from tests import test_weightings as checks

    print(
        f"\nagreement with TorchJD: {len(FAMILIES)} families x K in {{2,3,5,10,32}} x scales 1e-12, 1, 1e12"
    )
    print(f"x {seeds} seeds; relative direction gap <= 1e-6 counts as agreement")
    print(
        f"{'weighting':<12} {'agree':>6} {'differ':>7} {'inexact':>8} {'failed':>7} {'ours uncertified':>17}"
    )
    for name in checks.COMPARED:
        counts = dict.fromkeys(("agree", "differ", "inexact", "failed", "uncertified"), 0)
        for family in FAMILIES:
            for K in (2, 3, 5, 10, 32):
                for scale in (1e-12, 1.0, 1e12):
                    for seed in range(seeds):
                        J, G = gradient_family(family, K, scale=scale, seed=seed)
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            counts[checks.classify(name, J, G, seed)] += 1
                            counts["uncertified"] += int(not checks.certified(name, G))
        print(
            f"{name:<12} {counts['agree']:>6} {counts['differ']:>7} {counts['inexact']:>8} "
            f"{counts['failed']:>7} {counts['uncertified']:>17}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="K in {2, 5}, 3 rounds")
    parser.add_argument("--agreement", action="store_true", help="also the agreement table")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per problem in --agreement")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes, rounds = ([2, 5], 3) if args.quick else ([2, 5, 10, 32], 7)
    timings(sizes, rounds, budget=0.02)
    projections(rounds, budget=0.02)
    if args.agreement:
        agreement(args.seeds)


if __name__ == "__main__":
    main()
