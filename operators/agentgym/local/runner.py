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
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import nats
import yaml
from nats.js.api import ConsumerConfig, DeliverPolicy

from agentgym import lifecycle
from agentgym.lifecycle import JobState, Observed, Replicas
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
from agentgym.operator.manifests import Checkpoint
from agentgym.operator.weights import Replica, roller_for, sync_replicas
from agentgym.plan import Placement, plan_run
from agentgym.proto import rl_pb2
from agentgym.spec import Condition, TrainingRun, TrainingRunStatus

ControlMessage = TypeVar("ControlMessage", rl_pb2.CurriculumState, rl_pb2.WeightUpdate)

log = logging.getLogger(__name__)
PYTHON = sys.executable
AGENTGYM = [PYTHON, "-m", "agentgym.cli"]
LOG_LEVELS = {"env": "warning", "inference": "warning", "rollout": "warning", "trainer": "info"}
WEIGHT_ROLL_SECONDS = 120.0  # how long a weight roll retries a replica that cannot load (restarting, say)


VLLM_PYTHON_ENV = "AGENTGYM_VLLM_PYTHON"
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_READY_TIMEOUT_S = 600.0
REPO_ROOT = Path(__file__).resolve().parents[3]


def vllm_python() -> Path:
    """The interpreter of vLLM's own environment: `$AGENTGYM_VLLM_PYTHON`, else the repository's `.venv-vllm`
    (`scripts/setup-vllm.sh`). vLLM pins its own transformers and friends, so it never shares this one."""
    configured = os.environ.get(VLLM_PYTHON_ENV)
    return Path(configured) if configured else REPO_ROOT / ".venv-vllm" / "bin" / "python"


def local_command(command: tuple[str, ...] | list[str]) -> list[str]:
    """A plan's command on this machine: the images' `agentgym` and `python` are this interpreter, except that
    vLLM's server runs on vLLM's environment's (`vllm_python()`) and loads a builtin model from its cached folder
    (the HF engine resolves `builtin:` names itself; vLLM cannot)."""
    head, *rest = command
    if head == "agentgym":
        return [*AGENTGYM, *rest]
    if head == "python" and rest[:2] == ["-m", VLLM_SERVER_MODULE]:
        if "--model" in rest and rest[rest.index("--model") + 1].startswith("builtin:"):
            from agentgym.inference.models import resolve_model

            at = rest.index("--model") + 1
            rest[at] = str(resolve_model(rest[at]))
        return [str(vllm_python()), *rest]
    if head == "python":
        return [PYTHON, *rest]
    return list(command)


