"""Owns scale-out: N engine replicas on Ray Serve behind one OpenAI API (`isolab serve --replicas N`).

    router.py       which replica: (tenant scope, leading prompt blocks) affinity, load balance; pure
    replica.py      one replica: an LLMEngine + EngineLoop in a Ray Serve actor
    wire.py         what crosses between them (plain data, errors rebuilt)
    replica_set.py  the ingress's side: routes, streams, watches replicas, per-replica metrics
    deploy.py       Ray and Serve: start, join, tear down
    ingress.py      the app over the replicas (server.app.create_app_over)

Ray is an optional extra (`pip install 'isolab[ray]'`); nothing here imports it until deploy().
"""

from isolab.scaleout.deploy import RAY_MISSING, ScaleOut, ScaleOutError, require_ray
from isolab.scaleout.router import POLICIES, Router, RoutingConfig

__all__ = ["POLICIES", "RAY_MISSING", "Router", "RoutingConfig", "ScaleOut", "ScaleOutError", "require_ray"]
