"""The vllm engine against a real vLLM server: the CPU build of vLLM in its own venv
(scripts/install-vllm.sh; another interpreter with $TRACETRAIN_VLLM_PYTHON), started here on the
tiny model. Without it the tests skip, saying so; under CI (CI set) they fail instead.

Tolerance: the trainer's fp32 logprobs and vLLM's fp32 logprobs for the same weights agree to
1e-4 (measured: 2e-6 at most on the tiny model)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import sqlite3
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest
import torch
from gateway_fixtures import live_gateway
from openai import OpenAI
from safetensors import safe_open

from tracetrain.config import ConfigError, LocalEngineConfig, build_config
from tracetrain.engines.base import EngineError, SamplingParams
from tracetrain.engines.upstream import UpstreamEngine
from tracetrain.engines.vllm import VLLMEngine
from tracetrain.engines.vllm_server import SERVED_NAME, VLLMServer, server_command
from tracetrain.models.save import write_hf_dir
from tracetrain.models.tiny import build_model, build_tokenizer
from tracetrain.run.trainer import train

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "guess"
TOL = 1e-4
# vLLM's engine core in its server's process (vLLM's own VLLM_ENABLE_V1_MULTIPROCESSING=0): one
# process fewer to start per server. The demo's and the SIGTERM test's servers keep vLLM's defaults.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
IN_PROCESS_KEY = "engine.env=" + json.dumps(IN_PROCESS)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get("TRACETRAIN_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
    ok = os.path.isfile(python) and subprocess.run(
        [python, "-c", "import vllm"], capture_output=True, timeout=300).returncode == 0
    if not ok:
        why = f"no vLLM at {python} (bash scripts/install-vllm.sh)"
        if os.environ.get("CI"):
            pytest.fail(why + ": CI installs it", pytrace=False)
        pytest.skip(why)
    return python


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


# the served model's positions and vLLM's max_model_len: the cancel test's answer is long
SERVED_CONTEXT = 2048


@pytest.fixture(scope="module")
def served(tmp_path_factory, vllm_python, tok):
    """One server for the module, started on the tiny model (tied embeddings, written untied)."""
    model = build_model(tok, max_position_embeddings=SERVED_CONTEXT, seed=0)
    d = write_hf_dir(model, tok, tmp_path_factory.mktemp("served") / "weights")
    server = VLLMServer.launch(vllm_python, d, d.parent / "vllm.log", max_model_len=SERVED_CONTEXT,
                               dtype="float32", start_timeout_s=600)
    try:
        yield server, model, d
    finally:
        server.stop()


def engine_on(served, tok) -> VLLMEngine:
    """An engine on the module's server that does not stop it when closed."""
    server, _, d = served
    return VLLMEngine(VLLMServer(None, server.base_url), tok, d, max_context=SERVED_CONTEXT,
                      timeout=120)


def chat(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}],
                                   add_generation_prompt=True)["input_ids"]


def greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def teacher_forced(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def perturbed(model, seed: int, scale: float = 0.05):
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():  # tied: the embedding (= output layer) moves once
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return new.eval()


NO_STOP = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=())


async def ask(engine, prompt, params=NO_STOP):
    return await engine.generate(prompt, params)


