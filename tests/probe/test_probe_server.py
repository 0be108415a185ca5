"""The probe against our own server in-process: silent on a healthy isolab, and failing the matching
scenario for the most telling injected faults (tiny model; write-shared needs the real model's
slower steps, so it is marked real). Also the report files and the CLI's usage errors."""

from __future__ import annotations

import json

import pytest

from isolab.cli import main
from isolab.probe import ProbeConfig, Status, Thresholds, run_probe_sync
from isolab.probe.report import write_report
from isolab.probe.runner import EXIT_FAIL, EXIT_PASS, EXIT_USAGE
from tests.probe.conftest import isolab_server

KEYS = ("sk-alice", "sk-bob")


def by_name(result):
    return {v.name: v for v in result.verdicts}


@pytest.fixture(scope="module")
def healthy(long_tiny_bundle):
    with isolab_server(long_tiny_bundle) as url:
        yield url, run_probe_sync(ProbeConfig(url, api_keys=KEYS, seed=1))


@pytest.mark.slow  # the whole probe against the server: 7-9 s (in the fixture)
def test_healthy_isolab_passes_every_scenario(healthy):
    _, result = healthy
    assert {v.name: v.status for v in result.verdicts} == {n: Status.PASS for n in by_name(result)}
    assert result.exit_code == EXIT_PASS
    assert len(by_name(result)) == 6
    assert "fresh cache_salt gives a cold run: yes" in result.notes
    # isolab is batch-invariant: the exact mode finds nothing either (recomputed from the records)
    checks = by_name(result)["concurrency"].data["checks"][0]["data"]["comparisons"]
    assert checks and all(c["kind"] == "identical" for c in checks)


@pytest.mark.slow  # shares the whole probe run above
def test_report_files(healthy, tmp_path):
    _, result = healthy
    out = write_report(result, tmp_path / "rep")
    data = json.loads((out / "report.json").read_text())
    assert data["exit_code"] == 0 and len(data["records"]) == len(result.records)
    md = (out / "report.md").read_text()
    assert "| concurrency | **PASS** |" in md and "invisible" in md and "reuse-without-invalidate" in md
    assert (out / "divergence.png").exists() is False  # nothing diverged, nothing to plot


@pytest.mark.parametrize(
    ("fault", "scenario", "check"),
    [
        ("no-scope", "tenants", "tenants (api keys)"),
        ("coarse-key", "prefix-cache", "no false hits"),
        ("weak-hash", "prefix-cache", "no false hits"),
        ("shared-rng", "seeded", "seeded sampling"),
    ],
)
def test_each_fault_fails_its_scenario(long_tiny_bundle, fault, scenario, check):
    with isolab_server(long_tiny_bundle, faults=(fault,)) as url:
        result = run_probe_sync(ProbeConfig(url, api_keys=KEYS, scenarios=(scenario,), seed=2))
    v = by_name(result)[scenario]
    assert v.status is Status.FAIL, v.evidence
    failed = {c["name"] for c in v.data["checks"] if c["status"] == "FAIL"}
    assert check in failed
    assert result.exit_code == EXIT_FAIL


def test_two_keys_on_a_server_without_keys_test_tenants_by_cache_salt(long_tiny_bundle):
    """A server that serves any key (no auth) puts both keys in one tenant: their sharing is no leak.
    The probe tries a made-up key first, says so, and tests tenants by cache_salt instead (it failed
    'another tenant was served the owner's cached prefix')."""
    with isolab_server(long_tiny_bundle, keys=None) as url:
        result = run_probe_sync(ProbeConfig(url, api_keys=KEYS, scenarios=("tenants",), seed=6))
        assert any("made-up API key" in n for n in result.notes), result.notes
        v = by_name(result)["tenants"]
        assert v.status is Status.PASS, v.evidence
        assert {c["name"] for c in v.data["checks"]} == {"tenants (cache_salt)"}
        assert result.settings["tenants"] == "cache_salt"
    with isolab_server(long_tiny_bundle, faults=("no-scope",), keys=None) as url:  # the salt's test still bites
        v = by_name(run_probe_sync(ProbeConfig(url, api_keys=KEYS, scenarios=("tenants",), seed=6)))["tenants"]
        assert v.status is Status.FAIL, v.evidence


