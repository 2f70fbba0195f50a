"""
experiments/recall_probe.py: can the tiny language model learn in-context recall, and how fast?

    python experiments/recall_probe.py                         # the tiny default's sizes and initialisation
    python experiments/recall_probe.py --init-std 0.08         # the same model, weights drawn 4x wider
    python experiments/recall_probe.py --queries one           # one query per sequence instead of every key

Both embedded demos ask the tiny model for one hop of recall: the vision env's "click the red circle" is "find
the item the instruction names and copy its cell number" (docs/vision.md), and choosing a command from the
prompt's admissible list is a copy too. This probe isolates that hop from tokenizers, pixels and prompts:
a fresh Qwen2 with models/tiny.py's sizes reads `--pairs` (value, key) pairs of single tokens, value first as in
"cell 13 yellow circle", then the keys again in random order, each followed by its value. The loss is on the
queried values (all of them, or only the first with --queries one); the score is the first query's accuracy on
512 held-out sequences. A model that has learned only which values are still unanswered scores about 1/pairs on
the first query; recall scores near 1. Every batch is fresh (no example repeats), so memorising cannot help.
Not in the paper. Numbers move with the seed and the thread count: read the step at which a run leaves the
plateau as rough.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from models.tiny import TINY_SIZES  # noqa: E402

KEYS, VALUES = 24, 16  # token ids: 0 the filler word, 1..KEYS keys, then VALUES values
WORD_CHOICES = 6  # a multi-token key draws each word from its own 6 ids, as "yellow cross" draws a colour and a shape


def recall_batch(count, pairs, generator, key_tokens=1, filler=0):
    """(count, 2 * pairs * (filler + key_tokens + 1)) token ids: for each pair `filler` filler tokens, the value and
    its key, then for each key in a random order `filler` fillers, the key and its value. Keys within a sequence
    are distinct; values may repeat. One-token keys come from KEYS ids; a key of K tokens is K words, word j
    from its own WORD_CHOICES ids (so two keys may share a word, as "red cross" and "yellow cross" do)."""
    if key_tokens == 1:
        keys = torch.stack([torch.randperm(KEYS, generator=generator)[:pairs] for _ in range(count)])[..., None]
    else:  # distinct K-word keys: distinct indices into the WORD_CHOICES ** K combinations, written in base 6
        combos = torch.stack([torch.randperm(WORD_CHOICES ** key_tokens, generator=generator)[:pairs]
                              for _ in range(count)])                                                # (N, P)
        digits = [(combos // WORD_CHOICES ** j) % WORD_CHOICES + j * WORD_CHOICES for j in range(key_tokens)]
        keys = torch.stack(digits, -1)                                                                 # (N, P, K)
    keys = keys + 1                                                                                    # (N, P, K)
    values = torch.randint(0, VALUES, (count, pairs, 1), generator=generator) + 1 + KEYS              # (N, P, 1)
    fillers = torch.zeros(count, pairs, filler, dtype=torch.long)                                      # (N, P, F)
    order = torch.stack([torch.randperm(pairs, generator=generator) for _ in range(count)])           # (N, P)
    written = torch.cat([fillers, values, keys], -1).reshape(count, -1)                               # (N, P*L)
    reorder = lambda t: t.gather(1, order[..., None].expand(-1, -1, t.shape[-1]))  # noqa: E731
    asked = torch.cat([fillers, reorder(keys), reorder(values)], -1).reshape(count, -1)               # (N, P*L)
    return torch.cat([written, asked], 1)                                                             # (N, 2*P*L)


def mimetic_init(model, query_key=(0.7, 0.7), value_output=(0.4, 0.4), seed_value=0):
    """Mimetic initialisation (Trockman and Kolter, 2023): in every attention head set W_Q W_K^T to
    a Z + b I and W_V W_O to a Z - b I (Z ~ N(0, 1/d), (a, b) = query_key / value_output), each factor taken from the
    truncated SVD, so that from step 0 a token attends to tokens that look like it: the match half of recall is
    there before training. Heads that share a key/value head (grouped-query attention) share its factors."""
    config = model.config
    width, heads, groups = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = width // heads
    generator = torch.Generator().manual_seed(seed_value)

    def factors(scale, identity):  # (d, k), (k, d) with left @ right ~ scale Z + identity I
        target = scale * torch.randn(width, width, generator=generator) / width ** 0.5 + identity * torch.eye(width)
        u, s, vh = torch.linalg.svd(target)
        return u[:, :head_dim] * s[:head_dim].sqrt(), s[:head_dim].sqrt()[:, None] * vh[:head_dim]

    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            for group in range(groups):
                rows = slice(group * head_dim, (group + 1) * head_dim)
                query, key = factors(*query_key)                                       # (d, k), (k, d)
                attention.k_proj.weight[rows] = key                                    # x -> W_K^T x
                value_out, value_in = factors(value_output[0], -value_output[1])
                attention.v_proj.weight[rows] = value_in                               # x -> W_V x
                for head in range(group * heads // groups, (group + 1) * heads // groups):
                    head_rows = slice(head * head_dim, (head + 1) * head_dim)
                    attention.q_proj.weight[head_rows] = query.T                       # x -> W_Q^T x
                    attention.o_proj.weight[:, head_rows] = value_out / (heads // groups)
    return model


def recall_optimizer(model, lr=1e-3):
    """The warm-up's optimizer for screenshots (warmup.warm_start.warmup_optimizer), at a constant rate."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))


