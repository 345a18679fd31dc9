"""Serve an ASGI app with uvicorn on 127.0.0.1 inside the running event loop (embedded runs)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import uvicorn


@asynccontextmanager
async def serve_in_loop(app, *, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 30.0):
    """Yields the server's base URL; the server stops when the block exits."""
    # Keep-alive longer than any client's idle timeout: the server never closes a connection that
    # a client is about to reuse (the runner's clients close theirs after 2 s).
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            lifespan="on", timeout_keep_alive=120)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    deadline = asyncio.get_running_loop().time() + startup_timeout_s
    while not server.started:
        if task.done():
            task.result()  # raises the startup error
            raise RuntimeError("uvicorn exited during startup")
        if asyncio.get_running_loop().time() > deadline:
            server.should_exit = True
            raise TimeoutError(f"uvicorn did not start within {startup_timeout_s} s")
        await asyncio.sleep(0.005)
    bound = server.servers[0].sockets[0].getsockname()
    try:
        yield f"http://{host}:{bound[1]}"
    finally:
        server.should_exit = True
        await task