def local_process_specs(run: TrainingRun, placement: Placement, telemetry_dir: Path) -> list[ProcessSpec]:
    """The run's processes on this machine, from the same plan the operator renders into pods."""
    # The DeepSpeed launcher (several GPUs) is found on PATH, as in the trainer image: this environment's.
    path = os.pathsep.join([str(Path(PYTHON).parent), os.environ.get("PATH", "")])
    specs = []
    for component in plan_run(run, placement):
        argv = local_command(component.command)
        env = {**component.env, "PATH": path}
        if component.kind in ("rollout", "trainer"):
            env["AGENTGYM_TELEMETRY_DIR"] = str(telemetry_dir)
        if component.kind == "rollout":
            specs += [ProcessSpec(f"rollout-{i}", argv, env=env) for i in range(run.spec.rollout.workers)]
        elif component.kind == "trainer":
            specs.append(ProcessSpec("trainer", argv, done_on_success=True, max_restarts=3, env=env))
        else:
            health = f"http://127.0.0.1:{component.port}{component.health_path}" if component.health_path else None
            # vLLM takes 40-150 s to come up on CPU (imports, profiling; longer on a busy machine).
            ready = VLLM_READY_TIMEOUT_S if argv[0] == str(vllm_python()) else ProcessSpec.ready_timeout_s
            specs.append(ProcessSpec(component.name, argv, health, env=env, ready_timeout_s=ready))
    return specs


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class RunStatus:
    """`TrainingRun.status`, kept in `<run>/status.json` (atomically replaced on every change), written through
    the same lifecycle functions as the operator's (`agentgym.lifecycle`)."""

    def __init__(self, path: Path, generation: int = 1) -> None:
        self.path = path
        self.generation = generation
        self.status = TrainingRunStatus(start_time=_now())
        if path.exists():  # resume: keep step, versions and metrics
            with contextlib.suppress(Exception):
                self.status = TrainingRunStatus.model_validate_json(path.read_text())
        self.restarts: dict[str, int] = {}
        self.listeners: list[Callable[[TrainingRunStatus], None]] = []

    def apply(self, patch: dict[str, Any]) -> None:
        self.status = lifecycle.apply_status_patch(self.status, patch)

    def observe(self, observed: Observed) -> None:
        """Phase and conditions from what the runner sees of its processes."""
        previous = [c.model_dump(by_alias=True, exclude_none=True) for c in self.status.conditions]
        self.apply(lifecycle.compute_status(observed, generation=self.generation, previous=previous, now=_now()))

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
        self.eval_settings = eval_settings or RunEvalSettings()
        self.evals: dict[str, PhaseResult] = load_phases(run_dir) if resume else {}
        self.timings: dict[str, float] = {}
        self._chat: Any = None
        self._pending_eval: asyncio.Task[None] | None = None  # the start or sft eval, while it plays
        self._clock = time.perf_counter()
        self._trainer_failure: str | None = None
        self._step_metrics: set[str] = set()
        self._interrupted = False
        self._latest_update: rl_pb2.WeightUpdate | None = None
        self._inference_restarted = asyncio.Event()  # a restarted inference serves the base model: roll again

    # -- lifecycle -----------------------------------------------------------------------------------

    async def run_until_done(self, stop: asyncio.Event) -> int:
        self.spec_path.write_text(yaml.safe_dump(self.run.to_document(), sort_keys=False))
        self._refresh_status()
        controller: asyncio.Task[None] | None = None
        try:
            await self._start_platform()
            self._refresh_status()
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
                await self._reflect_last_step()
                # No more steps will be requested: the rollout workers stop (up to their grace period)
                # while the final evaluation plays, not after it. The watcher must not restart them.
                watcher.cancel()
                rollouts = [name for name in self.supervisor.processes if name.startswith("rollout")]
                stopping = asyncio.create_task(asyncio.to_thread(self.supervisor.stop_all, rollouts))
                await self._final_evaluation()
                await stopping
                self.status.status.completion_time = _now()
                code = 0
            else:
                self._interrupted = True
                code = 130
            stop.set()
            for task in (watcher, done_waiter, stop_waiter):
                task.cancel()
            return code
        except ProcessFailedError as error:
            log.error("%s", error)
            self._trainer_failure = str(error)[:2000]
            return 1
        except Exception as error:  # the runner's own failure: the status must not say Running after it
            log.exception("the local runner failed")
            self._trainer_failure = f"the local runner failed: {type(error).__name__}: {error}"[:2000]
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
            self._refresh_status()  # what the run ended as, before its processes are stopped
            self.shutdown()
            self._write_summary()
            self.status.save()

    def observed(self) -> Observed:
        """What the runner sees of its processes, in the terms the operator sees Deployments and the Job."""

        def replicas(name: str) -> Replicas | None:
            managed = self.supervisor.processes.get(name)
            if managed is None:
                return None
            return Replicas(ready=1 if managed.process.poll() is None and managed.healthy else 0, desired=1)

        trainer = self.supervisor.processes.get("trainer")
        if self._trainer_failure is not None:
            job: JobState | None = JobState(failed=True, reason="ProcessFailed", message=self._trainer_failure)
        elif trainer is None:
            job = None
        elif trainer.finished:
            job = JobState(succeeded=True)
        else:
            job = JobState(active=1 if trainer.process.poll() is None else 0)
        # A part without a condition of its own (NATS, a rollout worker) that is down makes the run not Ready.
        down = [
            f"{name} is down (restarts: {managed.restarts})"
            for name, managed in self.supervisor.processes.items()
            if (name == "nats" or name.startswith("rollout")) and not managed.healthy and not managed.finished
        ]
        status = self.status.status
        return Observed(
            environments={e.name: replicas(f"env-{e.name}") for e in self.spec.environments if e.url is None},
            inference=replicas("inference"),
            job=job,
            policy_version=status.policy_version,
            served_policy_version=status.served_policy_version,
            max_staleness=self.spec.rollout.max_staleness,
            suspended=self._interrupted,
            suspended_reason=("Interrupted", "stopped by the user; resume with --resume"),
            problem=("ComponentDown", "; ".join(down)) if down and not self._interrupted else None,
        )

    def _refresh_status(self) -> None:
        before = self._ready()
        self.status.observe(self.observed())
        self.status.save()
        after = self._ready()
        if after is not None and (before is None or (before.status, before.reason) != (after.status, after.reason)):
            # Each change of Ready in events.jsonl, as Kubernetes records the run's events.
            self.supervisor.event(
                "condition", "runner", type="Ready", status=after.status, reason=after.reason, message=after.message
            )

    def _ready(self) -> Condition | None:
        return next((c for c in self.status.status.conditions if c.type == "Ready"), None)

    def shutdown(self) -> None:
        # The trainer first (it may be checkpointing), then the producers and consumers, NATS last.
        order = ["trainer", *[n for n in self.supervisor.processes if n.startswith("rollout")], "inference"]
        order += [n for n in self.supervisor.processes if n not in order and n != "nats"]
        self.supervisor.stop_all([*order, "nats"])

    def _on_event(self, event: dict[str, Any]) -> None:
        name = str(event["process"])
        if event["event"] == "restarted":
            self.status.restarts[name] = int(str(event.get("restarts", 0)))
            self.status.status.metrics[f"restarts.{name}"] = float(self.status.restarts[name])
        if event["event"] in ("restarted", "healthy") and name == "inference":
            self._inference_restarted.set()
        if event["event"] in ("crashed", "restarted", "healthy", "finished"):
            with contextlib.suppress(Exception):
                self._refresh_status()

    # -- starting the platform -----------------------------------------------------------------------

    def placement(self, nats_url: str, ports: dict[str, int]) -> Placement:
        """Where this run's components run here: loopback ports, the run folder, the embedded NATS."""
        urls: dict[str, str] = {
            env.name: env.url or f"http://127.0.0.1:{ports[f'env-{env.name}']}" for env in self.spec.environments
        }
        return Placement(
            spec_path=str(self.spec_path),
            nats_url=nats_url,
            inference_url=f"http://127.0.0.1:{ports['inference']}",
            env_urls=urls,
            bind_host="127.0.0.1",
            http_ports=ports,
            grpc_port=0,  # rollout workers speak HTTP; no gRPC port to allocate
            output_dir=str(self.run_dir),
            master_port=free_port(),
            log_level=LOG_LEVELS,
        )

    async def _start_platform(self) -> None:
        from agentgym.inference.models import resolve_model

        started = time.perf_counter()
        if self.spec.inference.engine == "vllm":
            from agentgym.inference.vllm import cpu_attention_refusal

            python = vllm_python()
            if not python.exists():
                raise ProcessFailedError(
                    f"inference.engine is vllm, and there is no vLLM environment at {python}: run "
                    f"scripts/setup-vllm.sh (make vllm), or point {VLLM_PYTHON_ENV} at a python with vllm installed,"
                    " or set inference.engine: hf"
                )
            if self.spec.inference.gpus_per_replica == 0:
                refusal = cpu_attention_refusal(resolve_model(self.spec.model.name))
                if refusal is not None:
                    raise ProcessFailedError(f"inference.engine is vllm on CPU: {refusal}")
        # nats-server is one of the run's supervised processes: restarted on the same port and store if it dies.
        self.nats = EmbeddedNats(self.run_dir / "nats")
        await self.supervisor.start(ProcessSpec("nats", self.nats.argv(), self.nats.health_url, max_restarts=10))
        nc = await nats.connect(self.nats.url)
        await ensure_run_streams(nc.jetstream(), self.channels)
        await nc.close()

        # Resolved once here, before the processes that load it start together (builtins are built on first use).
        model_dir = resolve_model(self.spec.model.name)
        ports = {f"env-{env.name}": free_port() for env in self.spec.environments if env.url is None}
        ports["inference"] = free_port()
        placement = self.placement(self.nats.url, ports)
        self.urls, self.inference_url = dict(placement.env_urls), placement.inference_url
        specs = local_process_specs(self.run, placement, self.run_dir / "telemetry")
        services = [spec for spec in specs if spec.health_url is not None]
        # Environments and inference start together: none depends on another.
        await asyncio.gather(*(self.supervisor.start(spec) for spec in services))
        self.timings["services_up"] = self._elapsed()
        self._refresh_status()
        if self.eval_settings.enabled:
            from agentgym.inference.models import load_tokenizer_by_name
            from agentgym.rollout.tokens import ChatTokenizer

            self._chat = ChatTokenizer(load_tokenizer_by_name(self.spec.model.tokenizer or str(model_dir)))
            if "start" not in self.evals and not self.resume:
                # The initial policy, before any training: it plays while the trainer starts and warms up.
                self._pending_eval = asyncio.create_task(self._evaluate("start", 0), name="eval-start")
        for spec in specs:
            if spec.health_url is None:
                await self.supervisor.start(spec)
        self.timings["trainer_started"] = self._elapsed()
        self.status.status.metrics["startup_seconds"] = round(time.perf_counter() - started, 2)
        self._refresh_status()
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
        reconnected = asyncio.Event()

        async def on_reconnect() -> None:
            reconnected.set()

        # Reconnects for as long as the run lasts: the supervisor brings a dead nats-server back.
        nc = await nats.connect(
            self.nats.url,
            name="local-controller",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            reconnected_cb=on_reconnect,
        )
        js = nc.jetstream()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def enqueue(message: Any) -> None:
            await queue.put(message)

        async def subscribe() -> Any:
            # Ordered, ephemeral: on (re)subscribing, the last message of each control subject is replayed (what
            # it repeats is idempotent: a served version is not loaded again, a step's status is the same).
            config = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
            return await js.subscribe(
                f"{self.channels.prefix}.control.>", cb=enqueue, ordered_consumer=True, config=config
            )

        # Weight rolls wait for a running evaluation (it measures the policy it started on); the steps' states must
        # not wait behind them: with `rollout.maxStaleness` the trainer goes on training meanwhile.
        rolls: asyncio.Queue[rl_pb2.WeightUpdate] = asyncio.Queue()

        async def roll_in_order() -> None:
            while True:
                update = await rolls.get()
                await self._eval_finished()  # the policy being measured serves until it is measured
                await self._roll_weights(update)
                self._after_roll(update)

        roller = asyncio.create_task(roll_in_order(), name="weight-roller")
        subscription = await subscribe()
        try:
            while not stop.is_set():
                if roller.done():
                    roller.result()  # a roll that failed ends the run (ProcessFailedError)
                if reconnected.is_set():  # a restarted server lost the ephemeral consumer: a new one
                    reconnected.clear()
                    with contextlib.suppress(Exception):
                        await subscription.unsubscribe()
                    try:
                        subscription = await subscribe()
                    except (nats.errors.Error, TimeoutError) as error:
                        log.warning("controller: resubscribing after NATS came back failed (%s); retrying", error)
                        reconnected.set()
                        await asyncio.sleep(1.0)
                        continue
                if self._inference_restarted.is_set():
                    self._inference_restarted.clear()
                    if self._latest_update is not None:  # a restarted server starts on the base model
                        rolls.put_nowait(self._latest_update)
                try:
                    message = await asyncio.wait_for(queue.get(), timeout=0.5)
                except TimeoutError:
                    continue
                if message.subject == self.channels.weights_subject:
                    update = decode_message(message.data, rl_pb2.WeightUpdate)
                    self._reflect_weights(update)  # the trainer's version now; what inference serves once rolled
                    rolls.put_nowait(update)
                elif message.subject == self.channels.curriculum_subject:
                    self._reflect_curriculum(decode_message(message.data, rl_pb2.CurriculumState))
        finally:
            roller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await roller
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
            with contextlib.suppress(Exception):
                await nc.close()

    def _reflect_weights(self, update: rl_pb2.WeightUpdate) -> None:
        """The trainer's latest policy version and checkpoint into the status (an older update changes nothing)."""
        if update.version >= self.status.status.policy_version:
            self.status.apply(lifecycle.weights_status(update))
            self.status.save()

    async def _roll_weights(self, update: rl_pb2.WeightUpdate) -> None:
        """Make inference serve `update`: the operator's weight roll (`agentgym.operator.weights`) on the one
        local replica, retried while it cannot load (e.g. restarting) for up to `WEIGHT_ROLL_SECONDS`."""
        self._reflect_weights(update)
        if self._latest_update is None or update.version >= self._latest_update.version:
            self._latest_update = update
        latest = Checkpoint(int(update.version), update.uri)
        deadline = time.monotonic() + WEIGHT_ROLL_SECONDS
        async with aiohttp.ClientSession() as session:
            roller = roller_for(self.spec.inference.engine, session, timeout=600.0)
            for attempt in range(1000):
                result = await sync_replicas(roller, [Replica("inference", self.inference_url, 0)], latest)
                if result.served is not None and not result.failed:
                    break
                why = "; ".join(result.failed.values()) or "no answer"
                if time.monotonic() > deadline:
                    # The old weights keep serving: the run cannot stay on-policy.
                    self.status.status.served_policy_version = result.served
                    self._refresh_status()
                    raise ProcessFailedError(f"inference could not load policy {update.version}: {why}")
                log.warning("inference did not load policy %s (%s); retrying", update.version, why)
                await asyncio.sleep(min(2**attempt, 10))
        self.status.status.served_policy_version = result.served
        self._refresh_status()

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

    async def _last_control_message(self, subject: str, kind: type[ControlMessage]) -> ControlMessage | None:
        """The last message on a control subject, read from the stream (None, logged, where there is none)."""
        if self.nats is None:
            return None
        try:
            nc = await nats.connect(self.nats.url, name="local-last-control")
            try:
                last = await nc.jetstream().get_last_msg(self.channels.control_stream, subject)
            finally:
                await nc.close()
            return decode_message(last.data or b"", kind)
        except Exception as error:
            log.warning("no last %s on %s: %s", kind.__name__, subject, error)
            return None

    async def _reflect_last_step(self) -> None:
        """The trainer's last CurriculumState: the controller may have stopped before it came."""
        state = await self._last_control_message(self.channels.curriculum_subject, rl_pb2.CurriculumState)
        if state is not None and state.step > self.status.status.step:
            self._reflect_curriculum(state)

    async def _final_evaluation(self) -> None:
        """Serve the trainer's last policy version, then measure it."""
        if not self.eval_settings.enabled or self._chat is None or self.nats is None:
            return
        await self._eval_finished()  # a short run: the start or sft eval may still be playing
        update = await self._last_control_message(self.channels.weights_subject, rl_pb2.WeightUpdate)
        if update is None:
            return
        await self._roll_weights(update)
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
        # Only the last step's metrics are replaced: the evaluations' and the runner's own stay.
        patch = lifecycle.curriculum_status(state, dict.fromkeys(self._step_metrics, 0.0))
        self._step_metrics = set(state.metrics)
        self.status.apply(patch)
        self.status.save()
