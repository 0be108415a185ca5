"""Owns the engine's configuration: frozen dataclasses, validated once, never mutated.

Derived values come back as a new config (dataclasses.replace), never by mutation.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from isolab.errors import InvalidRequestError, is_whole
from isolab.faults import Faults

DTYPES = ("bf16", "fp32")
WEIGHTS = ("auto", "native", "dense")  # models/llama.py: native keeps the GGUF blocks; auto: native where it runs
GEMMS = ("isolab", "onednn", "fixed-tile", "torch")  # models/linear.py: GEMM_PATHS
MiB = 1 << 20
# Defaults the CLI, LLM and the server share (build_engine_config); the reasons are beside the fields.
DEFAULT_KV_CACHE_MEMORY = 2048 * MiB
DEFAULT_MAX_NUM_SEQS = 256


KV_CACHE_DTYPES = ("auto", "int8")


def memory_bytes(text: str) -> int:
    """'256MiB', '1GiB', '512M', '1TiB', or a plain number of bytes; InvalidRequestError otherwise."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().replace("ib", "").replace("b", "")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except (ValueError, OverflowError):  # (int of an infinite float overflows)
        raise InvalidRequestError(f"{text!r} is not a size (try 256MiB or 1GiB)", field="kv_cache_memory") from None


def fault_names(names: str | Iterable[str]) -> frozenset[str]:
    """One fault name or a collection of them (a string was read as its characters: "unknown fault 'a'")."""
    return frozenset({names} if isinstance(names, str) else names)


@dataclass(frozen=True)
class CacheConfig:
    # 16 tokens per block: vLLM's default; small enough that prefix sharing is fine-grained,
    # large enough that block-table gathers stay cheap.
    block_size: int = 16
    # Bytes for the K/V pool (all layers). 2 GiB holds ~93k tokens of SmolLM2-135M in bf16 (23 KB
    # a token): 256 requests of ~360 tokens without preemption. Pages are touched only as blocks are
    # first written, so an idle server's RSS does not grow with it.
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY
    enable_prefix_caching: bool = True
    # Sliding-window layers (Gemma 3's local ones) keep only the blocks their window still reads
    # (engine/kv_groups.py); off: every layer keeps every block. No effect on models without them.
    window_cache: bool = True
    # What the pool stores K/V as: "auto" the activations' dtype (bf16 or fp32: a row's numbers are
    # the reference's), or "int8": a byte a value and one fp32 scale a key and head (0.53x the bytes
    # of bf16 in SmolLM2's shape, so twice the tokens in the same memory and less to read a step;
    # a row's numbers then differ from the reference's by the rounding, measured in docs/engine.md).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):  # as the CLI takes it: "1GiB"
            object.__setattr__(self, "kv_cache_memory", memory_bytes(self.kv_cache_memory))
        for name in ("block_size", "kv_cache_memory"):  # (a float or another string reached the pool's maths)
            if not is_whole(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be a whole number, not {getattr(self, name)!r}", field=name)
        if self.block_size < 1 or self.block_size > 1024:
            raise InvalidRequestError("block_size must be between 1 and 1024", field="block_size")
        if self.block_size % 2:  # (an odd one gave wrong bf16 outputs that the start-up check did not see)
            raise InvalidRequestError(f"block_size must be even: the bf16 pool stores V in pairs of keys, not "
                                      f"{self.block_size}", field="block_size")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                      f"not {self.kv_cache_dtype!r}", field="kv_cache_dtype")
        if self.kv_cache_dtype == "int8" and self.block_size % 16:
            raise InvalidRequestError(f"kv_cache_dtype int8 stores keys in runs of 16: block_size must be a multiple "
                                      f"of 16, not {self.block_size}", field="block_size")
        if self.kv_cache_memory <= 0:
            raise InvalidRequestError("kv_cache_memory must be a positive number of bytes", field="kv_cache_memory")


