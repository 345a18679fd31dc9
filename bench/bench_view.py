"""How fast `tracetrain view` answers: each page of a finished demo run (250 steps x 128
rollouts) and of a run whose rollouts have 32 turns, over HTTP on loopback, cold and warm.

    .venv/bin/python bench/bench_view.py runs/guess          # the demo's run (scripts/demo.sh)
    .venv/bin/python bench/bench_view.py runs/guess --repeats 10

Pages (the viewer in a thread of this process, httpx as the browser's requests): the run page,
a step page (first visit: its rollouts read and put through aggregate, credit and the plan;
then cached), the same step filtered and sorted, a rollout page, two rollouts side by side,
and the rollout page of a 32-turn rollout. The 32-turn run is written here with the Store API: 8
rollouts of 32 turns whose prompts extend the turn before (as the gateway's exact context
records them: one row each), 40-word replies and observations in the tiny tokenizer, in one
step, with the demo's config (its row lengths raised to 16,384 so the rollouts are trained). "cold"
is a page's first request after the viewer started, "warm" the median of --repeats more. Goal: every
page under 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def long_rollouts(tok, n: int, turns: int, words: int = 40) -> list[list[tuple[list[int], list[int]]]]:
    """n rollouts of `turns` (prompt ids, response ids) as the gateway's exact context records
    them: turn k's prompt is turn k-1's prompt + response + the new observation's ids, replies
    and observations of `words` random words each."""
    import random

    from bench_train_step import WORDS

    rng = random.Random(0)
    say = lambda: " ".join(rng.choice(WORDS) for _ in range(words))  # noqa: E731
    out = []
    for _ in range(n):
        prompt = tok.apply_chat_template([{"role": "system", "content": "Solve the task."},
                                          {"role": "user", "content": say()}],
                                         add_generation_prompt=True)["input_ids"]
        made = []
        for _ in range(turns):
            response = tok.encode(say(), add_special_tokens=False) + [tok.eos_token_id]
            made.append((list(prompt), response))
            observation = tok.encode(f"\n<|im_start|>user\n{say()}<|im_end|>\n<|im_start|>assistant\n",
                                     add_special_tokens=False)
            prompt = prompt + response + observation
        out.append(made)
    return out


def long_run(demo: Path, out: Path, turns: int = 32) -> tuple[Path, str]:
    """A run directory with the demo's config and one step of 8 rollouts of `turns` turns."""
    from tracetrain.models.tiny import build_tokenizer
    from tracetrain.store import SQLiteStore
    from tracetrain.store.records import NewRollout, NewTurn

    out.mkdir(parents=True)
    cfg = json.loads((demo / "config.json").read_text())  # rows as long as the rollouts
    cfg["aggregate"].update(max_prompt_length=16384, max_response_length=16384)
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 0.5}) + "\n")
    rollouts = long_rollouts(build_tokenizer(), 8, turns)

    async def write():
        store = SQLiteStore(out / "traces.db")
        try:
            await store.create_rollouts([NewRollout(f"long-s0-t0-n{k}", "long-s0-t0", {"k": k},
                                                    key_hash=hashlib.sha256(b"%d" % k).digest())
                                         for k in range(len(rollouts))])
            for k, made in enumerate(rollouts):
                rid = f"long-s0-t0-n{k}"
                for prompt, response in made:
                    await store.add_turn(
                        rid, NewTurn(prompt, response, [-1.0] * len(response), 0, "stop"))
                await store.add_event(rid, "reward", reward=k / 8)
                await store.set_state(rid, "succeeded")
        finally:
            store.close()

    asyncio.run(write())
    prompt, response = rollouts[0][-1]
    return out, f"long-s0-t0-n0 ({len(prompt) + len(response)} tokens)"


def time_pages(run: Path, pages: list[tuple[str, str]],
               repeats: int) -> list[tuple[str, str, float, float, int]]:
    from tracetrain.gateway.serve import ThreadedServer
    from tracetrain.view.app import create_view_app

    app = create_view_app(run)
    app.state.run.tokenizer()  # as `tracetrain view` does before its ready line
    out = []
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        for name, path in pages:
            t = time.perf_counter()
            r = http.get(path)
            cold = time.perf_counter() - t
            if r.status_code != 200:
                raise SystemExit(f"{path}: HTTP {r.status_code}\n{r.text[:2000]}")
            warm = []
            for _ in range(repeats):
                t = time.perf_counter()
                http.get(path)
                warm.append(time.perf_counter() - t)
            out.append((name, path, cold, statistics.median(warm), len(r.content)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="a finished demo run (runs/guess)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    metrics = [json.loads(x) for x in (args.run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    last = metrics[-1]["step"]
    import sqlite3

    db = sqlite3.connect(args.run / "traces.db")
    n_rollouts = db.execute("SELECT count(*) FROM rollouts").fetchone()[0]
    ids = [r[0] for r in db.execute("SELECT rollout_id FROM rollouts WHERE group_id GLOB ? ORDER BY seq",
                                    (f"*-s{last // 2}-t*",))]
    db.close()
    mid = last // 2
    pages = [("run page", "/"), (f"step {mid} (cold: explained)", f"/step/{mid}"),
             (f"step {mid}, failed only, by reward",
              f"/step/{mid}?state=failed-or-timed-out&sort=reward&order=desc"),
             (f"step {mid + 1} sorted by advantage", f"/step/{mid + 1}?sort=advantage&order=desc"),
             ("rollout (its step explained)", f"/rollout/{ids[0]}"),
             ("rollout of another step (cold)", f"/rollout/{ids[0].replace(f'-s{mid}-', f'-s{mid + 2}-')}"),
             ("two rollouts side by side", f"/compare?a={ids[0]}&b={ids[1]}")]
    print(f"demo run {args.run}: {len(metrics)} steps, {n_rollouts} rollouts in traces.db")
    rows = time_pages(args.run, pages, args.repeats)
    with tempfile.TemporaryDirectory(prefix="bench-view-") as tmp:
        long, what = long_run(args.run, Path(tmp) / "long")
        rows += time_pages(long, [(f"32-turn rollout {what}", "/rollout/long-s0-t0-n0"),
                                  ("its step (8 x 32 turns)", "/step/0")], args.repeats)
    print(f"{'page':44s} {'cold s':>7s} {'warm s':>7s} {'KB':>7s}")
    for name, _, cold, warm, size in rows:
        print(f"{name:44s} {cold:7.3f} {warm:7.3f} {size / 1024:7.0f}")
    worst = max(max(c, w) for _, _, c, w, _ in rows)
    print(f"slowest: {worst:.3f} s (goal: every page under 1 s)")


if __name__ == "__main__":
    main()
