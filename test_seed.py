"""
test_seed.py: fast CPU tests of the five teaching files -- loss.py, skills.py, seed.py, envs.py (make_env,
env_options, the guarded env calls) and train.py -- one section per file.

    python -m pytest -q -rs test_seed.py tests   # everything: these, and tests/ (one file per topic)
    python -m pytest -q test_seed.py -k skill    # one section by name

Tiny models built from configs, tokenizers trained in-process, data the code generates: no network, no GPU.
Equivalence tests report their max difference in the assert message. tests/ holds the tests of the machinery
in folders (simulators, adapters, warm-up, reliability, torchrun, TRL, vision, benchmarks); they share this
file's fixtures and helpers (tests/conftest.py puts the repository root on sys.path).
"""
import copy
import dataclasses
import functools
import json
import math
import os
import random
import subprocess
import sys
import time
import types

# CPU tests, also on a GPU machine: a visible GPU would put every policy loaded without a device on it in bf16,
# where exact comparisons (resume, fast vs reference) do not hold. Hidden before torch first asks for CUDA.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
import pytest
import torch
from transformers import AutoModelForCausalLM

import envs
import loss as L
import seed
import skills
import train
from envs import EnvFailure, call_env, env_options, make_env, restart_env, step_env
from loss import aggregate, entropy_from_logits, grpo_advantages, seed_delta, seed_loss, token_logprobs
from models.policy import Policy, load_policy
from models.tiny import build_tiny_policy
from simulators.household import PROMPT, HouseholdEnv
from skills import JSON_SHAPE, SKILL_HEADER, analyzer_prompt, discounted_returns, parse_skill, with_skill
from warmup import warm_start

# train.main in this process shares the cores by $OMP_NUM_THREADS (training/locks.py): one thread, as below
os.environ.setdefault("OMP_NUM_THREADS", "1")


# =============================================================================
# loss.py: log-probs, aggregation, advantages, the SEED loss
# =============================================================================

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
DISTILL_MODES = ("advantage", "loss", "gated")


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# ----------------------------------------------------------------------------- chunked log-probs and entropy

def naive_logprobs(logits, targets, temperature):
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def naive_entropy(logits, temperature):
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def softmax_inputs(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    full = torch.randn(2, 3, 18, 37, generator=generator) * 4  # (2, 3, T+1, V)
    logits = full.to(dtype)[:, :, :-1].detach().requires_grad_()  # not contiguous, as model_logits[:, :-1]
    targets = torch.randint(0, 37, (2, 3, 17), generator=generator)
    weights = torch.randn(2, 3, 17, generator=generator)  # upstream gradient
    return logits, targets, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("chunk_size", [1, 5, 17, 51, 10_000, None])
def test_token_logprobs_chunked_equals_naive(dtype, temperature, chunk_size):
    logits, targets, weights = softmax_inputs(dtype)
    logp = token_logprobs(logits, targets, temperature, chunk_size)
    assert logp.dtype == torch.float32 and logp.shape == targets.shape
    (grad,) = torch.autograd.grad((logp * weights).sum(), logits)
    reference = naive_logprobs(logits, targets, temperature)
    (reference_grad,) = torch.autograd.grad((reference * weights).sum(), logits)
    assert max_diff(logp, reference) <= 1e-6, f"log-prob max diff {max_diff(logp, reference):.3g}"
    grad_tolerance = 1e-6 if dtype == torch.float32 else 1e-2 * reference_grad.abs().max().item()
    diff = max_diff(grad, reference_grad)
    assert grad.dtype == dtype and diff <= grad_tolerance, f"gradient max diff {diff:.3g}"


def test_token_logprobs_output_can_be_edited_in_place():
    logits, targets, weights = softmax_inputs(torch.float32, seed=3)
    grads = []
    for function in (token_logprobs, lambda *args: naive_logprobs(*args, 1.0)):
        logp = function(logits, targets)
        logp.masked_fill_(targets == 0, 0.0)  # what a user may do with a mask
        grads.append(torch.autograd.grad((logp * weights).sum(), logits)[0])
    assert max_diff(*grads) <= 1e-6, f"gradient max diff {max_diff(*grads):.3g}"


def test_token_logprobs_bf16_large_logits_stay_finite():
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 50, 1000, generator=generator) * 300).to(torch.bfloat16)  # (B, T, V)
    targets = torch.randint(0, 1000, (4, 50), generator=generator)
    logp = token_logprobs(logits, targets, chunk_size=7)
    reference = naive_logprobs(logits, targets, 1.0)
    assert torch.isfinite(logp).all() and (logp <= 0).all()
    assert max_diff(logp, reference) <= 1e-4, f"max diff {max_diff(logp, reference):.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [1, 4, 40, None])
def test_entropy_chunked_equals_naive(dtype, temperature, chunk_size):
    logits, _, weights = softmax_inputs(dtype, seed=2)
    entropy = entropy_from_logits(logits, temperature, chunk_size)
    (grad,) = torch.autograd.grad((entropy * weights).sum(), logits)
    reference = naive_entropy(logits, temperature)
    (reference_grad,) = torch.autograd.grad((reference * weights).sum(), logits)
    assert max_diff(entropy, reference) <= 1e-5, f"entropy max diff {max_diff(entropy, reference):.3g}"
    grad_tolerance = 1e-5 if dtype == torch.float32 else 1e-2 * reference_grad.abs().max().item()
    diff = max_diff(grad, reference_grad)
    assert diff <= grad_tolerance, f"gradient max diff {diff:.3g}"


# ----------------------------------------------------------------------------- aggregation and advantages

def test_aggregate_modes_and_empty_rows():
    values = torch.tensor([[1.0, 2.0, 3.0], [float("nan"), 7.0, 9.0], [4.0, float("inf"), 0.0]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 0, 0]])  # the middle row has no valid token
    expected = {"token-mean": 10 / 4, "seq-mean-token-mean": (2 + 4) / 2, "seq-mean-token-sum": (6 + 4) / 2}
    for mode, value in expected.items():
        assert aggregate(values, mask, mode).item() == pytest.approx(value), mode
        empty = aggregate(values, torch.zeros_like(mask), mode)
        assert empty.item() == 0.0, f"{mode}: no valid token gives {empty.item()}"
    with pytest.raises(ValueError):
        aggregate(values, mask, "sum")


def test_grpo_advantages_hand_computed():
    scores = torch.tensor([1.0, 5.0, 2.0, 3.0, 2.0, 2.0, 0.0, 10.0])
    groups = torch.tensor([7, 3, 9, 7, 9, 9, 4, 4])  # interleaved ids: {1, 3}, {5}, {2, 2, 2}, {0, 10}
    advantages = grpo_advantages(scores, groups)
    expected = torch.tensor([-1 / math.sqrt(2), 0.0, 0.0, 1 / math.sqrt(2), 0.0, 0.0,
                             -5 / math.sqrt(50), 5 / math.sqrt(50)])  # unbiased std: sqrt(2), sqrt(50)
    assert max_diff(advantages, expected) <= 1e-5, f"max diff {max_diff(advantages, expected):.3g}"
    assert advantages[1] == 0.0, "a group of one gets 0"
    assert (advantages[[2, 4, 5]] == 0.0).all(), "a group of equal scores gets 0"
    centered = grpo_advantages(scores, groups, norm_std=False)
    expected = torch.tensor([-1.0, 0.0, 0.0, 1.0, 0.0, 0.0, -5.0, 5.0])
    assert max_diff(centered, expected) <= 1e-6, f"max diff {max_diff(centered, expected):.3g}"


def test_seed_delta_is_zero_off_mask_and_detached():
    teacher = torch.tensor([[-1.0, -2.0, float("nan")], [-0.3, -float("inf"), float("inf")]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.0, 0.0], [float("nan"), -2.0, -float("inf")]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    delta = seed_delta(teacher, old, mask)
    assert torch.equal(delta, torch.tensor([[0.5, -1.0, 0.0], [0.0, 0.0, 0.0]])), delta
    assert not delta.requires_grad


# ----------------------------------------------------------------------------- seed_loss against a naive loop

def naive_seed_loss(sequences, distill_mode, agg, distill_coef=1e-3, gate_beta=5.0, kl_coef=0.0,
                    entropy_coef=0.0, clip_low=0.2, clip_high=0.2, dual_clip=3.0):
    """One Python loop over sequences and tokens; each sequence is a dict of 1-D tensors of its valid tokens."""
    totals = []  # (sum of token losses, number of tokens) per sequence
    for seq in sequences:
        token_losses = []
        for t in range(len(seq["logp"])):
            logp, old = seq["logp"][t], seq["old"][t]
            delta = (seq["teacher"][t] - old).detach()
            advantage = seq["adv"][t] + (distill_coef * delta if distill_mode == "advantage" else 0.0)
            ratio = torch.exp(torch.clamp(logp - old, -20, 20))
            surrogate = -advantage * ratio
            clipped = -advantage * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
            token_loss = surrogate if surrogate >= clipped else clipped
            if dual_clip is not None and advantage < 0 and token_loss > -advantage * dual_clip:
                token_loss = -advantage * dual_clip
            if distill_mode == "loss":
                token_loss = token_loss - distill_coef * delta * logp
            if distill_mode == "gated":
                token_loss = token_loss + distill_coef * torch.sigmoid(gate_beta * delta) * (seq["teacher"][t] - logp)
            x = torch.clamp(seq["ref"][t] - logp, -20, 20)
            token_loss = token_loss + kl_coef * torch.clamp(torch.exp(x) - x - 1, -10, 10)
            token_losses.append(token_loss - entropy_coef * seq["entropy"][t])
        if token_losses:
            totals.append((sum(token_losses), len(token_losses)))
    if not totals:
        return torch.tensor(0.0)
    if agg == "token-mean":
        return sum(s for s, _ in totals) / sum(n for _, n in totals)
    if agg == "seq-mean-token-mean":
        return sum(s / n for s, n in totals) / len(totals)
    return sum(s for s, _ in totals) / len(totals)


def loss_batch(seed=0, lengths=(5, 0, 9, 3, 7), width=10):
    """Padded (B, T) tensors with NaN/inf planted off the mask, ratios spread over all clip regions."""
    generator = torch.Generator().manual_seed(seed)
    shape = (len(lengths), width)
    mask = torch.zeros(shape, dtype=torch.long)
    for row, length in enumerate(lengths):
        start = int(torch.randint(0, width - length + 1, (1,), generator=generator))
        mask[row, start:start + length] = 1
    old = -3 * torch.rand(shape, generator=generator)
    spread = torch.tensor([0.1, 0.4, 1.0])[torch.arange(width) % 3]  # (T,) small, medium and large log-ratios
    shift = 1.5 * (torch.arange(width) % 4 == 0)  # (T,) some ratios above the dual clip
    batch = {"mask": mask, "old": old, "logp": old + spread * torch.randn(shape, generator=generator) + shift,
             "adv": torch.randn(shape[0], 1, generator=generator) + 0.1 * torch.randn(shape, generator=generator),
             "teacher": old + 0.5 * torch.randn(shape, generator=generator),
             "ref": old + 0.3 * torch.randn(shape, generator=generator),
             "entropy": 2 * torch.rand(shape, generator=generator)}
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.7, -5.0])
    for shift, key in enumerate(("old", "logp", "adv", "teacher", "ref", "entropy")):  # mixes garbage and finite
        batch[key] = torch.where(mask.bool(), batch[key], garbage[(torch.arange(mask.numel()) + shift) % 5].view(shape))
    return batch


