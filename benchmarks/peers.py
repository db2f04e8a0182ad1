"""The min-norm solvers that mogo is compared with, each called as its users call it.

Every function maps a (K, K) float64 numpy Gram matrix to weights (K,) or raises. Peers are
imported lazily, so a missing one drops out of the table instead of stopping the run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

import mogo

Solver = Callable[[np.ndarray], np.ndarray]


def mogo_exact(G: np.ndarray) -> np.ndarray:
    return mogo.min_norm(torch.from_numpy(G)).alpha.numpy()


def mogo_frank_wolfe(G: np.ndarray) -> np.ndarray:
    return mogo.min_norm(torch.from_numpy(G), method="frank_wolfe").alpha.numpy()


def mogo_qpth(G: np.ndarray) -> np.ndarray:
    return mogo.min_norm(torch.from_numpy(G), method="qpth").alpha.numpy()


def torchjd_mgda(G: np.ndarray) -> np.ndarray:
    """torchjd's ``MGDAWeighting`` with its defaults (epsilon 1e-3, 100 iterations)."""
    from torchjd.aggregation import MGDAWeighting

    return MGDAWeighting()(torch.from_numpy(G)).numpy()


def qpth_plain(G: np.ndarray) -> np.ndarray:
    """qpth's ``QPFunction`` on ``Q = 2 G`` as MGDA code calls it, with no regularisation."""
    from qpth.qp import QPFunction

    K = G.shape[0]
    Q = torch.from_numpy(2 * G).unsqueeze(0)
    eye = torch.eye(K, dtype=torch.float64)
    alpha = QPFunction(verbose=-1)(
        Q,
        torch.zeros(1, K, dtype=torch.float64),
        -eye.unsqueeze(0),
        torch.zeros(1, K, dtype=torch.float64),
        torch.ones(1, 1, K, dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.float64),
    )
    return alpha[0].numpy()


def quadprog_solve(G: np.ndarray) -> np.ndarray:
    import quadprog

    K = G.shape[0]
    constraints = np.hstack([np.ones((K, 1)), np.eye(K)])
    return quadprog.solve_qp(G, np.zeros(K), constraints, np.concatenate([[1.0], np.zeros(K)]), meq=1)[0]


def cvxpy_solve(G: np.ndarray) -> np.ndarray:
    import cvxpy as cp

    alpha = cp.Variable(G.shape[0], nonneg=True)
    cp.Problem(cp.Minimize(cp.quad_form(alpha, cp.psd_wrap(G))), [cp.sum(alpha) == 1]).solve()
    if alpha.value is None:
        raise RuntimeError("cvxpy returned no solution")
    return alpha.value


def daqp_solve(G: np.ndarray) -> np.ndarray:
    from ctypes import c_int

    import daqp

    K = G.shape[0]
    upper = np.concatenate([np.full(K, 1e30), [1.0]])
    lower = np.concatenate([np.zeros(K), [1.0]])
    sense = np.concatenate([np.zeros(K), [5]]).astype(c_int)  # 5: equality
    alpha, _, flag, _ = daqp.solve(G, np.zeros(K), np.ones((1, K)), upper, lower, sense)
    if flag != 1:
        raise RuntimeError(f"daqp exit flag {flag}")
    return alpha


def sener_koltun_frank_wolfe(G: np.ndarray, max_iter: int = 250, stop: float = 1e-5) -> np.ndarray:
    """Algorithm 2 of Sener & Koltun (2018), the solver LibMTL and most MGDA papers use: start at
    the best pair (closed form), then Frank-Wolfe steps until the weights move less than ``stop``
    (L1) or ``max_iter`` steps. Our transcription of the paper, without the published code's
    fixed ``dmin = 1e8`` initial bound, which breaks on large scales."""
    K = G.shape[0]
    if K == 1:
        return np.ones(1)

    def pair_step(aa: float, ab: float, bb: float) -> float:
        """argmin_c ||c a + (1 - c) b||^2 over [0, 1]."""
        if ab >= aa:
            return 1.0
        if ab >= bb:
            return 0.0
        return (bb - ab) / (aa + bb - 2 * ab)

    best, alpha = np.inf, np.zeros(K)
    for i, j in itertools.combinations(range(K), 2):
        c = pair_step(G[i, i], G[i, j], G[j, j])
        value = c * c * G[i, i] + 2 * c * (1 - c) * G[i, j] + (1 - c) ** 2 * G[j, j]
        if value < best:
            best, alpha = value, np.zeros(K)
            alpha[i], alpha[j] = c, 1 - c
    for _ in range(max_iter):
        g = G @ alpha
        t = int(np.argmin(g))
        gamma = 1.0 - pair_step(alpha @ g, g[t], G[t, t])
        new = (1 - gamma) * alpha
        new[t] += gamma
        moved = np.abs(new - alpha).sum()
        alpha = new
        if moved < stop:
            break
    return alpha


PEERS: dict[str, Solver] = {
    "mogo exact": mogo_exact,
    "mogo frank_wolfe": mogo_frank_wolfe,
    "mogo qpth": mogo_qpth,
    "torchjd MGDA": torchjd_mgda,
    "Sener-Koltun FW": sener_koltun_frank_wolfe,
    "qpth": qpth_plain,
    "quadprog": quadprog_solve,
    "daqp": daqp_solve,
    "cvxpy": cvxpy_solve,
}
