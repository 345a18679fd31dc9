"""Where the trainer's gateway listens and what agents are told (tracetrain/gateway/inprocess.py): loopback
by default with a random admin key; off loopback only with an operator's admin key; agents get
gateway.public_url ({port} filled in) or http://HOST:PORT of the address it listens on."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tracetrain.config import ConfigError, build_config
from tracetrain.gateway.inprocess import admin_key_for, bind, is_loopback, local_url, public_url

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.213.0.1", False), ("gw.example", False),
])
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


def test_admin_key_off_loopback_must_be_the_operators():
    assert len(admin_key_for("127.0.0.1", env={})) >= 16  # random when unset
    assert admin_key_for("127.0.0.1", env={}) != admin_key_for("127.0.0.1", env={})
    assert admin_key_for("::1", env={"TRACETRAIN_ADMIN_KEY": "k" * 20}) == "k" * 20
    for env, why in (({}, "unset"), ({"TRACETRAIN_ADMIN_KEY": "short"}, "too short")):
        with pytest.raises(ConfigError) as e:
            admin_key_for("0.0.0.0", env=env)
        assert "'gateway.host'" in str(e.value) and "TRACETRAIN_ADMIN_KEY" in str(e.value)
        assert why in str(e.value)
    assert admin_key_for("10.213.0.1", env={"TRACETRAIN_ADMIN_KEY": "x" * 16}) == "x" * 16


def test_public_url_handed_to_agents():
    gw = lambda **kw: build_config({"gateway": kw}).gateway  # noqa: E731
    assert public_url(gw(), 8100) is None  # loopback: the URL the caller used
    assert public_url(gw(host="10.213.0.1"), 8100) == "http://10.213.0.1:8100"
    assert public_url(gw(host="fd00::1"), 81) == "http://[fd00::1]:81"
    assert public_url(gw(host="0.0.0.0", public_url="https://gw.example/tt"), 5) == "https://gw.example/tt"
    assert public_url(gw(host="0.0.0.0", public_url="http://10.1.2.3:{port}/x"), 5) == "http://10.1.2.3:5/x"


def test_bind_a_wildcard_is_reached_locally_on_loopback():
    sock = bind(build_config({"gateway": {"host": "0.0.0.0", "public_url": "http://h:{port}"}}).gateway)
    try:
        port = sock.getsockname()[1]
        assert port > 0 and local_url(sock) == f"http://127.0.0.1:{port}"
    finally:
        sock.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match="'gateway.host': cannot listen on '127.0.0.1' port"):
            bind(build_config({"gateway": {"port": taken.getsockname()[1]}}).gateway)


def test_cli_train_refuses_a_non_loopback_gateway_without_an_admin_key(tmp_path):
    """Refused in one line with status 2 before any work (no warm start, no run dir)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRACETRAIN_ADMIN_KEY"}
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "tracetrain", "train",
                           str(ROOT / "examples/guess/config.yaml"),
                           "gateway.host=0.0.0.0", "gateway.public_url=http://10.213.0.1:{port}",
                           f"trainer.run_dir={run_dir}"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config key 'gateway.host'" in proc.stderr and "TRACETRAIN_ADMIN_KEY" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()
