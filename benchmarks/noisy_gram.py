"""Gram matrices of noisy gradients: one batch's against the cross-fitted estimate of two halves.

A synthetic problem with known expected gradients and controlled noise
(:class:`mogo.testing.NoisyObjectives`): batches of 64 samples whose gradients hold 5 % signal, the
noise shaped by how the objectives' per-sample advantages co-vary. Two studies:

* **The estimate** (:func:`mogo.testing.noise_study`): the same-batch Gram matrix and the
  cross-fitted ``(G_12 + G_21) / 2``, each averaged over n batches (n = 1..256: what averaging the
  weights over harmonizations can reach at best), against the true Gram matrix: the relative mean
  squared error, the diagonal's bias, and the min-norm (MARBLE) weights' distance from the true
  ones.
* **The conflict** (:func:`mogo.testing.planted_conflict`): how often one batch shows that the mean
  opposes an objective, same-batch and across the halves, and how often
  :class:`mogo.GatedProjection` opens, where the mean does oppose the third objective and where
  it agrees with every one.
* **The cost**: a harmonization step of ``HarmonizedOptimizer`` on an MLP (K = 4, batch 256,
  0.3M parameters), ``gram="cross_fitted"`` (2K gradient rows, from one forward over the batch or
  one per half) against ``"same_batch"`` (K rows), median of interleaved rounds.

    python benchmarks/noisy_gram.py                 # a minute or two; writes the figure and table
    python benchmarks/noisy_gram.py --quick         # fewer draws, no figure
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mogo
from benchmarks.machine import describe
from mogo.gram import has_direction
from mogo.testing import STUDY_BATCH, noise_study, planted_conflict

ROOT = Path(__file__).resolve().parent.parent
FIGURE = ROOT / "docs" / "_generated" / "noisy_gram.png"
TABLE = ROOT / "docs" / "_generated" / "noisy_gram.txt"
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def min_norm_alpha(G: np.ndarray, estimate: bool) -> np.ndarray | None:
    """MARBLE's alpha (unit gradients) of a Gram matrix, or of a declared estimate's nearest one;
    None where the estimate shows no direction (the optimizer's no-op step)."""
    if estimate and not has_direction(G):
        return None
    gram = mogo.GramEstimate(torch.from_numpy(G)) if estimate else torch.from_numpy(G)
    return mogo.MinNorm()(gram, torch.ones(len(G))).alpha.numpy()


def estimate_study(draws: int, seed: int = 0) -> dict[int, dict[str, float]]:
    """Per n: relative MSE, mean relative diagonal bias and alpha's largest error (over the
    estimates with a direction), both ways, and the share of cross-fitted ones without."""
    problem, rng = noise_study(), np.random.default_rng(seed)
    true = problem.gram
    true_alpha = min_norm_alpha(true, estimate=False)
    rows = {}
    for n in BATCHES:
        values: dict[str, list[float]] = {"cross none": []}
        for _ in range(max(16, draws // n)):
            for name, G in zip(("same", "cross"), problem.averaged_grams(rng, n, STUDY_BATCH), strict=True):
                error = G - true
                values.setdefault(f"{name} mse", []).append(float((error**2).sum() / (true**2).sum()))
                values.setdefault(f"{name} bias", []).append(
                    float((np.diagonal(error) / np.diagonal(true)).mean())
                )
                alpha = min_norm_alpha(G, estimate=name == "cross")
                if alpha is not None:
                    values.setdefault(f"{name} alpha", []).append(float(np.abs(alpha - true_alpha).max()))
                if name == "cross":
                    values["cross none"].append(float(alpha is None))
        rows[n] = {key: float(np.mean(value)) for key, value in values.items()}
    return rows


def conflict_study(draws: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """Per problem: the rates of a same-batch conflict, a cross-batch one, and an open gate."""
    weights = torch.ones(3) / 3
    gates = {margin: mogo.GatedProjection(weights, margin=margin) for margin in (1.0, 3.0)}
    rows = {}
    for label, conflict in (("mean opposes objective 3", True), ("mean agrees with all", False)):
        problem, rng = planted_conflict(conflict=conflict), np.random.default_rng(seed)
        meter, opened = mogo.ConflictMeter(), dict.fromkeys(gates, 0)
        ws = mogo.WeightedSum(weights)(torch.from_numpy(problem.gram), torch.ones(3))
        for _ in range(draws):
            first, second = problem.halves(rng, STUDY_BATCH)
            rows_ = np.vstack([first, second])
            halves = torch.from_numpy(rows_ @ rows_.T)
            meter.update(mogo.ConflictReport.from_halves(halves, ws, ("1", "2", "3")))
            checked = mogo.check_gram(mogo.cross_fit.estimate_of_halves(halves))
            for margin, gate in gates.items():
                opened[margin] += bool(gate.conflicts(checked, weights.double().numpy()).any())
        rows[label] = {
            "same-batch conflict rate": meter.conflict_rate,
            "cross-batch conflict rate": meter.cross_batch_conflict_rate,
            **{f"gate opens (margin {margin:g})": count / draws for margin, count in opened.items()},
        }
    return rows


def cost_study(rounds: int, K: int = 4, batch: int = 256) -> dict[str, dict[str, float]]:
    """Milliseconds per harmonization step (median of interleaved rounds), per gradient mode and
    way of forming the losses; the ratio to same_batch in the same mode."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 512),
        torch.nn.Tanh(),
        torch.nn.Linear(512, 512),
        torch.nn.Tanh(),
        torch.nn.Linear(512, K),
    )
    x, y = torch.randn(batch, 64), torch.randn(batch, K)
    half = batch // 2

    def losses(way: str) -> torch.Tensor:
        if way == "same_batch":
            return ((net(x) - y) ** 2).mean(0)
        if way == "cross_fitted, one forward":
            errors = (net(x) - y) ** 2
            return torch.stack([errors[:half].mean(0), errors[half:].mean(0)])
        return torch.stack([((net(x[h]) - y[h]) ** 2).mean(0) for h in (slice(0, half), slice(half, None))])

    ways = ("same_batch", "cross_fitted, one forward", "cross_fitted, a forward per half")
    rows = {}
    for mode in ("batched", "sequential"):
        optimizers = {
            way: mogo.HarmonizedOptimizer(
                torch.optim.SGD(net.parameters(), lr=0.0), K, gram=way.split(",")[0], grad_mode=mode
            )
            for way in ways
        }
        times: dict[str, list[float]] = {way: [] for way in ways}
        for round_ in range(rounds + 2):  # two rounds of warm-up
            for way, opt in optimizers.items():
                start = time.perf_counter()
                opt.zero_grad()
                opt.backward(losses(way))
                opt.step()
                if round_ >= 2:
                    times[way].append(time.perf_counter() - start)
        medians = {way: 1e3 * float(np.median(t)) for way, t in times.items()}
        for way in ways:
            rows[f"{mode}, {way}"] = {"ms": medians[way], "ratio": medians[way] / medians["same_batch"]}
    return rows


def table(
    estimates: dict[int, dict[str, float]],
    conflicts: dict[str, dict[str, float]],
    costs: dict[str, dict[str, float]],
    draws: int,
) -> str:
    lines = [
        describe(),
        f"noise_study: 3 objectives, 5 % signal at {STUDY_BATCH} samples; estimates averaged over n batches, "
        f"max(16, {draws} / n) draws each",
        "",
        "| n | MSE same | MSE cross | diag bias same | diag bias cross | alpha err same | alpha err cross "
        "| no direction cross |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, row in estimates.items():
        cells = [row[f"{name} {what}"] for what in ("mse", "bias", "alpha") for name in ("same", "cross")]
        cells.append(row["cross none"])
        lines.append(f"| {n} | " + " | ".join(f"{value:.3g}" for value in cells) + " |")
    columns = list(next(iter(conflicts.values())))
    lines += ["", f"planted_conflict: {draws} batches of {STUDY_BATCH}, the mean as the weighted sum", ""]
    lines += ["| problem | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for label, row in conflicts.items():
        lines.append(f"| {label} | " + " | ".join(f"{row[c]:.2f}" for c in columns) + " |")
    lines += ["", "harmonization step, MLP 64-512-512-4 (0.3M parameters), batch 256, one thread", ""]
    lines += ["| grad mode, losses | ms | / same_batch |", "|---|---|---|"]
    lines += [f"| {label} | {row['ms']:.1f} | {row['ratio']:.2f} |" for label, row in costs.items()]
    return "\n".join(lines)


def figure(estimates: dict[int, dict[str, float]], conflicts: dict[str, dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = np.array(list(estimates))
    fig, (mse, alpha, rates) = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, label, style in (("same", "same batch", "o-"), ("cross", "cross-fitted", "s-")):
        mse.loglog(n, [estimates[k][f"{name} mse"] for k in n], style, label=label)
        alpha.semilogx(n, [estimates[k][f"{name} alpha"] for k in n], style, label=label)
    start = estimates[1]["cross mse"]
    mse.loglog(n, start / n, "k:", label="1 / n")
    mse.set(
        xlabel="batches of 64 averaged (n)", ylabel="||G_hat - G||^2 / ||G||^2", title="Gram matrix error"
    )
    alpha.set(
        xlabel="batches of 64 averaged (n)", ylabel="max |alpha_hat - alpha|", title="min-norm weights error"
    )
    alpha.set_ylim(bottom=0)
    labels = list(conflicts)
    columns = list(conflicts[labels[0]])
    width = 0.8 / len(columns)
    for index, column in enumerate(columns):
        positions = np.arange(len(labels)) + (index - (len(columns) - 1) / 2) * width
        bars = rates.bar(positions, [conflicts[label][column] for label in labels], width, label=column)
        rates.bar_label(bars, fmt="%.2f", fontsize=6)
    rates.set_xticks(np.arange(len(labels)), labels)
    rates.set(ylabel="fraction of batches", title="one batch of 64: conflict seen", ylim=(0, 1))
    for axes in (mse, alpha, rates):
        axes.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=2048, help="estimates at n = 1 (fewer at larger n)")
    parser.add_argument("--quick", action="store_true", help="64 draws, no figure or table file")
    args = parser.parse_args()
    draws = 64 if args.quick else args.draws
    estimates, conflicts = estimate_study(draws), conflict_study(draws)
    costs = cost_study(rounds=5 if args.quick else 30)
    text = table(estimates, conflicts, costs, draws)
    print(text)
    if not args.quick:
        TABLE.write_text(text + "\n")
        figure(estimates, conflicts)
        print(f"\nwrote {FIGURE.relative_to(ROOT)} and {TABLE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