def test_timing_test_runs_opt_in(long_tiny_bundle):
    from isolab.probe import Sizes

    with isolab_server(long_tiny_bundle, faults=("no-scope",)) as url:
        result = run_probe_sync(ProbeConfig(url, api_keys=KEYS, scenarios=("tenants",), seed=3,
                                            sizes=Sizes(timing_samples=20)))
    timing = next(c for c in by_name(result)["tenants"].data["checks"] if c["name"] == "tenants (timing)")
    assert timing["optional"] and timing["data"]["other"]["n_hit"] == 20
    assert timing["status"] in ("PASS", "FAIL", "INCONCLUSIVE")  # the tiny model's prefill is too fast to promise more


class _LeakySlots:
    """ASGI wrapper that serves the last prompts on GET /slots, like llama.cpp's slots endpoint."""

    def __init__(self, app):
        self.app, self.prompts = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/slots":
            body = json.dumps([{"prompt": p} for p in self.prompts]).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["type"] == "http" and scope["path"] == "/v1/completions":
            msg = await receive()
            self.prompts.append(json.loads(msg.get("body") or b"{}").get("prompt", ""))

            sent = []

            async def replay(msg=msg):
                if not sent:
                    sent.append(1)
                    return msg
                return await receive()

            await self.app(scope, replay, send)
            return
        await self.app(scope, receive, send)


def test_monitoring_catches_prompts_on_a_debug_endpoint(long_tiny_bundle):
    with isolab_server(long_tiny_bundle, wrap=_LeakySlots) as url:
        result = run_probe_sync(ProbeConfig(url, api_keys=KEYS, scenarios=("monitoring",), seed=4))
    v = by_name(result)["monitoring"]
    assert v.status is Status.FAIL and "/slots" in v.data["checks"][0]["evidence"][0]


def test_cli_unreachable_server_is_exit_2(capsys):
    rc = main(["probe", "--base-url", "http://127.0.0.1:9", "--no-progress", "--timeout", "2"])
    err = capsys.readouterr().err
    assert rc == EXIT_USAGE and "cannot reach" in err and err.count("\n") == 1


def test_cli_runs_and_writes_a_report(long_tiny_bundle, tmp_path, capsys):
    with isolab_server(long_tiny_bundle) as url:
        rc = main(["probe", "--base-url", url, "--api-key", KEYS[0], "--api-key", KEYS[1], "--scenario", "tenants",
                   "--report", str(tmp_path), "--no-progress", "--json"])
    assert rc == EXIT_PASS
    out = json.loads(capsys.readouterr().out)
    assert out["verdicts"][0]["status"] == "PASS" and (tmp_path / "report.md").exists()


@pytest.mark.real
def test_write_shared_fails_prefix_cache_on_the_real_model(real_bundle):
    with isolab_server(real_bundle, faults=("write-shared",)) as url:
        # isolab is bit-exact, so any difference is real: --exact (the margin rule may call a
        # difference at an exact bf16 tie batch variance, as it must for other servers)
        result = run_probe_sync(ProbeConfig(url, api_keys=KEYS, scenarios=("prefix-cache",), seed=5,
                                            thresholds=Thresholds(exact=True)))
    v = by_name(result)["prefix-cache"]
    ext = next(c for c in v.data["checks"] if c["name"] == "extend while decoding")
    cached = [r.cached_tokens for r in result.records if "extension" in r.tags]
    assert v.status is Status.FAIL, (ext, cached)
    assert "extend while decoding" in {c["name"] for c in v.data["checks"] if c["status"] == "FAIL"}
