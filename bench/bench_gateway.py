"""Gateway throughput and added latency, tracetrain vs Agent Lightning, against one fake upstream.

    .venv/bin/python bench/bench_gateway.py [--requests 4000] [--concurrency 32] [--single 300]

Everything runs on loopback, each server in its own process:
  fake     tests/support/fake_upstream.py (a vLLM-protocol fake; answers in microseconds)
  direct   clients -> fake /v1/chat/completions                     (the baseline)
  tracetrain  clients -> `python -m tracetrain.gateway.serve --engine upstream` -> fake /v1/completions
           (chat template rendered to ids, turn committed to SQLite before each answer)
  agentlightning  clients -> its gateway (agentlightning.server.app:create_app, in bench/.venv-peers)
           -> fake /v1/chat/completions (events kept in memory); twice: "tuned" (the same uvicorn
           settings as tracetrain, logs off) and "as shipped" (as its __main__ runs it)
Requests are a 4-message chat (max_tokens 8) whose last user message is new every time (the
history repeats, as in a multi-turn chat, but no whole prompt does); --same-prompt sends one chat
every time instead (like the n rollouts of a group opening on one task: tracetrain then answers
from its prompt cache without rendering). For each: requests/s with --concurrency clients, p50/p99
latency and the latency added to the direct call; p50 added latency with one client; the server's
CPU time per request (user + system of its process during the concurrent run, from /proc), which
other load on a shared machine moves least. Then each gateway is killed with SIGKILL and restarted
on the same storage, and we count what survived. Without the peers env the Agent Lightning rows
say so.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
from fake_upstream import spawn_fake_upstream  # noqa: E402

PEERS_PYTHON = ROOT / "bench" / ".venv-peers" / "bin" / "python"
MESSAGES = [
    {"role": "system", "content": "You are playing a game. Guess the secret number."},
    {"role": "user", "content": "I am thinking of a number between 1 and 100. Guess it."},
    {"role": "assistant", "content": "50"},
    {"role": "user", "content": "Higher. Guess again."},
]
BODY = {"model": "fake", "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0}

AL_LAUNCHER = """
import sys, uvicorn
from agentlightning.server.app import create_app
config = {"key": sys.argv[2], "default_proxy": {"model_name": "fake", "include_log_probs": True,
          "include_routed_experts": False, "train": {"temperature": 1.0}, "val": {"temperature": 0.7}}}
# "shipped": as agentlightning.server.__main__ runs it (workers=1, keep-alive 120 s, uvicorn's
# defaults: access log on; its structlog debug line per proxied call). "tuned": the same with the
# access log and info logs off and uvicorn's fastest available loop/parser, as tracetrain runs.
kw = dict(access_log=False, log_level="warning", loop="auto", http="auto") if sys.argv[3] == "tuned" else {}
uvicorn.run(create_app(config), host="127.0.0.1", port=int(sys.argv[1]), workers=1,
            timeout_keep_alive=120, **kw)
