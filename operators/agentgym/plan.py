"""The plan of a TrainingRun: what each of its components runs, as a pure function of the spec.

    components = plan_run(run, Placement(...))

One plan for both ways of running a spec: the operator turns each `Component` into a container of a
Deployment or Job (`agentgym.operator.manifests`), the local runner into a supervised process
(`agentgym.local.runner`). So "the local run is the cluster run" holds by construction; only the
`Placement` differs: where the spec file lies, the endpoints (Service DNS names or loopback ports), the
address to bind and the log level.

Every component that needs more of the spec than its endpoints reads the spec file itself (the trainer
and the rollout workers, `--spec`), so no flag can be forgotten. Environment services and inference take
their few settings as flags: their images carry no spec and they serve whatever asks.

Programs are named as in the images (`agentgym`, `python`); the local runner puts this interpreter there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agentgym.spec import EnvironmentSpec, TrainingRun

__all__ = [
    "GRPC_PORT",
    "HTTP_PORT",
    "TRAINER_MODULE",
    "Component",
    "Placement",
    "environment_service",
    "inference_server",
    "plan_run",
    "rollout_worker",
    "trainer",
]

HTTP_PORT = 8000
GRPC_PORT = 50051
HEALTH_PATH = "/health"  # inference (the HF engine and vLLM alike)
ENV_HEALTH_PATH = "/healthz"
TRAINER_MODULE = "agentgym.trainer.entrypoint"
VLLM_WEIGHT_TRANSFER_BACKEND = "disk"
"""vLLM's weight-transfer backend by default: a checkpoint folder every replica mounts (the operator's
`inference.vllm.weightTransferBackend` can change it)."""
LAUNCH_MODULE = "agentgym.trainer.launch"


@dataclass(frozen=True)
class Placement:
    """Where a run's components run: everything the plan needs besides the spec."""

    spec_path: str
    """The resolved spec as the trainer and the rollout workers see it (a mounted ConfigMap, a run folder)."""
    nats_url: str
    """The run's NATS, with credentials (a `$(VAR)` reference to a Secret on the cluster)."""
    inference_url: str
    env_urls: Mapping[str, str]
    """Every environment's URL, the spec's external ones included."""
    bind_host: str = "0.0.0.0"
    http_ports: Mapping[str, int] = field(default_factory=dict)
    """Component name -> its HTTP port (default `HTTP_PORT`: each pod has its own address)."""
    grpc_port: int = GRPC_PORT
    """Environment services' gRPC port; 0 disables it."""
    output_dir: str | None = None
    """The trainer's output folder (metrics, checkpoints unless the spec's URI is absolute); None: its default."""
    inference_model: str | None = None
    """What inference loads instead of the spec's model: a checkpoint folder after a restart."""
    inference_policy_version: int = 0
    """The policy version of `inference_model` (0: the spec's model)."""
    master_port: int = 29500
    """The DeepSpeed launcher's rendezvous port (trainers on several GPUs)."""
    log_level: str | Mapping[str, str] = "info"
    """One log level, or one per component kind (`env`, `inference`, `rollout`, `trainer`)."""

    def port(self, component: str) -> int:
        return int(self.http_ports.get(component, HTTP_PORT))

    def level(self, kind: str) -> str:
        return self.log_level if isinstance(self.log_level, str) else self.log_level.get(kind, "info")


@dataclass(frozen=True)
class Component:
    """One component of the run: its command line, the environment it adds, and how to tell it is up."""

    name: str
    """`env-<kind>`, `inference`, `rollout`, `trainer`."""
    kind: str
    """`env`, `inference`, `rollout`, `trainer`."""
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    port: int | None = None
    health_path: str | None = None
    reads_spec: bool = False
    """Whether it reads `Placement.spec_path` (it must be there: a mounted volume, a file)."""


