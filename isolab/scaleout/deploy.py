"""Owns starting and stopping the replicas on Ray Serve: Ray (local or joined), one Serve app per replica.

    deploy(engine config, ScaleOut) -> (ReplicaSet, ReplicaFacts)
      ray.init(address or a local instance) -> serve.start(no HTTP proxy: isolab's own app is the API)
      -> serve.run_many: apps isolab-ID-replica-0..N-1 (ID: this server's), each one EngineReplica;
         Serve restarts a dead one; two isolab servers on one cluster never touch each other's apps
      -> replica 0's facts (tokenizer path, limits, numerics) for the ingress

One app per replica (not one deployment of N replicas behind Serve's own router): the ingress picks
the replica itself, by tenant scope and prefix (router.py), and Serve keeps each one alive.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from isolab.config import EngineConfig
from isolab.errors import IsolabError
from isolab.scaleout.replica import EngineReplica
from isolab.scaleout.replica_set import ReplicaSet
from isolab.scaleout.router import Router, RoutingConfig
from isolab.scaleout.wire import ReplicaFacts

log = logging.getLogger("isolab.scaleout")

RAY_MISSING = ("--replicas needs Ray Serve, an optional extra: pip install 'isolab[ray]' "
               "(or `make setup`, which installs it)")


class ScaleOutError(IsolabError):
    """Ray is missing, or the replicas could not be started."""


MAX_REPLICAS_JOINED = 1024


@dataclass(frozen=True)
class ScaleOut:
    replicas: int
    threads_per_replica: int  # torch / OpenMP threads in each replica
    ray_address: str | None = None  # None: a local Ray instance, started here and stopped with the server;
    #   else a cluster to join (auto, HEAD_IP:6379); not ray:// (Ray Client cannot stream from Serve handles)
    cpus_per_replica: float | None = None  # Ray's logical CPUs a replica asks for (None: its threads)
    gpus_per_replica: float = 0.0  # Ray GPUs a replica asks for (its engine then picks cuda)
    routing: RoutingConfig = dataclasses.field(default_factory=RoutingConfig)
    health_check_period_s: float = 2.0
    poll_s: float = 0.5

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ScaleOutError(f"--replicas must be at least 1, not {self.replicas}")
        if self.threads_per_replica < 1:
            raise ScaleOutError(f"--replica-threads must be at least 1, not {self.threads_per_replica}")
        if self.cpus_per_replica is not None and not 0 < self.cpus_per_replica < math.inf:
            raise ScaleOutError(f"--replica-cpus must be more than 0, not {self.cpus_per_replica}")
        if not 0 <= self.gpus_per_replica < math.inf:
            raise ScaleOutError(f"--replica-gpus must be 0 or more, not {self.gpus_per_replica}")
        # each replica is an engine process with its own KV pool; 100,000 of them took the machine's memory
        joined = self.ray_address not in (None, "local")
        most = MAX_REPLICAS_JOINED if joined else max(8, 4 * (os.cpu_count() or 1))
        if self.replicas > most:
            where = "on a joined cluster" if joined else \
                (f"on this machine's own Ray (4 a core, at least 8; {os.cpu_count()} cores here): join a cluster "
                 "with --ray-address for more")
            raise ScaleOutError(f"--replicas {self.replicas} is more than {most} {where}")


def require_ray() -> Any:
    try:
        from ray import serve
    except ImportError:
        raise ScaleOutError(RAY_MISSING) from None
    return serve


def deploy(config: EngineConfig, plan: ScaleOut, capacity_per_replica: int) -> tuple[ReplicaSet, ReplicaFacts]:
    serve = require_ray()
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
    if plan.ray_address is not None and plan.ray_address.startswith("ray://"):
        raise ScaleOutError("--ray-address ray://... (Ray Client) cannot stream from Serve replicas: run isolab serve "
                            "on a node of the cluster with --ray-address auto (or HEAD_IP:6379)")
    if plan.ray_address not in (None, "auto", "local") and not ray.is_initialized():
        _check_reachable(plan.ray_address)  # (ray.init waited forever on an address with nothing behind it)
    # local: a Ray instance of our own, stopped with the server; joined: only our apps are ever removed
    local = plan.ray_address is None and not ray.is_initialized()
    prefix = f"isolab-{uuid.uuid4().hex[:8]}-replica-"
    try:
        if local:
            # Logical CPUs: enough for every replica here (on this machine they share its cores; say so).
            need = plan.replicas * (plan.cpus_per_replica or plan.threads_per_replica)
            ray.init(num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), include_dashboard=False,
                     configure_logging=False, log_to_driver=False)
        elif not ray.is_initialized():
            ray.init(address=plan.ray_address, configure_logging=False, log_to_driver=False)
    except Exception as exc:
        raise ScaleOutError(f"Ray did not start{'' if local else f' at {plan.ray_address!r}'} "
                            f"({type(exc).__name__}: {str(exc)[:300]})") from None
    try:
        serve.start(proxy_location="Disabled")
        cpus = plan.cpus_per_replica if plan.cpus_per_replica is not None else float(plan.threads_per_replica)
        actor_options: dict[str, Any] = {
            "num_cpus": cpus, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(plan.threads_per_replica)}}}
        if plan.gpus_per_replica:
            actor_options["num_gpus"] = plan.gpus_per_replica
        deployment = serve.deployment(
            # room for every request the ingress admits (affinity may send them all to one replica),
            # plus its stats, abort and health calls
            EngineReplica, name="engine", num_replicas=1, max_ongoing_requests=capacity_per_replica * plan.replicas + 32,
            health_check_period_s=plan.health_check_period_s, health_check_timeout_s=30.0,
            graceful_shutdown_timeout_s=5.0, max_constructor_retry_count=2,
            ray_actor_options=actor_options,
            logging_config={"log_level": "WARNING", "enable_access_log": False},
        )
        targets = [serve.RunTarget(deployment.bind(_for_replica(config, i), i, plan.threads_per_replica),
                                   name=f"{prefix}{i}", route_prefix=None) for i in range(plan.replicas)]
        if not local:  # (a joined cluster without room kept the server waiting without a word)
            _say_if_no_room(ray.available_resources(), plan.replicas, cpus, plan.gpus_per_replica)
        handles = serve.run_many(targets, wait_for_applications_running=False)
        _wait_running(serve, [t.name for t in targets])
        facts: ReplicaFacts = handles[0].facts.remote().result(timeout_s=300)
    except BaseException as exc:  # a Ctrl-C while replicas start too: on a joined cluster they would outlive us
        _teardown(prefix, local)
        if isinstance(exc, IsolabError) or not isinstance(exc, Exception):
            raise
        raise ScaleOutError(f"the engine replicas did not start ({type(exc).__name__}: {str(exc)[:300]})") from exc
    replicas = ReplicaSet(handles, Router(plan.replicas, dataclasses.replace(plan.routing,
                                                                              block_size=config.cache.block_size)),
                          poll_s=plan.poll_s, on_shutdown=lambda: _teardown(prefix, local),
                          cluster_gone=_local_ray_died if local else lambda: False)
    log.info("%d engine replica(s) on Ray Serve, %d thread(s) each, routing %s", plan.replicas,
             plan.threads_per_replica, plan.routing.policy)
    return replicas, facts


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """HOST:PORT of a Ray cluster's head answers a TCP connect, or one sentence now."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ScaleOutError(f"--ray-address {address!r}: give HOST:PORT of the cluster's head (e.g. 10.0.0.5:6379) "
                            "or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ScaleOutError(f"--ray-address {address!r}: nothing answers there ({exc.strerror or exc}): is the "
                            "cluster's head running (`ray start --head`), and is this its GCS port?") from None


