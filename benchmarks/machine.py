"""What machine a benchmark ran on, for the header of its table: the date, the CPU's model and
the instruction sets that decide its kernels (AVX2, AVX-512, bfloat16, AMX), cores and threads,
and torch's version."""

from __future__ import annotations

import os
import platform
from datetime import date
from pathlib import Path

import torch

__all__ = ["cpu_flags", "describe"]

# Flags of /proc/cpuinfo that change which kernels torch, MKL and OpenBLAS run.
NOTABLE = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "avx_vnni")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (empty where ``/proc/cpuinfo`` is not readable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> str:
    """One line: date, CPU model and notable instruction sets, cores, torch threads, torch."""
    flags = cpu_flags()
    notable = ", ".join(flag for flag in NOTABLE if flag in flags) or "none of " + "/".join(NOTABLE)
    return (
        f"{date.today()}, {cpu_model()} ({notable}), {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch thread(s), torch {torch.__version__}"
    )


if __name__ == "__main__":
    print(describe())
