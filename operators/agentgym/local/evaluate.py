"""`agentgym eval`: a policy on an environment split, avg@k / pass@k and max-turn sweeps.

Test-time interaction scaling (AgentGym-RL's Figs 8-9) is measured the same way the platform trains:
real environment service, the inference server on the policy, the rollout loop. Each task is played
k times at each max-turn budget; avg@k is the mean success over all samples, pass@k the unbiased
estimator of Chen et al. (2021): 1 - C(n - c, k) / C(n, k) for n samples of which c succeed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentgym.envs import environment_class
from agentgym.envs.client import AsyncEnvClient
from agentgym.inference.client import CompletionClient
from agentgym.inference.models import load_tokenizer, resolve_model
from agentgym.local.supervisor import ProcessSpec, Supervisor
from agentgym.messaging import free_port
from agentgym.proto import rl_pb2
from agentgym.rollout.episode import EpisodeSettings, run_episode
from agentgym.rollout.policy import InferencePolicy
from agentgym.rollout.prompts import template_for
from agentgym.rollout.tokens import ChatTokenizer
from agentgym.seeding import derive_seed

log = logging.getLogger(__name__)

REASON_CHARS = 200
"""An error reason is kept to this many characters in a summary (a traceback-sized one would swamp it)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k: 1 - C(n - c, k) / C(n, k), the chance that k of the n samples include a success."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def k_values(samples: int) -> list[int]:
    """1, 2, 4, ... up to `samples`, plus `samples` itself."""
    ks, k = [], 1
    while k < samples:
        ks.append(k)
        k *= 2
    return [*ks, samples]


@dataclass
class EvalSettings:
    environment: str
    split: str = "test"
    tasks: int = 40
    samples: int = 4
    max_turns: list[int] = field(default_factory=lambda: [20])
    temperature: float = 1.0
    top_p: float = 1.0
    """Nucleus sampling, as the run's ``rollout.topP``: a policy is measured as it is sampled in training."""
    max_tokens_per_turn: int = 64
    max_context_tokens: int = 4096
    concurrency: int = 32
    seed: int = 0
    spread: bool = False
    """Fewer tasks than the split holds: False takes the first ``tasks``, True spreads them evenly over the split."""
    env_settings: list[str] = field(default_factory=list)
    """``KEY=VALUE`` settings for the environment service (``agentgym env serve --set``)."""


