"""The step contract: schedule -> execute -> update, with the scheduler as the only writer of a
request's progress, and a stop checker that costs O(new text) a token."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import isolab
from isolab import LLM, SamplingParams
from isolab.engine.detokenize import Detokenizer
from isolab.engine.request import RequestStatus
from isolab.engine.step import ModelRunnerOutput, SampledToken
from isolab.engine.stop import check_stop, stop_string_in

ROOT = Path(isolab.__file__).parent


def _writes_of(attr: str) -> list[str]:
    """Every `x.attr = ...` / `x.attr += ...` in the engine (where Request and KVBlock live, and
    the only code that holds them), as 'module:line'."""
    found = []
    for path in [*(ROOT / "engine").rglob("*.py"), ROOT / "llm.py"]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AugAssign | ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == attr:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


@pytest.mark.parametrize("attr", ["num_computed_tokens", "status", "num_cached_tokens", "stop_reason"])
def test_only_the_scheduler_writes_a_requests_progress(attr):
    writers = {w.split(":")[0] for w in _writes_of(attr)}
    assert writers <= {"engine/scheduler.py"}, f"{attr} written outside the scheduler: {sorted(writers)}"


def test_only_the_pool_writes_a_blocks_tokens():
    writers = {w.split(":")[0] for w in _writes_of("tokens") + _writes_of("sealed_tokens")}
    assert writers <= {"engine/block_pool.py"}, sorted(writers)


def test_check_stop_rules_in_order():
    p = SamplingParams(max_tokens=3, stop=("ab",), stop_token_ids=(7,))
    kw = dict(num_output_tokens=1, num_tokens=5, eos_token_id=2, max_model_len=100)
    assert check_stop(p, 2, **kw).status is RequestStatus.FINISHED_STOPPED  # eos first
    assert check_stop(p, 2, **kw).reason is None
    assert check_stop(SamplingParams(ignore_eos=True), 2, **kw) is None
    assert check_stop(p, 7, **kw).reason == 7
    assert check_stop(p, 5, **kw, text="xxab", new_text_len=1).reason == "ab"
    assert check_stop(p, 5, **kw, text="abxx", new_text_len=1) is None  # an old match was seen before
    d = check_stop(p, 5, **{**kw, "num_output_tokens": 3})
    assert d.status is RequestStatus.FINISHED_LENGTH and d.reason is None
    assert check_stop(p, 5, **{**kw, "num_tokens": 100}).status is RequestStatus.FINISHED_LENGTH


def test_an_end_of_turn_token_stops_like_eos():
    """Gemma's <end_of_turn> (Tokenizer.end_of_turn_ids) ends a request as EOS does; not under ignore_eos."""
    kw = dict(num_output_tokens=1, num_tokens=5, eos_token_id=1, max_model_len=100)
    assert check_stop(SamplingParams(), 106, **kw) is None  # without it, just a token
    d = check_stop(SamplingParams(), 106, **kw, end_of_turn=frozenset({106}))
    assert d.status is RequestStatus.FINISHED_STOPPED and d.reason is None
    assert check_stop(SamplingParams(ignore_eos=True), 106, **kw, end_of_turn=frozenset({106})) is None


def test_a_stop_string_across_two_tokens_is_found_in_the_second():
    assert stop_string_in("hello wor", 3, ("o w",)) == "o w"  # "wor" is new, the match starts before it
    assert stop_string_in("hello wor", 2, ("hell",)) is None
    assert stop_string_in("hello", 0, ("lo",)) is None
    assert stop_string_in("abcd", 1, ("zz", "cd", "d")) == "cd"  # the order given decides


@pytest.fixture(scope="module")
def llm(tiny_bundle):
    return LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20)


def test_stop_checking_never_redecodes_the_whole_output(llm, monkeypatch):
    """The old checker decoded the whole output after every token (O(n^2)); ours decodes a window.
    Driven through Scheduler.update with hand-made samples, so the output is valid text."""
    eng, tok = llm.engine, llm.tokenizer
    letters = [i for i in range(tok.vocab_size) if len(tok.decode([i])) == 1 and tok.decode([i]).isalpha()][:5]
    assert letters, "the tiny tokenizer has single-letter tokens"
    lengths: list[int] = []
    real = type(tok).decode

    def spy(self, ids, *a, **k):
        lengths.append(len(ids))
        return real(self, ids, *a, **k)

    monkeypatch.setattr(type(tok), "decode", spy)
    eng.add_request("s", [5, 6, 7], SamplingParams(max_tokens=150, ignore_eos=True, stop=("\x00never",)))
    for i in range(150):
        out = eng.scheduler.schedule()
        sampled = tuple(SampledToken(c.request.request_id, letters[i % len(letters)], None)
                        for c in out.chunks if c.samples)
        finished = eng.scheduler.update(out, ModelRunnerOutput(sampled))
    assert [r.request_id for r in finished] == ["s"] and finished[0].status is RequestStatus.FINISHED_LENGTH
    eng.requests.pop("s")
    assert len(lengths) >= 150 and max(lengths) <= 2, f"a decode of {max(lengths)} ids for one token"


