"""HTTP clients of an environment service (the rollout workers' and the CLI's side)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx


class EnvServiceError(RuntimeError):
    """The service refused a call; `status` is the HTTP status, `detail` its message."""

    def __init__(self, status: int, detail: str) -> None:
        self.status = status
        self.detail = detail
        super().__init__(f"{status}: {detail}")


@dataclass(frozen=True)
class Opened:
    episode_id: str
    task_id: str | None
    observation: str
    available_actions: list[str] | None
    info: dict[str, Any]


@dataclass(frozen=True)
class Stepped:
    observation: str
    reward: float
    score: float
    done: bool
    truncated: bool
    available_actions: list[str] | None
    info: dict[str, Any]


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise EnvServiceError(response.status_code, str(detail))
    return response.json() if response.content else None


def _task_body(task_id: str | None, split: str | None, index: int | None) -> dict[str, Any]:
    if task_id is not None:
        return {"task_id": task_id}
    if split is not None and index is not None:
        return {"split": split, "index": index}
    return {}


class EnvClient:
    """Blocking client: `with EnvClient(url) as env: opened = env.create(task_id=...)`."""

    def __init__(self, base_url: str, timeout: float = 60.0) -> None:
        self._http = httpx.Client(base_url=base_url, timeout=timeout)

    def __enter__(self) -> EnvClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_client()

    def close_client(self) -> None:
        self._http.close()

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = _check(self._http.get("/healthz"))
        return result

    def splits(self) -> dict[str, int]:
        result: dict[str, int] = _check(self._http.get("/v1/tasks"))["splits"]
        return result

    def task_ids(self, split: str, offset: int = 0, limit: int = 100) -> list[str]:
        params: dict[str, str | int] = {"split": split, "offset": offset, "limit": limit}
        result: list[str] = _check(self._http.get("/v1/tasks", params=params))["task_ids"]
        return result

    def create(self, task_id: str | None = None, split: str | None = None, index: int | None = None) -> Opened:
        return Opened(**_check(self._http.post("/v1/episodes", json=_task_body(task_id, split, index))))

    def reset(
        self, episode_id: str, task_id: str | None = None, split: str | None = None, index: int | None = None
    ) -> Opened:
        body = _task_body(task_id, split, index)
        return Opened(**_check(self._http.post(f"/v1/episodes/{episode_id}/reset", json=body)))

    def step(self, episode_id: str, action: str) -> Stepped:
        return Stepped(**_check(self._http.post(f"/v1/episodes/{episode_id}/step", json={"action": action})))

    def observe(self, episode_id: str) -> dict[str, Any]:
        result: dict[str, Any] = _check(self._http.get(f"/v1/episodes/{episode_id}"))
        return result

    def close(self, episode_id: str) -> None:
        _check(self._http.delete(f"/v1/episodes/{episode_id}"))


class AsyncEnvClient:
    """Asyncio client with the same calls as `EnvClient` (the rollout workers use this one)."""

    def __init__(self, base_url: str, timeout: float = 60.0, max_connections: int = 256) -> None:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits)

    async def __aenter__(self) -> AsyncEnvClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def health(self) -> dict[str, Any]:
        result: dict[str, Any] = _check(await self._http.get("/healthz"))
        return result

    async def create(self, task_id: str | None = None, split: str | None = None, index: int | None = None) -> Opened:
        return Opened(**_check(await self._http.post("/v1/episodes", json=_task_body(task_id, split, index))))

    async def step(self, episode_id: str, action: str) -> Stepped:
        response = await self._http.post(f"/v1/episodes/{episode_id}/step", json={"action": action})
        return Stepped(**_check(response))

    async def close(self, episode_id: str) -> None:
        _check(await self._http.delete(f"/v1/episodes/{episode_id}"))
