"""The quantized GEMM (kernels/qgemm.cpp) against the dense bf16 GEMM (kernels/gemm.cpp) on a model's
own shapes, at M = 1, 32 and 512 rows, in one run: ms per call and the ratio. The weights are the
model's (native records against the same tensors dequantized to bf16), hot in cache at M = 1.

    .venv/bin/python bench/qgemm.py [--model gemma3-270m] [--json bench/results/qgemm.json]
    .venv/bin/python bench/qgemm.py --order-ab [--json bench/results/qgemm_order.json]

--tiles-ab: the quantized GEMM alone at M = 8, 32 and 128, its default tiles (8 rows on AVX-512 VNNI,
3 on AVX2) against tiles of 4 (kernels.qgemm_tile_rows), calls alternating, median ms of each.

--dense-stream: the dense bf16 GEMM (kernels/gemm.cpp) on every layer's weights (the model's,
dequantized), one pass through the layers' four GEMMs in order, so each weight comes from memory as
in a decode step, at M = 1, 32 and 128: best of 5 passes, ms and GB/s of weights read; beside it the
same GEMMs hot in cache (each of the first layer's, repeated back to back) times the layers.

--blocks: the layers' GEMMs (every layer's, one pass in order, so each weight comes from memory as in
a decode step) at M = 1, 8, 32, 128 and 512, three ways taking turns: the quantized GEMM (--weights
native), the dense bf16 GEMM on bf16 panels, and the same dense GEMM on the weights kept in their
GGUF blocks (kernels/qdense.cpp, what --weights dense runs where the tile unit does; its bits are
checked against the panels'); median ms of 9 passes each, and the bytes each reads.

--order-ab: instead, the quantized GEMM alone at M = 1, 32, 128 and 512: its default (big weights
group by group, the next task's panels prefetched) against chunk by chunk with no prefetch
(kernels.qgemm_order), calls alternating, median ms of each. Here each weight is hot in cache
after the first call; in a decode step it comes from memory (step_profile.py --paired-order-ab).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from isolab import kernels
from isolab.models.bundle import load_bundle
from isolab.models.linear import QuantWeight


def per_call_ms(fn, x: torch.Tensor) -> float:
    fn(x)
    reps = max(3, int(2e8 // max(1, x.numel() * 1000)))  # about the same work for every M
    reps = min(reps, 200)
    t = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - t) / reps * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--order-ab", action="store_true")
    ap.add_argument("--tiles-ab", action="store_true")
    ap.add_argument("--dense-stream", action="store_true")
    ap.add_argument("--blocks", action="store_true")
    args = ap.parse_args()
    m = load_bundle(args.model, "bf16", weights="native").model
    if args.blocks:
        return blocks(m, args.model, Path(args.json or "bench/results/dense_blocks.json"))
    if args.dense_stream:
        return dense_stream(m, args.model, Path(args.json or "bench/results/dense_stream.json"))
    if args.order_ab:
        return order_ab(m, args.model, Path(args.json or "bench/results/qgemm_order.json"))
    if args.tiles_ab:
        return tiles_ab(m, args.model, Path(args.json or "bench/results/qgemm_tiles.json"))
    rows = []
    for name, w, k in quantized_weights(m):
        dense = kernels.pack_weight(torch.from_numpy(w_dense(w)).to(torch.bfloat16))
        for mm in (1, 32, 512):
            if name == "lm_head" and mm == 512:
                continue
            x = torch.randn(mm, k).to(torch.bfloat16)
            q = per_call_ms(w, x)
            d = per_call_ms(lambda a, dense=dense, n=w.n: kernels.gemm(a, dense, n), x)
            rows.append({"weight": name, "format": w.qtype, "n": w.n, "k": k, "m": mm, "qgemm_ms": round(q, 4),
                         "dense_bf16_ms": round(d, 4), "dense_over_qgemm": round(d / q, 2)})
            print(f"{name:10s} {w.qtype:6s} {w.n:6d}x{k:<5d} M={mm:<4d} qgemm {q:8.3f} ms  bf16 {d:8.3f} ms  "
                  f"{d / q:5.2f}x", flush=True)
    out = {"model": str(args.model or "smollm2-135m-instruct"), "threads": torch.get_num_threads(),
           "qgemm_isa": kernels.qgemm_isa(), "gemm_isa": kernels.gemm_isa(), "rows": rows}
    target = Path(args.json or "bench/results/qgemm.json")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=1))
    return 0


def quantized_weights(m) -> list[tuple[str, QuantWeight, int]]:
    """The first layer's quantized GEMMs and the vocabulary head: (name, weight, K)."""
    layer = m.layers[0]
    named = (("wqkv", layer.wqkv), ("wo", layer.wo), ("w_gate_up", layer.w_gate_up), ("w_down", layer.w_down),
             ("lm_head", m.lm_head))
    return [(name, w, w.packed.shape[1] * 32) for name, w in named if isinstance(w, QuantWeight) and w.packed is not None]


