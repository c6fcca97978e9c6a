"""The local supervisor's children: their environment (the processes of a run share the machine's cores) and
their scratch folders."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agentgym.local.supervisor import ManagedProcess, ProcessSpec, Supervisor

PRINT_WAIT_POLICY = "import os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('PYTHONUNBUFFERED'))"


def test_children_get_sleeping_openmp_threads_unless_told_otherwise(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path / "logs", tmp_path / "events.jsonl")

    async def run(name: str, env: dict[str, str]) -> str:
        managed = await supervisor.start(ProcessSpec(name, [sys.executable, "-c", PRINT_WAIT_POLICY], env=env))
        assert await asyncio.to_thread(managed.process.wait, 60) == 0
        return managed.log_path.read_text().strip()

    assert asyncio.run(run("default", {})) == "PASSIVE 1"
    assert asyncio.run(run("chosen", {"OMP_WAIT_POLICY": "ACTIVE"})) == "ACTIVE 1"  # a spec's own setting wins
    supervisor.stop_all()  # removes the exited children's scratch folders


# A child that leaves what a killed server leaves in its temporary folder: a file and a bound Unix socket.
LEAVE_TEMP_FILES = """
import os, socket, sys, tempfile, time
folder = tempfile.gettempdir()
open(os.path.join(folder, "vllm_dist_x"), "w").close()
socket.socket(socket.AF_UNIX).bind(os.path.join(folder, "s"))
open(sys.argv[1], "w").write(os.environ["TORCHINDUCTOR_CACHE_DIR"])
print(folder, flush=True)
time.sleep(600)
"""


def test_each_start_gets_its_own_tmpdir_removed_however_the_child_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent_tmp = tmp_path / "tmp"
    parent_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(parent_tmp))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    supervisor = Supervisor(tmp_path / "logs", tmp_path / "events.jsonl")
    inductor = tmp_path / "logs" / "inductor"
    spec = ProcessSpec("server", [sys.executable, "-c", LEAVE_TEMP_FILES, str(inductor)], env={"TMPDIR": "/ignored"})

    def folders_printed(managed: ManagedProcess, count: int) -> list[Path]:
        deadline = time.monotonic() + 60
        while len(lines := managed.log_path.read_text().split()) < count:
            assert time.monotonic() < deadline and managed.process.poll() is None, managed.log_path.read_text()
            time.sleep(0.05)
        return [Path(line) for line in lines]

    async def run() -> None:
        managed = await supervisor.start(spec)
        [first] = folders_printed(managed, 1)
        assert first.parent == parent_tmp and first.name.startswith("agentgym-server-")
        assert sorted(p.name for p in first.iterdir()) == ["s", "vllm_dist_x"]
        # torch inductor's kernel cache (by default in the temporary directory) stays where it was
        assert inductor.read_text().startswith(f"{parent_tmp}/torchinductor_")
        os.kill(managed.process.pid, signal.SIGKILL)  # a crash: nothing of the child's own cleans up
        stop = asyncio.Event()
        watching = asyncio.create_task(supervisor.watch(stop, poll_s=0.05))
        while managed.restarts == 0:
            await asyncio.sleep(0.05)
        _, second = await asyncio.to_thread(folders_printed, managed, 2)
        assert not first.exists() and second.exists() and second != first  # the crashed start's folder went
        stop.set()
        await watching

    asyncio.run(run())
    supervisor.stop_all(timeout_s=10)
    assert list(parent_tmp.iterdir()) == []  # the running child's folder went with it
