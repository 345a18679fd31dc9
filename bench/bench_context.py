"""Exact context vs the template's full render, side by side: a multi-turn tool-using agent.

    .venv/bin/python bench/bench_context.py [--turns 8 32] [--clients 32] [--tokenizer qwen]

Each run starts `python -m tracetrain.gateway.serve --engine upstream --context {exact|template}`
(its own process) in front of tests/support/fake_upstream.py, which answers with scripted token ids: tool
calls tokenized by the real tokenizer, a third of them written exactly as the template writes a
call, a third in compact JSON, a third after a sentence of text. `--clients` agents (one rollout
each, one keep-alive connection each) play a `--turns`-turn conversation in lockstep: each sends
its whole history (system prompt, task, every answer as the SDK returned it, every tool result)
with the tools, as harnesses do. The chat template is HERMES_TOOLS (tests/support/chat_templates.py: Qwen
2.5 / Hermes behaviour) on the Qwen tokenizer (tests/support/real_tokenizers.py) or another (--tokenizer).

Per policy and conversation length it prints, from the recorded turns (aggregate at the
trajectory level, with the tokenizer): prefix breaks per rollout by kind, rows per rollout, the
tokens a training step forwards per rollout, the bytes of token ids the store keeps per rollout,
and the gateway's CPU per request (all its threads, from /proc/PID/task/*/schedstat): the mean
over the conversation, over its last 4 turns, and at its last turn (the requests whose history
holds every earlier turn). Each policy runs --repeats times, alternating;
the ratios compare the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
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
JSON = {"Content-Type": "application/json"}
LAST = 4  # turns at the end of a conversation whose CPU is also shown apart
SYSTEM = "You are a careful calculator agent. Use the calc tool for every step of arithmetic."
TASK = "A shop sells pens at 17 each and pads at 29 each. What do 13 pens and 7 pads cost?"


def tokenizer(name: str):
    if name == "tiny":
        from tracetrain.models.tiny import build_tokenizer

        return with_template(build_tokenizer(), HERMES_TOOLS)
    import real_tokenizers

    return with_template(getattr(real_tokenizers, name)(), HERMES_TOOLS)


def scripted_replies(tok) -> list[list[int]]:
    """Token ids of the model's answers: tool calls, each ended by eos. 16 of them: a round of 32
    calls (any multiple of 16) gets each twice, whichever gateway it goes through."""
    out = []
    for k in range(16):
        args = {"expr": f"{13 + k}*17 + {7 + k}*29"}
        as_template = '<tool_call>\n{"name": "calc", "arguments": ' + json.dumps(args) + "}\n</tool_call>"
        compact = ("<tool_call>" + json.dumps({"name": "calc", "arguments": args}, separators=(",", ":"))
                   + "</tool_call>")
        text = f"Step {k + 1}: I add the two totals.\n" + as_template
        reply = (as_template, compact, text)[k % 3]
        out.append(tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id])
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds of a process, all its threads, from schedstat (nanoseconds; /proc/PID/stat
    counts 10 ms ticks, too coarse for one round of requests)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            pass
    return total / 1e9


# With 2+ CPUs the gateway gets the last one to itself and the clients and the fake upstream the
# others: its CPU time per request then does not depend on where the scheduler put whom.
CPUS = sorted(os.sched_getaffinity(0))
GATEWAY_CPUS = CPUS[-1:] if len(CPUS) > 1 else CPUS
OTHER_CPUS = CPUS[:-1] if len(CPUS) > 1 else CPUS


def pin(pid: int, cpus: list[int]) -> None:
    for task in Path(f"/proc/{pid}/task").iterdir():  # every thread, those started so far
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, OSError):
            pass


def launch(what: str, cmd: list[str], env: dict | None = None):
    """(process, URL) of `what` (a gateway) started by `cmd`, pinned to the gateway's CPU, once it
    prints its TRACETRAIN_GATEWAY_URL line."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    pin(proc.pid, GATEWAY_CPUS)
    line = proc.stdout.readline()
    if not line.startswith("TRACETRAIN_GATEWAY_URL="):
        proc.kill()
        raise RuntimeError(f"{what} did not start: {line!r}")
    return proc, line.strip().split("=", 1)[1]