def alternate(w, x: torch.Tensor, setting, a, b, reps: int) -> tuple[float, float]:
    """Median ms of w(x) with setting(a) and with setting(b), calls alternating (one warm call each)."""
    ms: dict[int, list[float]] = {0: [], 1: []}
    for i in range(2 * reps + 2):
        setting(b if i % 2 else a)
        t = time.perf_counter()
        w(x)
        if i >= 2:
            ms[i % 2].append((time.perf_counter() - t) * 1e3)
    return statistics.median(ms[0]), statistics.median(ms[1])


def tiles_ab(m, model: str | None, target: Path) -> int:
    rows = []
    dr = kernels.qgemm_default_tile_rows()  # the build's default: 8 on AVX-512 VNNI, 3 on AVX2
    try:
        for name, w, k in quantized_weights(m):
            for mm in (8, 32, 128):
                x = torch.randn(mm, k).to(torch.bfloat16)
                reps = min(200, max(8, int(4e9 // (mm * w.n * k))))
                four, default = alternate(w, x, kernels.qgemm_tile_rows, 4, 0, reps)
                rows.append({"weight": name, "format": w.qtype, "n": w.n, "k": k, "m": mm, "calls_each": reps,
                             "tiles4_ms": round(four, 4), f"tiles{dr}_ms": round(default, 4),
                             "speedup": round(four / default, 3),
                             f"gmac_s_tiles{dr}": round(mm * w.n * k / default / 1e6, 1)})
                print(f"{name:10s} {w.qtype:6s} {w.n:6d}x{k:<5d} M={mm:<4d} tiles of 4 {four:8.3f} ms  "
                      f"of {dr} {default:8.3f} ms  {four / default:5.2f}x", flush=True)
    finally:
        kernels.qgemm_tile_rows()
    out = {"model": str(model or "smollm2-135m-instruct"), "threads": torch.get_num_threads(),
           "qgemm_isa": kernels.qgemm_isa(), "default_tile_rows": dr, "rows": rows}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=1))
    return 0


def order_ab(m, model: str | None, target: Path) -> int:
    rows = []
    try:
        for name, w, k in quantized_weights(m):
            for mm in (1, 32, 128, 512):
                x = torch.randn(mm, k).to(torch.bfloat16)
                reps = min(200, max(8, int(4e9 // (mm * w.n * k))))
                off, on_ = alternate(w, x, kernels.qgemm_order, False, True, reps)
                rows.append({"weight": name, "format": w.qtype, "n": w.n, "k": k, "m": mm, "calls_each": reps,
                             "chunk_by_chunk_ms": round(off, 4), "default_ms": round(on_, 4),
                             "saving": round(1 - on_ / off, 4)})
                print(f"{name:10s} {w.qtype:6s} {w.n:6d}x{k:<5d} M={mm:<4d} chunk by chunk {off:8.3f} ms  "
                      f"default {on_:8.3f} ms  {1 - on_ / off:+6.1%}", flush=True)
    finally:
        kernels.qgemm_order(True)
    out = {"model": str(model or "smollm2-135m-instruct"), "threads": torch.get_num_threads(),
           "qgemm_isa": kernels.qgemm_isa(), "rows": rows}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=1))
    print(f"wrote {target}")
    return 0


def dense_stream(m, model: str | None, target: Path) -> int:
    layers = []
    for layer in m.layers:
        ws = [w for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down) if isinstance(w, QuantWeight)]
        layers.append([(kernels.pack_weight(torch.from_numpy(w_dense(w)).to(torch.bfloat16)), w.n) for w in ws])
    nbytes = sum(p.numel() * 2 for ws in layers for p, _ in ws)
    rows = []
    for mm in (1, 32, 128):
        xs = {p.shape[1] * 2: torch.randn(mm, p.shape[1] * 2).to(torch.bfloat16) for ws in layers for p, _ in ws}

        def one_pass(ws_list, xs=xs) -> float:
            t = time.perf_counter()
            for ws in ws_list:
                for p, n in ws:
                    kernels.gemm(xs[p.shape[1] * 2], p, n)
            return time.perf_counter() - t

        one_pass(layers)
        streamed = min(one_pass(layers) for _ in range(5))
        # the first layer's GEMMs, each repeated back to back (in cache after its first call), times the layers
        hot = sum(min(one_pass([[w]] * 20) for _ in range(5)) / 20 for w in layers[0]) * len(layers)
        rows.append({"m": mm, "streamed_ms": round(streamed * 1e3, 3), "gb_s": round(nbytes / streamed / 1e9, 2),
                     "hot_ms": round(hot * 1e3, 3)})
        print(f"M={mm:<4d} streamed {streamed * 1e3:7.2f} ms ({nbytes / streamed / 1e9:5.1f} GB/s of {nbytes / 1e6:.0f} MB)"
              f"   hot {hot * 1e3:7.2f} ms", flush=True)
    out = {"model": str(model or "smollm2-135m-instruct"), "threads": torch.get_num_threads(),
           "gemm_isa": kernels.gemm_isa(), "weight_mb": round(nbytes / 1e6, 1), "rows": rows}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=1))
    print(f"wrote {target}")
    return 0


