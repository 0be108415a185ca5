"""Owns what Qwen2 and Qwen3 change in the Llama layer (models/llama.py holds the weights and the rest):

  qwen2: biases on q, k and v, added to the qkv GEMM's rounded output;
  qwen3: a per-head RMSNorm of q and k (weights of head_dim), and a head_dim apart from hidden/heads.

Neither has llama.cpp's q/k row permutation (the loader knows). Row by row, so batch-invariant like
the rest of the layer.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from isolab import kernels


class QwenModel(Protocol):
    """The parts of LlamaModel this reads (no import of models/llama.py: it calls us)."""

    hp: Any  # LlamaHParams: num_heads, num_kv_heads, head_dim, rms_eps

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...


def qkv_extras(model: QwenModel, layer: Any, qkv: torch.Tensor, N: int, native: bool) -> torch.Tensor:
    """qkv: (N, (H + 2 Hkv) Dh), the qkv GEMM's output -> the same with the family's additions."""
    if layer.qkv_bias is not None:
        qkv = qkv + layer.qkv_bias  # added to the GEMM's rounded output (transformers adds it before rounding)
    if layer.q_norm is not None and layer.k_norm is not None:
        hp = model.hp
        H, Hkv, Dh = hp.num_heads, hp.num_kv_heads, hp.head_dim
        q = qkv[:, : H * Dh].reshape(N * H, Dh)
        k = qkv[:, H * Dh : (H + Hkv) * Dh].reshape(N * Hkv, Dh)
        if native:
            q, k = kernels.rms_norm(q, layer.q_norm, hp.rms_eps), kernels.rms_norm(k, layer.k_norm, hp.rms_eps)
        else:
            q, k = model._rms_norm(q, layer.q_norm), model._rms_norm(k, layer.k_norm)
        qkv = torch.cat([q.view(N, H * Dh), k.view(N, Hkv * Dh), qkv[:, (H + Hkv) * Dh :]], dim=1)
    return qkv