def _say_if_no_room(free: dict[str, float], replicas: int, cpus: float, gpus: float) -> None:
    """One warning when a joined cluster has fewer free CPUs/GPUs than the replicas ask for: Serve then
    waits for nodes to join or free up (an autoscaler's), and the server would wait without a word."""
    short = [f"{replicas} x {per:g} {kind} = {replicas * per:g} {kind} (free: {free.get(kind, 0.0):g})"
             for kind, per in (("CPU", cpus), ("GPU", gpus)) if per and free.get(kind, 0.0) < replicas * per]
    if short:
        log.warning("the cluster has no room for the replicas yet: they need %s; they start when nodes join or "
                    "free up (Ctrl-C stops; or lower --replicas, --replica-cpus, --replica-gpus)", "; ".join(short))


def _wait_running(serve: Any, names: list[str], *, say_every_s: float = 30.0, poll_s: float = 0.25,
                  clock: Any = time.monotonic, sleep: Any = time.sleep) -> None:
    """Until every app is RUNNING; what Serve says of one still waiting is logged every say_every_s (its
    controller's own warnings, e.g. "taken more than 30s to be scheduled ... resources required",
    stay in the cluster's logs), and a failed one ends the start in one sentence."""
    said = clock()
    while True:
        apps = serve.status().applications
        waiting = []
        for name in names:
            replica = name.rsplit("-", 1)[-1]
            app = apps.get(name)
            if app is None:  # (what Serve's own wait raises on, too)
                raise ScaleOutError(f"replica {replica}'s Serve app is gone while it started (deleted from outside?)")
            status = getattr(app.status, "value", app.status)  # ApplicationStatus: a str enum
            if status == "RUNNING":
                continue
            details = [d.message for d in app.deployments.values() if d.message] or \
                [app.message or f"{status} (Serve has given no reason yet)"]
            if status == "DEPLOY_FAILED":  # (Serve's own wait fails on this one only: UNHEALTHY may recover)
                raise ScaleOutError(f"replica {replica} failed to start: {_reason(details[0])}")
            waiting.append(details[0])
        if not waiting:
            return
        if clock() - said >= say_every_s:
            said = clock()
            log.warning("%d of %d replica(s) not running yet: %s", len(waiting), len(names), waiting[0][:400])
        sleep(poll_s)


