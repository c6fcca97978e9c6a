"""The platform check behind `helm test` (`agentgym operator check`): the operator and NATS answer."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import nats

from agentgym.operator.config import redact, with_credentials


def nats_url_from_env(url: str) -> str:
    """Add NATS_TOKEN, or NATS_USER + NATS_PASSWORD, from the environment to `url`."""
    token = os.environ.get("NATS_TOKEN")
    if token:
        return with_credentials(url, token=token)
    return with_credentials(url, user=os.environ.get("NATS_USER"), password=os.environ.get("NATS_PASSWORD"))


async def check_operator(url: str, timeout: float) -> str | None:
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.get(url) as response,
        ):
            if response.status != 200:
                return f"operator {url} answered {response.status}: {(await response.text())[:200]}"
    except (aiohttp.ClientError, TimeoutError) as error:
        return f"operator {url} unreachable: {type(error).__name__}: {error}"
    return None


async def check_nats(url: str, timeout: float) -> str | None:
    full = nats_url_from_env(url)
    try:
        client = await asyncio.wait_for(
            nats.connect(full, connect_timeout=timeout, allow_reconnect=False, max_reconnect_attempts=0),
            timeout=timeout,
        )
    except Exception as error:
        return f"NATS {redact(full)} unreachable or refused the credentials: {type(error).__name__}: {error}"
    try:
        info = await client.jetstream().account_info()
        del info
    except Exception as error:
        return f"NATS {redact(full)} answers but JetStream does not: {type(error).__name__}: {error}"
    finally:
        await client.close()
    return None


async def check_platform(operator_url: str, nats_url: str, *, timeout: float = 30.0) -> list[str]:
    results = await asyncio.gather(check_operator(operator_url, timeout), check_nats(nats_url, timeout))
    return [problem for problem in results if problem]