def setting_text(value: object) -> str:
    """A `--set KEY=VALUE` value as `agentgym env serve` parses it back (JSON where it parses, else the string):
    a plain string as itself where that reads back the same (`heap=1g`), anything else as JSON (the string
    "true" as `"true"`, not the boolean)."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            return value
    return json.dumps(value)


def environment_service(env: EnvironmentSpec, placement: Placement) -> Component:
    """`agentgym env serve KIND`: one environment kind over HTTP (+ gRPC), its `config` as `--set` JSON values."""
    name = f"env-{env.name}"
    command = [
        "agentgym",
        "env",
        "serve",
        env.name,
        "--host",
        placement.bind_host,
        "--port",
        str(placement.port(name)),
        "--grpc-port",
        str(placement.grpc_port),
        "--max-episodes",
        str(env.max_episodes),
        "--log-level",
        placement.level("env"),
    ]
    for key, value in sorted(env.config.items()):
        command += ["--set", f"{key}={setting_text(value)}"]
    return Component(name, "env", tuple(command), port=placement.port(name), health_path=ENV_HEALTH_PATH)


VLLM_CPU_KVCACHE_GIB = 1
"""vLLM's KV cache on CPU (`VLLM_CPU_KVCACHE_SPACE`, GiB): ~260k tokens of the tiny model, ~23k of SmolLM2-135M."""


VLLM_CPU_BATCHED_TOKENS = 8192
"""Prompt tokens vLLM's CPU backend prefills in one step (at least one context: no chunked prefill on CPU)."""


def _vllm_server(
    run: TrainingRun,
    model: str,
    placement: Placement,
    weight_transfer_backend: str | None,
    extra_args: Sequence[str],
) -> tuple[list[str], dict[str, str]]:
    """vLLM's OpenAI-compatible server, the one launch line of the platform (GPU pods, CPU pods, `agentgym run`).

    `python -m` the server module rather than the `vllm` script: the CPU build's distribution is named
    vllm-cpu, and the script's version lookup fails there. On CPU (`gpusPerReplica: 0`, vLLM's CPU backend)
    it runs eagerly (no graph capture), its KV cache is `VLLM_CPU_KVCACHE_SPACE` GiB of memory and nothing is
    fetched from a hub (the model is a local folder)."""
    spec = run.spec
    inference = spec.inference
    on_cpu = inference.gpus_per_replica == 0
    command = [
        "python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        placement.bind_host,
        "--port",
        str(placement.port("inference")),
        "--served-model-name",
        spec.model.name,
        "--tensor-parallel-size",
        str(inference.tensor_parallel),
        "--max-num-seqs",
        str(inference.max_batch_size),
        "--max-model-len",
        str(spec.model.max_context_tokens),
        "--dtype",
        spec.model.dtype,
        "--seed",
        "0",
        # Logprobs of the model's own distribution (before temperature / top-p), as the trainer recomputes them.
        "--logprobs-mode",
        "raw_logprobs",
        "--max-logprobs",
        "20",
        "--return-tokens-as-token-ids",
        # Sampling defaults come from each request, never from the checkpoint's generation_config.json.
        "--generation-config",
        "vllm",
        "--enable-prefix-caching",
        # usage.prompt_tokens_details.cached_tokens: the prefix-cache hits a `chat` span reports.
        "--enable-prompt-tokens-details",
    ]
    if on_cpu:
        # No chunked prefill on CPU: vLLM 0.32 rewinds a seeded request's generator after a partial prefill, which
        # CPU generators cannot do (`CPU Generator does not use offset` kills the engine). Whole prompts then
        # need a token budget of at least one context.
        command += ["--enforce-eager", "--no-enable-chunked-prefill"]
        command += ["--max-num-batched-tokens", str(max(spec.model.max_context_tokens, VLLM_CPU_BATCHED_TOKENS))]
    else:
        command += ["--gpu-memory-utilization", str(inference.gpu_memory_utilization)]
    if weight_transfer_backend:
        command += ["--weight-transfer-config", json.dumps({"backend": weight_transfer_backend})]
    command += list(extra_args)
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # the weight-transfer and pause/resume routes
    if on_cpu:
        env |= {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_CPU_KVCACHE_GIB), "HF_HUB_OFFLINE": "1"}
    return command, env