def start_gateway(db: Path, upstream: str, tokdir: str, key: str, context: str):
    cmd = [sys.executable, "-m", "tracetrain.gateway.serve", "--db", str(db), "--port", "0",
           "--engine", "upstream", "--upstream-url", upstream, "--model", "fake",
           "--tokenizer", tokdir, "--max-context", "16384", "--context", context]
    return launch("gateway", cmd, env={**os.environ, "TRACETRAIN_ADMIN_KEY": key})


def start_bare(upstream: str):
    """bench/bare_gateway.py: the floor of any gateway on this stack."""
    return launch("bare gateway", [sys.executable, str(ROOT / "bench" / "bare_gateway.py"), upstream])


class Agents:
    """`clients` conversations through one gateway: one rollout and keep-alive connection each."""

    def __init__(self, url: str, key: str, clients: int, pid: int):
        self.url, self.key, self.clients, self.pid = url, key, clients, pid
        self.cpu_per_request: list[float] = []  # gateway CPU seconds per request, each turn

    async def __aenter__(self):
        admin = {"Authorization": f"Bearer {self.key}"}
        async with aiohttp.ClientSession(headers=admin) as s:
            async with s.post(self.url + "/rollouts", json={"rollouts": [{}] * self.clients}) as r:
                self.made = (await r.json())["rollouts"]
        self.sessions = [
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1),
                                  headers={"Authorization": f"Bearer {m['api_key']}"})
            for m in self.made
        ]
        self.histories = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
                          for _ in self.made]
        self.sent: list[list[int]] = [[] for _ in self.made]  # per agent: messages sent, each call
        return self

    async def __aexit__(self, *exc):
        for s in self.sessions:
            await s.close()
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.key}"}) as s:
            patch = {"rollouts": [{"rollout_id": m["rollout_id"], "state": "succeeded"}
                                  for m in self.made]}
            async with s.patch(self.url + "/rollouts", json=patch) as r:
                assert r.status == 200, await r.text()

    async def call(self, k: int) -> None:
        """Agent k's next model call: its whole history and the tools, as harnesses send them;
        the answer and the tool results are appended to the history."""
        history = self.histories[k]
        self.sent[k].append(len(history))
        body = {"model": "fake", "messages": history, "tools": TOOLS, "max_tokens": 96}
        async with self.sessions[k].post(self.made[k]["base_url"] + "/chat/completions",
                                         data=orjson.dumps(body), headers=JSON) as r:
            answer = orjson.loads(await r.read())
            assert r.status == 200, answer
        message = answer["choices"][0]["message"]
        history.append({key: v for key, v in message.items() if v is not None})
        for tc in message.get("tool_calls") or []:
            history.append({"role": "tool", "tool_call_id": tc["id"],
                            "content": f"{1000 + 37 * len(history)}"})
        if not message.get("tool_calls"):
            history.append({"role": "user", "content": "Go on."})

    async def turn(self) -> None:
        """Every agent's next call at once; the gateway's CPU for them is recorded."""
        c0 = cpu_s(self.pid)
        await asyncio.gather(*(self.call(k) for k in range(self.clients)))
        self.cpu_per_request.append((cpu_s(self.pid) - c0) / self.clients)

    @property
    def rollout_ids(self) -> list[str]:
        return [m["rollout_id"] for m in self.made]


async def play(gateways: dict, clients: int, turns: int) -> dict[str, Agents]:
    """The same conversations through each gateway, turn by turn, alternating which goes first:
    the machine's speed drifts (here by up to a third within seconds) hit both alike."""
    agents = {c: Agents(url, key, clients, pid) for c, (url, key, pid) in gateways.items()}
    for a in agents.values():
        await a.__aenter__()
    try:
        order = list(agents)
        for turn in range(turns):
            for c in order if turn % 2 == 0 else order[::-1]:
                await agents[c].turn()
    finally:
        for a in agents.values():
            await a.__aexit__()
    return agents


