"""agentgym.trainer.launch: the trainer's command on this machine and the ranks a pod's SIGTERM goes to.

The supervisor itself runs for real, with the DeepSpeed launcher and two ranks, in
test_data_parallel (test_trainer_pod_command_on_two_ranks_over_nats_stops_on_sigterm).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentgym.trainer.launch import local_trainer_command, main, trainer_ranks


def test_one_process_unless_deepspeed_on_several_gpus() -> None:
    args = ["--run", "run.yaml"]
    plain = [sys.executable, "-m", "agentgym.trainer.entrypoint", *args]
    assert local_trainer_command("torch", 0, args, master_port=1) == plain
    assert local_trainer_command("deepspeed", 1, args, master_port=1) == plain
    several = local_trainer_command("deepspeed", 4, args, master_port=29511)
    assert several[:3] == [sys.executable, "-m", "agentgym.trainer.launch"]
    assert several[3] == str(Path(sys.executable).with_name("deepspeed"))  # this environment's launcher
    assert several[4:] == [
        "--num_gpus", "4", "--master_port", "29511", "--module", "agentgym.trainer.entrypoint", *args
    ]  # fmt: skip


def test_signals_go_to_the_trainer_ranks_only() -> None:
    """A launcher-like tree: an intermediate process naming DeepSpeed's launcher and two ranks below it."""
    sleeper = "import time; time.sleep(60)"
    spawn_ranks = (
        "import subprocess, sys, time\n"
        f"rank = [sys.executable, '-c', {sleeper!r}, 'agentgym.trainer.entrypoint']\n"
        "ranks = [subprocess.Popen(rank) for _ in range(2)]\n"
        "time.sleep(60)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", spawn_ranks, "deepspeed.launcher.launch", "agentgym.trainer.entrypoint"]
    )
    try:
        deadline = time.monotonic() + 30
        while len(ranks := trainer_ranks(launcher.pid)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert launcher.pid not in ranks and len(ranks) == 2
        assert trainer_ranks(ranks[0]) == []  # nothing below a rank
    finally:
        import psutil

        for process in [*psutil.Process(launcher.pid).children(recursive=True), psutil.Process(launcher.pid)]:
            process.kill()
        launcher.wait()


def test_needs_a_command_that_exists() -> None:
    with pytest.raises(SystemExit, match="usage"):
        main([])
    with pytest.raises(SystemExit, match=r"/nonexistent/deepspeed: not found; .*pip install deepspeed"):
        main(["/nonexistent/deepspeed", "--num_gpus", "2"])
