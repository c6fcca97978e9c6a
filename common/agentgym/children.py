"""Child processes that do not outlive their parent."""

from __future__ import annotations

import ctypes
import signal

__all__ = ["PR_SET_PDEATHSIG", "die_with_parent"]

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child, before exec (`preexec_fn`): ask Linux to send SIGTERM when the parent dies (no-op elsewhere).
    A supervisor or a server killed with SIGKILL then leaves no orphan holding its ports or memory."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
