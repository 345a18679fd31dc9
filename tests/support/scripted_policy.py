"""engine.kind `scripted_tools`, registered by this test plugin (a config's `plugins`): a local
engine over the run's own policy that answers with scripted TEXT (a tiny random model never
calls a tool) but records the policy's real logprobs for those tokens, teacher-forced at the
request's temperature: the trainer's update is a real one on real rollouts with tool calls.

The script, read off the rendered prompt (the tiny model's ChatML template lists the offered
tools as JSON lines after "# Tools"): while the prompt holds fewer than CALLS tool results, call
the first tool offered with arguments drawn from the engine's seeded RNG (an integer 1..5 per
integer parameter, "a"/"b" per string); then answer "Done." Each reply is its canonical
tokenization plus eos, so the next request's rendering continues it exactly.
"""

from __future__ import annotations

import asyncio
import json
import random

import torch

from tracetrain.engines.base import Generation, SamplingParams
from tracetrain.engines.local import LocalEngine
from tracetrain.engines.start import register_engine
from tracetrain.models.compute import compute_thread

CALLS = 2  # tool calls per rollout before the final answer


def offered_tools(prompt: str) -> list[dict]:
    """The tools the tiny template rendered into the prompt (one JSON object per line)."""
    if "# Tools\n" not in prompt:
        return []
    block = prompt.split("# Tools\n", 1)[1].split("<|im_end|>", 1)[0]
    tools = []
    for line in block.splitlines()[1:]:
        try:
            tools.append(json.loads(line))
        except ValueError:
            pass
    return [t for t in tools if isinstance(t, dict) and "function" in t]


def value(schema: dict, rng: random.Random):
    kind = schema.get("type")
    if kind in ("integer", "number"):
        return rng.randint(1, 5)
    if kind == "boolean":
        return rng.random() < 0.5
    return rng.choice(["a", "b"])


def reply(prompt: str, rng: random.Random) -> str:
    tools = offered_tools(prompt)
    if tools and prompt.count("<|im_start|>tool\n") < CALLS:
        f = tools[0]["function"]
        props = f.get("parameters", {}).get("properties", {})
        args = {name: value(s, rng) for name, s in props.items()}
        return "<tool_call>" + json.dumps({"name": f["name"], "arguments": args}) + "</tool_call>"
    return "Done."


class ScriptedPolicy(LocalEngine):
    """LocalEngine whose `generate` answers the script with the policy's teacher-forced logprobs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rng = random.Random(0)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, on_tokens=None) -> Generation:
        self.check(prompt_ids, params)
        text = reply(self.tokenizer.decode(prompt_ids), self.rng)
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        loop = asyncio.get_running_loop()
        logprobs, version = await loop.run_in_executor(  # where the engine runs the model
            compute_thread(), self.teacher_forced, list(prompt_ids), ids, params.temperature or 1.0)
        if on_tokens is not None:
            on_tokens(list(ids))
        return Generation(ids, logprobs, finish, version)

    @torch.inference_mode()
    def teacher_forced(self, prompt: list[int], response: list[int], temperature: float):
        """log p(response_j | prompt, response_<j) under softmax(logits / temperature)."""
        with self._lock:
            ids = torch.tensor([prompt + response], device=self.device)
            logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            lp = torch.log_softmax(logits / temperature, dim=-1)
            out = lp.gather(-1, torch.tensor(response, device=self.device)[:, None])[:, 0]
            return out.tolist(), self.model_version


@register_engine("scripted_tools")
async def start_scripted(cfg, weights, tokenizer, *, version, run_dir, threads, log, lockstep=None):
    return ScriptedPolicy(weights, tokenizer, max_batch_size=4096, model_version=version,
                          seed=cfg.trainer.seed, threads=threads,
                          batch_window_ms=cfg.engine.batch_window_ms)
