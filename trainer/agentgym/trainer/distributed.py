"""Data-parallel training over several ranks (GPUs), started by the DeepSpeed launcher.

Rank 0 is the trainer job as on one rank: it talks to NATS (requests, trajectories, weight updates,
curriculum), writes metrics and owns every file it saves. The other ranks never touch NATS: they
:func:`follow` rank 0, which announces each trainer call (``train_step``, ``sft``,
``save_checkpoint`` ...) with the call's arguments before making it itself, so every rank runs the
same calls on the same data in the same order, as DeepSpeed's collectives require.

Inside a call the work is split (:meth:`DataParallel.shard`): each mini-batch's packed rows go
round-robin to the ranks, so a step's forward/backward work is divided by the world size. DeepSpeed
averages the ranks' gradients, so each rank scales its loss by the world size: the averaged gradient
is then the sum of the rows' gradients, the single-rank update exactly (up to summation order). A
rank with fewer rows than the others runs a zero-weighted pass over one of the mini-batch's rows, so
every rank makes the same number of forward and backward calls (ZeRO-3 gathers parameters inside
both; ZeRO-1/2 reduce gradients inside backward).

Commands and metrics travel as Python objects over a gloo group of their own with a long timeout:
the other ranks wait on it while rank 0 collects trajectories, which can take far longer than a
collective is normally allowed to. Checkpoint and weight folders must be on a filesystem every rank
sees (the trainer pod's volume): DeepSpeed writes each rank's optimizer partition into the folder.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

log = logging.getLogger(__name__)

__all__ = ["FOLLOWED_CALLS", "DataParallel", "follow", "init_data_parallel", "world_size_from_env"]

T = TypeVar("T")

# How long the other ranks may wait for rank 0's next command (rank 0 may be collecting for hours
# when rollouts stall); a collective of the training step itself keeps the backend's timeout.
COMMAND_TIMEOUT = datetime.timedelta(days=7)

# The trainer methods rank 0 may announce; a follower calls nothing else.
FOLLOWED_CALLS = frozenset(
    {"maybe_resume", "renumber_policy", "sft", "train_step", "save_checkpoint", "export_weights"}
)


@dataclass
class DataParallel:
    """This process's place among the data-parallel ranks; one rank (the default) makes every method trivial."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    objects: Any = field(default=None, repr=False)
    """The gloo process group for Python objects (commands, metrics); None on one rank."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def shard(self, items: Sequence[T], sizes: Sequence[float] | None = None) -> list[T | None]:
        """This rank's share of ``items``, padded with None so that every rank gets as many entries.

        Without ``sizes``: round-robin, ``items[rank::world]``. With ``sizes`` (e.g. each packed row's
        tokens): largest first, each to the rank with the least so far, which evens out the ranks'
        work when rows differ in length. A None asks for an idle pass: the ranks' collectives must
        pair up. Every rank computes the same split from the same inputs. On one rank: all of ``items``.
        """
        if not self.enabled:
            return list(items)
        if sizes is None:
            mine: list[T | None] = list(items[self.rank :: self.world_size])
            return mine + [None] * (math.ceil(len(items) / self.world_size) - len(mine))
        if len(sizes) != len(items):
            raise ValueError("one size per item")
        loads = [0.0] * self.world_size
        owned: list[list[int]] = [[] for _ in range(self.world_size)]
        for i in sorted(range(len(items)), key=lambda k: (-sizes[k], k)):
            rank = min(range(self.world_size), key=lambda r: (loads[r], len(owned[r]), r))
            loads[rank] += sizes[i]
            owned[rank].append(i)
        longest = max(len(indices) for indices in owned)
        share: list[T | None] = [items[i] for i in sorted(owned[self.rank])]
        return share + [None] * (longest - len(share))

    def broadcast(self, value: Any = None) -> Any:
        """Rank 0's ``value`` on every rank (the other ranks' argument is ignored)."""
        if not self.enabled:
            return value
        import torch.distributed as dist

        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self.objects)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        if not self.enabled:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.objects)
        return out

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier(group=self.objects)

    def sum_gradients(self, parameters: Iterable[nn.Parameter]) -> None:
        """All-reduce (sum) the gradients of a model trained outside DeepSpeed (PPO's critic).

        A parameter without a gradient on this rank (it had no rows) contributes zeros.
        """
        if not self.enabled:
            return
        import torch.distributed as dist

        for p in parameters:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)

    def broadcast_parameters(self, module: nn.Module) -> None:
        """Rank 0's values of ``module``'s parameters and buffers on every rank (e.g. a random value head)."""
        if not self.enabled:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0)

    # -- rank 0 -> followers ---------------------------------------------------------------------

    def announce(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Rank 0: tell the followers to call ``trainer.<method>(*args, **kwargs)`` (no-op on one rank)."""
        if not self.enabled:
            return
        if not self.is_main:
            raise RuntimeError("only rank 0 announces")
        if method not in FOLLOWED_CALLS and method != "stop":
            raise ValueError(f"{method!r} is not a call the followers make")
        self.broadcast((method, args, kwargs))

    def stop_followers(self) -> None:
        """Rank 0: release the followers (they return from :func:`follow`)."""
        self.announce("stop")


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def init_data_parallel(local_rank: int | None = None) -> DataParallel:
    """Join the launcher's process group (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ... from the environment).

    On one rank nothing is initialised. On GPUs each rank takes ``cuda:<LOCAL_RANK>``.
    """
    world = world_size_from_env()
    if world <= 1:
        return DataParallel()
    import torch.distributed as dist

    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    import deepspeed

    from agentgym.trainer.deepspeed_backend import skip_cpu_shared_memory_op

    skip_cpu_shared_memory_op()

    deepspeed.init_distributed(verbose=False)
    objects = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    rank = dist.get_rank()
    log.info("data-parallel rank %d of %d (local rank %d)", rank, world, local_rank)
    return DataParallel(rank=rank, world_size=world, local_rank=local_rank, objects=objects)


class Follower(Protocol):
    """What :func:`follow` drives (``RLTrainer``: its methods named in :data:`FOLLOWED_CALLS`)."""

    @property
    def dp(self) -> DataParallel: ...


def follow(trainer: Follower) -> int:
    """A rank other than 0: make the trainer calls rank 0 announces until it says stop; the number made.

    SIGTERM and SIGINT are left to rank 0 (the launcher sends them to every rank): rank 0 finishes the
    step in progress, checkpoints and then stops its followers, which must take part until then.
    """
    dp = trainer.dp
    if dp.is_main:
        raise RuntimeError("rank 0 leads; it does not follow")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: log.info("rank %d: signal %d, stopping with rank 0", dp.rank, signum))
    calls = 0
    while True:
        method, args, kwargs = dp.broadcast()
        if method == "stop":
            return calls
        if method not in FOLLOWED_CALLS:
            raise RuntimeError(f"rank 0 announced an unknown call {method!r}")
        getattr(trainer, method)(*args, **kwargs)
        calls += 1
