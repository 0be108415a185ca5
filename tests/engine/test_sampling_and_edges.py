"""Sampling (greedy, temperature, top-k, top-p, seeds, stops, logprobs) and the engine's hard edges."""

from __future__ import annotations

import re

import pytest
import torch

from isolab import LLM, InvalidRequestError, PromptTooLongError, SamplingParams
from isolab.engine.request import Request
from isolab.engine.sampler import _filter, sample


@pytest.fixture(scope="module")
def llm(tiny_bundle):
    return LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("temperature", -1.0), ("top_p", -0.1), ("top_p", 1.5), ("top_k", -2),
    ("seed", -(2**63) - 1), ("seed", 2**64), ("logprobs", 99), ("stop", ("",)), ("ignore_eos", "yes"),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} ") as exc:  # the field as a client names it, not our class
        SamplingParams(**{field: value})
    assert exc.value.field == field


def test_same_seed_same_tokens_other_seed_other_tokens(llm):
    p = lambda s: SamplingParams(max_tokens=16, temperature=1.5, seed=s, ignore_eos=True)  # noqa: E731
    a, b, c = (llm.generate("the cat", p(s))[0].token_ids for s in (5, 5, 6))
    assert a == b and a != c


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate("the", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    topk1 = llm.generate("the", SamplingParams(max_tokens=12, temperature=2.0, top_k=1, seed=3, ignore_eos=True))[0].token_ids
    assert greedy == topk1


def test_top_p_zero_is_greedy(llm):
    """OpenAI takes top_p in [0, 1]; 0 keeps the most likely token alone."""
    greedy = llm.generate("the", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    top_p0 = llm.generate("the", SamplingParams(max_tokens=12, temperature=2.0, top_p=0.0, seed=3, ignore_eos=True))[0].token_ids
    assert greedy == top_p0


def test_filter_top_p_keeps_smallest_set():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(_filter(logits, 0, 0.7))
    assert kept.tolist() == [True, True, False, False]
    kept = torch.isfinite(_filter(logits, 2, 1.0))
    assert kept.tolist() == [True, True, False, False]


def test_logprobs_are_the_model_distribution(tiny_bundle):
    r = Request("x", [1], SamplingParams(temperature=0.0, logprobs=3), None)
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    [(tok, lp)] = sample(logits, [r])
    ref = torch.log_softmax(logits[0], -1)
    assert tok == 1 and lp.logprob == pytest.approx(float(ref[1]))
    assert [t for t, _ in lp.top] == [1, 2, 0]


def test_stop_strings_and_tokens(llm):
    free = llm.generate("the cat", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert len(free.token_ids) == 20
    stop_tok = free.token_ids[3]
    out = llm.generate("the cat", SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(stop_tok,), ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_tok and len(out.token_ids) == free.token_ids.index(stop_tok) + 1
    assert out.stop_reason == stop_tok and out.text == llm.tokenizer.decode(list(out.token_ids[:-1]))  # cut, as vLLM
    piece = free.text[len(free.text) // 2 :][:2]
    if piece.strip():
        out = llm.generate("the cat", SamplingParams(max_tokens=20, temperature=0, stop=(piece,), ignore_eos=True))[0]
        assert out.finish_reason == "stop"
        # the text ends before the stop string, as the server's does; the token ids keep every token
        assert out.text == free.text[: free.text.find(piece)]
        assert out.token_ids == free.token_ids[: len(out.token_ids)]


def test_bad_prompts_are_rejected_with_a_sentence(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate("", SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.engine.add_request("e", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([10**9], SamplingParams())
    with pytest.raises(PromptTooLongError, match="context"):
        llm.generate([5] * 600, SamplingParams(max_tokens=4))


def test_prompt_that_can_never_fit_the_cache_is_rejected_at_admission(tiny_bundle):
    small = LLM(bundle=tiny_bundle, kv_cache_memory=4 * 16 * 2 * 2 * 2 * 8 * 2 * 4)  # a handful of blocks
    with pytest.raises(PromptTooLongError, match="can never fit"):
        small.generate([5] * 300, SamplingParams(max_tokens=8))
    assert small.engine.kv.num_held_blocks() == 0 and not small.engine.has_unfinished()


def test_cancellation_frees_blocks_at_once(llm):
    eng = llm.engine
    free_before = eng.pool.num_free_blocks
    eng.add_request("c1", [5] * 40, SamplingParams(max_tokens=50))
    eng.step()
    assert eng.kv.num_held_blocks() > 0
    assert eng.abort("c1")
    assert eng.kv.num_held_blocks() == 0 and eng.pool.num_free_blocks == free_before
    assert not eng.abort("c1")


def test_num_cached_tokens_reported(llm):
    prompt = list(range(10, 60))
    first = llm.generate(prompt, SamplingParams(max_tokens=2))[0]
    second = llm.generate(prompt, SamplingParams(max_tokens=2))[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 48
    scoped = llm.generate(prompt, SamplingParams(max_tokens=2), cache_scope="other")[0]
    assert scoped.num_cached_tokens == 0


def test_chat_uses_the_gguf_template(llm):
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert llm.tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>user\nhi<|im_end|>")
    assert llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3))[0].token_ids


def test_bf16_logits_are_widened_for_all_but_a_plain_argmax():
    """The sampler takes the head's bf16 logits and widens them to fp32 for every request that needs
    more than an argmax (logprobs, penalties, temperature): each gets exactly what fp32 logits give.
    A plain greedy batch keeps bf16, whose argmax is fp32's (the widening is exact)."""
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(4, 300, generator=g) * 3).to(torch.bfloat16)
    reqs = [
        Request("lp", [1, 2], SamplingParams(temperature=0.0, logprobs=2), None),
        Request("rep", [5, 6, 7], SamplingParams(temperature=0.0, repetition_penalty=1.3), None),
        Request("hot", [1], SamplingParams(temperature=0.7, seed=3), None),
        Request("plain", [1], SamplingParams(temperature=0.0), None),
    ]
    for r in reqs:
        r.generator = torch.Generator().manual_seed(11)
    got = sample(logits, reqs)
    for r in reqs:
        r.generator = torch.Generator().manual_seed(11)
    want = sample(logits.float(), reqs)
    assert got == want
    plain = [reqs[3]] * 4
    assert [t for t, _ in sample(logits, plain)] == torch.argmax(logits.float(), dim=-1).tolist()


def test_chat_reads_messages_as_the_server_does(llm):
    """LLM.chat and /v1/chat/completions give a conversation the same prompt: 'developer' is read as
    'system', content as a list of text parts is joined; a role the server refuses is a sentence."""
    sp = SamplingParams(max_tokens=4, temperature=0)
    system = llm.chat([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}], sp)[0]
    dev = llm.chat([{"role": "developer", "content": "Be terse."},
                    {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}],
                   sp)[0]
    assert dev.prompt_token_ids == system.prompt_token_ids and dev.token_ids == system.token_ids
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.role"):
        llm.chat([{"role": "bot", "content": "hi"}], sp)
    with pytest.raises(InvalidRequestError, match="a user message needs content"):
        llm.chat([{"role": "user"}], sp)


def test_sampling_params_take_the_forms_vllm_takes_and_refuse_the_rest_in_a_sentence(llm):
    assert SamplingParams(logit_bias={5: 1.0}).logit_bias == ((5, 1.0),)
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    for kw, field in ((dict(top_k=True), "top_k"), (dict(seed=True), "seed"), (dict(stop=5), "stop"),
                      (dict(stop_token_ids=3), "stop_token_ids"), (dict(logit_bias=5), "logit_bias"),
                      (dict(temperature=True), "temperature")):
        with pytest.raises(InvalidRequestError, match=f"^{field} ") as exc:
            SamplingParams(**kw)
        assert exc.value.field == field
    vocab = llm.engine.bundle.hparams.vocab_size
    for kw, field in ((dict(stop_token_ids=(vocab,)), "stop_token_ids"), (dict(logit_bias={vocab + 5: 1.0}), "logit_bias")):
        with pytest.raises(InvalidRequestError, match="outside the vocabulary") as exc:  # as the server's 400
            llm.generate("the cat", SamplingParams(max_tokens=2, **kw))
        assert exc.value.field == field
    with pytest.raises(InvalidRequestError, match="prompts are text"):
        llm.generate(b"hello")
    assert not llm.engine.requests  # nothing was left queued


def test_a_max_model_len_beyond_the_models_context_is_refused_in_a_sentence(tiny_bundle):
    ctx = tiny_bundle.hparams.context_length
    with pytest.raises(InvalidRequestError, match=f"longer than the model's context of {ctx} tokens") as exc:
        LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20, max_model_len=ctx + 1)
    assert exc.value.field == "max_model_len"
    assert LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20, max_model_len=ctx).engine.max_model_len == ctx


def test_vllms_top_k_off_int64_seeds_and_no_stop_inside_a_grammar(llm, caplog):
    """top_k -1 is vLLM's off (read as 0); a negative seed (OpenAI's seeds are int64) is read as 64 bits,
    torch's rule, and samples as that seed; a stop string or token does not apply to a JSON structured
    output (it ends itself once complete; a stop could only cut it), with a warning."""
    from isolab.sampling_params import GrammarSpec

    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(seed=-5).seed == 2**64 - 5
    p = lambda s: SamplingParams(max_tokens=12, temperature=1.5, seed=s, ignore_eos=True)  # noqa: E731
    a, b = (llm.generate("the cat", p(s))[0].token_ids for s in (-5, 2**64 - 5))
    assert a == b
    spec = GrammarSpec("json_object", "", "response_format")
    for kw, field in ((dict(stop=["x"]), "stop"), (dict(stop_token_ids=[3]), "stop_token_ids")):
        with caplog.at_level("WARNING", logger="isolab"):
            sp = SamplingParams(structured=spec, **kw)
        assert sp.stop == () and sp.stop_token_ids == () and f"{field} ignored" in caplog.text
        caplog.clear()
        kept = SamplingParams(structured=GrammarSpec.choice(["yes", "no"]), **kw)  # a client's own language
        assert getattr(kept, field) == tuple(kw[field]) and not caplog.text


def test_a_stop_string_the_grammars_last_token_completes_is_the_stop_reason(llm):
    """The text is cut at the stop string either way; the reason named no stop when the same token also
    completed the grammar (a black-box QA pass: text 'P', stop_reason None)."""
    from isolab.sampling_params import GrammarSpec

    sp = SamplingParams(max_tokens=8, temperature=0, structured=GrammarSpec.choice(["Paris"]), stop=["ar"])
    out = llm.generate("The capital of France is", sp)[0]
    assert out.text == "P" and out.finish_reason == "stop" and out.stop_reason == "ar", out
    with pytest.raises(InvalidRequestError, match="^structured must be a GrammarSpec"):
        SamplingParams(structured="json")  # type: ignore[arg-type]  (an AttributeError before)


def test_a_complete_grammar_ends_the_request_even_before_min_tokens(llm):
    """The grammar wins over min_tokens: once "Paris" is complete it allows only EOS, which min_tokens
    masks; the request ends there (engine/stop.py, rule 0: "stop"), its text what the grammar accepts,
    never tokens past it or a run to max_tokens."""
    from isolab.sampling_params import GrammarSpec

    sp = SamplingParams(max_tokens=12, temperature=0, min_tokens=10, structured=GrammarSpec.choice(["Paris"]))
    out = llm.generate("The capital of France is", sp)[0]
    assert out.text == "Paris" and out.finish_reason == "stop" and len(out.token_ids) < 10, out


def test_engine_options_of_the_wrong_kind_are_one_sentence():
    """LLM(...)'s options as a user may pass them: a float or a string reached the pool's maths (raw
    TypeErrors), an odd block size gave wrong bf16 outputs (V is stored in pairs of keys) that the
    start-up check did not see, and a single fault name was read as its characters."""
    from isolab.config import build_engine_config

    for kw, needle in ((dict(kv_cache_memory=1.5e6), "kv_cache_memory must be a whole number"),
                       (dict(kv_cache_memory="lots"), "is not a size"),
                       (dict(block_size=16.0), "block_size must be a whole number"),
                       (dict(block_size=3), "block_size must be even"),
                       (dict(max_num_seqs=2.0), "max_num_seqs must be a whole number"),
                       (dict(max_prefill_tokens=1), "max_prefill_tokens must be a whole number of at least 2"),
                       (dict(max_prefill_tokens=8.5), "max_prefill_tokens must be a whole number of at least 2"),
                       (dict(model=123), "model must be a GGUF path")):
        with pytest.raises(InvalidRequestError, match=needle):
            build_engine_config(**kw)
    assert build_engine_config(kv_cache_memory="64MiB").cache.kv_cache_memory == 64 << 20  # as the CLI takes it
    assert build_engine_config(inject_faults="shared-rng").inject_faults == frozenset({"shared-rng"})


def test_numpy_token_ids_are_token_ids_and_bools_are_not(llm):
    """Token ids from numpy (np.int64) were refused as 'not integers'; True and False were taken as ids 1 and 0."""
    import numpy as np

    sp = SamplingParams(max_tokens=4, temperature=0)
    want = llm.generate([5, 6, 7], sp)[0].token_ids
    assert llm.generate([np.int64(5), np.int32(6), np.uint16(7)], sp)[0].token_ids == want
    assert llm.generate([[np.int64(5), 6, 7], "the cat"], sp)[0].token_ids == want
    with pytest.raises(InvalidRequestError, match="prompt token ids must be integers"):
        llm.generate([[True, False, 5]], sp)


def test_an_error_in_a_batch_names_its_prompt_or_conversation(llm):
    """With more than one prompt the error says which (from 0), keeping its type and field; with one it
    reads as before. Nothing stays queued."""
    from isolab.errors import PromptTooLongError

    sp = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError, match="^prompt 1: the prompt is empty"):
        llm.generate(["fine", ""], sp)
    with pytest.raises(PromptTooLongError, match="^prompt 2: the prompt has") as exc:
        llm.generate(["a", "b", [5] * 100_000], sp)
    assert exc.value.field == "prompt"
    with pytest.raises(InvalidRequestError, match="^conversation 1: "):
        llm.chat([[{"role": "user", "content": "hi"}], [{"role": "robot", "content": "x"}]], sp)
    with pytest.raises(InvalidRequestError, match="^the prompt is empty"):
        llm.generate([""], sp)
    assert not llm.engine.requests


def test_a_requests_top_logprobs_do_not_depend_on_what_others_ask_for(tiny_bundle):
    """torch.topk orders tied values by its k: the step cut every row's list from the largest n asked,
    so a request's top-3 changed when a request with logprobs=20 shared its step (a review helper: 9 of
    40 requests on the tiny model; bf16 logits tie often). Sampled and prompt logprobs alike; each list
    now breaks ties by token id."""
    import random

    from isolab.engine.sampler import top_logprobs

    row = torch.tensor([[-1.0, -2.0, -1.0, -3.0, -1.0, -2.0]])
    want = ((0, -1.0), (2, -1.0), (4, -1.0), (1, -2.0))
    assert top_logprobs(row, [4]) == [want]
    assert top_logprobs(torch.cat([row, row]), [4, 6]) == [want, (*want, (5, -2.0), (3, -3.0))]
    ties = torch.round(torch.randn(32, 300, generator=torch.Generator().manual_seed(0)) * 2) / 2  # runs of ties
    for n in (1, 3, 7, 20):  # (within the topk's width, and runs past it: the row searched)
        for b, got in enumerate(top_logprobs(ties, [n] * 32)):
            assert list(got) == sorted(enumerate(ties[b].tolist()), key=lambda t: (-t[1], t[0]))[:n]

    llm = LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20)
    V = tiny_bundle.hparams.vocab_size
    rng = random.Random(1)
    mine = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    greedy_more = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=20, prompt_logprobs=20)
    differ = 0
    for _ in range(16):
        prompt = [rng.randrange(100, V) for _ in range(rng.randrange(3, 30))]
        other = [rng.randrange(100, V) for _ in range(5)]
        alone = llm.generate([prompt], mine)[0]
        both = llm.generate([prompt, other], [mine, greedy_more])[0]  # one step: the same chunk budget holds both
        differ += ([lp.top for lp in alone.logprobs], alone.prompt_logprobs) != \
                  ([lp.top for lp in both.logprobs], both.prompt_logprobs)
    assert differ == 0


