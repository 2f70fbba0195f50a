"""
tests/test_distributed.py: data parallelism with torchrun (training/distributed.py) -- two CPU ranks (gloo) take
exactly the step one process takes on the union of their rollouts, and a task count that does not divide by
the ranks is one clear error.

    python -m pytest -q tests/test_distributed.py
"""
import dataclasses
import subprocess
import sys
import time

import pytest
import torch

import seed
import train
from models.policy import load_policy
from test_seed import SKILL, SUBPROCESS_ENV, final_weights, max_diff, read_lines, snapshot, weight_change


# Run by each torchrun rank: train.main as launched, recording what the rank rolled out, the gradient it steps
# with and the weights it ends with. The analysis is stubbed with a fixed skill on every other trajectory (a
# random model writes none that parse), so the teacher re-scoring and the distillation term are exercised. Rank
# 1's trajectories lose their last step: the ranks then hold 3:2 token counts (the random model's responses all
# run to the token limit), and a per-rank token mean would weigh rank 1's tokens 1.5 times too much.
DDP_DRIVER = '''
import os, sys, torch
import seed, train
SKILL = sys.argv[1]
record = {}
rollout, policy_update = seed.rollout, seed.policy_update

def recording_rollout(*args, **kwargs):
    trajectories = rollout(*args, **kwargs)
    if kwargs.get("desc", "rollout") == "rollout":  # not an evaluation
        for trajectory in trajectories:
            trajectory.steps = trajectory.steps[:len(trajectory.steps) - int(os.environ["RANK"])]
        record["trajectories"] = trajectories
    return trajectories

def stub_analyze(policy, trajectories, *args, **kwargs):
    record["skills"] = [SKILL if i % 2 == 0 else None for i in range(len(trajectories))]
    return record["skills"], ["stub"] * len(trajectories)

def recording_update(policy, optimizer, *args, **kwargs):
    record["policy"] = policy
    grads = lambda *_: record.update(grads=[p.grad.clone() for p in policy.model.parameters()])
    optimizer.register_step_pre_hook(grads)  # the summed, clipped gradient the rank steps with
    return policy_update(policy, optimizer, *args, **kwargs)

seed.rollout, seed.analyze, seed.policy_update = recording_rollout, stub_analyze, recording_update
config = train.get_config(sys.argv[2:])
train.main(config)
torch.save({"trajectories": record["trajectories"], "skills": record["skills"], "grads": record["grads"],
            "weights": record["policy"].model.state_dict()},
           os.path.join(config.out_dir, f"rank{os.environ['RANK']}.pt"))
'''


