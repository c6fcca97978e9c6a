"""The operator's side of NATS: connections, the run's streams, and its control messages (which
`agentgym.lifecycle` turns into status).

The trainer publishes `CurriculumState` (step, stage, horizon, step metrics) and `WeightUpdate`
(version, checkpoint URI) on the run's control subjects; the control stream keeps the last few per
subject, so a restarted operator starts from the latest state (`DeliverPolicy.LAST_PER_SUBJECT`).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from agentgym.messaging import RunChannels, decode_message
from agentgym.operator.config import redact
from agentgym.proto import rl_pb2

JSONDict = dict[str, Any]


class NatsUnavailable(Exception):
    """NATS cannot be reached now (a temporary error)."""


class NatsPool:
    """One connection per NATS URL, shared by every run that uses it."""

    def __init__(self, connect_timeout: float = 5.0) -> None:
        self.connect_timeout = connect_timeout
        self._clients: dict[str, Client] = {}
        self._lock = asyncio.Lock()

    async def jetstream(self, url: str) -> JetStreamContext:
        async with self._lock:
            client = self._clients.get(url)
            if client is None or client.is_closed:
                try:
                    client = await asyncio.wait_for(
                        nats.connect(
                            url,
                            name="agentgym-operator",
                            connect_timeout=self.connect_timeout,
                            allow_reconnect=True,
                            max_reconnect_attempts=-1,
                            reconnect_time_wait=1,
                        ),
                        timeout=self.connect_timeout * 2,
                    )
                except Exception as error:
                    raise NatsUnavailable(
                        f"cannot connect to NATS at {redact(url)}: {error or type(error).__name__}"
                    ) from None
                self._clients[url] = client
        if not client.is_connected:
            raise NatsUnavailable(f"NATS at {redact(url)} is reconnecting")
        return client.jetstream()

    async def close(self) -> None:
        async with self._lock:
            for client in self._clients.values():
                with contextlib.suppress(Exception):
                    await client.close()
            self._clients.clear()


async def subscribe_control(js: JetStreamContext, channels: RunChannels) -> JetStreamContext.PushSubscription:
    """An ordered consumer on the run's control subjects, starting from the last message of each."""
    return await js.subscribe(
        f"{channels.prefix}.control.>",
        stream=channels.control_stream,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
    )


def decode_control(
    channels: RunChannels, subject: str, data: bytes
) -> rl_pb2.CurriculumState | rl_pb2.WeightUpdate | None:
    if subject == channels.curriculum_subject:
        return decode_message(data, rl_pb2.CurriculumState)
    if subject == channels.weights_subject:
        return decode_message(data, rl_pb2.WeightUpdate)
    return None