# ----------------------------------------------------------------------------- no server needed
def test_the_hf_dir_is_untied_and_gives_the_same_logits(tmp_path, tok):
    from transformers import AutoModelForCausalLM

    model = build_model(tok, seed=1)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    d = write_hf_dir(model, tok, tmp_path / "policy")
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(f.keys())
    assert json.loads((d / "config.json").read_text())["tie_word_embeddings"] is False
    assert ((d / "chat_template.jinja").is_file()
            or "chat_template" in (d / "tokenizer_config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(d, local_files_only=True).eval()
    x = torch.tensor([chat(tok, "Guess.")])
    torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=1e-6)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # untouched


def test_server_command_adds_defaults_only_where_args_do_not_set_them():
    cmd = server_command("py", "/m", 9, max_model_len=512, dtype="float32", args=[], cuda=False)
    flags = " ".join(cmd)
    for part in ("--served-model-name policy", "--host 127.0.0.1", "--port 9", "--max-model-len 512",
                 "--dtype float32", "--logprobs-mode processed_logprobs", "--enforce-eager",
                 "--gpu-memory-utilization 0.1", "--optimization-level 0",
                 "--no-enable-chunked-prefill", "--max-num-batched-tokens 2048"):
        assert part in flags
    mine = ["-O3", "--dtype=bfloat16", "--gpu-memory-utilization", "0.5", "--enable-chunked-prefill"]
    cmd = server_command("py", "/m", 9, max_model_len=512, dtype="float32", args=mine, cuda=False)
    assert cmd[-5:] == mine
    assert "--optimization-level" not in cmd and "--gpu-memory-utilization" not in cmd[:-5]
    assert "--no-enable-chunked-prefill" not in cmd
    assert "--dtype" not in cmd  # given as --dtype=bfloat16 only
    gpu = server_command("py", "/m", 9, max_model_len=512, dtype="float32", args=[], cuda=True)
    assert "--enforce-eager" not in gpu and "--gpu-memory-utilization" not in gpu


class RecordingNccl:
    """Stands in for torch.cuda.nccl (no GPU here): records what rank 0 does."""

    def __init__(self):
        self.uid, self.calls, self.sent = bytes(range(128)), [], []

    def unique_id(self) -> bytes:
        return self.uid

    def join(self, world_size, uid, rank):
        self.calls.append(("join", world_size, uid, rank))
        return "comm"

    def broadcast(self, comm, tensor):
        assert comm == "comm"
        self.sent.append(tensor.clone())


def test_nccl_sync_speaks_vllms_weight_transfer_protocol(tok):
    """Up to the NCCL calls: the routes, their bodies and order, and what rank 0 broadcasts
    (every tensor named in update_info, in its order, the tied output layer included)."""
    import base64

    from fake_upstream import FakeUpstream

    from tracetrain.engines.vllm import NcclTransport

    model = build_model(tok, seed=2)
    ops = RecordingNccl()
    with FakeUpstream() as fake:
        async def go():
            engine = VLLMEngine(VLLMServer(None, fake.url), tok, "/unused", max_context=512,
                                transport=NcclTransport(ops))
            try:
                await engine.load_weights(model, 1)
                await engine.load_weights(perturbed(model, 3), 2)
            finally:
                await engine.aclose()
            return engine

        engine = asyncio.run(go())
        calls = fake.app.state.weight_calls
    routes = [r for r, _ in calls]
    one = ["/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"]
    assert routes == ["/init_weight_transfer_engine"] + one + one  # joined once
    init = calls[0][1]["init_info"]
    assert base64.b64decode(init["nccl_unique_id_b64"]) == ops.uid
    assert (init["rank_offset"], init["world_size"], init["packed"]) == (1, 2, False)
    assert ops.calls == [("join", 2, ops.uid, 0)]
    sd = model.state_dict()
    info = calls[2][1]["update_info"]
    assert "lm_head.weight" in info["names"] and set(info["names"]) == set(sd)
    assert info["dtype_names"] == ["float32"] * len(sd)
    assert info["shapes"] == [list(sd[n].shape) for n in info["names"]]
    for name, sent in zip(info["names"], ops.sent[: len(sd)], strict=True):
        torch.testing.assert_close(sent, sd[name], rtol=0, atol=0)
    assert len(ops.sent) == 2 * len(sd)
    assert [calls[k][1] for k in (3, 7)] == [{"weight_version": "1"}, {"weight_version": "2"}]
    assert engine.model_version == 2


@pytest.mark.parametrize("level, calls", [
    (1, ["/sleep?level=1", "/wake_up", "/collective_rpc", "/reset_prefix_cache"]),
    (2, ["/sleep?level=2", "/wake_up?tags=weights", "/collective_rpc", "/wake_up?tags=kv_cache",
         "/reset_prefix_cache"]),
])
def test_a_sleeping_server_is_woken_around_the_weight_push(tmp_path, tok, level, calls):
    """One GPU: asleep during the update; level 2 gets its weights' memory back before the push,
    its KV cache after it. Up to the routes (sleep mode needs CUDA)."""
    from fake_upstream import FakeUpstream

    model = build_model(tok, seed=2)
    d = write_hf_dir(model, tok, tmp_path / "weights")
    with FakeUpstream() as fake:
        async def go():
            engine = VLLMEngine(VLLMServer(None, fake.url), tok, d, max_context=512)
            try:
                await engine.sleep(level)
                await engine.load_weights(perturbed(model, 4), 1)
                await engine.load_weights(model, 2)  # awake now: no wake_up
            finally:
                await engine.aclose()

        asyncio.run(go())
        routes = [r for r, _ in fake.app.state.weight_calls]
    assert routes == calls + ["/collective_rpc", "/reset_prefix_cache"]
    assert fake.app.state.weight_calls[calls.index("/collective_rpc")][1] == {
        "method": "reload_weights", "kwargs": {"weights_path": str(d.resolve())}}


def test_the_log_tail_keeps_the_error_that_killed_the_server(tmp_path):
    from tracetrain.engines.vllm_server import log_tail

    log = tmp_path / "vllm.log"
    killer = "(Worker pid=7) ERROR 12-02 04:43:21 [multiproc_executor.py:1063] RuntimeError: boom"
    noise = ["(APIServer pid=6) WARNING [system_utils.py:255] Found ulimit ... OSError: [Errno 24]",
             "  warn: ModuleNotFoundError(\"No module named 'x'\")"]
    log.write_text("\n".join(["start", killer, *noise] + [f"shutdown {i}" for i in range(20)]))
    tail = log_tail(log, 5).splitlines()
    assert tail[0].endswith(killer) and tail[1].strip() == "..."
    assert [t.strip() for t in tail[2:]] == [f"shutdown {i}" for i in range(15, 20)]
    log.write_text("\n".join(noise + [f"line {i}" for i in range(10)]))
    assert "last error" not in log_tail(log, 5)  # warnings that mention an error are not one


def test_stop_kills_what_is_left_of_a_server_that_exited(tmp_path):
    """vLLM's API server can exit and leave its engine processes behind in its process group:
    stop() still ends them."""
    leader = subprocess.Popen(["sh", "-c", "sleep 300 & echo $! > child; exit 0"], cwd=tmp_path,
                              start_new_session=True)
    leader.wait(10)
    child = int((tmp_path / "child").read_text())
    assert live_in_groups([leader.pid]) == [child]
    VLLMServer(leader, "http://127.0.0.1:9").stop(timeout_s=5)
    assert live_in_groups([leader.pid]) == []


def vllm_config(run_dir: Path, steps: int, extra: list[str] = ()):
    return build_config({"task_args": {"high": 4, "max_turns": 3}}, [
        "task=task.py", "warm_start.steps=3", "warm_start.batch_size=8",
        "rollout.tasks_per_step=3", "rollout.n_per_task=4", "rollout.timeout_s=60",
        "optim.lr=1e-2", "optim.warmup_steps=0", f"trainer.steps={steps}",
        f"trainer.run_dir={run_dir}", "trainer.eval_every=0", "engine.kind=vllm", *extra])


@pytest.mark.parametrize("extra, key", [
    (["engine.python=/no/such/python"], "engine.python"),
    (["engine.base_url=http://127.0.0.1:9", "engine.start_timeout_s=2"], "engine.base_url"),
    (["engine.python=/usr/bin/python3", "engine.base_url=http://127.0.0.1:9"], "engine.python"),
    (["engine.python=/usr/bin/python3", "engine.sync=ncl"], "engine.sync"),
    (["engine.python=/usr/bin/python3", "engine.pyhton=x"], "engine.pyhton"),
    pytest.param(["engine.python=/usr/bin/python3", "engine.sync=nccl"], "engine.sync",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine")),
    pytest.param(["engine.python=/usr/bin/python3", "engine.sleep_level=1", "trainer.collect=step"],
                 "engine.sleep_level",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine")),
    (["engine.python=/usr/bin/python3", "engine.sleep_level=2", "trainer.collect=overlap",
      "trainer.max_staleness=1"], "engine.sleep_level"),
    (["engine.base_url=http://127.0.0.1:9", "engine.sleep_level=1"], "engine.sleep_level"),
    pytest.param(["engine.python=/usr/bin/python3", "trainer.device=cuda"], "trainer.device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine")),
])
def test_a_bad_engine_section_is_an_error_naming_the_key(tmp_path, extra, key):
    with pytest.raises(ConfigError) as e:
        train(vllm_config(tmp_path / "run", 1, extra), base_dir=EXAMPLE, log=lambda *_: None)
    assert f"'{key}'" in str(e.value).splitlines()[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_interpreter_without_vllm_is_an_error_quoting_its_log(tmp_path):
    """The server exits at once (no vllm module): the error names engine.python and shows why."""
    with pytest.raises(ConfigError) as e:
        train(vllm_config(tmp_path / "run", 1, [f"engine.python={sys.executable}"]),
              base_dir=EXAMPLE, log=lambda *_: None)
    first, *rest = str(e.value).splitlines()
    assert "'engine.python'" in first and "exited with code" in first
    assert "No module named" in "\n".join(rest)


def test_the_cli_says_it_in_one_line_with_status_2(tmp_path, capsys):
    from tracetrain.cli import main

    code = main(["train", str(EXAMPLE / "config.yaml"), "engine.kind=vllm",
                 "engine.python=/no/such/python", f"trainer.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "'engine.python'" in err


# ----------------------------------------------------------------------------- a real server
@pytest.mark.slow
def test_tied_weights_sync_and_a_prompt_seen_before_gets_the_new_weights(served, tok):
    """Regression: with the tied embedding written tied, vLLM's in-place reload kept the old output
    layer and this greedy comparison failed."""
    _, model, _ = served
    seen, fresh = chat(tok, "Guess my number from 1 to 8."), chat(tok, "Higher.")

    async def go():
        engine = engine_on(served, tok)
        try:
            await engine.load_weights(model, 0)
            before = await ask(engine, seen)
            assert before.response_ids == greedy(model, seen, 12) and before.model_version == 0
            new = perturbed(model, seed=7)
            await engine.load_weights(new, 1)
            after = [await ask(engine, p) for p in (seen, fresh)]
            return before, after, new
        finally:
            await UpstreamEngine.aclose(engine)

    before, after, new = asyncio.run(go())
    assert greedy(new, seen, 12) != before.response_ids  # the update changed the answer
    assert [a.response_ids for a in after] == [greedy(new, p, 12) for p in (seen, fresh)]
    assert [a.model_version for a in after] == [1, 1]


def sampled_after_sync(served, tok, model, version: int, prompts, *, max_tokens: int,
                       temperature: float, top_p: float = 1.0):
    """Push `model` as `version` to the module's server, then sample every prompt at once
    (prompt k with seed k, no stop ids)."""
    async def go():
        engine = engine_on(served, tok)
        try:
            await engine.load_weights(model, version)
            return await asyncio.gather(*(ask(engine, p, SamplingParams(
                max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=k,
                stop_token_ids=())) for k, p in enumerate(prompts)))
        finally:
            await UpstreamEngine.aclose(engine)

    return asyncio.run(go())


@pytest.mark.slow
def test_sampled_logprobs_after_a_sync_equal_the_trainers(served, tok):
    """At temperature 0.7 (vLLM's processed logprobs, not its default raw ones) the recorded
    logprob of each sampled token is the trainer's log softmax(logits / T) of it."""
    _, model, _ = served
    new = perturbed(model, seed=11)
    prompts = [chat(tok, t) for t in ("Guess.", "Lower.", "What is 2 + 2?")]
    gens = sampled_after_sync(served, tok, new, 2, prompts, max_tokens=16, temperature=0.7)
    for p, g in zip(prompts, gens, strict=True):
        assert g.model_version == 2 and len(g.response_ids) == len(g.response_logprobs) >= 1
        theirs = torch.tensor(g.response_logprobs)
        ours = teacher_forced(new, p, g.response_ids, 0.7)
        assert float((theirs - ours).abs().max()) < TOL
        assert float((theirs - teacher_forced(new, p, g.response_ids, 1.0)).abs().max()) > 10 * TOL


@pytest.mark.slow
def test_under_top_p_vllm_records_logprobs_renormalised_over_the_nucleus(served, tok):
    """Why a run whose PPO ratio is taken against vLLM's logprobs refuses rollout.top_p < 1
    (tracetrain/run/step.py, check_top_p): at top_p 0.5, temperature 0.7, vLLM's processed
    logprob of each sampled token is log p(y) - log S (p the trainer's softmax(logits / T), S the
    mass of p's nucleus), not the trainer's log p(y), |log S| ~ 0.7 away. Positions whose nucleus
    edge lies within 1e-4 of top_p (float32 sums may put the edge token on either side) are
    skipped; most are not."""
    _, model, _ = served
    new = perturbed(model, seed=12)
    prompts = [chat(tok, t) for t in ("Guess.", "Lower.", "What is 2 + 2?")]
    gens = sampled_after_sync(served, tok, new, 3, prompts, max_tokens=16, temperature=0.7,
                              top_p=0.5)
    checked = total = 0
    for prompt, g in zip(prompts, gens, strict=True):
        ours = teacher_forced(new, prompt, g.response_ids, 0.7)
        with torch.no_grad():
            logits = new(torch.tensor([prompt + g.response_ids])).logits[0, len(prompt) - 1 : -1]
        sp = torch.softmax(logits.double() / 0.7, -1).sort(-1, descending=True).values
        before = sp.cumsum(-1) - sp
        log_s = torch.log((sp * (before < 0.5)).sum(-1))
        clear = ((before - 0.5).abs() > 1e-4).all(-1)
        theirs = torch.tensor(g.response_logprobs)
        total += len(theirs)
        checked += int(clear.sum())
        gap = theirs - (ours - log_s.float())
        if clear.any():
            assert float(gap[clear].abs().max()) < TOL
        assert float((theirs - ours).abs().min()) > 100 * TOL
    assert checked >= 0.8 * total >= 0.8 * 3 * 4


@pytest.mark.slow
def test_a_stop_string_ends_the_answer_with_the_token_that_completes_it(served, tok):
    """vLLM's `stop`: the answer is the greedy answer's prefix that ends with the token whose text
    completes the string; the ids keep that token (the gateway leaves the string out of the text)."""
    engine = engine_on(served, tok)
    prompt = chat(tok, "Say something long.")
    free = asyncio.run(ask(engine, prompt)).response_ids
    k = next(k for k in range(2, len(free) - 1) if tok.decode(free[k : k + 2]).strip())
    stop = tok.decode(free[k : k + 2])
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(), stop=(stop,))
    got = asyncio.run(ask(engine, prompt, params))
    assert got.finish_reason == "stop"
    assert got.response_ids == free[: len(got.response_ids)]
    text = tok.decode(got.response_ids)
    assert stop in text and stop not in tok.decode(got.response_ids[:-1])


@pytest.mark.slow
def test_a_streamed_answer_is_the_whole_answer(served, tok):
    """Streamed (SSE, each chunk's new token ids handed to on_tokens): the runs make the answer,
    and at temperature 0 with a seed it is the unstreamed answer, with and without a stop string."""
    engine = engine_on(served, tok)
    prompt = chat(tok, "Say something long.")
    greedy_params = SamplingParams(max_tokens=12, temperature=0.0, seed=5, stop_token_ids=())

    async def both(params):
        runs: list[list[int]] = []
        streamed = await engine.generate(prompt, params, runs.append)
        return streamed, runs, await ask(engine, prompt, params)

    async def go():
        try:
            free = await both(greedy_params)
            ids = free[0].response_ids
            k = next(k for k in range(2, len(ids) - 1) if tok.decode(ids[k : k + 2]).strip())
            stop = SamplingParams(max_tokens=12, temperature=0.0, seed=5, stop_token_ids=(),
                                  stop=(tok.decode(ids[k : k + 2]),))
            return [free, await both(stop)]
        finally:
            await UpstreamEngine.aclose(engine)

    answers = asyncio.run(go())
    for streamed, runs, whole in answers:
        assert len(runs) > 1 and all(runs)  # token by token, not the whole answer at the end
        assert [t for r in runs for t in r] == streamed.response_ids == whole.response_ids
        assert len(streamed.response_logprobs) == len(streamed.response_ids)
        torch.testing.assert_close(streamed.response_logprobs, whole.response_logprobs,
                                   rtol=0, atol=TOL)
        assert streamed.finish_reason == whole.finish_reason
    assert answers[1][0].finish_reason == "stop"


def server_metric(metrics: str, name: str, having: str = "") -> float:
    """The sum of a Prometheus metric's series in a server's /metrics text (those whose labels
    contain `having`, e.g. 'finished_reason="stop"')."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + "{") and having in line)


def settled(read, base_url: str, timeout_s: float = 30.0):
    """`read(metrics)` of the server's /metrics text once the server has nothing running or
    waiting and two reads 0.5 s apart agree (vLLM's counters of a request move after its client
    has stopped listening). One GET per read."""

    def metrics() -> str:
        return httpx.get(base_url + "/metrics", timeout=30).text

    deadline = time.monotonic() + timeout_s
    last = read(metrics())
    while time.monotonic() < deadline:
        time.sleep(0.5)
        text = metrics()
        busy = sum(server_metric(text, m) for m in ("vllm:num_requests_running",
                                                    "vllm:num_requests_waiting"))
        now = read(text)
        if not busy and now == last:
            return now
        last = now
    raise AssertionError(f"the server did not settle in {timeout_s} s: {last}")


@pytest.mark.slow
def test_cancelling_a_stream_aborts_the_request_in_vllm(served, tok):
    """The engine's task cancelled after two runs of a greedy answer as long as the context allows,
    while vLLM is still decoding it: vLLM stops decoding it (it generated fewer tokens than asked
    for, no request is left running, none finished by stop or length).

    "Still decoding": the second run came in under half the time the same answer takes whole
    (timed first, to its last token). vLLM decodes the tiny model at ~200 tokens/s here, so ~10 s.
    A trial whose second run came later (the test's process stalled, or vLLM's front end lagged
    its engine core: CI once saw vLLM decode the whole answer before the cancel) proves nothing
    and is tried again, at most 5 times; the test fails if no trial is conclusive. (Reading vLLM's
    /metrics at the cancel instead does not work: it is answered only once the answer is done.)"""
    url = served[0].base_url
    prompt = chat(tok, "Say something long.")
    params = SamplingParams(max_tokens=SERVED_CONTEXT - len(prompt), temperature=0.0,
                            stop_token_ids=())
    # vLLM counts an abort in request_success_total too (finished_reason="abort") when the abort
    # reaches its engine core before its front end: only stop and length are finishing.
    reasons = ('finished_reason="stop"', 'finished_reason="length"')

    def counts(metrics: str) -> list[float]:
        return [server_metric(metrics, "vllm:generation_tokens_total")] + [
            server_metric(metrics, "vllm:request_success_total", r) for r in reasons]

    def run(cancel_at: int | None) -> tuple[list[list[int]], float, list[float], list[float]]:
        """(runs read, seconds from the request to the cancel or the answer's end, counts before,
        counts after) of one streamed answer, cancelled at its `cancel_at`-th run."""
        engine = engine_on(served, tok)
        before = settled(counts, url)

        async def go():
            runs: list[list[int]] = []
            cancelled_at: list[float] = []

            def on_tokens(ids: list[int]) -> None:
                runs.append(ids)
                if len(runs) == cancel_at:  # cancelled from inside the engine's read loop, at
                    task.cancel()  # once: a waiter woken later may find more of the answer read
                    cancelled_at.append(time.monotonic())

            t0 = time.monotonic()
            task = asyncio.create_task(engine.generate(prompt, params, on_tokens))
            try:
                await asyncio.wait({task}, timeout=120)
                assert task.cancelled() == (cancel_at is not None), f"{task}"
                return runs, (cancelled_at or [time.monotonic()])[0] - t0
            finally:
                task.cancel()
                await UpstreamEngine.aclose(engine)

        runs, seconds = asyncio.run(go())
        return runs, seconds, before, settled(counts, url)  # vLLM learns of a cancel later

    runs, whole_s, before, after = run(None)
    assert len([t for r in runs for t in r]) == params.max_tokens
    assert [a - b for a, b in zip(after, before, strict=True)] == [params.max_tokens, 0, 1]
    seen = []
    for _ in range(5):
        runs, seconds, before, after = run(2)
        assert len([t for r in runs for t in r]) < params.max_tokens
        seen.append(round(seconds, 3))
        if seconds < whole_s / 2:  # conclusive: vLLM had over half the answer left to decode
            assert after[0] - before[0] < params.max_tokens, (before, after, whole_s, seen)
            assert after[1:] == before[1:], (before, after, whole_s, seen)
            if len(seen) > 1:  # shown in the run's warnings summary: how long the stalls were
                warnings.warn(f"cancel test: trials cancelled after {seen} s; whole: {whole_s} s",
                              stacklevel=1)
            return
    raise AssertionError(f"every trial's second run came after half the whole answer's "
                         f"{whole_s:.1f} s: {seen}")


# A schema whose every value is bounded, so that even the random model's constrained answer ends.
TRIP = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}


def a_trip(value) -> bool:
    """Whether `value` is valid for TRIP."""
    return (isinstance(value, dict) and set(value) == {"city", "days"}
            and value["city"] in ("Paris", "Rome") and type(value["days"]) is int
            and 1 <= value["days"] <= 7)


def clients(live, n: int) -> list:
    """n new rollouts of a live gateway: (rollout id, its openai client)."""
    return [(r["rollout_id"], OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0,
                                     timeout=300)) for r in live.create(n)]


@pytest.mark.slow
def test_a_json_schema_response_format_gives_json_valid_for_the_schema(tmp_path, served, tok):
    """response_format json_schema through the gateway, sent to vLLM as structured_outputs
    {"json": schema}: the random model's sampled answers parse and hold to the schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP}}
    with live_gateway(tmp_path, engine_on(served, tok), close_engines=True) as live:
        for seed, (_, client) in enumerate(clients(live, 3)):
            out = client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "Plan a trip."}], seed=seed,
                max_tokens=200, response_format=fmt)
            assert out.choices[0].finish_reason == "stop", out
            assert a_trip(json.loads(out.choices[0].message.content)), out


@pytest.mark.slow
def test_a_named_tool_choice_is_answered_with_one_call_of_that_tool(tmp_path, served, tok):
    """A named tool_choice through the gateway, sent to vLLM as the hermes structural tag: the
    answer is one call of that tool in the model's own format (the recorded ids decode to a
    <tool_call> block), which the hermes parser reads, with arguments valid for its schema."""
    tools = [{"type": "function", "function": {"name": "plan"}},
             {"type": "function", "function": {"name": "book", "parameters": TRIP}}]
    with live_gateway(tmp_path, engine_on(served, tok), close_engines=True) as live:
        for seed, (rid, client) in enumerate(clients(live, 3)):
            out = client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "Book a trip."}], seed=seed,
                max_tokens=200, tools=tools,
                tool_choice={"type": "function", "function": {"name": "book"}})
            (call,) = out.choices[0].message.tool_calls
            assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "book"
            assert a_trip(json.loads(call.function.arguments)), out
            (turn,) = live.store.get_turns(rid)
            text = tok.decode(turn.response_ids, skip_special_tokens=True)
            assert text.startswith("<tool_call>") and text.endswith("</tool_call>"), text


