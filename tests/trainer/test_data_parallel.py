"""Data-parallel training over two ranks, for real: two processes, gloo, DeepSpeed's CPU accelerator.

The slow tests start the ranks as the DeepSpeed launcher does (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): first the trainer calls alone
(``data_parallel_run.py``: equal to one rank's training, exact resume), then the trainer process
itself over a real nats-server, stopped with SIGTERM as Kubernetes stops a pod. Not exercised here:
NCCL, CUDA and bf16 (no GPU on this machine).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from trainer_helpers import UPDATE_GAP_BOUND, fake_rollout_worker

from agentgym.messaging import EmbeddedNats, free_port
from agentgym.proto import rl_pb2
from agentgym.trainer.checkpoint import checkpoint_dirs
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.deepspeed_backend import launcher_command
from agentgym.trainer.distributed import DataParallel
from agentgym.trainer.trainer import RLTrainer

HERE = Path(__file__).resolve().parent


def _rl_steps(metrics: Path) -> list[int]:
    """The RL steps in ``metrics.jsonl`` (the SFT warm-up writes its own lines there)."""
    lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return [line["step"] for line in lines if not any(key.startswith("sft/") for key in line)]


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }


# --- one rank: every helper is trivial --------------------------------------------------------------


def test_one_rank_shards_nothing_and_talks_to_no_one() -> None:
    dp = DataParallel()
    assert dp.is_main and not dp.enabled
    assert dp.shard([1, 2, 3]) == [1, 2, 3]
    assert dp.broadcast("x") == "x" and dp.gather(5) == [5]
    dp.announce("train_step", [])  # nothing to tell
    dp.barrier()


def test_shard_is_round_robin_and_padded_to_the_same_length() -> None:
    rows = ["a", "b", "c", "d", "e"]
    shares = [DataParallel(rank=r, world_size=3).shard(rows) for r in range(3)]
    assert shares == [["a", "d"], ["b", "e"], ["c", None]]  # None: a zero-weighted pass on rank 2
    assert [DataParallel(rank=r, world_size=2).shard(["a"]) for r in range(2)] == [["a"], [None]]
    assert DataParallel(rank=1, world_size=2).shard([]) == []


def test_shard_by_size_evens_out_the_work() -> None:
    rows = ["a", "b", "c", "d", "e"]
    tokens = [900, 500, 450, 400, 100]
    shares = [DataParallel(rank=r, world_size=2).shard(rows, tokens) for r in range(2)]
    # Largest first, each to the lighter rank: a -> 0; b, c -> 1 (950); d -> 0 (1300); e -> 1 (1050).
    # Rank 0 pads with an idle pass: every rank makes as many passes.
    assert shares == [["a", "d", None], ["b", "c", "e"]]
    with pytest.raises(ValueError, match="one size per item"):
        DataParallel(rank=0, world_size=2).shard(rows, [1])


def test_announce_names_only_trainer_calls_and_only_from_rank_0() -> None:
    with pytest.raises(ValueError, match="not a call the followers make"):
        DataParallel(rank=0, world_size=2).announce("close")
    with pytest.raises(RuntimeError, match="only rank 0"):
        DataParallel(rank=1, world_size=2).announce("train_step", [])


def test_several_ranks_need_the_deepspeed_backend(config_factory: Callable[..., RLTrainerConfig]) -> None:
    with pytest.raises(ValueError, match="needs backend 'deepspeed'"):
        RLTrainer(config_factory(), data_parallel=DataParallel(rank=0, world_size=2))


def test_entrypoint_refuses_several_ranks_with_the_torch_backend(
    config_factory: Callable[..., RLTrainerConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentgym.trainer.entrypoint import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config_factory().to_dict()))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match=r"needs trainer\.backend: deepspeed"):
        main(["--config", str(path), "--nats-url", "nats://127.0.0.1:1"])


# --- two ranks --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "stage"), [("grpo", 3), ("ppo", 2)])
def test_two_ranks_train_like_one_and_resume_exactly(
    algorithm: str, stage: int, tiny_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, str(HERE / "data_parallel_run.py"), algorithm, str(stage), str(tmp_path), str(tiny_model)],
            env=_rank_env(rank, 2, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=600) for rank in ranks]
    for rank, (_, err) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, err[-4000:]
    result = json.loads(outputs[0][0].strip().splitlines()[-1])

    assert result["rows"] == [3, 3]  # an odd number of packed rows: rank 1 makes one zero-weighted pass
    assert result["ranks_agree"]  # both ranks hold the same weights after every call
    assert result["moved"] > 1e-3
    # Two ranks make one rank's update, up to float32 rounding (summation order across ranks, DeepSpeed's
    # AdamW and grad norm against torch's fused ones) amplified by AdamW: trainer_helpers.update_gap.
    assert result["dp_vs_torch"] < UPDATE_GAP_BOUND
    for sft_step in result["sft"]:
        loss, plain_loss = sft_step["sft_loss"]
        assert loss == pytest.approx(plain_loss, rel=1e-6)  # each rank's share of the loss, summed
        assert sft_step["tokens"][0] == sft_step["tokens"][1]
        assert sft_step["grad_norm"][0] == pytest.approx(sft_step["grad_norm"][1], rel=1e-4)
    for step in result["metrics"]:
        for name, (dp_value, plain_value) in step.items():
            assert dp_value == pytest.approx(plain_value, rel=1e-4, abs=1e-6), name
    assert result["counts"] == [6, 6]
    assert result["resumed_vs_straight"] == 0.0  # 1 step + checkpoint + resume on both ranks + 1 step == 2
    assert result["resumed_from"] == result["saved"]
    assert result["policy_version"] == [3, 3]  # the warm-up, then two steps
    # One HF folder for inference, and DeepSpeed's optimizer state with one partition per rank.
    assert {"config.json", "model.safetensors", "engine", "trainer_state.json"} <= set(result["checkpoint_files"])
    assert sum("optim_states" in name for name in result["engine_files"]) == 2
    if algorithm == "ppo":
        assert "critic" in result["checkpoint_files"]


@pytest.mark.slow
async def test_trainer_pod_command_on_two_ranks_over_nats_stops_on_sigterm(
    config_factory: Callable[..., RLTrainerConfig], tmp_path: Path
) -> None:
    """What a 2-GPU trainer pod runs: agentgym.trainer.launch, the real DeepSpeed launcher, two ranks.

    Rank 0 alone talks to NATS, both ranks train, and SIGTERM to the pod's first process (what
    Kubernetes sends) ends the run after a checkpoint, with exit status 0.
    """
    import psutil

    run = "dp-loop"
    config = config_factory(
        run=run,
        backend="deepspeed",
        gpus=2,
        zero_stage=2,
        bf16=False,
        total_steps=50,
        tasks_per_step=2,
        group_size=2,
        mini_batch_size=4,
        micro_batch_tokens=64,
        sft_warmup_steps=2,
        sft_tasks=2,
        sft_batch_size=2,
        collect_timeout_s=30,
        ack_wait_s=30,
    )
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config.to_dict()))
    with EmbeddedNats(tmp_path / "nats") as server:
        stop = asyncio.Event()
        seen: list[rl_pb2.RolloutRequest] = []
        worker = asyncio.create_task(fake_rollout_worker(server.url, run, stop, seen))
        launcher = launcher_command(config_path, 2, master_port=free_port(), extra_args=["--nats-url", server.url])
        launcher[0] = str(Path(sys.executable).with_name("deepspeed"))  # the venv's, wherever PATH points
        log_path = tmp_path / "pod.log"
        with log_path.open("wb") as log:
            pod = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "agentgym.trainer.launch",
                *launcher,
                env={**os.environ, "OMP_NUM_THREADS": "1", "AGENTGYM_TELEMETRY_DIR": str(tmp_path / "telemetry")},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            metrics = config.run_dir / "metrics.jsonl"
            deadline = time.monotonic() + 300
            while len(_rl_steps(metrics)) < 2:
                assert time.monotonic() < deadline, "two steps not trained within 300 s"
                assert pod.returncode is None, "the pod's command exited early"
                await asyncio.sleep(0.5)
            pod.send_signal(signal.SIGTERM)
            await asyncio.wait_for(pod.wait(), 120)
        finally:
            stop.set()
            await worker
            if pod.returncode is None:
                for process in [*psutil.Process(pod.pid).children(recursive=True), psutil.Process(pod.pid)]:
                    process.kill()
    output = log_path.read_text()
    assert pod.returncode == 0, output[-4000:]
    steps = _rl_steps(metrics)
    assert steps[:2] == [0, 1] and len(steps) < config.total_steps  # stopped early, by the signal
    # The last step trained is checkpointed, by both ranks: one optimizer partition each.
    saved = checkpoint_dirs(config.checkpoint_dir)
    assert saved[-1][0] == len(steps)
    assert len(list((saved[-1][1] / "engine").glob("*/zero_pp_rank_*_optim_states.pt"))) == 2
    assert json.loads((saved[-1][1] / "trainer_state.json").read_text())["sft_done"]
    # Only rank 0 asks for rollouts: one request per task and sample of each step trained or asked for.
    assert {r.step for r in seen} <= set(range(len(steps) + 1))
    assert len({(r.step, r.group_id, r.sample_index) for r in seen}) == len(seen)
    assert "rank 1: made" in output and "calls; done" in output  # rank 1 followed, then left with rank 0
