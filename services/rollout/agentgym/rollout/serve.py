"""The rollout worker's composition root: its settings from a TrainingRun and flags, and the running service.

`agentgym rollout worker` (operators/agentgym/cli/main.py) parses the command line and calls `serve`; the
operator's pod and the local runner start that command.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agentgym.envs.client import AsyncEnvClient
from agentgym.inference.client import CompletionClient
from agentgym.inference.models import load_tokenizer_by_name
from agentgym.rollout.episode import EpisodeSettings
from agentgym.rollout.policy import InferencePolicy
from agentgym.rollout.tokens import ChatTokenizer
from agentgym.rollout.worker import RolloutWorker, WorkerConfig
from agentgym.telemetry import setup_telemetry


class RolloutSettingsError(ValueError):
    """The worker's settings are unusable (the CLI prints the message and exits 2)."""


@dataclass(frozen=True)
class RolloutSettings:
    run: str
    tokenizer: str
    engine: Literal["hf", "vllm"]
    concurrency: int
    max_context_tokens: int


def rollout_settings(
    spec: Path | None,
    run: str | None,
    tokenizer: str | None,
    engine: str | None,
    concurrency: int | None,
    max_context_tokens: int | None,
) -> RolloutSettings:
    """The rollout worker's settings: a flag if given, else the spec's field, else the standalone default."""
    if engine is not None and engine not in ("hf", "vllm"):
        raise RolloutSettingsError(f"--engine must be hf or vllm, got {engine!r}")
    if spec is None:
        if run is None:
            raise RolloutSettingsError("give --spec (a TrainingRun YAML) or --run")
        return RolloutSettings(
            run=run,
            tokenizer=tokenizer or "builtin:tiny",
            engine=engine or "hf",  # type: ignore[arg-type]
            concurrency=concurrency or 32,
            max_context_tokens=max_context_tokens or 4096,
        )
    from agentgym.spec import SpecError, load_training_run

    try:
        training_run = load_training_run(spec)
    except (OSError, SpecError) as error:
        raise RolloutSettingsError(f"--spec {spec}: {error}") from None
    model = training_run.spec.model
    return RolloutSettings(
        run=run or training_run.metadata.name,
        tokenizer=tokenizer or model.tokenizer or model.name,
        engine=engine or training_run.spec.inference.engine,  # type: ignore[arg-type]
        concurrency=concurrency or training_run.spec.rollout.concurrency,
        max_context_tokens=max_context_tokens or model.max_context_tokens,
    )


def environment_urls(pairs: list[str]) -> dict[str, str]:
    """`NAME=URL` pairs (`--env-url`), by name."""
    urls: dict[str, str] = {}
    for pair in pairs:
        name, sep, url = pair.partition("=")
        if not sep or not name or not url:
            raise RolloutSettingsError(f"--env-url expects NAME=URL, got {pair!r}")
        urls[name] = url
    return urls


def serve(nats_url: str, inference_url: str, env_urls: dict[str, str], settings: RolloutSettings) -> None:
    """Pull RolloutRequests, play episodes, publish Trajectories until SIGTERM/SIGINT.

    Raises `RolloutSettingsError` before starting anything when the tokenizer cannot be loaded."""
    try:
        chat = ChatTokenizer(load_tokenizer_by_name(settings.tokenizer))
    except Exception as error:
        raise RolloutSettingsError(f"cannot load tokenizer {settings.tokenizer!r}: {error}") from None
    telemetry = setup_telemetry("agentgym-rollout")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        async with CompletionClient(inference_url, engine=settings.engine) as client:
            environments = {
                name: AsyncEnvClient(url, max_connections=settings.concurrency) for name, url in env_urls.items()
            }
            try:
                config = WorkerConfig(
                    run=settings.run,
                    nats_url=nats_url,
                    concurrency=settings.concurrency,
                    settings=EpisodeSettings(max_context_tokens=settings.max_context_tokens),
                )
                worker = RolloutWorker(
                    config, InferencePolicy(client), chat, environments, telemetry.tracer("agentgym.rollout")
                )
                await worker.run(stop)
            finally:
                for env in environments.values():
                    await env.aclose()

    try:
        asyncio.run(main())
    finally:
        telemetry.shutdown()
