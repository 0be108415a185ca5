"""The server's parts without HTTP: isolab errors -> OpenAI errors, and a choice the engine failed
(which a healthy engine never produces: a 500, or one error event mid-stream)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from isolab.engine.detokenize import Detokenizer
from isolab.engine.llm_engine import RequestOutput
from isolab.errors import (
    InvalidRequestError,
    IsolabError,
    ModelOutputError,
    PromptTooLongError,
    RequestAborted,
)
from isolab.server.call import Call, Choice
from isolab.server.errors import api_error, error_body
from isolab.server.formats import ChatFormat, CompletionFormat, Limits
from isolab.server.metrics import ServerMetrics
from isolab.server.replies import streamed
from isolab.server.settings import ServerConfig
from tests.server.logprob_text import token_bytes


def test_isolab_errors_map_to_openai_errors():
    assert error_body("m") == {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}
    e = api_error(InvalidRequestError("bad top_p", field="top_p"))
    assert (e.status, e.param, e.code) == (400, "top_p", None)
    e = api_error(PromptTooLongError("too long", field="prompt"))
    assert (e.status, e.param, e.code) == (400, "prompt", "context_length_exceeded")
    e = api_error(RequestAborted("stop"))
    assert e.status == 503 and e.body()["error"] == {"message": "the server is shutting down", "type": "server_error",
                                                     "param": None, "code": "shutting_down"}


def _failed_call(tok, fmt, error: IsolabError | None = None,
                 reason: str = "error") -> tuple[Call, asyncio.Queue[RequestOutput]]:
    metrics = ServerMetrics(lambda: {}, lambda: 0)
    choice = Choice(0, "r-0", Detokenizer(tok), fmt.choice(0, False))
    call = Call(fmt, "x-1", 0, "m", [3], [choice], True, True, time.monotonic(), metrics)
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    queue.put_nowait(RequestOutput("r-0", new_token_ids=(), new_logprobs=(), output_token_ids=(), finished=True,
                                   finish_reason=reason, stop_reason=None, num_prompt_tokens=3, num_cached_tokens=0,
                                   error=error or IsolabError("internal engine error")))
    return call, queue


@pytest.mark.parametrize("error,reason,status,kind,code,param", [
    (IsolabError("internal engine error"), "error", 500, "server_error", None, None),
    (InvalidRequestError("the output grammar ...", field="guided_json"), "error", 400, "invalid_request_error", None,
     "guided_json"),
    (RequestAborted("the server is shutting down"), "abort", 503, "server_error", "shutting_down", None),
])
def test_a_collected_reply_answers_what_ended_its_choice(tiny_bundle, error, reason, status, kind, code, param):
    """A request's own fault is a 400 naming its field, a drain's end a 503, an engine bug a 500."""
    from starlette.requests import Request

    from isolab.server.errors import ApiError
    from isolab.server.replies import collected

    tok = tiny_bundle.tokenizer
    call, queue = _failed_call(tok, CompletionFormat(tok, Limits(ServerConfig(), 64)), error, reason)

    async def receive():  # a client that stays connected
        await asyncio.sleep(3600)

    with pytest.raises(ApiError) as caught:
        asyncio.run(collected(call, queue, Request({"type": "http"}, receive), lambda: None))
    assert (caught.value.status, caught.value.type, caught.value.code, caught.value.param) == (status, kind, code, param)


def test_a_broken_models_nan_row_is_said_as_such(tiny_bundle):
    """An engine bug's message stays inside (a 500 that says no more), but a model whose logits came out
    NaN for a request is told as it is: the client learns its model file is broken, not "failed"."""
    from starlette.requests import Request

    from isolab.server.errors import ApiError
    from isolab.server.replies import collected

    tok = tiny_bundle.tokenizer
    said = "the model's logits for this request are not numbers (NaN): its weights are broken"
    for error, shown in ((ModelOutputError(said), said), (IsolabError(said), "the engine failed this request")):
        call, queue = _failed_call(tok, CompletionFormat(tok, Limits(ServerConfig(), 64)), error)

        async def receive():
            await asyncio.sleep(3600)

        with pytest.raises(ApiError) as caught:
            asyncio.run(collected(call, queue, Request({"type": "http"}, receive), lambda: None))
        assert caught.value.status == 500 and str(caught.value.body()["error"]["message"]) == shown


def test_a_failed_choice_streams_one_error_event(tiny_bundle):
    tok = tiny_bundle.tokenizer
    limits = Limits(ServerConfig(), 64)
    for fmt in (CompletionFormat(tok, limits), ChatFormat(tok, limits)):
        call, queue = _failed_call(tok, fmt)
        response = streamed(call, queue, lambda: None)  # clean-up runs when served, not when read here

        async def read(response=response) -> list[str]:
            return [part async for part in response.body_iterator]

        events = [e for part in asyncio.run(read()) for e in part.split("\n\n") if e]
        payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert events[-1] == "data: [DONE]"
        if fmt.object == "chat.completion":  # the role chunk goes out before any output
            assert payloads.pop(0)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert payloads[0] == error_body("the engine failed this request", type="server_error")
        assert payloads[1]["choices"] == [] and payloads[1]["usage"]["completion_tokens"] == 0
        assert call.finished and call.choices[0].error


def test_logprobs_wait_for_a_character_a_token_only_begins(real_bundle):
    """SmolLM2 has tokens that hold a whole character and the first bytes of the next (" \\xf0\\x9f"
    of " 👋"): while that next character and a stop string that may still complete hold the text
    back, the token's logprobs entry waits too; at every chunk the entries' bytes are a prefix of the
    text sent."""
    from isolab.engine.request import TokenLogprob

    tok = real_bundle.tokenizer
    fmt = CompletionFormat(tok, Limits(ServerConfig(), 4096))
    metrics = ServerMetrics(lambda: {}, lambda: 0)
    text = "Hi \U0001f44b there, hi \U0001f44b!"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(b.startswith(b" \xf0") for b in tok.token_bytes(ids))  # the case this test is for
    choice = Choice(0, "r-0", Detokenizer(tok, ["\U0001f44b?"]), fmt.choice(0, True))
    call = Call(fmt, "x-1", 0, "m", [3], [choice], True, False, time.monotonic(), metrics)
    sent, joined = "", b""
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        out = RequestOutput("r-0", new_token_ids=(t,), new_logprobs=(TokenLogprob(t, -0.5, ((t, -0.5),)),),
                            output_token_ids=tuple(ids[: i + 1]), finished=last, finish_reason="length" if last else None,
                            stop_reason=None, num_prompt_tokens=3, num_cached_tokens=0)
        _, piece = call.consume(out)
        if piece is not None:
            sent += piece["text"]
            for e in (piece["logprobs"] or {}).get("tokens", []):
                joined += token_bytes(e)
        assert sent.encode().startswith(joined), (sent, joined)
    assert sent == text and joined == text.encode()

