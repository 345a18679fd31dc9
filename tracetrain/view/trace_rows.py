"""`tracetrain rows`: build rows from example traces (examples/traces/*.json) with a small BPE
tokenizer trained in-process on their text, and print the rows, metrics and drift breaks."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tracetrain.types import Rollout, TraceError, Turn, UsageError

DEFAULT_TRACES = Path(__file__).resolve().parents[2] / "examples" / "traces"
SPECIAL_TOKENS = ["<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]


# ---------------------------------------------------------------- demo: traces and tokenizer


def build_demo_tokenizer(texts: list[str], vocab_size: int = 400):
    """A byte-level BPE trained on `texts` (offline, milliseconds), as a transformers tokenizer.

    Special tokens are SPECIAL_TOKENS; <|pad|> is id 0.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>")


def read_trace_files(path: Path) -> list[dict[str, Any]]:
    """The raw rollout dicts of one JSON file, or of every *.json in a folder (sorted by name);
    a UsageError naming the file if one is missing or not such JSON."""
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files:
        raise UsageError(f"no *.json trace files in {path}")
    out = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except OSError as e:
            raise UsageError(f"{f}: {e.strerror or e}") from None
        except ValueError as e:  # not JSON, not UTF-8
            raise UsageError(f"{f}: not JSON ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("rollouts"), list):
            raise UsageError(f"{f}: expected an object with a 'rollouts' list")
        out.extend(data["rollouts"])
    return out


def _get(d: Any, key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    """d[key], checked to be of `kind`; a UsageError naming the place otherwise."""
    if not isinstance(d, dict) or key not in d:
        raise UsageError(f"{where}: missing field {key!r}")
    if not isinstance(d[key], kind):
        raise UsageError(f"{where}.{key}: expected {kind}, got {type(d[key]).__name__}")
    return d[key]


def _turn_texts(raw: list[dict[str, Any]]):
    """(rollout index, turn dict, prompt text, response pieces) of every turn, checked."""
    for i, r in enumerate(raw):
        for k, t in enumerate(_get(r, "turns", f"rollouts[{i}]", list)):
            where = f"rollouts[{i}].turns[{k}]"
            response = _get(t, "response", where, (str, list))
            pieces = [response] if isinstance(response, str) else response
            if not all(isinstance(p, str) for p in pieces):
                raise UsageError(f"{where}.response: expected a str or a list of str")
            yield i, t, _get(t, "prompt", where, str), pieces


def _texts(raw: list[dict[str, Any]]) -> list[str]:
    return [text for _, _, prompt, pieces in _turn_texts(raw) for text in (prompt, "".join(pieces))]


def traces_to_rollouts(raw: list[dict[str, Any]], tokenizer) -> list:
    """Tokenize the text traces into Rollouts (validated by their constructors: a UsageError
    naming the rollout, the turn and the field)."""

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    rollouts = []
    for n, r in enumerate(raw):
        for key in ("rollout_id", "group_id"):
            _get(r, key, f"rollouts[{n}]", object)
        turns = []
        for t in r["turns"]:
            pieces = [t["response"]] if isinstance(t["response"], str) else t["response"]
            response = [i for piece in pieces for i in enc(piece)]
            # Stand-in sampling logprobs: the demo has no model; any finite value <= 0 works.
            logprobs = [-0.1 * (1 + j % 5) for j in range(len(response))]
            try:
                turns.append(Turn(enc(t["prompt"]), response, logprobs, t.get("model_version")))
            except TraceError as e:
                raise UsageError(f"rollouts[{n}]: {e}") from None
        try:
            rollouts.append(Rollout(
                r["rollout_id"], r["group_id"], turns, r.get("reward"), r.get("state", "succeeded")
            ))
        except TraceError as e:
            raise UsageError(str(e)) from None  # it names the rollout
    return rollouts


# ---------------------------------------------------------------- demo: printing


def _runs(mask: list[bool]) -> str:
    """Run-length view of a 0/1 mask: '12x1 5x0 8x1'."""
    out, prev, n = [], None, 0
    for m in mask + [None]:
        if m == prev:
            n += 1
            continue
        if prev is not None:
            out.append(f"{n}x{int(prev)}")
        prev, n = m, 1
    return " ".join(out)


def format_row(batch, i: int, tokenizer) -> str:
    """One row for a person: rollout, first turn, prompt text, response region with trained
    spans in [[...]], the mask as runs, and the ids."""
    P = batch.prompt_length
    att = batch.attention_mask[i].tolist()
    ids = batch.input_ids[i].tolist()
    prompt = [t for t, a in zip(ids[:P], att[:P], strict=True) if a]
    n_region = sum(att[P:])
    region = ids[P : P + n_region]
    mask = batch.response_mask[i, :n_region].tolist()

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    pieces, j = [], 0
    while j < n_region:  # group equal-mask runs and decode each run
        k = j
        while k < n_region and mask[k] == mask[j]:
            k += 1
        piece = text(region[j:k])
        pieces.append(f"[[{piece}]]" if mask[j] else piece)
        j = k
    ro = int(batch.rollout_index[i])
    reward = float(batch.rewards[ro])
    return "\n".join(
        [
            f"row {i}: rollout {batch.rollout_ids[i]!r}  first turn {int(batch.turn_index[i])}  "
            f"model_version {int(batch.model_version[i])}  reward {reward}",
            f"  prompt   ({len(prompt)} tokens): {text(prompt)}",
            f"  response ({n_region} tokens, {sum(mask)} trained): {''.join(pieces)}",
            f"  mask     {_runs(mask)}",
            f"  ids      {' '.join(str(t) for t in prompt)} | "
            + " ".join(f"{t}*" if m else str(t) for t, m in zip(region, mask, strict=True)),
        ]
    )


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--traces", type=Path, default=DEFAULT_TRACES, help="a trace JSON file or a folder of them"
    )
    p.add_argument("--level", choices=["trajectory", "transition"], default="trajectory")
    p.add_argument("--max-prompt-length", type=int, default=256)
    p.add_argument("--max-response-length", type=int, default=256)
    p.add_argument(
        "--overlong", choices=["drop_rollout", "truncate", "error"], default="drop_rollout"
    )


def run_demo(args: argparse.Namespace) -> int:
    from tracetrain.rows.aggregate import aggregate

    for option, value in (("--max-prompt-length", args.max_prompt_length),
                          ("--max-response-length", args.max_response_length)):
        if value < 1:
            raise UsageError(f"{option} must be >= 1, got {value}")
    raw = read_trace_files(args.traces)
    tokenizer = build_demo_tokenizer(_texts(raw))
    rollouts = traces_to_rollouts(raw, tokenizer)
    try:
        batch, metrics, breaks = aggregate(
            rollouts,
            level=args.level,
            max_prompt_length=args.max_prompt_length,
            max_response_length=args.max_response_length,
            pad_token_id=tokenizer.pad_token_id,
            tokenizer=tokenizer,
            overlong=args.overlong,
            return_breaks=True,
        )
    except TraceError as e:  # --overlong error: a rollout of the traces is too long
        raise UsageError(str(e)) from None
    print(
        f"{len(rollouts)} rollouts from {args.traces} -> {batch.n_rows} rows, level {args.level!r}"
    )
    P, S = batch.prompt_length, batch.response_length
    print(f"batch: input_ids {tuple(batch.input_ids.shape)} (P={P}, S={S})")
    print("trained response tokens are shown in [[...]] and marked * in the ids\n")
    for i in range(batch.n_rows):
        print(format_row(batch, i, tokenizer) + "\n")
    print("metrics:")
    for key, value in metrics.items():
        print(f"  {key:<36} {value:.3f}" if isinstance(value, float) else f"  {key:<36} {value}")
    print(f"\nprefix breaks ({len(breaks)}):" if breaks else "\nprefix breaks: none")
    for b in breaks:
        print(
            f"  rollout {b.rollout_id!r} turn {b.turn_index}: {b.kind} at token {b.position}, "
            f"{b.recomputed_tokens} tokens recomputed\n    {b.snippet}"
        )
    return 0
