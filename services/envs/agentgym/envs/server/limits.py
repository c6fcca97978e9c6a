"""The input bounds of an environment service, defined once and shared by every route and front end.

Native routes, every AgentGym-compatible route and gRPC take actions under the same limit, and every
HTTP body under the same size cap, so no route is a cheaper way to make a service echo, parse or
store something huge. Strings must also be valid Unicode: a lone surrogate (legal in a JSON escape,
``"\\ud800"``) cannot be encoded into a response, so it is refused at the door with a 422 naming the
field instead of failing later on the way out.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field

# One action, on every route. AgentGym's WebArena and Deep Search clients send the model's whole reply
# (chain of thought included) and the server extracts the action: 16 Ki characters is ~4k tokens, 8x the
# longest reply the platform's recipes sample (maxTokensPerTurn 512). Not more: Deep Search's tag parser
# is quadratic in the length of a reply full of unclosed tags (16 Ki: 0.5 s of CPU on the 2-core dev
# machine, 32 Ki: 2 s, 64 Ki: 10 s), and BabyAI and TextCraft echo an invalid action back.
MAX_ACTION_CHARS = 16_384
# Task ids, split names and the other names a request carries.
MAX_NAME_CHARS = 1_024
# Any HTTP request body. The largest legitimate one is an action of MAX_ACTION_CHARS characters, each
# escaped in JSON as up to 12 bytes (an astral character written as a \uXXXX\uXXXX pair): 192 KiB, plus
# the other fields. Checked before the body is read into memory or parsed (413 past it).
MAX_BODY_BYTES = 262_144


def valid_unicode(value: str) -> str:
    """`value` unchanged, or a ValueError when it holds a lone surrogate (not encodable as UTF-8)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {error.start}") from None
    return value


ActionText = Annotated[str, Field(max_length=MAX_ACTION_CHARS), AfterValidator(valid_unicode)]
NameText = Annotated[str, Field(max_length=MAX_NAME_CHARS), AfterValidator(valid_unicode)]


def json_integer(value: object) -> object:
    """Refuse what pydantic's lax int would take but JSON does not call an integer: `true` is not episode 1,
    and "1" is text. (1.0 is an integer in JSON Schema, and stays accepted.)"""
    if isinstance(value, bool | str | bytes):
        raise ValueError(f"must be an integer, not {type(value).__name__}")
    return value


# Integers in a JSON body. Query parameters stay plain ints: they arrive as text.
BodyInt = Annotated[int, BeforeValidator(json_integer)]
# A position in a list (a split's index, AgentGym's data_idx). The bound comes before the validator so
# that it reaches the JSON schema as "minimum".
BodyIndex = Annotated[int, Field(ge=0), BeforeValidator(json_integer)]


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
        max_bytes: int = MAX_BODY_BYTES,
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
