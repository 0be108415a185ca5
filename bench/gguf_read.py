"""Reading a GGUF's metadata and tensor table: gguf's GGUFReader against isolab's reader
(models/gguf_loader.py: MetadataReader, which reads numeric arrays whole and steps over the
tokenizer's string arrays), each in a fresh process, taking turns.

Per run: seconds to parse, peak RSS (ru_maxrss) of a process that imported gguf and parsed the
file, against one that only imported it; then, for isolab's reader only, `load_bundle`'s seconds
(the whole model load: parse, packing, tokenizer) in the same process.

    .venv/bin/python bench/gguf_read.py [--model gemma3-270m] [--rounds 3]

Writes bench/results/gguf_read_MODEL.json. Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(reader: str, model: str | None) -> dict:
    import gguf  # noqa: F401

    from isolab.models import gguf_loader
    from isolab.models.locate import resolve_model_path

    path = resolve_model_path(model)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cls = gguf.GGUFReader if reader == "gguf" else gguf_loader._reader_class()
    t = time.perf_counter()
    r = cls(str(path))
    parse_s = time.perf_counter() - t
    hp = gguf_loader.read_hparams(r)
    out = {"reader": reader, "parse_s": round(parse_s, 3), "fields": len(r.fields), "tensors": len(r.tensors),
           "vocab_size": hp.vocab_size,
           "peak_rss_added_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base, 1)}
    del r
    if reader == "isolab":
        from isolab.models.bundle import load_bundle

        t = time.perf_counter()
        load_bundle(model)
        out["load_bundle_s"] = round(time.perf_counter() - t, 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", choices=("gguf", "isolab"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model)))
        return 0
    from isolab.models.locate import resolve_model_path

    path = resolve_model_path(args.model)
    runs = []
    for r in range(args.rounds):
        for reader in (("gguf", "isolab") if r % 2 == 0 else ("isolab", "gguf")):
            cmd = [sys.executable, __file__, "--child", reader, *(["--model", args.model] if args.model else [])]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
            run = json.loads(out.strip().splitlines()[-1])
            runs.append(run)
            print(f"round {r} {reader:>6}: parse {run['parse_s']:.3f} s, peak RSS +{run['peak_rss_added_mib']} MiB"
                  + (f", load_bundle {run['load_bundle_s']:.2f} s" if "load_bundle_s" in run else ""), flush=True)
    med = {reader: {k: statistics.median(x[k] for x in runs if x["reader"] == reader)
                    for k in ("parse_s", "peak_rss_added_mib")} for reader in ("gguf", "isolab")}
    med["isolab"]["load_bundle_s"] = statistics.median(x["load_bundle_s"] for x in runs if x["reader"] == "isolab")
    g, i = med["gguf"], med["isolab"]
    print(f"{path.name}: parse {g['parse_s']:.3f} s -> {i['parse_s']:.3f} s ({g['parse_s'] / i['parse_s']:.0f}x), "
          f"peak RSS of the parse +{g['peak_rss_added_mib']} -> +{i['peak_rss_added_mib']} MiB; "
          f"a whole load now {i['load_bundle_s']:.2f} s")
    from isolab.models.invariance import cpu_description

    result = {"model": path.name, "cpu": cpu_description(), "rounds": args.rounds, "median": med, "runs": runs}
    out_path = Path(args.json or ROOT / f"bench/results/gguf_read_{path.stem}.json")
    out_path.write_text(json.dumps(result, indent=2))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
