"""Loaded by every process the pod executor starts (PYTHONPATH): the pod's own address, played on loopback.

Each pod has its own loopback address ($AGENTGYM_POD_IP, 127.0.0.x): a socket bound to the wildcard binds
there instead, so every pod can listen on the port its manifest names (8000), as pods do on their own IPs.
(Service names resolve through the pod's /etc/hosts, which the executor bind-mounts.)
"""

from __future__ import annotations

import os
import socket

_POD_IP = os.environ.get("AGENTGYM_POD_IP")
_bind = socket.socket.bind


def _bind_to_the_pod_address(self: socket.socket, address: object) -> None:
    if isinstance(address, tuple) and address[:1] in (("0.0.0.0",), ("",)) and self.family == socket.AF_INET:
        address = (_POD_IP, *address[1:])
    _bind(self, address)  # type: ignore[arg-type]


if _POD_IP:
    socket.socket.bind = _bind_to_the_pod_address  # type: ignore[method-assign]
