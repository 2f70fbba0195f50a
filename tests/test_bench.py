"""
tests/test_bench.py: benchmarks/bench.py and the packed (varlen) layout it measures -- packed scoring runs
models.packing's varlen attention and equals the padded layout (log-probs, entropies, gradient), and the
benchmark's helpers and a --quick section run (tests never time anything).

    python -m pytest -q tests/test_bench.py
"""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import seed
from benchmarks import bench
from models import packing
from test_seed import REPO, SUBPROCESS_ENV, max_diff


def test_packed_logits_run_varlen_attention_and_restore_the_model(tiny, trajectories, monkeypatch):
    """The packed layout goes through models.packing.varlen_attention once per layer (no (N, N) mask), equals the
    padded layout, and leaves the model's own attention implementation in place afterwards, also after an error."""
    policy, _ = tiny
    calls = []
    original = packing.varlen_attention
    monkeypatch.setattr(packing, "varlen_attention", lambda *a, **k: (calls.append(k["cu_seq_lens_q"].tolist()),
                                                                   original(*a, **k))[1])
    full = trajectories[0].steps[-1].prompt_ids
    prompts, responses = [full[:50], full, full[:9]], [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    implementation = policy.model.config._attn_implementation
    packed, _ = seed.forward_logprobs(policy.model, prompts, responses, policy.pad_id, 0.8, "packed")
    padded, _ = seed.forward_logprobs(policy.model, prompts, responses, policy.pad_id, 0.8, "padded")
    mask = seed.response_mask(responses)
    diff = max_diff(packed * mask, padded * mask)
    print(f"\nvarlen packed vs padded log-probs: max diff {diff:.2e}")
    assert diff < 1e-5, diff
    layers = policy.model.config.num_hidden_layers
    starts = [0, 53, 53 + len(full) + 1, 53 + len(full) + 1 + 14]
    assert calls == [starts] * layers, (calls, starts)
    assert policy.model.config._attn_implementation == implementation
    with pytest.raises(IndexError):  # an out-of-vocabulary id fails inside the forward pass
        seed.forward_logprobs(policy.model, [[10 ** 6]], [[1]], policy.pad_id, 1.0, "packed")
    assert policy.model.config._attn_implementation == implementation, "an error left the varlen attention set"


def test_forward_logprobs_packed_gradient_equals_padded(tiny, trajectories):
    """The flat packed scoring (no (B, R, V) tensor) gives the padded layout's log-probs, entropies and gradient."""
    policy, _ = tiny
    rows = seed.step_rows(trajectories)
    weights = torch.randn(seed.response_mask(rows.responses).shape, generator=torch.Generator().manual_seed(7))
    results = {}
    for layout in ("padded", "packed"):
        model = copy.deepcopy(policy.model)
        logp, entropy = seed.forward_logprobs(model, rows.prompts, rows.responses, policy.pad_id, 0.7, layout,
                                              entropy=True)
        mask = seed.response_mask(rows.responses)
        ((logp * weights * mask).sum() + (entropy * mask).sum()).backward()
        results[layout] = (logp * mask, entropy * mask, [p.grad.clone() for p in model.parameters()])
    (a, b) = results["padded"], results["packed"]
    diffs = (max_diff(a[0], b[0]), max_diff(a[1], b[1]), max(max_diff(x, y) for x, y in zip(a[2], b[2])))
    print(f"\nflat packed vs padded: log-probs {diffs[0]:.2e}, entropy {diffs[1]:.2e}, gradient {diffs[2]:.2e}")
    assert diffs[0] < 1e-5 and diffs[1] < 1e-5 and diffs[2] < 1e-4, diffs


def test_bench_compare_interleaves_variants():
    order = []
    times = bench.compare({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=3, warmup=1)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"], order  # warm-up, then rounds in rotated order
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert bench.median_ratio({"x": [2.0, 9.0, 3.0], "y": [1.0, 1.0, 1.0]}, "x", "y") == 3.0


def test_bench_matmul_bound_counts_its_own_flops():
    """The FLOPs bench reports for the matmul bound are the FLOPs its run performs (torch's counter)."""
    from torch.utils.flop_counter import FlopCounterMode
    model = bench.random_model("tiny", layers=2)
    run, flops = bench.matmul_bound(model.config, [7, 12], kept=5)
    with FlopCounterMode(display=False) as counter:
        run()
    assert counter.get_total_flops() == flops, (counter.get_total_flops(), flops)


def test_bench_padded_tokens_and_realistic_mix():
    prompts, responses = [[1] * 3, [1] * 5, [1] * 4], [[2] * 4, [2] * 1, [2] * 2]
    assert bench.padded_tokens(prompts, responses, max_batch_tokens=10 ** 6) == 3 * (5 + 4)
    assert bench.padded_tokens(prompts, responses, max_batch_tokens=1) == 7 + 6 + 6  # one row per micro-batch
    shapes = bench.realistic_mix(24)
    assert sum(p >= 1200 for p, _ in shapes) == 2 and all(8 <= r <= 160 for _, r in shapes), shapes


def test_bench_memory_child_reports_peak_extra_memory():
    """The fresh-process measurement of section 3, at a size small enough for a test: both kinds agree on the
    log-probs, the naive one needs at least its (T, V) float32 log_softmax (64 MB here), the chunked one (64-token
    chunks, 4 MB each; the allocator keeps a few) less than half of that."""
    run = lambda kind: json.loads(subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "bench.py"), "--child", "memory", kind, "1024", "16384",
         "64"], env=SUBPROCESS_ENV, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    naive, chunked = run("naive"), run("chunked")
    assert abs(naive["checksum"] - chunked["checksum"]) < 1e-3 * abs(naive["checksum"]), (naive, chunked)
    assert naive["extra_mb"] >= 60 and chunked["extra_mb"] < naive["extra_mb"] / 2, (naive, chunked)


def test_bench_quick_sections_run(capsys):
    """bench.py --quick, its cheapest sections and one SEED / GRPO update each (the others run the same
    helpers at larger sizes)."""
    summary = bench.main(["--quick", "--only", "rescore", "overhead", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "## 1. re-scoring throughput" in out and "## summary" in out, out
    assert "SEED / GRPO:" in out and len(summary) == 2 and summary[0][0].startswith("re-scoring"), summary
