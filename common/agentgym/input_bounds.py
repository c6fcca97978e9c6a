"""Input guards shared by the platform's HTTP front ends (the environment services and the inference server).

Strings must be valid Unicode: a lone surrogate (legal in a JSON escape, ``"\\ud800"``) cannot be encoded into
a response, so it is refused at the door instead of failing later on the way out. Error messages that quote
input go through `safe_text`. Request bodies are capped before they are read (`BodySizeLimit`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any


def valid_unicode(value: str) -> str:
    """`value` unchanged, or a ValueError when it holds a lone surrogate (not encodable as UTF-8)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {error.start}") from None
    return value


def safe_text(value: object, limit: int = 500) -> str:
    """`value` as text that can always be encoded into a response: lone surrogates escaped, cut to `limit`."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = text[:limit] + "…"
    return text.encode("utf-8", errors="backslashreplace").decode("utf-8")


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodySizeLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 before the app reads any of it.

    A declared Content-Length over the cap is refused at once (the server enforces the declared length,
    so a body that passes this check cannot be larger). A body without one (chunked) is buffered up to
    the cap and refused as soon as it passes it. `payload(message)` builds the JSON error body.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        payload: Callable[[str], dict[str, Any]] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.payload = payload or (lambda message: {"detail": message, "error": message})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
                break
        if declared is not None:
            if declared > self.max_bytes:
                await self._refuse(send)
                return
            await self.app(scope, receive, send)
            return
        if not any(name == b"transfer-encoding" for name, _ in scope.get("headers", ())):
            await self.app(scope, receive, send)  # no body at all
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        message = f"request body too large: at most {self.max_bytes} bytes"
        content = json.dumps(self.payload(message)).encode("utf-8")
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(content)).encode("ascii")),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": content})
