"""Cost of one optimizer step with K objectives, as a ratio to a weighted-sum step, same run.

Strategies, on an MLP (1.1M parameters) and a transformer encoder (about 10M):

* ``weighted sum``: one backward of ``sum_k L_k`` (the reference, ratio 1), and the same over
  8 micro-batches (the reference of the micro-batch row);
* ``floor``: one forward plus K backward passes with ``retain_graph``, the least a step that
  needs K gradients can cost;
* ``mogo full (batched | sequential)``: HarmonizedOptimizer harmonizing every step;
* ``mogo amortized N=5/10/20``: harmonizing every N steps, timed over N steps;
* ``mogo 8 micro-batches, N=10``: gradient accumulation, alpha estimated on one micro-batch;
* ``torchjd MGDA / UPGrad``: ``torchjd.autojac.backward`` + ``jac_to_grad``.

Each step includes forward, backward and the optimizer update (SGD). A round runs each strategy
for a few consecutive steps (N for an amortized one) after one warm-up step for all ("between
harmonizations" is a schedule that harmonizes only in its warm-up step); ratios are taken within
a round and their medians over rounds reported, so that the machine's drift in speed cancels.
Torch keeps no allocator statistics on the CPU, so peak memory is the growth of the peak resident
set over one step, in a fresh process per strategy.

``--keep-freed-memory`` stops glibc's malloc from returning freed memory to the system (as
jemalloc and tcmalloc do), so that a step's fresh tensors do not pay first-touch page faults.
``--breakdown`` adds where a harmonization step's time goes: the mean time in each ``mogo.*``
range of a ``torch.profiler`` trace, next to the floor. ``--batch`` sets the batch size.

    python benchmarks/step.py [--quick | --sizes 2 5 10] [--rounds 15] [--keep-freed-memory]
                              [--models "MLP 1.1M" "transformer 10M"] [--batch 256] [--breakdown]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

import mogo


def mlp(K: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, K),
    )  # fmt: skip


class Encoder(torch.nn.Module):
    """About 10M parameters: 4 layers of width 448, 8 heads, on 32 tokens."""

    def __init__(self, K: int, width: int = 448, layers: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(64, width)
        layer = torch.nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)).mean(1))


MODELS: dict[str, tuple[Callable[[int], torch.nn.Module], tuple[int, ...]]] = {
    "MLP 1.1M": (mlp, (256, 512)),
    "transformer 10M": (Encoder, (8, 32, 64)),
}


def inputs(shape: tuple[int, ...], K: int, batch: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs of ``shape`` (its batch size replaced by ``batch``, if given) and K targets."""
    shape = (batch or shape[0], *shape[1:])
    return torch.randn(*shape), torch.randn(shape[0], K)


def objective_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean(0)


Steps = dict[str, tuple[Callable[[], None], int]]
"""Strategies by label: a function running one step, and how many consecutive steps a round runs."""


def timed_rounds(steps: Steps, rounds: int) -> dict[str, list[float]]:
    """Each strategy's mean seconds per step over its ``count`` consecutive steps, in each of
    ``rounds`` rounds. A round runs every strategy once, in reverse order every other round, so
    that a ratio taken within a round sees the machine at one speed."""
    for step, _ in steps.values():
        step()
    samples: dict[str, list[float]] = {label: [] for label in steps}
    labels = list(steps)
    for round_index in range(rounds):
        for label in labels if round_index % 2 == 0 else labels[::-1]:
            step, count = steps[label]
            start = time.perf_counter()
            for _ in range(count):
                step()
            samples[label].append((time.perf_counter() - start) / count)
    return samples


def ratio(samples: dict[str, list[float]], label: str, reference: str) -> float:
    """Median over rounds of ``label``'s time per step divided by ``reference``'s."""
    return statistics.median(a / b for a, b in zip(samples[label], samples[reference], strict=True))


