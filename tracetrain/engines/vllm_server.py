"""A vLLM server process for the trainer's rollouts: launched on a Hugging Face directory, waited
for until it answers, stopped at the end.

    server = VLLMServer.launch(python, model_dir, log_path, args=[...], max_model_len=512)
    server.base_url            # http://127.0.0.1:PORT, answering /health once launch returns
    server.check_alive()       # EngineDied with the exit code and the log's last lines
    server.stop()

The command (vLLM's OpenAI server module: `vllm serve` looks up a distribution named `vllm`, which
the CPU build is not):

    PYTHON -m vllm.entrypoints.openai.api_server --model DIR --served-model-name policy
        --host 127.0.0.1 --port PORT --max-model-len N --dtype D --logprobs-mode processed_logprobs [args]

with VLLM_SERVER_DEV_MODE=1 in its environment (the routes weight sync uses: /collective_rpc,
/reset_prefix_cache, /pause, /sleep, ...). `--logprobs-mode processed_logprobs`: the recorded
logprobs are those of the distribution sampled from (after temperature), the quantity the PPO
ratio needs and the local engine records; vLLM's default is the raw logits' log-softmax. `--dtype`
is the trainer's weights' dtype (vLLM's "auto" serves a float32 model in bfloat16, which moved the
tiny model's logprobs by 3e-3 on average, 2e-2 at most, from the trainer's). On a
machine without CUDA, `CPU_ARGS` are added (each only when `args` does not set it): the memory
fraction is of RAM there (the default 0.92 refuses to start), eager mode skips minutes of
torch.compile for a model this size, and chunked prefill is off: vLLM 0.32's CPU worker dies
("CPU Generator does not use offset") when a seeded request's prefill is split over two
scheduler steps, which 128 agents' prompts (more than the 2048 tokens of one step) did at once;
with it off a step takes whole prompts (`--max-num-batched-tokens` at least max_model_len). `args`
come last and win.

A port is picked free, then bound by the server; if another process takes it in between, the
server fails with "address already in use" and the launch is retried on a new port (3 tries).
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tracetrain.config import ConfigError
from tracetrain.engines.base import EngineError

SERVED_NAME = "policy"
CPU_ARGS = {"--gpu-memory-utilization": "0.1", "--enforce-eager": None, "--optimization-level": "0",
            "--no-enable-chunked-prefill": None}
ALIASES = {"-O": "--optimization-level",  # flags given in args under another spelling
           "--enable-chunked-prefill": "--no-enable-chunked-prefill"}


class EngineStartError(ConfigError):
    """The server did not come up; the message names the config key to look at and quotes its log."""


class EngineDied(EngineError):
    """The server process exited while the run needed it."""

    def __init__(self, message: str):
        super().__init__(message, 503)


_ERROR = re.compile(r"(?:^|\] )[A-Z]\w*(?:Error|Exception): ")  # a traceback's last line


def log_tail(path: Path, lines: int = 15) -> str:
    """The log's last lines, after its last error line when that came earlier (a dying vLLM
    logs its shutdown after the error that killed it)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    tail = text[-lines:]
    errors = [line for line in text[:-lines] if _ERROR.search(line)]
    if errors:
        tail = [f"(last error line) {errors[-1]}", "..."] + tail
    return "\n".join("    " + line for line in tail) or "    (empty log)"


def _given(args: list[str]) -> set[str]:
    flags = set()
    for a in args:
        if a.startswith("-"):
            flag = a.split("=", 1)[0]
            if flag.startswith("-O") and not flag.startswith("--") and len(flag) > 2:
                flag = "-O"  # -O0, -O3
            flags.add(ALIASES.get(flag, flag))
    return flags


def server_command(python: str, model_dir: str, port: int, *, max_model_len: int, dtype: str,
                   args: list[str], cuda: bool) -> list[str]:
    """The argv of the server (see the module docstring)."""
    given = _given(args)
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port)]
    base = {"--max-model-len": str(max_model_len), "--dtype": dtype,
            "--logprobs-mode": "processed_logprobs"}
    if not cuda:
        base.update(CPU_ARGS)
        base["--max-num-batched-tokens"] = str(max(2048, max_model_len))
    for flag, value in base.items():
        if flag not in given:
            cmd += [flag] if value is None else [flag, value]
    return cmd + list(args)


