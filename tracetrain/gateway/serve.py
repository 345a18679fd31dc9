"""`tracetrain serve`: run the gateway with uvicorn on a SQLite store and one engine.

    python -m tracetrain.gateway.serve --db runs/gw.db --admin-key $KEY \\
        --engine upstream --upstream-url http://127.0.0.1:8000 --model Qwen/Qwen2.5-0.5B \\
        --tokenizer /path/to/tokenizer --max-context 4096
    python -m tracetrain.gateway.serve --db runs/gw.db --engine local --model-path out/tiny

It prints TRACETRAIN_GATEWAY_URL=http://HOST:PORT on stdout once the socket accepts connections
(a client may connect the moment it reads the line).
The admin key comes from --admin-key or $TRACETRAIN_ADMIN_KEY. uvicorn runs with uvloop/httptools
when installed and without an access log (--access-log turns it on; it never prints headers, and
keys never appear in paths). `ThreadedServer` runs an app on 127.0.0.1 in a background thread
(tests, the embedded trainer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import socket
import sys
import threading
from typing import Any

import uvicorn

from tracetrain.gateway.app import Gateway, create_app
from tracetrain.gateway.inprocess import MIN_ADMIN_KEY_CHARS, is_loopback, listen_socket
from tracetrain.store import SQLiteStore


def uvicorn_config(
    app: Any, *, access_log: bool = False, log_level: str = "warning", **kw
) -> uvicorn.Config:
    """Fast settings: uvloop + httptools when installed ("auto"), no access log, no extra headers."""
    return uvicorn.Config(
        app,
        loop="auto",
        http="auto",
        access_log=access_log,
        log_level=log_level,
        server_header=False,
        date_header=False,
        proxy_headers=False,  # the gateway is not behind a proxy unless you put it there
        timeout_graceful_shutdown=5,
        **kw,
    )


class ReadyServer(uvicorn.Server):
    """A uvicorn server that prints `ready_line` (flushed) once its sockets accept connections:
    after the app's startup and listen(), not before."""

    def __init__(self, config: uvicorn.Config, ready_line: str):
        super().__init__(config)
        self.ready_line = ready_line

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            print(self.ready_line, flush=True)


class ThreadedServer:
    """Serve `app` on 127.0.0.1 (a free port unless given) in a background thread.

    with ThreadedServer(app) as server:
        httpx.get(server.url + "/health")
    """

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, **config):
        self.sock = listen_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, **config))
        self.thread = threading.Thread(target=self._run, name="tracetrain-gateway", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve(sockets=[self.sock]))
        except BaseException as e:  # surfaced by start()
            self.error = e

    def start(self, timeout: float = 30.0) -> ThreadedServer:
        self.thread.start()
        for _ in range(int(timeout / 0.01)):
            if self.server.started or self.error is not None or not self.thread.is_alive():
                break
            threading.Event().wait(0.01)
        if not self.server.started:
            self.stop()
            raise RuntimeError(f"gateway did not start: {self.error!r}")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=30)
        self.sock.close()

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def upstream_factory(spec: dict[str, Any], gw: Gateway):
    """Build an UpstreamEngine from a registration spec (see schemas.RegisterEngineIn)."""
    from tracetrain.engines.upstream import UpstreamEngine

    default = gw.slots[gw.default_engine].engine
    tok = _load_tokenizer(spec["tokenizer"]) if spec.get("tokenizer") else default.tokenizer
    max_context = spec.get("max_context") or default.max_context
    return UpstreamEngine(
        spec["base_url"], spec["model"], tok, name=spec["name"], max_context=max_context
    )


