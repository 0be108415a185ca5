"""The lifecycle trace is complete (every allocated block life is freed, evicted, or still owned at
the end) on real engine runs, and the drawing shows violations with the reader and the writer."""

from __future__ import annotations

import json

import pytest

from isolab.engine.selftest import SCENARIOS
from isolab.lifecycle.trace import build, completeness, load
from isolab.testing.workload import Arrival, drive, make_engine


def _mixed(bundle, path, faults=frozenset(), audit=False, kv_blocks=8):
    import random

    eng = make_engine(bundle, kv_blocks, faults=faults, audit=audit, trace_path=str(path))
    rng = random.Random(3)
    shared = tuple(rng.randrange(100, 250) for _ in range(40))
    arrivals = [
        Arrival(0, "A", shared + (101, 102), _greedy(8)),
        Arrival(3, "B", shared + (103,), _greedy(6)),
        Arrival(4, "C", tuple(rng.randrange(100, 250) for _ in range(30)), _greedy(10)),
        Arrival(12, "D", shared + (104, 105, 106), _greedy(5)),
        Arrival(14, "E", tuple(rng.randrange(100, 250) for _ in range(50)), _greedy(6)),
    ]
    assert drive(eng, arrivals, check_invariants=True).invariant_breach is None
    eng.close()
    return load(path)


def _greedy(n):
    from isolab.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_trace_is_complete_on_a_mixed_workload(tiny_bundle, tmp_path):
    trace = _mixed(tiny_bundle, tmp_path / "t.jsonl")
    c = completeness(trace)
    assert c["complete"], c["problems"]
    assert c["ended"] > 0 and c["still_held"] == 0  # everything finished: nobody holds a block
    assert any(h.shared for life in trace.lives for h in life.holds), "the workload shares a prefix"
    assert any(life.end_kind == "evicted" for life in trace.lives), "the small pool recycles"
    for rec in trace.records:  # block events only: never token contents
        assert set(rec) <= {"step", "event", "block", "request", "scope", "generation", "slots", "writer", "refs"}


def test_llm_trace_path_round_trip(tiny_bundle, tiny_path, tmp_path):
    from isolab.llm import LLM
    from isolab.sampling_params import SamplingParams

    path = tmp_path / "llm.jsonl"
    llm = LLM(str(tiny_path), device="cpu", bundle=tiny_bundle, kv_cache_memory=64 * 4096, trace_path=str(path))
    llm.generate(["hello there world " * 4, "hello there world " * 4 + "again"], SamplingParams(max_tokens=4, temperature=0))
    llm.engine.close()
    c = completeness(load(path))
    assert c["complete"] and c["lives"] > 0, c


def test_an_open_engine_trace_is_whole_after_each_step_and_abort(tiny_bundle, tiny_path, tmp_path):
    """A reader of a live engine's trace (a server's `--trace`) sees every event of the steps and aborts
    so far: nothing waits in a buffer until the engine closes."""
    from isolab.llm import LLM
    from isolab.sampling_params import SamplingParams

    path = tmp_path / "live.jsonl"
    llm = LLM(str(tiny_path), device="cpu", bundle=tiny_bundle, kv_cache_memory=64 * 4096, trace_path=str(path))
    llm.generate(["hello there world " * 4], SamplingParams(max_tokens=4, temperature=0))
    c = completeness(load(path))  # the engine is still open
    assert c["complete"] and c["lives"] > 0 and c["still_held"] == 0, c
    eng = llm.engine
    eng.add_request("x", [5, 6, 7, 8, 9] * 4, SamplingParams(max_tokens=50, temperature=0))
    eng.step()
    assert completeness(load(path))["still_held"] > 0
    assert eng.abort("x")
    c = completeness(load(path))
    assert c["complete"] and c["still_held"] == 0, c
    eng.close()


def test_a_last_line_cut_short_is_left_out_and_said(tmp_path):
    recs = [{"step": 1, "event": "allocated", "block": 3, "request": "A", "scope": None},
            {"step": 2, "event": "released", "block": 3, "request": "A", "scope": None, "refs": 0},
            {"step": 2, "event": "freed", "block": 3, "request": "A", "scope": None}]
    whole = "".join(json.dumps(r) + "\n" for r in recs)
    path = tmp_path / "cut.jsonl"
    path.write_text(whole[:-20])  # a process killed mid-line
    trace = load(path)
    assert len(trace.records) == 2 and any("cut short" in p for p in trace.problems), trace.problems
    path.write_text(whole[:-20] + "\n" + whole)  # a bad line that is not the last: an error, as before
    from isolab.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="line 3 is not JSON"):
        load(path)


