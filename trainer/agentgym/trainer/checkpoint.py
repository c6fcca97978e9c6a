"""Checkpoints: layout, atomic writes, pruning, RNG state, HF weight loading, recent trajectory ids.

Layout of ``<checkpoints>/step-<n>/`` (``n`` = training steps completed)::

    config.json, generation_config.json, model*.safetensors   the policy, HF format (loadable by
                                                             from_pretrained and by inference)
    tokenizer.json, tokenizer_config.json, chat_template...   the tokenizer (when the trainer has one)
    optimizer.pt       {"policy": optimizer state, "critic": optimizer state or None}
    rng.pt             python / numpy / torch CPU / CUDA RNG states
    trainer_state.json step, policy version, curriculum state_dict, seen trajectory ids, metrics,
                       config summary (see RLTrainer.save_checkpoint)
    critic/            PPO only: the value model (HF backbone + value_head.safetensors)

A checkpoint is written into ``<checkpoints>/.tmp-step-<n>-<random>/`` and renamed into place
(``os.replace`` of a directory within one filesystem is atomic), so a crash leaves either the old
state or the complete new one; ``trainer_state.json`` is written last and a folder without it is
never considered. Older ``step-*`` folders beyond ``keep`` are removed after the new one is in place.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "STATE_FILE",
    "RecentIds",
    "atomic_directory",
    "capture_rng_state",
    "checkpoint_dirs",
    "latest_checkpoint",
    "load_hf_weights",
    "prune_checkpoints",
    "restore_rng_state",
    "step_dir_name",
]

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def checkpoint_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """Complete ``step-<n>`` checkpoints under ``root``, oldest first."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = []
    for child in base.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (or ``root`` itself when it is one)."""
    base = Path(root)
    if (base / STATE_FILE).is_file():
        return base
    dirs = checkpoint_dirs(base)
    return dirs[-1][1] if dirs else None


def prune_checkpoints(root: str | Path, keep: int, protect: Iterable[Path] = ()) -> list[Path]:
    """Remove all but the newest ``keep`` checkpoints (never those in ``protect``); returns the removed."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    protected = {Path(p).resolve() for p in protect}
    removed = []
    for _, path in checkpoint_dirs(root)[:-keep]:
        if path.resolve() in protected:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    # leftovers of interrupted writes
    base = Path(root)
    if base.is_dir():
        for child in base.iterdir():
            if child.name.startswith(".tmp-") and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
    return removed


class atomic_directory:
    """``with atomic_directory(final) as tmp:`` write into ``tmp``; on success it becomes ``final``.

    An existing ``final`` is replaced (moved aside, then removed). On an exception the temporary
    directory is removed and ``final`` is left as it was.
    """

    def __init__(self, final: str | Path) -> None:
        self.final = Path(final)
        self.tmp: Path | None = None

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{self.final.name}-", dir=self.final.parent))
        return self.tmp

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        assert self.tmp is not None
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        _fsync_tree(self.tmp)
        old: Path | None = None
        if self.final.exists():
            old = self.final.parent / f".tmp-old-{self.final.name}-{os.getpid()}"
            if old.exists():
                shutil.rmtree(old)
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())


def capture_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch wheels
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no safetensors weights in {folder}")


def load_hf_weights(model: nn.Module, folder: str | Path) -> None:
    """Load HF safetensors weights (single file or sharded) into ``model`` in place.

    Keys may be missing only for tied parameters (e.g. ``lm_head.weight`` tied to the embeddings);
    anything else missing or unexpected raises.
    """
    from safetensors.torch import load_file

    path = Path(folder)
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        state.update(load_file(str(file)))
    result = model.load_state_dict(state, strict=False)
    tied = _tied_keys(model)
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise ValueError(
            f"weights in {path} do not match the model: missing {sorted(missing)}, "
            f"unexpected {sorted(result.unexpected_keys)}"
        )


def _tied_keys(model: nn.Module) -> set[str]:
    """Parameter names that share storage with an earlier-named parameter."""
    seen: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        key = id(param)
        if key in seen:
            tied.add(name)
        else:
            seen[key] = name
    return tied


class RecentIds:
    """An insertion-ordered set of the most recent ``capacity`` trajectory ids (dedup across restarts)."""

    def __init__(self, capacity: int = 100_000, ids: Iterable[str] = ()) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()
        for trajectory_id in ids:
            self.add(trajectory_id)

    def add(self, trajectory_id: str) -> None:
        self._ids[trajectory_id] = None
        self._ids.move_to_end(trajectory_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def update(self, ids: Iterable[str]) -> None:
        for trajectory_id in ids:
            self.add(trajectory_id)

    def __contains__(self, trajectory_id: object) -> bool:
        return trajectory_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def to_list(self) -> list[str]:
        return list(self._ids)

    def replace(self, ids: Iterable[str]) -> None:
        """Forget everything, then hold ``ids`` (used when loading a checkpoint)."""
        self._ids.clear()
        self.update(ids)
