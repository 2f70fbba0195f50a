import math

import pytest
import torch

from loss import aggregate, entropy_from_logits, grpo_advantages, seed_delta, seed_loss, token_logprobs

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
    _, metrics = seed_loss(old.clone(), old, torch.ones(1), mask, teacher_logp=teacher)
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