def _build_engine(args: argparse.Namespace):
    if args.engine == "upstream":
        from tracetrain.engines.upstream import UpstreamEngine

        tok = _load_tokenizer(args.tokenizer)
        max_context = args.max_context or tok.model_max_length
        if not max_context or max_context > 10_000_000:
            sys.exit(
                "serve: --max-context is needed: the tokenizer does not say its context length"
            )
        return UpstreamEngine(
            args.upstream_url, args.model, tok, name=args.engine_name, max_context=max_context
        )
    from tracetrain.engines.local import LocalEngine
    from tracetrain.models.compute import on_compute
    from tracetrain.models.tiny import load_tiny

    model, tok = on_compute(0, load_tiny, args.model_path)  # where it decodes (models/compute.py)
    kwargs = {"max_context": args.max_context} if args.max_context else {}
    return LocalEngine(model, tok, name=args.engine_name, **kwargs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tracetrain serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--db", required=True, help="SQLite file (created if missing)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0: a free port (printed on stdout)")
    p.add_argument(
        "--admin-key",
        default=os.environ.get("TRACETRAIN_ADMIN_KEY"),
        help="admin key (default: $TRACETRAIN_ADMIN_KEY)",
    )
    p.add_argument("--engine", choices=["upstream", "local"], required=True)
    p.add_argument("--engine-name", default="default", help="name rollouts use for this engine")
    p.add_argument(
        "--upstream-url", help="upstream: OpenAI-compatible server, e.g. http://127.0.0.1:8000"
    )
    p.add_argument("--model", help="upstream: model name the server serves")
    p.add_argument("--tokenizer", help="upstream: tokenizer directory (chat template included)")
    p.add_argument("--model-path", help="local: model + tokenizer directory")
    p.add_argument(
        "--max-context", type=int, help="prompt + max_tokens limit (default: tokenizer's)"
    )
    p.add_argument("--max-body-bytes", type=int, default=8 << 20)
    p.add_argument(
        "--pause-wait-s", type=float, default=60.0, help="how long requests wait while paused"
    )
    p.add_argument(
        "--public-url", help="base URL agents reach this gateway at (default: request's)"
    )
    p.add_argument(
        "--durability",
        choices=["process", "power"],
        default="process",
        help="process: survive kill -9 (synchronous=NORMAL); power: also power loss (FULL)",
    )
    p.add_argument(
        "--context",
        choices=["exact", "template"],
        default="exact",
        help="exact: a turn's prompt is the ids of the turn it follows plus the new messages; "
        "template: the chat template's full render every time (docs/gateway.md)",
    )
    p.add_argument(
        "--tool-parser",
        default="auto",
        help="format of the model's tool calls: auto (from the chat template; a template that "
        "drops tools gets them in the system message, as hermes), hermes, llama3_json, mistral, "
        "off (auto without the tool block); gateway/tool_calls.py",
    )
    p.add_argument(
        "--forced-tool-choice",
        choices=["refuse", "as_auto"],
        default="refuse",
        help="a tool_choice that forces a call where it cannot be enforced (an engine that "
        "cannot constrain decoding: local, SGLang): refuse with a 400, or generate it as auto "
        "(smolagents' ToolCallingAgent sends 'required')",
    )
    p.add_argument("--access-log", action="store_true")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    if not args.admin_key:
        p.error("an admin key is needed: --admin-key or $TRACETRAIN_ADMIN_KEY")
    if not is_loopback(args.host) and len(args.admin_key.strip()) < MIN_ADMIN_KEY_CHARS:
        p.error(f"--host {args.host} is not loopback: the admin key must have at least "
                f"{MIN_ADMIN_KEY_CHARS} characters")
    from tracetrain.gateway.tool_calls import PARSERS

    if args.tool_parser not in ("auto", "off") and args.tool_parser not in PARSERS:
        p.error(f"--tool-parser {args.tool_parser!r} is unknown; known: auto, off, "
                f"{', '.join(PARSERS)}")
    if args.engine == "upstream":
        missing = [f for f in ("upstream_url", "model", "tokenizer") if not getattr(args, f)]
        if missing:
            p.error(
                "--engine upstream needs " + ", ".join("--" + m.replace("_", "-") for m in missing)
            )
    elif not args.model_path:
        p.error("--engine local needs --model-path")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    store = SQLiteStore(args.db, synchronous="FULL" if args.durability == "power" else "NORMAL")
    try:
        engine = _build_engine(args)
        app = create_app(
            store,
            {args.engine_name: engine},
            admin_key=args.admin_key,
            max_body_bytes=args.max_body_bytes,
            pause_wait_s=args.pause_wait_s,
            public_url=args.public_url,
            engine_factory=upstream_factory,
            close_engines=True,
            context=args.context,
            tool_parser=args.tool_parser,
            forced_tool_choice=args.forced_tool_choice,
        )
        sock = listen_socket(args.host, args.port)
        host, port = sock.getsockname()[:2]
        config = uvicorn_config(app, access_log=args.access_log, log_level=args.log_level)
        # Everything built so far (torch, transformers, the tokenizer: ~10^5-10^6 objects) lives
        # as long as the process: keep it out of the cyclic GC, whose full passes over it took
        # ~0.3 s each and showed up as p99 latency.
        gc.collect()
        gc.freeze()
        # What a request allocates (its messages as dicts, the validated body) is freed by
        # reference counting; the collector, run every 700 net allocations by default, found
        # nothing to free in serving and cost ~0.1 ms per request at 32 turns of history
        # (bench/bench_context.py): run it ~30x less often.
        gc.set_threshold(20_000, 20, 20)
        serving = contextlib.nullcontext()
        if args.engine == "local":  # its compute thread has the one OpenMP team (models/compute.py)
            from tracetrain.models.compute import one_thread_here

            serving = one_thread_here()
        with serving:
            ReadyServer(config, f"TRACETRAIN_GATEWAY_URL=http://{host}:{port}").run(sockets=[sock])
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