@pytest.mark.parametrize("records,problem", [
    ([{"step": 1, "event": "allocated", "block": 3, "request": "A", "scope": None},
      {"step": 2, "event": "released", "block": 3, "request": "A", "scope": None, "refs": 0}], "never freed"),
    ([{"step": 1, "event": "allocated", "block": 3, "request": "A", "scope": None},
      {"step": 2, "event": "allocated", "block": 3, "request": "B", "scope": None}], "never ended"),
    ([{"step": 1, "event": "freed", "block": 3, "request": "A", "scope": None}], "no allocated event"),
])
def test_missing_events_are_reported(records, problem):
    c = completeness(build(records))
    assert not c["complete"] and any(problem in p for p in c["problems"]), c


def test_held_and_cached_lives_are_complete():
    recs = [
        {"step": 1, "event": "allocated", "block": 1, "request": "A", "scope": None},
        {"step": 1, "event": "allocated", "block": 2, "request": "A", "scope": None},
        {"step": 2, "event": "sealed", "block": 1, "request": "A", "scope": None},
        {"step": 3, "event": "released", "block": 1, "request": "A", "scope": None, "refs": 0},
    ]
    c = completeness(build(recs))
    assert c["complete"] and c["still_held"] == 1 and c["cached_idle"] == 1


def test_reuse_fault_in_audit_mode_draws_the_violation(tiny_bundle, tmp_path, capsys):
    from isolab.lifecycle.draw import write_html, write_png

    sc = next(s for s in SCENARIOS if s.fault == "reuse-without-invalidate")
    import random

    path = tmp_path / "fault.jsonl"
    eng = make_engine(tiny_bundle, sc.kv_blocks, faults=frozenset([sc.fault]), audit=True, trace_path=str(path))
    drive(eng, sc.build(tiny_bundle, random.Random(0)))
    eng.close()
    trace = load(path)
    assert trace.violations and trace.violations[0]["writer"], trace.violations
    assert write_png(trace, tmp_path / "f.png").stat().st_size > 10_000
    page = write_html(trace, tmp_path / "f.html").read_text()
    assert "violation" in page and "data:image/png;base64," in page
    json.dumps(completeness(trace))
    # the CLI names each violation's access as the engine recorded it
    from isolab.cli import main

    assert main(["lifecycle", str(path), "--out", str(tmp_path / "g.png")]) == 1  # a violation: exit 1 (it was 0)
    out = capsys.readouterr().out
    for v in trace.violations:
        assert v["access"] in ("read", "write")
        said = f"block {v['block']} {v['access'] == 'write' and 'written' or 'read'} by {v['request']}"
        assert said in out, out


def test_lifecycle_cli(tiny_bundle, tmp_path, capsys):
    from isolab.cli import main
    from isolab.lifecycle.demo import run_traced

    trace = tmp_path / "t.jsonl"
    assert run_traced(tiny_bundle, trace) == []
    assert main(["lifecycle", str(trace), "--out", str(tmp_path / "t.png")]) == 0
    assert "0 audit violations" in capsys.readouterr().out and (tmp_path / "t.png").exists()
    assert main(["lifecycle", str(trace), "--out", str(tmp_path / "t.txt")]) == 2
    (tmp_path / "bad.jsonl").write_text('{"step": 1}\n')
    assert main(["lifecycle", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "b.png")]) == 2
    assert "not a block event" in capsys.readouterr().err


def test_a_trace_that_cannot_be_written_says_so_by_name_at_every_later_write():
    """A full disk: the sink names its file (the CLI said only 'cannot write the output'), and stays
    failed, so a trace with a hole never passes for the whole record."""
    import pytest

    from isolab.engine.events import JsonlSink
    from isolab.errors import InvalidRequestError

    sink = JsonlSink("/dev/full")
    with pytest.raises(InvalidRequestError, match="cannot write the trace '/dev/full'"):
        for b in range(100_000):  # past the file's buffer
            sink.emit("allocated", b, "r", "s")
        sink.flush()
    for again in (lambda: sink.emit("allocated", 0, "r", "s"), sink.flush):
        with pytest.raises(InvalidRequestError, match="cannot write the trace '/dev/full'"):
            again()
    sink.close()  # quietly: the error was raised already
