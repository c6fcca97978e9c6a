"""`agentgym inference serve` as a real process: it serves, sizes its threads to its cores, exits on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from agentgym.cpus import CPUS_VARIABLE
from agentgym.inference.client import CompletionClient
from agentgym.messaging import free_port


@pytest.mark.slow
async def test_serve_command_serves_and_stops_on_sigterm(tiny_dir: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "agentgym.cli", "inference", "serve", "--model", str(tiny_dir), "--port", str(port)]
    process = subprocess.Popen(
        [*cmd, "--max-batch-size", "8", "--prefix-cache-tokens", "4096", "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, CPUS_VARIABLE: "3"},  # as if its cgroup allowed 3 cores: torch gets all but one
    )
    try:
        async with CompletionClient(f"http://127.0.0.1:{port}", timeout=30) as client:
            deadline = time.monotonic() + 120
            while not await client.health():
                assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
                assert time.monotonic() < deadline, "the server did not become healthy"
                await asyncio.sleep(0.2)
            [completion] = await client.complete([1, 2, 3], max_tokens=3, temperature=0.0)
            assert len(completion.token_ids) == 3 and completion.policy_version == 0
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as response:
            metrics = await response.text()
        assert "agentgym_inference_prefix_cache_capacity_tokens 4096.0" in metrics
        assert "agentgym_inference_torch_threads 2.0" in metrics
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr:
            process.stderr.close()
