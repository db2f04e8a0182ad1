"""Two-process launches for the multi-process tests: a deadline, and what each rank saved."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accelerate_launch() -> list[str]:
    """``accelerate launch`` of two CPU processes (gloo), with no config file needed."""
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
    ]  # fmt: skip


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def launch(command: list[str], out: Path, env: dict[str, str] | None = None) -> list[dict]:
    """Run ``command`` (with ``env`` added to the environment) under a deadline (a hang fails the
    test, it does not stall CI) and load the ``out/rank{r}.pt`` each of the two ranks saved."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the two-process run did not finish in {TIMEOUT_S} s: {' '.join(command)}")
    assert process.returncode == 0, output[-4000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
