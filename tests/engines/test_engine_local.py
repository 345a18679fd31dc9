"""LocalEngine on the tiny model: exact logprobs, batching, stops, seeds, weights (the sampling
math and top_p: test_engine_sampling.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from tracetrain.engines.base import Engine, PromptTooLong, SamplingParams
from tracetrain.engines.decoder import Decoder, Request
from tracetrain.engines.local import LocalEngine
from tracetrain.engines.local_options import LocalOptions
from tracetrain.models.compute import on_compute
from tracetrain.models.tiny import build_model, build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_model(tok, seed=0)


@pytest.fixture(scope="module")
def prompts(tok):
    texts = [
        "Guess a number between 1 and 8.",
        "Higher.",
        "What is 12 + 30? Think step by step, then answer.",
    ]
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)[
            "input_ids"
        ]
        for t in texts
    ] + [[5]]


def teacher_forced_logprobs(model, prompt, response, temperature):
    """Independent recomputation: one unpadded forward pass over prompt + response."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def check_finish(gen, params, stop_ids):
    assert 1 <= len(gen.response_ids) <= params.max_tokens
    assert len(gen.response_logprobs) == len(gen.response_ids)
    assert not any(t in stop_ids for t in gen.response_ids[:-1])  # nothing after a stop
    if gen.finish_reason == "stop":
        assert gen.response_ids[-1] in stop_ids
    else:
        assert gen.finish_reason == "length" and len(gen.response_ids) == params.max_tokens


# Engine vs teacher forcing: the same model in fp32, but decoding against a KV cache in a
# left-padded batch runs other matmul shapes than one forward of the row (a CPU-dependent reduction
# order). The tiny model has hidden 32, 2 layers: each logit carries <~ 2 * (32 + 64) u ~ 1e-5
# of error relative to its magnitude (|logit| < 1.1 here), and log_softmax adds a few u: atol
# 1e-4 on a logprob has ~5x room over that worst case, ~100x over the measured (<= 9.5e-7 under
# each ATEN_CPU_CAPABILITY, 1 and 2 threads, and MKL_CBWR=COMPATIBLE).
LOGPROB_ATOL = 1e-4


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.5, 1.0), (0.0, 1.0)])
def test_logprobs_match_teacher_forcing(model, tok, prompts, temperature, top_p):
    eng = LocalEngine(model, tok)
    assert isinstance(eng, Engine)
    params = SamplingParams(max_tokens=12, temperature=temperature, top_p=top_p, seed=7)
    gens = eng.generate_batch(prompts, params)  # one left-padded batch, prompts of 1..40 tokens
    assert eng.stats["batches"] == 1
    for prompt, gen in zip(prompts, gens, strict=True):
        assert all(0 <= t < len(tok) for t in gen.response_ids)
        check_finish(gen, params, eng.stop_ids)
        expected = teacher_forced_logprobs(model, prompt, gen.response_ids, temperature)
        torch.testing.assert_close(torch.tensor(gen.response_logprobs), expected, atol=LOGPROB_ATOL, rtol=0)
        assert max(gen.response_logprobs) <= 0


def test_shared_prefix_is_computed_once_and_changes_nothing(model, tok):
    system = [{"role": "system", "content": "You are playing a game. Reply with the number only."}]
    msgs = [
        system + [{"role": "user", "content": f"Guess a number between 1 and {n}."}]
        for n in (8, 16, 100)
    ]
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True)["input_ids"] for m in msgs]
    prompts += [prompts[0]] * 3  # a group: identical prompts
    params = SamplingParams(max_tokens=6, seed=3)
    eng = LocalEngine(model, tok)
    gens = eng.generate_batch(prompts, params)
    shared = len(prompts[0]) - 8  # the three prompts differ only near their end
    assert eng.stats["prefill_tokens"] <= shared + len(prompts) * (max(map(len, prompts)) - shared)
    for prompt, gen in zip(prompts, gens, strict=True):
        expected = teacher_forced_logprobs(model, prompt, gen.response_ids, 1.0)
        torch.testing.assert_close(torch.tensor(gen.response_logprobs), expected, atol=LOGPROB_ATOL, rtol=0)
    alone = [eng.generate_batch([p], params)[0] for p in prompts]
    assert [g.response_ids for g in gens] == [g.response_ids for g in alone]


