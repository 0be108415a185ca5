"""Owns what differs between /v1/completions and /v1/chat/completions: two Formats.

    Format.plan(body)        -> Plan: the prompts' token ids (checked), max_tokens, logprobs
    Format.choice(index, logprobs) -> ChoiceFormat: one choice's opening / delta / finish
                                      chunk pieces and its final choice; keeps its logprobs
    id_prefix, object, chunk_object: the names in the reply

Limits holds the checks both share (prompt length, max_tokens). Does not know the engine loop,
tenants or HTTP; the checks a request fails raise ApiError.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from isolab.engine.request import TokenLogprob
from isolab.errors import InvalidRequestError
from isolab.models.tokenizer import Tokenizer
from isolab.server.errors import ApiError, api_error
from isolab.server.outputs import ChatLogprobs, CompletionLogprobs
from isolab.server.protocol import (
    BaseRequest,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionRequest,
    ChatLogprobsBody,
    ChunkChoice,
    CompletionChoice,
    CompletionRequest,
    FinalChoice,
)
from isolab.server.settings import ServerConfig
from isolab.server.tools import ToolError, ToolOutput, ToolPlan, parse_calls, plan_tools

BodyT_contra = TypeVar("BodyT_contra", bound=BaseRequest, contravariant=True)


@dataclass(frozen=True)
class Plan:
    """What a checked body asks of the engine, the same for every choice."""

    prompts: tuple[tuple[int, ...], ...]  # token ids, one entry per prompt (n choices each)
    max_tokens: int
    logprobs: int | None  # top alternatives per token; None: no logprobs
    echo: bool = False  # completions: the reply starts with the prompt (its logprobs too, when asked)
    tools: ToolPlan | None = None  # chat: tools the model may call (server/tools.py)


class ChoiceFormat(Protocol):
    """One choice's pieces of the reply; keeps its logprobs so far (for the final choice)."""

    def opening(self) -> ChunkChoice | None: ...  # streamed before any token

    # one output's text delta and logprobs (and, on its first output, the prompt's when echoed);
    # None when there is nothing to send
    def delta(self, text: str, lps: Sequence[TokenLogprob],
              prompt_lps: Sequence[TokenLogprob] | None = None) -> ChunkChoice | None: ...

    def finish(self, reason: str) -> Sequence[ChunkChoice]: ...  # the last pieces: the finish_reason's chunk last

    def final(self, text: str, reason: str | None) -> FinalChoice: ...


class Format(Protocol[BodyT_contra]):
    """One endpoint's format: its body becomes a Plan; each choice gets a ChoiceFormat."""

    id_prefix: str  # response ids: "<prefix>-<hex>"
    object: str  # the non-streamed reply's object
    chunk_object: str  # a streamed chunk's object

    def plan(self, body: BodyT_contra) -> Plan: ...

    def choice(self, index: int, logprobs: bool, prompt: tuple[int, ...] = (), echo: bool = False,
               tools: ToolPlan | None = None) -> ChoiceFormat: ...


@dataclass(frozen=True)
class Limits:
    """The server's limits on a prompt and on max_tokens, as 400s naming the field."""

    config: ServerConfig
    max_model_len: int

    def check_prompt(self, ids: Sequence[int]) -> None:
        limit = self.config.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server takes at most {limit}",
                           param="prompt", code="context_length_exceeded")

    def max_tokens(self, requested: int | None, default: int, prompt_len: int | None, field: str = "max_tokens") -> int:
        """field: the name the client sent the limit under (max_completion_tokens on chat), named in a 400."""
        limit = self.config.max_tokens_limit
        if requested is not None:
            if requested > limit:
                raise ApiError(400, f"{field} is {requested}; this server allows at most {limit}", param=field)
            if prompt_len is not None and prompt_len + requested > self.max_model_len:  # (the engine's own
                # check says max_tokens, whichever name the client sent the limit under)
                raise ApiError(400, f"the prompt has {prompt_len} tokens and {field} is {requested}: together more "
                                    f"than the context of {self.max_model_len} tokens", param="messages",
                               code="context_length_exceeded")
            return requested
        value = min(default, limit)
        if prompt_len is not None:  # room left in the context (and the KV pool), so a long chat still gets an answer
            room = self.max_model_len - prompt_len
            if room < 1:
                raise ApiError(400, f"the prompt has {prompt_len} tokens, which leaves no room for an answer in the "
                                    f"{self.max_model_len} tokens a request may hold", param="messages",
                               code="context_length_exceeded")
            value = min(value, room)
        return value


