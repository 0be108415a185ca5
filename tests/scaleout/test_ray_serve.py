"""`isolab serve --replicas 2` for real: a subprocess as a user starts it (a local Ray instance, two
Ray Serve replicas of the real model), checked from outside through the official `openai` client:
affinity reaches the cache, the black-box probe passes, a replica killed under load gives its
clients a clean error while the survivor serves and Serve restarts it, and nothing stays counted."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install 'isolab[ray]')")

pytestmark = [pytest.mark.ray, pytest.mark.real, pytest.mark.slow]

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, url: str, proc: subprocess.Popen) -> None:
        self.url, self.proc = url, proc

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def client(self, key: str = "sk-alice", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, **kw)

    def model(self) -> str:
        return self.client().models.list().data[0].id

    def wait_idle(self, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h["admitted"] == 0 and all(r["up"] and r["inflight"] == 0 and r["running"] == 0 for r in h["replicas"]):
                return h
            assert time.monotonic() < deadline, f"not idle: {h}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for k, t in KEYS.items()))
    port = free_port()
    log = tmp_path_factory.mktemp("log") / "serve.log"
    cmd = [sys.executable, "-m", "isolab.cli", "serve", "--replicas", "2", "--api-keys", str(keys),
           "--port", str(port), "--kv-cache-memory", "64MiB", "--max-num-seqs", "16", "--log-level", "warning"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        if proc.poll() is not None:
            pytest.fail(f"isolab serve --replicas 2 exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the replicas did not come up in 240 s: {log.read_text()[-3000:]}")
        time.sleep(0.5)
    c = Cluster(url, proc)
    while not all(r["pid"] for r in c.health()["replicas"]):  # the first poll
        time.sleep(0.2)
    yield c
    proc.send_signal(signal.SIGTERM)  # the drain, then Serve and the local Ray instance go
    try:
        assert proc.wait(90) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_chat_and_streaming_through_two_replicas(cluster):
    c, m = cluster.client(), cluster.model()
    r = c.chat.completions.create(model=m, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12,
                                  temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model=m, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if ch.choices)
    assert text.strip()
    h = cluster.health()
    assert h["status"] == "ok" and [r["up"] for r in h["replicas"]] == [True, True] and h["routing"] == "affinity"


def test_a_tenants_repeated_prefixes_reach_their_cache(cluster):
    """16 system prompts, each sent again after all 16: with affinity nearly every repeat lands where
    its prefix is cached (random routing over 2 replicas: about half; tests/scaleout/test_router.py)."""
    c, m = cluster.client("sk-bob"), cluster.model()
    prefixes = [f"System prompt {i}: you are assistant number {i} of a team; " + "answer briefly and politely. " * 6
                for i in range(16)]
    for rep in range(2):
        hits = 0
        for i, p in enumerate(prefixes):
            r = c.completions.create(model=m, prompt=p + f"Question {rep}-{i}?", max_tokens=2, temperature=0)
            details = r.usage.prompt_tokens_details
            hits += bool(details and details.cached_tokens)
        if rep == 0:
            assert hits == 0  # cold: nothing cached yet for this tenant
    assert hits / len(prefixes) >= 0.9, f"only {hits} of {len(prefixes)} repeats hit the cache"
    m = cluster.metrics()
    assert m['isolab_routing_decisions_total{decision="affinity"}'] >= 15
    # the other tenant's first send of the same prompt is cold, whichever replica it reaches
    r = cluster.client("sk-alice").completions.create(model=cluster.model(), prompt=prefixes[0] + "Question 1-0?",
                                                      max_tokens=2, temperature=0)
    assert not (r.usage.prompt_tokens_details and r.usage.prompt_tokens_details.cached_tokens)


def test_the_probe_finds_no_contamination_across_replicas(cluster):
    from isolab.probe import ProbeConfig, Status, run_probe_sync
    from isolab.probe.scenarios import Sizes
    from isolab.probe.verdicts import Thresholds

    # exact: both replicas run the same batch-invariant numerics; timing: another tenant's repeat of a
    # cached prompt is as slow as a cold one (40 TTFT samples a group keep it short)
    result = run_probe_sync(ProbeConfig(cluster.url + "/v1", api_keys=tuple(KEYS), model=cluster.model(),
                                        scenarios=("concurrency", "prefix-cache", "tenants", "seeded"), seed=11,
                                        sizes=Sizes(flood=6, timing_samples=40), thresholds=Thresholds(exact=True)))
    assert {v.name: v.status for v in result.verdicts} == {v.name: Status.PASS for v in result.verdicts}


def test_metrics_per_replica_and_aggregated(cluster):
    m = cluster.metrics()
    for i in ("0", "1"):
        assert m[f'isolab_replica_up{{replica="{i}"}}'] == 1
        assert f'isolab_replica_prefix_cache_hit_rate{{replica="{i}"}}' in m
    assert m["isolab_replicas_up"] == 2
    # the affinity test's 16 prefixes spread over both replicas, and each served its repeats from cache
    for i in ("0", "1"):
        assert m[f'isolab_replica_prefix_cache_hits_tokens_total{{replica="{i}"}}'] > 0
    total = sum(m[f'isolab_replica_prefix_cache_hits_tokens_total{{replica="{i}"}}'] for i in ("0", "1"))
    assert m["isolab_prefix_cache_hits_tokens_total"] == total  # the aggregate is their sum


def test_a_client_that_goes_away_frees_its_request_on_the_replica(cluster):
    """A disconnect cancels the Serve stream; the replica aborts the request (its blocks are freed)
    and Serve's "request cancelled" answer is not taken for a replica failure."""
    before = cluster.metrics()
    body = {"model": cluster.model(), "prompt": "Tell me a long story about a lighthouse.", "max_tokens": 400,
            "temperature": 0, "stream": True, "ignore_eos": True}
    for _ in range(3):
        with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer sk-alice"}) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i >= 6:
                    break  # leave mid-stream
    h = cluster.wait_idle()
    assert [r["up"] for r in h["replicas"]] == [True, True]
    after = cluster.metrics()
    for i in ("0", "1"):
        key = f'isolab_replica_failed_requests_total{{replica="{i}"}}'
        assert after[key] == before[key]
    assert after["isolab_kv_blocks_used"] == 0


