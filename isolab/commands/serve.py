"""Owns `isolab serve`: the OpenAI-compatible server on uvicorn, with keys, limits and a SIGTERM drain.

SIGTERM (or Ctrl-C): stop accepting, let running requests finish for up to --drain-timeout
seconds, then end what is left (an error event and [DONE]), stop the engine thread and exit 0.
With --replicas N the engines are Ray Serve replicas behind the same app (isolab.scaleout), torn
down after the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from isolab.commands.common import add_engine_args

if TYPE_CHECKING:
    from isolab.server.state import ServerState


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI API (completions, chat, models, health, metrics)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="API keys -> tenants: JSON {\"key\": \"tenant\"} or lines 'KEY TENANT' "
                        "(also read from ISOLAB_API_KEYS='key1=tenantA,key2=tenantB')")
    p.add_argument("--no-auth", action="store_true", help="serve without keys, as one anonymous tenant")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model id clients send, then aliases they may send instead (default: a slug of the "
                        "file name, e.g. smollm2-135m-instruct-q4_1, then the GGUF's general.name)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the GGUF's (as vLLM's flag)")
    g = p.add_argument_group("limits")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413 (1 MiB)")
    g.add_argument("--max-prompt-tokens", type=int, default=None, help="longer prompts get 400 (default: the context)")
    g.add_argument("--max-tokens-limit", type=int, default=4096, help="the largest max_tokens a request may ask")
    g.add_argument("--max-n", type=int, default=16, help="the largest n")
    g.add_argument("--max-queue", type=int, default=256,
                   help="engine requests admitted beyond --max-num-seqs; past that: 429 with Retry-After")
    g.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for running requests; then what is left is ended (an error event and [DONE])")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    r = p.add_argument_group("scale-out (Ray Serve: pip install 'isolab[ray]'; docs/scaleout.md)")
    r.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="N engine replicas as Ray Serve deployments behind this API (default: one in-process engine)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster from one of its nodes (auto, or HEAD_IP:6379; not ray://); default: start "
                        "a local Ray instance")
    r.add_argument("--replica-threads", type=int, default=None, metavar="T",
                   help="CPU threads per replica (default: this machine's cores / N, at least 1)")
    r.add_argument("--replica-cpus", type=float, default=None, metavar="C",
                   help="Ray logical CPUs each replica asks for (default: its threads)")
    r.add_argument("--replica-gpus", type=float, default=0.0, metavar="G",
                   help="Ray GPUs each replica asks for (0: CPU replicas)")
    r.add_argument("--routing", choices=("affinity", "least-loaded", "random"), default=None,
                   help="(default affinity) affinity: a request goes to the replica that holds its tenant's prefix unless that replica "
                        "is hot; least-loaded and random are baselines")
    add_engine_args(p)
    p.set_defaults(func=run)


def engine_config(args: argparse.Namespace) -> Any:
    from isolab.commands.common import llm_kwargs
    from isolab.config import build_engine_config

    return build_engine_config(**llm_kwargs(args))


def run(args: argparse.Namespace) -> int:
    from isolab.engine.llm_engine import LLMEngine
    from isolab.models.bundle import trim_heap
    from isolab.server import ServerConfig, create_app, load_registry

    # Keys and limits first: a misconfigured server refuses before spending seconds on the model.
    if not args.drain_timeout >= 0:
        from isolab.errors import InvalidRequestError

        raise InvalidRequestError(f"--drain-timeout must be 0 or more seconds, not {args.drain_timeout}",
                                  field="drain_timeout")
    _check_listen(args.host, args.port)
    tenants = load_registry(args.api_keys, no_auth=args.no_auth)
    config = ServerConfig(
        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit, max_n=args.max_n, max_queue=args.max_queue,
        served_model_names=tuple(args.served_model_name or ()),
        chat_template=_read_template(args.chat_template),
    )
    plan = _scale_out(args)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if plan is None:
        engine = LLMEngine(engine_config(args))
        app = create_app(engine, tenants, config)
        trim_heap()  # what loading and the start-up check freed goes back to the OS before serving
        _serve(app, args)
        engine.close()
        return 0
    from isolab.scaleout.ingress import create_replicated_app

    app, replicas = create_replicated_app(engine_config(args), plan, tenants, config)
    try:
        _serve(app, args)
    finally:
        clean = replicas.shutdown()
    if not clean:  # Ray's threads would keep the process alive, retrying a cluster that is gone
        logging.getLogger("isolab.server").warning("Ray did not shut down in 30 s; exiting without it")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _serve(app: Any, args: argparse.Namespace) -> None:
    from isolab.server.state import server_state

    # uvicorn cancels what is still open FLUSH_S after the drain: the engine has ended it by then
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                               timeout_graceful_shutdown=args.drain_timeout + DrainingServer.FLUSH_S, access_log=False)
    DrainingServer(uv_config, server_state(app), args.drain_timeout).run()


def _check_listen(host: str, port: int) -> None:
    """The address uvicorn will bind, tried now the way it binds (asyncio's create_server: every
    address the host resolves to, IPv6 sockets v6-only): a port out of range, a host that does not
    resolve or an address in use is one sentence before the model loads (uvicorn would take 70000
    as 4464, and report the rest with exit 3 after the load)."""
    import socket

    from isolab.errors import InvalidRequestError

    if not 0 <= port <= 65535:
        raise InvalidRequestError(f"--port must be between 0 and 65535, not {port}", field="port")

    async def try_bind() -> None:
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, host, port, reuse_address=True)
        server.close()
        await server.wait_closed()

    try:
        asyncio.run(try_bind())
    except (socket.gaierror, UnicodeError) as exc:
        raise InvalidRequestError(f"--host {host!r} does not resolve ({exc})", field="host") from None
    except OSError as exc:
        raise InvalidRequestError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", field="port") from None


def _scale_out(args: argparse.Namespace) -> Any:
    """The replicas' plan, or None for one in-process engine; a missing Ray is one sentence, at once."""
    if args.replicas is None:
        if args.ray_address or any(v is not None for v in (args.replica_threads, args.replica_cpus, args.routing)) or args.replica_gpus:
            from isolab.scaleout import ScaleOutError

            raise ScaleOutError("--ray-address, --routing and the --replica-* options need --replicas N")
        return None
    from isolab.scaleout import RoutingConfig, ScaleOut, ScaleOutError, require_ray

    require_ray()
    if args.replica_gpus and args.replica_gpus > 0 and not args.ray_address:
        import torch

        if not torch.cuda.is_available():  # a local Ray would wait for a GPU forever
            raise ScaleOutError("--replica-gpus asks for GPUs this machine does not have; give --ray-address to join "
                                "a cluster that has them, or leave it at 0")
    threads = args.replica_threads if args.replica_threads is not None else \
        max(1, (os.cpu_count() or 1) // max(1, args.replicas))  # (0 was taken as this default)
    from isolab.models.gguf_loader import check_model_file
    from isolab.models.locate import resolve_model_path

    check_model_file(resolve_model_path(args.model))  # here, in a sentence: a replica's error reached only Ray's log
    return ScaleOut(replicas=args.replicas, threads_per_replica=threads, ray_address=args.ray_address,
                    cpus_per_replica=args.replica_cpus, gpus_per_replica=args.replica_gpus, routing=RoutingConfig(policy=args.routing or "affinity"))


def _read_template(path: str | None) -> str | None:
    from isolab.errors import InvalidRequestError

    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"--chat-template {path!r} cannot be read ({exc.__class__.__name__})",
                                  field="chat_template") from None
    if not text.strip():  # it would render every conversation as an empty prompt
        raise InvalidRequestError(f"--chat-template {path!r} is empty: give a Jinja chat template, or leave the "
                                  "option out for the model's own", field="chat_template")
    return text


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that marks the app as draining on the first SIGTERM/SIGINT; uvicorn then
    stops accepting and waits up to timeout_graceful_shutdown for the responses in flight. A second
    signal cuts the drain short the same clean way (the engine ends what is left now: an error
    event and [DONE] each); only a third forces the exit (uvicorn's second Ctrl-C cancelled the
    responses mid-body, with tracebacks and plain-text 500s)."""

    FLUSH_S = 5.0  # after the drain, how long the ended requests' last events have to reach their clients

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_s: float) -> None:
        super().__init__(config)
        self.app_state = state
        self.drain_s = drain_s
        self.signals = 0

    def handle_exit(self, sig: int, frame: Any) -> None:
        # As uvicorn's own handler, minus re-raising the signal after shutdown: a completed drain
        # exits 0.
        self.signals += 1
        log = logging.getLogger("isolab.server")
        if self.signals == 1:
            log.info("signal %d: draining running requests", sig)
            self._end_leftovers(after_s=self.drain_s)
        elif self.signals == 2:
            log.info("signal %d again: ending the running requests now (a third signal forces the exit)", sig)
            self._end_leftovers(after_s=0.0)
        else:
            self.force_exit = True
        self.app_state.draining = True
        self.should_exit = True

    def _end_leftovers(self, after_s: float) -> None:
        """uvicorn cancels the responses still open at timeout_graceful_shutdown, which cuts a stream
        mid-body (no end, no [DONE]). So when the drain time is over the engine ends what is left
        itself, FLUSH_S before that: each stream then gets its error event ('the server is shutting
        down') and [DONE], a collected reply its error body."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        backend = self.app_state.engine_loop
        loop.call_later(after_s, lambda: backend.stop(timeout=0))
