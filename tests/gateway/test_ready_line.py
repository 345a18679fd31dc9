"""The ready signal means ready: a client that connects the moment `tracetrain serve` prints its
TRACETRAIN_GATEWAY_URL line (or the moment an in-process server hands back its URL) is answered,
with no retry."""

from __future__ import annotations

import asyncio
import secrets
import socket
from urllib.parse import urlsplit

import httpx
from fake_upstream import FakeUpstream
from gateway_fixtures import FakeEngine, save_tiny_tokenizer, spawn_gateway

from tracetrain.gateway import create_app
from tracetrain.gateway.inprocess import serve_in_loop
from tracetrain.gateway.serve import ThreadedServer
from tracetrain.store import SQLiteStore


def health_at_once(url: str) -> int:
    """One TCP connect and one GET /health, no retries: refused means not ready."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10):
        pass
    with httpx.Client(transport=httpx.HTTPTransport(retries=0), timeout=10) as client:
        return client.get(url + "/health").status_code


def test_serve_accepts_connections_when_it_prints_its_url(tmp_path):
    """spawn_gateway hands back the URL the moment the line is read: connect then, once."""
    tokdir = save_tiny_tokenizer(tmp_path / "tok")
    with FakeUpstream(response_len=4) as fake:
        proc, url = spawn_gateway(tmp_path / "gw.db", fake.url, tokdir, "admin-" + secrets.token_hex(8),
                                  timeout=120)
        try:
            assert health_at_once(url) == 200
        finally:
            proc.kill()
            proc.wait(30)


def test_in_process_servers_answer_as_soon_as_they_hand_back_their_url(tmp_path):
    store = SQLiteStore(tmp_path / "t.db")
    try:
        app = create_app(store, FakeEngine(record=False), admin_key="k" * 20)
        with ThreadedServer(app) as server:
            assert health_at_once(server.url) == 200

        async def in_loop():
            async with serve_in_loop(app) as url:
                # the blocking client runs beside the loop, which must keep serving
                return await asyncio.to_thread(health_at_once, url)

        assert asyncio.run(in_loop()) == 200
    finally:
        store.close()
