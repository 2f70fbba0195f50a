"""models/scoring.py: per-token log-probs of given response tokens under given prompts -- the
forward passes behind sampling, re-scoring and the update, in a padded or a packed layout, in
micro-batches.

Layout convention (the whole repository's): every per-token tensor is response-aligned, (B, R) with
R the longest response of the batch, and the mask is 1 exactly on the response tokens. padded:
prompts left-padded, responses right-padded, position_ids = cumsum(mask) - 1, the LM head only on
the last R + 1 positions. packed: every row in one sequence (models/packing.py). Both give the same
log-probs (a test proves it). Scores are recomputed at the sampling temperature. No departure from
the paper.
"""
import contextlib

import torch
from tqdm.auto import tqdm

import loss as L
from models import vision


def left_pad(sequences, pad_id, device):
    """list of id lists -> ids (B, P), attention mask (B, P), position ids (B, P), left-padded."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        attention[row, width - len(seq):] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), attention.to(device), positions.to(device)


def response_mask(responses, device="cpu"):
    """(B, R) float mask, 1 on the first len(response) positions: the tokens the sampler emitted."""
    width = max([1] + [len(r) for r in responses])
    lengths = torch.tensor([len(r) for r in responses], device=device, dtype=torch.long)
    return (torch.arange(width, device=device)[None, :] < lengths[:, None]).float()


def padded_logprobs(logp_lists):
    """Per-token log-prob lists, one per row -> (B, R) tensor, zeros past each row's end (the mask's layout)."""
    width = max([1] + [len(row) for row in logp_lists])
    padded = [row + [0.0] * (width - len(row)) for row in logp_lists]
    return torch.tensor(padded, dtype=torch.float32).reshape(-1, width)  # (B, R)


def forward_logits(model, prompts, responses, pad_id, layout="padded"):
    """Logits that predict each response token: (logits (B, R, V), targets (B, R)). padded: prompts
    left-padded, responses right-padded, position_ids = cumsum(mask) - 1, the LM head only on the
    last R + 1 positions. packed: models.packing.packed_logits re-padded to (B, R, V)."""
    from models import packing
    device = next(model.parameters()).device
    width = max(1, max(len(r) for r in responses))
    targets = torch.full((len(responses), width), pad_id, dtype=torch.long)
    for row, response in enumerate(responses):
        targets[row, :len(response)] = torch.tensor(response, dtype=torch.long)
    targets = targets.to(device)                                         # (B, R)
    if layout == "packed":
        flat, _, rows, cols = packing.packed_logits(model, prompts, responses)  # (n, V)
        logits = flat.new_zeros(len(responses), width, flat.shape[-1])  # (B, R, V)
        return logits.index_put((rows, cols), flat), targets
    if layout != "padded":
        raise ValueError(f"layout must be 'padded' or 'packed', got {layout!r}")
    prompt_ids, prompt_attention, _ = left_pad(prompts, pad_id, device)  # (B, P)
    ids = torch.cat([prompt_ids, targets], dim=1)                        # (B, P + R)
    attention = torch.cat([prompt_attention, response_mask(responses, device).long()], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)                  # (B, P + R)
    images = vision.image_inputs(model, prompts, ids, attention)         # {} for text prompts
    positions = images.pop("position_ids", positions)                    # or M-RoPE (3, B, P + R)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False,
                   logits_to_keep=width + 1, **images).logits[:, :-1]    # (B, R, V)
    return logits, targets


def forward_logprobs(model, prompts, responses, pad_id, temperature=1.0, layout="padded",
                     entropy=False):
    """Differentiable per-token log-probs (B, R) at the temperature, and entropies (B, R) when asked
    (else None). The packed layout scores the flat (n, V) logits of the n response tokens, never
    building the mostly-padding (B, R, V) tensor."""
    if layout == "packed":
        from models import packing
        flat, targets, rows, cols = packing.packed_logits(model, prompts, responses)  # (n, V), (n,)
        width = max(1, max(map(len, responses)))
        place = lambda x: x.new_zeros(len(responses), width).index_put((rows, cols), x)  # (B, R)
        logp = place(L.token_logprobs(flat, targets, temperature))
        return logp, place(L.entropy_from_logits(flat, temperature)) if entropy else None
    logits, targets = forward_logits(model, prompts, responses, pad_id, layout)  # (B, R, V)
    logp = L.token_logprobs(logits, targets, temperature)               # (B, R)
    return logp, L.entropy_from_logits(logits, temperature) if entropy else None


def micro_batches(prompts, responses, max_batch_tokens):
    """Lists of row indices, rows of similar length together, each about max_batch_tokens tokens
    when padded (always at least one row)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(responses[i]))
    batches, current, width = [], [], 0
    for i in order:
        length = len(prompts[i]) + len(responses[i])
        if current and max(width, length) * (len(current) + 1) > max_batch_tokens:
            batches.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, length)
    return batches + ([current] if current else [])


def response_logprobs(model, prompts, responses, pad_id, temperature=1.0, layout="padded",
                      max_batch_tokens=16384, desc=None):
    """Log-probs (B, R) of given response tokens under given prompts, no gradient, in micro-batches
    of about max_batch_tokens tokens. Row i lines up with responses[i] (0 past its end)."""
    result = torch.zeros(len(responses), max([1] + [len(r) for r in responses]))  # (B, R)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        batches = micro_batches(prompts, responses, max_batch_tokens)
        for batch in tqdm(batches, desc=desc, leave=False, disable=desc is None):
            logp, _ = forward_logprobs(model, [prompts[i] for i in batch],
                                       [responses[i] for i in batch], pad_id, temperature,
                                       layout)  # (b, r)
            result[batch, :logp.shape[1]] = logp.float().cpu()
    model.train(was_training)
    return result * response_mask(responses)


@contextlib.contextmanager
def dropout_free(model):
    """Train mode (gradient checkpointing still works) with every dropout off, so the update's log-probs
    equal the eval-mode ones of sampling and re-scoring: the ratio and delta compare like with like."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.training]
    attention = [(m, m.attention_dropout) for m in model.modules()
                 if isinstance(getattr(m, "attention_dropout", None), float)]  # HF attention layers
    for layer in layers:
        layer.eval()
    for module, _ in attention:
        module.attention_dropout = 0.0
    try:
        yield
    finally:
        for layer in layers:
            layer.train()
        for module, p in attention:
            module.attention_dropout = p
