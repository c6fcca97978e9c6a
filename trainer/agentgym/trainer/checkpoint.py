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

:func:`save_checkpoint`, :func:`load_checkpoint`, :func:`maybe_resume`, :func:`export_weights` and
:func:`state_dict` act on a trainer (:class:`Checkpointed`, ``RLTrainer``); under data parallelism
every rank calls them: rank 0 writes what all ranks share, each rank its optimizer partition.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:  # types only: the collector imports RecentIds from here without the models' modules
    from agentgym.trainer.config import RLTrainerConfig
    from agentgym.trainer.curriculum import HorizonSchedule
    from agentgym.trainer.distributed import DataParallel
    from agentgym.trainer.metrics import MetricsSink
    from agentgym.trainer.policy import Policy

log = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_FORMAT",
    "STATE_FILE",
    "Checkpointed",
    "RecentIds",
    "atomic_directory",
    "capture_rng_state",
    "checkpoint_dirs",
    "export_weights",
    "latest_checkpoint",
    "load_checkpoint",
    "load_hf_weights",
    "maybe_resume",
    "prune_checkpoints",
    "rank_atomic_directory",
    "restore_rng_state",
    "save_checkpoint",
    "state_dict",
    "step_dir_name",
]

CHECKPOINT_FORMAT = 1
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


# ----------------------------------------------------------------------------------------------
# a trainer's checkpoints
# ----------------------------------------------------------------------------------------------


class Checkpointed(Protocol):
    """The trainer state a checkpoint holds (``RLTrainer``)."""

    config: RLTrainerConfig
    models: Policy
    schedule: HorizonSchedule
    seen_ids: RecentIds
    step: int
    policy_version: int
    sft_done: bool
    last_metrics: dict[str, float]
    last_checkpoint: Path | None
    policy_dir: Path | None
    sink: MetricsSink | None


@contextlib.contextmanager
def rank_atomic_directory(dp: DataParallel, final: Path) -> Iterator[Path]:
    """:class:`atomic_directory` for every rank: rank 0 makes the temporary folder and renames it into
    place once all ranks have written their parts (each rank's optimizer partition, under DeepSpeed)."""
    if not dp.enabled:
        with atomic_directory(final) as tmp:
            yield tmp
        return
    if dp.is_main:
        with atomic_directory(final) as tmp:
            dp.broadcast(str(tmp))
            yield tmp
            dp.barrier()  # every rank has written into tmp
    else:
        yield Path(dp.broadcast())
        dp.barrier()
    dp.barrier()  # renamed: every rank may read `final`


def state_dict(trainer: Checkpointed) -> dict[str, Any]:
    """The JSON-able trainer state (``trainer_state.json``)."""
    reference_dir = trainer.models.reference_dir
    return {
        "format": CHECKPOINT_FORMAT,
        "step": trainer.step,
        "policy_version": trainer.policy_version,
        "sft_done": trainer.sft_done,
        "reference_dir": str(reference_dir) if reference_dir is not None else None,
        "curriculum": trainer.schedule.state_dict(),
        "curriculum_state": trainer.schedule.state().to_dict(),
        "seen_trajectory_ids": trainer.seen_ids.to_list(),
        "metrics": trainer.last_metrics,
        "config": trainer.config.to_dict(),
        "created_at": time.time(),
    }


def save_checkpoint(trainer: Checkpointed, directory: str | Path | None = None) -> Path:
    """Save ``<directory>/step-<step>/`` atomically (default directory: ``<output_dir>/checkpoints``).

    Older checkpoints beyond ``keep_checkpoints`` are pruned. The saved folder becomes the policy folder.
    """
    models, dp = trainer.models, trainer.models.dp
    root = Path(directory) if directory is not None else trainer.config.checkpoint_dir
    final = root / step_dir_name(trainer.step)
    with rank_atomic_directory(dp, final) as tmp:
        models.save_hf(tmp)
        save_engine_state = getattr(models.engine, "save_engine_state", None)
        if save_engine_state is not None:  # DeepSpeed: partitioned optimizer state, its own format
            save_engine_state(tmp / "engine")  # every rank writes its partition
        if dp.is_main:  # the rest is the same on every rank: rank 0 writes it
            optimizer_state = {
                "policy": None if save_engine_state is not None else models.engine.optimizer_state(),
                "critic": models.critic_engine.optimizer_state() if models.critic_engine is not None else None,
            }
            torch.save(optimizer_state, tmp / "optimizer.pt")
            torch.save(capture_rng_state(), tmp / "rng.pt")
            if models.critic is not None:
                models.critic.save(tmp / "critic")
            (tmp / STATE_FILE).write_text(json.dumps(state_dict(trainer), indent=1, default=float))
    if dp.is_main:
        prune_checkpoints(root, trainer.config.keep_checkpoints, protect=[final])
    trainer.last_checkpoint = final
    trainer.policy_dir = final
    return final