def test_stop_strings_end_text_and_match_a_full_decode(llm):
    free = llm.generate("a b c", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    for cut in (5, 12, 20):
        piece = free.text[cut : cut + 3]
        if not piece.strip():
            continue
        out = llm.generate("a b c", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=(piece,)))[0]
        assert out.finish_reason == "stop"
        n = len(out.token_ids)
        assert piece in llm.tokenizer.decode(out.token_ids) and piece not in llm.tokenizer.decode(out.token_ids[: n - 1])


def test_the_detokenizer_deltas_add_up_to_the_final_text(llm):
    free = llm.generate("x y", SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True))[0]
    d = Detokenizer(llm.tokenizer)
    text = "".join(d.push([t]) for t in free.token_ids) + d.finish()
    assert text == llm.tokenizer.decode(list(free.token_ids))


def test_update_reports_finished_requests_and_frees_them(llm):
    eng = llm.engine
    eng.add_request("u1", [5, 6, 7], SamplingParams(max_tokens=1))
    eng.add_request("u2", [5, 6, 8], SamplingParams(max_tokens=3))
    out = eng.scheduler.schedule()
    result = eng.runner.execute(out)
    assert [s.request_id for s in result.sampled] == ["u1", "u2"]
    finished = eng.scheduler.update(out, result)
    assert [r.request_id for r in finished] == ["u1"]
    assert finished[0].status is RequestStatus.FINISHED_LENGTH
    assert eng.kv.held_blocks(finished[0]) == ()
    assert [c.request.num_computed_tokens for c in out.chunks] == [3, 3]
    eng.abort("u2")
    eng.requests.pop("u1", None)  # we drove the scheduler by hand: forget u1 as step() would
    assert eng.kv.num_held_blocks() == 0


def test_a_prefill_cap_bounds_a_steps_prompt_tokens_and_never_holds_back_decodes(tiny_bundle):
    """--max-prefill-tokens: a step computes at most that many prompt tokens (chunks of 2 or more),
    every running decode still gets its token, and no output changes (chunking changes no bit)."""
    prompts = {"d": list(range(5, 9)), "p1": list(range(10, 40)), "p2": list(range(40, 70))}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(cap: int | None) -> tuple[list[list[tuple[str, int]]], dict[str, list[int]]]:
        eng = LLM(bundle=tiny_bundle, max_num_batched_tokens=64, max_prefill_tokens=cap).engine
        steps: list[list[tuple[str, int]]] = []
        schedule = eng.scheduler.schedule

        def spy():
            out = schedule()
            steps.append([(c.request.request_id, c.num_new_tokens) for c in out.chunks])
            return out

        eng.scheduler.schedule = spy
        eng.add_request("d", prompts["d"], params)
        outs: dict[str, list[int]] = {}
        for o in eng.step():  # d's prompt; then the long prompts arrive while it decodes
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        eng.add_request("p1", prompts["p1"], params)
        eng.add_request("p2", prompts["p2"], params)
        while eng.has_unfinished():
            for o in eng.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        eng.close()
        return steps, outs

    capped, out_capped = run(8)
    free, out_free = run(None)
    assert out_capped == out_free and set(out_free) == set(prompts)
    assert free[1] == [("d", 1), ("p1", 30), ("p2", 30)]  # without a cap the budget takes both prompts at once
    for step in capped:
        assert sum(n for _, n in step if n > 1) <= 8, step
    # d decodes in each of the next 7 steps (8 tokens, the first from its prompt), beside capped prompt chunks
    assert all(("d", 1) in step for step in capped[1:8]) and not any(r == "d" for step in capped[8:] for r, _ in step)
    assert capped[1] == [("d", 1), ("p1", 8)]  # p2 waits for prompt tokens, not for d


def test_a_stop_string_never_matches_a_character_still_being_completed(llm):
    """A character split across tokens decodes as U+FFFD until its last byte arrives; that U+FFFD is
    no text anyone is sent, so a stop string cannot match it (stop "\\ufffd" ended "😀😀" after one
    token). A stop string in the whole characters before it still counts at once."""
    eng, tok = llm.engine, llm.tokenizer
    emoji = tok.encode("😀😀", add_special_tokens=False)
    assert len(emoji) > 2 and tok.decode(emoji[:1]).endswith("\ufffd"), "the emoji spans tokens here"

    def run(ids: list[int], stop: tuple[str, ...]) -> tuple[RequestStatus, int]:
        eng.add_request("e", [5, 6, 7], SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=stop))
        for i, t in enumerate(ids):
            out = eng.scheduler.schedule()
            sampled = tuple(SampledToken(c.request.request_id, t, None) for c in out.chunks if c.samples)
            finished = eng.scheduler.update(out, ModelRunnerOutput(sampled))
            if finished:
                eng.requests.pop("e")
                return finished[0].status, i + 1
        raise AssertionError("never finished")

    assert run(emoji, ("\ufffd",)) == (RequestStatus.FINISHED_LENGTH, len(emoji))
    # a byte that can begin no character is U+FFFD in the final text: that one stops at once
    lone = next(i for i in range(tok.vocab_size) if tok.token_bytes([i]) == [b"\x80"])
    assert run([lone, *emoji], ("\ufffd",)) == (RequestStatus.FINISHED_STOPPED, 1)
    a = tok.encode("a", add_special_tokens=False)
    # "a" then the first bytes of the emoji in one token's window: the whole "a" is checked at once
    status, n = run(a + emoji, ("a",))
    assert status is RequestStatus.FINISHED_STOPPED and n == len(a)
    assert eng.kv.num_held_blocks() == 0