@dataclass(frozen=True)
class SchedulerConfig:
    # Running requests at once. Throughput grows with the batch until the GEMMs are compute-bound
    # (bench/step_profile.py), so the limit is set by the KV pool, not by a small constant.
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = 512  # tokens computed per step (prompt chunks + decode tokens)
    # prompt tokens a step computes at most, within max_num_batched_tokens (a request's chunk of more than
    # one token: its prompt, or its prompt and output again after a preemption); None: no cap of its own.
    # Bounds the step, hence every stream's gap between tokens, without holding back decodes.
    max_prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if not is_whole(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be a whole number, not {getattr(self, name)!r}", field=name)
        if self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs must be at least 1", field="max_num_seqs")
        if self.max_num_batched_tokens < 1:
            raise InvalidRequestError("max_num_batched_tokens must be at least 1", field="max_num_batched_tokens")
        if self.max_prefill_tokens is not None and (not is_whole(self.max_prefill_tokens) or self.max_prefill_tokens < 2):
            raise InvalidRequestError(f"max_prefill_tokens must be a whole number of at least 2 (or unset), not "
                                      f"{self.max_prefill_tokens!r}", field="max_prefill_tokens")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # path to a GGUF; None = the default SmolLM2-135M-Instruct Q4_1
    dtype: str = "bf16"  # activations and K/V
    device: str | None = None  # None: cuda when available, else cpu
    # weights: native (multiply on the GGUF's quantized blocks), dense (dequantized to dtype), or
    # auto: native where isolab's kernels run (a CPU with a C++ compiler), else dense
    weights: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int | None = None  # None: the model's context length
    gemm: str | None = None  # GEMM path (models/linear.py); None: the first that passes the invariance check
    audit: bool = False  # writer tags checked on every read; freed blocks poisoned with NaN
    inject_faults: frozenset[str] = frozenset()  # names from isolab.faults.FAULTS; never on by default
    trace_path: str | None = None  # JSONL lifecycle trace of every block event
    # Derived from inject_faults once, in __post_init__: what the engine's components read.
    faults: Faults = field(init=False, default=Faults())

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str | os.PathLike):
            raise InvalidRequestError(f"model must be a GGUF path or a model name, not {type(self.model).__name__}",
                                      field="model")
        if self.max_model_len is not None and not is_whole(self.max_model_len):
            raise InvalidRequestError(f"max_model_len must be a whole number, not {self.max_model_len!r}",
                                      field="max_model_len")
        object.__setattr__(self, "inject_faults", fault_names(self.inject_faults))
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}", field="dtype")
        if self.weights not in WEIGHTS:
            raise InvalidRequestError(f"weights must be one of {', '.join(WEIGHTS)}, not {self.weights!r}", field="weights")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidRequestError(f"max_model_len must be at least 1, not {self.max_model_len}", field="max_model_len")
        if self.gemm is not None and self.gemm not in GEMMS:
            raise InvalidRequestError(f"gemm must be one of {', '.join(GEMMS)}, not {self.gemm!r}", field="gemm")
        object.__setattr__(self, "faults", Faults.from_names(self.inject_faults))  # validates the names


def build_engine_config(
    *,
    model: str | None = None,
    dtype: str = "bf16",
    device: str | None = None,
    gemm: str | None = None,
    weights: str = "auto",
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    window_cache: bool = True,
    kv_cache_dtype: str = "auto",
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: int = 512,
    max_prefill_tokens: int | None = None,
    max_model_len: int | None = None,
    audit: bool = False,
    inject_faults: str | Iterable[str] = (),
    trace_path: str | None = None,
) -> EngineConfig:
    """The one way the CLI, `LLM` and the server build an EngineConfig from flat options."""
    return EngineConfig(
        model=model, dtype=dtype, device=device, gemm=gemm, weights=weights,
        cache=CacheConfig(block_size, kv_cache_memory, enable_prefix_caching, window_cache, kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_prefill_tokens),
        max_model_len=max_model_len, audit=audit, trace_path=trace_path,
        inject_faults=fault_names(inject_faults),
    )