def blocks(m, model: str | None, target: Path) -> int:
    from isolab.models.gguf_loader import load_gguf
    from isolab.models.linear import BlockWeight
    from isolab.models.llama import LlamaModel
    from isolab.models.locate import resolve_model_path

    if kernels.qdense_isa() != "amx":
        print(f"dense weights stay in blocks only where the tile unit runs; this CPU's path is {kernels.qdense_isa()!r}")
        return 0
    # the layers' weights three ways, each as the engine builds it: native records, dense bf16 panels,
    # dense blocks
    path = resolve_model_path(model)
    panels_m = LlamaModel(load_gguf(path), "bf16", weights="dense", dense_blocks=False)
    blocks_m = LlamaModel(load_gguf(path), "bf16", weights="dense", dense_blocks=True)

    def layer_weights(model_: LlamaModel) -> list:
        return [w for L in model_.layers for w in (L.wqkv, L.wo, L.w_gate_up, L.w_down)]

    triples = [t for t in zip(layer_weights(m), layer_weights(panels_m), layer_weights(blocks_m), strict=True)
               if isinstance(t[0], QuantWeight) and isinstance(t[2], BlockWeight)]  # (native, panels, blocks)
    nbytes = {"native": sum(w.nbytes for w, _, _ in triples), "panels": sum(p.nbytes for _, p, _ in triples),
              "blocks": sum(b.nbytes for _, _, b in triples)}
    kinds = {"native": 0, "panels": 1, "blocks": 2}

    def k_of(t: tuple) -> int:
        return t[0].packed.shape[1] * 32
    rows_out = []
    for mm in (1, 8, 32, 128, 512):
        xs = {k: torch.randn(mm, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
              for k in {k_of(t) for t in triples}}
        for t in triples[:4]:  # the same bits as the panels (and the start-up check's own comparison)
            assert torch.equal(t[2](xs[k_of(t)]).view(torch.int16), t[1](xs[k_of(t)]).view(torch.int16))

        def one_pass(kind: str, xs=xs) -> float:
            i = kinds[kind]
            t0 = time.perf_counter()
            for t in triples:
                t[i](xs[k_of(t)])
            return (time.perf_counter() - t0) * 1e3

        ms: dict[str, list[float]] = {k: [] for k in kinds}
        for kind in kinds:
            one_pass(kind)
        for _ in range(9):
            for kind in kinds:
                ms[kind].append(one_pass(kind))
        med = {k: statistics.median(v) for k, v in ms.items()}
        rows_out.append({"m": mm, **{f"{k}_ms": round(v, 3) for k, v in med.items()},
                         "blocks_over_panels": round(med["panels"] / med["blocks"], 3),
                         "blocks_over_native": round(med["native"] / med["blocks"], 3)})
        print(f"M={mm:<4d} native {med['native']:8.2f} ms   dense panels {med['panels']:8.2f} ms   dense blocks "
              f"{med['blocks']:8.2f} ms   (blocks {med['panels'] / med['blocks']:.2f}x panels, "
              f"{med['native'] / med['blocks']:.2f}x native)", flush=True)
    out = {"model": str(model or "smollm2-135m-instruct"), "threads": torch.get_num_threads(),
           "gemm_isa": kernels.gemm_isa(), "qgemm_isa": kernels.qgemm_isa(), "qdense_isa": kernels.qdense_isa(),
           "layers_weight_mb": {k: round(v / 1e6, 1) for k, v in nbytes.items()}, "passes": 9, "rows": rows_out}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=1))
    print(f"wrote {target}")
    return 0


def w_dense(w: QuantWeight):
    """The weight's values (N, K) fp32, read back from its records."""
    import numpy as np

    from isolab.kernels import quant

    return quant.dequantize_rows(w.packed, w.fmt, w.fp16, np.arange(w.n), w.packed.shape[1] * 32)


if __name__ == "__main__":
    raise SystemExit(main())
