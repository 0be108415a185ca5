"""`--weights dense` with its weights kept in their GGUF blocks (kernels/qdense.cpp, the default
where the tile unit runs) against the same engine on bf16 panels (ISOLAB_DENSE_BLOCKS=0): the
same bits, so what differs is speed and memory. `isolab bench` on the engine, fresh processes,
the two taking turns, at each concurrency; output tok/s, ITL p50 and peak RSS, medians and each
round.

    .venv/bin/python bench/dense_blocks.py [--concurrency 1,32,128] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(blocks: bool, concurrency: int, prompt_len: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "isolab.cli", "bench", "--weights", "dense", "--concurrency", str(concurrency),
               "--num-requests", str(max(4, concurrency)), "--prompt-len", prompt_len, "--json", str(target)]
        env = {**os.environ, "ISOLAB_DENSE_BLOCKS": "1" if blocks else "0"}
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"isolab bench failed ({done.returncode}): {done.stderr[-1500:]}")
        e = json.loads(target.read_text())["engine"]
    return {"tok_s": round(e["output_tokens_per_s"], 1), "itl_p50_ms": round(e["itl_s"]["p50"] * 1e3, 2),
            "ttft_p50_s": round(e["ttft_s"]["p50"], 3), "peak_rss_mib": round(e["peak_rss_mib"], 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,32,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", default="16:64")
    ap.add_argument("--json", default="bench/results/dense_blocks_engine.json")
    args = ap.parse_args()
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        runs: dict[str, list[dict]] = {"blocks": [], "panels": []}
        for _ in range(args.rounds):
            for name, blocks in (("blocks", True), ("panels", False)):
                runs[name].append(one(blocks, c, args.prompt_len))
        med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
        rows.append({"concurrency": c, "median": med, "runs": runs,
                     "tok_s_ratio": round(med["blocks"]["tok_s"] / med["panels"]["tok_s"], 3)})
        print(f"concurrency {c:4d}: blocks {med['blocks']['tok_s']:8.1f} tok/s (ITL p50 {med['blocks']['itl_p50_ms']:.1f} ms,"
              f" peak {med['blocks']['peak_rss_mib']:.0f} MiB)   panels {med['panels']['tok_s']:8.1f} tok/s (ITL p50 "
              f"{med['panels']['itl_p50_ms']:.1f} ms, peak {med['panels']['peak_rss_mib']:.0f} MiB)   "
              f"{med['blocks']['tok_s'] / med['panels']['tok_s']:.2f}x", flush=True)
    target = ROOT / args.json
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"prompt_len": args.prompt_len, "rounds": args.rounds, "rows": rows}, indent=1))
    print(f"wrote {target.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