def strategies(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, K: int) -> Steps:
    params = list(model.parameters())
    sgd = torch.optim.SGD(params, lr=1e-6)

    def weighted_sum() -> None:
        sgd.zero_grad()
        objective_losses(model, x, y).sum().backward()
        sgd.step()

    def floor() -> None:
        sgd.zero_grad()
        losses = objective_losses(model, x, y)
        for k in range(K):  # K backward passes into .grad, so that the step updates like the others
            losses[k].backward(retain_graph=k < K - 1)
        sgd.step()

    def mogo_step(every: int, mode: str, micro_batches: int = 1) -> Callable[[], None]:
        opt = mogo.HarmonizedOptimizer(
            torch.optim.SGD(params, lr=1e-6), K, harmonize_every=every, alpha_ema=0.9, grad_mode=mode
        )
        chunks = list(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True))

        def step() -> None:
            opt.zero_grad()
            for xs, ys in chunks:
                opt.backward(objective_losses(model, xs, ys))
            opt.step()

        return step

    def torchjd_step(aggregator_name: str) -> Callable[[], None]:
        from torchjd import aggregation, autojac

        aggregator = getattr(aggregation, aggregator_name)()

        def step() -> None:
            sgd.zero_grad()
            autojac.backward(objective_losses(model, x, y))
            autojac.jac_to_grad(params, aggregator)
            sgd.step()

        return step

    micro = x.shape[0] // 8
    return {  # an amortized strategy runs N steps a round: one harmonization and N - 1 reuses
        "weighted sum": (weighted_sum, 5),
        "floor: fwd + K bwd": (floor, 5),
        "mogo full, batched": (mogo_step(1, "batched"), 5),
        "mogo full, sequential": (mogo_step(1, "sequential"), 5),
        "mogo between harmonizations": (mogo_step(10**9, "auto"), 5),
        "mogo amortized N=5": (mogo_step(5, "auto"), 5),
        "mogo amortized N=10": (mogo_step(10, "auto"), 10),
        "mogo amortized N=20": (mogo_step(20, "auto"), 20),
        "weighted sum, 8 micro-batches": (lambda: weighted_sum_micro(model, sgd, x, y, micro), 5),
        "mogo 8 micro-batches, N=10": (mogo_step(10, "auto", 8), 10),
        "torchjd MGDA": (torchjd_step("MGDA"), 5),
        "torchjd UPGrad": (torchjd_step("UPGrad"), 5),
    }


def weighted_sum_micro(
    model: torch.nn.Module, sgd: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, size: int
) -> None:
    sgd.zero_grad()
    for xs, ys in zip(x.split(size), y.split(size), strict=True):
        objective_losses(model, xs, ys).sum().backward()
    sgd.step()


def keep_freed_memory() -> None:
    """Make glibc's malloc keep freed memory for reuse: never trim the heap, and serve blocks up
    to its 32 MiB maximum from the heap rather than from fresh mappings. Without it, the K x P
    gradients a harmonization step allocates are mapped anew each step, and every 4 KiB page
    faults on first touch (about 3 us each on this project's virtual machines)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError as error:
        raise SystemExit(f"--keep-freed-memory needs glibc (libc.so.6): {error}") from error
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    if not (libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) and libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)):
        raise SystemExit("--keep-freed-memory: glibc's mallopt refused the thresholds")


def breakdown(steps: Steps, count: int = 10) -> dict[str, dict[str, float]]:
    """Mean milliseconds per step in each ``mogo.*`` profiler range, for the two full strategies."""
    table: dict[str, dict[str, float]] = {}
    for label in ("mogo full, batched", "mogo full, sequential"):
        step, _ = steps[label]
        step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            for _ in range(count):
                step()
        table[label] = {
            event.key: event.cpu_time_total / count / 1e3
            for event in profile.key_averages()
            if event.key.startswith("mogo.")
        }
    return table


def print_breakdown(table: dict[str, dict[str, float]], samples: dict[str, list[float]]) -> None:
    labels = list(table)
    floor = statistics.median(samples["floor: fwd + K bwd"]) * 1e3
    print(f"\nWhere a full step goes, ms per step under torch.profiler (floor: {floor:.1f} ms unprofiled)")
    print(f"| range | {' | '.join(labels)} |")
    print("|---|" + "---|" * len(labels))
    for name in RANGES:
        print(f"| {name} | " + " | ".join(f"{table[label].get(name, 0.0):.2f}" for label in labels) + " |")
    whole = " | ".join(f"{statistics.median(samples[label]) * 1e3:.2f}" for label in labels)
    print(f"| whole step, unprofiled | {whole} |")


RANGES = ["mogo.objective_grads", "mogo.gramian", "mogo.weighting", "mogo.combine", "mogo.report"]


def peak_step_memory(model_name: str, K: int, label: str, keep_freed: bool, batch: int) -> float:
    """Bytes by which one step of ``label`` raises the peak resident set of a fresh process."""
    command = [sys.executable, __file__, "--peak-of", model_name, str(K), label, "--batch", str(batch)]
    command += ["--keep-freed-memory"] if keep_freed else []
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(result.stdout.split()[-1])


def measure_peak(model_name: str, K: int, label: str, batch: int | None) -> None:
    """In the child process: set up, then print the growth of ru_maxrss over one step."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    build, shape = MODELS[model_name]
    model = build(K)
    x, y = inputs(shape, K, batch)
    step, _ = strategies(model, x, y, K)[label]
    before = peak_resident_bytes()
    step()
    print(peak_resident_bytes() - before)


