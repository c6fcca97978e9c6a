"""CPU sharing benchmark: two PyTorch processes on the same cores, OpenMP threads busy-waiting vs sleeping.

`agentgym run` puts the inference server and the trainer (and the rest) on one machine. Each PyTorch process
starts as many OpenMP threads as there are cores, and libgomp's threads busy-wait after each parallel region
by default. When two such processes compute at once (the run's first evaluation while the trainer fine-tunes)
the spinning threads of one take the cores the other computes on. The local supervisor therefore starts its
children with ``OMP_WAIT_POLICY=PASSIVE`` (threads sleep). Measured here, in one run, with two workloads shaped
like the run's: a decode loop (many small ops: inference) and forward/backward passes (the trainer):
  - each alone, with the default policy and with PASSIVE;
  - both at once, with the default policy (the baseline) and with PASSIVE.

Usage: python benchmarks/cpu_sharing_bench.py [--decode-steps 300] [--train-steps 60]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

DECODE = """
import sys, torch
x, w, head = torch.randn(32, 256), torch.randn(256, 1024), torch.randn(256, 49152)
for _ in range(int(sys.argv[1])):
    torch.softmax((torch.relu(x @ w) @ w.T) @ head, -1)
"""
TRAIN = """
import sys, torch
x, w = torch.randn(2048, 256, requires_grad=True), torch.randn(256, 1024, requires_grad=True)
for _ in range(int(sys.argv[1])):
    (torch.relu(x @ w) @ w.T).sum().backward()
"""


def run_together(jobs: list[tuple[str, int]], policy: str | None) -> float:
    """Wall seconds until every job (a script and its step count) has finished, all started at once."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    started = time.perf_counter()
    processes = [subprocess.Popen([sys.executable, "-c", script, str(steps)], env=env) for script, steps in jobs]
    for process in processes:
        if process.wait() != 0:
            raise SystemExit(f"a workload failed with exit code {process.returncode}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-steps", type=int, default=300)
    parser.add_argument("--train-steps", type=int, default=60)
    args = parser.parse_args()
    decode, train = (DECODE, args.decode_steps), (TRAIN, args.train_steps)
    print(f"# {os.cpu_count()} CPUs; wall seconds, process start included")
    both: dict[str, float] = {}
    for label, policy in (("default (busy-wait)", None), ("PASSIVE (sleep)", "PASSIVE")):
        alone = run_together([decode], policy) + run_together([train], policy)
        both[label] = run_together([decode, train], policy)
        print(f"{label:<20} one after the other {alone:6.1f} s   both at once {both[label]:6.1f} s")
    baseline, passive = both["default (busy-wait)"], both["PASSIVE (sleep)"]
    print(f"both at once: PASSIVE {passive:.1f} s vs default {baseline:.1f} s -> {baseline / passive:.1f}x faster")


if __name__ == "__main__":
    main()