def packed(batch, flat):
    """The same tokens packed into one row: each sequence's span plus one masked token, padding dropped."""
    keep = []
    for row in range(batch["mask"].shape[0]):
        positions = batch["mask"][row].nonzero().flatten().tolist()
        start = positions[0] if positions else 0
        end = positions[-1] + 2 if positions else 1
        keep += [row * batch["mask"].shape[1] + t for t in range(start, min(end, batch["mask"].shape[1]))]
    packed_batch = {key: value.expand_as(batch["mask"]).reshape(-1)[keep] for key, value in batch.items()}
    return packed_batch if flat else {key: value.unsqueeze(0) for key, value in packed_batch.items()}


def run_both(batch, distill_mode, agg, **options):
    """seed_loss and the naive loop on separate leaf copies: (loss, reference, grads, reference grads)."""
    leaves = [{k: batch[k].clone().requires_grad_() for k in ("logp", "entropy")} for _ in range(2)]
    loss, metrics = seed_loss(leaves[0]["logp"], batch["old"], batch["adv"], batch["mask"],
                              teacher_logp=batch["teacher"], ref_logp=batch["ref"], entropy=leaves[0]["entropy"],
                              distill_mode=distill_mode, agg=agg, **options)
    valid = batch["mask"].bool()
    rows = valid.reshape(-1, valid.shape[-1]) if valid.dim() > 1 else valid.unsqueeze(0)
    sequences = []
    for row, row_valid in enumerate(rows):
        pick = lambda x: x.expand_as(batch["mask"]).reshape(rows.shape)[row][row_valid]
        sequences.append({"logp": pick(leaves[1]["logp"]), "old": pick(batch["old"]), "adv": pick(batch["adv"]),
                          "teacher": pick(batch["teacher"]), "ref": pick(batch["ref"]),
                          "entropy": pick(leaves[1]["entropy"])})
    reference = naive_seed_loss(sequences, distill_mode, agg, **options)
    loss.backward()
    reference.backward()
    return loss, reference, metrics, leaves


OPTIONS = dict(distill_coef=0.3, gate_beta=5.0, kl_coef=0.05, entropy_coef=0.01)  # coefs large enough to matter


@pytest.mark.parametrize("layout", ["padded", "packed", "packed-flat"])
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("distill_mode", DISTILL_MODES)
def test_seed_loss_equals_naive_loop(distill_mode, agg, layout):
    batch = loss_batch()
    if layout != "padded":
        batch = packed(batch, flat=layout == "packed-flat")
    loss, reference, metrics, leaves = run_both(batch, distill_mode, agg, **OPTIONS)
    assert abs(loss.item() - reference.item()) <= 1e-6, f"loss {loss.item()} vs naive {reference.item()}"
    for key in ("logp", "entropy"):
        grad, reference_grad = leaves[0][key].grad, leaves[1][key].grad
        assert torch.isfinite(grad).all(), f"{key}: non-finite gradient with NaN/inf planted off the mask"
        assert max_diff(grad, reference_grad) <= 1e-7, f"{key} grad max diff {max_diff(grad, reference_grad):.3g}"
    assert metrics["pg_clipfrac"] > 0 and metrics["pg_clipfrac_lower"] > 0, "the batch must reach both clips"
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values()), metrics


@pytest.mark.parametrize("distill_mode", DISTILL_MODES)
def test_packed_token_mean_equals_padded(distill_mode):
    batch = loss_batch(seed=3)
    padded_loss, _, _, padded_leaves = run_both(batch, distill_mode, "token-mean", **OPTIONS)
    packed_loss, _, _, packed_leaves = run_both(packed(batch, flat=False), distill_mode, "token-mean", **OPTIONS)
    assert abs(padded_loss.item() - packed_loss.item()) <= 1e-6, f"{padded_loss.item()} vs {packed_loss.item()}"
    valid = batch["mask"].bool()
    padded_grad = padded_leaves[0]["logp"].grad[valid]
    packed_grad = packed_leaves[0]["logp"].grad[packed(batch, flat=False)["mask"].bool()]
    assert max_diff(padded_grad, packed_grad) <= 1e-7, f"grad max diff {max_diff(padded_grad, packed_grad):.3g}"


def test_ratio_one_gradient_is_minus_advantage_over_tokens():
    batch = loss_batch(seed=4)
    mask = batch["mask"]
    advantages = torch.tensor([0.5, -1.0, 2.0, -0.25, 1.5])  # (B,) one per row
    logp = torch.where(mask.bool(), batch["old"], 0.0).requires_grad_()  # ratio exactly 1
    loss, metrics = seed_loss(logp, batch["old"], advantages, mask)
    loss.backward()
    expected = -advantages[:, None] * mask / mask.sum()
    assert max_diff(logp.grad, expected) <= 1e-7, f"grad max diff {max_diff(logp.grad, expected):.3g}"
    assert metrics["pg_clipfrac"] == 0.0 and metrics["ppo_kl"] == 0.0
    per_token, _ = seed_loss(logp, batch["old"], advantages[:, None].expand(mask.shape), mask)
    assert per_token.item() == loss.item(), "per-row and per-token advantages must agree"


def test_clipped_and_dual_clipped_gradients():
    old = torch.zeros(1, 5)
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5, 5.0]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    mask = torch.ones(1, 5)
    for dual_clip, expected_grad in ((3.0, [0.0, -0.5, 0.0, 1.5, 0.0]), (None, [0.0, -0.5, 0.0, 1.5, 5.0])):
        logp = ratios.log().requires_grad_()
        loss, metrics = seed_loss(logp, old, advantages, mask, dual_clip=dual_clip)
        loss.backward()
        expected = torch.tensor([expected_grad]) / 5  # d/dlogp (-A * ratio) = -A * ratio, over 5 tokens
        assert max_diff(logp.grad, expected) <= 1e-6, f"dual_clip={dual_clip}: grad {logp.grad.tolist()}"
        token_losses = [-1.2, -0.5, 0.8, 1.5, 3.0 if dual_clip else 5.0]
        assert loss.item() == pytest.approx(sum(token_losses) / 5), f"dual_clip={dual_clip}: loss {loss.item()}"
        assert metrics["pg_clipfrac"] == pytest.approx(0.4), metrics
        assert metrics["pg_clipfrac_lower"] == pytest.approx(0.2 if dual_clip else 0.0), metrics


def test_token_weights_scale_each_tokens_policy_loss():
    """token_weights (verl's rollout importance weights, docs/trainers.md) multiply the per-token policy loss:
    all ones is no weighting; weights w on the tokens give the loss of the per-token losses times w."""
    batch = loss_batch(seed=6)
    weights = torch.rand(batch["mask"].shape, generator=torch.Generator().manual_seed(6)) + 0.5  # (B, T)
    plain, _ = seed_loss(batch["logp"], batch["old"], batch["adv"], batch["mask"], distill_coef=0.0)
    ones, _ = seed_loss(batch["logp"], batch["old"], batch["adv"], batch["mask"], distill_coef=0.0,
                        token_weights=torch.ones_like(weights))
    weighted, _ = seed_loss(batch["logp"], batch["old"], batch["adv"], batch["mask"], distill_coef=0.0,
                            token_weights=weights)
    doubled, _ = seed_loss(batch["logp"], batch["old"], batch["adv"], batch["mask"], distill_coef=0.0,
                           token_weights=2 * weights)
    assert torch.equal(plain, ones)
    assert not torch.allclose(plain, weighted) and torch.allclose(doubled, 2 * weighted), \
        f"{plain.item():.6f} {weighted.item():.6f} {doubled.item():.6f}"


@pytest.mark.parametrize("distill_mode", DISTILL_MODES)
def test_distill_coef_zero_equals_no_teacher(distill_mode):
    batch = loss_batch(seed=5)
    results = []
    for teacher, coef in ((batch["teacher"], 0.0), (None, 0.5)):
        logp = batch["logp"].clone().requires_grad_()
        loss, metrics = seed_loss(logp, batch["old"], batch["adv"], batch["mask"], teacher_logp=teacher,
                                  ref_logp=batch["ref"], kl_coef=0.1, distill_coef=coef, distill_mode=distill_mode)
        loss.backward()
        results.append((loss, logp.grad, metrics))
    (loss_a, grad_a, metrics_a), (loss_b, grad_b, metrics_b) = results
    assert torch.equal(loss_a, loss_b), f"{loss_a.item()} vs {loss_b.item()}"
    assert torch.equal(grad_a, grad_b), f"grad max diff {max_diff(grad_a, grad_b):.3g}"
    assert metrics_a["delta_abs_mean"] > 0 and metrics_b["delta_abs_mean"] == 0.0
    assert {k: v for k, v in metrics_a.items() if not k.startswith(("delta", "teacher"))} == \
           {k: v for k, v in metrics_b.items() if not k.startswith(("delta", "teacher"))}


@pytest.mark.parametrize("distill_mode", DISTILL_MODES)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_all_zero_mask_gives_finite_zero(distill_mode, agg):
    batch = loss_batch(seed=6)
    mask = torch.zeros_like(batch["mask"])
    logp = batch["logp"].clone().requires_grad_()
    entropy = batch["entropy"].clone().requires_grad_()
    loss, metrics = seed_loss(logp, batch["old"], batch["adv"], mask, teacher_logp=batch["teacher"],
                              ref_logp=batch["ref"], entropy=entropy, distill_mode=distill_mode, agg=agg, **OPTIONS)
    loss.backward()
    assert loss.item() == 0.0, f"loss {loss.item()}"
    assert torch.equal(logp.grad, torch.zeros_like(logp)) and torch.equal(entropy.grad, torch.zeros_like(entropy))
    assert all(v == 0.0 for v in metrics.values()), metrics


def test_metrics_names_and_delta_statistics():
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0, float("nan")]])
    teacher = torch.tensor([[-0.5, -1.0, -2.0, -0.8, 0.0]])  # delta 0.5, 0, -1, 0.2 on the mask
    _, metrics = seed_loss(old.clone(), old, torch.ones(1), mask, teacher_logp=teacher, distill_mode="advantage",
                           distill_coef=1e-3)
    for name in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl", "entropy", "adv_mean", "delta_mean",
                 "delta_abs_mean", "delta_pos_share", "teacher_token_share"):
        assert isinstance(metrics[name], float), name
    assert metrics["delta_mean"] == pytest.approx(-0.3 / 4) and metrics["delta_abs_mean"] == pytest.approx(1.7 / 4)
    assert metrics["delta_pos_share"] == 0.5 and metrics["teacher_token_share"] == 1.0, metrics
    assert metrics["adv_mean"] == pytest.approx(1 + 1e-3 * -0.3 / 4), metrics


@pytest.mark.parametrize("distill_mode", DISTILL_MODES)
def test_teacher_mask_leaves_untaught_rows_plain_grpo(distill_mode):
    """A row whose analysis failed (teacher_mask 0) gets exactly the plain-GRPO gradient in every mode."""
    torch.manual_seed(7)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    old = -torch.rand(2, 4)
    teacher = old + torch.randn(2, 4)
    taught = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])  # row 1 has no skill
    grads = []
    for kwargs in ({"teacher_logp": teacher, "teacher_mask": taught, "distill_coef": 0.5}, {}):
        logp = old.clone().requires_grad_()
        loss, metrics = seed_loss(logp, old, torch.tensor([1.0, -1.0]), mask, distill_mode=distill_mode, **kwargs)
        loss.backward()
        grads.append(logp.grad)
    difference = (grads[0][1] - grads[1][1]).abs().max().item()
    assert difference == 0.0, f"untaught row gradient differs from plain GRPO by {difference}"
    assert (grads[0][0] - grads[1][0]).abs().max().item() > 1e-4, "the taught row must feel the teacher"