def test_many_seeded_requests_at_once_are_all_answered(served, tok):
    """Regression: 128 seeded requests whose prompts overflow one scheduler step (2048 tokens on
    CPU) were split by chunked prefill, and vLLM 0.32's CPU worker died rewinding a seeded
    request's generator ("CPU Generator does not use offset"); the demo's first step hit it."""
    _, model, _ = served
    prompts = [chat(tok, f"Guess my number from 1 to 8. Round {i}: " + "higher lower " * 12)
               for i in range(128)]
    assert sum(map(len, prompts)) > 3 * 2048
    gens = sampled_after_sync(served, tok, model, 0, prompts, max_tokens=4, temperature=1.0)
    assert len(gens) == 128 and all(1 <= len(g.response_ids) == len(g.response_logprobs) <= 4
                                    for g in gens)
    served[0].check_alive()


def turn_versions_by_step(run_dir: Path) -> dict[int, set[int]]:
    db = sqlite3.connect(run_dir / "traces.db")
    rows = db.execute("SELECT r.group_id, t.model_version FROM turns t JOIN rollouts r "
                      "ON r.rollout_id = t.rollout_id").fetchall()
    db.close()
    out: dict[int, set[int]] = {}
    for group, version in rows:
        step = int(group.split("-s")[1].split("-")[0])
        out.setdefault(step, set()).add(version)
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_demo_trains_through_vllm_and_its_policy_dir_is_servable(tmp_path, vllm_python, tok):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    train(vllm_config(run, 3, [f"engine.python={vllm_python}", "trainer.precision=fp32"]),
          base_dir=EXAMPLE, log=lambda *_: None)
    rows = metrics(run)
    assert [m["model_version"] for m in rows] == [1, 2, 3]
    assert turn_versions_by_step(run) == {0: {0}, 1: {1}, 2: {2}}  # each step from the last sync
    for m in rows:  # after every sync vLLM's logprobs were the trainer's for the same weights
        assert m["engine/logprob_gap_max"] < TOL and m["engine/requests"] > 0
        assert m["time/sync_s"] > 0 and m["n_failed"] == 0
    assert "exited" not in (run / "vllm.log").read_text()[-2000:].lower()

    # run_dir/policy: the trained weights, loadable by transformers and servable by vLLM as is
    ck = torch.load(run / "checkpoint.pt", weights_only=False)
    policy = AutoModelForCausalLM.from_pretrained(run / "policy", local_files_only=True).eval()
    for k, v in ck["model"].items():
        torch.testing.assert_close(policy.state_dict()[k], v, rtol=0, atol=0)
    server = VLLMServer.launch(vllm_python, run / "policy", tmp_path / "policy-vllm.log",
                               max_model_len=512, dtype="float32")
    prompts = [chat(tok, "Guess my number from 1 to 4."), chat(tok, "Guess.")]

    async def go():
        engine = VLLMEngine(server, tok, run / "policy", max_context=512)
        try:
            return [await ask(engine, p) for p in prompts]
        finally:
            await engine.aclose()

    assert [g.response_ids for g in asyncio.run(go())] == [greedy(policy, p, 12) for p in prompts]
    assert server.process is None  # aclose stopped it


