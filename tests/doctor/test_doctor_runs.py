"""The doctor end to end: an isolab engine in process (healthy, a cache fault, shared-rng) and a
mocked OpenAI server (healthy, and one whose prompt cache answers for the wrong prompt)."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from isolab.cli import main
from isolab.doctor.experiments import diagnose
from isolab.doctor.http_target import HttpTarget
from isolab.doctor.verdict import CACHE_ISOLATION, NO_SYMPTOM, NUMERICS, SHARED_NOT_CACHE, UNEXERCISED, judge
from isolab.doctor.workload import builtin_workload
from isolab.errors import InvalidRequestError
from isolab.faults import FAULTS


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tiny model is faster on one thread than on cores shared with other jobs."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


VERDICT = {"shared-rng": (SHARED_NOT_CACHE, {"a"}), "batch-variant-gemm": (NUMERICS, {"a"})}
EXPECTED = [(None, NO_SYMPTOM, set())] + [(f, *VERDICT.get(f, (CACHE_ISOLATION, {"a", "d"}))) for f in FAULTS]


@pytest.mark.parametrize("fault,verdict,fired", EXPECTED, ids=[str(e[0]) for e in EXPECTED])
def test_engine_doctor_verdicts(tiny_path, tmp_path, fault, verdict, fired, capsys):
    """Healthy: no symptom; every cache fault: cache isolation; shared-rng: shared state, not the cache;
    a batch-variant GEMM: the numerics, never contamination."""
    out = tmp_path / "d.json"
    engine_args = f"--model {tiny_path} --device cpu --kv-cache-memory 256KiB" + (f" --inject-fault {fault}" if fault else "")
    rc = main(["doctor", "--engine-args", engine_args, "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["verdict"] == verdict, data["answers"]
    assert fired <= set(data["fired"])
    assert rc == (0 if fault is None else 1)
    assert data["batch_invariant"] is (fault != "batch-variant-gemm")
    if fault == "shared-rng":  # only the seeded sampling requests are hurt
        ids = {s["item_id"] for r in data["runs"]["sweep"] for s in r["symptoms"]}
        seeded = {it.item_id for it in builtin_workload() if it.seed is not None}
        assert ids and ids <= seeded
    # the examples name each item once, with the run it was seen in (they repeated r10, r16, r10, ...)
    examples = [ln.split(" (")[0] for ln in capsys.readouterr().out.splitlines() if ln.startswith("  e.g. ")]
    assert len(examples) == len({e.split(" in ")[0] for e in examples}) and all(" in " in e for e in examples)
    if fault != "batch-variant-gemm":  # (its symptoms depend on the numerics; the verdict above is what counts)
        assert bool(examples) == (fault is not None), examples


def test_bad_engine_args_is_one_sentence(capsys):
    assert main(["doctor", "--engine-args=--no-such-flag"]) == 2
    assert "unknown engine flags --no-such-flag" in capsys.readouterr().err


def _mock_server(buggy: bool, reports_cache: bool = True) -> httpx.MockTransport:
    """A deterministic server; when buggy, its prompt cache keys on the prompt's length only. It
    reports as cached the characters a prompt shares with an earlier one (none if not reports_cache)."""
    cache: dict[int, str] = {}
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "mock"}]})
        body = json.loads(request.content)
        prompt = body["prompt"]
        answer = "".join(reversed(prompt))[: body["max_tokens"]]
        if buggy and body.get("cache_prompt", True):
            answer = cache.setdefault(len(prompt), answer)
        toks = list(answer)
        lp = {"tokens": toks, "token_logprobs": [-0.1] * len(toks), "top_logprobs": [{t: -0.1, "#": -5.0} for t in toks]}
        cached = max((len(os.path.commonprefix([prompt, p])) for p in seen), default=0)
        if body.get("cache_prompt", True):
            seen.append(prompt)
        else:
            cached = 0
        return httpx.Response(200, json={"choices": [{"text": answer, "logprobs": lp}],
                                         "usage": {"prompt_tokens_details": {"cached_tokens": cached * reports_cache}}})

    return httpx.MockTransport(handler)


@pytest.mark.parametrize("buggy,reports,verdict", [(False, True, NO_SYMPTOM), (True, True, CACHE_ISOLATION),
                                                    (False, False, UNEXERCISED)])
def test_server_doctor_on_a_mock(buggy, reports, verdict):
    target = HttpTarget("http://mock", no_cache={"cache_prompt": False}, stagger_s=0,
                        transport=_mock_server(buggy, reports))
    f = diagnose(target, builtin_workload(), concurrencies=(1, 4))
    assert judge(f).verdict == verdict
    assert f.alone.label == "alone (one request at a time)"  # (it said "fresh engine each" of a server)


def test_a_server_that_rejects_everything_is_one_sentence():
    target = HttpTarget("http://mock", transport=httpx.MockTransport(lambda r: httpx.Response(
        200, json={"data": [{"id": "m"}]}) if r.url.path.endswith("/models") else httpx.Response(400, text="no logprobs here")))
    with pytest.raises(InvalidRequestError, match="every request failed even alone"):
        diagnose(target, builtin_workload()[:3], concurrencies=(1,))
