"""Three tasks on scikit-learn's handwritten digits: weighted sum against MARBLE.

One shared trunk, three heads: which digit it is (10-way cross-entropy), whether it is even
(binary cross-entropy), and how much ink it has (the mean pixel value, mean squared error, a loss
on a much larger scale). The weighted sum of the three losses lets the loud regression dominate;
MARBLE (``mogo.MinNorm``: unit-norm gradients, min-norm point) balances them, every step or
amortized over ten. The same seeds, budget and optimizer for all. It prints held-out scores and
the conflict rate (the share of harmonization steps whose weighted-sum direction opposed a task),
and plots the curves to ``multitask_digits.png``. The weighted sum is run through the same
optimizer, computing the three gradients every step for its conflict statistics, so wall time
here says nothing about its cost: ``benchmarks/`` measures that.

    python examples/multitask_digits.py [--epochs 30] [--seeds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from sklearn.datasets import load_digits

import mogo

TASKS = ("digit", "even", "ink")


def data(seed: int) -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    label = torch.tensor(digits.target)
    ink = torch.tensor(digits.data, dtype=torch.float32).mean(1)  # 0..16 scale: a loud loss
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    train, test = order[:1400], order[1400:]
    return x[train], label[train], ink[train], x[test], label[test], ink[test]


class MultiTaskNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh()
        )
        self.digit, self.even, self.ink = (
            torch.nn.Linear(64, 10),
            torch.nn.Linear(64, 1),
            torch.nn.Linear(64, 1),
        )

    def losses(self, x: torch.Tensor, label: torch.Tensor, ink: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        even = (label % 2 == 0).float()
        return torch.stack([
            torch.nn.functional.cross_entropy(self.digit(h), label),
            torch.nn.functional.binary_cross_entropy_with_logits(self.even(h)[:, 0], even),
            torch.nn.functional.mse_loss(self.ink(h)[:, 0], ink),
        ])  # fmt: skip

    @torch.no_grad()
    def scores(self, x: torch.Tensor, label: torch.Tensor, ink: torch.Tensor) -> dict[str, float]:
        h = self.trunk(x)
        return {
            "digit accuracy": float((self.digit(h).argmax(1) == label).float().mean()),
            "even accuracy": float(((self.even(h)[:, 0] > 0) == (label % 2 == 0)).float().mean()),
            "ink RMSE": float(torch.nn.functional.mse_loss(self.ink(h)[:, 0], ink).sqrt()),
        }


def train(
    strategy: str, seed: int, epochs: int, batch: int = 64
) -> tuple[dict[str, float], list[dict], float]:
    """Train one model; returns final held-out scores, per-epoch scores and the conflict rate."""
    x, label, ink, x_test, label_test, ink_test = data(seed)
    torch.manual_seed(seed)
    net = MultiTaskNet()
    weighting, every, ema = {
        "weighted sum": (mogo.WeightedSum([1.0, 1.0, 1.0]), 1, 0.0),
        "MARBLE": (mogo.MinNorm(), 1, 0.0),
        "MARBLE N=10": (mogo.MinNorm(), 10, 0.9),
    }[strategy]
    opt = mogo.HarmonizedOptimizer(
        torch.optim.Adam(net.parameters(), lr=3e-3), TASKS, weighting=weighting, harmonize_every=every,
        alpha_ema=ema, params=list(net.trunk.parameters()),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    curve = []
    for _ in range(epochs):
        for index in torch.randperm(len(x), generator=generator).split(batch):
            opt.zero_grad()
            opt.backward(net.losses(x[index], label[index], ink[index]))
            opt.step()
        curve.append(net.scores(x_test, label_test, ink_test))
    return curve[-1], curve, opt.meter.conflict_rate


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30, help="epochs per run (default 30)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per strategy (default 3)")
    parser.add_argument("--out", type=Path, default=Path("."), help="directory for the PNG")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    summary, curves = {}, {}
    for strategy in ("weighted sum", "MARBLE", "MARBLE N=10"):
        runs = [train(strategy, seed, args.epochs) for seed in range(args.seeds)]
        summary[strategy] = {key: sum(r[0][key] for r in runs) / len(runs) for key in runs[0][0]}
        summary[strategy]["conflict rate"] = sum(r[2] for r in runs) / len(runs)
        curves[strategy] = runs[0][1]
    columns = ["digit accuracy", "even accuracy", "ink RMSE", "conflict rate"]
    print(f"{'':>13} " + " ".join(f"{c:>15}" for c in columns))
    for strategy, row in summary.items():
        print(f"{strategy:>13} " + " ".join(f"{row[c]:>15.3f}" for c in columns))
    print(f"(means over {args.seeds} seed(s), {args.epochs} epochs, 397 held-out digits)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key in zip(axes, ["digit accuracy", "even accuracy", "ink RMSE"], strict=True):
        for strategy, curve in curves.items():
            ax.plot(range(1, len(curve) + 1), [c[key] for c in curve], label=strategy)
        ax.set(xlabel="epoch", title=f"held-out {key}")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out / "multitask_digits.png", dpi=110)
    print(f"wrote {args.out / 'multitask_digits.png'}")
    return summary


if __name__ == "__main__":
    main()