def export_weights(trainer: Checkpointed, directory: str | Path | None = None) -> Path:
    """Write the current policy (HF folder) to ``<directory>/version-<policy_version>`` for inference."""
    root = Path(directory) if directory is not None else trainer.config.weights_dir
    final = root / f"version-{trainer.policy_version}"
    with rank_atomic_directory(trainer.models.dp, final) as tmp:
        trainer.models.save_hf(tmp)
    trainer.policy_dir = final
    if not trainer.models.dp.is_main:
        return final
    versions = sorted(
        (int(p.name.split("-", 1)[1]), p)
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith("version-") and p.name.split("-", 1)[1].isdigit()
    )
    for _, path in versions[: -trainer.config.keep_checkpoints]:
        if path != final:
            shutil.rmtree(path, ignore_errors=True)
    return final


def load_checkpoint(trainer: Checkpointed, directory: str | Path) -> Path:
    """Restore from a ``step-<n>`` folder, or the newest one under ``directory``; returns the folder."""
    path = latest_checkpoint(directory)
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {directory}")
    state = json.loads((path / STATE_FILE).read_text())
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: unsupported checkpoint format {state.get('format')!r}")
    models, config = trainer.models, trainer.config
    load = getattr(models.engine, "load_hf_model", None)
    if load is not None:
        load(path)
    else:
        load_hf_weights(models.model, path)
    optimizer_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    load_engine_state = getattr(models.engine, "load_engine_state", None)
    if load_engine_state is not None:
        load_engine_state(path / "engine")
    else:
        models.engine.load_optimizer_state(optimizer_state["policy"])
    # The optimiser state carries the learning rate it was saved with (e.g. an `agentgym sft` run's, or
    # before the spec changed); the config is the source of truth (there is no schedule to resume).
    models.engine.set_lr(config.learning_rate)
    if models.critic is not None and models.critic_engine is not None:
        if not (path / "critic").is_dir() or optimizer_state.get("critic") is None:
            raise ValueError(f"{path} has no critic (needed for ppo)")
        models.critic.load(path / "critic")
        models.critic_engine.load_optimizer_state(optimizer_state["critic"])
        models.critic_engine.set_lr(config.critic_learning_rate)
    trainer.schedule.load_state_dict(state["curriculum"])
    trainer.seen_ids.replace(state.get("seen_trajectory_ids", []))
    trainer.step = int(state["step"])
    trainer.policy_version = int(state["policy_version"])
    trainer.sft_done = bool(state.get("sft_done", False))
    reference_dir = state.get("reference_dir")
    if reference_dir and config.uses_reference:
        if not (Path(reference_dir) / "config.json").is_file():
            raise ValueError(f"{path} names the KL reference {reference_dir}, which is missing")
        models.reference = models.load_reference(Path(reference_dir))
        models.reference_dir = Path(reference_dir)
    trainer.last_metrics = {str(k): float(v) for k, v in dict(state.get("metrics", {})).items()}
    restore_rng_state(torch.load(path / "rng.pt", map_location="cpu", weights_only=False))
    trainer.last_checkpoint = path
    trainer.policy_dir = path
    return path


def maybe_resume(trainer: Checkpointed, directory: str | Path | None = None) -> Path | None:
    """Load the newest checkpoint under ``directory`` (default: the run's) if there is one."""
    root = Path(directory) if directory is not None else trainer.config.checkpoint_dir
    loaded = load_checkpoint(trainer, root) if latest_checkpoint(root) is not None else None
    if trainer.sink is not None:  # what an earlier process trained after its last checkpoint is trained again
        dropped = trainer.sink.forget_from(trainer.step, sft_committed=trainer.sft_done)
        if dropped:
            log.info("at step %d: dropped %d metrics lines of uncommitted steps", trainer.step, dropped)
    return loaded
