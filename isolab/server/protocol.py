"""Owns the wire format: the OpenAI requests (pydantic) and the replies (TypedDicts) that we serve.

No silent ignoring. A field is one of three kinds (docs/server.md lists each):
  * honoured: a field of the models below;
  * refused: a field a peer (OpenAI, vLLM, SGLang, llama.cpp) honours and we do not (REFUSED), or
    one of ours at a value we do not implement: 400 naming it (`param`), never silently dropped;
  * ignored and reported: any other field (clients such as LangChain send extras). It is kept
    out of the request, and its name (never its value) goes to the log and to the
    `x-isolab-ignored-params` response header (BaseRequest.ignored_params).
Replies are plain JSON dicts typed by the TypedDicts below (key order is the wire order), built
by isolab.server.formats and isolab.server.call; errors by isolab.server.errors. Does not know the
engine or HTTP.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired, TypedDict

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, Strict, StrictBool, StrictInt, model_validator

from isolab.sampling_params import MAX_TOP_LOGPROBS
from isolab.server.refused import REFUSED, RefusedField
from isolab.server.tools import ToolCallIn, ToolChoice, ToolSpec, history_text

MAX_STOPS = 64  # stop strings a request may give
MAX_STOP_CHARS = 1024  # characters a stop string may have
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
NonNegInt = Annotated[StrictInt, Field(ge=0)]
TokenId = Annotated[StrictInt, Field(ge=0)]
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]  # an int is a number; a bool or "0" is not (400)


def refuse_lone_surrogates(data: Any) -> None:
    """A JSON body may escape half of a UTF-16 pair ("\\ud800"): Python keeps it in the string, and no
    tokenizer or grammar can take it. The first such string is a 400 naming its field. (A loop, not a
    recursion: a body nested as deep as the JSON parser allows must not overflow the stack here.)"""
    todo: list[tuple[Any, str]] = [(data, "")]
    while todo:
        item, path = todo.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                name = path or "body"
                raise RefusedField(name, "", message=f"{name}: the text holds a lone UTF-16 surrogate (half of an "
                                                      "escaped pair); send valid Unicode") from None
        elif isinstance(item, dict):
            for key, value in item.items():
                todo.append((key, path))
                todo.append((value, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, list):
            todo.extend((value, f"{path}.{i}") for i, value in enumerate(item))


class NullsAreDefaults(BaseModel):
    """A request body (or a part of one) in which an explicit null for a field is its default (a
    required one stays missing), as OpenAI and vLLM read it: clients write unset options as null."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class BaseRequest(NullsAreDefaults):
    """What completions and chat requests share: the sampling knobs, the refused and ignored fields."""

    model_config = ConfigDict(extra="ignore")
    _ignored: tuple[str, ...] = PrivateAttr(default=())
    _moot: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="before")
    @classmethod
    def _refuse_peer_fields(cls, data: Any) -> Any:
        refuse_lone_surrogates(data)
        if isinstance(data, dict):
            refused = cls.refused()
            for name in data:
                if name in refused and data[name] is not None and name not in cls.model_fields:
                    raise RefusedField(name, refused[name])
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _record_ignored(cls, data: Any, handler: Any) -> Any:
        model = handler(data)
        if isinstance(data, dict):
            refused = cls.refused()
            top = {k for k in data if k not in cls.model_fields and k not in refused}
            model._ignored = tuple(sorted(top | cls._nested_ignored(data)))
        return model

    @classmethod
    def _nested_ignored(cls, data: dict[str, Any]) -> set[str]:
        """Fields inside the body's objects that nobody reads, as 'messages[].name'."""
        out: set[str] = set()
        so = data.get("stream_options")
        if isinstance(so, dict):  # e.g. vLLM's continuous_usage_stats
            out |= {f"stream_options.{k}" for k in so if k not in StreamOptions.model_fields}
        rf = data.get("response_format")
        if isinstance(rf, dict):  # what its type reads (a json_object's schema is refused: server/structured.py)
            reads: dict[str, tuple[str, ...]] = {"json_schema": ("type", "json_schema"), "json_object": ("type", "schema")}
            read = reads.get(str(rf.get("type")), ("type",))
            out |= {f"response_format.{k}" for k in rf if k not in read}
            js = rf.get("json_schema") if rf.get("type") == "json_schema" else None
            if isinstance(js, dict):  # the name is an identifier; a description would guide OpenAI's model
                out |= {f"response_format.json_schema.{k}" for k in js if k not in ("name", "schema", "strict")}
        return out

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> BaseRequest:
        if self.stream_options is not None and not self.stream:
            raise RefusedField("stream_options", "", message="stream_options goes with stream: true")
        return self

    @classmethod
    def refused(cls) -> dict[str, str]:
        """The fields this endpoint refuses by name (server/refused.py)."""
        return REFUSED

    @property
    def ignored_params(self) -> tuple[str, ...]:
        """Names of the body's fields that nobody defines here (their values are never kept), then those
        the request makes moot (set_moot)."""
        return self._ignored + self._moot

    def set_moot(self, names: tuple[str, ...]) -> None:
        """Fields we define that this request's other fields make moot (stop beside a JSON output)."""
        self._moot = names

    model: str | None = Field(None, description="the served model's id; omitted means that model")
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None  # 0: completions with echo only (the prompt scored); chat: >= 1
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[Number, Field(ge=0.0, le=1.0)] = 1.0  # 0: the most likely token only (OpenAI takes [0, 1])
    top_k: Annotated[StrictInt, Field(ge=-1)] = Field(0, description="extension: 0 or -1 = off")
    n: Annotated[StrictInt, Field(ge=1)] = 1
    seed: Annotated[StrictInt, Field(ge=-(2**63), lt=2**63)] | None = None  # OpenAI's int64
    # every token is checked against every stop string: bounded, so one request cannot slow the step
    # for all (OpenAI takes 4; vLLM has no bound)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, description="extension")
    ignore_eos: StrictBool = Field(False, description="extension: keep going past end-of-sequence")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(
        None, description="narrows prefix-cache sharing inside your tenant; never widens it"
    )
    user: str | None = None
    presence_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[Number, Field(ge=0.01, le=100.0)] = Field(1.0, description="extension: 1 = off")
    logit_bias: dict[str, Annotated[Number, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="token id (as a string) -> bias added to its logit")
    min_p: Annotated[Number, Field(ge=0.0, le=1.0)] = Field(0.0, description="extension: 0 = off")
    min_tokens: NonNegInt = Field(0, description="extension: no stop before this many tokens")
    # structured outputs (server/structured.py): at most one of these
    response_format: dict[str, Any] | None = Field(None, description="text, json_object or json_schema")
    guided_json: dict[str, Any] | str | None = Field(None, description="extension (vLLM): a JSON schema")
    guided_regex: str | None = Field(None, description="extension (vLLM)")
    guided_choice: list[str] | None = Field(None, description="extension (vLLM)")
    structured_outputs: dict[str, Any] | None = Field(None, description="extension (vLLM): json, regex or choice")
    json_schema: dict[str, Any] | None = Field(None, description="extension (llama.cpp's server)")

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class StreamOptions(NullsAreDefaults):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class CompletionRequest(BaseRequest):
    @classmethod
    def refused(cls) -> dict[str, str]:
        return {**REFUSED, "chat_template_kwargs": "chat template arguments apply to chat completions only"}

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: StrictBool = Field(False, description="the reply starts with the prompt (and its logprobs)")
    suffix: None = Field(None, description="not supported")
    best_of: Annotated[StrictInt, Field(ge=1)] | None = Field(None, description="must equal n when given")


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatRefusalPart(BaseModel):
    """An assistant turn's refusal, as OpenAI writes it back into the history: read as its text."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["refusal"]
    refusal: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[Annotated[ChatContentPart | ChatRefusalPart, Field(discriminator="type")]],
                             Field(min_length=1)] | None = None  # (OpenAI refuses an empty list)
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this result answers

    @model_validator(mode="after")
    def _complete(self) -> ChatMessage:
        """What OpenAI requires of each role: content, except where an assistant turn made tool calls;
        a tool result names the call it answers."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            article = "an" if self.role == "assistant" else "a"  # (a user, a system, a developer, a tool)
            raise ValueError(f"{article} {self.role} message needs content" + (" (or tool_calls)" if self.role == "assistant" else ""))
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.role != "assistant" and isinstance(self.content, list) and \
                any(isinstance(p, ChatRefusalPart) for p in self.content):
            raise ValueError(f"a refusal part belongs to an assistant message, not a {self.role} one")
        return self

    def for_template(self) -> dict[str, str]:
        """The message as the chat template reads it ('developer' is OpenAI's newer name for 'system';
        earlier tool calls are written as the model is asked to write them)."""
        text = self.text()
        if self.tool_calls:
            text = (text + "\n" if text else "") + history_text(self.tool_calls)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, ChatContentPart) else p.refusal for p in self.content)