def eval_task_ids(environment: str, split: str, tasks: int, spread: bool = False) -> list[str]:
    """The task ids an evaluation plays: the first ``tasks`` of ``split``, or ``tasks`` spread evenly over it."""
    catalog = environment_class(environment).catalog()
    if not spread:
        return list(catalog.task_ids(split, limit=tasks))
    size = len(catalog.task_ids(split))
    count = min(tasks, size)
    return [catalog.task_id(split, (i * size) // count) for i in range(count)]


def success_standard_error(successes: dict[str, list[bool]]) -> float:
    """Standard error of the mean success over tasks (each task's success averaged over its samples).

    Tasks are the sampling unit: samples of one task are correlated, so a binomial error over all
    episodes would understate the uncertainty. With one task (or none) the error is 0.
    """
    rates = [sum(values) / len(values) for values in successes.values() if values]
    m = len(rates)
    if m < 2:
        return 0.0
    mean = sum(rates) / m
    return math.sqrt(sum((r - mean) ** 2 for r in rates) / (m - 1) / m)


def summarise(successes: dict[str, list[bool]], scores: dict[str, list[float]], samples: int) -> dict[str, Any]:
    """avg@k, pass@k for k in 1, 2, 4, ..., mean score, the success rate with its standard error, and each task's
    success rate (``task_success``: two evaluations of the same tasks compare task by task, a paired difference)."""
    all_success = [s for values in successes.values() for s in values]
    rate = sum(all_success) / max(len(all_success), 1)
    result: dict[str, Any] = {
        "tasks": len(successes),
        "episodes": len(all_success),
        f"avg@{samples}": rate,
        "success": rate,
        "success_se": success_standard_error(successes),
        "score_mean": sum(s for values in scores.values() for s in values) / max(len(all_success), 1),
        "pass@k": {},
    }
    for k in k_values(samples):
        per_task = [pass_at_k(len(v), sum(v), k) for v in successes.values() if len(v) >= k]
        result["pass@k"][str(k)] = sum(per_task) / max(len(per_task), 1)
    result["task_success"] = {task: sum(values) / len(values) for task, values in successes.items() if values}
    return result


async def play_split(settings: EvalSettings, inference_url: str, env_url: str, chat: ChatTokenizer) -> dict[str, Any]:
    """Play ``settings`` against running services (inference at ``inference_url``, the environment at ``env_url``).

    Returns ``{"by_max_turns": {"<turns>": summary}}``, one :func:`summarise` summary (plus ``turns_mean``,
    ``errors``, ``seconds``) per max-turn budget. Each episode is seeded from ``settings.seed``, its task
    and its sample index (hashed: no two episodes share a random stream), so the same policy plays the same
    episodes, at every max-turn budget.
    """
    task_ids = eval_task_ids(settings.environment, settings.split, settings.tasks, settings.spread)
    semaphore = asyncio.Semaphore(settings.concurrency)
    results: dict[str, Any] = {"by_max_turns": {}}
    async with (
        CompletionClient(inference_url) as client,
        AsyncEnvClient(env_url, max_connections=settings.concurrency) as env,
    ):
        policy = InferencePolicy(client)
        template = template_for(settings.environment)
        episode_settings = EpisodeSettings(max_context_tokens=settings.max_context_tokens)
        for max_turns in settings.max_turns:

            async def one(task_id: str, sample: int, max_turns: int = max_turns) -> rl_pb2.Trajectory:
                request = rl_pb2.RolloutRequest(
                    run="eval",
                    request_id=f"eval/{max_turns}/{task_id}/{sample}",
                    environment=settings.environment,
                    task_id=task_id,
                    max_turns=max_turns,
                    max_tokens_per_turn=settings.max_tokens_per_turn,
                    temperature=settings.temperature,
                    top_p=settings.top_p,
                    seed=derive_seed("eval", settings.seed, task_id, sample),
                )
                async with semaphore:
                    return await run_episode(request, env, policy, chat, template, episode_settings)

            started = time.perf_counter()
            trajectories = await asyncio.gather(*(one(t, s) for t in task_ids for s in range(settings.samples)))
            successes: dict[str, list[bool]] = {t: [] for t in task_ids}
            scores: dict[str, list[float]] = {t: [] for t in task_ids}
            for trajectory in trajectories:
                successes[trajectory.task_id].append(trajectory.success)
                scores[trajectory.task_id].append(trajectory.final_score)
            summary = summarise(successes, scores, settings.samples)
            summary["turns_mean"] = sum(t.turns_used for t in trajectories) / max(len(trajectories), 1)
            failed = [t for t in trajectories if t.termination == rl_pb2.TERMINATION_ERROR]
            summary["errors"] = len(failed)
            # Why they failed, most common first: an eval error is otherwise a bare count in the summary.
            reasons = Counter(t.termination_reason[:REASON_CHARS] or "unknown" for t in failed)
            summary["error_reasons"] = dict(reasons.most_common(5))
            summary["seconds"] = round(time.perf_counter() - started, 1)
            results["by_max_turns"][str(max_turns)] = summary
            log.info("max_turns=%d: %s", max_turns, {k: v for k, v in summary.items() if k != "task_success"})
    return results


def evaluate(model: str, settings: EvalSettings, work_dir: Path) -> dict[str, Any]:
    """Serve `model` and the environment locally, play the split, return the results dict."""
    model_dir = resolve_model(model)
    chat = ChatTokenizer(load_tokenizer(model_dir))
    supervisor = Supervisor(work_dir / "logs", work_dir / "events.jsonl")
    inference_port, env_port = free_port(), free_port()
    inference_url, env_url = f"http://127.0.0.1:{inference_port}", f"http://127.0.0.1:{env_port}"
    agentgym = [__import__("sys").executable, "-m", "agentgym.cli"]

    async def main() -> dict[str, Any]:
        await asyncio.gather(
            supervisor.start(
                ProcessSpec(
                    "inference",
                    [
                        *agentgym,
                        "inference",
                        "serve",
                        "--model",
                        str(model_dir),
                        "--port",
                        str(inference_port),
                        "--max-batch-size",
                        str(max(settings.concurrency, 1)),
                        "--log-level",
                        "warning",
                    ],
                    f"{inference_url}/health",
                )
            ),
            supervisor.start(
                ProcessSpec(
                    f"env-{settings.environment}",
                    [
                        *agentgym,
                        "env",
                        "serve",
                        settings.environment,
                        "--port",
                        str(env_port),
                        "--grpc-port",
                        "0",
                        "--max-episodes",
                        str(settings.concurrency + 8),
                        "--log-level",
                        "warning",
                        *[arg for setting in settings.env_settings for arg in ("--set", setting)],
                    ],
                    f"{env_url}/healthz",
                )
            ),
        )
        return await play_split(settings, inference_url, env_url, chat)

    try:
        results = asyncio.run(main())
    finally:
        supervisor.stop_all()
    return {"model": str(model), "model_dir": str(model_dir), "settings": asdict(settings), **results}


def write_results(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
