"""The GGUF loader: every supported tensor type reads back what was written; bad files get one sentence."""

from __future__ import annotations

import re

import numpy as np
import pytest

from isolab.errors import ModelLoadError, UnsupportedModelError
from isolab.models.gguf_loader import load_gguf
from isolab.testing.tiny_model import TinySpec, write_tiny_llama

# Reading back a quantized tensor can only be as exact as the quantization itself.
TOLERANCE = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 2e-2, "Q4_1": 0.15, "Q4_0": 0.2}


@pytest.fixture(scope="module")
def f32(tmp_path_factory):
    return load_gguf(write_tiny_llama(tmp_path_factory.mktemp("f32") / "m.gguf", TinySpec(qtype="F32")))


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_tensor_types_read_back(tmp_path, f32, qtype):
    m = load_gguf(write_tiny_llama(tmp_path / "m.gguf", TinySpec(qtype=qtype)))
    assert m.tensor_types["blk.0.ffn_up.weight"] == qtype
    for name in ("token_embd.weight", "blk.0.ffn_up.weight", "blk.1.attn_q.weight"):
        a, b = m.tensors[name], f32.tensors[name]
        assert a.shape == b.shape
        rel = np.abs(a - b).max() / np.abs(b).max()
        assert rel <= TOLERANCE[qtype], (name, rel)


def test_hparams(f32):
    hp = f32.hparams
    assert (hp.hidden_size, hp.num_layers, hp.num_heads, hp.num_kv_heads, hp.head_dim) == (64, 2, 4, 2, 16)
    assert len(f32.fingerprint) == 64


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        load_gguf(p)


def test_truncated_file(tmp_path):
    good = write_tiny_llama(tmp_path / "m.gguf")
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 3])
    with pytest.raises(ModelLoadError, match="corrupt or truncated|could not be read"):
        load_gguf(bad)


def test_unsupported_architecture(tmp_path):
    p = write_tiny_llama(tmp_path / "m.gguf", TinySpec(arch="mamba"))
    with pytest.raises(UnsupportedModelError, match="architecture 'mamba' is not supported"):
        load_gguf(p)


def test_unsupported_tensor_type(tmp_path):
    import gguf

    p = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_feed_forward_length(8)
    w.add_vocab_size(4)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="has type I32, which isolab does not read"):
        load_gguf(p)


def _same_as_gguf(path) -> None:
    """isolab's reader gives gguf's own reading of every field and tensor, except the arrays of
    strings it steps over, whose length it keeps."""
    from gguf import GGUFReader, GGUFValueType

    from isolab.models.gguf_loader import _reader_class, array_len

    ref, ours = GGUFReader(str(path)), _reader_class()(str(path))
    assert list(ours.fields) == list(ref.fields)
    skipped = 0
    for key, field in ref.fields.items():
        assert ours.fields[key].types == field.types, key
        if field.types[:1] == [GGUFValueType.ARRAY] and field.types[-1] == GGUFValueType.STRING:
            assert ours.fields[key].contents() == []
            assert array_len(ours, key) == len(field.contents()), key
            skipped += 1
        else:
            assert ours.fields[key].contents() == field.contents(), key
            if field.types[:1] == [GGUFValueType.ARRAY]:
                assert array_len(ours, key) == len(field.contents()), key
    assert skipped >= 1  # the vocabulary
    assert ours.data_offset == ref.data_offset and len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape.tolist(), a.data_offset) == (b.name, b.tensor_type, b.shape.tolist(),
                                                                           b.data_offset)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def test_reader_matches_gguf_on_a_tiny_model(tmp_path):
    _same_as_gguf(write_tiny_llama(tmp_path / "m.gguf", TinySpec(qtype="Q4_1")))


@pytest.mark.real
def test_reader_matches_gguf_on_the_shipped_model():
    from isolab.models.locate import resolve_model_path

    _same_as_gguf(resolve_model_path(None))


