"""32 concurrent streamed chats (real model, greedy), each equal to its solo output: the engine
thread, the per-request queues and the batching never mix or perturb requests."""

from __future__ import annotations

import asyncio

import pytest

NUM_CHATS = 32
MAX_TOKENS = 12
TOPICS = ["the moon", "bread", "rivers", "chess", "owls", "copper", "tea", "glaciers", "violins", "bees",
          "deserts", "clocks", "salt", "comets", "maps", "ferns", "ink", "trains", "coral", "wool",
          "volcanoes", "kites", "lenses", "honey", "bridges", "whales", "paper", "storms", "gardens", "rust",
          "mirrors", "lanterns"]


@pytest.fixture(scope="module")
def srv(server_factory, real_bundle):
    return server_factory(real_bundle, kv_cache_memory=64 << 20)


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"In one sentence, what is interesting about {TOPICS[i]}?"}]


@pytest.mark.real
def test_32_concurrent_streamed_chats_equal_their_solo_outputs(srv):
    kw = dict(model=srv.model, max_tokens=MAX_TOKENS, temperature=0)
    client = srv.client()
    solo = []
    for i in range(NUM_CHATS):
        r = client.chat.completions.create(messages=_messages(i), **kw)
        solo.append((r.choices[0].message.content, r.choices[0].finish_reason))
    srv.wait_idle()
    srv.app.state.engine_loop.peak_reserved = 0

    async def one(aclient, i: int) -> tuple[str, str | None]:
        text, reason = "", None
        stream = await aclient.chat.completions.create(messages=_messages(i), stream=True, **kw)
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                reason = c.finish_reason or reason
        return text, reason

    async def run() -> list[tuple[str, str | None]]:
        aclient = srv.async_client()
        try:
            return await asyncio.gather(*(one(aclient, i) for i in range(NUM_CHATS)))
        finally:
            await aclient.close()

    together = asyncio.run(run())
    assert srv.app.state.engine_loop.peak_reserved > 1  # they really were in flight together
    assert len({t for t, _ in solo}) > NUM_CHATS // 2  # distinct answers: a mix-up would show
    for i in range(NUM_CHATS):
        assert together[i] == solo[i], f"chat {i} differs when run with the others"
    srv.wait_idle()
    assert srv.engine.kv.num_held_blocks() == 0
