"""loss.py: the SEED loss -- PPO-clip on GRPO advantages plus a dense, self-distilled token signal.

Sampled tokens are re-scored under a teacher context h^ (the prompt plus a skill the policy wrote
about its episode) and the ordinary h: delta_t = log pi_old(y_t | h^) - log pi_old(y_t | h). Pure
functions, no import but torch: paste this file into verl or TRL. The default is the paper's
objective per a third party's reading (REFERENCE 1b; no author code is public), a gated OPD loss
beside GRPO, 0.01 * mean(g * (logp_teacher - logp)), g = sigmoid(5 delta); OPID's A_t = A_grpo +
1e-3 delta_t is distill_mode="advantage". mask is 1 exactly on sampled tokens; off it is removed.
"""
import torch


def aggregate(values, mask, mode="token-mean"):
    """Masked mean of per-token values -> scalar. values, mask (..., T); each row is a sequence.
    token-mean:          sum over valid tokens / their number (every token weighs the same);
    seq-mean-token-mean: mean over rows of each row's token mean (every sequence weighs the same);
    seq-mean-token-sum:  mean over rows of each row's token sum. Rows without a valid token are
    left out; with no valid token at all the result is 0, not NaN.
    >>> values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    >>> mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    >>> [aggregate(values, mask, m).item() for m in ("token-mean", "seq-mean-token-mean")]
    [2.5, 3.0]
    """
    valid = mask.bool()
    values = torch.where(valid, values, 0.0)  # whatever sat off the mask, NaN included, is gone
    if mode == "token-mean":
        return values.sum() / valid.sum().clamp(min=1)
    tokens, per_row = valid.sum(-1), values.sum(-1)  # (...), (...)
    if mode == "seq-mean-token-mean":
        per_row = per_row / tokens.clamp(min=1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown aggregation {mode!r}")
    return torch.where(tokens > 0, per_row, 0.0).sum() / (tokens > 0).sum().clamp(min=1)


def grpo_advantages(scores, group_ids, norm_std=True, eps=1e-6):
    """(score - group mean) / (group std + eps), the std unbiased like verl's and TRL's:
    scores (N,) floats, group_ids (N,) integers (a task's G rollouts share one) -> (N,) float32. A
    group of one gets 0 (verl would give it its raw score), and so does a group of equal scores.
    norm_std=False returns score - group mean (Dr. GRPO).
    >>> grpo_advantages(torch.tensor([1.0, 3.0, 5.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 2, 2]))
    tensor([-0.7071,  0.7071,  0.0000,  0.0000,  0.0000])
    """
    scores = torch.as_tensor(scores, dtype=torch.float32)
    group = torch.unique(torch.as_tensor(group_ids), return_inverse=True)[1].to(scores.device)
    groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.bincount(group, minlength=groups).float()  # (groups,)
    mean = scores.new_zeros(groups).index_add_(0, group, scores) / count.clamp(min=1)  # (groups,)
    centered = scores - mean[group]  # (N,)
    if not norm_std:
        return centered
    squares = scores.new_zeros(groups).index_add_(0, group, centered ** 2)  # (groups,)
    return centered / ((squares / (count - 1).clamp(min=1)).sqrt()[group] + eps)


def seed_delta(teacher_logp, old_logp, mask):
    """delta_t = (log pi_old(y_t | h^) - log pi_old(y_t | h)) * mask_t, detached: (..., T) each.
    Exactly 0 off the mask even where an input is -inf or NaN. No signal on a row: teacher = old.
    >>> teacher, old = torch.tensor([-1.0, -0.5, float("nan")]), torch.tensor([-1.5, -0.5, -1e9])
    >>> seed_delta(teacher, old, torch.tensor([1, 1, 0]))
    tensor([0.5000, 0.0000, 0.0000])
    """
    return torch.where(mask.bool(), teacher_logp.detach().float() - old_logp.detach().float(), 0.0)


def seed_loss(logp, old_logp, advantages, mask, *, teacher_logp=None, ref_logp=None, entropy=None,
              distill_coef=0.01, distill_mode="gated", gate_beta=5.0, kl_coef=0.0,
              entropy_coef=0.0, clip_low=0.2, clip_high=0.2, dual_clip=3.0, agg="token-mean",
              teacher_mask=None, token_weights=None):
    """PPO-clip on SEED-shaped advantages + distillation, k3 KL, entropy -> (loss, metrics).
    logp (..., T) log pi_theta(y_t | h) with gradient (and entropy); old_logp, teacher_logp (under
    h^), ref_logp and mask share its shape; advantages per token (..., T) or row (...) / (..., 1).
    teacher_mask (default mask): 0 on rows whose analysis did not parse; token_weights multiply
    the per-token policy loss (verl's rollout importance weights). distill_mode "gated": the paper's
    OPD loss distill_coef * g_t * (teacher_logp_t - logp_t), g_t = sigmoid(gate_beta delta_t);
    "advantage": A_t + distill_coef * delta_t (OPID); "loss": -distill_coef * delta_t * logp_t.
    PPO: ratio exp(logp - old_logp) clipped to [1 - clip_low, 1 + clip_high], a negative advantage's
    loss capped at -A * dual_clip (None: no cap); KL: k3 of ref - logp. metrics: Python floats.
    >>> logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    >>> mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    >>> loss, metrics = seed_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), mask,
    ...                           teacher_logp=logp.detach() + 1.0)  # every token likelier
    >>> loss.backward()  # ratio 1: gradient -(A + 0.01 * sigmoid(5 * delta)) / 3 tokens
    >>> round(loss.item(), 4), metrics["delta_mean"], logp.grad
    (-0.3234, 1.0, tensor([[-0.3366, -0.3366,  0.0000],
            [ 0.3300,  0.0000,  0.0000]]))
    """
    if distill_mode not in ("advantage", "loss", "gated"):
        raise ValueError(f"unknown distill_mode {distill_mode!r}")
    if (kl_coef and ref_logp is None) or (entropy_coef and entropy is None):
        raise ValueError("kl_coef needs ref_logp and entropy_coef needs entropy")
    if not (0 <= clip_low < 1 and clip_high >= 0 and (dual_clip is None or dual_clip > 1)):
        raise ValueError("need 0 <= clip_low < 1, clip_high >= 0 and dual_clip > 1 (or None), got "
                         f"{clip_low}, {clip_high}, {dual_clip}")
    valid = mask.bool()
    clean = lambda x: torch.where(valid, x.float(), 0.0)  # float32, 0 wherever the mask is 0
    logp, old_logp = clean(logp), clean(old_logp.detach())
    per_row = advantages.shape == mask.shape[:-1]
    advantages = clean(advantages.detach().unsqueeze(-1) if per_row else advantages.detach())
    taught = valid if teacher_mask is None else valid & teacher_mask.bool()  # tokens with a teacher
    distill = teacher_logp is not None and distill_coef != 0
    delta = torch.zeros_like(logp) if teacher_logp is None else seed_delta(teacher_logp, old_logp,
                                                                           taught)  # (..., T)
    if distill and distill_mode == "advantage":
        advantages = advantages + distill_coef * delta  # SEED: A_t = A_grpo + lambda * delta_t
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)  # (..., T)
    unclipped = -advantages * torch.exp(log_ratio)
    clipped = -advantages * torch.clamp(torch.exp(log_ratio), 1.0 - clip_low, 1.0 + clip_high)
    pg_losses = torch.maximum(unclipped, clipped)  # the pessimistic side of the trust region
    clipped_upper, clipped_lower = clipped > unclipped, torch.zeros_like(valid)
    if dual_clip is not None:  # a negative advantage with a huge ratio cannot blow the loss up
        cap = -advantages * dual_clip
        clipped_lower = (advantages < 0) & (pg_losses > cap)
        pg_losses = torch.where(clipped_lower, cap, pg_losses)
    if token_weights is not None:
        pg_losses = pg_losses * clean(token_weights.detach())
    loss = pg_loss = aggregate(pg_losses, mask, agg)
    distill_loss = torch.zeros_like(pg_loss)
    if distill and distill_mode == "loss":
        distill_loss = aggregate(-distill_coef * delta * logp, mask, agg)
    elif distill and distill_mode == "gated":  # endorsed tokens pushed up, rejected ones softened
        gate = torch.where(taught, torch.sigmoid(gate_beta * delta), 0.0)
        gap = clean(teacher_logp.detach()) - logp  # (..., T)
        distill_loss = aggregate(distill_coef * gate * gap, mask, agg)
    loss = loss + distill_loss  # 0 in the advantage mode
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        x = torch.clamp(clean(ref_logp.detach()) - logp, -20.0, 20.0)
        kl = torch.clamp(torch.exp(x) - x - 1.0, -10.0, 10.0)  # (..., T)
        loss = loss + kl_coef * aggregate(kl, mask, agg) if kl_coef else loss
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * aggregate(clean(entropy), mask, agg)
    with torch.no_grad():
        mean, zero = lambda x: aggregate(x.float(), mask), torch.zeros_like(pg_loss)
        values = dict(loss=loss, pg_loss=pg_loss, distill_loss=distill_loss,
                      pg_clipfrac=mean(clipped_upper), pg_clipfrac_lower=mean(clipped_lower),
                      ppo_kl=mean(-log_ratio), kl=mean(kl), adv_mean=mean(advantages),
                      entropy=zero if entropy is None else mean(entropy), delta_mean=mean(delta),
                      delta_abs_mean=mean(delta.abs()), delta_pos_share=mean(delta > 0),
                      teacher_token_share=zero if teacher_logp is None else mean(taught))
        stacked = torch.stack([v.detach().float() for v in values.values()])  # one device sync
    return loss, dict(zip(values, stacked.tolist()))


