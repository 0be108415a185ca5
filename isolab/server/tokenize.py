"""Owns /tokenize and /detokenize (vLLM's shapes): the served model's tokenizer, behind the same
API keys as /v1/* (the gate), so a tenant can count and inspect tokens before it sends them.

    POST /tokenize    {"prompt": str, "add_special_tokens": true}            -> {count, max_model_len, tokens}
                      {"messages": [...], "add_generation_prompt": true}
    POST /detokenize  {"tokens": [int, ...]}                                  -> {prompt}

Stateless: the tokenizer is shared and read-only; nothing here touches the engine or the cache,
and nothing is logged. Does not know routing (app.py) or the error shape (errors.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, model_validator

from isolab.errors import InvalidRequestError
from isolab.models.tokenizer import Tokenizer
from isolab.server.errors import ApiError, api_error
from isolab.server.protocol import ChatMessage, NullsAreDefaults, TokenId, refuse_lone_surrogates


class TokenizeRequest(NullsAreDefaults):
    """vLLM's /tokenize: a prompt, or chat messages through the model's template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True  # prompt only
    add_generation_prompt: StrictBool = True  # messages only
    chat_template_kwargs: dict[str, Any] | None = None  # messages only

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        refuse_lone_surrogates(data)
        return data


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId]


class Tokenization:
    def __init__(self, tokenizer: Tokenizer, model_names: tuple[str, ...], max_model_len: int,
                 chat_template: str | None = None) -> None:
        self.tok = tokenizer
        self.chat_template = chat_template  # the server's (--chat-template), as the chat endpoint uses
        self.model_names = model_names
        self.max_model_len = max_model_len

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                           f"{', '.join(repr(n) for n in self.model_names)}", param="model", code="model_not_found")

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send exactly one of prompt and messages", param="prompt")
        try:
            if body.messages is not None:
                messages = [m.for_template() for m in body.messages]
                ids = self.tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                   template=self.chat_template,
                                                   template_kwargs=body.chat_template_kwargs)
            else:
                assert body.prompt is not None
                ids = self.tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except InvalidRequestError as exc:
            raise api_error(exc) from None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        bad = [t for t in body.tokens if t >= self.tok.vocab_size]
        if bad:
            raise ApiError(400, f"token ids must be in [0, {self.tok.vocab_size}); got {bad[0]}", param="tokens")
        # special tokens kept, as vLLM's: /tokenize's ids of a chat prompt decode back to that prompt
        return {"prompt": self.tok.decode(body.tokens, skip_special_tokens=False)}
