"""The trainer's own gateway: where it listens, its admin key, the URL agents get, and uvicorn
serving it inside the running event loop (embedded runs).

Loopback (127.0.0.0/8, ::1, localhost) is the default. Any other address is a network boundary:
the admin key must be set by the operator ($TRACETRAIN_ADMIN_KEY, at least 16 characters), and
agents, wherever they run, call with their rollout's own key (the gateway has no keyless route but
/health).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import secrets
import socket
from contextlib import asynccontextmanager

import uvicorn

from tracetrain.config import WILDCARD_HOSTS, ConfigError, GatewayConfig

ADMIN_KEY_ENV = "TRACETRAIN_ADMIN_KEY"
MIN_ADMIN_KEY_CHARS = 16


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def admin_key_for(host: str, env=os.environ) -> str:
    """$TRACETRAIN_ADMIN_KEY; on loopback, a random key when it is unset. Off loopback it must be
    set (a ConfigError names gateway.host otherwise)."""
    key = env.get(ADMIN_KEY_ENV, "")
    if is_loopback(host):
        return key or secrets.token_urlsafe(24)
    if len(key.strip()) < MIN_ADMIN_KEY_CHARS:
        raise ConfigError(
            f"config key 'gateway.host': {host!r} is not a loopback address; a gateway reachable from "
            f"other hosts needs an admin key of at least {MIN_ADMIN_KEY_CHARS} characters in "
            f"${ADMIN_KEY_ENV} ({'too short' if key else 'unset'})")
    return key


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (IPv4 or IPv6; port 0: a free one). Listening starts when
    uvicorn serves it, so nothing connects before the app is up. OSError if it cannot bind."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def bind(cfg: GatewayConfig) -> socket.socket:
    """`listen_socket` for gateway.host:gateway.port; a ConfigError naming the key if it fails."""
    try:
        return listen_socket(cfg.host, cfg.port)
    except OSError as e:
        raise ConfigError(f"config key 'gateway.host': cannot listen on {cfg.host!r} "
                          f"port {cfg.port}: {e}") from None


def public_url(cfg: GatewayConfig, port: int) -> str | None:
    """The base URL handed to agents: gateway.public_url with {port} filled in; for a specific
    non-loopback address, http://HOST:PORT; on loopback None (the URL the caller used)."""
    if cfg.public_url is not None:
        return cfg.public_url.replace("{port}", str(port))
    if is_loopback(cfg.host):
        return None
    return f"http://{_url_host(cfg.host)}:{port}"


def app_options(cfg: GatewayConfig, port: int) -> dict:
    """create_app's keyword arguments from the gateway section, for the trainers (both backends)."""
    return {
        "public_url": public_url(cfg, port),
        "context": cfg.context,
        "tool_parser": cfg.tool_parser,
        "forced_tool_choice": cfg.forced_tool_choice,
    }


def local_url(sock: socket.socket) -> str:
    """The URL this process reaches a socket bound by `bind` at (loopback for a wildcard)."""
    host, port = sock.getsockname()[:2]
    if host in WILDCARD_HOSTS:
        host = "::1" if sock.family == socket.AF_INET6 else "127.0.0.1"
    return f"http://{_url_host(host)}:{port}"


class EmbeddedServer(uvicorn.Server):
    """uvicorn serving inside a run's event loop. The process's signals are the run's
    (run/stop.py), never the server's: a stock `uvicorn.Server` in the main thread takes SIGTERM and
    SIGINT for itself, ends at once on the first one and raises it again when it has ended."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@asynccontextmanager
async def serve_in_loop(app, sock: socket.socket | None = None, *, startup_timeout_s: float = 30.0):
    """Serve `app` on `sock` (default: a free loopback port) in this event loop; yields its local
    URL once it accepts connections; the server stops when the block exits."""
    sock = sock if sock is not None else bind(GatewayConfig())
    # Keep-alive longer than any client's idle timeout: the server never closes a connection that
    # a client is about to reuse (the runner's clients close theirs after 2 s).
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_keep_alive=120)
    server = EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    deadline = asyncio.get_running_loop().time() + startup_timeout_s
    try:
        while not server.started:
            if task.done():
                task.result()  # raises the startup error
                raise RuntimeError("uvicorn exited during startup")
            if asyncio.get_running_loop().time() > deadline:
                server.should_exit = True
                raise TimeoutError(f"uvicorn did not start within {startup_timeout_s} s")
            await asyncio.sleep(0.005)
        yield local_url(sock)
    finally:
        server.should_exit = True
        await task
        sock.close()