@pytest.mark.slow
def test_collect_overlap_with_vllm_trains_on_rollouts_one_version_old(tmp_path, vllm_python):
    run = tmp_path / "run"
    train(vllm_config(run, 3, [f"engine.python={vllm_python}", "trainer.collect=overlap",
                               "trainer.max_staleness=1", IN_PROCESS_KEY]),
          base_dir=EXAMPLE, log=lambda *_: None)
    rows = metrics(run)
    assert [m["rollout_model_version"] for m in rows] == [0, 0, 1]
    assert turn_versions_by_step(run) == {0: {0}, 1: {0}, 2: {1}}
    assert rows[0]["engine/logprob_gap_max"] < TOL  # on-policy: measured; later steps: not
    assert "engine/logprob_gap_max" not in rows[2]
    assert all(m["n_stale_rollouts"] == 0 and m["n_failed"] == 0 for m in rows)


@pytest.mark.slow
def test_a_server_that_dies_mid_step_fails_the_step_and_stops_the_run(tmp_path, vllm_python):
    run = tmp_path / "run"
    cfg = build_config({"task_args": {"high": 4, "max_turns": 3, "kill_step": 2, "run_dir": str(run)}}, [
        f"task={ROOT / 'tests' / 'support' / 'vllm_kill_task.py'}", "warm_start.steps=3",
        "warm_start.batch_size=8",
        "rollout.tasks_per_step=2", "rollout.n_per_task=4", "optim.warmup_steps=0",
        "trainer.steps=4", f"trainer.run_dir={run}", "trainer.checkpoint_every=1",
        "engine.kind=vllm", f"engine.python={vllm_python}", "trainer.precision=fp32", IN_PROCESS_KEY])
    with pytest.raises(EngineError) as e:
        train(cfg, log=lambda *_: None)
    assert "vLLM server exited" in str(e.value) and str(run / "vllm.log") in str(e.value)
    assert [m["step"] for m in metrics(run)] == [0, 1]

    db = sqlite3.connect(run / "traces.db")
    states = db.execute("SELECT state, error FROM rollouts WHERE group_id LIKE '%-s2-%'").fetchall()
    rewards = db.execute("SELECT count(*) FROM rollouts WHERE group_id LIKE '%-s2-%' "
                         "AND COALESCE(reward_override, reward_event) IS NOT NULL").fetchone()[0]
    db.close()
    assert len(states) == 8 and {s for s, _ in states} == {"failed"}  # never reward 0
    assert all(err for _, err in states) and rewards == 0

    ck = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ck["step"] == 2  # the checkpoint after step 1, whole
    resumed = cfg.model_copy(update={"engine": LocalEngineConfig(threads=cfg.engine.threads),
                                     "trainer": cfg.trainer.model_copy(update={"resume": True, "steps": 3})})
    resumed.task_args["kill_step"] = -1
    train(resumed, log=lambda *_: None)
    assert [m["step"] for m in metrics(run)] == [0, 1, 2]