# -- completions ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CompletionFormat:
    tok: Tokenizer
    limits: Limits
    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def plan(self, body: CompletionRequest) -> Plan:
        if body.best_of is not None and body.best_of != body.n:
            raise ApiError(400, "best_of is not supported beyond best_of == n", param="best_of")
        if body.max_tokens == 0 and not body.echo:  # (OpenAI's legacy scoring call: echo, logprobs, max_tokens 0)
            raise ApiError(400, "max_tokens 0 generates nothing: it needs echo=true (the prompt, and its logprobs "
                                "when asked)", param="max_tokens")
        prompts = self._prompts(body.prompt)
        max_tokens = self.limits.max_tokens(body.max_tokens, self.limits.config.default_completion_max_tokens, None)
        return Plan(prompts, max_tokens, body.logprobs, body.echo)

    def _prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> tuple[tuple[int, ...], ...]:
        if isinstance(prompt, str):
            raw: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            raw = [list(prompt)]  # type: ignore[arg-type]
        else:
            raw = list(prompt)  # type: ignore[arg-type]
        if not raw:
            raise ApiError(400, "the prompt list is empty", param="prompt")
        if len(raw) > self.limits.config.max_prompts:
            raise ApiError(400, f"at most {self.limits.config.max_prompts} prompts per request", param="prompt")
        out = []
        for p in raw:
            ids = self.tok.encode(p) if isinstance(p, str) else list(p)
            if not ids:
                raise ApiError(400, "a prompt is empty: send at least one token", param="prompt")
            self.limits.check_prompt(ids)
            out.append(tuple(ids))
        return tuple(out)

    def choice(self, index: int, logprobs: bool, prompt: tuple[int, ...] = (), echo: bool = False,
               tools: ToolPlan | None = None) -> _CompletionChoice:
        # the prompt as the model saw it, special tokens written out (<|im_start|>, a BOS the tokenizer
        # added): the text the logprobs entries and their text_offset walk through
        echoed = _Echo(self.tok.decode(prompt, skip_special_tokens=False), prompt[0]) if echo and prompt else None
        return _CompletionChoice(index, CompletionLogprobs(self.tok) if logprobs else None, echoed)


@dataclass
class _Echo:
    """echo=true: the prompt goes out before the first token (its logprobs too; the first prompt
    token has none). Mutable: `sent` flips once."""

    text: str
    first_token: int
    sent: bool = False


@dataclass(frozen=True)
class _CompletionChoice:
    index: int
    logprobs: CompletionLogprobs | None
    echo: _Echo | None = None

    def opening(self) -> None:
        return None

    def delta(self, text: str, lps: Sequence[TokenLogprob],
              prompt_lps: Sequence[TokenLogprob] | None = None) -> CompletionChoice | None:
        entries: list[TokenLogprob | int] = list(lps)
        if self.echo is not None and not self.echo.sent:
            self.echo.sent = True
            text = self.echo.text + text
            entries = [self.echo.first_token, *(prompt_lps or ()), *lps]
        lp = self.logprobs.push(entries) if self.logprobs is not None and entries else None
        if not text and lp is None:
            return None
        return {"index": self.index, "text": text, "logprobs": lp, "finish_reason": None}

    def finish(self, reason: str) -> list[CompletionChoice]:
        return [{"index": self.index, "text": "", "logprobs": None, "finish_reason": reason}]

    def final(self, text: str, reason: str | None) -> CompletionChoice:
        lp = self.logprobs.total if self.logprobs is not None else None
        prefix = self.echo.text if self.echo is not None else ""
        return {"index": self.index, "text": prefix + text, "logprobs": lp, "finish_reason": reason}