def cpu_figures(agents: Agents) -> dict[str, float]:
    """The gateway's CPU per request, ms: over the conversation, its last turns, its last turn."""
    per_turn = agents.cpu_per_request
    return {
        "cpu_ms": 1e3 * sum(per_turn) / len(per_turn),
        "cpu_ms_last": 1e3 * sum(per_turn[-LAST:]) / len(per_turn[-LAST:]),
        "cpu_ms_end": 1e3 * per_turn[-1],  # the requests at the last turn (the deepest history)
    }


def cpu_text(figs: dict, turns: int) -> str:
    return (f"gateway CPU {figs['cpu_ms']:.2f} ms/req (last {LAST} turns {figs['cpu_ms_last']:.2f}, "
            f"turn {turns} {figs['cpu_ms_end']:.2f})")


def figures(context: str, turns: int, agents: Agents, db: Path, tok) -> dict:
    from tracetrain.rows.aggregate import aggregate
    from tracetrain.store import SQLiteStore

    with SQLiteStore(db) as store:
        rollouts = store.load_rollouts(rollout_ids=agents.rollout_ids)
    _, m = aggregate(rollouts, max_prompt_length=16384, max_response_length=16384,
                     pad_token_id=tok.pad_token_id or 0, tokenizer=tok)
    n = len(rollouts)
    with closing(sqlite3.connect(db)) as conn:  # what the store keeps of the turns' ids (bytes)
        (stored,) = conn.execute(
            "SELECT SUM(length(prompt_ids) + length(response_ids)) FROM turns"
        ).fetchone()
    out = {
        "context": context,
        "turns": turns,
        "breaks": m["breaks/total"] / n,
        "by_kind": {k: m.get(f"breaks/{k}", 0) / n
                    for k in ("retokenization", "assistant_rewrite", "context_rewrite")},
        "rows": m["n_rows"] / n,
        "forward_tokens": m["tokens/non_pad"] / n,
        "stored_kb": stored / n / 1024,
        **cpu_figures(agents),
    }
    kinds = " ".join(f"{k[:6]} {v:.2f}" for k, v in out["by_kind"].items())
    print(f"  {context:<8} {turns:3d} turns: breaks/rollout {out['breaks']:6.2f} ({kinds})  "
          f"rows/rollout {out['rows']:6.2f}  forward tokens/rollout {out['forward_tokens']:8.0f}  "
          f"ids stored/rollout {out['stored_kb']:6.1f} kB  "
          f"{cpu_text(out, turns)}", flush=True)
    return out


