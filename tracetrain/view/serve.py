"""`tracetrain view RUN_DIR`: a local web page over a run directory, while it trains and after.

    tracetrain view runs/guess                 # http://127.0.0.1:8765/
    tracetrain view runs/guess --port 0        # a free port
    tracetrain view runs/guess --host 0.0.0.0  # other hosts: a token is made and put in the URL

read.py reads the run's files read-only, explain.py recomputes what the trainer did with each
token, pages.py shapes it, app.py serves it with the templates and static files that
ship in this package (no build step, nothing fetched at view time).
"""

from __future__ import annotations

import secrets
from pathlib import Path

from tracetrain.config import ConfigError
from tracetrain.types import UsageError


def serve_view(run_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8765,
               token: str | None = None) -> None:
    """Serve the viewer until interrupted; prints `tracetrain view: URL` once it accepts
    connections. A host other than loopback needs a token (one is made when none is given)."""
    from tracetrain.gateway.inprocess import is_loopback, listen_socket
    from tracetrain.gateway.serve import ReadyServer, uvicorn_config
    from tracetrain.view.app import create_view_app

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{str(run_dir)!r} is not a run directory")
    if token is None and not is_loopback(host):
        token = secrets.token_urlsafe(18)
    app = create_view_app(run_dir, token=token)
    app.state.run.tokenizer()  # loaded before the ready line: the first page is as fast as the rest
    try:
        sock = listen_socket(host, port)
    except OSError as e:  # the port is taken, the address is not this machine's
        raise UsageError(f"cannot listen on {host!r} port {port}: {e}") from None
    bound, bound_port = sock.getsockname()[:2]
    shown = f"[{bound}]" if ":" in bound else bound
    url = f"http://{shown}:{bound_port}/" + (f"?token={token}" if token else "")
    try:
        ReadyServer(uvicorn_config(app), f"tracetrain view: {url}").run(sockets=[sock])
    finally:
        app.state.run.close()
