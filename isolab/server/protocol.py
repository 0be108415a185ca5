"""Owns the wire format: the OpenAI requests (pydantic) and the replies (TypedDicts) that we serve.

Requests ignore fields they do not know (clients send many); fields we know but do not implement
are accepted only at their neutral value, so a client never silently gets something else.
Replies are plain JSON dicts typed by the TypedDicts below (key order is the wire order), built
by isolab.server.formats and isolab.server.call; errors by isolab.server.errors. Does not know the
engine or HTTP.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired, TypedDict

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from isolab.sampling_params import MAX_TOP_LOGPROBS

NonNegInt = Annotated[StrictInt, Field(ge=0)]
TokenId = Annotated[StrictInt, Field(ge=0)]
Number = Annotated[float, Field(allow_inf_nan=False)]


class BaseRequest(BaseModel):
    """What completions and chat requests share: the sampling knobs and the refused fields."""

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


class CompletionRequest(BaseRequest):
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


class ChatCompletionRequest(BaseRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    tools: None = Field(None, description="not supported")
    response_format: dict[str, Any] | None = Field(None, description="only {'type': 'text'}")


# -- replies ----------------------------------------------------------------------------------------
class PromptTokensDetails(TypedDict):
    cached_tokens: int


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobsBody(TypedDict):
    """The legacy completions logprobs: four parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobsBody(TypedDict):
    content: list[ChatTokenLogprob]


class CompletionChoice(TypedDict):
    """A completions choice; a streamed chunk's choice has the same shape (text = the delta)."""

    index: int
    text: str
    logprobs: CompletionLogprobsBody | None
    finish_reason: str | None


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str


class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobsBody | None
    finish_reason: str | None


class ChatDelta(TypedDict, total=False):
    role: Literal["assistant"]
    content: str


class ChatChunkChoice(TypedDict):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobsBody | None
    finish_reason: str | None


FinalChoice = CompletionChoice | ChatChoice
ChunkChoice = CompletionChoice | ChatChunkChoice


class Reply(TypedDict):
    """The non-streamed body: object "text_completion" or "chat.completion"."""

    id: str
    object: str
    created: int
    model: str
    choices: list[FinalChoice]
    usage: Usage


class Chunk(TypedDict):
    """One server-sent event: one choice's piece, or (the last, with include_usage) no choice and the usage."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: NotRequired[Usage]


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


BaseRequest.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
