"""Prefill throughput: one 512-token prompt through isolab's engine (to its first token) against
transformers' forward over the same 512 tokens, same model, same dtype, same process, interleaved.

isolab's figure is the wall time of a fresh request (no prefix-cache hit: each repeat uses other
tokens) from add_request to its first sampled token; transformers' is one forward of the prompt
(logits of the last position), under inference_mode. The median of the repeats' ratios is the
figure (the machine is shared and noisy).

    .venv/bin/python bench/prefill.py [--tokens 512] [--repeats 5] [--dtypes bf16,fp32]

Writes bench/results/prefill.json. Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from isolab.bench.engine_bench import load_hf  # noqa: E402
from isolab.config import build_engine_config  # noqa: E402
from isolab.engine.llm_engine import LLMEngine  # noqa: E402
from isolab.models.invariance import cpu_description  # noqa: E402
from isolab.sampling_params import SamplingParams  # noqa: E402


def isolab_prefill_s(engine: LLMEngine, ids: list[int], rid: str) -> float:
    t0 = time.perf_counter()
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


@torch.inference_mode()
def hf_prefill_s(model, ids: list[int]) -> float:
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    model(input_ids=x, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", default="bf16,fp32")
    a = ap.parse_args()
    result: dict = {"tokens": a.tokens, "cpu": cpu_description().split(";")[0], "torch_threads": torch.get_num_threads(),
                    "dtypes": {}}
    for dtype in a.dtypes.split(","):
        engine = LLMEngine(build_engine_config(dtype=dtype, max_num_batched_tokens=max(a.tokens, 512)))
        hf, _ = load_hf(None, dtype)
        vocab = engine.model.hp.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(100, vocab - 100, (a.tokens,), generator=g).tolist() for _ in range(a.repeats + 1)]
        isolab_prefill_s(engine, prompts[-1], "warm")  # first-call costs out
        hf_prefill_s(hf, prompts[-1])
        pairs = []
        for r in range(a.repeats):
            ours = isolab_prefill_s(engine, prompts[r], f"p{r}")
            theirs = hf_prefill_s(hf, prompts[r])
            pairs.append({"isolab_s": ours, "hf_s": theirs, "ratio": theirs / ours})
            print(f"{dtype} repeat {r + 1}: isolab {a.tokens / ours:.0f} tok/s ({ours * 1e3:.0f} ms), "
                  f"transformers {a.tokens / theirs:.0f} tok/s ({theirs * 1e3:.0f} ms): {theirs / ours:.2f}x", flush=True)
        ratios = [p["ratio"] for p in pairs]
        result["dtypes"][dtype] = {
            "numerics": engine.model.numerics.numerics,
            "isolab_tok_s_median": a.tokens / statistics.median(p["isolab_s"] for p in pairs),
            "hf_tok_s_median": a.tokens / statistics.median(p["hf_s"] for p in pairs),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "pairs": pairs,
        }
        d = result["dtypes"][dtype]
        print(f"{dtype}: prefill {a.tokens} tokens, median ratio {d['ratio_median']:.2f}x "
              f"(isolab {d['isolab_tok_s_median']:.0f} tok/s, transformers {d['hf_tok_s_median']:.0f} tok/s)", flush=True)
        engine.close()
        del hf
    out = Path(__file__).parent / "results" / "prefill.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