def test_docstring_examples():
    import doctest
    import loss
    failures, tried = doctest.testmod(loss)
    assert tried >= 6 and failures == 0, f"{failures} of {tried} docstring examples failed"

def test_loss_edges_a_copy_paster_hits():
    """Hugging Face's -100 ignore targets give log-prob 0 and no gradient; a zero-length completion axis gives
    empty results and a zero loss; clip values that make no sense are one ValueError (verl asserts dual > 1)."""
    logits = torch.randn(2, 3, 7, requires_grad=True)
    targets = torch.tensor([[1, -100, 2], [-100, 4, 5]])
    logp = token_logprobs(logits, targets)
    naive = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    ignored = targets < 0
    assert (logp[ignored] == 0).all() and max_diff(logp[~ignored], naive[~ignored]) < 1e-6
    logp.sum().backward()
    assert logits.grad[0, 1].abs().sum() == 0 and logits.grad[1, 0].abs().sum() == 0
    empty = torch.randn(2, 0, 7, requires_grad=True)
    assert token_logprobs(empty, torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0)
    assert entropy_from_logits(empty).shape == (2, 0)
    loss, metrics = seed_loss(torch.zeros(2, 0), torch.zeros(2, 0), torch.ones(2), torch.zeros(2, 0))
    assert loss.item() == 0 and metrics["pg_loss"] == 0
    row = (torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2))
    for bad in (dict(dual_clip=1.0), dict(dual_clip=0.5), dict(clip_low=1.0), dict(clip_low=-0.1),
                dict(clip_high=-0.2)):
        with pytest.raises(ValueError, match="clip"):
            seed_loss(*row, **bad)
    seed_loss(*row, dual_clip=None)  # no dual clip is a choice, not an error


# =============================================================================
# envs.py: make_env, env_options and the guarded env calls (the envs themselves: tests/test_household.py,
# tests/test_adapters.py)
# =============================================================================

def test_make_env_dispatch(monkeypatch):
    with pytest.raises(ValueError, match="household"):
        make_env("nethack")
    with pytest.raises(ValueError, match="valid_unseen"):
        make_env("household", "test")
    fake = types.ModuleType("adapters.alfworld")
    fake.AlfworldEnv = lambda split, seed, **options: ("alfworld", split, seed, options)
    monkeypatch.setitem(sys.modules, "adapters.alfworld", fake)
    assert make_env("alfworld", "valid_seen", 3, max_steps=7) == ("alfworld", "valid_seen", 3, {"max_steps": 7})
    small = make_env("household", "train", 0, num_receptacles=3, num_distractors=0, max_steps=5)
    assert isinstance(small, HouseholdEnv) and small.max_steps == 5


def test_env_options_resolve_max_steps_and_each_envs_own_knobs(tmp_path, monkeypatch):
    run = lambda env, max_steps=None, **flags: env_options(train.get_config(
        ["--env", env] + (["--max-steps", str(max_steps)] if max_steps else []) + [
            f"--{k.replace('_', '-')}={v}" if v is not True else f"--{k.replace('_', '-')}" for k, v in flags.items()]))
    assert run("household") == {"max_steps": envs.spec("household").max_steps} == {"max_steps": 20}
    assert run("webshop", max_steps=4) == {"max_steps": 4}
    assert run("miniwob", task="click-button", miniwob_elements=True) == {
        "task": "click-button", "elements": True, "max_steps": envs.spec("miniwob").max_steps}
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    assert run("alfworld") == {"max_steps": 30, "data_dir": str(tmp_path)}
    assert run("alfworld", 5, data_dir="games")["data_dir"] == "games"
    with pytest.raises(ValueError, match="nethack.*household"):
        envs.spec("nethack")


def test_every_env_is_one_registry_entry_whose_paths_resolve():
    """Each EnvSpec names a class, a prompt template and an annotator that import (optional packages are imported
    only when an env is built, so this needs none), and the template fills with seed.render_prompt."""
    for spec in envs.ENVS.values():
        template, annotate = envs.load(spec.prompt), envs.load(spec.annotator)
        assert callable(envs.load(spec.env_class)) and callable(annotate), spec.name
        assert set(template) == {"first", "history", "action", "separator", "tags"}, spec.name
        for history in ([], [("o1", "a1")]):
            text = skills.render_prompt(template, "the task", history, "the observation", ["a", "b"], 3)
            shown = "the observation" in text or (not history and "the task" in text)
            assert shown and "<think>" in text, (spec.name, text)
        assert spec.probe is None or callable(envs.load(spec.probe)), spec.name
        for flag in spec.own_flags:
            assert hasattr(train.get_config(["--env", spec.name]), flag), (spec.name, flag)


def test_guarded_env_calls_turn_errors_hangs_and_dead_browsers_into_env_failure():
    env = make_env("household", "train", 0)
    assert call_env(env.reset, 3) == make_env("household", "train", 0).reset(3)

    def engine_gone(_):
        raise ConnectionError("the engine went away")

    def hang(_):
        while True:  # stuck in Python code: the SIGALRM timer gets it out
            pass

    with pytest.raises(EnvFailure, match="env.engine_gone failed: ConnectionError: the engine went away"):
        call_env(engine_gone, None)
    start = time.perf_counter()
    with pytest.raises(EnvFailure, match="no answer within 0.2 s"):
        call_env(hang, None, timeout=0.2)
    assert time.perf_counter() - start < 2.0
    lost_browser = {"browser_restarted": True}
    restarted = types.SimpleNamespace(step=lambda action: ("The browser stopped.", 0.0, True, lost_browser))
    with pytest.raises(EnvFailure, match="the browser died; the env restarted it"):
        step_env(restarted, "click 3 4")
    assert step_env(env, "look")[3]["valid"]
    closed, env_list = [], [types.SimpleNamespace(close=lambda: closed.append(True) or 1 / 0)]
    restart_env(env_list, 0)  # no factory: the env stays
    assert closed == [] and len(env_list) == 1
    restart_env(env_list, 0, lambda index: ("rebuilt", index))
    assert closed == [True] and env_list == [("rebuilt", 0)], "a close that raises must not stop the rebuild"

# =============================================================================
# skills.py: analyzer prompts, parser, teacher contexts (the stage-1 annotator: tests/test_warmup.py)
# =============================================================================


GOOD = "Open closed drawers before searching them, then take the apple."
FRIDGE = "Open the fridge before taking the apple."
HEAT_TASK = "heat some apple and put it in countertop."


def raw(skill, before='{"episode_summary": "s", '):
    """An analyzer answer with the skill pasted in verbatim (escapes and all) after `before`."""
    return before + '"episode_skill": "' + skill + '"}'


# ----------------------------------------------------------------------------- parse_skill
PARSE_CASES = [  # (name, analyzer output, expected skill[, task])
    ("clean json", json.dumps({"episode_summary": "ok", "episode_skill": GOOD}), GOOD),
    ("fenced", "Here is my analysis:\n```json\n" + raw(GOOD, '{"episode_summary": "s",\n ') + "\n```\nBye.", GOOD),
    ("trailing commas", raw(GOOD)[:-1] + ",}", GOOD), ("wrapped value", f'Skill: **"[{FRIDGE}]"**', FRIDGE),
    ("single quotes", "{'episode_summary': 's', 'episode_skill': \"Don't skip drawers; open each closed one.\"}",
     "Don't skip drawers; open each closed one."),
    ("chatter around", "Sure! " + raw(GOOD, "{") + " Let me know.", GOOD),
    ("label line", "Summary: it failed.\nSkill: " + FRIDGE, FRIDGE),
    ("key as label", "episode_skill: " + FRIDGE, FRIDGE), ("markdown label", "**Episode Skill**: " + FRIDGE, FRIDGE),
    ("bold label", "**Skill:** " + FRIDGE, FRIDGE), ("bytes", raw(GOOD).encode(), GOOD),
    ("quote at the end", raw("Warning sign: 'The drawer 2 is closed.'"), "Warning sign: 'The drawer 2 is closed.'"),
    ("nested", '{"analysis": ' + raw(GOOD) + "}", GOOD), ("brace missing, value closed", raw(GOOD)[:-1], GOOD),
    ("escaped quotes", raw(r"Use \"open drawer 2\" when it is closed."), 'Use "open drawer 2" when it is closed.'),
    ("curly quotes", "{\u201cepisode_skill\u201d: \u201c" + GOOD + "\u201d}", GOOD),
    ("key spelled out", '{"Episode Skill": "' + GOOD + '"}', GOOD), ("huge tail", raw(GOOD) + "x" * 2_000_000, GOOD),
    ("list value", '{"episode_skill": ["Open the fridge first.", "Then take the apple."]}',
     "Open the fridge first. Then take the apple."),
    ("control characters", raw("Open\\u0000 the\\u200b fridge\\n before taking the apple.\x07"), FRIDGE),
    ("first object lacks skill", '{"episode_summary": "s"} and then ' + raw(GOOD, "{"), GOOD),
    ("braces in value", raw("Use {the microwave} to heat the apple."), "Use {the microwave} to heat the apple."),
    ("special tokens", raw("Open the fridge<|im_end|> before taking the apple."), FRIDGE),
    ("lone surrogate", raw("Open the fridge \\ud800before taking the apple."), FRIDGE),
    ("new facts beyond the task", raw("Heat the apple with microwave 1 before putting it in countertop."),
     "Heat the apple with microwave 1 before putting it in countertop.", HEAT_TASK),
    ("empty", "", None), ("none", None, None), ("not text", 12345, None), ("format echoed", JSON_SHAPE, None),
    ("truncated value", raw("Always open the closed dr")[:-2], None),
    ("truncated pretty json", '{\n  "episode_summary": "s",\n  "episode_skill": "Always open the closed dr', None),
    ("too short", raw("Open it."), None), ("not a string", '{"episode_skill": 42, "episode_summary": "s"}', None),
    ("restates the task", raw("Your task is to: " + HEAT_TASK), None),
    ("only the task's words", raw("Heat the apple and put it in the countertop."), None, HEAT_TASK),
    ("degenerate", raw("go to drawer 1 " * 12), None), ("symbols", raw("!!!! ???? #### $$$$ %%%% ^^^^"), None),
    ("no function words", raw("aaaa bbbb cccc dddd eeee"), None), ("deep nesting", "[" * 5000 + "{" * 5000, None),
    ("unlabelled sentence", "Open closed drawers before searching them.", None),
    ("beyond scan window", " " * (skills.MAX_PARSE_CHARS + 10) + raw(GOOD), None),
]


@pytest.mark.parametrize("name,text,expected,task", [(*case, None)[:4] for case in PARSE_CASES],
                         ids=[case[0] for case in PARSE_CASES])
def test_parse_skill_cases(name, text, expected, task):
    assert parse_skill(text, task=task) == expected, f"{name}: {parse_skill(text, task=task)!r} != {expected!r}"


