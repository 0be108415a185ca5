"""--chat-template FILE replaces the GGUF's template for chat and /tokenize alike, and
chat_template_kwargs reach it per request; a template that cannot render refuses to start."""

from __future__ import annotations

import httpx
import pytest

from isolab.errors import InvalidRequestError
from isolab.server import ServerConfig, TenantRegistry, create_app

H = {"Authorization": "Bearer sk-alice"}
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if shout %} LOUDLY{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def srv(server_factory, tiny_bundle):
    return server_factory(tiny_bundle, server_config=ServerConfig(chat_template=TEMPLATE))


def _count(srv, **kw) -> list[int]:
    r = httpx.post(srv.url + "/tokenize", headers=H, json={"messages": [{"role": "user", "content": "hi"}], **kw})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_the_servers_template_is_used(srv):
    tok = srv.engine.tokenizer
    assert _count(srv) == tok.encode("<user>hi<assistant>", add_special_tokens=False)
    usage = srv.client().chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=1).usage
    assert usage.prompt_tokens == len(_count(srv))


def test_chat_template_kwargs_reach_the_template(srv):
    tok = srv.engine.tokenizer
    assert _count(srv, chat_template_kwargs={"shout": True}) == tok.encode("<user>hi LOUDLY<assistant>",
                                                                           add_special_tokens=False)
    loud = srv.client().chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=1, extra_body={"chat_template_kwargs": {"shout": True}})
    assert loud.usage.prompt_tokens == len(_count(srv, chat_template_kwargs={"shout": True}))


def test_reserved_template_variables_are_a_400(srv):
    r = httpx.post(srv.base_url + "/chat/completions", headers=H, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_a_template_that_cannot_render_refuses_to_start(tiny_bundle):
    from isolab.config import build_engine_config
    from isolab.engine.llm_engine import LLMEngine

    engine = LLMEngine(build_engine_config(kv_cache_memory=1 << 20), tiny_bundle)
    with pytest.raises(InvalidRequestError, match="--chat-template"):
        create_app(engine, TenantRegistry({}, anonymous=True), ServerConfig(chat_template="{% for m in messages %}"))
    # one that renders nothing (an empty file) would refuse every chat request as an empty prompt
    for nothing in ("", "{# nothing #}"):
        with pytest.raises(InvalidRequestError, match="renders a conversation as nothing"):
            create_app(engine, TenantRegistry({}, anonymous=True), ServerConfig(chat_template=nothing))
