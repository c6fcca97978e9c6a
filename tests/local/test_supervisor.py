"""The local supervisor's children: their environment (the processes of a run share the machine's cores)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from agentgym.local.supervisor import ProcessSpec, Supervisor

PRINT_WAIT_POLICY = "import os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('PYTHONUNBUFFERED'))"


def test_children_get_sleeping_openmp_threads_unless_told_otherwise(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path / "logs", tmp_path / "events.jsonl")

    async def run(name: str, env: dict[str, str]) -> str:
        managed = await supervisor.start(ProcessSpec(name, [sys.executable, "-c", PRINT_WAIT_POLICY], env=env))
        assert await asyncio.to_thread(managed.process.wait, 60) == 0
        return managed.log_path.read_text().strip()

    assert asyncio.run(run("default", {})) == "PASSIVE 1"
    assert asyncio.run(run("chosen", {"OMP_WAIT_POLICY": "ACTIVE"})) == "ACTIVE 1"  # a spec's own setting wins