def prompt_cpu(agents: Agents, db: Path, tok) -> dict[str, float]:
    """The prompt's part alone, in this process: every request of the exact gateway's run replayed
    turn by turn (all agents, as the gateway saw them) through each policy's prompt code, ms per
    request: `template` the full render and its encode (render.full_prompt_ids with a PromptEncoder,
    as the gateway does), `exact` ExactContext (serializing the messages, matching the earlier
    turn, rendering and encoding the new messages, remembering the answer). Each replayed exact
    prompt is checked against the ids the gateway recorded."""
    import gc

    from tracetrain.gateway.context import ExactContext, messages_json
    from tracetrain.gateway.prompt_cache import PromptEncoder
    from tracetrain.gateway.render import chat_messages, full_prompt_ids, template_text
    from tracetrain.gateway.schemas import ChatCompletionIn
    from tracetrain.store import SQLiteStore

    with SQLiteStore(db) as store:
        turns = {r.rollout_id: r.turns for r in store.load_rollouts(rollout_ids=agents.rollout_ids)}
    full_encoder, exact_encoder = PromptEncoder(tok), PromptEncoder(tok)
    context = ExactContext(exact_encoder, lambda m, t, g: template_text(tok, m, t, g))
    context.warm()
    spent: dict[str, list[float]] = {"template": [], "exact": []}  # seconds, per turn
    gc.collect()
    gc.disable()  # the gateway runs its cyclic GC rarely too (serve.py)
    try:
        for turn in range(len(agents.sent[0])):
            per = {"template": 0.0, "exact": 0.0}
            for k, rid in enumerate(agents.rollout_ids):
                history, n = agents.histories[k], agents.sent[k][turn]
                data = {"messages": history[:n], "tools": TOOLS}
                messages, tools = chat_messages(ChatCompletionIn.model_validate(data), data)
                recorded = turns[rid][turn]
                t0 = time.perf_counter()
                full_prompt_ids(tok, messages, tools, full_encoder)
                t1 = time.perf_counter()
                sent = messages_json(messages)
                built = context.build(
                    rid, messages, tools,
                    lambda m=messages, t=tools: full_prompt_ids(tok, m, t, exact_encoder),
                    first=turn == 0, sent=sent)
                prompt = built.prompt_ids if built.ids is None else built.ids
                context.answered(rid, turn, messages, tools, history[n], prompt,
                                 recorded.response_ids, sent=sent)
                t2 = time.perf_counter()
                assert built.prompt_ids == list(recorded.prompt_ids), (rid, turn)
                per["template"] += t1 - t0
                per["exact"] += t2 - t1
            for c in per:
                spent[c].append(per[c] / len(agents.rollout_ids))
    finally:
        gc.enable()
    out = {}
    for c, per_turn in spent.items():
        out[f"prompt_{c}_ms"] = 1e3 * sum(per_turn) / len(per_turn)
        out[f"prompt_{c}_ms_end"] = 1e3 * per_turn[-1]
    return out


def run(turns: int, args, tok, tokdir: str, upstream: str, tmp: Path) -> dict[str, dict]:
    """Both policies side by side, each its own gateway process, on the same CPU (and with
    args.bare the bare gateway too: its CPU figures only)."""
    procs, gateways, dbs = [], {}, {}
    try:
        for c in ("template", "exact"):
            key = secrets.token_hex(16)
            dbs[c] = tmp / f"{c}-{turns}-{secrets.token_hex(4)}.db"
            proc, url = start_gateway(dbs[c], upstream, tokdir, key, c)
            procs.append(proc)
            gateways[c] = (url, key, proc.pid)
        if args.bare:
            proc, url = start_bare(upstream)
            procs.append(proc)
            gateways["bare"] = (url, "bare", proc.pid)
        agents = asyncio.run(play(gateways, args.clients, turns))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    out = {c: figures(c, turns, agents[c], dbs[c], tok) for c in agents if c != "bare"}
    if args.bare:
        out["bare"] = {"context": "bare", "sent": agents["bare"].sent, **cpu_figures(agents["bare"])}
        out["exact"]["sent"] = agents["exact"].sent
        print(f"  bare      {turns:3d} turns: {cpu_text(out['bare'], turns)}", flush=True)
    prompt = prompt_cpu(agents["exact"], dbs["exact"], tok)
    print(f"  prompt only, in-process replay of the exact run: template {prompt['prompt_template_ms']:.3f} "
          f"ms/req (turn {turns} {prompt['prompt_template_ms_end']:.3f}), "
          f"exact {prompt['prompt_exact_ms']:.3f} "
          f"ms/req (turn {turns} {prompt['prompt_exact_ms_end']:.3f})", flush=True)
    for c in out:
        out[c].update(prompt)
    return out


def median_run(runs: list[dict]) -> dict:
    """The runs' figures (all equal but the CPU ones) with the CPU figures' medians."""
    out = dict(runs[0])
    for k in ("cpu_ms", "cpu_ms_last", "cpu_ms_end", "prompt_template_ms", "prompt_template_ms_end",
              "prompt_exact_ms", "prompt_exact_ms_end"):
        if k in out:  # the bare gateway has no prompt figures
            out[k] = statistics.median(r[k] for r in runs)
    return out


