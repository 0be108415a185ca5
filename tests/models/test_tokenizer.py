"""The tokenizer wrapper (models/tokenizer.py): the construction tables transformers keeps are
released, and the tokenizer encodes, decodes and templates exactly as one that keeps them."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from isolab.models.gguf_loader import load_gguf
from isolab.models.tokenizer import Tokenizer, _cache_dir

TEXTS = ["Hello there, how are you doing today?", "Straße, ünïcode and 🙂 emoji", "  leading spaces\nand\ttabs",
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2  # code"]


def same_as_a_full_tokenizer(tok: Tokenizer, fingerprint: str) -> None:
    full = AutoTokenizer.from_pretrained(str(_cache_dir(fingerprint)))
    if getattr(full, "_vocab", None):  # transformers kept the tables there; ours let them go
        assert tok.hf._vocab == {} and tok.hf._merges == []
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(full(text).input_ids)
        assert tok.decode(ids, skip_special_tokens=False) == full.decode(ids, skip_special_tokens=False)
    full.chat_template = tok.hf.chat_template  # (a family's own where the file has none, as ours)
    msgs = [{"role": "user", "content": TEXTS[0]}]
    assert tok.apply_chat_template(msgs) == list(full.apply_chat_template(msgs, add_generation_prompt=True,
                                                                          tokenize=True, return_dict=False))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_construction_tables_are_released(tmp_path, arch):
    """Qwen2's and Gemma's tokenizer classes keep them (Gemma 3's 262k tokens made 144 MiB of an idle
    server); the byte-level one the tiny Llama gets has none."""
    from isolab.testing.tiny_model import TinySpec, tiny_vocab, write_hf_decoder, write_tiny_llama

    if arch == "llama":
        path = write_tiny_llama(tmp_path / "tiny.gguf", TinySpec(layers=1, seed=5))
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tiny_vocab()), hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
        path = write_hf_decoder(tmp_path / "tiny-qwen2.gguf", hf, "qwen2")
    loaded = load_gguf(path)
    tok = Tokenizer(path, loaded.fingerprint)
    same_as_a_full_tokenizer(tok, loaded.fingerprint)
    kept = getattr(AutoTokenizer.from_pretrained(str(_cache_dir(loaded.fingerprint))), "_vocab", None)
    assert bool(kept) == (arch == "qwen2")  # the case the release is for is the one tested


@pytest.mark.parametrize("which", ["tiny", "smollm2", "gemma3-270m"])
def test_token_bytes_are_llguidances_for_every_token(which, tiny_bundle, real_bundle):
    """Tokenizer.token_bytes (logprobs' `bytes`) against llguidance's own table of every token's bytes,
    on a byte-level vocabulary (the tiny model's, SmolLM2's) and a SentencePiece one with byte
    fallback (Gemma 3's 262k). llguidance marks its special tokens with a leading 0xFF, so it reads
    the token of the byte 0xFF as b"": that one token differs, and ours is the byte."""
    import llguidance

    if which == "gemma3-270m":
        from isolab.models.bundle import load_bundle

        bundle = load_bundle(which, "bf16", "cpu")
    else:
        bundle = tiny_bundle if which == "tiny" else real_bundle
    tok, n = bundle.tokenizer, bundle.hparams.vocab_size
    ll = llguidance.LLTokenizer(tok.hf.backend_tokenizer.to_str(), n_vocab=n, eos_token=tok.hf.eos_token_id)
    ours = tok.token_bytes(range(n))
    differ = [i for i in range(n) if ours[i] != ll.decode_bytes([i])]
    assert len(differ) <= 1 and all(ours[i] == b"\xff" and ll.decode_bytes([i]) == b"" for i in differ)
    split = tok.token_bytes(tok.encode("\U0001f44b", add_special_tokens=False))
    assert b"".join(split) == "\U0001f44b".encode()


def test_a_family_template_for_a_file_without_one_is_said(tmp_path, caplog):
    """A GGUF with no chat template (a base model's, as Gemma 3 270M's) gets its family's, and the log
    says so: chat requests format prompts for a model that may never have been tuned to answer them."""
    from isolab.testing.tiny_model import TinySpec, write_tiny_llama

    path = write_tiny_llama(tmp_path / "tiny-base.gguf", TinySpec(layers=1, chat_template=False))
    fingerprint = load_gguf(path).fingerprint
    with caplog.at_level("WARNING", logger="isolab.models.tokenizer"):
        Tokenizer(path, fingerprint)  # no family template given: nothing to say
        assert not caplog.records
        tok = Tokenizer(path, fingerprint, default_template="{{ messages[0]['content'] }}")
    assert tok.has_chat_template and "carries no chat template" in caplog.text and "tiny-base.gguf" in caplog.text


def test_a_gguf_without_a_token_list_names_the_missing_key(tiny_path, monkeypatch, tmp_path):
    """transformers raises KeyError('tokens') for a GGUF without tokenizer.ggml.tokens: the sentence
    said only "('tokens')"; it names the metadata key."""
    import transformers

    from isolab.errors import ModelLoadError
    from isolab.models import tokenizer as T

    def no_tokens(*args, **kwargs):
        raise KeyError("tokens")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_tokens)
    monkeypatch.setattr(T, "_cache_dir", lambda fingerprint: tmp_path / "none")
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.ggml\.tokens in its metadata"):
        T.Tokenizer(tiny_path, "a-fingerprint-no-cache-holds")