def test_prefix_cache_reuses_a_prefix_across_batches_and_changes_nothing(model, tok):
    """Batches of one step arrive apart (the agents' later turns): the engine keeps the KV of the
    last prefix it prefilled and computes only the rest. Seeded sampling gives the same ids and
    (within the kernels' reassociation, LOGPROB_ATOL) the same logprobs as without the cache;
    new weights drop it."""
    system = [{"role": "system", "content": "You are playing a game. Reply with the number only."}]
    prompts = [tok.apply_chat_template(system + [{"role": "user", "content": f"Guess up to {n}."}],
                                       add_generation_prompt=True)["input_ids"] for n in (8, 16, 100, 7)]
    batches = [prompts[:2], prompts[2:3], prompts[3:] * 2, prompts[:1]]
    params = SamplingParams(max_tokens=6, seed=5)
    cached, plain = LocalEngine(model, tok), LocalEngine(model, tok, prefix_cache=False)
    for batch in batches:
        a, b = cached.generate_batch(batch, params), plain.generate_batch(batch, params)
        assert [g.response_ids for g in a] == [g.response_ids for g in b]
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(torch.tensor(x.response_logprobs), torch.tensor(y.response_logprobs),
                                       atol=LOGPROB_ATOL, rtol=0)
    # the system prompt's tokens were computed once: every later batch reused them
    common = len(_common(prompts))
    assert common >= 8
    assert cached.stats["prefix_cache_tokens"] >= common * (len(batches) - 1)
    assert cached.stats["prefill_tokens"] < plain.stats["prefill_tokens"]
    assert plain.stats["prefix_cache_tokens"] == 0
    cached.update_weights(None, 1)  # new weights: the kept KV is not theirs
    before = cached.stats["prefix_cache_tokens"]
    cached.generate_batch(prompts[:1], params)
    assert cached.stats["prefix_cache_tokens"] == before


def _common(prompts):
    k = 0
    while all(len(p) > k and p[k] == prompts[0][k] for p in prompts):
        k += 1
    return prompts[0][:k]


def test_greedy_equals_transformers_generate(model, tok, prompts):
    # (without the prefix cache: the second batch would read its prompts' KV from the cache, the
    # same within LOGPROB_ATOL, not bit for bit: tests/engines/test_prefix_cache.py)
    eng = LocalEngine(model, tok, prefix_cache=False)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    ours = eng.generate_batch(prompts, params)
    assert eng.generate_batch(prompts, params) == ours  # deterministic
    for prompt, gen in zip(prompts, ours, strict=True):
        ref = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[0, len(prompt) :].tolist()
        assert gen.response_ids == ref


def test_seeds_reproduce_whatever_the_batch(model, tok, prompts):
    eng = LocalEngine(model, tok)
    p = SamplingParams(max_tokens=10, seed=42)
    alone = eng.generate_batch([prompts[0]], p)[0]
    again = eng.generate_batch([prompts[0]], p)[0]  # its prompt's KV from the prefix cache now
    assert again.response_ids == alone.response_ids
    torch.testing.assert_close(torch.tensor(again.response_logprobs),
                               torch.tensor(alone.response_logprobs), atol=LOGPROB_ATOL, rtol=0)
    in_batch = eng.generate_batch(prompts, [p, SamplingParams(seed=1), SamplingParams(), p])
    assert in_batch[0].response_ids == alone.response_ids
    other_seed = eng.generate_batch([prompts[0]], SamplingParams(max_tokens=10, seed=43))[0]
    assert other_seed.response_ids != alone.response_ids
    unseeded = eng.generate_batch([prompts[0]] * 2, SamplingParams(max_tokens=10))
    assert unseeded[0].response_ids != unseeded[1].response_ids


