"""The local engine's decoder: a batch of requests decoded by one loop over a KV cache.

    batch = prefill(requests)                 prompts' KV, prefixes once (engines/prefill.py)
    loop:
        join:    batch += prefill(joiners)    requests that arrived meanwhile (engines/join.py)
        sample:  ids, logprobs = sample(batch.logits)               (engines/sampling.py)
        finish:  each row's request takes its token; it ends at a stop id, a stop string,
                 max_tokens, or when its caller gave up
        if no row is live: return
        compact: drop finished rows from the batch and its cache (a quarter or more done)
        step:    batch.logits = forward(ids, batch.cache)          one token per row

`prefill` runs each prompt prefix once and keeps their KV across batches in a radix tree (per
model version and adapter, at most `prefix_cache_bytes`, least recently used out). The model's
layers are checked when the decoder is made (engines/layers.py): full-attention and sliding-window
layers keep every token's KV (a sliding layer's mask windows it); a model with conv layers (lfm2)
prefills each prompt whole, without the tree, and says so once in the log; a model of any other
layer kind, or whose forward pass does not keep its state in that cache, is refused then, naming
its model_type.

`sample` draws each row's token with its request's temperature and top_p from a uniform seeded by
(the request's seed, the token's index), and keeps the token's logprob under the full temperature-scaled
distribution, log_softmax(l / T), before top-p: the quantity the trainer recomputes. A stop id is
the tokenizer's eos, the model's generation_config eos or one of the request's stop_token_ids; it
stays in the response (finish "stop"), as does the token that completes one of the request's stop
strings ("stop"); at max_tokens the finish is "length". `step` writes each step's keys and values
in place (engines/kv_cache.py): for llama, qwen2, qwen3, mistral and gemma3_text one function of
tensors, compiled with `compile` (engines/decode_graph.py), else transformers' forward.

The forward passes run `runner`: a copy of the model's modules around its own weights (fp32), or
a bf16 copy that `update_weights` refreshes (engines/precision.py). With several policies (config
`policies`) each request names its LoRA adapter (SamplingParams.adapter) and one batch decodes rows
of several adapters (peft's `adapter_names`: the base weights' matmuls shared).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tracetrain.engines import decode_graph, layers
from tracetrain.engines.base import OnTokens, SamplingParams, stop_string_in
from tracetrain.engines.batch import Batch
from tracetrain.engines.local_options import LocalOptions
from tracetrain.engines.local_stats import LocalStats
from tracetrain.engines.precision import engine_precision, refresh
from tracetrain.engines.prefill import Prefill
from tracetrain.engines.sampling import sample_tokens, uniform
from tracetrain.models import lora
from tracetrain.models.compute import on_compute

log = logging.getLogger("tracetrain.engine")

# joiners(room): up to `room` requests that join the decoding batch now
Joiners = Callable[[int], "list[Request]"]
# deliver(runs): one step's new ids, (the request's on_tokens, [id]) each, to their streams
Deliver = Callable[[list[tuple[OnTokens, list[int]]]], None]


@dataclass
class Request:
    """A prompt to decode, and what the decoder makes of it: `ids`, `logprobs`, `finish`."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int | None  # the draws' seed (None until its batch is formed: a lockstep's order)
    on_tokens: OnTokens | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None  # "stop" | "length" | "cancelled"
    cancelled: bool = False  # set when its caller gave up (another thread); read by the decoder

    def take(self, token: int, logprob: float, stops: frozenset[int], tokenizer: Any) -> bool:
        """Append a sampled token; whether it ends the request (`finish` then set)."""
        self.ids.append(token)
        self.logprobs.append(logprob)
        stop = self.params.stop
        if token in stops or (stop and stop_string_in(tokenizer, self.ids, stop)):
            self.finish = "stop"
        elif len(self.ids) >= self.params.max_tokens:
            self.finish = "length"
        return self.finish is not None