def test_vocabulary_size_from_the_token_list(tmp_path):
    """Without {arch}.vocab_size (Gemma 3's file has none) the vocabulary size is the token list's
    length, which the reader keeps though it steps over the list."""
    from gguf import GGUFReader

    from isolab.testing.tiny_model import tiny_vocab

    path = write_tiny_llama(tmp_path / "m.gguf", TinySpec(vocab_size_key=False))
    assert "llama.vocab_size" not in GGUFReader(str(path)).fields
    assert load_gguf(path).hparams.vocab_size == len(tiny_vocab())


@pytest.mark.parametrize("key,where", [("tokenizer.ggml.tokens", "the token list's first length"),
                                       ("tokenizer.ggml.tokens", "a token's bytes"),
                                       ("tokenizer.ggml.tokens", "the last token"),
                                       ("tokenizer.ggml.token_type", "the last value")])
def test_truncated_inside_the_vocabulary(tmp_path, key, where):
    """A file cut inside an array isolab's reader steps over (strings) or reads whole (numbers)."""
    from gguf import GGUFReader

    good = write_tiny_llama(tmp_path / "m.gguf")
    field = GGUFReader(str(good)).fields[key]
    start = [field.offset]  # where each part of the field begins: key length, key, type, element type, count,
    for part in field.parts:  # then each token's length and bytes
        start.append(start[-1] + part.nbytes)
    assert key != "tokenizer.ggml.tokens" or field.parts[6].nbytes > 1  # the first token has bytes to cut into
    ends = {"the token list's first length": start[5] + 3, "a token's bytes": start[6] + 1,
            "the last token": start[-1] - 1, "the last value": start[-1] - 4}  # (one int32 short)
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[: ends[where]])
    # short of the last element, the reader's own check names it (else a later read would fail)
    with pytest.raises(ModelLoadError, match="corrupt or truncated" + (".*runs past the end of the file"
                                                                        if where.startswith("the last") else "")):
        load_gguf(bad)


def test_an_interrupted_join_of_gemmas_parts_leaves_no_temporary(tmp_path, monkeypatch):
    """Ctrl-C while Gemma 3's pip chunks are joined into the cache (a 250 MB file): the half-written
    temporary is removed, and the next run joins again from scratch."""
    from isolab.models import locate

    class Interrupted:
        def open(self, mode="rb"):
            import io

            class Reader(io.BytesIO):
                def read(self, n=-1):
                    raise KeyboardInterrupt

            return Reader()

    first = tmp_path / "part0"
    first.write_bytes(b"gguf" * 1000)
    monkeypatch.setattr(locate, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(locate, "_package_file", lambda pkg, name, hint: first if name.endswith("00") else Interrupted())
    with pytest.raises(KeyboardInterrupt):
        locate.gemma3_path()
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.parametrize(("method", "value", "says"), [
    ("add_head_count", 0, "llama.attention.head_count is 0: it must be at least 1"),
    ("add_head_count_kv", 0, "llama.attention.head_count_kv is 0: it must be at least 1"),
    ("add_block_count", 0, "llama.block_count is 0: it must be at least 1"),
    ("add_context_length", 0, "llama.context_length is 0: it must be at least 1"),
    ("add_context_length", 2**31, "context_length is 2,147,483,648 tokens, more than isolab takes"),
    ("add_layer_norm_rms_eps", float("nan"), "layer_norm_rms_epsilon is nan: it must be a positive number"),
    ("add_layer_norm_rms_eps", -1.0, "layer_norm_rms_epsilon is -1.0: it must be a positive number"),
    ("add_rope_freq_base", 0.0, "rope.freq_base is 0.0: it must be a positive number"),
])
def test_metadata_no_model_can_have_is_refused_at_load_in_a_sentence(tmp_path, monkeypatch, method, value, says):
    """A QA pass: a head count of 0 was a ZeroDivisionError, a context of 2**31 a 64 GiB RoPE table, an
    epsilon of NaN a sampler's RuntimeError at the first token (or token 0 forever, greedy)."""
    import gguf

    real = getattr(gguf.GGUFWriter, method)
    monkeypatch.setattr(gguf.GGUFWriter, method, lambda self, _v: real(self, value))
    path = write_tiny_llama(tmp_path / "bad.gguf")
    monkeypatch.undo()
    with pytest.raises(ModelLoadError, match=re.escape(says)):
        load_gguf(path)