def test_parse_skill_length_cap_and_prefixes_of_a_valid_answer():
    """Capped at a word boundary; every prefix cut before the skill's closing quote is None, after it whole."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    long = "Open the drawer " + " ".join(letters[i % 26] + letters[i // 26 % 26] + "ing" for i in range(300))
    capped = parse_skill(json.dumps({"episode_skill": long}))
    assert capped and len(capped) <= skills.MAX_SKILL_CHARS and long.startswith(capped), len(capped or "")
    assert long[len(capped)] == " ", f"cut inside a word: ...{capped[-20:]!r}"
    text = json.dumps({"episode_summary": "The agent won.", "episode_skill": GOOD})
    closing = text.index(GOOD) + len(GOOD)
    for cut in range(len(text) + 1):
        assert parse_skill(text[:cut]) == (GOOD if cut > closing else None), f"cut {cut}: {parse_skill(text[:cut])!r}"


def test_parse_skill_never_raises_on_random_strings():
    rng, start, parsed = random.Random(0), time.perf_counter(), 0
    pieces = ['{', '}', '"', "'", '\\', ',', ':', '[', ']', '```json', '\n', 'episode_skill', 'Skill:', 'the ',
              'open ', 'drawer 1 ', '\x00', '\u200b', '\ud800', 'é', '<|im_end|>', ' ', 'a', 'Z', '9']
    for index in range(10_000):  # a quarter are mutations of a valid answer, the rest random pieces
        chars = list(raw(GOOD)) if index % 4 == 0 else [rng.choice(pieces) for _ in range(rng.randint(0, 60))]
        for _ in range(rng.randint(1, 5) if index % 4 == 0 else 0):
            chars[rng.randrange(len(chars))] = rng.choice(pieces)
        skill = parse_skill(text := "".join(chars))
        assert skill is None or (len(skill) <= skills.MAX_SKILL_CHARS and skill.isprintable()), f"{skill!r} <- {text!r}"
        parsed += skill is not None
    elapsed = time.perf_counter() - start
    # a guard against catastrophic regex backtracking (minutes), not a speed target: 0.5 s here beside two runs,
    # 24.7 s once when the whole suite ran at nice 19 beside three training processes on 2 cores
    assert elapsed < 60, f"10,000 parses took {elapsed:.1f} s"
    print(f"parse_skill: 10,000 random strings in {elapsed:.2f} s, {parsed} parsed")


# ----------------------------------------------------------------------------- with_skill
AGENT_PROMPT = (
    f"You are an expert agent operating in the ALFRED Embodied Environment. Your task is to: {HEAT_TASK}\nPrior to "
    "this step, you have already taken 2 step(s). Below are the most recent 2 observations and the corresponding "
    "actions you took: [Observation 1: 'You arrive at drawer 1. Your task is to: x', Action 1: 'go to drawer 1']\n"
    "You are now at step 3 and your current observation is: Nothing happens.\nYour admissible actions of the current "
    "situation are: ['go to fridge 1', 'look'].\n\nNow it's your turn to take an action.\nYou should first reason.")
BLOCK, LAST_LINE = f"{SKILL_HEADER}\n[{GOOD}]", "Your task is to: put a mug in cabinet."
NO_TASK = AGENT_PROMPT.replace("Your task is to:", "Goal:")
AFTER_TASK, BEFORE_TURN = AGENT_PROMPT.index("\nPrior to this step"), NO_TASK.index("Now it's your turn")


@pytest.mark.parametrize("prompt,expected", [
    (AGENT_PROMPT, AGENT_PROMPT[:AFTER_TASK] + f"\n\n{BLOCK}\n" + AGENT_PROMPT[AFTER_TASK:]),
    (NO_TASK, NO_TASK[:BEFORE_TURN] + f"{BLOCK}\n\n" + NO_TASK[BEFORE_TURN:]),
    ("Pick an action.", f"Pick an action.\n\n{BLOCK}\n"),
    (LAST_LINE, f"{LAST_LINE}\n\n{BLOCK}\n"),
    (LAST_LINE + "\r\nNow it's your turn.", f"{LAST_LINE}\n\n{BLOCK}\n\r\nNow it's your turn."),
], ids=["after the task line", "before your turn", "appended", "task on the last line", "crlf"])
def test_with_skill_inserts_one_block_and_keeps_the_prompt_byte_for_byte(prompt, expected):
    teacher = with_skill(prompt, GOOD)
    assert teacher == expected, teacher
    inserted = len(teacher) - len(prompt)  # the prompt must be teacher[:k] + teacher[k + inserted:] for some k
    assert any(teacher[:k] + teacher[k + inserted:] == prompt and GOOD in teacher[k:k + inserted]
               for k in range(len(prompt) + 1)), "the ordinary prompt is not prefix + suffix around the block"
    assert teacher.count("**Episode-Level Skill**") == 1
    for bad in (None, "", "   "):
        with pytest.raises(ValueError):
            with_skill(prompt, bad)


# ----------------------------------------------------------------------------- trajectories (contract dicts)
WELCOME = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, you "
           "see a cabinet 1, a countertop 1, a drawer 1, a drawer 2, a fridge 1, a microwave 1, and a sinkbasin 1."
           f"\n\nYour task is to: {HEAT_TASK}")
HEAT_GT = {"env": "household", "task_type": "pick_heat_then_place_in_recep", "task": HEAT_TASK, "goal_object": "apple",
           "goal_receptacle": "countertop", "tool": "microwave 1", "object_locations": {"apple 1": "drawer 2"},
           "closed_receptacles": ["cabinet 1", "drawer 1", "drawer 2", "fridge 1", "microwave 1"], "expert_plan": []}
closed, on = "You arrive at {0}. The {0} is closed.".format, "You arrive at {0}. On the {0}, you see {1}.".format
empty, NOTHING = "You arrive at {0}. On the {0}, you see nothing.".format, "Nothing happens."


def episode(rows, won=False, **gt):
    """A trajectory from rows (observation, action[, valid]) with the household gt; its events are written out
    here, independently of skills.py. A missing action tag (action "") costs the -0.1 format penalty."""
    steps, events = [], []
    for index, (observation, action, valid) in enumerate((*row, True)[:3] for row in rows):
        steps.append(seed.Step(observation=observation, action=action, valid=valid, reward=-0.1 * (not action),
                               response="<think>I should act.</think>" + (f"<action>{action}</action>" if action else "")))
        verb, *words = action.split() or ["look"]  # "go to X 1", "open X 1", "take A 1 from X 1", "move A 1 to X 1"
        if valid and verb != "look":
            events.append({"step": index, "kind": "put" if verb == "move" else verb, "target": " ".join(words[-2:]),
                           "object": None if verb in ("go", "open", "use") else " ".join(words[:2])})
    steps[-1].reward += 10.0 * won
    gt = dict(HEAT_GT, **gt, won=won, steps=len(steps), max_steps=len(steps), events=events,
              invalid_steps=[index for index, step in enumerate(steps) if not step.valid])
    return seed.Trajectory(task=gt["task"], won=won, reward=10.0 * won, steps=steps, gt=gt)


TO_DRAWER_2 = [(WELCOME, "go to drawer 2"), (closed("drawer 2"), "open drawer 2"),
               ("You open the drawer 2. The drawer 2 is open. In it, you see a apple 1.", "take apple 1 from drawer 2")]
PICKED = "You pick up the apple 1 from the drawer 2."
EXPERT = episode(TO_DRAWER_2 + [
    (PICKED, "go to microwave 1"), (closed("microwave 1"), "heat apple 1 with microwave 1"),
    ("You heat the apple 1.", "go to countertop 1"), (on("countertop 1", "a bread 1"), "move apple 1 to countertop 1")],
    won=True)
TAKE = "take apple 1 from countertop 1"
FAILURES = {  # name: (trajectory with the planted mistake, words every skill phrasing has, part of the summary)
    "placed before heating": (episode(TO_DRAWER_2 + [
        (PICKED, "go to countertop 1"), (on("countertop 1", "a bread 1"), "move apple 1 to countertop 1"),
        ("You move the apple 1.", "look")]),
        ["apple", "microwave 1", "countertop", "heat"], "before it was heated"),
    "closed not opened": (episode([(WELCOME, "go to drawer 1")] + [(closed(place), f"go to {then}") for place, then in [
        ("drawer 1", "drawer 2"), ("drawer 2", "fridge 1"), ("fridge 1", "cabinet 1"), ("cabinet 1", "drawer 1")]]),
        ["apple", "drawer 2", "open"], "never opened the closed drawer 2"),
    "repeated invalid": (episode([(WELCOME, "go to countertop 1"), (empty("countertop 1"), TAKE, False),
                                  (NOTHING, TAKE, False), (NOTHING, TAKE, False), (NOTHING, "", False)]),
                         [TAKE, "3", "listed"], f"'{TAKE}' did nothing, 3 times"),
    "missing action tags": (episode([(WELCOME, "go to drawer 1")] + [(NOTHING, "", False)] * 3),
                            ["action tag", "3", NOTHING], "without an action tag did nothing, 3 times"),
    "wrong appliance": (episode(TO_DRAWER_2 + [
        (PICKED, "go to fridge 1"), (closed("fridge 1"), "heat apple 1 with fridge 1", False),
        (NOTHING, "go to countertop 1")]),
        ["fridge", "microwave", "heat"], "used the fridge instead of the microwave"),
    "wrong object": (episode([
        (WELCOME, "go to countertop 1"), (on("countertop 1", "a tomato 1"), "take tomato 1 from countertop 1"),
        ("You pick up the tomato 1.", "go to microwave 1"), (closed("microwave 1"), "heat tomato 1 with microwave 1"),
        ("You heat the tomato 1.", "go to countertop 1"), (empty("countertop 1"), "move tomato 1 to countertop 1")]),
        ["tomato 1", "apple"], "took tomato 1 instead of an apple"),
    "circling": (episode([(WELCOME, "go to countertop 1")] + [(empty(place), f"go to {then}") for place, then in [
        ("countertop 1", "sinkbasin 1"), ("sinkbasin 1", "countertop 1")] * 3]),  # the apple was in unvisited drawer 2
        ["countertop 1", "sinkbasin 1", "drawer 2"], "kept revisiting"),
    "never found": (episode([(WELCOME, "go to countertop 1"), (empty("countertop 1"), "go to sinkbasin 1"),
                             (empty("sinkbasin 1"), "go to cabinet 1")]), ["apple", "drawer 2", "never"],
                    "never found the apple"),
    "never heated": (episode(TO_DRAWER_2 + [(PICKED, "go to countertop 1"), (empty("countertop 1"), "look")]),
                     ["apple", "microwave 1", "never heated"], "never heated it"),
}

# ----------------------------------------------------------------------------- analyzer_prompt
def test_skill_analyzer_prompt_content_and_returns():
    prompt, returns = analyzer_prompt(EXPERT), discounted_returns([step.reward for step in EXPERT.steps])
    expected = [10 * 0.95 ** (6 - i) for i in range(7)]
    assert max(abs(a - b) for a, b in zip(returns, expected)) < 1e-9, (returns, expected)
    assert prompt.startswith("Analyze the agent's episode.\nTask: " + HEAT_TASK + "\nOutcome: success"), prompt[:120]
    assert prompt.endswith(JSON_SHAPE) and "reusable workflow" in prompt
    assert "Step 1 | return 7.35 | obs: -= Welcome" in prompt and "thought: I should act. | action: go to" in prompt
    assert "Step 7 | return 10.00 |" in prompt and "action: move apple 1 to countertop 1" in prompt
    failed = analyzer_prompt(FAILURES["repeated invalid"][0])
    assert "Outcome: failure" in failed and "avoidance rule" in failed
    assert "action: take apple 1 from countertop 1 (invalid)" in failed and "action: (none)" in failed
    bare = dataclasses.replace(EXPERT, steps=[dataclasses.replace(step, response=f"<action>{step.action}</action>")
                                              for step in EXPERT.steps])
    assert "thought:" not in analyzer_prompt(bare), "a bare action tag should not repeat the action as a thought"


def test_skill_analyzer_prompt_fits_a_budget_and_keeps_first_and_last_steps():
    trajectory = episode([(closed(f"drawer {i}") * 8, f"go to drawer {i}") for i in range(1, 31)], won=True)
    full = analyzer_prompt(trajectory)
    for budget in (2000, 800, 300, 150):
        prompt = analyzer_prompt(trajectory, max_tokens=budget)
        assert len(prompt) // 4 <= budget < len(full) // 4, f"budget {budget}: {len(prompt) // 4} tokens"
        assert "Step 1 |" in prompt and "Step 30 |" in prompt and "steps omitted) ..." in prompt, budget
        assert HEAT_TASK in prompt and "Outcome: success" in prompt and prompt.endswith(JSON_SHAPE), budget
        numbers = [int(line.split()[1]) for line in prompt.splitlines() if line.startswith("Step ")]
        head = [n for n in numbers if n <= len(numbers)]
        assert numbers == head + list(range(31 - (len(numbers) - len(head)), 31)), f"not head + tail: {numbers}"
        assert (len(numbers) > 2 and " ... | " not in prompt) == (budget >= 800), f"{budget}: cut before dropping steps"
    tight = analyzer_prompt(trajectory, max_tokens=120, count_tokens=lambda text: len(text.split()))
    assert len(tight.split()) <= 120 and "Step 30 |" in tight and " ..." in tight, len(tight.split())
    impossible = analyzer_prompt(trajectory, max_tokens=5)
    assert HEAT_TASK in impossible and "Step 1 |" in impossible, "the fixed part must never be cut"


# =============================================================================
# seed.py and train.py: the pipeline end to end
# =============================================================================

REPO = os.path.dirname(os.path.abspath(__file__))
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1)
SKILL = "The apple was in the fridge 1: open the fridge 1 first, take the apple, then go to the countertop 1."
# One intra-op thread: on a 2-core machine shared with other jobs, OpenMP's spinning threads made one forward
# pass of the tiny model 40x slower (1.3 s vs 0.03 s measured); a model this small gains nothing from more.
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def weight_change(before, model):
    """Largest absolute change of any parameter since `before` (a snapshot)."""
    return max(max_diff(b, p.detach()) for b, p in zip(before, model.parameters()))


def fresh(policy):
    """A policy on a copy of the weights: tests that train never touch the shared fixture."""
    return Policy(copy.deepcopy(policy.model), policy.tokenizer)


def finite(metrics):
    return all(math.isfinite(v) for v in metrics.values())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def out_dir_of_the_tests(tmp_path_factory, monkeypatch):
    """Flags parsed in-process default to --out-dir out, relative to the working directory, where the user's own
    `python train.py` (the README's first command) leaves a run or holds its lock; train.get_config refuses such
    a folder. So in-process parsers default to a folder of the tests' own (train.get_parser.__wrapped__ is the
    real parser, for the test of docs/flags.md)."""
    real, folder = train.get_parser, str(tmp_path_factory.getbasetemp() / "out-of-the-tests")

    @functools.wraps(real)
    def get_parser(*args, **kwargs):
        parser = real(*args, **kwargs)
        parser.set_defaults(out_dir=folder)
        return parser
    monkeypatch.setattr(train, "get_parser", get_parser)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(policy, folder): a random 2-layer Qwen2 with a 512-token BPE trained on rendered household prompts,
    expert responses and analyzer prompts from 8 demonstration episodes."""
    env = envs.make_env("household", "train", 0)
    act, follow, analyzed = warm_start.demonstrations(env, 8, history_window=3, seed_value=0)
    corpus = [p + r for p, r in act + follow] + [skills.analyzer_prompt(t) + c for t, c in analyzed]
    folder = str(tmp_path_factory.mktemp("tiny_policy"))
    return build_tiny_policy(corpus, folder, seed=0, **TINY), folder


