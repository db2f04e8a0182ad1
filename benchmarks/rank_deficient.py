"""The dual-cone solve (``mogo.UPGrad``, ``mogo.project_dual_cone``) on rank-deficient problems.

Each problem is ``mogo.testing.rank_deficient(seed)``: K in 3..24 gradients in fewer dimensions
(a centred cloud or Gaussian rows) scaled by 1e-12..1e12. Under one and two BLAS threads
(numpy's and torch's) every problem is solved four ways: the ``UPGrad`` weighting, the K
projections in one batched call, each projection alone, and in a stack with the next problem.
A failure is a raised ``SolverError`` or a KKT violation above the tolerance; the directions
``J^T v`` of the batched, single and paired solves must agree to ``sqrt(400 K eps)`` of the
size of their sums (the bound of ``tests/test_dual_cone.py``).

    python benchmarks/rank_deficient.py             # 10,000 problems (a few minutes)
    python benchmarks/rank_deficient.py --problems 500
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mogo
from benchmarks.machine import describe
from mogo.testing import rank_deficient

EPS = float(np.finfo(np.float64).eps)


def direction_gap(J: torch.Tensor, V1: torch.Tensor, V2: torch.Tensor) -> float:
    """The largest ``||J^T (v1 - v2)||`` over the rows, relative to ``sqrt(400 K eps)`` times the
    size of the sums (at most 1 where the two are one direction), for ``U = I``."""
    K, norms = J.shape[0], J.norm(dim=1)
    eye = torch.eye(K, dtype=J.dtype)
    size = torch.maximum(
        ((eye + (V1 - eye).abs()) * norms).sum(-1), ((eye + (V2 - eye).abs()) * norms).sum(-1)
    )
    gap = (V1 @ J - V2 @ J).norm(dim=-1) / ((400 * K * EPS) ** 0.5 * size)
    return float(gap.max())


def sweep(problems: int, threads: int) -> dict[str, float]:
    """Failures of each solve and the worst direction disagreement over ``problems`` seeds."""
    failures = {"UPGrad": 0, "batched": 0, "single": 0, "paired": 0}
    worst, start = 0.0, time.perf_counter()
    with threadpool_limits(threads):
        torch.set_num_threads(threads)
        for seed in range(problems):
            J = rank_deficient(seed)
            K, G = J.shape[0], J @ J.T
            eye = torch.eye(K, dtype=G.dtype)
            try:
                mogo.UPGrad()(G, torch.ones(K, dtype=G.dtype))
            except mogo.SolverError:
                failures["UPGrad"] += 1
            batched = mogo.project_dual_cone(G, throw=False)
            single = [mogo.project_dual_cone(G, eye[k], throw=False) for k in range(K)]
            partner = rank_deficient(seed + problems)
            other = torch.zeros(K, partner.shape[1], dtype=G.dtype)
            other[: min(K, len(partner))] = partner[:K]
            paired = mogo.project_dual_cone(torch.stack([G, other @ other.T]), throw=False)
            failures["batched"] += batched.status != "success"
            failures["single"] += sum(result.status != "success" for result in single)
            failures["paired"] += paired.status != "success"
            alone = torch.cat([result.weights for result in single])
            worst = max(worst, direction_gap(J, batched.weights, alone))
            worst = max(worst, direction_gap(J, batched.weights, paired.weights[0]))
    return {**failures, "worst direction gap / bound": worst, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=10_000, help="problems per thread count")
    args = parser.parse_args()
    print(describe())
    print(f"{args.problems} rank-deficient problems per thread count; failures of each solve\n")
    rows = {threads: sweep(args.problems, threads) for threads in (1, 2)}
    columns = list(rows[1])
    print("| threads | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for threads, row in rows.items():
        cells = [f"{value:.3g}" if isinstance(value, float) else str(value) for value in row.values()]
        print(f"| {threads} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
