"""`local` engine: a transformers causal LM in this process, concurrent requests decoded as one batch.

Requests that arrive together (concurrent `generate` calls, e.g. the turns of 128 agents) are
gathered into one left-padded batch and decoded by one loop with a KV cache, on the process's
compute thread (models/compute.py: its one OpenMP team) so the event loop keeps serving.
Gathering: after the first request, keep gathering until a
`batch_window_ms` passes with no new request and the event loop free (a window the loop woke from
late does not count: it was busy, or its thread was stopped, and requests may be half-way through
the gateway); at most `max_batch_size` requests, at most `max_wait_ms` in all. Requests that arrive
while a batch is decoding join it at its next step, prefilled on their own (continuous batching,
up to `max_batch_size` live rows: tracetrain/engines/join.py). With a `lockstep`
(agents/lockstep.py) a batch closes instead when every live agent is waiting on a call, holds every
pending request sorted by (seed, prompt ids), requests without a seed drawing theirs in that order,
and none joins it: the batches of a run do not depend on when requests arrive.

One decode step samples each row from its logits with the request's temperature and top_p and
records the token's logprob under the full temperature-scaled distribution, log_softmax(l / T),
before top-p: the quantity the trainer recomputes (tracetrain/engines/sampling.py: the formulas,
the seeded draw, and the bias the choice implies when top_p < 1).

A row ends after a stop id (the tokenizer's eos, the model's generation_config eos, or the
request's stop_token_ids; the stop id is kept in the response, finish "stop"), after the token that
completes one of the request's stop strings (finish "stop") or at max_tokens
("length"). Finished rows are dropped from the batch and its KV cache once a quarter are done. The
decode writes each step's keys and values in place (engines/kv_cache.py), not by concatenation.

Prefill computes each prompt prefix once and keeps their KV across batches in a radix tree (per
model version and adapter, at most `prefix_cache_bytes`, least recently used out; `prefix_cache=
False`: none kept): tracetrain/engines/prefill.py. With several policies (config `policies`) each request
names its LoRA adapter (SamplingParams.adapter) and one batch decodes rows of several adapters
(peft's `adapter_names`: the base weights' matmuls shared, each row's adapter its own).

`precision` bf16 (or auto, where measured faster) decodes with a bfloat16 copy of the model,
refreshed from it on every weight change: tracetrain/engines/precision.py. A Llama-family decode
step runs as one function of tensors, compiled with `compile` (tracetrain/engines/decode_graph.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tracetrain.engines import decode_graph
from tracetrain.engines.base import (
    EngineError,
    Generation,
    OnTokens,
    PromptTooLong,
    SamplingParams,
    check_sampling_params,
    stop_string_in,
)
from tracetrain.engines.join import join_rows
from tracetrain.engines.kv_cache import reserve
from tracetrain.engines.precision import engine_precision, refresh
from tracetrain.engines.prefill import DEFAULT_PREFIX_CACHE_BYTES, Prefill
from tracetrain.engines.sampling import sample_tokens, uniform
from tracetrain.models import lora
from tracetrain.models.compute import compute_thread, on_compute, run_with_threads


def _batch_order(req: _Request) -> tuple:
    return (req.params.seed is None, req.params.seed or 0, req.prompt_ids)


def _deliver(runs: list[tuple[OnTokens, list[int]]]) -> None:
    """One decode step's new ids to their streams (in the event loop's thread)."""
    for on_tokens, ids in runs:
        on_tokens(ids)


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int | None  # None until its batch is formed (lockstep)
    future: asyncio.Future | None = None
    on_tokens: OnTokens | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    cancelled: bool = False  # set in the loop's thread when its caller gave up; read by decode
    unanswered: bool = True  # counted in the engine's unanswered calls (the lockstep's waiting)


class LocalEngine:
    """Engine over a transformers causal LM in this process (see the module docstring).

    `generate` batches concurrent calls; `generate_batch` decodes a list of prompts directly
    (for the trainer). `update_weights` swaps weights between batches and sets `model_version`;
    weights changed in place (the module the engine shares) must be announced by it too
    (`update_weights(None, version)`): it drops the prefix cache's KV of the old weights.
    `stats` counts decode loops ("batches"), requests (those that joined a decoding batch:
    "joined"), forward calls, prompt tokens (requested, forwarded, from the prefix cache:
    prefill.py), decode row-steps ("tokens"), and the seconds (perf_counter, cumulative) of prefill,
    of the decode steps' forward calls and of sampling with its bookkeeping. `threads`: torch
    intra-op threads of the decode thread (0: the creating thread's count). `precision`: fp32,
    bf16 or auto (engines/precision.py): the forward passes run `runner`, a copy of `model`'s
    modules around its weights (fp32) or a bf16 copy that `update_weights` refreshes (bf16).
    """

    constrains = False  # no constrained decoding: params with `structured` are refused

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str = "local",
        max_context: int | None = None,
        max_batch_size: int = 128,
        batch_window_ms: float = 2.0,
        max_wait_ms: float = 50.0,
        device: str | torch.device | None = None,
        model_version: int = 0,
        seed: int | None = None,
        threads: int = 0,
        prefix_cache: bool = True,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        lockstep: Any = None,
        precision: str = "fp32",
        compile: bool = False,
    ):
        if type(max_batch_size) is not int or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if not batch_window_ms >= 0 or not max_wait_ms >= 0:
            raise ValueError(f"batch_window_ms and max_wait_ms must be >= 0, got "
                             f"{batch_window_ms!r}, {max_wait_ms!r}")
        self.model = model if device is None else model.to(device)
        self.device = next(self.model.parameters()).device
        self.tokenizer = tokenizer
        self.name = name
        limit = getattr(model.config, "max_position_embeddings", None)
        if max_context is None and limit is None:
            raise ValueError("max_context is needed: the model config has no max_position_embeddings")
        self.max_context = int(max_context if max_context is not None else limit)
        if limit is not None and self.max_context > limit:
            raise ValueError(
                f"max_context {self.max_context} exceeds the model's max_position_embeddings {limit}"
            )
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.max_batch_size = max_batch_size
        self.batch_window = batch_window_ms / 1000
        self.max_wait = max_wait_ms / 1000
        self.model_version = model_version
        eos = [tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)]
        self.stop_ids = frozenset(i for e in eos for i in (e if isinstance(e, list) else [e])
                                  if i is not None)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.stop_ids, default=0)
        self.prefix_cache = prefix_cache
        # torch's thread count is per OS thread: the decode sets its own (0: this thread's)
        self.threads = threads if threads > 0 else torch.get_num_threads()
        # the module the forward passes run: the model, or its bf16 copy (engines/precision.py;
        # "auto" times both where they will run)
        self.precision, self.runner, self.precision_s = on_compute(
            self.threads, engine_precision, self.model, precision)
        # several policies: the model's adapters (lora.adapter_names), which requests may name
        names = lora.adapter_names(self.model)
        self.adapters = (*names, lora.BASE) if names else ()
        self._seeds = random.Random(seed)
        self._lock = threading.Lock()  # held while the model decodes or its weights change
        self._decoding: concurrent.futures.Future | None = None  # the batch on the compute thread
        self._pending: list[_Request] = []
        self._queue = threading.Lock()  # `_pending`'s: the decode thread takes joiners from it
        self.lockstep = lockstep
        self.unanswered = 0  # calls of `generate` whose answer is not set yet
        if lockstep is not None:
            lockstep.watch(lambda: self.unanswered)
        self._wakeup: asyncio.Event | None = None
        self._gatherer: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = {
            "batches": 0, "requests": 0, "forward_calls": 0, "tokens": 0, "max_batch": 0,
            "joined": 0, "prompt_tokens": 0, "prefill_tokens": 0, "prefix_cache_tokens": 0,  # (prefill.py)
            "prefill_s": 0.0, "decode_forward_s": 0.0, "sample_s": 0.0,  # seconds
        }
        # a decode step as one function (compiled with `compile`), or transformers' forward
        self.graph, self.graph_note = decode_graph.build(self.runner, compile, self.stats)
        self._step = self.graph or self._forward  # a decode step's forward pass
        self._prefill = Prefill(self._forward, pad_id=self.pad_id, device=self.device,
                                budget=prefix_cache_bytes if prefix_cache else 0, stats=self.stats)

    # ------------------------------------------------------------------ requests
    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError on bad params or ids; PromptTooLong if prompt + max_tokens > max_context."""
        check_sampling_params(params, adapters=self.adapters)
        if not isinstance(prompt_ids, list) or not prompt_ids:
            raise ValueError("prompt_ids must be a non-empty list of token ids")
        for k, i in enumerate(prompt_ids):
            if type(i) is not int or not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"prompt_ids[{k}] is {i!r}; token ids of this model are ints in [0, {self.vocab_size})"
                )
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_context:
            raise PromptTooLong(
                f"prompt has {len(prompt_ids)} tokens and max_tokens is {params.max_tokens}: "
                f"{need} > the engine's max_context {self.max_context}"
            )

    def _request(self, prompt_ids: list[int], params: SamplingParams) -> _Request:
        self.check(prompt_ids, params)
        if params.seed is None and self.lockstep is None:  # (under lockstep: when batched)
            return _Request(list(prompt_ids), params, self._seeds.getrandbits(63))
        return _Request(list(prompt_ids), params, params.seed)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_tokens: OnTokens | None = None
    ) -> Generation:
        """One request, decoded with the others that arrive with it. `on_tokens` gets each
        decode step's new id; cancelling the call drops its row from the batch at the next step."""
        req = self._request(prompt_ids, params)
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._gatherer is None or self._gatherer.done():
            self._loop, self._wakeup, self._pending = loop, asyncio.Event(), []
            self._gatherer = loop.create_task(self._gather())
            self._gatherer.add_done_callback(self._gatherer_ended)
        req.future = loop.create_future()
        req.on_tokens = on_tokens
        req.future.add_done_callback(self._gave_up(req))
        self.unanswered += 1
        with self._queue:
            self._pending.append(req)
        self._wakeup.set()
        if self.lockstep is not None:
            self.lockstep.changed()
        return await req.future

    def _answered(self, req: _Request) -> None:
        """`req` no longer waits (answered, failed or given up): counted out, once."""
        if req.unanswered:
            req.unanswered = False
            self.unanswered -= 1
            if self.lockstep is not None:
                self.lockstep.changed()

    def _gave_up(self, req: _Request):
        def done(future: asyncio.Future) -> None:
            if future.cancelled():
                req.cancelled = True
            self._answered(req)

        return done

    def _settle(self, req: _Request, result: Generation | None = None,
                error: BaseException | None = None) -> None:
        """Answer `req` (unless its caller gave up), counted out before its caller runs again."""
        if req.future.done():
            return
        self._answered(req)
        if error is not None:
            req.future.set_exception(error)
        else:
            req.future.set_result(result)

    def generate_batch(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Generation]:
        """Decode `prompts` (with one params for all, or one each) in batches of max_batch_size."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        reqs = [self._request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        for r in reqs:  # (in the order given: a direct call has no arrival order)
            if r.seed is None:
                r.seed = self._seeds.getrandbits(63)
        out: list[Generation] = []
        for k in range(0, len(reqs), self.max_batch_size):
            out += on_compute(0, self._run, reqs[k : k + self.max_batch_size])
        return out

    async def _gather(self) -> None:
        """Forever: wait for requests, gather a batch (see the module docstring), decode it."""
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            if self.lockstep is not None:
                await self.lockstep.wait()
                self._pending.sort(key=_batch_order)
                for r in self._pending[: self.max_batch_size]:
                    if r.seed is None:
                        r.seed = self._seeds.getrandbits(63)
            start, seen = loop.time(), len(self._pending)
            while self.lockstep is None and seen < self.max_batch_size and self.batch_window > 0:
                slept = loop.time()
                await asyncio.sleep(self.batch_window)
                now = loop.time()
                if now - start >= self.max_wait:
                    break
                # quiet only if the loop woke on time: woken late, it was busy or stopped (host
                # steal, a pause of the process), and requests may be half-way through the gateway
                if len(self._pending) == seen and now - slept < 2 * self.batch_window:
                    break
                seen = len(self._pending)
            with self._queue:  # (the decode thread takes joiners from the queue too)
                batch = [r for r in self._pending[: self.max_batch_size] if not r.future.done()]
                del self._pending[: self.max_batch_size]
                if not self._pending:
                    self._wakeup.clear()
            if not batch:
                continue
            try:
                # (requests that join it are appended to `batch`: engines/join.py)
                self._decoding = compute_thread().submit(self._run, batch, self.lockstep is None)
                gens = await asyncio.wrap_future(self._decoding)
            except asyncio.CancelledError:  # aclose() while decoding: nobody waits forever
                for r in batch:
                    self._settle(r, error=EngineError(f"local engine {self.name!r} closed", 503))
                raise
            except Exception as e:  # the engine failed, not the request: 503 with the reason
                err = EngineError(
                    f"local engine {self.name!r} failed: {type(e).__name__}: {e}", 503
                )
                for r in batch:
                    self._settle(r, error=err)
                continue
            for r, g in zip(batch, gens, strict=True):
                self._settle(r, g)

    def _gatherer_ended(self, task: asyncio.Task) -> None:
        """If the gatherer ever dies of a bug, fail its waiting requests instead of hanging them."""
        if task.cancelled() or task.exception() is None:
            return
        err = EngineError(f"local engine {self.name!r} failed: {task.exception()!r}", 503)
        for r in self._pending:
            if r.future is not None:
                self._settle(r, error=err)
        self._pending = []

    # ------------------------------------------------------------------ decoding
    def _run(self, reqs: list[_Request], join: bool = False) -> list[Generation]:
        """Decode `reqs` (`join`: and the requests that join them, appended to `reqs`)."""
        with self._lock:
            version = self.model_version
            run_with_threads(self.threads, self._decode, reqs, join)
        return [Generation(r.ids, r.logprobs, r.finish, version) for r in reqs]

    def _forward(self, input_ids, attention_mask, position_ids, cache, adapters=None):
        """(next-token logits [B, V] float32, the cache); `adapters`: each row's adapter."""
        self.stats["forward_calls"] += 1
        out = self.runner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **({} if adapters is None else {"adapter_names": adapters}),
        )
        return out.logits[:, -1, :].float(), out.past_key_values

    @torch.inference_mode()
    def _decode(self, reqs: list[_Request], join: bool = False) -> None:
        """Fill r.ids, r.logprobs, r.finish for each request; one batched loop. `join`: requests
        that arrive meanwhile join at each step (engines/join.py), appended to `reqs`."""
        dev, B, clock, stats = self.device, len(reqs), time.perf_counter, self.stats
        t0 = clock()
        # several policies: each row's adapter (a request naming none: the active one)
        by_request = None if not self.adapters else [
            r.params.adapter or self.model.active_adapter for r in reqs]
        adapters = by_request
        logits, cache, mask, next_pos = self._prefill(
            [r.prompt_ids for r in reqs], self.model_version, adapters)
        cache = reserve(cache, max(r.params.max_tokens for r in reqs))
        stats["prefill_s"] += clock() - t0
        temperature, top_p, stops = self._row_params(reqs)
        rows = list(range(B))  # request index of each batch row
        alive = [True] * B
        self.stats["batches"] += 1
        self.stats["requests"] += B
        self.stats["max_batch"] = max(self.stats["max_batch"], B)
        while True:
            new = self._joiners(self.max_batch_size - sum(alive)) if join else []
            if new:  # prefilled on their own, their rows after the batch's
                t0 = clock()
                rows += range(len(reqs), len(reqs) + len(new))
                reqs += new
                if by_request is not None:
                    by_request += [r.params.adapter or self.model.active_adapter for r in new]
                    adapters = [by_request[i] for i in rows]
                n_logits, n_cache, n_mask, n_pos = self._prefill(
                    [r.prompt_ids for r in new], self.model_version,
                    None if by_request is None else by_request[-len(new):])
                cache, mask = join_rows(cache, mask, n_cache, n_mask)
                cache = reserve(cache, max(reqs[i].params.max_tokens - len(reqs[i].ids) for i in rows))
                n_temperature, n_top_p, n_stops = self._row_params(new)
                logits, next_pos = torch.cat([logits, n_logits]), torch.cat([next_pos, n_pos])
                temperature = torch.cat([temperature, n_temperature])
                top_p, stops = torch.cat([top_p, n_top_p]), stops + n_stops
                alive += [True] * len(new)
                stats["requests"] += len(new)
                stats["joined"] += len(new)
                stats["max_batch"] = max(stats["max_batch"], sum(alive))
                stats["prefill_s"] += clock() - t0
            t0 = clock()
            u = torch.tensor(  # (row i's draw for its token number len(ids): engines/sampling.py)
                [uniform(reqs[i].seed, len(reqs[i].ids)) for i in rows], dtype=torch.float64,
                device=dev)
            y, lp = sample_tokens(logits, temperature, top_p, u)
            runs = []
            for b, (i, t, v) in enumerate(zip(rows, y.tolist(), lp.tolist(), strict=True)):
                if not alive[b]:
                    continue
                r = reqs[i]
                if r.cancelled:  # its caller left: stop decoding it
                    r.finish, alive[b] = "cancelled", False
                    continue
                r.ids.append(t)
                r.logprobs.append(v)
                if r.on_tokens is not None:
                    runs.append((r.on_tokens, [t]))
                if t in stops[i] or (
                    r.params.stop and stop_string_in(self.tokenizer, r.ids, r.params.stop)
                ):
                    r.finish = "stop"
                elif len(r.ids) >= r.params.max_tokens:
                    r.finish = "length"
                if r.finish is not None:
                    alive[b] = False
            if runs and self._loop is not None:
                self._loop.call_soon_threadsafe(_deliver, runs)
            n_alive = sum(alive)
            self.stats["tokens"] += len(rows)
            stats["sample_s"] += clock() - t0
            if n_alive == 0:
                break
            if 4 * (len(rows) - n_alive) >= len(rows):  # drop finished rows from batch and cache
                keep = torch.tensor([b for b in range(len(rows)) if alive[b]], device=dev)
                cache.batch_select_indices(keep)
                mask, next_pos, y = mask[keep], next_pos[keep], y[keep]
                temperature, top_p = temperature[keep], top_p[keep]
                rows = [rows[b] for b in range(len(rows)) if alive[b]]
                alive = [True] * len(rows)
                adapters = None if adapters is None else [by_request[i] for i in rows]
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=-1)
            t0 = clock()
            logits, cache = self._step(y[:, None], mask, next_pos[:, None], cache, adapters)
            stats["decode_forward_s"] += clock() - t0
            next_pos = next_pos + 1

    def _row_params(self, reqs: list[_Request]) -> tuple[torch.Tensor, torch.Tensor, list]:
        """(temperature [R], top_p [R], the stop ids of each) of requests `reqs`."""
        return (torch.tensor([float(r.params.temperature) for r in reqs], device=self.device),
                torch.tensor([float(r.params.top_p) for r in reqs], device=self.device),
                [self.stop_ids | set(r.params.stop_token_ids) for r in reqs])

    def _joiners(self, room: int) -> list[_Request]:
        """Up to `room` waiting requests, taken from the queue to join the decoding batch."""
        if room <= 0 or not self._pending:
            return []
        with self._queue:
            taken = self._pending[:room]
            del self._pending[:room]
        return [r for r in taken if not r.future.done()]

    # ------------------------------------------------------------------ weights
    def update_weights(self, state_dict: dict[str, torch.Tensor] | None, version: int) -> None:
        """Load `state_dict` into the model in place (None: the trainer updated the shared module
        itself) and set model_version. Waits for a decoding batch to finish first; the gateway
        pauses and drains requests around it."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        with self._lock:
            self._prefill.clear()  # its kept prefixes' KV came from the old weights
            if state_dict is not None:
                with torch.no_grad():
                    self.model.load_state_dict(state_dict, strict=True)
            if self.precision == "bf16":  # (in fp32 the runner holds the model's own weights)
                refresh(self.runner, self.model)
            self.model_version = version

    def drop_prefix_cache(self) -> None:
        """Forget every kept prefix (after a decoding batch finishes)."""
        with self._lock:
            self._prefill.clear()

    async def load_weights(self, model: torch.nn.Module, version: int) -> None:
        """`model`'s weights into this engine's own module (update_weights), as `version`."""
        self.update_weights(model.state_dict(), version)

    async def aclose(self) -> None:
        if self._gatherer is not None:
            self._gatherer.cancel()
            self._gatherer = None
        for r in self._pending:
            if r.future is not None:
                self._settle(r, error=EngineError(f"local engine {self.name!r} closed", 503))
        self._pending = []
        if self._decoding is not None:  # the batch on the compute thread ends (its callers told)
            concurrent.futures.wait([self._decoding])
            self._decoding = None
