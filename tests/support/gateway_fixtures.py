"""Shared pieces for the gateway tests: a fast deterministic engine, a live gateway on loopback.

`FakeEngine` implements the Engine protocol with no model: it answers with the canonical
tokenization of a reply text (plus eos), so decode -> re-encode round-trips and a chat template
that renders the assistant message back reproduces the response ids exactly. Every call is kept
in `calls` (prompt ids, Generation) so tests compare what the store holds with what the engine
produced.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import secrets
import subprocess
import sys
import textwrap
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest

from tracetrain.engines.base import EngineError, Generation, SamplingParams, stop_string_in
from tracetrain.gateway import create_app
from tracetrain.gateway.serve import ThreadedServer
from tracetrain.models.tiny import build_tokenizer
from tracetrain.store import SQLiteStore

_TOKENIZER = None


def tiny_tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = build_tokenizer()
    return _TOKENIZER


class FakeEngine:
    """Deterministic Engine: reply k (k = call number) is `reply(k, prompt_ids)` + eos."""

    name = "fake"

    def __init__(
        self,
        tokenizer=None,
        *,
        max_context: int = 2048,
        reply: Callable[[int, list[int]], str] | None = None,
        delay: float = 0.0,
        model_version: int = 0,
        record: bool = True,
    ):
        self.tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
        self.max_context = max_context
        self.model_version = model_version
        self.reply = reply or (lambda k, prompt: f"Reply number {k}, I guess {k % 100}.")
        self.delay = delay
        self.record = record
        self.calls: list[tuple[list[int], Generation]] = []
        self.fail_with: EngineError | None = None
        self._count = itertools.count()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_tokens=None
    ) -> Generation:
        if self.fail_with is not None:
            raise self.fail_with
        k = next(self._count)
        ids = self.tokenizer.encode(self.reply(k, prompt_ids), add_special_tokens=False)
        ids = ids + [self.tokenizer.eos_token_id]
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        logprobs = [-0.125 * (1 + (k + j) % 5) for j in range(len(ids))]  # exact in float32
        if self.delay:
            await asyncio.sleep(self.delay)
        for t in ids if on_tokens is not None else ():  # a token at a time, as engines stream
            on_tokens([t])
            await asyncio.sleep(0)
        gen = Generation(ids, logprobs, finish, self.model_version)
        if self.record:
            self.calls.append((list(prompt_ids), gen))
        return gen

    async def aclose(self) -> None:
        pass


class ScriptedEngine(FakeEngine):
    """Answers each call with the next token ids in `script`, whatever the prompt, as an engine
    would: up to and including the first stop id (eos or one asked for) or the token that
    completes a stop string, at most max_tokens."""

    def __init__(self, tokenizer=None, *, token_delay: float = 0.0):
        super().__init__(tokenizer)
        self.script: deque[list[int]] = deque()
        self.token_delay = token_delay  # seconds between tokens when streaming
        self.streamed: list[list[int]] = []  # per call with on_tokens: the ids it was given
        self.cancelled = 0  # calls cancelled while streaming

    def say(self, text: str, eos: bool = True) -> None:
        """Script the next answer: `text` tokenized, then eos (unless `eos` is False)."""
        tok = self.tokenizer
        self.script.append(tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else []))

    async def generate(self, prompt_ids, params, on_tokens=None):
        """`on_tokens`: each token on its own, `token_delay` apart, as a decoding engine would."""
        planned = self.script.popleft()
        stops = {self.tokenizer.eos_token_id, *params.stop_token_ids}
        ids, finish = [], "length"
        if on_tokens is not None:
            self.streamed.append([])
        for t in planned[: params.max_tokens]:
            ids.append(t)
            if on_tokens is not None:
                try:
                    await asyncio.sleep(self.token_delay)
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
                self.streamed[-1].append(t)
                on_tokens([t])
            if t in stops or (params.stop and stop_string_in(self.tokenizer, ids, params.stop)):
                finish = "stop"
                break
        gen = Generation(ids, [-0.5] * len(ids), finish, self.model_version)
        self.calls.append((list(prompt_ids), gen))
        return gen


# The calculator tool of the chat-completions tests.
CALC_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
        },
    }
]


def hermes_call(name: str, arguments: dict) -> str:
    """A tool call as a Hermes/Qwen model writes it (the gateway's default parser reads it)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@dataclass
class LiveGateway:
    url: str
    admin_key: str
    store: SQLiteStore
    engine: FakeEngine
    app: object
    admin: httpx.Client = field(repr=False, default=None)

    def create(self, n: int = 1, **spec) -> list[dict]:
        """Create n rollouts; returns the created records (with base_url and api_key)."""
        body = {"rollouts": [dict(spec) for _ in range(n)]}
        r = self.admin.post("/rollouts", json=body)
        assert r.status_code == 200, r.text
        return r.json()["rollouts"]


def live_gateway(tmp_path, engine: FakeEngine | None = None, **app_kwargs):
    """Context-managed live gateway (store + app + uvicorn thread)."""

    class _Ctx:
        def __enter__(self):
            self.store = SQLiteStore(tmp_path / "gateway.db")
            self.engine = engine or FakeEngine()
            key = "admin-" + secrets.token_hex(16)
            self.app = create_app(self.store, {"default": self.engine}, admin_key=key, **app_kwargs)
            self.server = ThreadedServer(self.app).start()
            admin = httpx.Client(
                base_url=self.server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30
            )
            return LiveGateway(self.server.url, key, self.store, self.engine, self.app, admin)

        def __exit__(self, *exc):
            self.server.stop()
            self.store.close()

    return _Ctx()


@pytest.fixture
def gateway(tmp_path):
    with live_gateway(tmp_path) as gw:
        yield gw
        gw.admin.close()


def save_tiny_tokenizer(path) -> str:
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def spawn_gateway(
    db, upstream_url: str, tokenizer_dir: str, admin_key: str, *extra: str, timeout=60.0
):
    """`python -m tracetrain.gateway.serve` (upstream mode) as a subprocess -> (process, url)."""
    args = [
        sys.executable,
        "-m",
        "tracetrain.gateway.serve",
        "--db",
        str(db),
        "--port",
        "0",
        "--engine",
        "upstream",
        "--upstream-url",
        upstream_url,
        "--model",
        "fake",
        "--tokenizer",
        tokenizer_dir,
        "--max-context",
        "4096",
        *extra,
    ]
    env = {**os.environ, "TRACETRAIN_ADMIN_KEY": admin_key}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("TRACETRAIN_GATEWAY_URL="):  # printed once it accepts connections
            return proc, line.strip().split("=", 1)[1]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"gateway subprocess did not start within {timeout} s")


