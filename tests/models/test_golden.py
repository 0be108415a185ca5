"""Golden tests on the real model: our forward against Hugging Face transformers (same GGUF, fp32),
the paged engine against our dense reference path (bf16, bit for bit), and the causal mask (C9)."""

from __future__ import annotations

import pytest
import torch

from isolab.llm import LLM
from isolab.sampling_params import SamplingParams

pytestmark = pytest.mark.real

PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Colour of the sky?"}],
    [{"role": "user", "content": "Explain what a KV cache is."}],
]
STEPS = 24


def _prompt_ids(tok):
    return [tok.encode(p) for p in PLAIN] + [tok.apply_chat_template(c) for c in CHATS]


@pytest.fixture(scope="module")
def hf_model(real_bundle_fp32):
    from transformers import AutoModelForCausalLM

    p = real_bundle_fp32.path
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()


def test_greedy_tokens_and_logits_match_transformers(real_bundle_fp32, hf_model):
    llm = LLM(dtype="fp32", bundle=real_bundle_fp32)
    ids = _prompt_ids(llm.tokenizer)
    ours = llm.generate(ids, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(ids, ours, strict=True):
        theirs = []
        with torch.no_grad():  # HF's greedy loop with its own KV cache; EOS not special
            step = hf_model(torch.tensor([prompt]), use_cache=True)
            hf_logits = step.logits[0, -1].float()
            for _ in range(STEPS):
                nxt = int(step.logits[0, -1].argmax())
                theirs.append(nxt)
                step = hf_model(torch.tensor([[nxt]]), cache=step.past_key_values, use_cache=True)
        assert list(out.token_ids) == theirs
        our_logits = real_bundle_fp32.model.reference_logits(prompt)[-1]
        assert (our_logits - hf_logits).abs().max().item() < 1e-3


def test_engine_equals_dense_reference_bit_for_bit(real_bundle):
    """The paged engine (prefix cache, batching) against a naive loop that recomputes everything."""
    llm = LLM(bundle=real_bundle)
    ids = _prompt_ids(llm.tokenizer)
    outs = llm.generate(ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0))
    for prompt, out in zip(ids, outs, strict=True):
        seq = list(prompt)
        for step in range(8):
            logits = real_bundle.model.reference_logits(seq)[-1]
            token = int(torch.argmax(logits))
            assert token == out.token_ids[step]
            assert float(torch.log_softmax(logits, -1)[token]) == out.logprobs[step].logprob
            seq.append(token)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_causal_mask_isolates_the_past(dtype, real_bundle, real_bundle_fp32):
    """C9: changing a later token never changes an earlier position's logits."""
    bundle = real_bundle if dtype == "bf16" else real_bundle_fp32
    ids = bundle.tokenizer.encode("The causal mask keeps every position from seeing the future tokens.")
    base = bundle.model.reference_logits(ids)
    for j in (3, len(ids) // 2, len(ids) - 1):
        changed = list(ids)
        changed[j] = (changed[j] + 7) % bundle.hparams.vocab_size
        other = bundle.model.reference_logits(changed)
        assert torch.equal(base[:j], other[:j]), f"a change at {j} leaked into earlier positions"
        assert not torch.equal(base[j:], other[j:])