def test_an_earlier_lifes_non_finite_value_does_not_reach_the_torch_path(tiny_path, tiny_bundle):
    """The torch attention (CUDA, or no compiler) reads whole blocks and masks the slots nobody wrote;
    0 x inf is NaN, so a non-finite value an earlier life left in such a slot turned a new request's
    logprobs into NaN (a review helper). Blocks are now cleared when allocated on that path (audit mode
    did already); the native kernel reads a row's keys up to its position and needs none of it."""
    import dataclasses

    from isolab.models.gguf_loader import load_gguf
    from isolab.models.llama import LlamaModel
    from isolab.testing.workload import Arrival, drive, make_engine

    torch_path = dataclasses.replace(tiny_bundle, model=LlamaModel(load_gguf(str(tiny_path)), "bf16", "cpu", native=False))
    req = Arrival(0, "B", tuple(range(100, 106)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0))
    clean = drive(make_engine(torch_path, 8, prefix=False), [req]).finished["B"]
    engine = make_engine(torch_path, 8, prefix=False)
    assert engine.pool.clear_on_allocate and not make_engine(tiny_bundle, 8, prefix=False).pool.clear_on_allocate
    for kv in engine.storage.slots:  # block 1's last slot, which a 6-token prompt and 4 tokens never write
        kv[1, :, 1, -1] = float("inf")
    stale = drive(engine, [req]).finished["B"]
    assert stale.pairs() == clean.pairs()


