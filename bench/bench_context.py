"""Exact context vs the template's full render, side by side: a multi-turn tool-using agent.

    .venv/bin/python bench/bench_context.py [--turns 8 32] [--clients 32] [--tokenizer qwen]

Each run starts `python -m tracetrain.gateway.serve --engine upstream --context {exact|template}`
(its own process) in front of tests/fake_upstream.py, which answers with scripted token ids: tool
calls tokenized by the real tokenizer, a third of them written exactly as the template writes a
call, a third in compact JSON, a third after a sentence of text. `--clients` agents (one rollout
each, one keep-alive connection each) play a `--turns`-turn conversation in lockstep: each sends
its whole history (system prompt, task, every answer as the SDK returned it, every tool result)
with the tools, as harnesses do. The chat template is HERMES_TOOLS (tests/chat_templates.py: Qwen
2.5 / Hermes behaviour) on the Qwen tokenizer (tests/real_tokenizers.py), or the tokenizer's own.

Per policy and conversation length it prints, from the recorded turns (aggregate at the
trajectory level, with the tokenizer): prefix breaks per rollout by kind, rows per rollout, the
tokens a training step forwards per rollout, and the gateway's CPU per request (user + system of
its process, from /proc): the mean over the conversation and at its last turn. Then the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from chat_templates import HERMES_TOOLS, with_template  # noqa: E402
from fake_upstream import spawn_fake_upstream  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression and return the number.",
            "parameters": {
                "type": "object",
                "properties": {"expr": {"type": "string", "description": "e.g. 12*(3+4)"}},
                "required": ["expr"],
            },
        },
    }
]
SYSTEM = "You are a careful calculator agent. Use the calc tool for every step of arithmetic."
TASK = "A shop sells pens at 17 each and pads at 29 each. What do 13 pens and 7 pads cost?"


def tokenizer(name: str):
    if name == "tiny":
        from tracetrain.tiny import build_tokenizer

        return with_template(build_tokenizer(), HERMES_TOOLS)
    import real_tokenizers

    tok = getattr(real_tokenizers, name)()
    return tok if name == "smollm2" else with_template(tok, HERMES_TOOLS)


def scripted_replies(tok) -> list[list[int]]:
    """Token ids of the model's answers: tool calls, each ended by eos."""
    out = []
    for k in range(12):
        args = {"expr": f"{13 + k}*17 + {7 + k}*29"}
        as_template = '<tool_call>\n{"name": "calc", "arguments": ' + json.dumps(args) + "}\n</tool_call>"
        compact = "<tool_call>" + json.dumps({"name": "calc", "arguments": args}, separators=(",", ":")) + "</tool_call>"
        text = f"Step {k + 1}: I add the two totals.\n" + as_template
        reply = (as_template, compact, text)[k % 3]
        out.append(tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id])
    return out


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_gateway(db: Path, upstream: str, tokdir: str, key: str, context: str):
    cmd = [sys.executable, "-m", "tracetrain.gateway.serve", "--db", str(db), "--port", "0",
           "--engine", "upstream", "--upstream-url", upstream, "--model", "fake",
           "--tokenizer", tokdir, "--max-context", "16384", "--context", context]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TRACETRAIN_ADMIN_KEY": key})
    line = proc.stdout.readline()
    if not line.startswith("TRACETRAIN_GATEWAY_URL="):
        proc.kill()
        raise RuntimeError(f"gateway did not start: {line!r}")
    return proc, line.strip().split("=", 1)[1]


async def play(url: str, key: str, clients: int, turns: int, pid: int) -> tuple[list[str], list[float]]:
    """`clients` conversations of `turns` calls, in lockstep; returns (rollout ids, gateway CPU
    seconds per request at each turn)."""
    admin = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(headers=admin) as s:
        async with s.post(url + "/rollouts", json={"rollouts": [{}] * clients}) as r:
            made = (await r.json())["rollouts"]
    sessions = [
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1),
            headers={"Authorization": f"Bearer {m['api_key']}"},
        )
        for m in made
    ]
    histories = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
                 for _ in made]

    async def call(k: int) -> None:
        body = {"model": "fake", "messages": histories[k], "tools": TOOLS, "max_tokens": 96}
        async with sessions[k].post(made[k]["base_url"] + "/chat/completions", json=body) as r:
            answer = await r.json()
            assert r.status == 200, answer
        message = answer["choices"][0]["message"]
        histories[k].append({key: v for key, v in message.items() if v is not None})
        for tc in message.get("tool_calls") or []:
            histories[k].append({"role": "tool", "tool_call_id": tc["id"],
                                 "content": f"{1000 + 37 * len(histories[k])}"})
        if not message.get("tool_calls"):
            histories[k].append({"role": "user", "content": "Go on."})

    per_turn = []
    try:
        for _ in range(turns):
            c0 = cpu_s(pid)
            await asyncio.gather(*(call(k) for k in range(clients)))
            per_turn.append((cpu_s(pid) - c0) / clients)
    finally:
        for s in sessions:
            await s.close()
    async with aiohttp.ClientSession(headers=admin) as s:
        patch = {"rollouts": [{"rollout_id": m["rollout_id"], "state": "succeeded"} for m in made]}
        async with s.patch(url + "/rollouts", json=patch) as r:
            assert r.status == 200, await r.text()
    return [m["rollout_id"] for m in made], per_turn


