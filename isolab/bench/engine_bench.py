"""Owns the engine-level benchmark (no HTTP): a workload at a fixed concurrency through LLMEngine,
and the same prompts through Hugging Face transformers' static-batch generate for comparison.

Reports aggregate output tokens/s, time to first token and inter-token latency percentiles
(per request, measured at the step that produced the token), prefix-cache hit rate, peak RSS.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass

import torch

from isolab.bench.http_bench import percentiles
from isolab.bench.workload import Workload
from isolab.engine.llm_engine import LLMEngine
from isolab.sampling_params import SamplingParams


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclass
class _Track:
    sent: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0


def run_engine_bench(engine: LLMEngine, wl: Workload, concurrency: int, *, warmup: bool = True) -> dict:
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")  # else no request is ever admitted
    tok = engine.tokenizer
    prompt_ids = [tok.encode(p) for p in wl.prompts]
    if warmup:  # one short request: first-call costs (allocator, kernels) out of the measurement
        # its own text, not a workload prompt's start: the warm-up must not seed the prefix cache
        engine.add_request("warmup", tok.encode("Warm-up: not part of the workload."),
                           SamplingParams(max_tokens=2, temperature=0))
        while engine.has_unfinished():
            engine.step()
    q0, h0 = engine.kv.num_query_tokens, engine.kv.num_hit_tokens
    pending = list(range(len(prompt_ids)))
    tracks: dict[str, _Track] = {}
    itl: list[float] = []
    live = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and live < concurrency:
            i = pending.pop(0)
            rid = f"b{i}"
            engine.add_request(rid, prompt_ids[i], SamplingParams(max_tokens=wl.max_tokens[i], temperature=0, ignore_eos=True))
            tracks[rid] = _Track(time.perf_counter())
            live += 1
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            t = tracks[o.request_id]
            if o.new_token_ids:
                if t.first is None:
                    t.first = now
                elif t.last is not None:
                    itl.append(now - t.last)
                t.last = now
                t.tokens += len(o.new_token_ids)
            if o.finished:
                live -= 1
    wall = time.perf_counter() - t0
    total = sum(t.tokens for t in tracks.values())
    q, h = engine.kv.num_query_tokens - q0, engine.kv.num_hit_tokens - h0
    return {
        "requests": len(tracks),
        "concurrency": concurrency,
        "prompt_tokens": sum(len(p) for p in prompt_ids),
        "output_tokens": total,
        "wall_s": wall,
        "output_tokens_per_s": total / wall,
        "ttft_s": percentiles([t.first - t.sent for t in tracks.values() if t.first is not None]),
        "itl_s": percentiles(itl),
        "prefix_cache_hit_rate": (h / q) if q else 0.0,
        "preemptions": engine.scheduler.num_preemptions,
        "peak_rss_mib": peak_rss_mib(),
    }


def load_hf(model_path: str | None, dtype: str):
    """transformers' model and tokenizer from the same GGUF, left padding for batched generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from isolab.models.locate import resolve_model_path

    p = resolve_model_path(model_path)
    tdtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=tdtype).eval()
    with torch.inference_mode():  # first-call costs out of the measurement, as the engine's warm-up does
        model.generate(**tok(["warm up"], return_tensors="pt"), max_new_tokens=2, do_sample=False,
                       pad_token_id=tok.pad_token_id)
    return model, tok


def run_hf_bench(model_path: str | None, dtype: str, wl: Workload, batch_size: int, loaded=None) -> dict:
    """transformers' batched generate: static batches of `batch_size`, left-padded, greedy."""
    model, tok = loaded or load_hf(model_path, dtype)
    total = 0
    ttfts: list[float] = []
    t0 = time.perf_counter()
    for s in range(0, len(wl.prompts), batch_size):
        batch = wl.prompts[s : s + batch_size]
        n_new = max(wl.max_tokens[s : s + batch_size])
        enc = tok(batch, return_tensors="pt", padding=True)
        tb = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        # static batching: every request waits for the whole batch; its first token comes after prefill
        ttfts.extend([time.perf_counter() - tb] * len(batch))
        total += (out.shape[1] - enc.input_ids.shape[1]) * len(batch)
    wall = time.perf_counter() - t0
    return {"output_tokens": total, "wall_s": wall, "output_tokens_per_s": total / wall, "batch_size": batch_size,
            "request_latency_s": percentiles(ttfts), "peak_rss_mib": peak_rss_mib()}
