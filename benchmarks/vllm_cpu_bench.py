"""vLLM's CPU backend vs the platform's HF engine on the quickstart's rollout workload, in one run.

Both engines are started with the platform's own launch lines (`agentgym.plan.inference_server` for
examples/quickstart.yaml with `inference.engine` hf, then vllm; the vLLM one on `.venv-vllm`'s python), on the
same model (the quickstart's `builtin:tiny`) and the same machine, one after the other, against one BabyAI service
started from the same plan. Each engine plays the same rollout step: 32 concurrent multi-turn BabyAI episodes
(4 tasks x 8 samples, up to --turns turns, 36 tokens a turn, temperature 1, as the quickstart's GRPO step), after
a warm-up. Printed per engine and as vLLM / HF ratios:
  - sampled tokens/s over the step's wall time, and turns/s;
  - turn latency (one completion call of one episode) p50 / p99;
  - weight-update seconds: the platform's weight roll (`agentgym.operator.weights`) of another checkpoint folder
    of the same architecture, median of 3;
  - memory: peak resident set size of the inference server's process tree during the step.

Usage: python benchmarks/vllm_cpu_bench.py [--episodes 32] [--turns 5] [--repeats 1]
Needs scripts/setup-vllm.sh (`make vllm`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import psutil

from agentgym.envs.client import AsyncEnvClient
from agentgym.inference.client import CompletionClient
from agentgym.inference.models import load_tokenizer, resolve_model, tiny_model_dir
from agentgym.local.runner import local_command, vllm_python
from agentgym.messaging import free_port
from agentgym.operator.manifests import Checkpoint
from agentgym.operator.weights import Replica, roller_for, sync_replicas
from agentgym.plan import Placement, environment_service, inference_server
from agentgym.proto import rl_pb2
from agentgym.rollout.episode import EpisodeSettings, Sample, run_episode
from agentgym.rollout.policy import InferencePolicy
from agentgym.rollout.prompts import template_for
from agentgym.rollout.tokens import ChatTokenizer
from agentgym.spec import TrainingRun, load_training_run

ROOT = Path(__file__).resolve().parents[1]


def tree_rss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


@contextmanager
def serve(argv: list[str], env: dict[str, str], health_url: str, timeout: float = 600.0) -> Iterator[int]:
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env}, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(health_url, timeout=2).raise_for_status()
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline or proc.poll() is not None:
                os.killpg(proc.pid, 9)
                raise RuntimeError(f"{argv[:4]} did not start") from None
            time.sleep(0.5)
    try:
        yield proc.pid
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


class TimedPolicy(InferencePolicy):
    """Records each completion call's latency and sampled tokens."""

    def __init__(self, client: CompletionClient) -> None:
        super().__init__(client)
        self.latencies: list[float] = []
        self.tokens = 0

    async def sample(self, prompt_ids: list[int], **kwargs: object) -> Sample:
        started = time.perf_counter()
        sample = await super().sample(prompt_ids, **kwargs)  # type: ignore[arg-type]
        self.latencies.append(time.perf_counter() - started)
        self.tokens += len(sample.token_ids)
        return sample


def requests(count: int, turns: int, max_tokens: int, group: int = 8) -> list[rl_pb2.RolloutRequest]:
    return [
        rl_pb2.RolloutRequest(
            run="bench",
            request_id=f"bench/{n}",
            environment="babyai",
            task_id=f"GoToRedBall/s{n // group}",
            max_turns=turns,
            max_tokens_per_turn=max_tokens,
            temperature=1.0,
            top_p=1.0,
            seed=n + 1,
        )
        for n in range(count)
    ]


async def play(
    batch: list[rl_pb2.RolloutRequest], inference_url: str, env_url: str, chat: ChatTokenizer, context: int
) -> tuple[float, TimedPolicy, list[rl_pb2.Trajectory]]:
    async with (
        CompletionClient(inference_url) as client,
        AsyncEnvClient(env_url, max_connections=len(batch)) as env,
    ):
        policy = TimedPolicy(client)
        settings = EpisodeSettings(max_context_tokens=context)
        started = time.perf_counter()
        trajectories = await asyncio.gather(
            *(run_episode(r, env, policy, chat, template_for("babyai"), settings) for r in batch)
        )
        return time.perf_counter() - started, policy, list(trajectories)


async def weight_roll_seconds(engine: str, url: str, folders: list[Path]) -> float:
    times = []
    async with aiohttp.ClientSession() as session:
        roller = roller_for(engine, session, timeout=600)
        for version, folder in enumerate(folders, start=1):
            started = time.perf_counter()
            result = await sync_replicas(
                roller, [Replica("inference", url, 0)], Checkpoint(version, f"file://{folder}")
            )
            times.append(time.perf_counter() - started)
            if result.failed or result.served != version:
                raise RuntimeError(f"{engine}: weight roll failed: {result}")
    return statistics.median(times)


