"""The server's parts without HTTP: isolab errors -> OpenAI errors, and a choice the engine failed
(which a healthy engine never produces: a 500, or one error event mid-stream)."""

from __future__ import annotations

import asyncio
import json
import time

from isolab.engine.detokenize import Detokenizer
from isolab.engine.llm_engine import RequestOutput
from isolab.errors import InvalidRequestError, IsolabError, PromptTooLongError, RequestAborted
from isolab.server.call import Call, Choice
from isolab.server.errors import api_error, error_body
from isolab.server.formats import ChatFormat, CompletionFormat, Limits
from isolab.server.metrics import ServerMetrics
from isolab.server.replies import streamed
from isolab.server.settings import ServerConfig


def test_isolab_errors_map_to_openai_errors():
    assert error_body("m") == {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}
    e = api_error(InvalidRequestError("bad top_p", field="top_p"))
    assert (e.status, e.param, e.code) == (400, "top_p", None)
    e = api_error(PromptTooLongError("too long", field="prompt"))
    assert (e.status, e.param, e.code) == (400, "prompt", "context_length_exceeded")
    e = api_error(RequestAborted("stop"))
    assert e.status == 503 and e.body()["error"] == {"message": "the server is shutting down", "type": "server_error",
                                                     "param": None, "code": "shutting_down"}


def _failed_call(tok, fmt) -> tuple[Call, asyncio.Queue[RequestOutput]]:
    metrics = ServerMetrics(lambda: {}, lambda: 0)
    choice = Choice(0, "r-0", Detokenizer(tok), fmt.choice(0, False))
    call = Call(fmt, "x-1", 0, "m", [3], [choice], True, True, time.monotonic(), metrics)
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    queue.put_nowait(RequestOutput("r-0", new_token_ids=(), new_logprobs=(), output_token_ids=(), finished=True,
                                   finish_reason="error", stop_reason=None, num_prompt_tokens=3, num_cached_tokens=0,
                                   error=IsolabError("internal engine error")))
    return call, queue


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