def test_calls_from_two_threads_run_one_after_the_other_with_their_solo_outputs(llm):
    """A QA pass: two threads calling generate on one LLM at once stepped the engine together and
    took each other's outputs (KeyError, AssertionError, zip() of unequal lengths: every call failed)."""
    import threading

    prompts = [("the cat sat on", 5), ("a b c d e f", 6)]
    solo = [llm.generate(p, SamplingParams(max_tokens=12, temperature=1.0, seed=s))[0].text for p, s in prompts]
    got: list[str | BaseException] = [""] * len(prompts)
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait()
        try:
            got[i] = llm.generate(prompts[i][0], SamplingParams(max_tokens=12, temperature=1.0, seed=prompts[i][1]))[0].text
        except BaseException as exc:  # noqa: BLE001 (reported below)
            got[i] = exc

    for _ in range(3):
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == solo, got


def test_a_scope_that_is_no_str_and_a_closed_llm_are_refused_in_a_sentence(tiny_bundle):
    with LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20) as llm:
        for scope in (1, b"tenant", ("a",)):  # (an int failed only once a prompt filled a block)
            with pytest.raises(InvalidRequestError, match="cache_scope is a tenant's name"):
                llm.generate("x " * 40, SamplingParams(max_tokens=1), cache_scope=scope)  # type: ignore[arg-type]
        assert llm.generate("x " * 40, SamplingParams(max_tokens=1), cache_scope="t")[0].token_ids
    with pytest.raises(InvalidRequestError, match="this LLM is closed"):
        llm.generate("x", SamplingParams(max_tokens=1))