"""


# ------------------------------------------------------------------------------ load generator


_SERIAL = itertools.count()  # numbers the last messages across runs: none is sent twice


def payloads(n: int, same: bool) -> list[bytes]:
    """The request bodies: the same chat for every request (`same`), or the same history with a
    last user message of its own per request (default), so that no gateway can answer from a
    cache of whole prompts: only what a multi-turn chat repeats (the history) is seen before."""
    if same:
        return [json.dumps(BODY).encode()] * n
    out = []
    for _ in range(n):
        last = {"role": "user", "content": f"Higher. Guess again, try {next(_SERIAL)}."}
        out.append(json.dumps({**BODY, "messages": MESSAGES[:-1] + [last]}).encode())
    return out


async def load(
    targets: list[tuple[str, dict]], n_requests: int, same: bool = False
) -> tuple[float, list[float], int]:
    """len(targets) clients (one keep-alive connection each: url, headers) share n_requests.
    Returns (requests/s, latencies in s of the 2xx answers, number of non-2xx/failed)."""
    latencies: list[float] = []
    failed = 0
    left = n_requests
    bodies = payloads(n_requests, same)

    async def client(url: str, headers: dict) -> None:
        nonlocal left, failed
        conn = aiohttp.TCPConnector(limit=1, force_close=False)
        async with aiohttp.ClientSession(connector=conn, headers=headers) as s:
            while left > 0:
                left -= 1
                payload = bodies[left]
                t0 = time.perf_counter()
                try:
                    async with s.post(
                        url, data=payload, headers={"Content-Type": "application/json"}
                    ) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - t0)
                else:
                    failed += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client(u, h) for u, h in targets))
    return len(latencies) / (time.perf_counter() - t0), latencies, failed


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(name: str, targets: list[tuple[str, dict]], args, pid: int | None = None) -> dict:
    asyncio.run(load(targets, min(200, args.requests), args.same_prompt))  # warm up
    cpu0 = cpu_s(pid) if pid else 0.0
    rps, lat, failed = asyncio.run(load(targets, args.requests, args.same_prompt))
    cpu = (cpu_s(pid) - cpu0) / max(len(lat), 1) if pid else float("nan")
    _, lat1, failed1 = asyncio.run(load(targets[:1], args.single, args.same_prompt))
    out = {
        "name": name,
        "rps": rps,
        "p50": pct(lat, 50),
        "p99": pct(lat, 99),
        "p50_1": pct(lat1, 50),
        "failed": failed + failed1,
        "ok": len(lat) + len(lat1),
        "cpu_ms_per_request": cpu * 1e3,
    }
    print(
        f"  {name:<15} {rps:8.0f} req/s   p50 {out['p50'] * 1e3:7.2f} ms   p99 {out['p99'] * 1e3:7.2f} ms"
        f"   1 client p50 {out['p50_1'] * 1e3:6.2f} ms   failed {out['failed']}"
        f"   server CPU {out['cpu_ms_per_request']:.2f} ms/req",
        flush=True,
    )
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ------------------------------------------------------------------------------------ servers


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    async def probe() -> bool:
        try:
            async with aiohttp.ClientSession() as s, s.get(url) as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        if asyncio.run(probe()):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


def start_tracetrain(
    db: Path, fake_url: str, tokdir: str, key: str
) -> tuple[subprocess.Popen, str]:
    cmd = [
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
        fake_url,
        "--model",
        "fake",
        "--tokenizer",
        tokdir,
        "--max-context",
        "4096",
    ]
    env = {**os.environ, "TRACETRAIN_ADMIN_KEY": key}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("TRACETRAIN_GATEWAY_URL="):
        proc.kill()
        raise RuntimeError(f"tracetrain gateway did not start: {line!r}")
    url = line.strip().split("=", 1)[1]
    wait_http(url + "/health", proc)
    return proc, url


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_al(key: str, mode: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(PEERS_PYTHON), "-c", AL_LAUNCHER, str(port), key, mode],
        stdout=subprocess.DEVNULL,  # its logs are formatted and written, not shown
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/healthz", proc)
    return proc, url


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def http_json(method: str, url: str, key: str, body=None):
    async def go():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
            async with s.request(method, url, json=body) as r:
                return r.status, (await r.json() if r.content_type == "application/json" else None)

    return asyncio.run(go())


# ------------------------------------------------------------------------------------- runs


def run_tracetrain(args, fake_url: str, tmp: Path) -> dict:
    from tracetrain.models.tiny import build_tokenizer

    tokdir = str(tmp / "tok")
    build_tokenizer().save_pretrained(tokdir)
    key = secrets.token_hex(16)
    db = tmp / "gateway.db"
    proc, url = start_tracetrain(db, fake_url, tokdir, key)
    try:
        status, made = http_json(
            "POST", url + "/rollouts", key, {"rollouts": [{}] * args.concurrency}
        )
        assert status == 200, made
        targets = [
            (r["base_url"] + "/chat/completions", {"Authorization": f"Bearer {r['api_key']}"})
            for r in made["rollouts"]
        ]
        rss0 = rss_mb(proc.pid)
        out = measure("tracetrain", targets, args, proc.pid)
        out["rss_growth_mb"] = rss_mb(proc.pid) - rss0
        ids = [r["rollout_id"] for r in made["rollouts"]]
        before = sum(
            http_json("GET", f"{url}/rollouts/{i}?turns=false", key)[1]["n_turns"] for i in ids
        )
        kill9(proc)
        proc, url = start_tracetrain(db, fake_url, tokdir, key)
        after = sum(
            http_json("GET", f"{url}/rollouts/{i}?turns=false", key)[1]["n_turns"] for i in ids
        )
        acked = out["ok"] + min(200, args.requests)  # warm-up requests were answered 200 too
        out["recorded"], out["acked"], out["after_restart"] = before, acked, after
        print(
            f"  tracetrain turns recorded {before} for {acked} answered requests; after kill -9 "
            f"+ restart: {after}; gateway RSS growth {out['rss_growth_mb']:.0f} MB",
            flush=True,
        )
        return out
    finally:
        proc.kill()
        proc.wait()


def run_al(args, fake_url: str, mode: str) -> dict | None:
    if not PEERS_PYTHON.exists():
        print("  agentlightning   unavailable (no bench/.venv-peers; run bench/setup_peers.sh)")
        return None
    check = subprocess.run(
        [str(PEERS_PYTHON), "-c", "import agentlightning.server.app"], capture_output=True
    )
    if check.returncode != 0:
        print("  agentlightning   unavailable: " + check.stderr.decode().strip().splitlines()[-1])
        return None
    key = secrets.token_hex(16)
    proc, url = start_al(key, mode)
    name = "agentlightning" if mode == "tuned" else "AL as shipped"
    try:
        status, _ = http_json(
            "POST",
            url + "/api/models",
            key,
            [{"model": "fake", "endpoint": fake_url + "/v1", "version": 0}],
        )
        assert status == 201, status
        status, made = http_json(
            "POST",
            url + "/api/rollouts",
            key,
            [{"input": {"q": i}} for i in range(args.concurrency)],
        )
        assert status == 201, made
        ids = [r["rollout_id"] for r in made]
        auth = {"Authorization": f"Bearer {key}"}
        targets = [
            (f"{url}/proxy/rollout/{i}/attempt/0/mode/train/openai/v1/chat/completions", auth)
            for i in ids
        ]
        rss0 = rss_mb(proc.pid)
        out = measure(name, targets, args, proc.pid)
        out["rss_growth_mb"] = rss_mb(proc.pid) - rss0
        if mode != "tuned":
            return out
        kill9(proc)
        proc, url = start_al(key, mode)
        survived = sum(http_json("GET", f"{url}/api/rollouts/{i}", key)[0] == 200 for i in ids)
        out["rollouts_after_restart"] = survived
        print(
            f"  agentlightning rollouts after kill -9 + restart: {survived} of {len(ids)}; "
            f"gateway RSS growth {out['rss_growth_mb']:.0f} MB",
            flush=True,
        )
        return out
    finally:
        proc.kill()
        proc.wait()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=4000, help="requests per concurrent run")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--single", type=int, default=300, help="requests of the one-client run")
    p.add_argument(
        "--same-prompt",
        action="store_true",
        help="send the same chat every time (like the n rollouts of one task opening a group) "
        "instead of a new last message per request",
    )
    p.add_argument("--no-peer", action="store_true", help="skip Agent Lightning")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    print(
        f"{args.concurrency} clients x {args.requests} requests, then 1 client x {args.single}; "
        f"{'the same chat' if args.same_prompt else 'a new last message'} per request; "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    fake, fake_url = spawn_fake_upstream()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            direct = measure(
                "direct (fake)",
                [(fake_url + "/v1/chat/completions", {})] * args.concurrency,
                args,
                fake.pid,
            )
            tt = run_tracetrain(args, fake_url, Path(tmp))
            al = None if args.no_peer else run_al(args, fake_url, "tuned")
            shipped = None if args.no_peer or al is None else run_al(args, fake_url, "shipped")
    finally:
        fake.kill()
        fake.wait()

    print("\nadded latency vs direct:")
    rows = [tt] + [r for r in (al, shipped) if r]
    for r in rows:
        print(
            f"  {r['name']:<15} p50 +{(r['p50'] - direct['p50']) * 1e3:6.2f} ms   "
            f"p99 +{(r['p99'] - direct['p99']) * 1e3:6.2f} ms   "
            f"1 client p50 +{(r['p50_1'] - direct['p50_1']) * 1e3:5.2f} ms"
        )
    print()
    for peer in (al, shipped):
        if peer:
            print(
                f"tracetrain / {peer['name']}: throughput {tt['rps'] / peer['rps']:.1f}x, "
                f"p50 {peer['p50'] / tt['p50']:.1f}x lower, p99 {peer['p99'] / tt['p99']:.1f}x lower, "
                f"server CPU per request {peer['cpu_ms_per_request'] / tt['cpu_ms_per_request']:.1f}x lower"
            )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {"direct": direct, "tracetrain": tt, "agentlightning": al, "al_shipped": shipped},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
