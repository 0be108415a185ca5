"""Owns the wire format: pydantic models of the OpenAI requests and responses that we serve.

Requests ignore fields they do not know (clients send many); fields we know but do not implement
are accepted only at their neutral value, so a client never silently gets something else.
Responses are built as plain dicts by isolab.server.serving, following these shapes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from isolab.sampling_params import MAX_TOP_LOGPROBS

NonNegInt = Annotated[StrictInt, Field(ge=0)]
TokenId = Annotated[StrictInt, Field(ge=0)]
Number = Annotated[float, Field(allow_inf_nan=False)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="the served model's id; omitted means that model")
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] = 1.0
    top_k: NonNegInt = Field(0, description="extension: 0 = off")
    n: Annotated[StrictInt, Field(ge=1)] = 1
    seed: Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, description="extension")
    ignore_eos: StrictBool = Field(False, description="extension: keep going past end-of-sequence")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(
        None, description="narrows prefix-cache sharing inside your tenant; never widens it"
    )
    user: str | None = None
    presence_penalty: Annotated[Number, Field(ge=0.0, le=0.0)] = Field(0.0, description="not supported: 0 only")
    frequency_penalty: Annotated[Number, Field(ge=0.0, le=0.0)] = Field(0.0, description="not supported: 0 only")
    logit_bias: dict[str, float] | None = Field(None, description="not supported: omit or {}")

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class CompletionRequest(_Request):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: Literal[False] = Field(False, description="not supported: false only")
    suffix: None = Field(None, description="not supported")
    best_of: Annotated[StrictInt, Field(ge=1)] | None = Field(None, description="must equal n when given")


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    tools: None = Field(None, description="not supported")
    response_format: dict[str, Any] | None = Field(None, description="only {'type': 'text'}")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "isolab"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
