"""Where a server process's idle memory goes: RSS after each thing it loads, in a fresh process.

    .venv/bin/python bench/memory.py [--model gemma3-270m] [--json bench/results/memory_MODEL.json]

Stages: Python, torch, the server's libraries (transformers, llguidance, FastAPI, isolab.server),
the GGUF read, the tokenizer, the model (weights packed, file pages and heap temporaries handed
back, as load_bundle does), then what `isolab serve` builds over it with its default settings:
the engine (its KV pool is mapped, not touched), structured outputs' compiler (llguidance's own
tokenizer over the vocabulary: built by the first structured request, so an idle server holds
none of this stage), the app, and the heap trimmed as `isolab serve` trims it before listening.
Also the tensors the model holds by kind.
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path


def rss_mib() -> float:
    for ln in Path("/proc/self/status").read_text().splitlines():
        if ln.startswith("VmRSS"):
            return round(int(ln.split()[1]) / 1024, 1)
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    stages = {"python": rss_mib()}
    import torch

    stages["torch"] = rss_mib()
    import fastapi  # noqa: F401
    import llguidance  # noqa: F401
    import transformers  # noqa: F401

    import isolab.server.app  # noqa: F401

    stages["server libraries"] = rss_mib()
    from isolab.models.bundle import family_template
    from isolab.models.gguf_loader import load_gguf
    from isolab.models.llama import LlamaModel
    from isolab.models.locate import resolve_model_path
    from isolab.models.tokenizer import Tokenizer

    path = resolve_model_path(args.model)
    loaded = load_gguf(path)
    stages["GGUF read"] = rss_mib()
    tokenizer = Tokenizer(path, loaded.fingerprint, family_template(loaded.hparams.arch))
    stages["tokenizer"] = rss_mib()
    model = LlamaModel(loaded, "bf16", "cpu", weights="native")
    loaded.release_pages()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    stages["model"] = rss_mib()
    from isolab.cli import build_parser
    from isolab.commands.serve import engine_config
    from isolab.engine.llm_engine import LLMEngine
    from isolab.models.bundle import assemble
    from isolab.server import ServerConfig, create_app, load_registry

    bundle = assemble(loaded, model, tokenizer, "bf16", "native")
    serve_args = build_parser().parse_args(["serve", "--no-auth", "--model", str(path)])
    engine = LLMEngine(engine_config(serve_args), bundle)
    stages["engine"] = rss_mib()
    engine.grammars.lltok  # noqa: B018 (what the first structured request builds: an idle server holds none of it)
    stages["structured outputs (first use)"] = rss_mib()
    create_app(engine, load_registry(None, no_auth=True), ServerConfig())
    stages["app"] = rss_mib()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    stages["trimmed"] = rss_mib()

    held = {"weight blocks MiB": round(sum(w.nbytes for w in model.linears()) / 2**20, 1),
            "RoPE tables MiB": round(sum(getattr(model, a).nbytes for a in ("rope", "rope_local")
                                         if hasattr(model, a)) / 2**20, 1)}
    steps = list(stages.items())
    deltas = {name: round(v - steps[i - 1][1], 1) for i, (name, v) in enumerate(steps) if i}
    out = {"model": path.name, "rss_mib": stages, "added_mib": deltas, "held": held, "torch": torch.__version__}
    for name, d in deltas.items():
        print(f"{name:18s} +{d:7.1f} MiB  (RSS {stages[name]:7.1f})")
    print(held)
    target = Path(args.json or f"bench/results/memory_{path.stem}.json")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
