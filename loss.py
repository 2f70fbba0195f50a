"""The SEED loss: PPO-clip on GRPO advantages plus a dense, self-distilled token signal. Pure functions.

SEED re-scores the tokens the policy sampled under a teacher context (the prompt with a skill that the same
policy wrote about the finished episode) and under the ordinary context, and turns the difference into a
per-token signal: delta_t = log pi_old(y_t | h^) - log pi_old(y_t | h). This file holds everything from
logits to the scalar loss, imports only torch, and is meant to be copied into other trainers (verl, TRL).

How it departs from the paper: the paper does not publish its loss code. The default ("advantage" mode,
A_t = A_grpo + 1e-3 * delta_t, delta neither normalised nor clipped) and the PPO settings (clip 0.2, dual
clip 3, k3 KL, token-mean) follow the authors' predecessor OPID and verl. The "loss" mode (OPID's auxiliary
-c * delta * log p) and the "gated" mode (SDAR's sigmoid gate) are options, off by default.

Conventions: per-token tensors share one shape, padded (B, T) or packed (1, N) / (N,); the last axis holds
the tokens of a row and the seq-mean aggregations treat each row as one sequence (re-pad packed rows first
to use them). mask is 1 exactly on sampled response tokens. Whatever sits off the mask (padding, NaN, inf)
is replaced with torch.where before any arithmetic: 0 * NaN is NaN, so multiplying by the mask is not enough.

Tests: python -m pytest -q test_seed.py
"""
import torch

_CHUNK_ELEMENTS = 2 ** 25  # float32 elements per chunk of logits (128 MB): 220 tokens at a 152k vocabulary


def _token_blocks(rows, length, vocab, chunk_size):
    """Yield (row slice, token slice) blocks covering a (rows, length) grid, at most chunk_size tokens each."""
    chunk_size = max(1, _CHUNK_ELEMENTS // vocab) if chunk_size is None else chunk_size
    rows_per_block = max(1, chunk_size // max(length, 1))  # short rows: several whole rows per block
    tokens_per_block = max(1, min(length, chunk_size))  # long rows: a slice of one row per block
    for row in range(0, rows, rows_per_block):
        for token in range(0, length, tokens_per_block):
            yield slice(row, row + rows_per_block), slice(token, token + tokens_per_block)


def _scaled(logits, temperature):
    """A block of logits in float32 divided by the temperature (no copy of fp32 logits at temperature 1)."""
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def _block_statistic(logits, targets, block, temperature):
    """log p(target) per token of one block of (B, T, V) logits, or the entropy when targets is None."""
    log_probs = torch.log_softmax(_scaled(logits[block], temperature), dim=-1)  # (b, t, V)
    if targets is None:
        return -(log_probs.exp() * log_probs).sum(-1)  # (b, t)
    return log_probs.gather(-1, targets[block].unsqueeze(-1)).squeeze(-1)  # (b, t)


def _block_gradient(logits, targets, entropy, grad_out, block, temperature):
    """Gradient w.r.t. one block of (B, T, V) logits of the statistic above, given its (B, T) upstream gradient."""
    log_probs = torch.log_softmax(_scaled(logits[block], temperature), dim=-1)  # (b, t, V)
    upstream = grad_out[block].unsqueeze(-1) / temperature  # (b, t, 1)  z = logits / temperature
    if targets is None:  # d entropy / d z = -p * (log p + entropy)
        probs = log_probs.exp()
        return log_probs.add_(entropy[block].unsqueeze(-1)).mul_(probs).mul_(-upstream)
    # d log p(target) / d z = one_hot(target) - p
    return log_probs.exp_().mul_(-upstream).scatter_add_(-1, targets[block].unsqueeze(-1), upstream)


class _ChunkedSoftmaxStatistic(torch.autograd.Function):
    """Per-token log p(target) or entropy, forward and backward one block of tokens at a time. Plain autograd
    through a loop of chunks would keep every chunk's float32 softmax for the backward pass (a second full
    (T, V) tensor); this keeps only the logits and recomputes each block's softmax in the backward pass."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_size):
        logits3 = logits.reshape(-1, *logits.shape[-2:])  # (B, T, V), a view when only T was sliced
        targets2 = None if targets is None else targets.reshape(logits3.shape[:2])  # (B, T)
        out = logits.new_empty(logits.shape[:-1], dtype=torch.float32)  # (..., T), not a view: in-place edits work
        out2 = out.view(logits3.shape[:2])  # (B, T)
        for block in _token_blocks(*logits3.shape, chunk_size):
            out2[block] = _block_statistic(logits3, targets2, block, temperature)
        ctx.save_for_backward(logits, targets2, out if targets is None else None)  # entropy's gradient needs it
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, targets2, entropy = ctx.saved_tensors
        logits3 = logits.reshape(-1, *logits.shape[-2:])  # (B, T, V)
        grad_out = grad_out.reshape(logits3.shape[:2])  # (B, T)
        entropy = None if entropy is None else entropy.reshape(logits3.shape[:2])  # (B, T)
        grad = torch.empty(logits3.shape, dtype=logits.dtype, device=logits.device)  # (B, T, V)
        for block in _token_blocks(*logits3.shape, ctx.chunk_size):
            grad[block] = _block_gradient(logits3, targets2, entropy, grad_out, block, ctx.temperature)
        return grad.reshape(logits.shape), None, None, None


def token_logprobs(logits, targets, temperature=1.0, chunk_size=None):
    """log p(target) under softmax(logits / temperature), in float32, computed in chunks of tokens.

    logits (..., T, V) of any float dtype, targets (..., T) integer ids -> (..., T) float32. Each chunk of
    chunk_size tokens (default: about 128 MB of float32) is upcast and normalised on its own, so the peak extra
    memory is O(chunk_size x V) in the forward and the backward pass, never a second full (T, V) tensor.
    Equal to torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None])[..., 0].

    >>> logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # (T=2, V=3)
    >>> token_logprobs(logits, torch.tensor([0, 2]))
    tensor([-0.4076, -1.0986])
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return _ChunkedSoftmaxStatistic.apply(logits, targets.long(), float(temperature), chunk_size)


