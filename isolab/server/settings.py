"""Owns the server's limits and knobs: one frozen ServerConfig, validated once."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

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
    # The model ids clients may send: the first is the id replies carry and /v1/models lists first,
    # the rest are aliases. (): a slug of the file's name, then the GGUF's general.name.
    served_model_names: tuple[str, ...] = ()
    chat_template: str | None = None  # a Jinja chat template (--chat-template FILE); None: the GGUF's

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
        names = self.served_model_names
        if any(not isinstance(n, str) or not n.strip() for n in names) or len(set(names)) != len(names):
            raise InvalidRequestError("served model names must be distinct non-empty strings",
                                      field="served_model_names")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise InvalidRequestError(f"max_queue must be an integer >= 0, not {self.max_queue!r}", field="max_queue")


def default_model_names(path: Path, name: str) -> tuple[str, ...]:
    """The ids a model is served under without --served-model-name: the file's slug, then general.name."""
    return tuple(dict.fromkeys((model_slug(path.stem), name)))


def model_slug(text: str) -> str:
    """A model id that survives URLs, shells and config files: 'SmolLM2-135M-Instruct.Q4_1' ->
    'smollm2-135m-instruct-q4_1' (lowercase; runs of anything but letters, digits and _ become -)."""
    return re.sub(r"[^a-z0-9_]+", "-", text.lower()).strip("-") or "model"