def run(context: str, turns: int, args, tok, tokdir: str, upstream: str, tmp: Path) -> dict:
    from tracetrain.aggregate import aggregate
    from tracetrain.store import SQLiteStore

    key = secrets.token_hex(16)
    db = tmp / f"{context}-{turns}.db"
    proc, url = start_gateway(db, upstream, tokdir, key, context)
    try:
        ids, per_turn = asyncio.run(play(url, key, args.clients, turns, proc.pid))
    finally:
        proc.kill()
        proc.wait()
    with SQLiteStore(db) as store:
        rollouts = store.load_rollouts(rollout_ids=ids)
    _, m = aggregate(rollouts, max_prompt_length=16384, max_response_length=16384,
                     pad_token_id=tok.pad_token_id or 0, tokenizer=tok)
    n = len(rollouts)
    out = {
        "context": context,
        "turns": turns,
        "breaks": m["breaks/total"] / n,
        "by_kind": {k: m.get(f"breaks/{k}", 0) / n
                    for k in ("retokenization", "assistant_rewrite", "context_rewrite")},
        "rows": m["n_rows"] / n,
        "forward_tokens": m["tokens/non_pad"] / n,
        "cpu_ms": 1e3 * sum(per_turn) / len(per_turn),
        "cpu_ms_last": 1e3 * per_turn[-1],
    }
    kinds = " ".join(f"{k[:6]} {v:.2f}" for k, v in out["by_kind"].items())
    print(f"  {context:<8} {turns:3d} turns: breaks/rollout {out['breaks']:6.2f} ({kinds})  "
          f"rows/rollout {out['rows']:6.2f}  forward tokens/rollout {out['forward_tokens']:8.0f}  "
          f"gateway CPU {out['cpu_ms']:.2f} ms/req (last turn {out['cpu_ms_last']:.2f})", flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, nargs="+", default=[8, 32])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--tokenizer", default="qwen", choices=["qwen", "smollm2", "deepseek", "tiny"])
    args = p.parse_args(argv)
    tok = tokenizer(args.tokenizer)
    print(f"tokenizer {args.tokenizer} ({len(tok)} ids), template "
          f"{'its own' if args.tokenizer == 'smollm2' else 'HERMES_TOOLS'}; {args.clients} clients; "
          f"{os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tokdir = str(tmp / "tok")
        tok.save_pretrained(tokdir)
        fake, upstream = spawn_fake_upstream(vocab_size=len(tok), eos_id=tok.eos_token_id,
                                             max_model_len=16384)
        try:
            async def script():
                async with aiohttp.ClientSession() as s:
                    async with s.post(upstream + "/fake/config",
                                      json={"replies": scripted_replies(tok)}) as r:
                        assert r.status == 200, await r.text()
            asyncio.run(script())
            results = []
            for turns in args.turns:
                t0 = time.perf_counter()
                pair = {c: run(c, turns, args, tok, tokdir, upstream, tmp) for c in ("template", "exact")}
                results.append(pair)
                e, t = pair["exact"], pair["template"]
                print(f"  {turns} turns, template / exact: gateway CPU per request "
                      f"{t['cpu_ms'] / e['cpu_ms']:.2f}x (last turn {t['cpu_ms_last'] / e['cpu_ms_last']:.2f}x), "
                      f"forward tokens {t['forward_tokens'] / e['forward_tokens']:.2f}x, "
                      f"rows {t['rows'] / e['rows']:.2f}x   [{time.perf_counter() - t0:.0f} s]", flush=True)
        finally:
            fake.kill()
            fake.wait()


if __name__ == "__main__":
    main()
