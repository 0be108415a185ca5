"""Owns the app over replicas: deploy them, then the same HTTP layer as one engine (create_app_over).

The ingress loads the tokenizer only (from the path replica 0 resolved; cached by the file's
fingerprint), never the weights: validation, chat templates and detokenization happen here, the
forward passes in the replicas.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI

from isolab.config import EngineConfig
from isolab.engine.grammar import GrammarCompiler
from isolab.models.bundle import family_template
from isolab.models.tokenizer import Tokenizer
from isolab.scaleout.deploy import ScaleOut, deploy
from isolab.scaleout.replica_set import ReplicaSet
from isolab.scaleout.wire import ReplicaFacts
from isolab.server.app import create_app_over
from isolab.server.backend import ModelFacts
from isolab.server.settings import ServerConfig, default_model_names
from isolab.server.tenants import TenantRegistry


def create_replicated_app(config: EngineConfig, plan: ScaleOut, tenants: TenantRegistry,
                          server_config: ServerConfig | None = None) -> tuple[FastAPI, ReplicaSet]:
    """Start the replicas and the app over them. Call `replicas.shutdown()` after the app stops."""
    server_config = server_config or ServerConfig()
    replicas, facts = deploy(config, plan, config.scheduler.max_num_seqs + server_config.max_queue)
    try:
        app = create_app_over(replicas, model_facts(facts, plan.replicas, config.cache.kv_cache_dtype), tenants,
                              server_config)
    except BaseException:
        replicas.shutdown()
        raise
    return app, replicas


def model_facts(facts: ReplicaFacts, num_engines: int, kv_cache_dtype: str = "auto") -> ModelFacts:
    tokenizer = Tokenizer(Path(facts.path), facts.fingerprint, family_template(facts.arch))
    names = default_model_names(Path(facts.path), facts.name)
    return ModelFacts(tokenizer=tokenizer, default_names=names, max_model_len=facts.max_model_len,
                      max_num_seqs=facts.max_num_seqs, num_engines=num_engines,
                      grammars=GrammarCompiler(tokenizer, facts.vocab_size, facts.fingerprint),
                      numerics=facts.numerics, kv_cache_dtype=kv_cache_dtype)