def live_in_groups(groups: list[int]) -> list[int]:
    """Processes (not zombies) whose process group is one of `groups`."""
    live = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:
            live.append(int(d))
    return live


@pytest.mark.slow
def test_sigterm_stops_the_run_and_the_server_it_launched(tmp_path, vllm_python):
    """A trainer stopped by SIGTERM leaves no vLLM process behind (the server runs in its own
    session, so the signal does not reach it; seen before: its engine processes spinning on after
    the run): the run stops (run/stop.py), checkpoints, stops its server and exits 0."""
    import signal

    from vllm_kill_task import server_pids

    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracetrain", "train", str(EXAMPLE / "config.yaml"),
         f"trainer.run_dir={run}", "engine.kind=vllm", f"engine.python={vllm_python}",
         "warm_start.steps=3", "rollout.agent_workers=0", "trainer.steps=1000",
         "trainer.stop_grace_s=60"],  # (a busy machine's vLLM may take long to end)
        stdout=(log := (tmp_path / "log.txt")).open("wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not (run / "metrics.jsonl").is_file() and time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before its first step"
            time.sleep(0.5)
        pids = server_pids(str(run))
        assert pids, "no vLLM server of this run was found running"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(90)
        out = log.read_text(errors="replace")
        assert rc == 0 and "stopped: checkpoint of step" in out, out[-3000:]  # stopped and saved
        gone_by = time.monotonic() + 60
        while server_pids(str(run)) and time.monotonic() < gone_by:
            time.sleep(0.2)
        assert not server_pids(str(run))
        assert not live_in_groups(pids)  # its children too (the server's process group)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_scoring_asks_vllm_for_prompt_logprobs_and_gets_the_trainers(served, tok):
    """engines/score.py on vLLM: the logprobs of given response tokens (not sampled: greedy ones
    of another model, so most are not the server's argmax) are the trainer's log softmax at
    temperature 1, and the same through a teacher named by URL (run/teacher.py, which first
    checks the server's tokenizer against the policy's)."""
    from tracetrain.config import DistillConfig
    from tracetrain.engines.score import score
    from tracetrain.run.teacher import load_teacher

    server, model, _ = served
    other = perturbed(model, seed=23, scale=0.2)
    prompts = [chat(tok, t) for t in ("Guess.", "Lower, much lower.", "What is 2 + 2?")]
    responses = [greedy(other, p, n) for p, n in zip(prompts, (1, 9, 16), strict=True)]
    dc = DistillConfig(teacher={"url": server.base_url + "/v1", "name": SERVED_NAME})
    cfg = build_config({"distill": dc.model_dump()})

    async def go():
        engine = engine_on(served, tok)
        try:
            await engine.load_weights(model, 0)
            direct = await score(engine, prompts, responses)
        finally:
            await UpstreamEngine.aclose(engine)
        teacher = await load_teacher(cfg.distill, tok, cfg, key="distill", threads=1)
        try:
            return direct, await score(teacher, prompts, responses)
        finally:
            await teacher.aclose()

    direct, named = asyncio.run(go())
    for p, r, d, n in zip(prompts, responses, direct, named, strict=True):
        ours = teacher_forced(model, p, r, 1.0)
        assert len(d) == len(n) == len(r)
        assert float((torch.tensor(d) - ours).abs().max()) < TOL
        assert d == n
