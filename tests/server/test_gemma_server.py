"""Gemma 3 270M behind the OpenAI API: chat through the official client (the family's template, its
<end_of_turn> ending a turn), and the black-box probe's cross-request scenarios on it."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.real, pytest.mark.slow]


@pytest.fixture(scope="module")
def gemma_srv(server_factory):
    from isolab.models.bundle import load_bundle

    return server_factory(load_bundle("gemma3-270m", "bf16", "cpu"), kv_cache_memory=64 << 20)


def test_chat_through_the_openai_client(gemma_srv):
    client = gemma_srv.client()
    r = client.chat.completions.create(model=gemma_srv.model, messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=24, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.prompt_tokens > 5
    assert r.choices[0].message.content is not None
    stream = client.completions.create(model=gemma_srv.model, prompt="The capital of France is", max_tokens=8,
                                       temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text.strip()


def test_probe_finds_no_contamination_on_gemma(gemma_srv):
    from isolab.probe import ProbeConfig, Status, run_probe_sync

    result = run_probe_sync(ProbeConfig(gemma_srv.base_url, api_keys=("sk-alice", "sk-bob"), model=gemma_srv.model,
                                        scenarios=("concurrency", "prefix-cache", "seeded"), seed=5))
    assert {v.name: v.status for v in result.verdicts} == {v.name: Status.PASS for v in result.verdicts}