@pytest.mark.parametrize(("args", "says"), [
    (("bogus", "x"), "a grammar's kind is one of json_schema, json_object, regex, choice, lark, not 'bogus'"),
    (("choice", "[]"), "a choice grammar's source is a JSON list of non-empty strings"),
    (("choice", '["a", ""]'), "a choice grammar's source is a JSON list of non-empty strings"),
    (("regex", 5), "a grammar's source is a str, not int"),
    (("json_object", '{"type": "array"}'), "a json_object grammar takes no source"),
    (("choice", "[" * 100_000), "a choice grammar's source is a JSON list"),  # (a RecursionError)
])
def test_a_grammar_spec_built_by_hand_is_checked_as_the_builders_check_it(args, says):
    """A QA pass: GrammarSpec("bogus", ...) ran as a Lark grammar, and a choice of [] gave ""."""
    from isolab.sampling_params import GrammarSpec

    with pytest.raises(InvalidRequestError, match=re.escape(says)):
        GrammarSpec(*args)


def test_one_fault_name_as_a_str_and_sizes_in_tib(tiny_bundle):
    """LLM(inject_faults="shared-rng") was read as its characters ("unknown fault '-'"); "1TiB" was no size."""
    from isolab.config import memory_bytes

    llm = LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20, inject_faults="shared-rng")
    assert llm.config.inject_faults == frozenset({"shared-rng"})
    assert memory_bytes("1TiB") == memory_bytes("1024GiB") == 1 << 40