# -------------------------------------------------------------------- memory: chunked log-probs
# (T, V) float32 logits at a 152k vocabulary are 5 GB for 8k tokens: compute block by block.
_CHUNK_ELEMENTS = 2 ** 25  # float32 logits per chunk (128 MB): 220 tokens at a 152k vocabulary


def token_logprobs(logits, targets, temperature=1.0, chunk_size=None):
    """log p(target) under softmax(logits / temperature): (..., T, V) any float, (..., T) ids ->
    (..., T) float32, a negative target (Hugging Face's -100) 0 without gradient. Each chunk of
    chunk_size tokens (default ~128 MB of float32) is upcast alone: O(chunk_size x V) extra memory.
    >>> token_logprobs(torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), torch.tensor([0, 2]))
    tensor([-0.4076, -1.0986])
    """
    logp = _ChunkedStatistic.apply(logits, targets.clamp(min=0).long(), temperature, chunk_size)
    return torch.where(targets < 0, 0.0, logp)


def entropy_from_logits(logits, temperature=1.0, chunk_size=None):
    """Entropy of softmax(logits / temperature) per token, chunked like token_logprobs and
    differentiable (the entropy bonus); a -inf logit gives NaN, as the formula does.
    >>> entropy_from_logits(torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))  # log 3 = 1.0986
    tensor([0.8324, 1.0986])
    """
    return _ChunkedStatistic.apply(logits, None, temperature, chunk_size)


