"""Owns the step profiler: where one engine step's time goes, by phase, without touching the engine.

Timers are put around the phases' functions for the duration of a `with StepProfiler(engine)`
block and taken off after, so the engine's hot path carries no profiling code:

    step        LLMEngine.step, the whole step
    schedule    Scheduler.schedule
    prepare     ModelRunner.prepare (the step's index tensors: tokens, positions, slots, tables)
    gemm.NAME   each Weight by name (wqkv, wo, w_gate_up, w_down over all layers; lm_head)
    attention   PagedAttention.attend (write this step's K/V, read each row's keys)
    row_ops     the fused native row ops (RMSNorm, residual + RMSNorm, RoPE, SiLU * up) or their torch twins
    sample      the sampler (each request's generator, logprobs)
    update      Scheduler.update (commit and seal, num_computed_tokens, stop checks, finishing)
    other       step minus the phases above (embedding, the forward's glue, outputs)

Nested phases are subtracted from the phase around them only for `other`; GEMMs inside `forward`
are reported on their own. Times are wall-clock seconds summed over the steps profiled.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from isolab import kernels
from isolab.engine import model_runner
from isolab.engine.llm_engine import LLMEngine
from isolab.engine.model_runner import ModelRunner, PagedAttention
from isolab.engine.scheduler import Scheduler
from isolab.models.linear import BlockWeight, QuantWeight, Weight

ROW_OPS = ("rms_norm", "rms_norm_gemma", "add_rms_norm_", "silu_mul", "rope_")
TOP_PHASES = ("schedule", "prepare", "attention", "row_ops", "sample", "update")


class StepProfiler:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self._undo: list[tuple[Any, str, Any]] = []
        model = engine.model
        self._weight_names: dict[int, str] = {id(model.lm_head): "lm_head"}
        for layer in model.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                self._weight_names[id(getattr(layer, name))] = name

    def _wrap(self, owner: Any, attr: str, phase: str | Callable[..., str]) -> None:
        fn = getattr(owner, attr)
        seconds, calls = self.seconds, self.calls

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                key = phase(*a) if callable(phase) else phase
                seconds[key] += time.perf_counter() - t
                calls[key] += 1

        self._undo.append((owner, attr, owner.__dict__.get(attr, _MISSING)))
        setattr(owner, attr, timed)

    def __enter__(self) -> StepProfiler:
        # the one-call forward (forward.cpp) hides its parts: profile the per-op path, same bits
        self._undo.append((self.engine.model, "_fused", self.engine.model._fused))
        self.engine.model._fused = None
        self._wrap(LLMEngine, "step", "step")
        self._wrap(Scheduler, "schedule", "schedule")
        self._wrap(Scheduler, "update", "update")
        self._wrap(ModelRunner, "prepare", "prepare")
        self._wrap(PagedAttention, "attend", "attention")
        self._wrap(model_runner, "sample", "sample")
        # dense, quantized, and dense on blocks (a StackedWeight calls its parts)
        for cls in (Weight, QuantWeight, BlockWeight):
            self._wrap(cls, "__call__", lambda w, *_: "gemm." + self._weight_names.get(id(w), "other"))
        for name in ROW_OPS:
            if hasattr(kernels, name):
                self._wrap(kernels, name, "row_ops")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, old in reversed(self._undo):
            if old is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)
        self._undo.clear()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def report(self) -> dict[str, float]:
        """Milliseconds per step for each phase, `gemm` (all GEMMs) and `other`."""
        steps = self.calls["step"] or 1
        ms = {k: v * 1e3 / steps for k, v in self.seconds.items()}
        ms["gemm"] = sum(v for k, v in ms.items() if k.startswith("gemm."))
        ms["other"] = ms.get("step", 0.0) - ms["gemm"] - sum(ms.get(p, 0.0) for p in TOP_PHASES)
        ms["steps"] = float(self.calls["step"])
        return ms


_MISSING = object()