def test_stops_at_eos_and_stop_ids_and_respects_max_tokens(tok, prompts):
    model = build_model(tok, seed=1)
    eos = tok.eos_token_id
    boost = torch.zeros(len(tok))
    hook = model.lm_head.register_forward_hook(lambda m, i, out: out + boost)
    eng = LocalEngine(model, tok)
    try:
        boost[eos] = 100.0  # eos is certain: every response is exactly [eos]
        for g in eng.generate_batch(prompts, SamplingParams(max_tokens=5)):
            assert g.response_ids == [eos] and g.finish_reason == "stop"
        boost[eos], boost[77] = 0.0, 100.0  # token 77 is certain: stop only when asked to
        for g in eng.generate_batch(prompts, SamplingParams(max_tokens=3, stop_token_ids=(77,))):
            assert g.response_ids == [77] and g.finish_reason == "stop"
        for n in (1, 4):
            for g in eng.generate_batch(prompts, SamplingParams(max_tokens=n)):
                assert g.response_ids == [77] * n and g.finish_reason == "length"
        # a stop string ends a row with the token that completes it (kept in the response)
        text = tok.decode([77])
        for n in (2, 3):
            for g in eng.generate_batch(prompts, SamplingParams(max_tokens=6, stop=(text * n,))):
                assert g.response_ids == [77] * n and g.finish_reason == "stop"
    finally:
        hook.remove()


def test_mixed_lengths_in_one_batch_drop_finished_rows(model, tok, prompts):
    eng = LocalEngine(model, tok)
    params = [SamplingParams(max_tokens=n, seed=n) for n in (1, 2, 3, 30)]
    gens = eng.generate_batch(prompts, params)
    for prompt, p, g in zip(prompts, params, gens, strict=True):
        check_finish(g, p, eng.stop_ids)
        expected = teacher_forced_logprobs(model, prompt, g.response_ids, 1.0)
        torch.testing.assert_close(torch.tensor(g.response_logprobs), expected, atol=LOGPROB_ATOL, rtol=0)
    assert eng.stats["batches"] == 1
    assert eng.stats["tokens"] < 4 * max(len(g.response_ids) for g in gens)  # rows left the batch


def test_concurrent_requests_are_decoded_as_one_batch(model, tok, prompts):
    eng = LocalEngine(model, tok, batch_window_ms=5.0)
    reqs = [(prompts[i % 4] + [3 + i], SamplingParams(max_tokens=6, seed=i)) for i in range(32)]

    async def go():
        try:
            return await asyncio.gather(*(eng.generate(p, sp) for p, sp in reqs))
        finally:
            await eng.aclose()

    gens = asyncio.run(go())
    assert eng.stats["requests"] == 32 and eng.stats["batches"] <= 2
    assert eng.stats["max_batch"] >= 16
    direct = LocalEngine(model, tok).generate_batch([p for p, _ in reqs], [sp for _, sp in reqs])
    assert [g.response_ids for g in gens] == [g.response_ids for g in direct]


def test_a_stopped_event_loop_does_not_cut_the_batch(model, tok, prompts):
    """Requests half-way through the gateway when the loop's thread stops (host steal, a paused
    process) arrive after the gather window has run out on the clock; they still join the batch,
    because a window the loop woke from late does not count as quiet."""
    window_s = 0.05
    eng = LocalEngine(model, tok, batch_window_ms=window_s * 1e3, max_wait_ms=10_000)
    reqs = [(prompts[i % 4] + [3 + i], SamplingParams(max_tokens=4, seed=i)) for i in range(8)]

    async def agent(i: int):
        if i > 0:  # the other requests are still being parsed and rendered (some loop steps)
            for step in range(6):
                await asyncio.sleep(0)
                if i == 1 and step == 1:
                    time.sleep(6 * window_s)  # the thread stops: no loop step runs meanwhile
        return await eng.generate(*reqs[i])

    async def go():
        try:
            return await asyncio.gather(*(agent(i) for i in range(8)))
        finally:
            await eng.aclose()

    gens = asyncio.run(go())
    assert (eng.stats["requests"], eng.stats["batches"], eng.stats["max_batch"]) == (8, 1, 8)
    direct = LocalEngine(model, tok).generate_batch([p for p, _ in reqs], [sp for _, sp in reqs])
    assert [g.response_ids for g in gens] == [g.response_ids for g in direct]