def _blocks(logits, chunk_size, temperature):
    """(block, its float32 log_softmax) over (B, T, V) logits, <= chunk_size tokens a block."""
    rows, length, vocab = logits.shape
    chunk_size = max(1, _CHUNK_ELEMENTS // vocab) if chunk_size is None else chunk_size
    rows_per_block = max(1, chunk_size // max(length, 1))  # several short rows, or part of one
    tokens_per_block = max(1, min(length, chunk_size))
    for row in range(0, rows, rows_per_block):
        for token in range(0, length, tokens_per_block):
            block = slice(row, row + rows_per_block), slice(token, token + tokens_per_block)
            scaled = logits[block].float()  # (b, t, V); no copy of float32 logits at temperature 1
            yield block, torch.log_softmax(scaled if temperature == 1 else scaled / temperature, -1)


class _ChunkedStatistic(torch.autograd.Function):
    """Per-token log p(target), or the entropy when targets is None, block by block: backward keeps
    only the logits and recomputes each block's softmax (no second (T, V) tensor)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_size):
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        rows = int(torch.tensor(logits.shape[:-2]).prod())  # not -1: an empty T axis is allowed
        logits3 = logits.reshape(rows, *logits.shape[-2:])  # (B, T, V), a view if only T was sliced
        targets2 = None if targets is None else targets.reshape(logits3.shape[:2])  # (B, T)
        out = logits.new_empty(logits.shape[:-1], dtype=torch.float32)  # (..., T), not a view
        out2 = out.view(logits3.shape[:2])  # (B, T)
        for block, log_probs in _blocks(logits3, chunk_size, temperature):
            out2[block] = -(log_probs.exp() * log_probs).sum(-1) if targets is None else \
                log_probs.gather(-1, targets2[block].unsqueeze(-1)).squeeze(-1)
            del log_probs  # freed before the next block's: one block's softmax alive at a time
        ctx.save_for_backward(logits, targets2, out if targets is None else None)
        ctx.temperature, ctx.chunk_size, ctx.rows = temperature, chunk_size, rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, targets2, entropy = ctx.saved_tensors
        logits3 = logits.reshape(ctx.rows, *logits.shape[-2:])  # (B, T, V)
        grad_out = grad_out.reshape(logits3.shape[:2])  # (B, T)
        grad = torch.empty(logits3.shape, dtype=logits.dtype, device=logits.device)  # (B, T, V)
        for block, log_probs in _blocks(logits3, ctx.chunk_size, ctx.temperature):
            upstream = grad_out[block].unsqueeze(-1) / ctx.temperature  # (b, t, 1); z = logits / T
            if targets2 is None:  # d entropy / d z = -p * (log p + entropy)
                probs = log_probs.exp()
                log_probs.add_(entropy.reshape(logits3.shape[:2])[block].unsqueeze(-1))
                grad[block] = log_probs.mul_(probs).mul_(-upstream)
            else:  # d log p(target) / d z = one_hot(target) - p
                target = targets2[block].unsqueeze(-1)
                grad[block] = log_probs.exp_().mul_(-upstream).scatter_add_(-1, target, upstream)
            del log_probs  # as in forward
        return grad.reshape(logits.shape), None, None, None
