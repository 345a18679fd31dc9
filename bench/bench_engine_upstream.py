"""UpstreamEngine against the fake vLLM server (a subprocess on loopback): requests/s and latency
at N concurrent requests, next to bare HTTP clients (aiohttp, httpx) posting the same body.

    .venv/bin/python bench/bench_engine_upstream.py --requests 4000 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
from fake_upstream import spawn_fake_upstream  # noqa: E402

from tracetrain.engines.base import SamplingParams  # noqa: E402
from tracetrain.engines.upstream import UpstreamEngine, request_body  # noqa: E402


async def drive(call, n: int, concurrency: int) -> tuple[float, list[float]]:
    """(requests/s, per-request latencies) for n calls with at most `concurrency` in flight."""
    sem, lat = asyncio.Semaphore(concurrency), []

    async def one(i: int):
        async with sem:
            t = time.perf_counter()
            await call(i)
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - t0), lat


def prompt(i: int) -> list[int]:
    return [3 + i % 400] + list(range(10, 60))


async def run_engine(url: str, n: int, c: int, params: SamplingParams):
    eng = UpstreamEngine(url, "fake", tokenizer=None, max_context=4096, max_connections=c)
    try:
        return await drive(lambda i: eng.generate(prompt(i), params), n, c)
    finally:
        await eng.aclose()


async def run_aiohttp(url: str, n: int, c: int, params: SamplingParams):
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=c)) as s:

        async def call(i):
            async with s.post(
                url + "/v1/completions", json=request_body("fake", prompt(i), params)
            ) as r:
                await r.json()

        return await drive(call, n, c)


async def run_httpx(url: str, n: int, c: int, params: SamplingParams):
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=c)) as client:

        async def call(i):
            (
                await client.post(
                    url + "/v1/completions", json=request_body("fake", prompt(i), params)
                )
            ).json()

        return await drive(call, n, c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument(
        "--httpx-requests", type=int, default=1000, help="httpx is slow: fewer requests"
    )
    args = ap.parse_args()
    proc, url = spawn_fake_upstream(response_len=16)
    params = SamplingParams(max_tokens=16)
    try:
        results = []
        for name, fn, n in [
            ("bare aiohttp client -> fake", run_aiohttp, args.requests),
            ("UpstreamEngine.generate -> fake", run_engine, args.requests),
            ("bare httpx client -> fake", run_httpx, args.httpx_requests),
        ]:
            asyncio.run(fn(url, 200, args.concurrency, params))  # warm up
            rps, lat = asyncio.run(fn(url, n, args.concurrency, params))
            results.append((name, rps, lat))
    finally:
        proc.terminate()
        proc.wait()
    print(
        f"{args.concurrency} concurrent requests, 51-token prompts, 16 tokens each, "
        "fake upstream in a subprocess"
    )
    print(f"{'client':36s} {'req/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for name, rps, lat in results:
        q = statistics.quantiles(lat, n=100)
        print(f"{name:36s} {rps:8.0f} {q[49] * 1e3:8.2f} {q[98] * 1e3:8.2f}")
    base, eng, hx = (r[1] for r in results)
    print(
        f"UpstreamEngine / bare aiohttp: {eng / base:.2f}; UpstreamEngine / bare httpx: {eng / hx:.1f}x"
    )


if __name__ == "__main__":
    main()
