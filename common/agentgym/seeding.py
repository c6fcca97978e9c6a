"""Seeds for sampling, derived by hashing so that different episodes and turns never share a stream.

A ``RolloutRequest.seed`` of 0 means "unseeded" (proto3 cannot tell an unset field from 0), so a
derived seed is always in ``[1, 2**31 - 1]``.

Why hashing and not arithmetic: seeds such as ``base + sample`` for every task, or ``seed + turn``
for every turn, make episodes share random streams: sample 0 of every task draws the same
uniforms, and turn 1 of sample 0 draws what turn 0 of sample 1 draws. With a near-deterministic
reply format, a draw that picks a tail token at some position then does so in every episode that
shares it, so the episodes of an evaluation or of a GRPO group stop being independent.
"""

from __future__ import annotations

import hashlib

__all__ = ["derive_seed"]


def derive_seed(*parts: object) -> int:
    """A seed in ``[1, 2**31 - 1]`` determined by ``parts`` (joined by "/" and hashed with SHA-256)."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") % (2**31 - 1) + 1
