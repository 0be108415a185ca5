"""The probe client's handling of servers that reject an extension field: drop it once, say so,
and stop sending it (one retry, not one per request)."""

from __future__ import annotations

import asyncio
import json

import httpx

from isolab.probe.client import Identity, ProbeClient


def test_a_rejected_stream_options_is_dropped_once_and_not_sent_again():
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        if "stream_options" in body:
            return httpx.Response(400, json={"error": {"message": "unknown field: stream_options"}})
        events = [{"choices": [{"text": t, "logprobs": None, "finish_reason": None}]} for t in "ok"]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    async def run() -> tuple[list, ProbeClient]:
        client = ProbeClient("http://mock", model="m", transport=httpx.MockTransport(handler))
        try:
            recs = [await client.complete("hi", Identity("a"), stream=True) for _ in range(3)]
        finally:
            await client.close()
        return recs, client

    recs, client = asyncio.run(run())
    assert all(r.status == 200 and r.text == "ok" for r in recs), [(r.status, r.error) for r in recs]
    assert len(bodies) == 4  # one rejected, then three without the field
    assert not client.caps.stream_options
    assert len(client.caps.dropped) == 1 and client.caps.dropped[0].startswith("stream_options")