# -- chat -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatFormat:
    tok: Tokenizer
    limits: Limits
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def plan(self, body: ChatCompletionRequest) -> Plan:
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        try:
            tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        except ToolError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        messages = [m.for_template() for m in body.messages]
        if tools is not None:  # shown in a system message: SmolLM2's template does not render `tools`
            if messages[0]["role"] == "system":
                messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + tools.system}
            else:
                messages.insert(0, {"role": "system", "content": tools.system})
        try:
            ids = self.tok.apply_chat_template(messages, template=self.limits.config.chat_template,
                                               template_kwargs=body.chat_template_kwargs)
        except InvalidRequestError as exc:
            raise api_error(exc) from None
        self.limits.check_prompt(ids)
        # (both sent: max_completion_tokens, OpenAI's newer name, wins, as vLLM reads them)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = self.limits.max_tokens(requested, self.limits.config.default_chat_max_tokens, len(ids), field)
        return Plan((tuple(ids),), max_tokens, (body.top_logprobs or 0) if body.logprobs else None, tools=tools)

    def choice(self, index: int, logprobs: bool, prompt: tuple[int, ...] = (), echo: bool = False,
               tools: ToolPlan | None = None) -> _ChatChoice:
        return _ChatChoice(index, ChatLogprobs(self.tok) if logprobs else None,
                           ToolOutput(tools) if tools is not None else None)


@dataclass(frozen=True)
class _ChatChoice:
    index: int
    logprobs: ChatLogprobs | None
    tools: ToolOutput | None = None  # tools may be called: the text is held back and read at the end

    def opening(self) -> ChatChunkChoice:
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, text: str, lps: Sequence[TokenLogprob],
              prompt_lps: Sequence[TokenLogprob] | None = None) -> ChatChunkChoice | None:
        if self.tools is not None:  # held to the end, and its logprobs with it
            self.tools.parts.append(text)
            self.tools.lps.extend(lps)
            text, lps = "", ()
        lp = self.logprobs.push(lps) if self.logprobs is not None and lps else None
        if not text and lp is None:
            return None
        return {"index": self.index, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}

    def finish(self, reason: str) -> list[ChatChunkChoice]:
        """With tools, the held-back text goes out as content or as tool_calls, then (as OpenAI's
        streams) the finish_reason in a chunk of its own with an empty delta."""
        if self.tools is None:
            return [{"index": self.index, "delta": {}, "logprobs": None, "finish_reason": reason}]
        text = "".join(self.tools.parts)
        lp = self._held_logprobs()
        calls = parse_calls(text, self.tools.plan)
        if calls is None:
            held: ChatChunkChoice = {"index": self.index, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}
        else:
            held = {"index": self.index, "delta": {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]},
                    "logprobs": lp, "finish_reason": None}
            reason = "tool_calls" if reason == "stop" else reason
        return ([held] if text or lp else []) + [{"index": self.index, "delta": {}, "logprobs": None, "finish_reason": reason}]

    def _held_logprobs(self) -> ChatLogprobsBody | None:
        """The held text's logprobs entries, once (a stream sends them at finish; a reply has them all)."""
        if self.tools is None or self.logprobs is None or not self.tools.lps:
            return None
        lp = self.logprobs.push(self.tools.lps)
        self.tools.lps.clear()
        return lp

    def final(self, text: str, reason: str | None) -> ChatChoice:
        self._held_logprobs()
        lp = self.logprobs.total if self.logprobs is not None else None
        calls = parse_calls(text, self.tools.plan) if self.tools is not None else None
        if calls is None:
            return {"index": self.index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                    "finish_reason": reason}
        return {"index": self.index, "message": {"role": "assistant", "content": None, "tool_calls": calls},
                "logprobs": lp, "finish_reason": "tool_calls" if reason == "stop" else reason}