def check_interpreter(python: str) -> None:
    """EngineStartError naming engine.python unless it is an executable file."""
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise EngineStartError(f"config key 'engine.python': no executable interpreter at "
                               f"{python!r} (scripts/install-vllm.sh makes .venv-vllm/bin/python)")


_LAUNCHED: list[VLLMServer] = []  # servers this process launched


@atexit.register
def stop_launched() -> None:
    """Stop every server this process launched and has not stopped (at exit, on SIGTERM)."""
    while _LAUNCHED:
        _LAUNCHED.pop().stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VLLMServer:
    process: subprocess.Popen | None
    base_url: str
    log_path: Path | None = None

    @classmethod
    def launch(cls, python: str, model_dir: str | Path, log_path: str | Path, *,
               args: list[str] = (), max_model_len: int, dtype: str = "float32",
               env: dict[str, str] | None = None, start_timeout_s: float = 600.0,
               cuda: bool | None = None, tries: int = 3) -> VLLMServer:
        """Start the server on `model_dir` and return once GET /health answers 200."""
        check_interpreter(python)
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        log_path = Path(log_path)
        for attempt in range(tries):
            port = free_port()
            cmd = server_command(python, str(model_dir), port, max_model_len=max_model_len,
                                 dtype=dtype, args=list(args), cuda=cuda)
            with log_path.open("a") as log:
                log.write(f"# tracetrain: {' '.join(cmd)}\n")
                log.flush()
                proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env={**os.environ, **(env or {}), "VLLM_SERVER_DEV_MODE": "1"},
                    start_new_session=True,
                )
            server = cls(proc, f"http://127.0.0.1:{port}", log_path)
            _LAUNCHED.append(server)  # its own session: no Ctrl-C reaches it, so we stop it
            try:
                server.wait_ready(start_timeout_s)
                return server
            except EngineStartError as e:
                server.stop()
                if "address already in use" in str(e).lower() and attempt + 1 < tries:
                    continue  # the port was taken between free_port() and the server's bind
                raise
        raise AssertionError("unreachable")

    @classmethod
    def running(cls, base_url: str, timeout_s: float = 60.0) -> VLLMServer:
        """A server someone else started at `base_url`: answering, with the dev routes."""
        server = cls(None, base_url.rstrip("/"))
        server.wait_ready(timeout_s)
        try:
            r = httpx.get(server.base_url + "/is_paused", timeout=30)
        except httpx.HTTPError as e:
            raise EngineStartError(f"config key 'engine.base_url': {e}") from None
        if r.status_code == 404:
            raise EngineStartError(
                f"config key 'engine.base_url': the server at {base_url} has no /is_paused route: "
                "weight sync needs vLLM's dev routes (start it with VLLM_SERVER_DEV_MODE=1)")
        return server

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise EngineStartError(
                    f"config key 'engine.python' / 'engine.args': the vLLM server exited with code "
                    f"{self.process.returncode} before it answered; its log ({self.log_path}) ends:\n"
                    f"{log_tail(self.log_path)}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
                last = "GET /health did not answer 200"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(0.5)
        where = ("config key 'engine.start_timeout_s'" if self.process is not None
                 else "config key 'engine.base_url'")
        tail = f"; its log ({self.log_path}) ends:\n{log_tail(self.log_path)}" if self.log_path else ""
        raise EngineStartError(f"{where}: the vLLM server at {self.base_url} did not answer "
                               f"within {timeout_s:g} s ({last}){tail}")

    def check_alive(self) -> None:
        """EngineDied if the launched process has exited (a server at base_url: not checked)."""
        if self.process is not None and self.process.poll() is not None:
            raise EngineDied(f"the vLLM server exited with code {self.process.returncode}; its "
                             f"log ({self.log_path}) ends:\n{log_tail(self.log_path)}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's process group, then SIGKILL to what is left of it after
        `timeout_s` (also when the server itself had exited: vLLM's engine processes can outlive
        it); reaped. Returns once the group is gone (at most 10 s after the SIGKILL): a killed
        process that the server left behind dies, and is reaped by init, a moment later."""
        proc, self.process = self.process, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            if sig == signal.SIGTERM and proc.poll() is not None:
                continue
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)  # anyone left in the group (a zombie not yet reaped too)?
            except ProcessLookupError:
                return
            time.sleep(0.02)
