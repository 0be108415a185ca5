"""Owns the engine options every engine-backed subcommand shares (model, dtype, cache, audit, faults)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from isolab.config import (
    DEFAULT_KV_CACHE_MEMORY,
    DEFAULT_MAX_NUM_SEQS,
    GEMMS,
    KV_CACHE_DTYPES,
    WEIGHTS,
    MiB,
    memory_bytes,
)
from isolab.errors import InvalidRequestError
from isolab.faults import FAULTS


def parse_memory(text: str) -> int:
    """'256MiB', '1GiB', '512M', or a plain number of bytes (config.memory_bytes), as an argparse type."""
    try:
        return memory_bytes(text)
    except InvalidRequestError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="a GGUF path (Llama, Qwen2/3, Gemma 3) or a name: "
                   "smollm2-135m-instruct (the default: its Q4_1 GGUF), gemma3-270m")
    g.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="activations and K/V (bf16)")
    g.add_argument("--weights", choices=WEIGHTS, default="auto",
                   help="native: multiply on the GGUF's quantized blocks (isolab/kernels/qgemm.cpp); dense: "
                        "dequantize to --dtype (the bit-exact reference in fp32; in bf16 on a CPU with AMX the "
                        "blocks are dequantized tile by tile, the same bits, and under load faster than native); "
                        "auto: native where isolab's kernels run")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    g.add_argument("--gemm", choices=GEMMS, default=None,
                   help="the dense GEMM path (default: the first that passes the start-up invariance check: isolab's "
                        "own GEMM wherever a C++ compiler is; docs/engine.md, Numerics); native weights multiply on "
                        "their quantized blocks whatever it says, so it matters with --weights dense")
    g.add_argument("--kv-cache-memory", type=parse_memory, default=DEFAULT_KV_CACHE_MEMORY,
                   help=f"bytes for the KV pool ({DEFAULT_KV_CACHE_MEMORY // MiB}MiB)")
    g.add_argument("--block-size", type=int, default=16,
                   help="tokens a K/V block holds (16; any multiple of 16 takes the native attention kernel's "
                        "fast paths, with the same bits; other sizes run its generic loop, several times slower "
                        "under load)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="what the KV pool stores: auto (--dtype: a row's numbers are the reference's) or int8 (a "
                        "byte a value, a scale a key: twice the tokens in --kv-cache-memory, faster under load, "
                        "numbers off the reference by the rounding; docs/engine.md)")
    g.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="prompt tokens a step computes at most, decodes not counted (default: no cap besides "
                        "--max-num-batched-tokens): a smaller step, so a shorter gap between tokens under load")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="tokens a request may hold, prompt and output (default: the model's context length)")
    g.add_argument("--no-prefix-cache", action="store_true", help="turn prefix caching off")
    g.add_argument("--no-window-cache", action="store_true",
                   help="sliding-window layers (Gemma 3's local ones) keep every block, not only their window's")
    g.add_argument("--audit", action="store_true", help="check writer tags on every read; poison freed blocks")
    g.add_argument("--inject-fault", action="append", default=[], choices=sorted(FAULTS), metavar="NAME",
                   help=f"switch one protection off (repeatable): {', '.join(FAULTS)}")
    g.add_argument("--trace", default=None, metavar="FILE", help="write every block event to this JSONL file")


def flags_set(args: argparse.Namespace, add_args: Callable[[argparse.ArgumentParser], None]) -> list[tuple[str, str]]:
    """(option, dest) of each flag `add_args` declares that `args` holds away from its default, in the
    order they are declared: what a command refuses where those flags would be ignored."""
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    defaults = vars(parser.parse_args([]))
    return [(a.option_strings[0], a.dest) for a in parser._actions
            if a.dest in defaults and getattr(args, a.dest) != defaults[a.dest]]


def engine_flags_set(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The engine flags (add_engine_args) set: what a command that builds no engine, or builds its own, must refuse."""
    return flags_set(args, add_engine_args)


def llm_kwargs(args: argparse.Namespace) -> dict:
    from isolab.commands.outputs import check_output_path

    check_output_path(args.trace, "--trace")  # before the model loads
    return dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        gemm=args.gemm,
        weights=args.weights,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_cache,
        window_cache=not args.no_window_cache,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_tokens=args.max_prefill_tokens,
        max_model_len=args.max_model_len,
        audit=args.audit,
        inject_faults=tuple(args.inject_fault),
        trace_path=args.trace,
    )
