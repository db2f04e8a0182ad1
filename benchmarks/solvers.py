"""Min-norm solvers on the problem families of mogo.testing: speed, accuracy, failures.

Every solver sees the same Gram matrices in one run. A result is a *failure* when the solver
raises, returns NaN, or returns weights off the simplex (an entry below -1e-6 or a sum off by more
than 1e-6). Its *error* is ``(f(alpha) - f_best) / max_i G_ii``, with ``f`` evaluated in float64 on
the weights projected onto the simplex and ``f_best`` the smallest such value any solver reached
on that problem (every projected value is feasible, hence at least the optimum).

    python benchmarks/solvers.py                   # the full table (about two minutes)
    python benchmarks/solvers.py --quick           # K in {2, 5}, one seed
    python benchmarks/solvers.py --sizes 5 64 --solvers "mogo exact" quadprog daqp   # timing only
    python benchmarks/solvers.py --out docs/_generated   # also JSON, RST tables, figure
    python benchmarks/solvers.py --replot docs/_generated/solvers.json --out docs/_generated
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import PEERS, Solver

import mogo
from mogo.testing import FAMILIES, gradient_family
from mogo_diffusion.tables import markdown_table, rst_table

SLOW = {"cvxpy", "qpth", "mogo qpth"}  # timed once per problem; the rest until TIME_BUDGET_S
TIME_BUDGET_S = 0.01


def timed(solve: Solver, G: np.ndarray, repeat: bool) -> tuple[np.ndarray | None, float, str]:
    """Weights (None on failure), median seconds per call, and the failure reason."""
    times: list[float] = []
    alpha = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while True:
            start = time.perf_counter()
            try:
                alpha = np.asarray(solve(G), dtype=np.float64)
            except Exception as error:  # a peer's failure is a data point, not a crash
                return None, time.perf_counter() - start, f"{type(error).__name__}: {error}"[:80]
            times.append(time.perf_counter() - start)
            if not repeat or sum(times) > TIME_BUDGET_S or len(times) >= 200:
                break
    if alpha.shape != (G.shape[0],) or not np.all(np.isfinite(alpha)):
        return None, float(np.median(times)), "non-finite or misshapen weights"
    if alpha.min() < -1e-6 or abs(alpha.sum() - 1) > 1e-6:
        return (
            None,
            float(np.median(times)),
            f"off the simplex (min {alpha.min():.2g}, sum {alpha.sum():.8g})",
        )
    return alpha, float(np.median(times)), ""


def projected_value(G: np.ndarray, alpha: np.ndarray) -> float:
    alpha = np.clip(alpha, 0.0, None)
    alpha = alpha / alpha.sum()
    return float(alpha @ G @ alpha)


def run(sizes: list[int], seeds: int, solvers: dict[str, Solver]) -> list[dict]:
    records = []
    for family in FAMILIES:
        for K in sizes:
            for seed in range(seeds):
                G = gradient_family(family, K, seed=seed)[1].numpy()
                scale = float(np.diagonal(G).max()) or 1.0
                rows = []
                for name, solve in solvers.items():
                    alpha, seconds, reason = timed(solve, G, repeat=name not in SLOW)
                    value = projected_value(G, alpha) if alpha is not None else None
                    rows.append(
                        {
                            "solver": name,
                            "family": family,
                            "K": K,
                            "seed": seed,
                            "seconds": seconds,
                            "failure": reason,
                            "value": value,
                        }
                    )
                best = min(r["value"] for r in rows if r["value"] is not None)
                for row in rows:
                    row["error"] = None if row["value"] is None else (row["value"] - best) / scale
                records.extend(rows)
        print(f"  {family} done", file=sys.stderr)
    return records


def batched_throughput(batch: int, K: int, solvers: list[str]) -> dict[str, float]:
    """Seconds to solve ``batch`` Gaussian problems of size K: mogo batched against loops, for
    those of ``solvers`` that have a batched or a looped entry."""
    stack = torch.stack([gradient_family("gaussian", K, seed=s)[1] for s in range(batch)])
    results = {}
    for solver, name, solve in [
        ("mogo exact", "mogo exact (batched)", lambda: mogo.min_norm(stack)),
        (
            "mogo frank_wolfe",
            "mogo frank_wolfe, tol 1e-6 (batched)",
            lambda: mogo.min_norm(stack, method="frank_wolfe", tol=1e-6, max_iter=5000, throw=False),
        ),
        ("mogo exact", "mogo exact (loop)", lambda: [mogo.min_norm(G) for G in stack]),
        ("quadprog", "quadprog (loop)", lambda: [PEERS["quadprog"](G) for G in stack.numpy()]),
    ]:
        if solver not in solvers:
            continue
        solve()
        start = time.perf_counter()
        solve()
        results[f"{batch} problems, K={K}: {name}"] = time.perf_counter() - start
    return results


def table(records: list[dict], solvers: list[str], sizes: list[int]) -> tuple[list[str], list[list[str]]]:
    """Per solver: median microseconds per K, then worst error and failures over all families."""
    header = ["solver", *[f"K={K} (us)" for K in sizes], "worst error", "failures"]
    rows = []
    for name in solvers:
        mine = [r for r in records if r["solver"] == name]
        times = [np.median([r["seconds"] for r in mine if r["K"] == K]) * 1e6 for K in sizes]
        errors = [r["error"] for r in mine if r["error"] is not None]
        failures = sum(bool(r["failure"]) for r in mine)
        rows.append(
            [
                name,
                *[f"{t:,.0f}" for t in times],
                f"{max(errors):.1e}" if errors else "-",
                f"{failures}/{len(mine)}",
            ]
        )
    return header, rows


def common_table(
    records: list[dict], solvers: list[str], sizes: list[int]
) -> tuple[list[str], list[list[str]]]:
    """Per solver: median microseconds per K over the problems that every solver solved (a
    failure is timed once, cold, so the summary's medians mix two kinds of call)."""
    header = ["solver", *[f"K={K} (us)" for K in sizes]]
    failed = {(r["family"], r["K"], r["seed"]) for r in records if r["failure"]}
    rows = []
    for name in solvers:
        mine = [r for r in records if r["solver"] == name and (r["family"], r["K"], r["seed"]) not in failed]
        times = [[r["seconds"] for r in mine if r["K"] == K] for K in sizes]
        rows.append([name, *[f"{np.median(t) * 1e6:,.0f} ({len(t)})" if t else "-" for t in times]])
    return header, rows


def family_table(records: list[dict], solvers: list[str]) -> tuple[list[str], list[list[str]]]:
    """Failures and worst error per family, one column per solver."""
    header = ["family", *solvers]
    rows = []
    for family in FAMILIES:
        row = [family]
        for name in solvers:
            mine = [r for r in records if r["solver"] == name and r["family"] == family]
            errors = [r["error"] for r in mine if r["error"] is not None]
            failures = sum(bool(r["failure"]) for r in mine)
            worst = f"{max(errors):.0e}" if errors else "-"
            row.append(f"{worst}" + (f" ({failures} failed)" if failures else ""))
        rows.append(row)
    return header, rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    return markdown_table([header, *rows])


def rst(header: list[str], rows: list[list[str]]) -> str:
    return rst_table([header, *rows]) + "\n"


def figure(records: list[dict], solvers: list[str], sizes: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, (speed, accuracy) = plt.subplots(1, 2, figsize=(12, 4.4))
    families = list(FAMILIES)
    width = 0.8 / len(solvers)
    for index, name in enumerate(solvers):
        mine = [r for r in records if r["solver"] == name]
        times = [np.median([r["seconds"] for r in mine if r["K"] == K]) * 1e6 for K in sizes]
        style = "-o" if name.startswith("mogo") else "--."
        speed.plot(sizes, times, style, label=name)
        bad = [
            sum(1 for r in mine if r["family"] == f and (r["failure"] or (r["error"] or 0) > 1e-6))
            for f in families
        ]
        positions = np.arange(len(families)) + (index - len(solvers) / 2 + 0.5) * width
        accuracy.bar(positions, bad, width, label=name)
    speed.set(xscale="log", yscale="log", xlabel="K (objectives)", ylabel="median time per solve (us)")
    speed.set_title("Speed (lower is better)")
    speed.set_xticks(sizes, [str(K) for K in sizes])
    speed.xaxis.set_minor_formatter(NullFormatter())
    speed.legend(fontsize=7)
    total = len([r for r in records if r["solver"] == solvers[0] and r["family"] == families[0]])
    accuracy.set(ylabel=f"of {total} problems: failed or error > 1e-6")
    accuracy.set_title("Robustness per family (lower is better)")
    accuracy.set_xticks(range(len(families)), families, rotation=60, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_outputs(out: Path, records: list[dict], throughput: dict[str, float], sizes: list[int]) -> None:
    """Print the tables and, with ``out``, write JSON, RST tables and the figure there."""
    solvers = list(dict.fromkeys(r["solver"] for r in records))
    summary = table(records, solvers, sizes)
    common = common_table(records, solvers, sizes)
    families = family_table(records, solvers)
    batch_rows = [[name, f"{seconds * 1e3:,.1f}"] for name, seconds in throughput.items()]
    batch_header = ["solver", "ms"]
    print(
        markdown(*summary),
        "",
        "On the problems every solver solved (how many):",
        markdown(*common),
        "",
        markdown(*families),
        "",
        markdown(batch_header, batch_rows),
        sep="\n",
    )
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    payload = {"sizes": sizes, "records": records, "batched_s": throughput}
    (out / "solvers.json").write_text(json.dumps(payload))
    (out / "solvers_summary.rst").write_text(rst(*summary))
    (out / "solvers_common.rst").write_text(rst(*common))
    (out / "solvers_families.rst").write_text(rst(*families))
    (out / "solvers_batched.rst").write_text(rst(batch_header, batch_rows))
    figure(records, solvers, sizes, out / "solvers.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="K in {2, 5}, one seed, no slow peers")
    parser.add_argument("--seeds", type=int, default=5, help="problems per family and K (default 5)")
    parser.add_argument("--out", type=Path, help="directory for solvers.json, RST tables and solvers.png")
    parser.add_argument("--replot", type=Path, help="redo tables and figure from a saved solvers.json")
    parser.add_argument("--sizes", type=int, nargs="+", help="values of K (default 2 3 5 10 32 64)")
    parser.add_argument("--solvers", nargs="+", choices=list(PEERS), help="a subset of the solvers")
    parser.add_argument("--batch", type=int, help="problems in the batched comparison (default 4096)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sizes = args.sizes or ([2, 5] if args.quick else [2, 3, 5, 10, 32, 64])
    seeds = 1 if args.quick else args.seeds
    chosen = args.solvers or [n for n in PEERS if not (args.quick and n in SLOW)]
    solvers = {n: PEERS[n] for n in chosen}
    if args.replot:
        saved = json.loads(args.replot.read_text())
        write_outputs(args.out, saved["records"], saved["batched_s"], saved["sizes"])
        return
    records = run(sizes, seeds, solvers)
    throughput = batched_throughput(args.batch or (256 if args.quick else 4096), 5, chosen)
    write_outputs(args.out, records, throughput, sizes)


if __name__ == "__main__":
    main()