def floor(pair: dict[str, dict], turns: int, repeats: int) -> None:
    """What the bare gateway says: each policy's CPU above the floor, and the most template /
    exact could be were the gateway's shared path (all but the prompt) as cheap as the bare one's:
    (bare + template's prompt) / (bare + exact's prompt); (x + T) / (x + E) falls as x grows."""
    b, e, t = pair["bare"], pair["exact"], pair["template"]
    for at, end in (("mean", ""), (f"turn {turns}", "_end")):
        bare, template, exact = (x[f"cpu_ms{end}"] for x in (b, t, e))
        ceiling = (bare + e[f"prompt_template_ms{end}"]) / (bare + e[f"prompt_exact_ms{end}"])
        print(f"  {turns} turns, medians of {repeats}, {at}: bare gateway {bare:.2f} ms/req; above "
              f"it template +{template - bare:.2f}, exact +{exact - bare:.2f} ms/req; template / "
              f"exact at most {ceiling:.2f}x with a shared path as cheap as the bare one's "
              f"(measured {template / exact:.2f}x)", flush=True)


def main(argv=None) -> list[dict[str, dict]]:
    """Per conversation length, {policy: its figures (medians)}; also printed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, nargs="+", default=[8, 32])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="runs per policy; CPU figures: medians")
    p.add_argument("--tokenizer", default="qwen", choices=["qwen", "smollm2", "deepseek", "tiny"])
    p.add_argument("--bare", action="store_true",
                   help="play the conversations through bench/bare_gateway.py too: the floor")
    args = p.parse_args(argv)
    tok = tokenizer(args.tokenizer)
    print(f"tokenizer {args.tokenizer} ({len(tok)} ids), template HERMES_TOOLS; {args.clients} clients; "
          f"gateway on CPU {GATEWAY_CPUS}, clients and fake upstream on {OTHER_CPUS}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tokdir = str(tmp / "tok")
        tok.save_pretrained(tokdir)
        pin(os.getpid(), OTHER_CPUS)
        fake, upstream = spawn_fake_upstream(vocab_size=len(tok), eos_id=tok.eos_token_id,
                                             max_model_len=16384)
        pin(fake.pid, OTHER_CPUS)
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
                runs: dict[str, list] = {}
                for _ in range(args.repeats):
                    for c, out in run(turns, args, tok, tokdir, upstream, tmp).items():
                        runs.setdefault(c, []).append(out)
                pair = {c: median_run(rs) for c, rs in runs.items()}
                results.append(pair)
                e, t = pair["exact"], pair["template"]
                print(f"  {turns} turns, medians of {args.repeats}, template / exact: "
                      f"gateway CPU per request {t['cpu_ms'] / e['cpu_ms']:.2f}x "
                      f"(last {LAST} turns {t['cpu_ms_last'] / e['cpu_ms_last']:.2f}x, "
                      f"turn {turns} {t['cpu_ms_end'] / e['cpu_ms_end']:.2f}x), "
                      f"forward tokens {t['forward_tokens'] / e['forward_tokens']:.2f}x, "
                      f"ids stored {t['stored_kb'] / e['stored_kb']:.2f}x, "
                      f"rows {t['rows'] / e['rows']:.2f}x   [{time.perf_counter() - t0:.0f} s]", flush=True)
                print(f"  {turns} turns, medians of {args.repeats}: the prompt alone (in-process replay) "
                      f"template {e['prompt_template_ms']:.3f} ms/req, exact {e['prompt_exact_ms']:.3f} "
                      f"ms/req: {e['prompt_template_ms'] / e['prompt_exact_ms']:.2f}x (turn {turns} "
                      f"{e['prompt_template_ms_end']:.3f} vs {e['prompt_exact_ms_end']:.3f} ms: "
                      f"{e['prompt_template_ms_end'] / e['prompt_exact_ms_end']:.2f}x)", flush=True)
                if args.bare:
                    floor(pair, turns, args.repeats)
        finally:
            fake.kill()
            fake.wait()
    return results


if __name__ == "__main__":
    main()