def _reason(message: str) -> str:
    """A failed deployment's message in a line: Serve's first sentence and the error its traceback ends
    with ("The deployment failed to start 3 times in a row. ... Error:\\n<traceback>"; the app's own
    message only says "Failed to update the deployments ['engine']")."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    if not lines:
        return "Serve gave no reason"
    first = lines[0].split(". ")[0].rstrip(".")
    return first if len(lines) == 1 else f"{first}: {lines[-1][:300]}"


def _for_replica(config: EngineConfig, index: int) -> EngineConfig:
    """Each replica its own trace file (two writers must not share one)."""
    if config.trace_path is None:
        return config
    return dataclasses.replace(config, trace_path=f"{config.trace_path}.replica{index}")


def _local_ray_died() -> bool:
    """Whether a process of the Ray instance this server started (GCS, raylet) has exited."""
    try:
        from ray._private import worker

        node = worker._global_node
        return node is not None and bool(node.dead_processes())
    except Exception:  # a private API: if it moved, ask the cluster as usual (bounded by shutdown's timeout)
        return False


def _teardown(prefix: str, local: bool) -> None:
    """Remove this server's apps; stop Serve and Ray only if they are this server's own instance."""
    import ray
    from ray import serve

    if local and _local_ray_died():  # a terminal's Ctrl-C reached Ray's processes too: nothing to ask
        ray.shutdown()
        return
    try:  # all at once, then wait (one by one takes seconds each)
        ours = [name for name in serve.status().applications if name.startswith(prefix)]
        for name in ours:
            serve.delete(name, _blocking=False)
        deadline = time.monotonic() + 30
        while ours and time.monotonic() < deadline and any(n in serve.status().applications for n in ours):
            time.sleep(0.2)
    except Exception:  # the cluster may be going away already
        log.warning("could not delete the replicas' Serve apps (%s*)", prefix)
    if local:
        serve.shutdown()
    ray.shutdown()  # joined: disconnects this driver only; the cluster and its other apps stay