class ChatCompletionRequest(BaseRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # (0, completions' scoring call, is no chat call)
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat template")
    tools: Annotated[list[ToolSpec], Field(min_length=1)] | None = None  # (OpenAI refuses [])
    tool_choice: ToolChoice | None = None  # default: auto with tools, none without
    parallel_tool_calls: StrictBool = True

    @classmethod
    def _nested_ignored(cls, data: dict[str, Any]) -> set[str]:
        out = super()._nested_ignored(data)
        read = set(ChatMessage.model_fields) - {"name"}  # a participant's name: the chat templates have no place for it
        for m in data.get("messages") or ():
            if isinstance(m, dict):
                out |= {f"messages[].{k}" for k, v in m.items() if k not in read and v is not None}
                if isinstance(m.get("content"), list):
                    kinds = {"text": ChatContentPart.model_fields, "refusal": ChatRefusalPart.model_fields}
                    out |= {f"messages[].content[].{k}" for part in m["content"] if isinstance(part, dict)
                            for k in part if k not in kinds.get(str(part.get("type")), ChatContentPart.model_fields)}
        return out


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
    token_logprobs: list[float | None]
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
    stop_reason: NotRequired[str | int | None]  # vLLM's: the stop string or stop token that ended it (final)


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str | None
    tool_calls: NotRequired[list[dict[str, Any]]]


class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobsBody | None
    finish_reason: str | None
    stop_reason: NotRequired[str | int | None]  # vLLM's: the stop string or stop token that ended it (final)


class ChatDelta(TypedDict, total=False):
    role: Literal["assistant"]
    content: str
    tool_calls: list[dict[str, Any]]


class ChatChunkChoice(TypedDict):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobsBody | None
    finish_reason: str | None
    stop_reason: NotRequired[str | int | None]  # vLLM's: the stop string or stop token that ended it (final)


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
    usage: NotRequired[Usage | None]


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
