"""The input bounds of an environment service, defined once and shared by every route and front end.

Native routes, every AgentGym-compatible route and gRPC take actions under the same limit, and every
HTTP body under the same size cap, so no route is a cheaper way to make a service echo, parse or
store something huge. Strings must also be valid Unicode: a lone surrogate (legal in a JSON escape,
``"\\ud800"``) cannot be encoded into a response, so it is refused at the door with a 422 naming the
field instead of failing later on the way out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field

# The guards every HTTP front end shares (the inference server too) live in common; re-exported here.
from agentgym.input_bounds import ASGIApp, safe_text, valid_unicode
from agentgym.input_bounds import BodySizeLimit as _BodySizeLimit

__all__ = [
    "MAX_ACTION_CHARS",
    "MAX_BODY_BYTES",
    "MAX_NAME_CHARS",
    "ActionText",
    "BodyIndex",
    "BodyInt",
    "BodySizeLimit",
    "NameText",
    "json_integer",
    "safe_text",
    "valid_unicode",
]

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


class BodySizeLimit(_BodySizeLimit):
    """The shared body cap middleware with the environment services' limit by default."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = MAX_BODY_BYTES,
        payload: Callable[[str], dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(app, max_bytes, payload)