def test_a_replica_killed_under_load(cluster):
    """8 streams over both replicas; replica 0's process is killed: its streams end with an error
    event naming it (never a hang), the others finish, new requests go to the survivor at once,
    Ray Serve restarts the replica, and nothing stays counted anywhere."""
    pid = cluster.health()["replicas"][0]["pid"]
    m = cluster.model()

    async def one(i: int, client: openai.AsyncOpenAI) -> tuple[str, str]:
        try:
            stream = await client.completions.create(model=m, prompt=f"Story {i}: once upon a time", max_tokens=300,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            async for _ in stream:
                pass
            return "ok", ""
        except openai.APIError as exc:
            return "error", str(exc)

    async def load_and_kill() -> list[tuple[str, str]]:
        client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="sk-alice", max_retries=0, timeout=120)
        tasks = [asyncio.create_task(one(i, client)) for i in range(8)]
        deadline = time.monotonic() + 60
        while not all(r["running"] > 0 for r in cluster.health()["replicas"]):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    results = asyncio.run(load_and_kill())
    errors = [msg for kind, msg in results if kind == "error"]
    assert errors and len(errors) < len(results), results
    assert all("replica 0 stopped" in msg for msg in errors), errors
    c = cluster.client(max_retries=0)
    for i in range(4):  # at once: the survivor takes them
        assert c.completions.create(model=m, prompt=f"After the kill {i}", max_tokens=4, temperature=0).choices[0].text
    deadline = time.monotonic() + 120
    while True:
        r0 = cluster.health()["replicas"][0]
        if r0["up"] and r0["restarts"] == 1 and r0["pid"] != pid:
            break
        assert time.monotonic() < deadline, f"replica 0 did not come back: {r0}"
        time.sleep(0.5)
    h = cluster.wait_idle()
    assert h["admitted"] == 0
    metrics = cluster.metrics()
    assert metrics['isolab_replica_failed_requests_total{replica="0"}'] == len(errors)
    assert metrics["isolab_kv_blocks_used"] == 0 and metrics["isolab_num_requests_running"] == 0
    r = c.completions.create(model=m, prompt="And the restarted one serves too", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"