# A command agent (run as a subprocess by the runners): "hang" writes its pid and sleeps,
# "exit" fails with status 3 after one call, anything else posts task["reward"] to the gateway.
COMMAND_AGENT_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    task = json.loads(os.environ["TRACETRAIN_TASK"])
    if task["kind"] == "hang":  # before the slow imports: the pid is written at once
        open(task["pidfile"], "w").write(str(os.getpid()))
        time.sleep(3600)
    import httpx
    from openai import OpenAI
    client = OpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY from the runner
    client.chat.completions.create(model=os.environ["TRACETRAIN_MODEL"],
                                   messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    if task["kind"] == "exit":
        print("the environment broke", file=sys.stderr)
        sys.exit(3)
    r = httpx.post(os.environ["TRACETRAIN_ROLLOUT_URL"] + "/rewards", json={"reward": task["reward"]},
                   headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    r.raise_for_status()
    """
)


def autogen_python():
    """.venv-autogen's python (scripts/install-autogen.sh: AutoGen's protobuf pin conflicts with
    Ray's); the test is skipped without it, and fails in CI, which installs it."""
    from pathlib import Path

    python = Path(__file__).resolve().parents[2] / ".venv-autogen" / "bin" / "python"
    if not python.exists():
        why = "no .venv-autogen (bash scripts/install-autogen.sh)"
        if os.environ.get("CI"):
            pytest.fail(why + ": CI installs it", pytrace=False)
        pytest.skip(why)
    return python
