"""How many CPU cores this process may really use, and torch threads sized to them.

``os.cpu_count()`` counts the machine's cores, not this process's share of them. In a Kubernetes pod with
``resources.limits.cpu: 2`` on a 64-core node, or under ``taskset``/a cpuset, PyTorch's default of one
OpenMP thread per core it can see starts far more threads than the cores the kernel will run it on; the
threads then wait on each other at every parallel region's barrier. The CFS quota throttles the whole
process once the quota is spent, so oversubscribed decode steps stall for the rest of each period.

`available_cpus` is the smallest of: the affinity mask (``sched_getaffinity``: cpusets, ``taskset``) and the
CPU quota of this process's cgroup (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``),
rounded up, and at least 1. ``AGENTGYM_CPUS`` overrides it (a share of the machine chosen by the caller,
e.g. the local runner splitting cores between inference and the trainer).

`prefer_sleeping_omp_threads`: OpenMP threads that busy-wait between parallel regions (libgomp's default) take
the cores another process is computing on. Inference evaluating while the trainer fine-tuned ran twice as long
as with threads that sleep (``benchmarks/cpu_sharing_bench.py``). Every CPU process of the platform that runs
torch (the inference server, the trainer, the local runner's children) starts with ``OMP_WAIT_POLICY=PASSIVE``
unless it was set; libgomp reads it once, when torch loads it, so it is set before torch is imported.
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping
from pathlib import Path

__all__ = [
    "CPUS_VARIABLE",
    "available_cpus",
    "available_memory",
    "cgroup_cpu_quota",
    "configure_torch_threads",
    "cpu_has_bf16_units",
    "inference_threads",
    "prefer_sleeping_omp_threads",
    "trainer_threads",
]

CPUS_VARIABLE = "AGENTGYM_CPUS"
"""An explicit number of cores for this process (a positive integer), overriding what is measured."""


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _own_cgroup_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and its v1 ``cpu`` controller path, from ``/proc/self/cgroup``."""
    unified: str | None = None
    cpu_v1: str | None = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            unified = path
        elif "cpu" in controllers.split(","):
            cpu_v1 = path
    return unified, cpu_v1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _quota_v2(text: str | None) -> float | None:
    """``cpu.max`` holds ``"<quota> <period>"`` or ``"max <period>"`` (no limit)."""
    if not text:
        return None
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _quota_v1(quota_text: str | None, period_text: str | None) -> float | None:
    """``cpu.cfs_quota_us`` is -1 when unlimited."""
    try:
        quota, period = int(quota_text or ""), int(period_text or "")
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: str | None = None) -> float | None:
    """This process's CPU quota in cores (e.g. 1.5), or None when its cgroup has none.

    Looks at this process's own cgroup and its ancestors (a limit on a parent caps the child), under both the
    mount as seen from inside a container (the cgroup namespace makes it the process's own cgroup) and the
    host's full path."""
    if proc_cgroup is None:
        proc_cgroup = _read(Path("/proc/self/cgroup")) or ""
    unified, cpu_v1 = _own_cgroup_paths(proc_cgroup)
    quotas: list[float] = []
    # cgroup v2 is mounted at the root, or at ``unified`` beside the v1 controllers on a hybrid host
    candidates_v2 = [folder for base in (root, root / "unified") for folder in _ancestors(base, unified or "/")]
    for folder in candidates_v2:
        quota = _quota_v2(_read(folder / "cpu.max"))
        if quota is not None:
            quotas.append(quota)
    for base in (root / "cpu", root / "cpu,cpuacct"):
        for folder in _ancestors(base, cpu_v1 or "/"):
            quota = _quota_v1(_read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us"))
            if quota is not None:
                quotas.append(quota)
    return min(quotas) if quotas else None


def _ancestors(base: Path, cgroup_path: str) -> list[Path]:
    """``base`` joined with ``cgroup_path`` and each of its parents, down to ``base`` itself."""
    parts = [part for part in cgroup_path.split("/") if part]
    return [base.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def available_cpus() -> int:
    """Cores this process can run on at once: affinity capped by the cgroup quota, or ``$AGENTGYM_CPUS``."""
    chosen = os.environ.get(CPUS_VARIABLE, "").strip()
    if chosen:
        try:
            value = int(chosen)
        except ValueError:
            raise ValueError(f"{CPUS_VARIABLE}={chosen!r} is not a positive integer") from None
        if value < 1:
            raise ValueError(f"{CPUS_VARIABLE}={chosen!r} is not a positive integer")
        return value
    cpus = _affinity_cpus()
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def prefer_sleeping_omp_threads(environ: MutableMapping[str, str] | None = None) -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` (default: this process's, before torch loads), unless set."""
    (os.environ if environ is None else environ).setdefault("OMP_WAIT_POLICY", "PASSIVE")


def inference_threads() -> int:
    """Torch threads for a CPU inference engine: the usable cores but one, at least 1.

    The engine's process also runs the HTTP server, tokenisation and detokenisation, and beside it on a shared
    machine run the environment services and the rollout worker. With as many compute threads as cores, a
    parallel region's barrier waits whenever one of them is descheduled: on 2 cores the quickstart's rollout step
    ran at 250-530 tokens/s with 2 threads (faster with another process keeping a core busy than without) and at
    460-580 with 1 (`benchmarks/rollout_engines_bench.py`, `hf:threads=N`)."""
    return max(1, available_cpus() - 1)


def available_memory(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process may still allocate: the kernel's MemAvailable, capped by what is left under the cgroup's
    limit (cgroup v2 `memory.max` less `memory.current`, as a container sees its own cgroup); None where neither
    is known."""
    available = None
    for line in (_read(meminfo) or "").splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    limit, used = _read(cgroup / "memory.max"), _read(cgroup / "memory.current")
    if limit and limit.isdigit() and used and used.isdigit():
        left = max(0, int(limit) - int(used))
        available = left if available is None else min(available, left)
    return available


def trainer_threads() -> int:
    """Torch threads for a trainer rank: the usable cores shared by the ranks on this node (``LOCAL_WORLD_SIZE``,
    set by torch's and DeepSpeed's launchers), at least 1."""
    local_ranks = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    ranks = int(local_ranks) if local_ranks.isdigit() and int(local_ranks) > 0 else 1
    return max(1, available_cpus() // ranks)


def configure_torch_threads(requested: int | None = None) -> int:
    """Set torch's intra-op threads to ``requested`` or to `available_cpus`; returns the count set."""
    import torch

    threads = requested if requested is not None else available_cpus()
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def cpu_has_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX tiles): the trainer's bf16 autocast and the
    inference engine's bf16 matmuls are used only where it does.

    Without them oneDNN emulates bf16 matmuls: a tiny-model forward/backward measured 33x slower than in
    float32 on a 2-core AVX2 EPYC (``benchmarks/cpu_bf16_bench.py``); with them a learning-check update was
    1.06x faster than float32 on an AVX512-BF16 Xeon (``benchmarks/packed_attention_bench.py``).
    """
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
