"""Run an environment service: HTTP (uvicorn) and gRPC on one event loop, one shared manager."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from agentgym.envs import environment_class
from agentgym.envs.server.grpc_api import create_grpc_server
from agentgym.envs.server.http_api import create_app
from agentgym.envs.server.manager import EpisodeManager, ManagerConfig
from agentgym.serving import serve_until_signalled

log = logging.getLogger(__name__)


class EnvironmentSettingsError(ValueError):
    """The environment rejected the service's settings (``env serve --set`` / a spec's ``config``)."""


def build_manager(
    environment: str, config: ManagerConfig | None = None, env_config: dict[str, Any] | None = None
) -> EpisodeManager:
    """A manager creating `environment` instances with `env_config` keyword settings."""
    cls = environment_class(environment)
    settings = dict(env_config or {})
    # Settings can extend the catalog (e.g. Deep Search's user datasets): build one instance with them
    # first, which also surfaces bad settings before the service starts.
    try:
        probe = cls(**settings)
    except (TypeError, ValueError) as error:  # an unknown key or a bad value
        raise EnvironmentSettingsError(f"{environment}: bad settings {settings}: {error}") from error
    try:
        catalog = probe.catalog()
    finally:
        probe.close()
    return EpisodeManager(environment, lambda: cls(**settings), catalog, config)


async def serve(
    environment: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    grpc_port: int | None = 50051,
    config: ManagerConfig | None = None,
    env_config: dict[str, Any] | None = None,
    log_level: str = "warning",
) -> None:
    """Serve until SIGINT/SIGTERM; gRPC is skipped when `grpc_port` is None."""
    manager = build_manager(environment, config, env_config)
    await manager.start()
    grpc_server = None
    try:
        if grpc_port is not None:
            grpc_server, bound = create_grpc_server(manager, f"{host}:{grpc_port}")
            await grpc_server.start()
            log.info("gRPC on %s:%d", host, bound)
        app = create_app(manager, manage_lifecycle=False)
        await serve_until_signalled(app, host, port, log_level)
    finally:
        if grpc_server is not None:
            await grpc_server.stop(grace=2)
        await manager.stop()


def run(environment: str, **kwargs: Any) -> None:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(environment, **kwargs))