@pytest.fixture(scope="module")
def trajectories(tiny):
    """2 household tasks x 2 rollouts of up to 3 steps, 12 new tokens per step, sampled by the tiny policy."""
    policy, _ = tiny
    train_envs = [envs.make_env("household", "train", i, max_steps=3) for i in range(4)]
    return seed.rollout(policy, train_envs, [11, 12], group_size=2, max_steps=3, template=PROMPT, max_new_tokens=12,
                        generator=torch.Generator().manual_seed(0))


def update(policy, trajectories, skill_list=None, **loss_kwargs):
    """step_rows -> rescore -> step_advantages (GRPO over the episodes' scores) -> policy_update (AdamW without
    weight decay, as train.py) on `policy`; returns (metrics, skipped, rows, has_teacher)."""
    rows = seed.step_rows(trajectories, skill_list)
    old, teacher, ref, has_teacher = seed.rescore(policy, rows)
    advantages = seed.step_advantages(trajectories, rows, stats="trajectories")  # (B,)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-3, weight_decay=0.0)
    metrics, skipped = seed.policy_update(policy, optimizer, rows.prompts, rows.responses, advantages, old,
                                          teacher if skill_list else None, ref, has_teacher, loss_kwargs)
    return metrics, skipped, rows, has_teacher


# ----------------------------------------------------------------------------- one update, SEED and GRPO

def test_seed_update_end_to_end(tiny):
    policy = fresh(tiny[0])
    torch.manual_seed(0)
    train_envs = [envs.make_env("household", "train", i, max_steps=3) for i in range(4)]
    trajectories = seed.rollout(policy, train_envs, [3, 4], group_size=2, max_steps=3, template=PROMPT,
                                max_new_tokens=12)
    assert [t.group for t in trajectories] == [0, 0, 1, 1]
    for t in trajectories:
        assert 1 <= len(t.steps) <= 3 and t.gt is not None, f"episode not finished: {len(t.steps)} steps"
        for step in t.steps:
            assert len(step.response_ids) == len(step.sampled_logp) <= 12
    parsed, texts = seed.analyze(policy, trajectories, max_new_tokens=16)
    assert len(parsed) == len(texts) == 4

    # the analyzer's own skills (a random model parses none): GRPO still applies, metrics stay finite
    metrics, skipped, rows, has_teacher = update(fresh(policy), trajectories, parsed)
    assert skipped is None and finite(metrics), metrics
    mask = seed.response_mask(rows.responses)  # (B, R)
    share = ((mask * has_teacher[:, None]).sum() / mask.sum()).item()
    assert abs(metrics["teacher_token_share"] - share) < 1e-6, (metrics["teacher_token_share"], share)

    # skills forced: every row has a teacher, delta is non-zero and the update moves the weights
    before = snapshot(policy.model)
    metrics, skipped, rows, has_teacher = update(policy, trajectories, [SKILL] * 4)
    change = weight_change(before, policy.model)
    assert skipped is None and finite(metrics), metrics
    assert has_teacher.all() and abs(metrics["teacher_token_share"] - 1.0) < 1e-6, metrics["teacher_token_share"]
    assert metrics["delta_abs_mean"] > 1e-4, f"the skill changed no log-prob: {metrics['delta_abs_mean']}"
    assert change > 1e-5, f"a SEED update with non-zero delta left the weights unchanged (max change {change})"


def test_grpo_update_changes_weights_only_with_a_reward_signal(tiny, trajectories):
    # a random tiny model never wins, so both groups tie and the GRPO advantages are exactly 0: no change
    scores = [t.reward - sum(s.penalty for s in t.steps) for t in trajectories]  # outcome - penalties
    policy = fresh(tiny[0])
    before = snapshot(policy.model)
    metrics, skipped, *_ = update(policy, trajectories, distill_coef=0.0)
    assert skipped is None and finite(metrics), (skipped, metrics)
    if scores[0] == scores[1] and scores[2] == scores[3]:
        assert weight_change(before, policy.model) == 0.0, "zero advantages must give a zero update"
    # credit the first rollout of each task with a win (+10): advantages +-0.707 and the weights move
    won = copy.deepcopy(trajectories)
    for t in won[0::2]:
        t.reward += 10.0
    policy = fresh(tiny[0])
    metrics, skipped, *_ = update(policy, won, distill_coef=0.0)
    change = weight_change(before, policy.model)
    rows = seed.step_rows(won)
    advantages = seed.step_advantages(won, rows, stats="trajectories")  # (B,) each row its episode's
    expected = (torch.tensor([1, -1, 1, -1]) / math.sqrt(2))[rows.trajectory]
    assert max_diff(advantages, expected) < 1e-5, advantages
    assert skipped is None and finite(metrics) and metrics["delta_abs_mean"] == 0.0, metrics
    assert metrics["grad_norm"] > 0 and change > 1e-5, f"GRPO update: max weight change {change}"


def step(penalty=0.0):
    """A step record with only its format penalty set (what step_advantages reads)."""
    return seed.Step(observation="", response="", action="", penalty=penalty)


