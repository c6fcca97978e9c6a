"""The cores a process may use: affinity, cgroup quotas (v1 and v2, own cgroup and ancestors), overrides."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentgym import cpus
from agentgym.cpus import (
    CPUS_VARIABLE,
    available_cpus,
    cgroup_cpu_quota,
    inference_threads,
    prefer_sleeping_omp_threads,
    trainer_threads,
)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_a_v2_quota_inside_a_container_is_read_from_the_namespace_root(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "150000 100000")
    assert cgroup_cpu_quota(tmp_path, "0::/\n") == 1.5


def test_no_limit_is_no_quota(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "max 100000")
    write(tmp_path / "cpu" / "cpu.cfs_quota_us", "-1")
    write(tmp_path / "cpu" / "cpu.cfs_period_us", "100000")
    assert cgroup_cpu_quota(tmp_path, "0::/\n1:cpu,cpuacct:/\n") is None
    assert cgroup_cpu_quota(tmp_path / "missing", "0::/\n") is None


def test_a_limit_on_a_parent_cgroup_caps_the_child(tmp_path: Path) -> None:
    pod = tmp_path / "kubepods" / "pod1"
    write(pod / "cpu.max", "400000 100000")
    write(pod / "container" / "cpu.max", "max 100000")
    write(tmp_path / "kubepods" / "cpu.max", "max 100000")
    assert cgroup_cpu_quota(tmp_path, "0::/kubepods/pod1/container\n") == 4.0


def test_the_smallest_of_several_limits_wins(tmp_path: Path) -> None:
    write(tmp_path / "a" / "cpu.max", "300000 100000")
    write(tmp_path / "a" / "b" / "cpu.max", "50000 100000")
    assert cgroup_cpu_quota(tmp_path, "0::/a/b\n") == 0.5


def test_a_v1_quota_and_a_hybrid_hosts_unified_mount(tmp_path: Path) -> None:
    write(tmp_path / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us", "250000")
    write(tmp_path / "cpu,cpuacct" / "job" / "cpu.cfs_period_us", "100000")
    assert cgroup_cpu_quota(tmp_path, "3:cpu,cpuacct:/job\n0::/\n") == 2.5
    write(tmp_path / "unified" / "svc" / "cpu.max", "100000 100000")
    assert cgroup_cpu_quota(tmp_path, "3:cpu,cpuacct:/job\n0::/svc\n") == 1.0


def test_unreadable_or_odd_files_are_ignored(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "garbage")
    write(tmp_path / "cpu" / "cpu.cfs_quota_us", "x")
    write(tmp_path / "cpu" / "cpu.cfs_period_us", "0")
    assert cgroup_cpu_quota(tmp_path, "not a cgroup line\n0::/\n1:cpu:/\n") is None


def test_available_cpus_rounds_a_quota_up_and_keeps_under_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPUS_VARIABLE, raising=False)
    monkeypatch.setattr(cpus, "_affinity_cpus", lambda: 8)
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: 1.5)
    assert available_cpus() == 2
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: 0.1)
    assert available_cpus() == 1
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: 64.0)
    assert available_cpus() == 8
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: None)
    assert available_cpus() == 8


def test_the_override_wins_and_a_bad_one_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPUS_VARIABLE, "3")
    assert available_cpus() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(CPUS_VARIABLE, bad)
        with pytest.raises(ValueError, match=CPUS_VARIABLE):
            available_cpus()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="affinity masks are Linux-only")
def test_a_process_pinned_to_one_core_sizes_torch_to_one_thread() -> None:
    """The real mask, as `taskset` or a cpuset sets it, in a child process."""
    code = (
        "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
        "from agentgym.cpus import available_cpus, configure_torch_threads; "
        "import torch; print(available_cpus(), configure_torch_threads(), torch.get_num_threads())"
    )
    env = {key: value for key, value in os.environ.items() if key != CPUS_VARIABLE}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["1", "1", "1"]


def test_inference_leaves_one_core_to_the_rest_of_its_process_and_neighbours(monkeypatch: pytest.MonkeyPatch) -> None:
    for cores, threads in ((1, 1), (2, 1), (3, 2), (16, 15)):
        monkeypatch.setenv(CPUS_VARIABLE, str(cores))
        assert inference_threads() == threads


def test_openmp_threads_sleep_unless_the_caller_chose_otherwise() -> None:
    environment: dict[str, str] = {}
    prefer_sleeping_omp_threads(environment)
    assert environment == {"OMP_WAIT_POLICY": "PASSIVE"}
    chosen = {"OMP_WAIT_POLICY": "ACTIVE"}
    prefer_sleeping_omp_threads(chosen)
    assert chosen == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_trainer_ranks_on_one_node_share_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPUS_VARIABLE, "8")
    for local_ranks, threads in (("", 8), ("1", 8), ("2", 4), ("3", 2), ("16", 1), ("junk", 8), ("0", 8)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
        assert trainer_threads() == threads


def test_the_trainer_process_sets_the_wait_policy_before_torch_loads() -> None:
    code = "import sys; import agentgym.trainer.entrypoint as e; import os; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["PASSIVE"]


TRAINER = ["-m", "agentgym.trainer.entrypoint", "--run", "examples/quickstart.yaml", "--nats-url", "nats://127.0.0.1:1"]


@pytest.mark.parametrize(
    ("command", "code"),
    [
        (["-m", "agentgym.cli", "inference", "serve"], 2),  # a usage error of the CLI
        (["-m", "agentgym.cli", "env", "serve", "babyai"], 2),
        (TRAINER, 1),
    ],
    ids=["inference", "env-service", "trainer"],
)
def test_a_bad_core_count_is_refused_naming_the_variable_before_anything_starts(command: list[str], code: int) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, CPUS_VARIABLE: "two"}
    done = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, cwd=root, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == code and f"{CPUS_VARIABLE}='two' is not a positive integer" in output, output
    assert "Traceback" not in output
