"""benchmarks/inference_gpu_bench.py, the GPU scale's inference check, runs its whole path on CPU: the in-process
engine on the smoke shape, and `--server` against a real `agentgym inference serve` (vLLM's place on a GPU)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentgym.messaging import free_port

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "inference_gpu_bench.py"
SMALL = ["--conversations", "3", "--turns", "2", "--repeats", "1", "--max-tokens", "4", "--prompt-tokens", "16"]
SMALL += ["--observation-tokens", "8"]


def bench(*options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *options], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_engine_on_the_smoke_shape_reports_throughput_latency_and_prefix_reuse() -> None:
    result = bench("--smoke", *SMALL)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"one stream [0-9.]+ decode tokens/s, 256-token prefill [0-9.]+ s", result.stdout)
    # Every conversation's second turn starts with its first turn's prompt and reply: the prefix cache serves them.
    reuse = re.search(r"\[1/1\] +[0-9.]+ generated tokens/s, turn p50 [0-9.]+ s, prefix cache (\d+)%", result.stdout)
    assert reuse and int(reuse.group(1)) > 0, result.stdout
    assert "## platform engine (float32 on cpu), shape smoke, 3 conversations x 2 turns x 4 tokens" in result.stdout


@pytest.mark.slow
def test_a_completions_server_is_measured_through_the_client(tiny_dir: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "agentgym.cli", "inference", "serve", "--model", str(tiny_dir)]
    server = subprocess.Popen(
        [*command, "--port", str(port), "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.3)
        result = bench("--server", url, "--model-dir", str(tiny_dir), *SMALL)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"## server {url}, model {tiny_dir}, 3 conversations x 2 turns x 4 tokens" in result.stdout


def test_bad_options_are_usage_errors_before_any_work(tmp_path: Path) -> None:
    for options, message in (
        (["--conversations", "0"], "--conversations, --turns"),
        (["--tokenizer", str(tmp_path)], "--tokenizer: no tokenizer.json"),
        (["--server", "http://127.0.0.1:9", "--model-dir", str(tmp_path)], "--model-dir: no config.json"),
        (["--server", "http://127.0.0.1:9"], "--server needs --model-dir"),
    ):
        result = bench(*options)
        assert result.returncode == 2 and message in result.stderr, result.stderr[-500:]
