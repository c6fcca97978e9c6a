"""vLLM, the production engine: its launch command line and an adapter for its weight-update API.

vLLM needs CUDA and cannot run on the CPU machines this platform is developed on; this module only speaks
its documented protocol (see services/inference/README.md for what was and was not run).

- `vllm_serve_argv(settings)` / `vllm_serve_env(settings)`: the `vllm serve` command the platform deploys:
  token-id prompts (native), raw-model logprobs (`--logprobs-mode raw_logprobs`, the same semantics as our HF
  engine), `--return-tokens-as-token-ids`, no generation-config sampling defaults (`--generation-config vllm`),
  max model length, GPU memory utilisation, tensor parallelism, max concurrent sequences, prefix caching, and
  the weight-transfer engine (`--weight-transfer-config '{"backend": ...}'`, whose HTTP control routes need
  `VLLM_SERVER_DEV_MODE=1`).
- `VLLMAdapter`: the same weight-update interface as our `CompletionClient` (`load_weights(uri, version)`,
  `policy_version()`), over vLLM's HTTP control plane:
    * reload from a checkpoint folder with the `disk` weight-transfer backend:
      `POST /pause?mode=wait` → `POST /init_weight_transfer_engine {"init_info": {}}` (once) →
      `POST /start_weight_update` → `POST /update_weights {"update_info": {"path": DIR}}` →
      `POST /finish_weight_update {"weight_version": "V"}` → `POST /resume`; version from `GET /weight_info`.
    * the native NCCL backend (trainer on its own GPUs broadcasts to the inference workers):
      `POST /init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset, world_size,
      packed, packed_buffer_size_bytes, packed_num_buffers}}` once (concurrently with the trainer joining the
      NCCL group as rank 0), then per update `start_weight_update` → `update_weights {"update_info": {names,
      dtype_names, shapes}}` running concurrently with the trainer's broadcast → `finish_weight_update`.
  A failed update leaves vLLM paused (its updates are not transactional, so partly loaded weights must not
  serve): the error says so, and a retried update resumes serving once it succeeds.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import aiohttp

from agentgym.inference.client import InferenceError

if TYPE_CHECKING:
    from agentgym.spec import InferenceSpec, ModelSpec

WeightTransferBackend = Literal["nccl", "ipc", "disk"]
PauseMode = Literal["wait", "abort", "keep"]
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
DEFAULT_PACKED_NUM_BUFFERS = 2


@dataclass(frozen=True)
class VLLMServeSettings:
    """What the platform sets on `vllm serve` (built from a TrainingRun's model + inference specs)."""

    model: str
    served_model_name: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.85
    max_model_len: int = 4096
    max_num_seqs: int = 64
    dtype: str = "bfloat16"
    seed: int = 0
    max_logprobs: int = 20
    weight_transfer_backend: WeightTransferBackend | None = "nccl"
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    extra_args: tuple[str, ...] = ()

    @classmethod
    def from_spec(
        cls,
        model: ModelSpec,
        inference: InferenceSpec,
        *,
        model_path: str | None = None,
        port: int = 8000,
        weight_transfer_backend: WeightTransferBackend | None = "nccl",
    ) -> VLLMServeSettings:
        """Settings from the spec; `model_path` is where the deployment put the weights (default: model.name)."""
        return cls(
            model=model_path or model.name,
            served_model_name=model.name,
            port=port,
            tensor_parallel=inference.tensor_parallel,
            gpu_memory_utilization=inference.gpu_memory_utilization,
            max_model_len=model.max_context_tokens,
            max_num_seqs=inference.max_batch_size,
            dtype=model.dtype,
            weight_transfer_backend=weight_transfer_backend,
        )


def vllm_serve_argv(settings: VLLMServeSettings) -> list[str]:
    """The `vllm serve ...` argv for these settings."""
    argv = [
        "vllm",
        "serve",
        settings.model,
        "--host",
        settings.host,
        "--port",
        str(settings.port),
        "--served-model-name",
        settings.served_model_name or settings.model,
        "--tensor-parallel-size",
        str(settings.tensor_parallel),
        "--gpu-memory-utilization",
        f"{settings.gpu_memory_utilization:g}",
        "--max-model-len",
        str(settings.max_model_len),
        "--max-num-seqs",
        str(settings.max_num_seqs),
        "--dtype",
        settings.dtype,
        "--seed",
        str(settings.seed),
        "--max-logprobs",
        str(settings.max_logprobs),
        # Logprobs of the model's own distribution (before temperature / top-p), as the trainer recomputes them.
        "--logprobs-mode",
        "raw_logprobs",
        "--return-tokens-as-token-ids",
        # Sampling defaults come from each request, never from the checkpoint's generation_config.json.
        "--generation-config",
        "vllm",
    ]
    if settings.enable_prefix_caching:
        argv.append("--enable-prefix-caching")
    if settings.enforce_eager:
        argv.append("--enforce-eager")
    if settings.weight_transfer_backend is not None:
        argv += ["--weight-transfer-config", json.dumps({"backend": settings.weight_transfer_backend})]
    argv += list(settings.extra_args)
    return argv


def vllm_serve_env(settings: VLLMServeSettings) -> dict[str, str]:
    """Environment `vllm serve` needs: the weight-transfer and pause routes exist only in dev mode."""
    return {"VLLM_SERVER_DEV_MODE": "1"} if settings.weight_transfer_backend is not None else {}


@dataclass(frozen=True)
class ParamInfo:
    """One tensor of an NCCL weight update, in checkpoint (Hugging Face) naming."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]


class VLLMAdapter:
    """Weight updates (and the served version) of one vLLM server over its HTTP control routes."""

    def __init__(
        self,
        base_url: str,
        *,
        session: aiohttp.ClientSession | None = None,
        timeout: float = 1800.0,
        pause_mode: PauseMode = "wait",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.pause_mode = pause_mode
        self._session = session
        self._owns_session = session is None
        self._disk_ready = False

    async def __aenter__(self) -> VLLMAdapter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None and self._owns_session:
            await self._session.close()
        self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
            self._owns_session = True
        return self._session

    async def _call(
        self, method: str, path: str, payload: dict[str, Any] | None = None, params: dict[str, str] | None = None
    ) -> Any:
        url = f"{self.base_url}{path}"
        try:
            async with self._http().request(method, url, json=payload, params=params) as response:
                text = await response.text()
                try:
                    body = json.loads(text) if text else None
                except ValueError:
                    body = None
                if response.status >= 400:
                    detail = body.get("detail") or body.get("error") if isinstance(body, dict) else None
                    raise InferenceError(
                        f"vLLM {method} {path} -> HTTP {response.status}: {detail or text.strip()[:500]}",
                        status=response.status,
                    )
                return body
        except InferenceError:
            raise
        except (TimeoutError, aiohttp.ClientError) as error:
            raise InferenceError(f"vLLM {method} {path}: {type(error).__name__}: {error}", status=None) from error

    # ---------------------------------------------------------------- the shared weight-update interface

    async def policy_version(self) -> int:
        """`GET /weight_info` → its `weight_version` (0 before any committed update)."""
        body = await self._call("GET", "/weight_info")
        value = body.get("weight_version") if isinstance(body, dict) else None
        if value in (None, ""):
            return 0
        try:
            return int(str(value))
        except ValueError as error:
            raise InferenceError(
                f"vLLM weight_version {value!r} is not an integer", status=None, transient=False
            ) from error

    async def load_weights(self, uri: str, version: int) -> int:
        """Reload from a checkpoint folder (the `disk` backend) and commit it as `version`."""
        path = Path(uri.removeprefix("file://"))
        if not path.is_absolute():
            raise InferenceError(
                f"{uri}: vLLM's disk backend needs an absolute folder path visible to every worker",
                status=None,
                transient=False,
            )
        await self.pause()
        try:
            if not self._disk_ready:
                await self._call("POST", "/init_weight_transfer_engine", {"init_info": {}})
                self._disk_ready = True
            await self._call("POST", "/start_weight_update")
            await self._call("POST", "/update_weights", {"update_info": {"path": str(path)}})
            await self._call("POST", "/finish_weight_update", {"weight_version": str(version)})
        except InferenceError as error:
            raise InferenceError(
                f"{error}; vLLM stays paused (weights may be partly updated): retry load_weights", status=error.status
            ) from error
        await self.resume()
        return version

    # ---------------------------------------------------------------- generation control

    async def pause(self, mode: PauseMode | None = None) -> None:
        """`POST /pause?mode=...` (`wait` lets in-flight requests finish on the old weights)."""
        await self._call("POST", "/pause", params={"mode": mode or self.pause_mode})

    async def resume(self) -> None:
        await self._call("POST", "/resume")

    async def is_paused(self) -> bool:
        body = await self._call("GET", "/is_paused")
        return bool(body.get("is_paused")) if isinstance(body, dict) else False

    async def world_size(self, include_dp: bool = True) -> int:
        """Inference workers that join an NCCL weight-transfer group (`GET /get_world_size`)."""
        body = await self._call("GET", "/get_world_size", params={"include_dp": str(include_dp).lower()})
        return int(body["world_size"])

    # ---------------------------------------------------------------- native NCCL weight transfer

    async def init_nccl(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        rank_offset: int = 1,
        packed: bool = True,
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
    ) -> None:
        """Make the inference workers join the trainer's NCCL group (the trainer is rank 0, workers start at
        `rank_offset`); it returns once the trainer has joined too, so run it concurrently with that."""
        init_info = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "packed": packed,
            "packed_buffer_size_bytes": packed_buffer_size_bytes,
            "packed_num_buffers": packed_num_buffers,
        }
        await self._call("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    async def update_nccl(
        self,
        params: Sequence[ParamInfo],
        broadcast: Callable[[], Awaitable[None] | None],
        version: int,
    ) -> int:
        """One NCCL update: the workers receive `params` (in this order) while `broadcast()` (the trainer's
        rank-0 NCCL broadcast of the same tensors; a plain function runs in a thread) sends them."""
        update_info = {
            "names": [p.name for p in params],
            "dtype_names": [p.dtype.removeprefix("torch.") for p in params],
            "shapes": [list(p.shape) for p in params],
        }
        await self.pause()
        try:
            await self._call("POST", "/start_weight_update")
            receive = asyncio.ensure_future(self._call("POST", "/update_weights", {"update_info": update_info}))
            try:
                if inspect.iscoroutinefunction(broadcast):
                    await broadcast()
                else:
                    result = await asyncio.to_thread(broadcast)
                    if inspect.isawaitable(result):
                        await result
            except BaseException:
                receive.cancel()
                raise
            await receive
            await self._call("POST", "/finish_weight_update", {"weight_version": str(version)})
        except InferenceError as error:
            raise InferenceError(
                f"{error}; vLLM stays paused (weights may be partly updated): retry the update", status=error.status
            ) from error
        await self.resume()
        return version
