"""Token bookkeeping for multi-turn conversations: token-in, token-out.

The trajectory is one growing id sequence: the prompt, then for each turn the ids the model sampled
(kept exactly as sampled, never decoded and re-encoded) followed by the ids of the environment's
reply, rendered with the model's own chat template. `ChatTokenizer` learns, once, how the template
wraps a new user message after an assistant message, and splices observations in as ids:

    <sampled ids ... eos> + [tail after eos] + [user header] + [observation] + [footer + assistant header]

Observation text is tokenized with special-token parsing off, so an observation containing, say,
"<|im_start|>" cannot forge conversation structure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

_ASSISTANT_SENTINEL = "\x00ASSISTANT_SENTINEL\x00"
_USER_SENTINEL = "\x00USER_SENTINEL\x00"


class HFTokenizer(Protocol):
    eos_token_id: int | None
    eos_token: Any

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...

    def decode(self, ids: Any, **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class ObservationFrame:
    """The template text around an observation that follows an assistant message."""

    after_eos: str  # what the template writes after the assistant's end-of-turn token
    before: str  # user-turn header
    after: str  # user-turn footer + the assistant header (generation prompt)


class ChatTokenizer:
    """Renders prompts and observation turns as token ids with a model's chat template."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; the agent loop needs one to end a turn")
        self.tokenizer = tokenizer
        self.eos_token_id: int = tokenizer.eos_token_id
        self.frame = self._learn_frame()
        self._after_eos_ids = self._encode_template(self.frame.after_eos)
        self._before_ids = self._encode_template(self.frame.before)
        self._after_ids = self._encode_template(self.frame.after)

    def _learn_frame(self) -> ObservationFrame:
        base = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": _ASSISTANT_SENTINEL}]
        with_assistant = self._render(base, add_generation_prompt=False)
        with_user = self._render([*base, {"role": "user", "content": _USER_SENTINEL}], add_generation_prompt=True)
        if not with_user.startswith(with_assistant):
            raise ValueError("the chat template re-renders earlier turns; incremental token splicing is impossible")
        tail = with_assistant[with_assistant.index(_ASSISTANT_SENTINEL) + len(_ASSISTANT_SENTINEL) :]
        eos_text = str(self.tokenizer.eos_token)
        if not tail.startswith(eos_text):
            raise ValueError(f"the chat template does not end assistant turns with the eos token {eos_text!r}")
        delta = with_user[len(with_assistant) :]
        before, _, after = delta.partition(_USER_SENTINEL)
        return ObservationFrame(after_eos=tail[len(eos_text) :], before=before, after=after)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return str(text)

    def _encode_template(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _encode_content(self, text: str) -> list[int]:
        if not text:
            return []
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
        except TypeError:  # tokenizers without the flag
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The opening conversation (ending with the assistant header) as ids."""
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in some transformers versions
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def observation_ids(self, observation: str, sampled_ended_with_eos: bool) -> tuple[list[int], int]:
        """Ids to append after a model turn, and how many of them close that turn (eos + tail).

        When the model stopped without its end-of-turn token (length limit), the eos is added here
        as a non-sampled id so the conversation stays well-formed.
        """
        closing = ([] if sampled_ended_with_eos else [self.eos_token_id]) + self._after_eos_ids
        body = self._before_ids + self._encode_content(observation) + self._after_ids
        return closing + body, len(closing)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
