"""Owns the server's limits and knobs: one frozen ServerConfig, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from isolab.errors import InvalidRequestError

KiB = 1 << 10


@dataclass(frozen=True)
class ServerConfig:
    # 1 MiB of JSON holds a full-context prompt many times over; more is a mistake or an attack.
    max_body_bytes: int = 1024 * KiB
    # None: the engine's context length is the only bound on a prompt.
    max_prompt_tokens: int | None = None
    # The most a request may ask for; a request asking more gets a 400 naming max_tokens.
    max_tokens_limit: int = 4096
    # Defaults when a request does not say: OpenAI's 16 for completions; chat gets room to answer.
    default_completion_max_tokens: int = 16
    default_chat_max_tokens: int = 256
    max_n: int = 16  # choices per request (each one an engine request)
    max_prompts: int = 64  # prompts in one completions request (a list of prompts)
    # Engine requests admitted beyond the running slots; past this a request gets 429.
    max_queue: int = 256
    retry_after_s: int = 1  # the Retry-After a 429 carries
    served_model_name: str | None = None  # None: the model bundle's name

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, not {v!r}", field=name)

        for name in ("max_body_bytes", "max_tokens_limit", "default_completion_max_tokens",
                     "default_chat_max_tokens", "max_n", "max_prompts", "retry_after_s"):
            positive(name)
        if self.max_prompt_tokens is not None:
            positive("max_prompt_tokens")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise InvalidRequestError(f"max_queue must be an integer >= 0, not {self.max_queue!r}", field="max_queue")
