"""Owns the benchmark workload: N text prompts with length distributions and shared prefixes.

The same workload drives the engine bench, Hugging Face's batched generate, and the HTTP bench,
so the three are measured on identical prompts. Deterministic for a given seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = (
    "the of and to in is that for it as with was on be by at this are from or have an they which one you "
    "were all we when there can more if will each about how up out them then she many some so these would "
    "other into has two like him see time could no make than first been its who now people my made over "
    "did down only way find use may water long little very after words called just where most know get "
    "through back much before go good new write our used me man too any day same right look think also "
    "around another came come work three word must because does part even place well such here take why "
    "things help put years different away again off went old number great tell men say small every found "
    "still between name should home big give air line set own under read last never us left end along while "
    "might next sound below saw something thought both few those always looked show large often together "
    "asked house don't world going want school important until form food keep children feet land side "
    "without boy once animals life enough took sometimes four head above kind began almost live page got "
    "earth need far hand high year mother light parts country father let night following picture being "
    "study second eyes soon times story boys since white days ever paper hard near sentence better best "
    "across during today others sure means knew it's try told young miles sun ways thing whole hear example "
    "heard several change answer room sea against top turned learn point city play toward five using himself "
    "usually money seen didn't car morning i'm body upon family later turn move face door cut done group true"
).split()


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 32
    prompt_len: tuple[int, int] = (64, 256)  # words, uniform in [lo, hi]
    output_len: tuple[int, int] = (128, 128)  # new tokens, uniform in [lo, hi]
    shared_prefix_len: int = 0  # words of a prefix shared by `shared_fraction` of the prompts
    shared_fraction: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class Workload:
    prompts: list[str]
    max_tokens: list[int]
    spec: WorkloadSpec


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_workload(spec: WorkloadSpec) -> Workload:
    rng = random.Random(spec.seed)
    prefix = _words(rng, spec.shared_prefix_len) if spec.shared_prefix_len else ""
    prompts, outs = [], []
    for _ in range(spec.num_requests):
        body = _words(rng, rng.randint(*spec.prompt_len))
        shared = prefix and rng.random() < spec.shared_fraction
        prompts.append(f"{prefix} {body}" if shared else body)
        outs.append(rng.randint(*spec.output_len))
    return Workload(prompts, outs, spec)