def test_event_loop_keeps_running_while_decoding(model, tok, prompts):
    eng = LocalEngine(model, tok)
    ticks = 0

    async def ticker(done: asyncio.Event):
        nonlocal ticks
        while not done.is_set():
            await asyncio.sleep(0.002)
            ticks += 1

    async def go():
        done = asyncio.Event()
        t = asyncio.create_task(ticker(done))
        try:
            await asyncio.gather(
                *(eng.generate(p, SamplingParams(max_tokens=64, seed=1)) for p in prompts * 8)
            )
        finally:
            done.set()
            await t
            await eng.aclose()

    asyncio.run(go())
    assert eng.stats["forward_calls"] >= 8 and ticks >= 5


def test_prompt_too_long_and_bad_ids(model, tok):
    eng = LocalEngine(model, tok, max_context=64)
    with pytest.raises(PromptTooLong, match="max_context 64"):
        eng.generate_batch([[5] * 60], SamplingParams(max_tokens=5))
    assert eng.generate_batch([[5] * 59], SamplingParams(max_tokens=5))[0].response_ids
    with pytest.raises(PromptTooLong):
        asyncio.run(eng.generate([5] * 64, SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is 512"):
        eng.generate_batch([[5, len(tok)]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="non-empty"):
        eng.generate_batch([[]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="top_p"):
        eng.generate_batch([[5]], SamplingParams(top_p=2.0))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LocalEngine(model, tok, max_context=10**6)
    assert eng.stats["requests"] == 1


def test_update_weights_swaps_in_place_and_waits_for_decoding(tok, prompts):
    a, b = build_model(tok, seed=0), build_model(tok, seed=1)
    eng = LocalEngine(a, tok)
    p = SamplingParams(max_tokens=8, temperature=0.0)
    ref_b = LocalEngine(b, tok).generate_batch(prompts, p)
    eng.update_weights(b.state_dict(), version=3)
    gens = eng.generate_batch(prompts, p)
    assert [g.response_ids for g in gens] == [g.response_ids for g in ref_b]
    assert all(g.model_version == 3 for g in gens) and eng.model_version == 3
    eng.update_weights(None, version=4)  # the trainer changed the shared module itself
    assert eng.generate_batch(prompts[:1], p)[0].model_version == 4
    with pytest.raises(ValueError, match="version"):
        eng.update_weights(None, version=-1)
    with pytest.raises(RuntimeError):
        eng.update_weights({"nope": torch.zeros(1)}, version=5)
    assert eng.model_version == 4

    # a swap requested mid-batch waits for the batch: no forward pass runs after it returns,
    # and every row of the batch carries the version read when the batch started
    started, forwards, out = threading.Event(), [], []

    step = eng._step  # (a decode step's forward pass)

    def count(*args):
        forwards.append(1)
        started.set()
        return step(*args)

    eng._step = count
    worker = threading.Thread(
        target=lambda: out.extend(
            eng.generate_batch(prompts * 4, SamplingParams(max_tokens=48, seed=0))
        )
    )
    worker.start()
    assert started.wait(30)
    eng.update_weights(None, version=9)
    at_swap = len(forwards)
    worker.join()
    assert at_swap == len(forwards) > 1
    assert {g.model_version for g in out} == {4} and eng.model_version == 9


def test_a_failing_model_fails_its_batch_with_503_and_the_engine_recovers(tok, prompts):
    from tracetrain.engines.base import EngineError

    model = build_model(tok, seed=2)
    eng = LocalEngine(model, tok)

    def boom(*_):
        raise RuntimeError("simulated out of memory")

    async def go():
        hook = eng.runner.model.layers[0].register_forward_hook(boom)  # (the engine's modules)
        try:
            results = await asyncio.gather(
                *(eng.generate(p, SamplingParams(max_tokens=4)) for p in prompts),
                return_exceptions=True,
            )
        finally:
            hook.remove()
        after = await eng.generate(prompts[0], SamplingParams(max_tokens=4))
        await eng.aclose()
        return results, after

    results, after = asyncio.run(go())
    assert all(isinstance(r, EngineError) and r.status == 503 for r in results)
    assert "simulated out of memory" in str(results[0])
    assert len(after.response_ids) >= 1


def test_streamed_ids_arrive_step_by_step_and_equal_the_generation(model, tok, prompts):
    """on_tokens gets each decode step's id in the event loop's thread, before generate returns;
    the runs are the response ids, for every request of a batch, seeded as without streaming."""
    eng = LocalEngine(model, tok, batch_window_ms=5.0)
    reqs = [(prompts[i % 4], SamplingParams(max_tokens=12, seed=i)) for i in range(6)]
    loop_thread: list[bool] = []

    async def go():
        runs = [[] for _ in reqs]

        def sink(k):
            def on_tokens(ids):
                loop_thread.append(threading.current_thread() is threading.main_thread())
                runs[k].append(list(ids))
            return on_tokens

        try:
            gens = await asyncio.gather(
                *(eng.generate(p, sp, on_tokens=sink(k)) for k, (p, sp) in enumerate(reqs))
            )
        finally:
            await eng.aclose()
        return runs, gens

    runs, gens = asyncio.run(go())
    direct = LocalEngine(model, tok).generate_batch([p for p, _ in reqs], [sp for _, sp in reqs])
    assert [g.response_ids for g in gens] == [g.response_ids for g in direct]
    for r, g in zip(runs, gens, strict=True):
        assert [t for run in r for t in run] == g.response_ids
        assert all(len(run) == 1 for run in r)  # one id per decode step: it is not held back
    assert loop_thread and all(loop_thread)


def test_cancelled_request_stops_decoding_and_the_rest_of_its_batch_is_unchanged(model, tok, prompts):
    """Cancelling a streaming generate drops its row at the next step: the engine decodes far
    fewer row-steps than max_tokens for it, and the batch's other request gets its own ids."""
    stop_never = SamplingParams(max_tokens=200, seed=1, temperature=1.0)
    other = SamplingParams(max_tokens=40, seed=2, temperature=1.0)
    alone = LocalEngine(model, tok).generate_batch([prompts[1]], [other])[0]
    eng = LocalEngine(model, tok, batch_window_ms=5.0)

    async def go():
        seen = asyncio.Event()
        got: list[int] = []

        def on_tokens(ids):
            got.extend(ids)
            if len(got) >= 3:
                seen.set()

        try:
            victim = asyncio.ensure_future(eng.generate(prompts[2], stop_never, on_tokens=on_tokens))
            kept = asyncio.ensure_future(eng.generate(prompts[1], other))
            await seen.wait()
            victim.cancel()
            gen = await kept
            with pytest.raises(asyncio.CancelledError):
                await victim
            return gen, len(got)
        finally:
            await eng.aclose()

    gen, streamed = asyncio.run(go())
    assert gen.response_ids == alone.response_ids
    # row-steps: the kept request's, plus the victim's until it was dropped (not 200 of them)
    assert eng.stats["tokens"] < len(gen.response_ids) + 100
    assert streamed < 100


def test_the_decoder_alone_decodes_as_the_engine(model, tok, prompts):
    """engines/decoder.py without the gathering: Requests in, their ids, logprobs and finish
    filled, bit for bit the engine's for the same seeds; the options one LocalOptions or its
    fields by name; the counters read as a mapping."""
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=k) for k in range(len(prompts))]
    engine = LocalEngine(model, tok, LocalOptions(seed=0), max_batch_size=8)
    assert engine.options == LocalOptions(seed=0, max_batch_size=8)
    want = engine.generate_batch(prompts, params)
    decoder = Decoder(model, tok, LocalOptions(seed=0))
    reqs = [Request(list(p), sp, sp.seed) for p, sp in zip(prompts, params, strict=True)]
    on_compute(decoder.threads, decoder.decode, reqs, decoder.model_version)  # (as engines do)
    assert [(r.ids, r.logprobs, r.finish) for r in reqs] == [
        (g.response_ids, g.response_logprobs, g.finish_reason) for g in want]
    counts = [{k: v for k, v in s.items() if not k.endswith("_s")}
              for s in (decoder.stats, engine.stats)]
    assert counts[0] == counts[1] and decoder.stats["batches"] == 1
    with pytest.raises(ValueError, match="max_batch_size"):
        LocalOptions(max_batch_size=0)
