"""The policy as the agent loop sees it: our inference server or vLLM, through one client."""

from __future__ import annotations

from agentgym.inference.client import CompletionClient, InferenceError
from agentgym.rollout.episode import PolicyError, Sample


class InferencePolicy:
    """`Policy` over an OpenAI-compatible completions server (the platform's HF engine or vLLM)."""

    def __init__(self, client: CompletionClient) -> None:
        self.client = client
        self.provider = "vllm" if client.engine == "vllm" else "agentgym"

    @property
    def model_name(self) -> str | None:
        return self.client.model

    async def sample(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: list[int],
        seed: int | None,
    ) -> Sample:
        try:
            [completion] = await self.client.complete(
                prompt_ids,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                stop_token_ids=stop_token_ids,
                seed=seed,
            )
        except InferenceError as error:
            raise PolicyError(f"inference: {error}", transient=error.transient) from error
        return Sample(
            token_ids=list(completion.token_ids),
            logprobs=list(completion.logprobs),
            finish_reason=completion.finish_reason,
            policy_version=completion.policy_version,
            model=completion.model,
            cached_tokens=completion.cached_tokens,
        )

    async def served_version(self) -> int:
        """The policy version the server currently serves."""
        try:
            return await self.client.policy_version()
        except InferenceError as error:
            raise PolicyError(f"inference: {error}", transient=error.transient) from error
