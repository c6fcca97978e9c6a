"""`agentgym run`: the TrainingRun lifecycle on one machine.

The same spec as the cluster's custom resource, reconciled onto supervised local processes:

    embedded nats-server (JetStream in <run>/nats)
    env services        agentgym env serve <kind>            one per environment (unless it names a url)
    inference           agentgym inference serve --model ...  the HF engine on CPU
    rollout workers     agentgym rollout worker ...           rollout.workers of them
    trainer             python -m agentgym.trainer.entrypoint  checkpoints in <run>/checkpoints

and, in this process, the controller the operator is in the cluster: it follows WeightUpdate and
CurriculumState on the run's control stream, makes inference load each new policy version, and keeps
`<run>/status.json` (the CRD status: phase, conditions, step, horizon, versions, metrics). Everything of
the run lands in one directory: spec, logs, events, status, metrics, checkpoints, traces.

The runner also measures what the run learned (`agentgym.local.run_eval`): held-out success on each
environment's eval split before training (while the trainer starts and warms up; the first weight roll
waits for it), after the SFT warm-up (before the controller rolls the next policy version, while the
first RL step's episodes play on the same policy), and on the final policy once the trainer is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import nats
import yaml
from nats.js.api import ConsumerConfig, DeliverPolicy

from agentgym.inference.client import CompletionClient, InferenceError
from agentgym.local.run_eval import (
    PhaseResult,
    RunEvalSettings,
    evaluate_served_policy,
    gains,
    load_phases,
    summary_lines,
    write_phase,
)
from agentgym.local.supervisor import ProcessFailedError, ProcessSpec, Supervisor
from agentgym.messaging import EmbeddedNats, RunChannels, decode_message, ensure_run_streams, free_port
from agentgym.proto import rl_pb2
from agentgym.spec import Condition, TrainingRun, TrainingRunStatus

log = logging.getLogger(__name__)
PYTHON = sys.executable
AGENTGYM = [PYTHON, "-m", "agentgym.cli"]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class RunStatus:
    """`TrainingRun.status`, kept in `<run>/status.json` (atomically replaced on every change)."""

    def __init__(self, path: Path, generation: int = 1) -> None:
        self.path = path
        self.generation = generation
        self.status = TrainingRunStatus(start_time=_now())
        if path.exists():  # resume: keep step, versions and metrics
            with contextlib.suppress(Exception):
                self.status = TrainingRunStatus.model_validate_json(path.read_text())
        self.restarts: dict[str, int] = {}
        self.listeners: list[Callable[[TrainingRunStatus], None]] = []

    def condition(self, kind: str, ok: bool, reason: str, message: str = "") -> None:
        value: Literal["True", "False"] = "True" if ok else "False"
        conditions = [c for c in self.status.conditions if c.type != kind]
        previous = next((c for c in self.status.conditions if c.type == kind), None)
        changed = previous is None or previous.status != value
        conditions.append(
            Condition(
                type=kind,  # type: ignore[arg-type]
                status=value,
                reason=reason,
                message=message,
                observed_generation=self.generation,
                last_transition_time=_now() if changed else (previous.last_transition_time if previous else None),
            )
        )
        self.status.conditions = conditions

    def save(self) -> None:
        self.status.observed_generation = self.generation
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(self.status.model_dump_json(by_alias=True, indent=2))
        temporary.replace(self.path)
        for listener in self.listeners:
            listener(self.status)


class LocalRunner:
    """Reconciles one TrainingRun onto local processes; `run()` returns the process exit code."""

    def __init__(
        self,
        run: TrainingRun,
        run_dir: Path,
        *,
        resume: bool = False,
        spec_path: Path | None = None,
        eval_settings: RunEvalSettings | None = None,
    ):
        self.run = run
        self.spec = run.spec
        self.name = run.metadata.name
        self.run_dir = run_dir
        self.resume = resume
        self.channels = RunChannels(self.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.spec_path = run_dir / "spec.yaml"
        self.status = RunStatus(run_dir / "status.json")
        self.supervisor = Supervisor(run_dir / "logs", run_dir / "events.jsonl", on_event=self._on_event)
        self.nats: EmbeddedNats | None = None
        self.urls: dict[str, str] = {}
        self.inference_url = ""
        self.started_at = time.time()
        self.step_lines: list[Callable[[rl_pb2.CurriculumState], None]] = []
        self.eval_settings = eval_settings or RunEvalSettings()
        self.evals: dict[str, PhaseResult] = load_phases(run_dir) if resume else {}
        self.timings: dict[str, float] = {}
        self._chat: Any = None
        self._pending_eval: asyncio.Task[None] | None = None  # the start or sft eval, while it plays
        self._clock = time.perf_counter()

    # -- lifecycle -----------------------------------------------------------------------------------

    async def run_until_done(self, stop: asyncio.Event) -> int:
        self.spec_path.write_text(yaml.safe_dump(self.run.to_document(), sort_keys=False))
        self.status.status.phase = "Pending"
        self.status.save()
        controller: asyncio.Task[None] | None = None
        try:
            await self._start_platform()
            self.status.status.phase = "Running"
            self.status.condition("Ready", True, "AllComponentsHealthy")
            self.status.save()
            controller = asyncio.create_task(self._control_loop(stop), name="controller")
            watcher = asyncio.create_task(self.supervisor.watch(stop), name="supervisor")
            done_waiter = asyncio.create_task(self._wait_trainer_done(stop), name="trainer-done")
            stop_waiter = asyncio.create_task(stop.wait(), name="stop")
            finished, _ = await asyncio.wait(
                {watcher, done_waiter, stop_waiter, controller}, return_when=asyncio.FIRST_COMPLETED
            )
            for task in finished:
                if task is not stop_waiter and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            if done_waiter in finished:
                self.timings["trainer_done"] = self._elapsed()
                if controller is not None:
                    controller.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await controller
                # No more steps will be requested: the rollout workers stop (up to their grace period)
                # while the final evaluation plays, not after it. The watcher must not restart them.
                watcher.cancel()
                rollouts = [name for name in self.supervisor.processes if name.startswith("rollout")]
                stopping = asyncio.create_task(asyncio.to_thread(self.supervisor.stop_all, rollouts))
                await self._final_evaluation()
                await stopping
                self.status.status.phase = "Succeeded"
                self.status.status.completion_time = _now()
                self.status.condition("Complete", True, "TotalStepsReached")
                self.status.condition("TrainerRunning", False, "Finished")
                code = 0
            else:
                self.status.status.phase = "Suspended"
                self.status.condition("Suspended", True, "Interrupted", "stopped by the user; resume with --resume")
                code = 130
            stop.set()
            for task in (watcher, done_waiter, stop_waiter):
                task.cancel()
            return code
        except ProcessFailedError as error:
            log.error("%s", error)
            self.status.status.phase = "Failed"
            self.status.condition("Failed", True, "ProcessFailed", str(error)[:2000])
            return 1
        finally:
            stop.set()
            if controller is not None:
                controller.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await controller
            if self._pending_eval is not None and not self._pending_eval.done():
                self._pending_eval.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._pending_eval
            self.shutdown()
            self._write_summary()
            self.status.save()

    def shutdown(self) -> None:
        # The trainer first (it may be checkpointing), then the producers and consumers, NATS last.
        order = ["trainer", *[n for n in self.supervisor.processes if n.startswith("rollout")], "inference"]
        order += [n for n in self.supervisor.processes if n not in order]
        self.supervisor.stop_all(order)
        if self.nats is not None:
            self.nats.stop()

    def _on_event(self, event: dict[str, Any]) -> None:
        if event["event"] == "restarted":
            name = str(event["process"])
            self.status.restarts[name] = int(str(event.get("restarts", 0)))
            self.status.status.metrics[f"restarts.{name}"] = float(self.status.restarts[name])
            with contextlib.suppress(Exception):
                self.status.save()

    # -- starting the platform -----------------------------------------------------------------------

    async def _start_platform(self) -> None:
        from agentgym.inference.models import resolve_model

        started = time.perf_counter()
        self.nats = EmbeddedNats(self.run_dir / "nats")
        self.nats.start()
        nc = await nats.connect(self.nats.url)
        await ensure_run_streams(nc.jetstream(), self.channels)
        await nc.close()

        model_dir = resolve_model(self.spec.model.name)
        envs = []
        for env in self.spec.environments:
            if env.url:
                self.urls[env.name] = env.url
                continue
            port = free_port()
            self.urls[env.name] = f"http://127.0.0.1:{port}"
            argv = [
                *AGENTGYM,
                "env",
                "serve",
                env.name,
                "--port",
                str(port),
                "--grpc-port",
                "0",
                "--max-episodes",
                str(env.max_episodes),
                "--log-level",
                "warning",
            ]
            for key, value in env.config.items():
                argv += ["--set", f"{key}={json.dumps(value)}"]
            envs.append(ProcessSpec(f"env-{env.name}", argv, f"{self.urls[env.name]}/healthz"))
        inference_port = free_port()
        self.inference_url = f"http://127.0.0.1:{inference_port}"
        inference = ProcessSpec(
            "inference",
            [
                *AGENTGYM,
                "inference",
                "serve",
                "--model",
                str(model_dir),
                "--port",
                str(inference_port),
                "--max-batch-size",
                str(self.spec.inference.max_batch_size),
                "--log-level",
                "warning",
            ],
            f"{self.inference_url}/health",
        )
        # Environments and inference start together: none depends on another.
        await asyncio.gather(*(self.supervisor.start(spec) for spec in [*envs, inference]))
        self.status.condition("EnvironmentsReady", True, "ServicesHealthy", ", ".join(sorted(self.urls)))
        self.status.condition("InferenceReady", True, "ServerHealthy", self.inference_url)
        self.timings["services_up"] = self._elapsed()
        if self.eval_settings.enabled:
            from agentgym.inference.models import load_tokenizer
            from agentgym.rollout.tokens import ChatTokenizer

            self._chat = ChatTokenizer(load_tokenizer(model_dir))
            if "start" not in self.evals and not self.resume:
                # The initial policy, before any training: it plays while the trainer starts and warms up.
                self._pending_eval = asyncio.create_task(self._evaluate("start", 0), name="eval-start")

        telemetry_env = {"AGENTGYM_TELEMETRY_DIR": str(self.run_dir / "telemetry")}
        for index in range(self.spec.rollout.workers):
            argv = [
                *AGENTGYM,
                "rollout",
                "worker",
                "--run",
                self.name,
                "--nats-url",
                self.nats.url,
                "--inference-url",
                self.inference_url,
                "--tokenizer",
                str(model_dir),
                "--concurrency",
                str(self.spec.rollout.concurrency),
                "--max-context-tokens",
                str(self.spec.model.max_context_tokens),
                "--log-level",
                "warning",
            ]
            for name, url in self.urls.items():
                argv += ["--env-url", f"{name}={url}"]
            await self.supervisor.start(ProcessSpec(f"rollout-{index}", argv, env=telemetry_env))
        from agentgym.trainer.launch import local_trainer_command

        trainer = ProcessSpec(
            "trainer",
            local_trainer_command(
                self.spec.trainer.backend,
                self.spec.trainer.gpus,
                [
                    "--run",
                    str(self.spec_path),
                    "--nats-url",
                    self.nats.url,
                    "--output-dir",
                    str(self.run_dir),
                    "--run-name",
                    self.name,
                    "--log-level",
                    "info",
                ],
                master_port=free_port(),
            ),
            done_on_success=True,
            max_restarts=3,
            env=telemetry_env,
        )
        await self.supervisor.start(trainer)
        self.status.condition("TrainerRunning", True, "Started")
        self.timings["trainer_started"] = self._elapsed()
        self.status.status.metrics["startup_seconds"] = round(time.perf_counter() - started, 2)
        self.status.save()
        log.info(
            "platform up in %.1fs: %s", time.perf_counter() - started, self.urls | {"inference": self.inference_url}
        )

    async def _wait_trainer_done(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.supervisor.finished("trainer"):
                return
            await asyncio.sleep(0.5)
        await asyncio.Event().wait()  # stopped by the user: never "done"

    # -- the controller ------------------------------------------------------------------------------

    async def _control_loop(self, stop: asyncio.Event) -> None:
        """Follow WeightUpdate/CurriculumState: roll weights to inference, reflect state into status."""
        assert self.nats is not None
        nc = await nats.connect(self.nats.url, name="local-controller")
        js = nc.jetstream()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def enqueue(message: Any) -> None:
            await queue.put(message)

        # Ordered, ephemeral: on (re)start, the last message of each control subject is replayed.
        config = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
        subscription = await js.subscribe(
            f"{self.channels.prefix}.control.>", cb=enqueue, ordered_consumer=True, config=config
        )
        try:
            async with CompletionClient(self.inference_url) as inference:
                while not stop.is_set():
                    try:
                        message = await asyncio.wait_for(queue.get(), timeout=0.5)
                    except TimeoutError:
                        continue
                    if message.subject == self.channels.weights_subject:
                        update = decode_message(message.data, rl_pb2.WeightUpdate)
                        await self._eval_finished()  # the policy being measured serves until it is measured
                        await self._roll_weights(inference, update)
                        self._after_roll(update)
                    elif message.subject == self.channels.curriculum_subject:
                        self._reflect_curriculum(decode_message(message.data, rl_pb2.CurriculumState))
        finally:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
            await nc.close()

    async def _roll_weights(self, inference: CompletionClient, update: rl_pb2.WeightUpdate) -> None:
        status = self.status.status
        status.policy_version = max(status.policy_version, update.version)
        status.last_checkpoint = update.uri or status.last_checkpoint
        served = await inference.policy_version()
        if served < update.version:
            for attempt in range(5):
                try:
                    served = await inference.load_weights(update.uri, update.version)
                    break
                except InferenceError as error:
                    if not error.transient or attempt == 4:
                        # A permanent failure keeps the old weights serving; the run cannot stay on-policy.
                        self.status.condition("InferenceReady", False, "WeightLoadFailed", str(error))
                        self.status.save()
                        raise ProcessFailedError(
                            f"inference could not load policy {update.version}: {error}"
                        ) from error
                    await asyncio.sleep(2**attempt)
        status.served_policy_version = served
        self.status.condition("InferenceReady", True, "ServingPolicy", f"version {served}")
        self.status.save()

    # -- evaluations -----------------------------------------------------------------------------------

    def _elapsed(self) -> float:
        return round(time.perf_counter() - self._clock, 1)

    async def _eval_finished(self) -> None:
        """Wait for the start / sft eval in progress (it is not cancelled when the waiter is)."""
        if self._pending_eval is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._pending_eval)

    def _after_roll(self, update: rl_pb2.WeightUpdate) -> None:
        """After the SFT warm-up's policy is served (step 0, version >= 1): measure it before RL changes it."""
        warmed_up = self.spec.trainer.sft_warmup_steps > 0 and update.step == 0 and update.version >= 1
        if warmed_up and "sft_done" not in self.timings:
            self.timings["sft_done"] = self._elapsed()
        if warmed_up and "sft" not in self.evals and self.eval_settings.enabled and self._chat is not None:
            # The next policy version is rolled only once this eval is done (the controller waits for it), so
            # it measures this one; the first RL step's episodes play on the same policy meanwhile.
            self._pending_eval = asyncio.create_task(self._evaluate("sft", int(update.version)), name="eval-sft")

    async def _evaluate(self, phase: str, version: int) -> None:
        """One eval phase on the policy served now; a failure is logged and recorded, never fatal to the run."""
        started = self._elapsed()
        try:
            result = await evaluate_served_policy(
                self.spec, phase, version, self.inference_url, self.urls, self._chat, self.eval_settings
            )
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.warning("eval %s failed: %s", phase, error, exc_info=True)
            self.supervisor.event("eval_failed", "runner", phase=phase, error=str(error)[:500])
            return
        self.evals[phase] = result
        self.timings[f"eval_{phase}"] = round(self._elapsed() - started, 1)
        write_phase(self.run_dir, result)
        self.supervisor.event("evaluated", "runner", phase=phase, success=result.success, episodes=result.episodes)
        log.info("eval %s: %s", phase, result.describe())
        self.status.status.metrics.update(result.metrics())
        for name, points in gains(self.evals).items():
            self.status.status.metrics[f"eval/gain/{name}"] = points
        self.status.save()

    async def _final_evaluation(self) -> None:
        """Serve the trainer's last policy version, then measure it."""
        if not self.eval_settings.enabled or self._chat is None or self.nats is None:
            return
        await self._eval_finished()  # a short run: the start or sft eval may still be playing
        nc = await nats.connect(self.nats.url, name="local-final-eval")
        try:
            last = await nc.jetstream().get_last_msg(self.channels.control_stream, self.channels.weights_subject)
            update = decode_message(last.data or b"", rl_pb2.WeightUpdate)
        except Exception as error:
            log.warning("no final WeightUpdate to evaluate: %s", error)
            return
        finally:
            await nc.close()
        async with CompletionClient(self.inference_url) as inference:
            await self._roll_weights(inference, update)
        await self._evaluate("end", int(update.version))

    def summary_lines(self) -> list[str]:
        """What the run learned, for the end of `agentgym run` (empty without evaluations)."""
        return summary_lines(self.evals, self.spec.algorithm.name, self.spec.trainer.total_steps)

    def _write_summary(self) -> None:
        if not self.evals:
            return
        timings = dict(self.timings)
        timings["total"] = self._elapsed()
        document = {
            "phases": {phase: result.__dict__ for phase, result in self.evals.items()},
            "gain_points": gains(self.evals),
            "seconds": timings,
            "summary": self.summary_lines(),
        }
        path = self.run_dir / "eval" / "summary.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2, default=str))

    def _reflect_curriculum(self, state: rl_pb2.CurriculumState) -> None:
        status = self.status.status
        status.step, status.stage, status.horizon = int(state.step), int(state.stage), int(state.horizon)
        status.metrics.update({k: float(v) for k, v in state.metrics.items()})
        for key in ("reward_mean", "reward/mean", "reward"):
            if key in state.metrics:
                status.reward = float(state.metrics[key])
                break
        self.status.save()
        for listener in self.step_lines:
            listener(state)
