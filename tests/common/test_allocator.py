"""`agentgym.allocator`: freed large buffers are reused instead of faulted in afresh."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from agentgym.allocator import DISABLE_VARIABLE, retain_freed_memory

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"
)

# Allocates, writes and frees a 64 MiB tensor 32 times; prints the minor page faults of the last 16 (the heap
# settles into its layout over the first few).
PROBE = """
import json, resource, sys
import torch
from agentgym.allocator import retain_freed_memory
applied = retain_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(32):
    if i == 16:
        before = faults()
    buffer = torch.ones(16 << 20)  # 64 MiB of float32, written in full
    del buffer
print(json.dumps({"applied": applied, "faults": faults() - before}))
"""


def probe(disabled: bool) -> dict[str, int]:
    env = {**os.environ, DISABLE_VARIABLE: "0" if disabled else "1"}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@glibc_only
def test_retained_memory_is_reused_without_page_faults() -> None:
    pages = 16 * (64 << 20) // 4096  # what 16 fresh 64 MiB mappings fault in (4 KiB pages)
    default = probe(disabled=True)
    retained = probe(disabled=False)
    assert not default["applied"] and retained["applied"]
    assert default["faults"] > pages // 2, default  # glibc maps and unmaps each one afresh
    # Mostly reused: now and then another allocation splits the freed block and the heap grows once more.
    assert retained["faults"] < pages // 4, retained


def test_limit_must_fit_mallopt() -> None:
    with pytest.raises(ValueError, match="limit must be in"):
        retain_freed_memory(0)
    with pytest.raises(ValueError, match="limit must be in"):
        retain_freed_memory(1 << 31)


def test_disabled_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_VARIABLE, "off")
    assert retain_freed_memory() is False


def test_an_unknown_setting_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_VARIABLE, "sometimes")
    with pytest.raises(ValueError, match="AGENTGYM_RETAIN_FREED_MEMORY='sometimes'"):
        retain_freed_memory()