def run_recall_probe(steps=2000, pairs=4, queries="all", init_std=0.02, lr=1e-3, batch_size=32, seed_value=0,
                     eval_every=250, log=print, key_tokens=1, filler=0, plain_steps=0, model=None, vocabulary=None,
                     mimetic=False):
    """Train a fresh tiny Qwen2 on recall, the first `plain_steps` steps without filler (a curriculum);
    returns [(step, first-query accuracy)] on 512 held-out sequences with the filler.
    model, vocabulary: train this causal LM instead (a warm-up stage), the probe's token i written as its token
    vocabulary[i] (a LongTensor of 1 + KEYS + VALUES ids)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def answer_positions(filler):  # where the queried values sit
        item = filler + key_tokens + 1  # tokens per written pair and per query
        return torch.arange(pairs * item + item - 1, 2 * pairs * item, item)[:1 if queries == "one" else None]

    torch.manual_seed(seed_value)
    if model is None:
        longest = 2 * pairs * (filler + key_tokens + 1)
        config = Qwen2Config(vocab_size=1 + KEYS + VALUES, max_position_embeddings=longest, tie_word_embeddings=True,
                             initializer_range=init_std, **TINY_SIZES)
        model = Qwen2ForCausalLM(config)
        if mimetic:
            mimetic_init(model, seed_value=seed_value)
    vocabulary = torch.arange(1 + KEYS + VALUES) if vocabulary is None else vocabulary  # (1 + KEYS + VALUES,)
    optimizer = recall_optimizer(model, lr)
    generator = torch.Generator().manual_seed(seed_value)
    held_out = vocabulary[recall_batch(512, pairs, torch.Generator().manual_seed(10 ** 6), key_tokens, filler)]
    results, start = [], time.time()
    for step in range(1, steps + 1):
        step_filler = 0 if step <= plain_steps else filler
        tokens = vocabulary[recall_batch(batch_size, pairs, generator, key_tokens, step_filler)]  # (B, 2PL)
        answers = answer_positions(step_filler)                                           # (Q,)
        logits = model(tokens[:, :-1]).logits[:, answers - 1]                           # (B, Q, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, answers].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % eval_every == 0 or step == steps:
            with torch.no_grad():
                first = answer_positions(filler)[0].item()
                guess = model(held_out[:, :first]).logits[:, -1].argmax(-1)              # (512,)
                accuracy = (guess == held_out[:, first]).float().mean().item()
            results.append((step, accuracy))
            log(f"recall step {step} | loss {loss.item():.3f} | first-query accuracy {accuracy:.3f} | "
                f"{time.time() - start:.0f}s")
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000, help="training steps (fresh batches)")
    p.add_argument("--pairs", type=int, default=4, help="(value, key) pairs per sequence")
    p.add_argument("--queries", default="all", choices=["all", "one"], help="loss on every query or the first")
    p.add_argument("--init-std", type=float, default=0.02,
                   help="std of the initial weights (Qwen2's initializer_range; the tiny default's is 0.02)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    p.add_argument("--eval-every", type=int, default=250, help="evaluate every K steps")
    p.add_argument("--key-tokens", type=int, default=1, choices=[1, 2, 3, 4],
                   help="tokens per key (2: a colour word and a shape word, each from its own 6)")
    p.add_argument("--filler", type=int, default=0, help="filler tokens before each pair and each query")
    p.add_argument("--plain-steps", type=int, default=0, help="the first K steps without the filler (a curriculum)")
    p.add_argument("--mimetic", action="store_true", help="mimetic attention initialisation (mimetic_init)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (docs/vision.md's figures: 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    run_recall_probe(args.steps, args.pairs, args.queries, args.init_std, args.lr, args.batch_size, args.seed,
                     args.eval_every, key_tokens=args.key_tokens, filler=args.filler,
                     plain_steps=args.plain_steps, mimetic=args.mimetic)
