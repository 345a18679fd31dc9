"""A tiny model toolkit: a byte-level BPE tokenizer with a ChatML template, and a small Llama.

Everything is built offline, in-process and deterministically: the same inputs give the same
vocabulary, merges and weights. Used by tests, examples and benchmarks that need a real
transformers model without a hub download.

Tokenizer layout (ids):
    0 <|endoftext|> (pad)   1 <|im_start|>   2 <|im_end|> (eos: generation stops here)
    3..258   the 256 byte symbols of byte-level BPE (any text encodes and decodes losslessly)
    ...      merges learned from the corpus (digits removed from it)
    last 101 number tokens: every 2-digit string "00".."99", then "100"
Digit runs are cut off from letters and spaces by the pre-tokenizer (at most 3 digits per piece),
so every number 0..100 is exactly one token: "guess 42" -> ["guess", " ", "42"].

    tok = build_tokenizer()
    model = build_model(tok)
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    save_tiny("out/tiny", tok, model); AutoModelForCausalLM.from_pretrained("out/tiny")
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:  # transformers (slow to import) is imported where it is used
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
NUMBER_TOKENS = [f"{i:02d}" for i in range(100)] + ["100"]
N_BYTES = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + N_BYTES + len(NUMBER_TOKENS)  # 360
DEFAULT_VOCAB_SIZE = 512
ROLES = ("system", "user", "assistant", "tool")

# ChatML, as Qwen2 uses it. Content may be a string, None, or a list of {"type": "text"} parts;
# assistant tool calls render as <tool_call>{json}</tool_call>; `tools` go in a system block.
CHAT_TEMPLATE = (
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c -%}{%- for p in c -%}{%- if p.type == 'text' -%}{{ p.text }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(skip_first=false) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{{- text(messages[0].content) + '\\n\\n' -}}{%- set ns.skip_first = true -%}"
    "{%- endif -%}"
    '{{- \'# Tools\\nCall a function as <tool_call>{"name": ..., "arguments": ...}</tool_call>.\' -}}'
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('message role must be system, user, assistant or tool, got ' + m.role) -}}"
    "{%- endif -%}"
    "{%- if not (loop.first and ns.skip_first) -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + text(m.content) -}}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}"
    "{%- for tc in m.tool_calls -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{%- if text(m.content) or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set args = f.arguments if f.arguments is string else (f.arguments | tojson) -%}"
    "{{- '<tool_call>{\"name\": \"' + f.name + '\", \"arguments\": ' + args + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def default_corpus(n_games: int = 200, seed: int = 0) -> list[str]:
    """Deterministic text like the demos': chat roles, number-guessing games, arithmetic, tool calls."""
    rng = random.Random(seed)
    lines = [
        "system\nYou are a helpful assistant. Answer briefly.",
        "system\nYou are playing a game. Guess the secret number. Reply with the number only.",
        "user\nWhat is the answer? Use the calculator tool if you need it.",
        "assistant\nThe answer is",
        'tool\n{"result": }',
        "Too high. Too low. Correct! You win.",
        '<tool_call>{"name": "calculator", "arguments": {"expression": ""}}</tool_call>',
        "The quick brown fox jumps over the lazy dog. Hello, world! Thank you.",
    ]
    for _ in range(n_games):
        lo, hi = 1, rng.choice([8, 16, 100])
        secret = rng.randint(lo, hi)
        lines.append(f"user\nI am thinking of a number between {lo} and {hi}. Guess it.")
        for _ in range(rng.randint(1, 4)):
            guess = rng.randint(lo, hi)
            lines.append(f"assistant\n{guess}")
            word = "higher" if guess < secret else "lower" if guess > secret else "correct"
            lines.append(f"user\n{word.capitalize()}. The number is {word}. Guess again.")
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(["+", "-", "*"])
        lines.append(f"user\nWhat is {a} {op} {b}? Think step by step, then give the answer.")
    return lines


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    digits = pre_tokenizers.Split(Regex(r"\d{1,3}"), behavior="isolated")
    return pre_tokenizers.Sequence(
        [digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )


def train_bpe(
    corpus: Iterable[str] | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> Tokenizer:
    """The raw `tokenizers` BPE of `build_tokenizer` (see the module docstring for its layout).

    `vocab_size` bounds everything (3 special + 256 bytes + learned merges + 101 number tokens),
    so it must be >= 360; a small corpus may run out of merges first.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size is {vocab_size}; it must be >= {MIN_VOCAB_SIZE} "
            f"({len(SPECIAL_TOKENS)} special + {N_BYTES} byte + {len(NUMBER_TOKENS)} number tokens)"
        )
    texts = default_corpus() if corpus is None else list(corpus)
    if not all(isinstance(t, str) for t in texts):
        raise TypeError("corpus must be an iterable of str")
    # 1. Learn merges on the corpus without digits (numbers get fixed merges in step 2).
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(NUMBER_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator((re.sub(r"\d", "", t) for t in texts), trainer)
    vocab: dict[str, int] = bpe.get_vocab()
    merges = [tuple(m) for m in json.loads(bpe.to_str())["model"]["merges"]]
    # 2. Every 2-digit string, then "100", is one token: merges (d1, d2), then ("1", "00").
    for tok in NUMBER_TOKENS:
        vocab[tok] = len(vocab)
        merges.append((tok[0], tok[1]) if len(tok) == 2 else ("1", "00"))
    assert len(vocab) <= vocab_size, (len(vocab), vocab_size)
    # 3. The final BPE: byte-level symbols, fixed merges, special tokens matched first.
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = _pre_tokenizer()
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIAL_TOKENS)
    return tk


def build_tokenizer(
    corpus: Iterable[str] | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """`train_bpe(corpus, vocab_size)` as a transformers tokenizer with the ChatML template;
    eos = <|im_end|> (the end of a ChatML turn), pad = <|endoftext|>, padding on the left."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(corpus, vocab_size),
        eos_token=IM_END,
        pad_token=PAD,
        padding_side="left",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A Llama causal LM (GQA, RoPE, SwiGLU, RMSNorm) with tied embeddings, initialised from `seed`.

    0.77M parameters by default. intermediate_size defaults to 8/3 * hidden rounded up to a
    multiple of 32 (352 for 128). Llama rather than Qwen2 (the same blocks save Qwen2's q/k/v
    biases): transformers 5 makes `AutoTokenizer` load a qwen2 directory with its own Qwen2
    tokenizer class, which replaces our pre-tokenizer; for llama it loads tokenizer.json as is.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if intermediate_size is None:
        intermediate_size = -(-(8 * hidden_size // 3) // 32) * 32
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def save_tiny(
    path: str | Path,
    tokenizer: PreTrainedTokenizerFast | None = None,
    model: LlamaForCausalLM | None = None,
    **model_kwargs,
) -> Path:
    """Write tokenizer and model to `path` (building the defaults when not given); load them back
    with `AutoTokenizer.from_pretrained(path)` / `AutoModelForCausalLM.from_pretrained(path)`."""
    path = Path(path)
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    model = model if model is not None else build_model(tokenizer, **model_kwargs)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return path


def load_tiny(path: str | Path) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """(model, tokenizer) from a directory written by `save_tiny`, offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return model.eval(), tok