def entropy_from_logits(logits, temperature=1.0, chunk_size=None):
    """Entropy of softmax(logits / temperature) per token, in float32, chunked like token_logprobs.

    logits (..., T, V) -> (..., T). Differentiable (for an entropy bonus) with the same O(chunk_size x V) memory.
    Logits must be finite: a -inf logit gives 0 * -inf = NaN here, as in the textbook formula.

    >>> entropy_from_logits(torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))  # the second is log 3
    tensor([0.8324, 1.0986])
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return _ChunkedSoftmaxStatistic.apply(logits, None, float(temperature), chunk_size)


def aggregate(values, mask, mode="token-mean"):
    """Masked mean of per-token values -> scalar. values, mask (..., T); each row of the last axis is a sequence.

    token-mean:          sum over valid tokens / number of valid tokens (every token weighs the same);
    seq-mean-token-mean: mean over rows of each row's token mean (every sequence weighs the same);
    seq-mean-token-sum:  mean over rows of each row's token sum.
    Rows without a valid token are left out; with no valid token at all the result is 0, not NaN.

    >>> values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    >>> mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    >>> [aggregate(values, mask, m).item() for m in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")]
    [2.5, 3.0, 5.0]
    """
    valid = mask.bool()
    values = torch.where(valid, values, 0.0)
    if mode == "token-mean":
        return values.sum() / valid.sum().clamp(min=1)
    tokens = valid.sum(-1)  # (...)
    per_row = values.sum(-1)  # (...)
    if mode == "seq-mean-token-mean":
        per_row = per_row / tokens.clamp(min=1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown aggregation {mode!r}")
    has_tokens = tokens > 0  # (...)
    return torch.where(has_tokens, per_row, 0.0).sum() / has_tokens.sum().clamp(min=1)


def grpo_advantages(scores, group_ids, norm_std=True, eps=1e-6):
    """Group-relative outcome advantage: (score - group mean) / (group std + eps), std unbiased like verl and TRL.

    scores (N,) floats, group_ids (N,) integers (the G rollouts of one task share an id) -> (N,) float32.
    A group of one gets 0 (nothing to compare with; verl would give it its raw score), and so does a group of
    equal scores (0 / (0 + eps)). norm_std=False returns score - group mean (Dr. GRPO).

    >>> grpo_advantages(torch.tensor([1.0, 3.0, 5.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 2, 2]))
    tensor([-0.7071,  0.7071,  0.0000,  0.0000,  0.0000])
    """
    scores = torch.as_tensor(scores, dtype=torch.float32)
    _, group = torch.unique(torch.as_tensor(group_ids, device=scores.device), return_inverse=True)  # (N,)
    groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.bincount(group, minlength=groups).float()  # (groups,)
    mean = scores.new_zeros(groups).index_add_(0, group, scores) / count.clamp(min=1)  # (groups,)
    centered = scores - mean[group]  # (N,)
    if not norm_std:
        return centered
    variance = scores.new_zeros(groups).index_add_(0, group, centered ** 2) / (count - 1).clamp(min=1)
    return centered / (variance.sqrt()[group] + eps)


def seed_delta(teacher_logp, old_logp, mask):
    """SEED's token signal delta_t = (log pi_old(y_t | h^) - log pi_old(y_t | h)) * mask_t, detached.

    teacher_logp, old_logp, mask (..., T) -> (..., T). Exactly 0 off the mask even where an input is -inf or
    NaN there. To give a row no signal (its analysis did not parse), pass teacher_logp = old_logp on it.

    >>> seed_delta(torch.tensor([-1.0, -0.5, float("nan")]), torch.tensor([-1.5, -0.5, -float("inf")]),
    ...            torch.tensor([1, 1, 0]))
    tensor([0.5000, 0.0000, 0.0000])
    """
    return torch.where(mask.bool(), teacher_logp.detach().float() - old_logp.detach().float(), 0.0)


def seed_loss(logp, old_logp, advantages, mask, *, teacher_logp=None, ref_logp=None, entropy=None,
              distill_coef=1e-3, distill_mode="advantage", gate_beta=5.0, kl_coef=0.0, entropy_coef=0.0,
              clip_low=0.2, clip_high=0.2, dual_clip=3.0, agg="token-mean", teacher_mask=None):
    """PPO-clip on (SEED-shaped) advantages + optional distillation, k3 KL and entropy terms -> (loss, metrics).

    logp (..., T) log pi_theta(y_t | h) with gradient; old_logp, teacher_logp (under h^), ref_logp, entropy and
    mask share its shape; advantages (..., T) per token or (...) / (..., 1) per row. Only logp and entropy
    carry gradient. teacher_mask (default: mask) marks the tokens that have a teacher: a row whose analysis
    did not parse gets 0 there, so no distillation term of any mode touches it (the gated term would
    otherwise push its tokens up with gate 0.5). distill_mode (no effect when teacher_logp is None or
    distill_coef is 0):
      "advantage": A_t + distill_coef * delta_t inside PPO (SEED, OPID);
      "loss":      auxiliary -distill_coef * delta_t * logp_t (OPID's option);
      "gated":     distill_coef * g_t * (teacher_logp_t - logp_t), g_t = sigmoid(gate_beta * delta_t) (SDAR).
    PPO: ratio = exp(clamp(logp - old_logp, -20, 20)), surrogate clipped to [1 - clip_low, 1 + clip_high]; for
    negative advantages the loss is capped at -A * dual_clip (None: no cap). KL: k3 with x = clamp(ref - logp,
    -20, 20), clamp(exp(x) - x - 1, -10, 10), weighted by kl_coef. The entropy bonus subtracts entropy_coef x
    entropy. All terms use the aggregation agg. metrics are Python floats (token means; 0 when not applicable).

    >>> logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    >>> mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    >>> loss, metrics = seed_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), mask,
    ...                           teacher_logp=logp.detach() + 1.0)  # the skill makes every token likelier
    >>> loss.backward()  # ratio 1: gradient -(A + 1e-3 * delta) / 3 tokens
    >>> round(loss.item(), 4), metrics["delta_mean"], logp.grad
    (-0.3343, 1.0, tensor([[-0.3337, -0.3337,  0.0000],
            [ 0.3330,  0.0000,  0.0000]]))
    """
    if distill_mode not in ("advantage", "loss", "gated"):
        raise ValueError(f"unknown distill_mode {distill_mode!r}")
    if (kl_coef and ref_logp is None) or (entropy_coef and entropy is None):
        raise ValueError("kl_coef needs ref_logp and entropy_coef needs entropy")
    valid = mask.bool()

    def clean(x):  # float32, and 0 wherever the mask is 0 (whatever garbage was there)
        return torch.where(valid, x.float(), 0.0)

    logp, old_logp = clean(logp), clean(old_logp.detach())
    advantages = advantages.detach()
    if advantages.shape == mask.shape[:-1]:
        advantages = advantages.unsqueeze(-1)  # one advantage per row
    advantages = clean(advantages)  # (..., T)
    taught = valid if teacher_mask is None else valid & teacher_mask.bool()  # tokens with a teacher
    delta = seed_delta(teacher_logp, old_logp, taught) if teacher_logp is not None else torch.zeros_like(logp)
    distill = teacher_logp is not None and distill_coef != 0
    if distill and distill_mode == "advantage":
        advantages = advantages + distill_coef * delta

    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)  # (..., T)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg_losses = torch.maximum(unclipped, clipped)  # pessimistic side of the trust region
    clipped_upper = clipped > unclipped
    clipped_lower = torch.zeros_like(valid)
    if dual_clip is not None:  # a negative advantage with a huge ratio cannot blow the loss up
        cap = -advantages * dual_clip
        clipped_lower = (advantages < 0) & (pg_losses > cap)
        pg_losses = torch.where(clipped_lower, cap, pg_losses)
    pg_loss = aggregate(pg_losses, mask, agg)
    loss = pg_loss

    distill_loss = torch.zeros_like(pg_loss)
    if distill and distill_mode == "loss":
        distill_loss = aggregate(-distill_coef * delta * logp, mask, agg)
    elif distill and distill_mode == "gated":
        gate = torch.where(taught, torch.sigmoid(gate_beta * delta), 0.0)  # endorsed up, rejected only softened
        distill_loss = aggregate(distill_coef * gate * (clean(teacher_logp.detach()) - logp), mask, agg)
    if distill and distill_mode != "advantage":
        loss = loss + distill_loss

    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        x = torch.clamp(clean(ref_logp.detach()) - logp, -20.0, 20.0)
        kl = torch.clamp(torch.exp(x) - x - 1.0, -10.0, 10.0)  # (..., T)
        if kl_coef:
            loss = loss + kl_coef * aggregate(kl, mask, agg)
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * aggregate(clean(entropy), mask, agg)

    with torch.no_grad():
        mean = lambda x: aggregate(x.float(), mask)
        values = {"loss": loss, "pg_loss": pg_loss, "distill_loss": distill_loss, "pg_clipfrac": mean(clipped_upper),
                  "pg_clipfrac_lower": mean(clipped_lower), "ppo_kl": mean(-log_ratio), "kl": mean(kl),
                  "entropy": mean(entropy) if entropy is not None else torch.zeros_like(pg_loss),
                  "adv_mean": mean(advantages), "delta_mean": mean(delta), "delta_abs_mean": mean(delta.abs()),
                  "delta_pos_share": mean(delta > 0),
                  "teacher_token_share": mean(taught) if teacher_logp is not None else torch.zeros_like(pg_loss)}
        metrics = dict(zip(values, torch.stack([v.detach().float() for v in values.values()]).tolist()))
    return loss, metrics
