"""How often does a weighted sum oppose one of the objectives, and does the min-norm direction?

For random sets of K gradients (the ``conflicting`` and ``gaussian`` families of mogo.testing) it
compares the mean gradient (a weighted sum with equal weights) with MARBLE's direction, the
min-norm point of the unit-normalised gradients. A direction *conflicts* when its cosine with at
least one gradient is negative. It prints the conflict rates and the worst cosines, and draws one
two-dimensional case to ``conflicting_gradients.png``.

    python examples/conflicting_gradients.py [--trials 500] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import mogo
from mogo.testing import gradient_family


def directions(J: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean gradient of the rows of J, and MARBLE's direction
    ``d = s * sum_k alpha_k g_k / ||g_k||`` with ``s`` the mean gradient norm."""
    unit = mogo.normalize_gram(mogo.gramian([J]), "l2")
    alpha = unit.expand(mogo.min_norm(unit.gram).alpha)
    return J.mean(0), unit.scale.mean() * (alpha / unit.scale) @ J


def worst_cosine(J: torch.Tensor, d: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(J, d.expand_as(J), dim=1).min())


def draw(J: torch.Tensor, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mean, harmonized = directions(J)
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    for k, g in enumerate(J):
        ax.annotate("", g.tolist(), (0, 0), arrowprops={"arrowstyle": "->", "color": "0.5"})
        ax.text(*(1.08 * g).tolist(), f"$g_{k + 1}$", color="0.3")
    ax.annotate("", mean.tolist(), (0, 0), arrowprops={"arrowstyle": "->", "color": "tab:red", "lw": 2})
    ax.annotate(
        "", harmonized.tolist(), (0, 0), arrowprops={"arrowstyle": "->", "color": "tab:blue", "lw": 2}
    )
    ax.plot([], [], color="tab:red", label=f"mean (worst cos {worst_cosine(J, mean):+.2f})")
    ax.plot([], [], color="tab:blue", label=f"min-norm (worst cos {worst_cosine(J, harmonized):+.2f})")
    limit = 1.3 * float(J.abs().max())
    ax.set(
        xlim=(-limit, limit), ylim=(-limit, limit), aspect="equal", title="Three objectives, two directions"
    )
    ax.axhline(0, color="0.9", zorder=0)
    ax.axvline(0, color="0.9", zorder=0)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=500, help="gradient sets per family (default 500)")
    parser.add_argument("--out", type=Path, default=Path("."), help="directory for the PNG")
    args = parser.parse_args(argv)
    results = {}
    print(
        f"{'family':<12} {'K':>3} {'conflicts: mean':>16} {'min-norm':>9} "
        f"{'worst cos: mean':>16} {'min-norm':>9}"
    )
    for family in ("conflicting", "gaussian"):
        for K in (3, 5, 10):
            mean_cos, harmonized_cos = [], []
            for seed in range(args.trials):
                J = gradient_family(family, K, dim=K, seed=seed)[0]
                mean, harmonized = directions(J)
                mean_cos.append(worst_cosine(J, mean))
                harmonized_cos.append(worst_cosine(J, harmonized))
            rate = sum(c < 0 for c in mean_cos) / args.trials
            harmonized_rate = sum(c < -1e-9 for c in harmonized_cos) / args.trials
            results[f"{family}/K={K}/mean"] = rate
            results[f"{family}/K={K}/min_norm"] = harmonized_rate
            print(
                f"{family:<12} {K:>3} {rate:>16.1%} {harmonized_rate:>9.1%} "
                f"{min(mean_cos):>16.3f} {min(harmonized_cos):>9.3f}"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    draw(
        torch.tensor([[1.0, 0.1], [0.9, 0.5], [-0.6, 0.4]], dtype=torch.float64),
        args.out / "conflicting_gradients.png",
    )
    print(f"wrote {args.out / 'conflicting_gradients.png'}")
    return results


if __name__ == "__main__":
    main()
