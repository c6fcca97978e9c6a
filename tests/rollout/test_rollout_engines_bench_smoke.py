"""benchmarks/rollout_engines_bench.py on a few short episodes: every engine named comes up, plays, gets its table row
and JSON figure, and the run leaves nothing in the temporary directory (figures: by hand, in issue #30's notes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentgym.local.supervisor import scratch_tmpdir

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "rollout_engines_bench.py"


@pytest.mark.slow
def test_rollout_engines_bench_smoke() -> None:
    command = [sys.executable, str(BENCH), "--models", "builtin:tiny", "--engines", "hf,hf:bf16,hf:rev=HEAD"]
    command += ["--episodes", "4", "--turns", "2", "--repeats", "1", "--no-weight-updates"]
    scratch, scratch_environment = scratch_tmpdir("bench-smoke", os.environ)
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=400,
            env={**os.environ, **scratch_environment},
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert list(scratch.iterdir()) == []  # each server's scratch folder went with it
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    lines = result.stdout.splitlines()
    assert any(line.split()[:3] == ["engine", "tokens/s", "episodes/s"] for line in lines)
    rows = {
        line.split()[0]: line.split() for line in lines if line.split()[:1] in (["hf"], ["hf:bf16"], ["hf:rev=HEAD"])
    }
    assert set(rows) == {"hf", "hf:bf16", "hf:rev=HEAD"} and rows["hf"][5] == "1.00x"  # the first is the baseline
    figures = json.loads(lines[-1])
    assert figures["model"] == "builtin:tiny"
    assert all(figures[engine] > 0 for engine in rows)
