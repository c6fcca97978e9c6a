"""Every container command the operator starts, in one place (the CLIs they call are owned elsewhere).

Ports are fixed by convention: HTTP 8000 everywhere, gRPC 50051 on environment services.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

HTTP_PORT = 8000
GRPC_PORT = 50051
SPEC_DIR = "/etc/agentgym"
SPEC_PATH = f"{SPEC_DIR}/spec.yaml"
NATS_URL_ENV = "AGENTGYM_NATS_URL"


def env_service(kind: str, max_episodes: int, settings: Mapping[str, Any]) -> list[str]:
    """`agentgym env serve`: one environment kind over HTTP + gRPC."""
    command = [
        "agentgym",
        "env",
        "serve",
        kind,
        "--host",
        "0.0.0.0",
        "--port",
        str(HTTP_PORT),
        "--grpc-port",
        str(GRPC_PORT),
        "--max-episodes",
        str(max_episodes),
    ]
    for key, value in sorted(settings.items()):
        command += ["--set", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return command


HF_HEALTH_PATH = "/health"
VLLM_HEALTH_PATH = "/health"


def hf_inference(
    model: str, *, max_batch_size: int, max_model_len: int, dtype: str, gpus: int, policy_version: int
) -> list[str]:
    """The platform's HF-transformers engine (`agentgym inference serve`), on CPU or the pod's GPU.

    `--policy-version` is the version of the weights it starts on (a checkpoint after a restart)."""
    return [
        "agentgym",
        "inference",
        "serve",
        "--model",
        model,
        "--host",
        "0.0.0.0",
        "--port",
        str(HTTP_PORT),
        "--max-batch-size",
        str(max_batch_size),
        "--max-model-len",
        str(max_model_len),
        "--device",
        "cuda" if gpus else "cpu",
        "--dtype",
        dtype,
        "--policy-version",
        str(policy_version),
    ]


def vllm_inference(
    model: str,
    *,
    served_model_name: str,
    tensor_parallel: int,
    gpu_memory_utilization: float,
    max_num_seqs: int,
    max_model_len: int,
    dtype: str,
    weight_transfer_backend: str | None,
    extra_args: list[str],
) -> list[str]:
    """vLLM's OpenAI-compatible server with what the platform needs: token ids in and out, logprobs,
    a stable served name across checkpoint restarts, and the weight-transfer control plane."""
    command = [
        "vllm",
        "serve",
        model,
        "--host",
        "0.0.0.0",
        "--port",
        str(HTTP_PORT),
        "--served-model-name",
        served_model_name,
        "--tensor-parallel-size",
        str(tensor_parallel),
        "--gpu-memory-utilization",
        str(gpu_memory_utilization),
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        dtype,
        "--return-tokens-as-token-ids",
        "--max-logprobs",
        "1",
    ]
    if weight_transfer_backend:
        command += ["--weight-transfer-config", json.dumps({"backend": weight_transfer_backend})]
    return command + list(extra_args)


def rollout_worker(run: str, inference_url: str, env_urls: Mapping[str, str], concurrency: int) -> list[str]:
    """`agentgym rollout worker`; the NATS URL (with credentials) comes from $AGENTGYM_NATS_URL."""
    command = [
        "agentgym",
        "rollout",
        "worker",
        "--run",
        run,
        "--nats-url",
        f"$({NATS_URL_ENV})",
        "--inference-url",
        inference_url,
        "--concurrency",
        str(concurrency),
    ]
    for name, url in sorted(env_urls.items()):
        command += ["--env-url", f"{name}={url}"]
    return command


TRAINER_MODULE = "agentgym.trainer.entrypoint"


def trainer(run: str, *, backend: str, gpus: int) -> list[str]:
    """The trainer (`python -m agentgym.trainer.entrypoint`, reading the mounted spec), under the DeepSpeed
    launcher (one data-parallel rank per GPU of the pod) for `backend: deepspeed`, itself under
    `agentgym.trainer.launch`, which hands the pod's SIGTERM to the ranks (a checkpointed stop). NATS with
    credentials comes in through $AGENTGYM_NATS_URL."""
    args = ["--run", SPEC_PATH, "--run-name", run, "--nats-url", f"$({NATS_URL_ENV})"]
    if backend == "deepspeed":
        launcher = ["deepspeed", "--num_gpus", str(gpus), "--master_port", "29500", "--module", TRAINER_MODULE]
        return ["python", "-m", "agentgym.trainer.launch", *launcher, *args]
    return ["python", "-m", TRAINER_MODULE, *args]