def peak_resident_bytes() -> int:
    """This process's peak resident set (VmHWM; ru_maxrss would carry the parent's across exec)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="K=5 only")
    parser.add_argument(
        "--sizes", nargs="+", type=int, default=[2, 5, 10], metavar="K", help="numbers of objectives"
    )
    parser.add_argument(
        "--keep-freed-memory", action="store_true", help="glibc malloc keeps freed memory (no page faults)"
    )
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=15, help="rounds of every strategy (medians over them)")
    parser.add_argument(
        "--batch", type=int, help="batch size (default: 256 for the MLP, 8 for the transformer)"
    )
    parser.add_argument("--breakdown", action="store_true", help="time in each mogo.* profiler range")
    parser.add_argument("--peak-of", nargs=3, metavar=("MODEL", "K", "STRATEGY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.keep_freed_memory:
        keep_freed_memory()
    if args.peak_of:
        measure_peak(args.peak_of[0], int(args.peak_of[1]), args.peak_of[2], args.batch)
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = args.models
    sizes = [5] if args.quick else args.sizes
    for name in models:
        build, shape = MODELS[name]
        for K in sizes:
            model = build(K)
            x, y = inputs(shape, K, args.batch)
            count = sum(p.numel() for p in model.parameters())
            steps = strategies(model, x, y, K)
            samples = timed_rounds(steps, args.rounds)
            allocator = "malloc keeps freed memory" if args.keep_freed_memory else "default malloc"
            print(f"\n{name} ({count / 1e6:.1f}M parameters), K={K}, batch {x.shape[0]}, {allocator}")
            print("| strategy | ms per step | ratio to weighted sum | peak memory of a step, MB |")
            print("|---|---|---|---|")
            for label, seconds in samples.items():
                reference = "weighted sum, 8 micro-batches" if "micro" in label else "weighted sum"
                peak = peak_step_memory(name, K, label, args.keep_freed_memory, x.shape[0]) / 1e6
                milliseconds = statistics.median(seconds) * 1e3
                print(
                    f"| {label} | {milliseconds:.1f} | {ratio(samples, label, reference):.2f} | {peak:.1f} |"
                )
            print_targets(samples)
            if args.breakdown:
                print_breakdown(breakdown(steps), samples)


def print_targets(samples: dict[str, list[float]]) -> None:
    """The issue's targets, as measured in this run (ratios within rounds, medians over rounds)."""
    pairs = zip(samples["mogo full, batched"], samples["mogo full, sequential"], strict=True)
    samples = {**samples, "mogo full": [min(pair) for pair in pairs]}

    def to(label: str, reference: str = "weighted sum") -> float:
        return ratio(samples, label, reference)

    c = to("mogo full")
    micro = to("mogo 8 micro-batches, N=10", "weighted sum, 8 micro-batches")
    print(
        f"full step / floor {to('mogo full', 'floor: fwd + K bwd'):.2f} (target <= 1.1); "
        f"full / torchjd MGDA {to('mogo full', 'torchjd MGDA'):.2f} (<= 1); "
        f"between harmonizations {to('mogo between harmonizations'):.2f} (<= 1.05); "
        f"N=10 average {to('mogo amortized N=10'):.2f} against 1 + (c - 1) / 10 = {1 + (c - 1) / 10:.2f} "
        f"(within 1.1x); 8 micro-batches, N=10 {micro:.2f} (<= 1.1)"
    )


if __name__ == "__main__":
    main()