class Decoder:
    """A transformers causal LM decoding batches of requests (module docstring). `decode` fills
    each request's ids, logprobs and finish; `update_weights` swaps weights between batches."""

    def __init__(self, model: Any, tokenizer: Any, options: LocalOptions):
        self.model = model if options.device is None else model.to(options.device)
        self.device = next(self.model.parameters()).device
        self.layer_kinds = layers.layer_kinds(self.model)  # (a kind it cannot serve: refused)
        self.tokenizer, self.max_batch_size = tokenizer, options.max_batch_size
        limit = getattr(model.config, "max_position_embeddings", None)
        if options.max_context is None and limit is None:
            raise ValueError(
                "max_context is needed: the model config has no max_position_embeddings")
        self.max_context = int(options.max_context if options.max_context is not None else limit)
        if limit is not None and self.max_context > limit:
            raise ValueError(f"max_context {self.max_context} exceeds the model's "
                             f"max_position_embeddings {limit}")
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.model_version = options.model_version
        eos = [tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)]
        self.stop_ids = frozenset(i for e in eos for i in (e if isinstance(e, list) else [e])
                                  if i is not None)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.stop_ids, default=0)
        # torch's thread count is per OS thread: the decode sets its own (0: this thread's)
        self.threads = options.threads if options.threads > 0 else torch.get_num_threads()
        # the module the forward passes run: the model, or its bf16 copy ("auto" times both)
        self.precision, self.runner, self.precision_s = on_compute(
            self.threads, engine_precision, self.model, options.precision)
        layers.check_serves(self.runner, self.layer_kinds, self.device)  # (or refused now)
        names = lora.adapter_names(self.model)  # several policies: adapters requests may name
        self.adapters = (*names, lora.BASE) if names else ()
        self._lock = threading.Lock()  # held while the model decodes or its weights change
        self.stats = LocalStats()
        # a decode step as one function (compiled with `compile`), or transformers' forward
        self.graph, self.graph_note = decode_graph.build(self.runner, options.compile, self.stats)
        self._step = self.graph or self._forward  # a decode step's forward pass
        budget = options.prefix_cache_bytes if options.prefix_cache else 0
        self.plain = layers.why_plain(self.model, self.layer_kinds)  # why no prefix cache
        if self.plain and options.prefix_cache:
            log.warning("local engine %r: %s", options.name, self.plain)
        self._prefill = Prefill(self._forward, pad_id=self.pad_id, device=self.device,
                                budget=budget, stats=self.stats, kinds=self.layer_kinds,
                                plain=self.plain is not None)

    @torch.inference_mode()
    def decode(self, requests: list[Request], version: int, joiners: Joiners | None = None,
               deliver: Deliver | None = None) -> None:
        """Fill each request's ids, logprobs and finish: one batched loop (module docstring).
        `joiners`: asked at each step for requests to join (appended to `requests`); `deliver`:
        given each step's new ids of the requests that stream (on_tokens)."""
        batch = self._start(requests, version)  # prefill
        while True:
            if joiners is not None:  # join
                self._join(batch, joiners(self.max_batch_size - batch.n_live()), version)
            with self.stats.timing("sample_s"):
                self._sample(batch)  # sample
                self._finish(batch, deliver)  # finish
            if batch.n_live() == 0:
                return
            batch.compact()  # compact
            self._decode_step(batch)  # step

    def _start(self, requests: list[Request], version: int) -> Batch:
        """The batch of `requests`: prompts prefilled, room reserved for their tokens."""
        with self.stats.timing("prefill_s"):
            batch = self._prefilled(requests, version)
            batch.reserve()
        self.stats.batch_started(len(requests))
        return batch

    def _join(self, batch: Batch, new: list[Request], version: int) -> None:
        """`new` requests prefilled on their own, their rows after the batch's."""
        if not new:
            return
        with self.stats.timing("prefill_s"):
            batch.join(self._prefilled(new, version))
            batch.reserve()
            self.stats.rows_joined(len(new), batch.n_live())

    def _prefilled(self, requests: list[Request], version: int) -> Batch:
        """A batch of `requests`, their prompts prefilled (engines/prefill.py)."""
        # several policies: each request's adapter (one naming none: the active one)
        adapter_of = None if not self.adapters else [
            r.params.adapter or self.model.active_adapter for r in requests]
        logits, cache, mask, next_pos = self._prefill(
            [r.prompt_ids for r in requests], version, adapter_of)
        return Batch(requests, list(range(len(requests))), [True] * len(requests), logits, cache,
                     mask, next_pos, *self._row_params(requests), adapter_of)

    def _row_params(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor, list]:
        """(temperature [R], top_p [R], the stop ids of each) of `requests`."""
        return (torch.tensor([float(r.params.temperature) for r in requests], device=self.device),
                torch.tensor([float(r.params.top_p) for r in requests], device=self.device),
                [self.stop_ids | set(r.params.stop_token_ids) for r in requests])

    def _sample(self, batch: Batch) -> None:
        """Each row's next token and its logprob, drawn from its logits (engines/sampling.py)."""
        reqs = batch.requests
        u = torch.tensor(  # (row i's draw for its token number len(ids): engines/sampling.py)
            [uniform(reqs[i].seed, len(reqs[i].ids)) for i in batch.rows], dtype=torch.float64,
            device=self.device)
        batch.tokens, batch.logprobs = sample_tokens(batch.logits, batch.temperature,
                                                     batch.top_p, u)

    def _finish(self, batch: Batch, deliver: Deliver | None) -> None:
        """Each live row's request takes its token (or ends: its caller is gone); the streams get
        theirs."""
        runs = []
        for b, (i, t, v) in enumerate(zip(batch.rows, batch.tokens.tolist(),
                                          batch.logprobs.tolist(), strict=True)):
            if not batch.live[b]:
                continue
            r = batch.requests[i]
            if r.cancelled:  # its caller left: stop decoding it
                r.finish, batch.live[b] = "cancelled", False
                continue
            batch.live[b] = not r.take(t, v, batch.stops[i], self.tokenizer)
            if r.on_tokens is not None:
                runs.append((r.on_tokens, [t]))
        if runs and deliver is not None:
            deliver(runs)
        self.stats.tokens += len(batch.rows)

    def _decode_step(self, batch: Batch) -> None:
        """One decode step: the sampled ids in, each row's next-token logits out."""
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=-1)
        with self.stats.timing("decode_forward_s"):
            batch.logits, batch.cache = self._step(batch.tokens[:, None], batch.mask,
                                                   batch.next_pos[:, None], batch.cache,
                                                   batch.adapters)
        batch.next_pos = batch.next_pos + 1

    def _forward(self, input_ids, attention_mask, position_ids, cache, adapters=None):
        """(next-token logits [B, V] float32, the cache); `adapters`: each row's adapter."""
        self.stats.forward_calls += 1
        per_row = {} if adapters is None else {"adapter_names": adapters}
        out = self.runner(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, past_key_values=cache, use_cache=True,
                          logits_to_keep=1, **per_row)
        return out.logits[:, -1, :].float(), out.past_key_values

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