def inference_server(
    run: TrainingRun,
    placement: Placement,
    *,
    weight_transfer_backend: str | None = VLLM_WEIGHT_TRANSFER_BACKEND,
    extra_args: Sequence[str] = (),
) -> Component:
    """The policy server: vLLM's OpenAI-compatible server, or the platform's HF engine for `engine: hf`.

    Both start on `Placement.inference_model` when set (the newest checkpoint after a restart), else the
    spec's model; vLLM keeps serving under the spec's model name either way."""
    spec = run.spec
    inference = spec.inference
    model = placement.inference_model or spec.model.name
    port = placement.port("inference")
    if inference.engine == "vllm":
        command, env = _vllm_server(run, model, placement, weight_transfer_backend, extra_args)
    else:
        command = [
            "agentgym",
            "inference",
            "serve",
            "--model",
            model,
            "--host",
            placement.bind_host,
            "--port",
            str(port),
            "--max-batch-size",
            str(inference.max_batch_size),
            "--max-model-len",
            str(spec.model.max_context_tokens),
            "--device",
            "cuda" if inference.gpus_per_replica else "cpu",
            "--dtype",
            spec.model.dtype,
            "--policy-version",
            str(placement.inference_policy_version),
            "--log-level",
            placement.level("inference"),
        ]
        if inference.data_parallel > 1:
            command += ["--data-parallel", str(inference.data_parallel)]
        env = {}
    return Component("inference", "inference", tuple(command), env=env, port=port, health_path=HEALTH_PATH)


def rollout_worker(run: TrainingRun, placement: Placement) -> Component:
    """`agentgym rollout worker --spec`: the tokenizer, engine, concurrency and context come from the spec."""
    command = [
        "agentgym",
        "rollout",
        "worker",
        "--spec",
        placement.spec_path,
        "--nats-url",
        placement.nats_url,
        "--inference-url",
        placement.inference_url,
        "--log-level",
        placement.level("rollout"),
    ]
    for name, url in sorted(placement.env_urls.items()):
        command += ["--env-url", f"{name}={url}"]
    return Component("rollout", "rollout", tuple(command), reads_spec=True)


def trainer(run: TrainingRun, placement: Placement) -> Component:
    """The trainer, reading the spec; on several GPUs with `backend: deepspeed`, one rank per GPU under the
    DeepSpeed launcher, itself under `agentgym.trainer.launch`, which hands SIGTERM to the ranks only (a
    checkpointed stop; the launcher as PID 1 would ignore it)."""
    spec = run.spec.trainer
    args = ["--run", placement.spec_path, "--run-name", run.metadata.name, "--nats-url", placement.nats_url]
    if placement.output_dir is not None:
        args += ["--output-dir", placement.output_dir]
    args += ["--log-level", placement.level("trainer")]
    if spec.backend == "deepspeed" and spec.gpus > 1:
        launcher = ["deepspeed", "--num_gpus", str(spec.gpus), "--master_port", str(placement.master_port)]
        command = ["python", "-m", LAUNCH_MODULE, *launcher, "--module", TRAINER_MODULE, *args]
    else:
        command = ["python", "-m", TRAINER_MODULE, *args]
    return Component("trainer", "trainer", tuple(command), reads_spec=True)


def plan_run(run: TrainingRun, placement: Placement) -> list[Component]:
    """Every component of the run, in start order: its own environment services, inference, rollout, trainer."""
    envs = [environment_service(env, placement) for env in run.spec.environments if env.url is None]
    return [*envs, inference_server(run, placement), rollout_worker(run, placement), trainer(run, placement)]