def test_a_call_back_into_the_llm_from_on_step_is_refused_not_a_hang(tiny_bundle):
    """With the lock, an on_step that called generate (or close) waited on itself forever (a review)."""
    llm = LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20)
    for again in (lambda: llm.generate("a b", SamplingParams(max_tokens=1)), llm.close):
        def on_step(_outputs, again=again):
            again()

        with pytest.raises(InvalidRequestError, match="called from inside a call of this LLM"):
            llm.generate("hi", SamplingParams(max_tokens=3), on_step=on_step)
    assert llm.generate("hi", SamplingParams(max_tokens=2))[0].token_ids  # still usable, not closed


@pytest.mark.parametrize("temperature,top_k,nans", [(0.0, -1, "row"), (1.0, -1, "row"), (0.0, -1, "one"),
                                                   (1.0, -1, "one"), (1.0, 2, "one"), (0.0, -1, "masked"),
                                                   (1.0, -1, "masked")])
def test_a_row_of_nan_logits_fails_its_request_alone_in_a_sentence(tiny_bundle, monkeypatch, temperature, top_k, nans):
    """Broken weights (NaN in a tensor): torch.multinomial raised for the whole batch, and a greedy row
    took token 0 forever. The request whose row is NaN (all of it, or one logit: the argmax takes a
    NaN, as torch's does, and a softmax over it is NaN; or one logit its grammar forbids, which the
    mask had covered with -inf) fails with a sentence; the one beside it gets its solo tokens."""
    from isolab.errors import IsolabError
    from isolab.sampling_params import GrammarSpec

    llm = LLM(bundle=tiny_bundle, kv_cache_memory=1 << 20)
    grammar = GrammarSpec.choice(["ab", "ba"]) if nans == "masked" else None
    sp = SamplingParams(max_tokens=6, temperature=temperature, seed=3, top_k=top_k, structured=grammar)
    solo = llm.generate("a b c", sp)[0]
    model = llm.engine.runner.model
    real = model.logits_raw
    forbidden = llm.tokenizer.encode("z", add_special_tokens=False)[0]  # no choice starts with it

    def poisoned(hidden):
        out = real(hidden).clone()
        if out.shape[0] == 2:  # the step both requests share: the first one's row only
            if nans == "row":
                out[0] = float("nan")
            else:
                out[0, forbidden if nans == "masked" else 7] = float("nan")
        return out

    monkeypatch.setattr(model, "logits_raw", poisoned)
    engine, outs = llm.engine, {}
    for rid, prompt in (("nan", "the cat"), ("fine", "a b c")):
        engine.add_request(rid, llm.tokenizer.encode(prompt), sp)
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    monkeypatch.undo()
    assert outs["nan"].finish_reason == "error" and outs["nan"].output_token_ids == ()
    assert isinstance(outs["nan"].error, IsolabError) and "logits for this request are not numbers (NaN)" in str(outs["nan"].error)
    assert outs["fine"].error is None and outs["fine"].output_token_ids == solo.token_ids, outs
    assert engine.kv.num_held_blocks() == 0
    with pytest.raises(IsolabError, match="the model's logits for this request are not numbers"):  # the API: a sentence
        monkeypatch.setattr(model, "logits_raw", lambda h: real(h).clone().fill_(float("nan")))
        llm.generate("the cat", sp)
