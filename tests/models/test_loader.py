"""The GGUF loader: every supported tensor type reads back what was written; bad files get one sentence."""

from __future__ import annotations

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
    w.add_block_count(0)
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
