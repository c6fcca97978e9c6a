"""PID 1 of a multi-GPU trainer pod: ``python -m agentgym.trainer.launch deepspeed --num_gpus 8 --module ...``.

Runs the DeepSpeed launcher as its child and hands SIGTERM / SIGINT to the trainer ranks alone, so a
pod being stopped ends the way a one-process trainer does: rank 0 finishes the step in progress,
checkpoints, and stops the other ranks; the exit status is the launcher's (0).

Without it the launcher's runner would be PID 1, which ignores signals it has no handler for (the
kernel's rule for init): the pod would sit out its grace period and be killed. Passing the signal to
the launcher's ``launch`` process does not help either: it passes it on to the ranks and then kills
them 30 seconds later, checkpoint written or not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

__all__ = ["deepspeed_launcher", "local_trainer_command", "main", "trainer_ranks"]

log = logging.getLogger(__name__)

TRAINER_MODULE = "agentgym.trainer.entrypoint"


def local_trainer_command(backend: str, gpus: int, trainer_args: list[str], *, master_port: int) -> list[str]:
    """The trainer on this machine: ``python -m agentgym.trainer.entrypoint <args>``, or for DeepSpeed on
    several GPUs that module under the DeepSpeed launcher under this supervisor (this interpreter's
    environment: the launcher starts the ranks with it)."""
    if backend != "deepspeed" or gpus <= 1:
        return [sys.executable, "-m", TRAINER_MODULE, *trainer_args]
    return [sys.executable, "-m", __name__, *deepspeed_launcher(gpus, trainer_args, master_port=master_port)]


def deepspeed_launcher(gpus: int, trainer_args: list[str], *, master_port: int) -> list[str]:
    """This environment's ``deepspeed`` launcher running the trainer module on ``gpus`` local GPUs."""
    deepspeed = str(Path(sys.executable).with_name("deepspeed"))
    launcher = [deepspeed, "--num_gpus", str(gpus), "--master_port", str(master_port), "--module", TRAINER_MODULE]
    return [*launcher, *trainer_args]


def trainer_ranks(root_pid: int) -> list[int]:
    """The trainer rank processes below ``root_pid``: they run the trainer module and are not DeepSpeed's launcher."""
    import psutil  # DeepSpeed's dependency: present wherever its launcher is

    ranks = []
    for process in psutil.Process(root_pid).children(recursive=True):
        try:
            command = process.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if TRAINER_MODULE in command and not any("deepspeed.launcher" in part for part in command):
            ranks.append(process.pid)
    return ranks


def main(argv: list[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        raise SystemExit("usage: python -m agentgym.trainer.launch <launcher command ...>")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        child = subprocess.Popen(command)
    except FileNotFoundError:
        raise SystemExit(
            f"{command[0]}: not found; several GPUs train under the DeepSpeed launcher (pip install deepspeed)"
        ) from None

    def forward(signum: int, frame: FrameType | None) -> None:
        ranks = trainer_ranks(child.pid)
        log.info("signal %d: passing it to the trainer ranks %s", signum, ranks)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    return child.wait()


if __name__ == "__main__":
    raise SystemExit(main())
