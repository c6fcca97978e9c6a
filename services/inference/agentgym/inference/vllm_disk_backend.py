"""The platform's `disk` weight-transfer backend for vLLM: reload from a checkpoint folder every replica mounts.

vLLM 0.32.0's built-in backends (nccl, ipc, ...) need an accelerator and it has no shared-disk backend; this one
works on CPU and GPU alike. It is registered through the `vllm.general_plugins` entry point (pyproject.toml), so
every vLLM process of an environment where the platform is installed knows `--weight-transfer-config
'{"backend": "disk"}'` (a vLLM that has its own `disk` backend keeps it). It speaks vLLM's native routes:

    POST /init_weight_transfer_engine {"init_info": {}}
    POST /start_weight_update
    POST /update_weights {"update_info": {"path": "/checkpoints/run/step-4"}}
    POST /finish_weight_update {"weight_version": "4"}

`update_weights` checks the folder before it touches the model: it must hold `model*.safetensors` whose tensor
names are the served checkpoint's and whose shapes match. A refused update leaves the old weights serving; the
error names the folder and the first offending tensor. Only then are the weights loaded with vLLM's layerwise
reload (`initialize_layerwise_reload` → `model.load_weights` → `finalize_layerwise_reload`), which re-runs the
per-layer processing a backend does after loading (the CPU backend's packed GEMM weights, for one).

This module imports vLLM: it runs only inside vLLM's processes (`.venv-vllm`, the vLLM image).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

log = logging.getLogger(__name__)

BACKEND = "disk"
WEIGHT_GLOB = "model*.safetensors"


class CheckpointRefusedError(ValueError):
    """A checkpoint folder that cannot be loaded into the served model (nothing was changed)."""


def register() -> None:
    """The `vllm.general_plugins` entry point: make `disk` a weight-transfer backend (idempotent; vLLM calls it
    once in each of its processes)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "DiskWeightTransferEngine")


def checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a HF safetensors checkpoint folder, from the files' headers (no data is read)."""
    from safetensors import safe_open

    if not folder.is_dir():
        raise CheckpointRefusedError(f"{folder}: no such checkpoint folder (it must be visible to every replica)")
    files = sorted(folder.glob(WEIGHT_GLOB))
    if not files:
        raise CheckpointRefusedError(f"{folder}: no {WEIGHT_GLOB} weights in the folder")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except Exception as error:
            raise CheckpointRefusedError(f"{file}: not a readable safetensors file: {error}") from error
    return shapes


def check_compatible(new: dict[str, tuple[int, ...]], served: dict[str, tuple[int, ...]], folder: Path) -> None:
    """Refuse a checkpoint whose tensors are not the served model's (unknown names or other shapes)."""
    unknown = sorted(set(new) - set(served))
    if unknown:
        raise CheckpointRefusedError(
            f"{folder}: {len(unknown)} tensor(s) the served model does not have, e.g. {unknown[0]!r} "
            "(another architecture?)"
        )
    for name, shape in new.items():
        if shape != served[name]:
            raise CheckpointRefusedError(
                f"{folder}: {name} has shape {list(shape)}, the served model's is {list(served[name])}"
            )
    missing = sorted(set(served) - set(new))
    if missing:
        raise CheckpointRefusedError(f"{folder}: {len(missing)} tensor(s) missing, e.g. {missing[0]!r}")


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in sorted(folder.glob(WEIGHT_GLOB)):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                yield name, handle.get_tensor(name)


def _copy_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


@dataclass
class DiskInitInfo(WeightTransferInitInfo):
    """Nothing to set up: every replica reads the same folder."""


@dataclass
class DiskUpdateInfo(WeightTransferUpdateInfo):
    path: str
    """An absolute checkpoint folder (HF layout: config.json, model*.safetensors), or a file:// URI of one."""


class DiskWeightTransferEngine(WeightTransferEngine):
    """One update = one checkpoint folder, checked against the served checkpoint, then loaded layer by layer."""

    init_info_cls = DiskInitInfo
    update_info_cls = DiskUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._served: dict[str, tuple[int, ...]] | None = None

    def _served_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """The checkpoint vLLM started from (a local folder), the reference every update is checked against."""
        if self._served is None:
            folder = Path(str(self.model_config.model))
            if folder.is_dir() and any(folder.glob(WEIGHT_GLOB)):
                self._served = checkpoint_shapes(folder)
        return self._served

    def init_transfer_engine(self, init_info: DiskInitInfo) -> None:
        self._served_shapes()

    def start_weight_update(self) -> None:
        """Nothing yet: the model is touched only once `update_weights` has checked the folder."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronises the accelerator afterwards, which fails where there is none (CPU).
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: DiskUpdateInfo) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        folder = Path(str(update_info.path).removeprefix("file://"))
        if not folder.is_absolute():
            raise CheckpointRefusedError(f"{folder}: the disk backend needs an absolute folder path")
        new = checkpoint_shapes(folder)
        served = self._served_shapes()
        if served is not None:
            check_compatible(new, served, folder)
        tied = self._tied_embedding(new)
        initialize_layerwise_reload(self.model)
        embedding: list[torch.Tensor] = []

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in iter_checkpoint(folder):
                if name == tied:
                    embedding.append(tensor)
                yield name, tensor

        self.model.load_weights(weights())
        if tied is not None:
            # Tied embeddings: the checkpoint has no lm_head, and the model's load_weights skips it. The reload
            # gave lm_head a tensor of its own (no longer the embedding's), which would otherwise keep the old
            # values: load the new embedding into it through its own (reload-wrapped) loader.
            head = self.model.lm_head.weight
            getattr(head, "weight_loader", _copy_loader)(head, embedding[0])
        finalize_layerwise_reload(self.model, self.model_config)
        log.info("loaded %d tensors from %s", len(new), folder)

    def _tied_embedding(self, names: dict[str, tuple[int, ...]]) -> str | None:
        """The checkpoint's input embedding when the served model ties its lm_head to it (else None)."""
        config = getattr(self.model_config, "hf_config", None)
        text = getattr(config, "get_text_config", lambda: config)()
        if not getattr(text, "tie_word_embeddings", False) or not hasattr(self.model, "lm_head"):
            return None
        if any(name.endswith("lm_head.weight") for name in names):
            return None
        return next((name for name in names if name.endswith("embed_tokens.weight")), None)

    def finish_weight_update(self) -> None:
        """The weights were loaded and processed in `update_weights`; vLLM then records the version."""

    def shutdown(self) -> None:
        """Nothing held."""
