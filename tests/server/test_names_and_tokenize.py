"""Model names (a slug id, --served-model-name with aliases, /v1/models listing them) and vLLM's
/tokenize and /detokenize behind the same keys, through the official client where it has a call."""

from __future__ import annotations

import httpx
import openai
import pytest

from isolab.server import ServerConfig
from isolab.server.settings import model_slug

H = {"Authorization": "Bearer sk-alice"}


def test_model_slug():
    assert model_slug("SmolLM2-135M-Instruct.Q4_1") == "smollm2-135m-instruct-q4_1"
    assert model_slug("Smollm2 135M 8k Lc100K Mix1 Ep2") == "smollm2-135m-8k-lc100k-mix1-ep2"
    assert model_slug("...") == "model"


@pytest.fixture(scope="module")
def srv(server_factory, tiny_bundle):
    return server_factory(tiny_bundle, server_config=ServerConfig(served_model_names=("tiny-1", "default", "alias")))


def test_models_lists_the_id_then_aliases(srv):
    assert [m.id for m in srv.client().models.list().data] == ["tiny-1", "default", "alias"]


def test_one_model_is_retrieved_by_any_of_its_names(srv):
    """GET /v1/models/{model}, as OpenAI's (the client's models.retrieve); an unknown one is a 404 that
    lists the served names, and the key is needed as on every /v1 path."""
    c = srv.client()
    for name in ("tiny-1", "alias"):
        m = c.models.retrieve(name)
        assert (m.id, m.object, m.owned_by) == (name, "model", "isolab")
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4")
    assert "tiny-1" in e.value.body["message"] and e.value.body["code"] == "model_not_found"
    assert httpx.get(srv.url + "/v1/models/tiny-1").status_code == 401


@pytest.mark.parametrize("name", ["tiny-1", "default", "alias"])
def test_any_name_is_served_and_replies_carry_the_id(srv, name):
    r = srv.client().completions.create(model=name, prompt="hi", max_tokens=2)
    assert r.model == "tiny-1"
    c = srv.client().chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert c.model == "tiny-1"


def test_an_unknown_name_is_404_listing_the_served_ones(srv):
    with pytest.raises(openai.NotFoundError) as e:
        srv.client().completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert "tiny-1" in e.value.body["message"] and e.value.body["code"] == "model_not_found"


def test_the_default_id_is_a_slug_of_the_file_with_the_gguf_name_as_alias(server_factory, tiny_bundle):
    s = server_factory(tiny_bundle)
    ids = [m.id for m in s.client().models.list().data]
    assert ids[0] == model_slug(tiny_bundle.path.stem) and " " not in ids[0]
    assert tiny_bundle.name in ids


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="distinct"):
        ServerConfig(served_model_names=("a", "a"))
    with pytest.raises(ValueError, match="distinct"):
        ServerConfig(served_model_names=("",))


def test_tokenize_and_detokenize_round_trip(srv):
    tok = srv.engine.tokenizer
    r = httpx.post(srv.url + "/tokenize", headers=H, json={"prompt": "hello world", "model": "alias"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == srv.engine.max_request_tokens == srv.engine.max_model_len  # (a pool far larger)
    plain = httpx.post(srv.url + "/tokenize", headers=H, json={"prompt": "hello world", "add_special_tokens": False})
    assert plain.json()["tokens"] == tok.encode("hello world", add_special_tokens=False)
    d = httpx.post(srv.url + "/detokenize", headers=H, json={"tokens": body["tokens"]})
    assert d.status_code == 200 and d.json()["prompt"] == tok.decode(body["tokens"])
    msgs = [{"role": "user", "content": "hi"}]  # special tokens come back (vLLM's /detokenize keeps them)
    ids = httpx.post(srv.url + "/tokenize", headers=H, json={"messages": msgs}).json()["tokens"]
    back = httpx.post(srv.url + "/detokenize", headers=H, json={"tokens": ids}).json()["prompt"]
    assert back == tok.decode(ids, skip_special_tokens=False) and back != tok.decode(ids)


def test_tokenize_chat_messages_as_the_chat_endpoint_counts_them(srv):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    n = httpx.post(srv.url + "/tokenize", headers=H, json={"messages": msgs}).json()["count"]
    usage = srv.client().chat.completions.create(model="tiny-1", messages=msgs, max_tokens=1).usage
    assert n == usage.prompt_tokens


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_tokenize_errors(srv, path, body, status, param):
    r = httpx.post(srv.url + path, headers=H, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_tokenize_needs_a_key(srv, path):
    r = httpx.post(srv.url + path, json={"prompt": "a", "tokens": [1]})
    assert r.status_code == 401
