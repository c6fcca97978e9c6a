"""Fixtures of the service-framework tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from countdown_env import make_manager

from agentgym.envs.server.manager import EpisodeManager


@pytest.fixture
async def manager() -> AsyncIterator[EpisodeManager]:
    m = make_manager()
    await m.start()
    yield m
    await m.stop()
