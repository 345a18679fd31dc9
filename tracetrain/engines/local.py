"""`local` engine: a transformers causal LM in this process, concurrent requests decoded together.

    generate(prompt) -> a Call, queued          (the event loop's thread)
    gatherer, forever:
        wait for calls; gather a batch          (batch window, or the lockstep)
        on the compute thread: decode the batch (engines/decoder.py), calls that arrive
                               meanwhile joining it at its next step
        answer each call with its Generation

This module is the gathering; the decoding is engines/decoder.py (LocalEngine is a Decoder).
Requests that arrive together (concurrent `generate` calls, e.g. the turns of 128 agents) are
gathered into one batch, decoded on the process's compute thread (models/compute.py: its one
OpenMP team) so that the event loop keeps serving. After the first request, gathering goes on
until a `batch_window_ms` passes with no new request and the event loop free (a window the loop
woke from late does not count: it was busy, or its thread was stopped, and requests may be
half-way through the gateway); at most `max_batch_size` requests, at most `max_wait_ms` in all.
Requests that arrive while a batch is decoding join it at its next step, prefilled on their own
(continuous batching, up to `max_batch_size` live rows: engines/join.py). With a `lockstep`
(agents/lockstep.py) a batch closes instead when every live agent is waiting on a call, holds every
pending request sorted by (seed, prompt ids), requests without a seed drawing theirs in that order,
and none joins it: the batches of a run do not depend on when requests arrive.

The options are one LocalOptions (engines/local_options.py), the counters one LocalStats
(engines/local_stats.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
from dataclasses import dataclass, replace
from typing import Any

from tracetrain.engines.base import (
    EngineError,
    Generation,
    OnTokens,
    PromptTooLong,
    SamplingParams,
    check_sampling_params,
)
from tracetrain.engines.decoder import Decoder, Request
from tracetrain.engines.local_options import LocalOptions
from tracetrain.models.compute import compute_thread, on_compute, run_with_threads


def _batch_order(req: Request) -> tuple:
    return (req.params.seed is None, req.params.seed or 0, req.prompt_ids)


def _deliver(runs: list[tuple[OnTokens, list[int]]]) -> None:
    """One decode step's new ids to their streams (in the event loop's thread)."""
    for on_tokens, ids in runs:
        on_tokens(ids)


@dataclass
class Call(Request):
    """A request made by a call of `generate`: answered through its future."""

    future: asyncio.Future | None = None
    unanswered: bool = True  # counted in the engine's unanswered calls (the lockstep's waiting)


class LocalEngine(Decoder):
    """Engine over a transformers causal LM in this process (see the module docstring).

    `generate` batches concurrent calls; `generate_batch` decodes a list of prompts directly
    (for the trainer). `update_weights` swaps weights between batches and sets `model_version`;
    weights changed in place (the module the engine shares) must be announced by it too
    (`update_weights(None, version)`): it drops the prefix cache's KV of the old weights.
    `options` (a LocalOptions, or its fields by name) say how it gathers and decodes; `stats`
    (a LocalStats) counts its work. The forward passes run `runner`, a copy of `model`'s modules
    around its weights (fp32) or a bf16 copy that `update_weights` refreshes (bf16).
    """

    constrains = False  # no constrained decoding: params with `structured` are refused

    def __init__(self, model: Any, tokenizer: Any, options: LocalOptions | None = None,
                 **fields: Any):
        """`fields`: LocalOptions's fields by name, over `options` (or the defaults)."""
        self.options = o = replace(options or LocalOptions(), **fields)
        super().__init__(model, tokenizer, o)
        self.name, self.lockstep = o.name, o.lockstep
        self.batch_window, self.max_wait = o.batch_window_ms / 1000, o.max_wait_ms / 1000
        self.prefix_cache = o.prefix_cache
        self._seeds = random.Random(o.seed)
        self._decoding: concurrent.futures.Future | None = None  # the batch on the compute thread
        self._pending: list[Call] = []
        self._queue = threading.Lock()  # `_pending`'s: the decode thread takes joiners from it
        self.unanswered = 0  # calls of `generate` whose answer is not set yet
        if self.lockstep is not None:
            self.lockstep.watch(lambda: self.unanswered)
        self._wakeup: asyncio.Event | None = None
        self._gatherer: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ requests
    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError on bad params or ids; PromptTooLong if prompt + max_tokens > max_context."""
        check_sampling_params(params, adapters=self.adapters)
        if not isinstance(prompt_ids, list) or not prompt_ids:
            raise ValueError("prompt_ids must be a non-empty list of token ids")
        for k, i in enumerate(prompt_ids):
            if type(i) is not int or not 0 <= i < self.vocab_size:
                raise ValueError(f"prompt_ids[{k}] is {i!r}; token ids of this model are ints in "
                                 f"[0, {self.vocab_size})")
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_context:
            raise PromptTooLong(
                f"prompt has {len(prompt_ids)} tokens and max_tokens is {params.max_tokens}: "
                f"{need} > the engine's max_context {self.max_context}"
            )

    def _request(self, prompt_ids: list[int], params: SamplingParams) -> Call:
        self.check(prompt_ids, params)
        if params.seed is None and self.lockstep is None:  # (under lockstep: when batched)
            return Call(list(prompt_ids), params, self._seeds.getrandbits(63))
        return Call(list(prompt_ids), params, params.seed)

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

    def _answered(self, req: Call) -> None:
        """`req` no longer waits (answered, failed or given up): counted out, once."""
        if req.unanswered:
            req.unanswered = False
            self.unanswered -= 1
            if self.lockstep is not None:
                self.lockstep.changed()

    def _gave_up(self, req: Call):
        def done(future: asyncio.Future) -> None:
            if future.cancelled():
                req.cancelled = True
            self._answered(req)

        return done

    def _settle(self, req: Call, result: Generation | None = None,
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

    # ------------------------------------------------------------------ to the decoder
    def _run(self, reqs: list[Request], join: bool = False) -> list[Generation]:
        """Decode `reqs` (`join`: and the calls that join them, appended to `reqs`) with the
        weights held still, in the engine's torch threads."""
        with self._lock:
            version = self.model_version
            run_with_threads(self.threads, self._decode, reqs, join)
        return [Generation(r.ids, r.logprobs, r.finish, version) for r in reqs]

    def _decode(self, reqs: list[Request], join: bool = False) -> None:
        self.decode(reqs, self.model_version, self._joiners if join else None, self._stream)

    def _joiners(self, room: int) -> list[Call]:
        """Up to `room` waiting calls, taken from the queue to join the decoding batch."""
        if room <= 0 or not self._pending:
            return []
        with self._queue:
            taken = self._pending[:room]
            del self._pending[:room]
        return [r for r in taken if not r.future.done()]

    def _stream(self, runs: list[tuple[OnTokens, list[int]]]) -> None:
        """A decode step's new ids to their streams, in the event loop's thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver, runs)

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