def test_two_rank_update_equals_one_process(tiny, tmp_path):
    """torchrun, 2 CPU ranks (gloo), one update of 2 tasks (one per rank): every rank ends with the same weights,
    rank 0 alone writes the log and the checkpoint, and the weights equal one process's update on the union of
    the ranks' rollouts. The union is taken from what the ranks recorded: one process sampling both tasks in one
    batch draws other random numbers, so its rollouts could not be the same ones."""
    out = tmp_path / "ddp"
    (tmp_path / "ddp_driver.py").write_text(DDP_DRIVER)
    flags = ["--model", tiny[1], "--stage", "rl", "--updates", 1, "--tasks-per-update", 2, "--group-size", 2,
             "--max-steps", 3, "--max-new-tokens", 8, "--eval-tasks", 3, "--lr", 1e-3, "--distill-mode", "loss",
             "--distill-coef", 0.5, "--entropy-coef", 0.01, "--analysis-prompt-tokens", 1024,
             "--analysis-max-new-tokens", 96, "--out-dir", out]
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(tmp_path / "ddp_driver.py"), SKILL, *map(str, flags)], capture_output=True, text=True,
                            timeout=300, env=SUBPROCESS_ENV, cwd=tmp_path)
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    rank_diff = max(max_diff(ranks[0]["weights"][k], ranks[1]["weights"][k]) for k in ranks[0]["weights"])
    (record,) = read_lines(out / "metrics.jsonl")  # one line: rank 1 wrote none
    evals = read_lines(out / "eval.jsonl")
    assert [e["split"] for e in evals] == ["valid_seen", "valid_unseen"] * 2, evals
    assert all(sum(e["per_type"].values()) >= 0 and len(e["per_type"]) >= 1 for e in evals), evals

    # one process: the same update on the union of both ranks' rollouts (rank 1's task is group 1)
    cfg = train.get_config([str(f) for f in flags], check=False)  # (its --out-dir now holds the run)
    trajectories = ranks[0]["trajectories"] + [dataclasses.replace(t, group=t.group + 1) for t in ranks[1]["trajectories"]]
    skill_list = ranks[0]["skills"] + ranks[1]["skills"]

    def one_process_update(max_batch_tokens):
        """(gradient stepped with, metrics, weights after) of train.py's update phases in one process."""
        policy = load_policy(tiny[1], "cpu", "float32")
        rows = seed.step_rows(trajectories, skill_list)
        _, teacher, _, has_teacher = seed.rescore(policy, rows, need_old=False)
        advantages = seed.step_advantages(trajectories, rows, cfg.advantage_norm, cfg.grpo_stats)  # (B,) as train.py
        optimizer = torch.optim.AdamW(policy.model.parameters(), lr=cfg.lr, weight_decay=0.0)
        grads = []
        optimizer.register_step_pre_hook(lambda *_: grads.extend(p.grad.clone() for p in policy.model.parameters()))
        metrics, skipped = seed.policy_update(policy, optimizer, rows.prompts, rows.responses, advantages,
                                              None, teacher, None, has_teacher,
                                              dict(distill_coef=cfg.distill_coef, distill_mode=cfg.distill_mode,
                                                   entropy_coef=cfg.entropy_coef), max_batch_tokens=max_batch_tokens)
        assert skipped is None, skipped
        return grads, metrics, list(policy.model.parameters())

    grads, metrics, weights = one_process_update(cfg.max_batch_tokens)
    row_by_row, _, _ = one_process_update(1)  # the float noise of another batch layout, for scale
    saved, _ = final_weights(str(out))
    grad_max = max(g.abs().max().item() for g in grads)
    grad_diff = max(max_diff(a, b) for a, b in zip(grads, ranks[0]["grads"])) / grad_max
    layout_noise = max(max_diff(a, b) for a, b in zip(grads, row_by_row)) / grad_max
    weight_diff = max(max_diff(a, b) for a, b in zip(weights, saved.parameters()))
    moved = weight_change(snapshot(load_policy(tiny[1]).model), saved)
    metric_diff = max(abs(metrics[k] - record[k]) for k in metrics)
    tokens = [sum(len(s.response_ids) for t in r["trajectories"] for s in t.steps) for r in ranks]
    print(f"\ntorchrun 2 ranks (gloo), one update: {seconds:.1f}s; response tokens per rank {tokens}; rank 0 vs "
          f"rank 1: max weight diff {rank_diff:.2e}; 2 ranks vs 1 process: gradient max diff {grad_diff:.2e} of its "
          f"largest entry (1 process, micro-batches of one row vs one batch: {layout_noise:.2e}), weights after "
          f"AdamW {weight_diff:.2e} (moved up to {moved:.2e}), loss metrics {metric_diff:.2e}")
    assert rank_diff == 0.0, f"the ranks hold different weights: max diff {rank_diff}"
    assert record["skipped"] is None and record["rows"] == sum(len(t.steps) for t in trajectories), record
    assert record["teacher_token_share"] > 0 and tokens[0] != tokens[1], (record, tokens)
    assert moved > 1e-4, f"the update barely moved the weights ({moved}): the comparison would prove nothing"
    assert grad_diff < 1e-4, f"2 ranks step with another gradient than 1 process: max diff {grad_diff} (relative)"
    # AdamW's first step is lr * g / (|g| + eps) per entry, so an entry whose gradient is at the float-noise
    # floor can move by a fraction of lr either way: weights are held to a fraction of lr, the gradient above
    assert weight_diff < 0.1 * cfg.lr, f"2 ranks differ from 1 process: max weight diff {weight_diff}"
    assert metric_diff < 1e-5, f"loss metrics differ: {metric_diff}"


def test_tasks_per_update_must_divide_by_ranks(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit):
        train.get_config(["--tasks-per-update", "8"])
    assert "must divide by the 3 torchrun processes" in capsys.readouterr().err