@dataclass
class Figures:
    engine: str
    wall: float = 0.0
    tokens: int = 0
    turns: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    peak_rss: int = 0
    update_s: float = 0.0

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(engine: str, run: TrainingRun, env_url: str, args: argparse.Namespace, chat: ChatTokenizer) -> Figures:
    run = run.model_copy(deep=True)
    run.spec.inference.engine = engine  # type: ignore[assignment]
    port = free_port()
    placement = Placement(
        spec_path="-",
        nats_url="-",
        inference_url=f"http://127.0.0.1:{port}",
        env_urls={"babyai": env_url},
        bind_host="127.0.0.1",
        http_ports={"inference": port},
    )
    component = inference_server(run, placement)
    url = placement.inference_url
    figures = Figures(engine)
    context = run.spec.model.max_context_tokens
    with serve(local_command(component.command), dict(component.env), f"{url}/health") as pid:
        asyncio.run(play(requests(4, 2, 8, group=1), url, env_url, chat, context))  # warm-up (vLLM: ~25 s)
        stop = threading.Event()

        def sample_memory() -> None:
            while not stop.is_set():
                figures.peak_rss = max(figures.peak_rss, tree_rss(pid))
                stop.wait(0.2)

        sampler = threading.Thread(target=sample_memory, daemon=True)
        sampler.start()
        for _ in range(args.repeats):
            wall, policy, trajectories = asyncio.run(
                play(requests(args.episodes, args.turns, args.max_tokens), url, env_url, chat, context)
            )
            figures.wall += wall
            figures.tokens += policy.tokens
            figures.latencies += policy.latencies
            figures.turns += sum(t.turns_used for t in trajectories)
            figures.errors += sum(t.termination == rl_pb2.TERMINATION_ERROR for t in trajectories)
        stop.set()
        sampler.join()
        others = [tiny_model_dir(seed=s) for s in (1, 2, 3)]
        figures.update_s = asyncio.run(weight_roll_seconds(engine, url, others))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=5, help="the quickstart's last horizon")
    parser.add_argument("--max-tokens", type=int, default=36, help="the quickstart's maxTokensPerTurn")
    parser.add_argument("--repeats", type=int, default=1, help="rollout steps per engine")
    args = parser.parse_args()
    if not vllm_python().exists():
        raise SystemExit(f"no vLLM environment at {vllm_python()}: run scripts/setup-vllm.sh")

    run = load_training_run(ROOT / "examples" / "quickstart.yaml")
    model = resolve_model(run.spec.model.name)
    for seed in (1, 2, 3):
        tiny_model_dir(seed=seed)  # the weight-roll checkpoints, built before anything is timed
    chat = ChatTokenizer(load_tokenizer(model))
    env_port = free_port()
    env_url = f"http://127.0.0.1:{env_port}"
    env_placement = Placement(
        spec_path="-", nats_url="-", inference_url="-", env_urls={}, bind_host="127.0.0.1", grpc_port=0,
        http_ports={"env-babyai": env_port},
    )  # fmt: skip
    env_component = environment_service(run.spec.environments[0], env_placement)
    with serve(local_command(env_component.command), {}, f"{env_url}/healthz"):
        hf = measure("hf", run, env_url, args, chat)
        vllm = measure("vllm", run, env_url, args, chat)

    print(
        f"# vLLM CPU (vllm-cpu 0.32.0) vs the HF engine: {args.episodes} concurrent BabyAI episodes x <= {args.turns}"
        f" turns x {args.max_tokens} tokens, {run.spec.model.name}, x{args.repeats}; {os.cpu_count()} CPUs"
    )
    print(f"{'engine':8} {'tokens/s':>9} {'turns/s':>8} {'turn p50':>9} {'turn p99':>9} {'update':>8} {'peak RSS':>9}")
    for f in (hf, vllm):
        print(
            f"{f.engine:8} {f.tokens / f.wall:9.1f} {f.turns / f.wall:8.2f} {f.pct(0.5):8.2f}s {f.pct(0.99):8.2f}s "
            f"{f.update_s:7.2f}s {f.peak_rss / 2**30:7.2f}GB"
            + (f"  ({f.errors} episodes ended in errors)" if f.errors else "")
        )
    print(
        f"vLLM / HF: tokens/s {vllm.tokens / vllm.wall / (hf.tokens / hf.wall):.2f}x, "
        f"turn p50 {vllm.pct(0.5) / hf.pct(0.5):.2f}x, p99 {vllm.pct(0.99) / hf.pct(0.99):.2f}x, "
        f"weight update {vllm.update_s / hf.update_s:.2f}x, memory {vllm.peak_rss / hf.peak_rss:.2f}x"
    )


if __name__ == "__main__":
    main()
