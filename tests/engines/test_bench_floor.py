"""bench/bench_floor.py's arithmetic on a 1-layer tiny model: the parameter count by hand, the
forward FLOPs against torch's own count (FlopCounterMode, eager attention) of a decode step, the
prefix trees of a step's prompts and rows, and a matmul rate that is a rate."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tracetrain.models.tiny import build_model, build_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_floor  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    model = build_model(tok, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                        intermediate_size=64, seed=0)
    model.config._attn_implementation = "eager"  # (torch counts no FLOPs of CPU sdpa)
    return model


def test_shapes_count_the_projections_by_hand(tiny):
    s = bench_floor.Shapes.of(tiny.config)
    assert (s.hidden, s.intermediate, s.layers, s.heads, s.kv_heads, s.head_dim) == (32, 64, 1, 4, 2, 8)
    # q 32x32, k and v 32x16, o 32x32, gate, up, down 32x64
    assert s.layer_params == 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64 == 9216
    assert s.layer_params == sum(w.numel() for ws in bench_floor.layer_weights(tiny) for w in ws)
    assert s.head_params == 32 * tiny.config.vocab_size == tiny.get_output_embeddings().weight.numel()


def test_forward_flops_equal_torchs_count_of_a_decode_step(tiny):
    s = bench_floor.Shapes.of(tiny.config)
    prompt = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 8, 10]])
    with torch.no_grad():
        cache = tiny(prompt, use_cache=True).past_key_values
        with FlopCounterMode(display=False) as counter:
            tiny(torch.tensor([[11], [12]]), past_key_values=cache, use_cache=True)
    # 2 rows, one token each, logits for both, each attending its 5 cached keys and itself
    want = bench_floor.forward_flops(s, tokens=2, logits=2, keys=2 * 6)
    assert want["attention"] == 4 * 1 * 32 * 12
    counts = {k: dict(v) for k, v in counter.get_flop_counts().items()}
    layer = counts["LlamaForCausalLM.model.layers.0"]
    assert layer[torch.ops.aten.mm] == want["layers"]  # the projections
    assert layer[torch.ops.aten.bmm] == want["attention"]  # q.k and p.v over the cache
    assert counts["LlamaForCausalLM.lm_head"] == {torch.ops.aten.mm: want["head"]}
    # all the rest: the rotary embedding's angles (O(d) per token, not counted)
    assert counter.get_total_flops() - sum(want.values()) == sum(
        counts["LlamaForCausalLM.model.rotary_emb"].values())


def test_step_work_counts_shared_prefixes_once():
    s = bench_floor.Shapes(hidden=32, intermediate=64, layers=1, heads=4, kv_heads=2, head_dim=8, vocab=100)
    reqs = [([1, 2, 3], [7, 8]), ([1, 2, 3], [7, 9]), ([1, 2, 4], [5, 6])]
    w = bench_floor.step_work(s, reqs)
    # prefill: (1) (1 2) (1 2 3) (1 2 4); 2 distinct prompts
    assert (w["prefill"]["tokens"], w["prefill"]["G"]) == (4, 2)
    assert w["prefill"]["flops"] == bench_floor.forward_flops(s, 4, 2, 1 + 2 + 3 + 3)
    # decode: the second token of each row, at position 3, attending 4 keys
    assert (w["decode"]["M"], w["decode"]["tokens"]) == (3, 3)
    assert w["decode"]["flops"] == bench_floor.forward_flops(s, 3, 3, 12)
    # update: 1 2 3 7 (twice), 1 2 4 5 -> (1) (12) (123) (1237) (124) (1245); 6 trained tokens
    f = bench_floor.forward_flops(s, 6, 6, 1 + 2 + 3 + 4 + 3 + 4)
    assert (w["update"]["tokens"], w["update"]["G"]) == (6, 6)
    assert w["update"]["flops"] == {k: 3 * v for k, v in f.items()}


def test_matmul_rate_and_floor(tiny):
    w = [x for ws in bench_floor.layer_weights(tiny) for x in ws]
    for backward in (False, True):
        rate = bench_floor.matmul_rate(w, 16, torch.float32, backward=backward, repeats=2)
        assert math.isfinite(rate) and rate > 0
    flops = {"layers": 4e9, "attention": 1e9, "head": 2e9}
    assert bench_floor.floor_s(flops, {"layers": 10.0, "head": 4.0}) == pytest.approx(0.5 + 0.5)


@pytest.mark.slow
def test_bench_floor_runs_a_real_step_beside_its_floors(capsys):
    """The whole bench, small (SmolLM2-135M, 1 question x 8 x 4 tokens): every phase of the
    breakdown, the parts adding up to the step, a floor and a ratio for the three matmul phases."""
    r = bench_floor.main(["--prompts", "1", "--new-tokens", "4", "--warmup", "0", "--repeats", "2", "--json"])
    rows = {row["phase"]: row for row in r["table"]}
    assert list(rows) == ["prefill", "decode", "sampling", "engine other", "gateway + agents",
                          "store reads", "rows", "update", "sync", "rest"]
    assert sum(row["measured_s"] for row in rows.values()) == pytest.approx(r["step_s"])
    for phase in ("prefill", "decode", "update"):  # (no timing bound: a busy machine's rate is low)
        assert rows[phase]["measured_s"] > 0 and rows[phase]["floor_s"] > 0
        assert rows[phase]["ratio"] == pytest.approx(rows[phase]["measured_s"] / rows[phase]["floor_s"])
    assert r["work"]["decode"]["M"] == 8 and r["work"]["decode"]["tokens"] == 8 * 3
    assert r["torch_threads"] == 2 and r["cpu"] and '"table"' in capsys.readouterr().out
