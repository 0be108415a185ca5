"""Owns writing a tiny random Llama to a GGUF file, so tests run the real loader in milliseconds.

The tokenizer is byte-level BPE (GPT-2 style): 256 byte tokens, a few merges, and the ChatML
special tokens, with a ChatML chat template, all in the GGUF metadata like a real model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "r e"]


def _bytes_to_unicode() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


@dataclass(frozen=True)
class TinySpec:
    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    context: int = 512
    rope_theta: float = 10000.0
    seed: int = 0
    qtype: str = "F32"  # type of the 2-D weight matrices: F32, F16, BF16, Q8_0, Q4_0, Q4_1
    arch: str = "llama"  # or "gemma3": norms after attention and the MLP, q/k norms, a sliding window
    tied: bool = True
    sliding_window: int = 0  # gemma3: the local layers' window (5 of every 6 layers are local)
    vocab_size_key: bool = True  # write {arch}.vocab_size (else readers take the token list's length, as Gemma's file)
    chat_template: bool = True  # write the ChatML template (a base model's file may carry none)


def tiny_vocab() -> list[str]:
    toks = SPECIALS + _bytes_to_unicode()
    toks += [m.replace(" ", "") for m in MERGES]
    return toks


def _write_tokenizer(w, vocab_size_key: bool = True, chat_template: bool = True) -> None:
    """The byte-level BPE tokenizer and ChatML template, as GGUF metadata."""
    vocab = tiny_vocab()
    if vocab_size_key:
        w.add_vocab_size(len(vocab))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(CHAT_TEMPLATE)


# transformers' Llama-style decoder (Qwen2, Qwen3) -> llama.cpp's tensor names
HF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def write_hf_decoder(path: str | Path, model, arch: str, qtype: str = "F32") -> Path:
    """A transformers Qwen2/Qwen3 (or any Llama-style) model written as llama.cpp's converter lays it
    out (no q/k row permutation for qwen), with the tiny tokenizer: for tests that compare isolab
    with transformers on families no small real GGUF of which is on PyPI. Matrices in `qtype`."""
    import gguf
    from gguf.quants import quantize

    path = Path(path)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    _write_tokenizer(w)
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    for name, t in model.state_dict().items():
        data = t.detach().float().numpy()
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        elif name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, i, rest = name.split(".", 3)  # model.layers.I.self_attn.q_proj.weight
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{HF_NAMES[module]}.{kind}"
        if data.ndim == 2 and qtype != "F32":
            q = quantize(data, qt)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qt)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_llama(path: str | Path, spec: TinySpec = TinySpec()) -> Path:
    import gguf
    from gguf.quants import quantize

    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    vocab = tiny_vocab()
    V, D, F_, H, KV = len(vocab), spec.hidden, spec.intermediate, spec.heads, spec.kv_heads
    hd = D // H
    w = gguf.GGUFWriter(str(path), spec.arch)
    w.add_name("tiny-llama")
    w.add_context_length(spec.context)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F_)
    w.add_block_count(spec.layers)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    gemma = spec.arch == "gemma3"
    if gemma:
        assert spec.sliding_window > 0, "a tiny gemma3 needs its sliding window"
        w.add_sliding_window(spec.sliding_window)
        w.add_key_length(hd)
        w.add_value_length(hd)
    _write_tokenizer(w, spec.vocab_size_key, spec.chat_template)

    qtype = getattr(gguf.GGMLQuantizationType, spec.qtype)

    def mat(name: str, rows: int, cols: int, scale: float) -> None:
        data = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if spec.qtype == "F32":
            w.add_tensor(name, data)
        elif spec.qtype == "F16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            q = quantize(data, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    def vec(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", V, D, 0.5)
    if not spec.tied:
        mat("output.weight", V, D, 0.5)
    vec("output_norm.weight", D)
    s = D ** -0.5
    for i in range(spec.layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", D)
        vec(p + "ffn_norm.weight", D)
        mat(p + "attn_q.weight", H * hd, D, s)
        mat(p + "attn_k.weight", KV * hd, D, s)
        mat(p + "attn_v.weight", KV * hd, D, s)
        mat(p + "attn_output.weight", D, H * hd, s)
        mat(p + "ffn_gate.weight", F_, D, s)
        mat(p + "ffn_up.weight", F_, D, s)
        mat(p + "ffn_down.weight", D, F_, F_ ** -0.5)
        if gemma:
            vec(p + "attn_q_norm.weight", hd)
            vec(p + "attn_k_norm.weight", hd)
            vec(p + "post_attention_norm.weight", D)
            vec(p + "post_ffw_norm.weight", D)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
