"""Two objectives, one of them twenty times louder: the weighted sum sacrifices the quiet one.

``L1(x) = ||x - a||^2`` and ``L2(x) = 20 ||x - b||^2`` on the plane; their Pareto front is the
segment from a to b. Gradient descent on ``L1 + L2`` from any start runs to the same point next to
b, where L1 is 3.6 times its value at the front's middle. HarmonizedOptimizer with MinNorm walks
each start to the nearest part of the front and stops there, where no direction improves both.
Trajectories go to ``pareto_toy.png``.

    python examples/pareto_toy.py [--steps 300] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import mogo

A, B, LOUD = torch.tensor([-1.0, 0.0]), torch.tensor([1.0, 0.0]), 20.0
STARTS = [(-1.5, 1.5), (-0.5, 1.8), (0.6, 1.6), (1.6, 1.2), (0.0, -1.6), (-1.8, -1.0)]


def losses(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([((x - A) ** 2).sum(), LOUD * ((x - B) ** 2).sum()])


def descend(start: tuple[float, float], weighting: mogo.Weighting, steps: int, lr: float) -> torch.Tensor:
    """The trajectory (steps + 1, 2) of plain SGD driven by HarmonizedOptimizer."""
    x = torch.tensor(start, requires_grad=True)
    opt = mogo.HarmonizedOptimizer(torch.optim.SGD([x], lr=lr), ["quiet", "loud"], weighting=weighting)
    path = [x.detach().clone()]
    for _ in range(steps):
        opt.zero_grad()
        opt.backward(losses(x))
        opt.step()
        path.append(x.detach().clone())
    return torch.stack(path)


def distance_to_front(x: torch.Tensor) -> float:
    t = float(((x - A) @ (B - A)) / ((B - A) @ (B - A)))
    return float((x - (A + min(max(t, 0.0), 1.0) * (B - A))).norm())


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="SGD steps per start (default 300)")
    parser.add_argument("--out", type=Path, default=Path("."), help="directory for the PNG")
    args = parser.parse_args(argv)
    methods = {"weighted sum": (mogo.WeightedSum([1.0, 1.0]), 0.02), "MinNorm": (mogo.MinNorm(), 0.02)}
    paths = {name: [descend(s, w, args.steps, lr) for s in STARTS] for name, (w, lr) in methods.items()}
    results = {}
    for name, trajectories in paths.items():
        ends = [path[-1] for path in trajectories]
        results[name] = [float(losses(x)[0]) for x in ends]
        results[f"{name} distance to front"] = [distance_to_front(x) for x in ends]
        print(f"{name:>13}: final quiet loss L1 = " + ", ".join(f"{v:.2f}" for v in results[name]))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    ax.plot([A[0], B[0]], [A[1], B[1]], color="black", lw=3, label="Pareto front")
    for (name, trajectories), color in zip(paths.items(), ("tab:red", "tab:blue"), strict=True):
        for i, path in enumerate(trajectories):
            ax.plot(path[:, 0], path[:, 1], color=color, lw=1.2, label=name if i == 0 else None)
            ax.plot(*path[0].tolist(), "o", color="0.4", ms=4)
    ax.set(aspect="equal", title="L1 = |x - a|^2 and L2 = 20 |x - b|^2")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out / "pareto_toy.png", dpi=120)
    print(f"wrote {args.out / 'pareto_toy.png'}")
    return results


if __name__ == "__main__":
    main()