def test_advantage_norms():
    """group: each task's std (GRPO); batch: one std over the update, so an all-failed group whose rollouts
    differ only by a 0.1 format penalty keeps advantages ~0 instead of +-1; none: centred scores (Dr. GRPO)."""
    scores = [10.0, 0.0, 0.0, 0.0, 0.0, -0.1, 0.0, 0.0]  # task 0: one win; task 1: all failed, one penalty
    trajectories = [seed.Trajectory(reward=r, group=i // 4, steps=[step()]) for i, r in enumerate(scores)]  # 1 row each
    rows = seed.Rows([], [], [], [], trajectory=list(range(len(scores))))
    group, batch, none = (seed.step_advantages(trajectories, rows, norm, stats="trajectories")
                          for norm in ("group", "batch", "none"))
    assert max_diff(none, torch.tensor([7.5, -2.5, -2.5, -2.5, 0.025, -0.075, 0.025, 0.025])) < 1e-5, none
    assert abs(group[5].item() + 1.5) < 1e-4 and abs(group[0].item() - 1.5) < 1e-4, group  # the penalty blown up
    assert max_diff(batch, none / none.std()) < 1e-6, batch
    assert batch[4:].abs().max() < 0.03 < 1.0 < batch[0], f"the all-failed group should stay ~0: {batch}"


# ----------------------------------------------------------------------------- the harness, as verl-agent's

def test_invalid_format_penalty_falls_on_its_own_step():
    """A won 3-step episode with two invalid steps: verl-agent's rows score 9.9, 9.9, 10.0 (the penalty on the
    invalid step's own row); the old rule gave every row the summed 9.8. Checked through the advantages of a
    group whose other episode scores 0 (norm none: advantage = row score - group mean)."""
    won = seed.Trajectory(reward=10.0, group=0, steps=[step(0.1), step(0.1), step(0.0)])
    lost = seed.Trajectory(reward=0.0, group=0, steps=[step(0.0)])
    rows = seed.Rows([], [], [], [], trajectory=[0, 0, 0, 1])
    steps = seed.step_advantages([won, lost], rows, "none", stats="steps")
    mean = (9.9 + 9.9 + 10.0 + 0.0) / 4
    assert max_diff(steps, torch.tensor([9.9, 9.9, 10.0, 0.0]) - mean) < 1e-5, steps
    old = seed.step_advantages([won, lost], rows, "none", stats="trajectories")
    assert max_diff(old, torch.tensor([4.9, 4.9, 4.9, -4.9])) < 1e-5, old  # 9.8 broadcast, the old rule


@pytest.mark.parametrize("response, valid", [
    ("<think>go</think><action>go to fridge 1</action>", True),
    ("<action>go to fridge 1</action>", False),  # no think pair: verl-agent's projection marks it invalid
    ("<think>go</think> go to fridge 1", False),
    ("<think>\u53bb</think><action>go to fridge 1</action>", False),  # Chinese characters
    ("<think>a</think><action>b", False)])
def test_response_validity_is_verl_agents(response, valid):
    assert skills.response_is_valid(response) is valid


def test_grpo_statistics_over_step_rows():
    """Step lengths [3, 10, 10, 2] with scores [10, 0, 0, 10] in one group: verl-agent's mean and std over the
    25 step rows give +1.96 / -0.49; over the 4 trajectories, +-0.866."""
    trajectories = [seed.Trajectory(reward=r, group=0, steps=[step(0.0)] * n) for r, n in
                    zip([10.0, 0.0, 0.0, 10.0], [3, 10, 10, 2])]
    rows = seed.Rows([], [], [], [], trajectory=[i for i, n in enumerate([3, 10, 10, 2]) for _ in range(n)])
    steps = seed.step_advantages(trajectories, rows, "group", stats="steps")
    assert abs(steps[0].item() - 1.96) < 0.005 and abs(steps[3].item() + 0.49) < 0.005, steps
    episodes = seed.step_advantages(trajectories, rows, "group", stats="trajectories")
    assert abs(episodes[0].item() - 0.866) < 0.001 and abs(episodes[3].item() + 0.866) < 0.001, episodes
    with pytest.raises(ValueError, match="stats must be"):
        seed.step_advantages(trajectories, rows, "group", stats="episodes")


def test_update_log_probs_are_dropout_free(tiny, trajectories):
    """With attention dropout 0.1, the update's own forward (old = its detached log-probs) must equal the
    eval-mode re-scoring that gives the teacher: the same prompts as teacher make delta exactly 0. A
    train-mode forward gave |delta| about 0.05, the size of SEED's signal."""
    policy = load_policy(tiny[1], device="cpu", dtype="float32")
    policy.model.config.attention_dropout = 0.1
    for module in policy.model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    torch.manual_seed(0)
    rows = seed.step_rows(trajectories)
    same = seed.response_logprobs(policy.model, rows.prompts, rows.responses, policy.pad_id)  # eval
    advantages = torch.zeros(len(rows.prompts))
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.0)
    metrics, skipped = seed.policy_update(policy, optimizer, rows.prompts, rows.responses, advantages, None,
                                          same, has_teacher=torch.ones(len(rows.prompts), dtype=torch.bool))
    print(f"\ndropout 0.1: |delta| against an identical teacher {metrics['delta_abs_mean']:.2e}")
    assert skipped is None and metrics["delta_abs_mean"] < 1e-5, metrics
    assert [m.attention_dropout for m in policy.model.modules() if hasattr(m, "attention_dropout")][0] == 0.1


def test_prompt_is_verl_agents_alfworld_template():
    first = skills.render_prompt(PROMPT, "put a mug in shelf.", [], "Welcome.\n\nYour task is to: put a mug in shelf.",
                               ["go to shelf 1", "look"])
    assert first == ("\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
                     "Your current observation is: Welcome.\n\nYour task is to: put a mug in shelf.\n"
                     "Your admissible actions of the current situation are: ['go to shelf 1'\n 'look'].\n\n"
                     "Now it's your turn to take an action.\nYou should first reason step-by-step about the "
                     "current situation. This reasoning process MUST be enclosed within <think> </think> tags. \n"
                     "Once you've finished your reasoning, you should choose an admissible action for current "
                     "step and present it within <action> </action> tags.\n")
    later = skills.render_prompt(PROMPT, "put a mug in shelf.", [("o1", "a1"), ("o2", "a2"), ("o3", "a3")], "o4",
                               ["look"], history_window=2)
    assert later.startswith("\nYou are an expert agent operating in the ALFRED Embodied Environment. Your task "
                            "is to: put a mug in shelf.\nPrior to this step, you have already taken 3 step(s). "
                            "Below are the most recent 2 observaitons and the corresponding actions you took: "
                            "[Observation 2: 'o2', Action 2: 'a2']\n[Observation 3: 'o3', Action 3: 'a3']\n"
                            "You are now at step 4 and your current observation is: o4\n"
                            "Your admissible actions of the current situation are: ['look'].\n\n"), later
    assert "Your task is to:" in with_skill(first, "Open the cabinet first.")  # the skill finds its line
    shop = skills.render_prompt(envs.load("adapters.webshop:PROMPT"), "i need jeans", [], "'Search'",
                              ["search[<your query>]", "click[next >]"])
    assert "environment. \nYour task is to: i need jeans.\nYour current observation is: 'Search'.\n" in shop
    assert "are: \n[\n'search[<your query>]',\n'click[next >]',\n].\n\nNow it's your turn to take one action" in shop


def test_presets_follow_opid_for_hugging_face_models():
    tiny_cfg, hf_cfg = train.get_config([]), train.get_config(["--model", "Qwen/Qwen2.5-1.5B-Instruct"])
    assert (tiny_cfg.eval_temperature, hf_cfg.eval_temperature) == (0.0, 0.4)
    assert (hf_cfg.analysis_prompt_tokens, hf_cfg.analysis_max_new_tokens) == (28672, 4096)
    assert (tiny_cfg.grpo_stats, hf_cfg.grpo_stats) == ("steps", "steps")  # verl-agent's rule for both


# ----------------------------------------------------------------------------- packed == padded

def test_packed_equals_padded_logprobs(tiny, trajectories):
    policy, _ = tiny
    generator = torch.Generator().manual_seed(1)
    full = trajectories[-1].steps[-1].prompt_ids
    prompts = [full[:7], full, full[:120], full[:1], full[:300]]
    lengths = [1, 12, 5, 9, 3]  # varied prompt and response lengths: padding on both sides differs per row
    responses = [torch.randint(3, len(policy.tokenizer), (n,), generator=generator).tolist() for n in lengths]
    mask = seed.response_mask(responses)
    padded = seed.response_logprobs(policy.model, prompts, responses, policy.pad_id, 0.7, "padded")
    packed = seed.response_logprobs(policy.model, prompts, responses, policy.pad_id, 0.7, "packed")
    small = seed.response_logprobs(policy.model, prompts, responses, policy.pad_id, 0.7, "packed", max_batch_tokens=200)
    one_by_one = torch.zeros_like(padded)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        one_by_one[i, :len(response)] = seed.response_logprobs(policy.model, [prompt], [response], policy.pad_id,
                                                               0.7)[0]
    diff, diff_small, diff_single = max_diff(packed, padded), max_diff(small, padded), max_diff(one_by_one, padded)
    print(f"\npacked vs padded log-probs: max diff {diff:.2e} (micro-batched {diff_small:.2e}, "
          f"row by row {diff_single:.2e})")
    assert diff < 1e-5 and diff_small < 1e-5 and diff_single < 1e-5, (diff, diff_small, diff_single)
    assert (padded[mask == 0] == 0).all() and (packed[mask == 0] == 0).all(), "log-probs past a response's end"
    assert (padded[mask == 1] < 0).all(), "a real token got log-prob 0"


def test_packed_equals_padded_update(tiny, trajectories):
    """One policy_update per layout from the same weights: the same gradient. SGD with lr 1 makes the weight
    difference the gradient difference (Adam's first step, ~lr * sign(g), would hide it)."""
    rows = seed.step_rows(trajectories, [SKILL, None, SKILL, None])
    old, teacher, _, has_teacher = seed.rescore(tiny[0], rows)
    advantages = torch.randn(len(rows.prompts), generator=torch.Generator().manual_seed(2))  # (B,)
    kwargs = dict(distill_coef=0.1, distill_mode="gated", entropy_coef=0.01)
    results = {}
    for layout in ("padded", "packed"):
        policy = fresh(tiny[0])
        optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
        metrics, skipped = seed.policy_update(policy, optimizer, rows.prompts, rows.responses, advantages, old,
                                              teacher, None, has_teacher, kwargs, layout=layout,
                                              max_batch_tokens=1500)
        assert skipped is None and finite(metrics), (layout, skipped, metrics)
        results[layout] = (policy.model, metrics)
    diff = max(max_diff(a, b) for a, b in zip(results["padded"][0].parameters(), results["packed"][0].parameters()))
    change = weight_change(snapshot(tiny[0].model), results["padded"][0])
    metric_diff = max(abs(results["padded"][1][k] - results["packed"][1][k]) for k in results["padded"][1])
    print(f"\npacked vs padded update: max weight diff {diff:.2e} (max change {change:.2e}), metrics {metric_diff:.2e}")
    assert change > 1e-4, f"the update did nothing (max change {change})"
    assert diff < 1e-6 and metric_diff < 1e-5, f"packed vs padded: weights {diff}, metrics {metric_diff}"


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_equal_one_batch(tiny, trajectories, agg):
    """Gradient accumulation over micro-batches of about one row gives the full batch's gradient in every
    aggregation (SGD with lr 1: the weight difference is the gradient difference)."""
    rows = seed.step_rows(trajectories, [SKILL, None, SKILL, None])
    old, teacher, _, has_teacher = seed.rescore(tiny[0], rows)
    advantages = torch.randn(len(rows.prompts), generator=torch.Generator().manual_seed(6))  # (B,)
    results = []
    for max_batch_tokens in (100_000, 1):
        policy = fresh(tiny[0])
        metrics, skipped = seed.policy_update(policy, torch.optim.SGD(policy.model.parameters(), lr=1.0),
                                              rows.prompts, rows.responses, advantages, old, teacher, None,
                                              has_teacher, dict(distill_coef=0.1, agg=agg, entropy_coef=0.01),
                                              max_batch_tokens=max_batch_tokens)
        assert skipped is None, skipped
        results.append((list(policy.model.parameters()), metrics))
    diff = max(max_diff(a, b) for a, b in zip(results[0][0], results[1][0]))
    loss_diff = abs(results[0][1]["loss"] - results[1][1]["loss"])
    print(f"\n{agg}: one batch vs {len(rows.prompts)} micro-batches: max weight diff {diff:.2e}, loss {loss_diff:.2e}")
    # the loss metric is summed in float32 over micro-batches; with per-row token sums (and the gated term's
    # teacher - logp gaps) its rounding reaches ~1e-6, the weights still agree to ~5e-8
    assert diff < 1e-6 and loss_diff < 1e-5, f"{agg}: weights {diff}, loss {loss_diff}"


# ----------------------------------------------------------------------------- teacher rows, parse failures

def test_teacher_and_student_rows_share_response_tokens(tiny, trajectories):
    policy, _ = tiny
    skill_list = [SKILL, None, SKILL, None]
    rows = seed.step_rows(trajectories, skill_list)
    steps = [(t, s) for t, trajectory in enumerate(trajectories) for s in trajectory.steps]
    assert len(rows.prompts) == len(steps) and rows.trajectory == [t for t, _ in steps]
    for i, (t, step) in enumerate(steps):
        assert rows.responses[i] is step.response_ids, f"row {i}: the response is not the sampled one"
        assert rows.prompts[i] == step.prompt_ids == seed.encode_chat(policy.tokenizer, step.prompt)
        if skill_list[t] is None:
            assert rows.teacher_prompts[i] is None, f"row {i}: teacher prompt without a skill"
            continue
        assert rows.teacher_prompts[i] == skills.with_skill(step.prompt, SKILL)
        teacher_ids = seed.encode_chat(policy.tokenizer, rows.teacher_prompts[i])
        assert len(teacher_ids) > len(step.prompt_ids) and teacher_ids != step.prompt_ids
    old, teacher, ref, has_teacher = seed.rescore(policy, rows)
    assert ref is None and has_teacher.tolist() == [skill_list[t] is not None for t, _ in steps]
    assert torch.equal(teacher[~has_teacher], old[~has_teacher]), "rows without a skill must hold the old log-probs"
    # the teacher log-probs line up with the response tokens: row by row scoring under the skill prompt agrees
    alignment = 0.0
    for i in has_teacher.nonzero().flatten().tolist():
        alone = seed.response_logprobs(policy.model, [seed.encode_chat(policy.tokenizer, rows.teacher_prompts[i])],
                                       [rows.responses[i]], policy.pad_id)[0]
        alignment = max(alignment, max_diff(teacher[i, :alone.shape[0]], alone))
        assert (teacher[i, len(rows.responses[i]):] == 0).all(), f"row {i}: teacher log-prob past the response"
    shift = max_diff(teacher[has_teacher], old[has_teacher])
    print(f"\nteacher row-by-row alignment: max diff {alignment:.2e}; skill shifts log-probs by up to {shift:.3f}")
    assert alignment < 1e-5, f"teacher log-probs misaligned: max diff {alignment}"
    assert shift > 1e-3, f"the skill block changed no teacher log-prob (max diff {shift})"


def test_parse_failure_gives_zero_delta(tiny, trajectories):
    policy, _ = tiny
    rows = seed.step_rows(trajectories, [SKILL, None, SKILL, None])
    old, teacher, _, has_teacher = seed.rescore(policy, rows)
    mask = seed.response_mask(rows.responses)  # (B, R)
    failed = torch.tensor([t % 2 == 1 for t in rows.trajectory])  # (B,) rows of trajectories 1 and 3
    assert torch.equal(has_teacher, ~failed), has_teacher
    delta = L.seed_delta(teacher, old, mask * has_teacher[:, None])  # (B, R)
    assert (delta[failed] == 0).all(), f"delta on a failed analysis: max {delta[failed].abs().max().item()}"
    assert delta[~failed].abs().max() > 1e-3, "no delta on the rows that have a skill"
    # the loss's own statistics on the failed rows: no signal of any mode
    for mode in ("advantage", "loss", "gated"):
        logp = old[failed].clone().requires_grad_()
        _, metrics = L.seed_loss(logp, old[failed], torch.ones(int(failed.sum())), mask[failed],
                                 teacher_logp=teacher[failed], teacher_mask=mask[failed] * 0, distill_mode=mode)
        assert metrics["delta_abs_mean"] == 0.0 and metrics["teacher_token_share"] == 0.0, (mode, metrics)
        assert metrics["distill_loss"] == 0.0, (mode, metrics)

    # an update on the failed rows alone equals plain GRPO, even in gated mode (without has_teacher the gate
    # would be 0.5 there and push their tokens)
    subset = failed.nonzero().flatten().tolist()
    prompts, responses = [rows.prompts[i] for i in subset], [rows.responses[i] for i in subset]
    advantages = torch.randn(len(subset), generator=torch.Generator().manual_seed(3))  # (b,)
    weights = {}
    for name, teacher_logp, marks in [("grpo", None, None), ("masked", teacher[failed], has_teacher[failed]),
                                      ("unmasked", teacher[failed], None)]:
        model = fresh(policy)
        seed.policy_update(model, torch.optim.SGD(model.model.parameters(), lr=1.0), prompts, responses, advantages,
                           old[failed], teacher_logp, None, marks, dict(distill_coef=0.5, distill_mode="gated"))
        weights[name] = list(model.model.parameters())
    masked = max(max_diff(a, b) for a, b in zip(weights["grpo"], weights["masked"]))
    unmasked = max(max_diff(a, b) for a, b in zip(weights["grpo"], weights["unmasked"]))
    print(f"\nfailed rows: GRPO vs masked gated update max diff {masked:.2e}; unmasked {unmasked:.2e}")
    assert masked == 0.0, f"a failed analysis changed the update: max weight diff {masked}"
    assert unmasked > 1e-6, f"the gated term had no effect, so this test proves nothing ({unmasked})"


def test_rescore_without_student_pass_gives_the_same_update(tiny, trajectories):
    """rescore(need_old=False) + policy_update(old_logp=None), as train.py runs it, equals the explicit
    student re-scoring: with one PPO epoch the update's own forward pass holds log pi_old."""
    rows = seed.step_rows(trajectories, [SKILL, None, SKILL, None])
    old, teacher, _, has_teacher = seed.rescore(tiny[0], rows)
    no_old, teacher_only, _, has_teacher_only = seed.rescore(tiny[0], rows, need_old=False)
    assert no_old is None and torch.equal(has_teacher, has_teacher_only)
    assert torch.equal(teacher[has_teacher], teacher_only[has_teacher]), "teacher rows differ between the modes"
    advantages = torch.randn(len(rows.prompts), generator=torch.Generator().manual_seed(4))  # (B,)
    results = []
    for old_logp, teacher_logp in [(old, teacher), (None, teacher_only)]:
        policy = fresh(tiny[0])
        metrics, skipped = seed.policy_update(policy, torch.optim.SGD(policy.model.parameters(), lr=1.0),
                                              rows.prompts, rows.responses, advantages, old_logp, teacher_logp,
                                              None, has_teacher, dict(distill_coef=0.1))
        assert skipped is None, skipped
        results.append((list(policy.model.parameters()), metrics))
    diff = max(max_diff(a, b) for a, b in zip(results[0][0], results[1][0]))
    metric_diff = max(abs(results[0][1][k] - results[1][1][k]) for k in results[0][1])
    print(f"\nneed_old=False vs student pass: max weight diff {diff:.2e}, metrics {metric_diff:.2e}")
    assert diff < 1e-6 and metric_diff < 1e-5, f"weights {diff}, metrics {metric_diff}"


def test_ppo_mini_batches(tiny, trajectories):
    """ppo_update: one part equals policy_update on all rows; two parts are two optimizer steps on a random
    split, the first with ratio 1 (the sampling log-probs are the current weights'), the second with the
    behaviour log-probs of the moved weights (ratio != 1, ppo_kl > 0) and each part's teacher rows."""
    rows = seed.step_rows(trajectories, [SKILL, None, SKILL, None])
    _, teacher, _, has_teacher = seed.rescore(tiny[0], rows, need_old=False)
    advantages = torch.randn(len(rows.prompts), generator=torch.Generator().manual_seed(5))  # (B,)
    kwargs = dict(loss_kwargs=dict(distill_coef=0.1))
    one, reference = fresh(tiny[0]), fresh(tiny[0])
    seed.ppo_update(one, torch.optim.SGD(one.model.parameters(), lr=0.5), rows, advantages, teacher, None,
                    has_teacher, mini_batches=1, **kwargs)
    seed.policy_update(reference, torch.optim.SGD(reference.model.parameters(), lr=0.5), rows.prompts,
                       rows.responses, advantages, None, teacher, None, has_teacher, dict(distill_coef=0.1))
    diff = max(max_diff(a, b) for a, b in zip(one.model.parameters(), reference.model.parameters()))
    assert diff < 1e-7, f"one mini-batch differs from policy_update: {diff}"

    two, by_hand = fresh(tiny[0]), fresh(tiny[0])
    metrics, skipped = seed.ppo_update(two, torch.optim.SGD(two.model.parameters(), lr=0.5), rows, advantages,
                                       teacher, None, has_teacher, mini_batches=2,
                                       generator=torch.Generator().manual_seed(6), **kwargs)
    assert skipped is None and finite(metrics), (skipped, metrics)
    parts = torch.randperm(len(rows.prompts), generator=torch.Generator().manual_seed(6)).chunk(2)
    behaviour = seed.padded_logprobs(rows.sampled_logp)  # (B, R)
    optimizer, kls = torch.optim.SGD(by_hand.model.parameters(), lr=0.5), []
    for part in parts:
        part_metrics, _ = seed.policy_update(
            by_hand, optimizer, [rows.prompts[i] for i in part], [rows.responses[i] for i in part],
            advantages[part], behaviour[part], teacher[part], None, has_teacher[part], dict(distill_coef=0.1))
        kls.append(part_metrics["ppo_kl"])
    diff = max(max_diff(a, b) for a, b in zip(two.model.parameters(), by_hand.model.parameters()))
    print(f"\nppo_update(2 parts) vs two policy_update calls: max weight diff {diff:.2e}; ppo_kl per part {kls}")
    assert diff < 1e-7, f"two mini-batches differ from two policy_update steps: {diff}"
    assert abs(kls[0]) < 1e-4 < abs(kls[1]), f"expected ratio 1 then a moved policy, ppo_kl {kls}"
    assert abs(metrics["ppo_kl"] - sum(kls) / 2) < 1e-6, (metrics["ppo_kl"], kls)


# ----------------------------------------------------------------------------- sampling

def test_sample_greedy_stop_and_logprobs(tiny, trajectories):
    policy, _ = tiny
    full = trajectories[0].steps[-1].prompt_ids
    prompts = [full, full[:40], full[:200], full[:5]]
    greedy, greedy_logp = seed.sample(policy, prompts, 12, temperature=0)
    again, again_logp = seed.sample(policy, prompts, 12, temperature=0, batch_size=1)  # no padding at all
    assert greedy == again, "greedy decoding depends on the batch (left padding / position ids)"
    batch_diff = max(max_diff(torch.tensor(a), torch.tensor(b)) for a, b in zip(greedy_logp, again_logp))
    assert batch_diff < 1e-5, f"greedy log-probs batch vs single: max diff {batch_diff}"
    for response, logp in zip(greedy, greedy_logp):  # 12 tokens, or ends right after its only stop token
        stops = [j for j, token in enumerate(response) if token in policy.stop_ids]
        assert len(logp) == len(response) and stops in ([], [len(response) - 1]), (response, policy.stop_ids)
        assert stops or len(response) == 12, response

    # make a token the greedy decoder emits mid-response a stop token: every row must end right after it
    stop_token = greedy[0][3]
    stopping = Policy(policy.model, policy.tokenizer)
    stopping.stop_ids = [stop_token]
    stopped, stopped_logp = seed.sample(stopping, prompts, 12, temperature=0)
    for row, (long, short, long_logp, short_logp) in enumerate(zip(greedy, stopped, greedy_logp, stopped_logp)):
        end = long.index(stop_token) + 1 if stop_token in long else len(long)
        assert short == long[:end] and short_logp == long_logp[:end], f"row {row}: {short} vs {long[:end]}"
    assert len(stopped[0]) <= 4 and stopped[0][-1] == stop_token, stopped[0]
    assert (seed.response_mask(stopped).sum(1) == torch.tensor([len(r) for r in stopped])).all()

    # greedy log-probs are at temperature 1; sampled ones at the sampling temperature: re-scoring agrees
    rescored = seed.response_logprobs(policy.model, prompts, greedy, policy.pad_id, 1.0)
    greedy_diff = max(max_diff(rescored[i, :len(lp)], torch.tensor(lp)) for i, lp in enumerate(greedy_logp))
    sampled, sampled_logp = seed.sample(policy, prompts, 12, temperature=0.7,
                                        generator=torch.Generator().manual_seed(5))
    repeat, _ = seed.sample(policy, prompts, 12, temperature=0.7, generator=torch.Generator().manual_seed(5))
    assert sampled == repeat, "the same generator seed gave different samples"
    diffs = {}
    for layout in ("padded", "packed"):
        rescored = seed.response_logprobs(policy.model, prompts, sampled, policy.pad_id, 0.7, layout)
        diffs[layout] = max(max_diff(rescored[i, :len(lp)], torch.tensor(lp)) for i, lp in enumerate(sampled_logp))
    print(f"\nsampled (KV cache) vs re-scored log-probs: temperature 0.7 padded {diffs['padded']:.2e} packed "
          f"{diffs['packed']:.2e}; greedy {greedy_diff:.2e}; batch vs single {batch_diff:.2e}")
    assert max(diffs.values()) < 1e-4 and greedy_diff < 1e-4, (diffs, greedy_diff)


class OldCacheName(torch.nn.Module):
    """A model as transformers before 5.24 shaped it: the KV cache goes in and out as past_key_values."""

    def __init__(self, policy):
        super().__init__()
        self.inner, self.config, self.name = policy.model, policy.model.config, policy.cache_name  # the installed one

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=True, logits_to_keep=0):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=use_cache, logits_to_keep=logits_to_keep, **{self.name: past_key_values})
        return types.SimpleNamespace(logits=out.logits, past_key_values=getattr(out, self.name))


