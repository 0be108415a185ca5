"""Qwen2 (q, k, v biases) and Qwen3 (per-head RMSNorm of q and k, head_dim apart from hidden/heads):
tiny random models built with transformers, written to GGUF as llama.cpp's converter lays them out,
run by isolab and compared with transformers; the engine's guarantees hold on them."""

from __future__ import annotations

import pytest
import torch

from isolab.engine.selftest import SCENARIOS, run_scenario
from isolab.models.bundle import load_bundle
from isolab.models.gguf_loader import load_gguf
from isolab.models.llama import LlamaModel
from isolab.testing.tiny_model import tiny_vocab, write_hf_decoder

PROMPTS = [list(range(5, 40)), [7, 80, 33, 12, 200, 150, 9, 9, 9, 41, 3]]


def _hf(arch: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed({"qwen2": 1, "qwen3": 2}[arch])
    common = dict(vocab_size=len(tiny_vocab()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, tie_word_embeddings=True))
    for p in model.parameters():  # biases and norm weights away from their 0 / 1 init, so a test sees them
        p.data += 0.05 * torch.randn_like(p)
    return model.eval()


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def family(request, tmp_path_factory):
    arch = request.param
    hf = _hf(arch)
    path = write_hf_decoder(tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", hf, arch)
    return arch, hf, path


def test_the_family_is_read_with_what_it_adds(family):
    arch, _, path = family
    hp = load_gguf(path).hparams
    assert hp.arch == arch
    assert hp.qkv_bias == (arch == "qwen2") and hp.qk_norm == (arch == "qwen3")
    assert hp.head_dim == (32 if arch == "qwen3" else 16)


def test_logits_match_transformers_in_fp32(family):
    arch, hf, path = family
    bundle = load_bundle(str(path), "fp32", "cpu", weights="dense")
    for ids in PROMPTS:
        ours = bundle.model.reference_logits(ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max() < 1e-4, arch


def test_greedy_tokens_match_transformers(family):
    from isolab.llm import LLM
    from isolab.sampling_params import SamplingParams

    arch, hf, path = family
    llm = LLM(str(path), dtype="fp32", weights="dense")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for ids, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, len(ids):]
        assert list(out.token_ids) == ref.tolist(), arch


def test_torch_path_agrees_with_the_native_kernels(family):
    _, _, path = family
    loaded = load_gguf(path)
    native = LlamaModel(loaded, "fp32", native=True, weights="dense").reference_logits(PROMPTS[0])
    torch_path = LlamaModel(loaded, "fp32", native=False, weights="dense").reference_logits(PROMPTS[0])
    assert (native - torch_path).abs().max() < 1e-4


WIDE = next(s for s in SCENARIOS if s.fault == "batch-variant-gemm")


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_batch_invariance_and_its_fault_on_the_family(family, tmp_path, qtype):
    arch, hf, _ = family
    path = write_hf_decoder(tmp_path / f"{arch}-{qtype}.gguf", hf, arch, qtype=qtype)
    bundle = load_bundle(str(path), "bf16", "cpu", weights="native")
    assert not run_scenario(bundle, WIDE).caught
    assert run_scenario(bundle, WIDE, frozenset(["batch-variant-gemm"])).caught


def test_prefix_hit_equals_miss_on_the_family(family):
    """The same 30 requests twice on one engine: the second time from the prefix cache, same bits."""
    from tests.engine.workload import assert_hit_equals_miss

    assert_hit_equals_miss(load_bundle(str(family[2]), "bf16", "cpu", weights="native"))


@pytest.mark.parametrize("fault", [s.fault for s in SCENARIOS if s.fault != "batch-variant-gemm"])
def test_the_fault_catalogue_is_caught_on_the_family(family, fault):
    """Each cache and sampler fault: its scenario is silent on the healthy engine, caught with it on."""
    _, _, path = family
    bundle = load_bundle(str(path), "bf16", "cpu", weights="native")
    sc = next(s for s in SCENARIOS if s.fault == fault)
    assert not run_scenario(bundle, sc).caught
    assert run_scenario(bundle, sc, frozenset([fault])).caught