def test_sample_reuses_the_kv_cache_under_either_transformers_name(tiny, trajectories):
    policy, _ = tiny
    old = Policy(OldCacheName(policy), policy.tokenizer)
    assert old.cache_name == "past_key_values" and policy.cache_name in ("cache", "past_key_values")
    prompts = [trajectories[0].steps[-1].prompt_ids, trajectories[0].steps[0].prompt_ids[:30]]
    assert seed.sample(old, prompts, 10, temperature=0) == seed.sample(policy, prompts, 10, temperature=0)


# ----------------------------------------------------------------------------- train.py

def run_train(*args):
    """train.main in this process on the given flags; returns its wall time in seconds."""
    start = time.perf_counter()
    train.main(train.get_config([str(a) for a in args]))
    return time.perf_counter() - start


def read_lines(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def numbers(record):
    """The numeric fields of a metrics line, times excluded (they differ run to run)."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not k.startswith("time")}


def untimed(record):
    """A log line without its wall-clock fields ("time", "time_*"), which differ run to run."""
    return {k: v for k, v in record.items() if not k.startswith("time")}


def final_weights(out_dir):
    with open(os.path.join(out_dir, "checkpoints", "latest")) as handle:
        folder = os.path.join(out_dir, "checkpoints", handle.read().strip())
    return AutoModelForCausalLM.from_pretrained(folder), folder


# --analysis-prompt-tokens: the tiny fixture's folder runs as a Hugging Face model, whose preset budget (OPID's
# 28,672 tokens) exceeds its 4,096-token window
TRAIN_FLAGS = ["--updates", 2, "--tasks-per-update", 2, "--group-size", 2, "--max-steps", 3,
               "--max-new-tokens", 8, "--eval-tasks", 2, "--save-every", 1, "--analysis-max-new-tokens", 16,
               "--analysis-prompt-tokens", 1024]


def test_train_end_to_end_tiny(tmp_path, capsys):
    """--model tiny with a 2-step warm-up: files, a loadable checkpoint, and a rerun that reads the cached
    warm-up reproduces the run that built it."""
    flags = TRAIN_FLAGS + ["--warmup-steps", 2, "--cache-dir", tmp_path / "cache", "--entropy-coef", 0.01]
    seconds = run_train(*flags, "--out-dir", tmp_path / "a")
    output = capsys.readouterr().out
    out = tmp_path / "a"
    assert "update 2/2 |" in output and "final evaluation" in output, output[-2000:]
    config = json.loads((out / "config.json").read_text())
    assert config["updates"] == 2 and config["model"] == "tiny" and config["max_steps"] == 3, config
    metrics = read_lines(out / "metrics.jsonl")
    assert [m["update"] for m in metrics] == [1, 2], metrics
    for m in metrics:
        assert m["skipped"] is None and all(math.isfinite(v) for v in numbers(m).values()), m
        assert m["rows"] > 0 and 0 <= m["parse_fail"] <= 1 and m["entropy"] > 0, m
    evals = read_lines(out / "eval.jsonl")
    assert [(e["update"], e["split"]) for e in evals] == [(0, "valid_seen"), (0, "valid_unseen"),
                                                          (2, "valid_seen"), (2, "valid_unseen")], evals
    assert all(0 <= e["micro"] <= 1 and e["per_type"] for e in evals), evals
    model, folder = final_weights(str(out))
    assert folder.endswith("update_000002") and sorted(os.listdir(out / "checkpoints")) == [
        "latest", "update_000001", "update_000002"]
    assert torch.load(os.path.join(folder, "trainer.pt"), weights_only=True)["update"] == 2
    warm = [d for d in os.listdir(tmp_path / "cache") if d.startswith("tiny-household-")]
    assert len(warm) == 1, warm
    start = load_policy(str(tmp_path / "cache" / warm[0]), "cpu", "float32").model
    moved = max(max_diff(a, b) for a, b in zip(start.parameters(), model.parameters()))
    assert moved > 0, "two RL updates with an entropy bonus left the warm-started weights unchanged"

    rerun = run_train(*flags, "--out-dir", tmp_path / "b")
    assert "reusing the cached tiny model" in capsys.readouterr().out
    again, _ = final_weights(str(tmp_path / "b"))
    diff = max(max_diff(a, b) for a, b in zip(model.parameters(), again.parameters()))
    pairs = zip(map(numbers, metrics), map(numbers, read_lines(tmp_path / "b" / "metrics.jsonl")))
    metrics_diff = max(abs(a[k] - b[k]) for a, b in pairs for k in a)
    print(f"\ntrain.py --model tiny: {seconds:.1f}s building the warm-up, {rerun:.1f}s reusing it; "
          f"cached vs built: max weight diff {diff:.2e}, metrics {metrics_diff:.2e}; RL moved weights {moved:.2e}")
    assert diff == 0.0 and metrics_diff == 0.0, f"the cached warm-up changed the run: {diff}, metrics {metrics_diff}"


def test_train_tasks_repeats_the_same_tasks(tiny, tmp_path, monkeypatch):
    """--train-tasks K: every update draws its tasks from train tasks 0..K-1 (the check that RL can fit a few
    tasks it sees again, docs/vision.md); without it an update's tasks are fresh draws from a million."""
    drawn, rollout = [], seed.rollout

    def recording_rollout(policy, env_list, task_seeds, *args, **kwargs):
        if kwargs.get("desc", "rollout") == "rollout":  # not an evaluation
            drawn.append(sorted(task_seeds))
        return rollout(policy, env_list, task_seeds, *args, **kwargs)

    monkeypatch.setattr(seed, "rollout", recording_rollout)
    flags = ["--model", tiny[1], "--stage", "rl", "--algo", "grpo", "--lr", 1e-3] + TRAIN_FLAGS
    run_train(*flags, "--updates", 3, "--train-tasks", 2, "--out-dir", tmp_path / "fixed")
    assert drawn == [[0, 1]] * 3, drawn
    drawn.clear()
    run_train(*flags, "--out-dir", tmp_path / "fresh")
    assert len(drawn) == 2 and drawn[0] != drawn[1] and max(map(max, drawn)) > 1, drawn


# ----------------------------------------------------------------------------- bad configs

def test_unknown_env_is_one_clear_error(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "--env", "nosuchenv",
                             "--out-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                            env=SUBPROCESS_ENV, cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]  # argparse: "train.py: error: ..."
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(errors) == 1 and "nosuchenv" in errors[0] and "household" in errors[0], result.stderr[-2000:]


@pytest.mark.parametrize("flags, message", [
    (["--group-size", "1"], "--group-size"),
    (["--group-size", "1", "--algo", "grpo"], "--group-size"),
    (["--updates", "0"], "--updates"),
    (["--max-steps", "0"], "--max-steps"),
    (["--train-tasks", "4", "--tasks-per-update", "8"], "--train-tasks"),
    (["--train-tasks", "-1"], "--train-tasks"),
])
def test_bad_sizes_are_clean_argparse_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.get_config(flags)
    err = capsys.readouterr().err
    assert exit_info.value.code != 0 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], err



def test_docs_flags_table_is_generated_from_the_parser():
    """docs/flags.md's flag table is training.flags.flags_markdown's output: every default lives in the code
    once (PRESETS or the add() call), and the page cannot drift from it."""
    from training.flags import flags_markdown
    get_parser = train.get_parser.__wrapped__  # the real defaults (out_dir_of_the_tests changes --out-dir's)
    table = flags_markdown(get_parser("tiny"), get_parser("some/hf-model"))
    page = open(os.path.join(REPO, "docs", "flags.md")).read()
    start = page.index("<!-- flags table: generated by training.flags.flags_markdown -->\n")
    end = page.index("\n<!-- end of the generated table -->")
    assert page[page.index("\n", start) + 1:end] == table, "docs/flags.md's table is stale: remake it (its header)"
    assert "| `--lr` | `0.0001` | `1e-06` |" in table and "| **plumbing** |" in table
    help_text = get_parser().format_help()
    options = help_text[help_text.index("\nthe method:"):]  # past the usage line and the docstring
    assert options.index("--algo") < options.index("\nplumbing:") < options.index("--out-dir"), options[:300]


def test_stage1_follows_the_protocol_and_prints_its_counts(tiny, tmp_path, capsys):
    """The paper's stage 1 on a (local) Hugging Face model: --sft-tasks x --sft-rollouts of its own rollouts,
    annotated by the env's annotator, format-checked, counted, then --sft-epochs of SFT, saved in <out-dir>/sft;
    a pair whose completion fails the check is dropped and counted."""
    defaults = train.get_config(["--model", "some/hf-model"])
    assert (defaults.sft_tasks, defaults.sft_rollouts, defaults.sft_epochs) == (180, 8, 3)
    assert (defaults.distill_mode, defaults.distill_coef, defaults.gate_beta, defaults.kl_coef, defaults.lr) == (
        "gated", 0.01, 5.0, 0.01, 1e-6)
    run_train("--model", tiny[1], "--stage", "sft", "--sft-tasks", 2, "--sft-rollouts", 2, "--tasks-per-update", 2,
              "--sft-epochs", 1, "--max-steps", 3, "--max-new-tokens", 8, "--analysis-prompt-tokens", 1024,
              "--analysis-max-new-tokens", 16, "--sft-lr", 1e-3, "--out-dir", tmp_path / "out")
    output = capsys.readouterr().out
    assert "stage 1: 4 trajectories collected, 4 kept, 0 dropped by the format check" in output, output[-2000:]
    assert "stage 1: 1 epoch(s) on 4 examples" in output and (tmp_path / "out" / "sft" / "config.json").exists()
    broken = lambda trajectory, gt, rng: ("a summary", "x")  # a skill the check refuses
    examples, counts = skills.hindsight_examples([seed.Trajectory(task="t", gt={})], broken)
    assert examples == [] and counts == {"collected": 1, "kept": 0, "dropped": 1}
