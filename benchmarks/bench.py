"""
bench.py: speed and memory of the SEED pipeline, measured side by side (in the spirit of nanoGPT's bench.py).

    python benchmarks/bench.py                      # every section, full sizes (about 10 minutes on 2 CPU cores)
    python benchmarks/bench.py --quick              # small sizes, 3 repeats (under a minute)
    python benchmarks/bench.py --only packing memory --threads 2

Sections: (1) re-scoring tokens/s against the same forward pass's matmuls run alone at this machine's rate;
(2) packed vs padded re-scoring on a realistic mix of row lengths; (3) peak extra memory of the chunked
log-probs vs log_softmax + gather (fresh subprocesses, peak RSS); (4) batched rollouts over all live envs vs
one env at a time; (5) one SEED update vs one GRPO update, split by phase; (6) training step tokens/s with
gradient accumulation, gradient checkpointing on/off; (gpu) bf16 generation, re-scoring and a 3B-shaped
update at the paper's batch shapes, only when CUDA is present.

How to read it: a shared machine makes absolute times drift, so every comparison runs its variants
interleaved in one process (A B A B ...) and prints the median time of each and the median of the per-round
ratios. Models are random-weight Qwen2s built from configs (nothing is downloaded); the rollout and update
sections use the tiny policy: the default run's warm-start (cached or shipped) when there is one, else
random weights, whose responses run to the token limit. Analyses that do not parse get a fixed skill, so every
row has a teacher pass (the worst case for SEED). Tests never time anything; tests/test_bench.py runs helpers and a
--quick section as smoke tests.
"""
import argparse
import contextlib
import copy
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types

os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm is imported: the tables are the output
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root holds the teaching files
sys.path.insert(0, REPO)
import torch  # noqa: E402

import loss as L  # noqa: E402
import seed  # noqa: E402
from models.policy import Policy, kv_cache_name, load_policy  # noqa: E402
from models.tiny import TINY_SIZES, build_tiny_policy  # noqa: E402
from simulators.household import PROMPT  # noqa: E402

SHAPES = {  # Qwen2 / Qwen2.5 shapes; the number of layers is chosen per section
    "tiny": dict(vocab_size=2048, **TINY_SIZES),
    "qwen-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                      num_key_value_heads=2, num_hidden_layers=24),
    "qwen-3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
                    num_key_value_heads=2, num_hidden_layers=36),
}
FIXED_SKILL = "Open the fridge 1 first, take the apple, then go to the countertop 1 and put it there."


# ----------------------------------------------------------------------------- measuring

def compare(variants, repeats, warmup=1):
    """Run zero-argument callables interleaved: `warmup` untimed rounds, then `repeats` timed rounds, each
    round every variant once in a rotated order. Returns {name: [seconds per round]}."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    return times


def median_ratio(times, numerator, denominator):
    """Median over rounds of times[numerator][i] / times[denominator][i]."""
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator]))


med = statistics.median


def random_model(kind, layers=None, attn=None, dtype=torch.float32, device="cpu"):
    """A random-weight Qwen2ForCausalLM of a SHAPES entry (SDPA, as load_policy gives every model, unless asked)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    sizes = dict(SHAPES[kind], **({"num_hidden_layers": layers} if layers else {}))
    config = Qwen2Config(**sizes, tie_word_embeddings=True, max_position_embeddings=32768, pad_token_id=0)
    config._attn_implementation = attn or "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # built where it runs: a 3B model is not first made in CPU memory
        model = Qwen2ForCausalLM(config)
    return model.to(dtype).eval()


def bare_policy(model):
    """What sample() and policy_update() read from a Policy, for a model without a tokenizer."""
    return types.SimpleNamespace(model=model, device=next(model.parameters()).device, pad_id=0, stop_ids=[1],
                                 banned_ids=[], cache_name=kv_cache_name(model))


def random_rows(shapes, vocab, seed_value=0):
    """(prompt_len, response_len) pairs -> (prompts, responses) of random ids in [2, vocab)."""
    generator = torch.Generator().manual_seed(seed_value)
    draw = lambda n: torch.randint(2, vocab, (n,), generator=generator).tolist()
    return [draw(p) for p, _ in shapes], [draw(r) for _, r in shapes]


def realistic_mix(n_rows, seed_value=0, long_every=12):
    """Row shapes of one re-scoring batch: step rows whose prompts grow with the history (150-550 tokens) and
    whose responses are mostly short actions (8-24 tokens) with some long reasoning (48-160); every
    long_every-th row a long-history row (1,200-2,000 prompt tokens)."""
    rng = random.Random(seed_value)
    shapes = []
    for i in range(n_rows):
        prompt = rng.randint(1200, 2000) if i % long_every == long_every - 1 else rng.randint(150, 550)
        response = rng.randint(48, 160) if rng.random() < 0.3 else rng.randint(8, 24)
        shapes.append((prompt, response))
    return shapes


def padded_tokens(prompts, responses, max_batch_tokens):
    """Tokens the padded layout pushes through the model: per micro-batch, rows x (longest prompt + longest response)."""
    total = 0
    for rows in seed.micro_batches(prompts, responses, max_batch_tokens):
        total += len(rows) * (max(len(prompts[i]) for i in rows) + max(len(responses[i]) for i in rows))
    return total


def matmul_bound(config, lengths, kept):
    """A callable that runs only the matmuls of one forward pass over rows of the given lengths (projections and
    MLP on every token, q.k and p.v per row, the LM head on `kept` positions), and its FLOP count. No forward
    pass can beat it: it is the same arithmetic at this machine's matmul rate with nothing around it."""
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    n = sum(lengths)
    x, m = torch.randn(n, h), torch.randn(n, inter)
    weights = [torch.randn(h, heads * d), torch.randn(h, kv * d), torch.randn(h, kv * d), torch.randn(heads * d, h),
               torch.randn(h, inter), torch.randn(h, inter)]
    down, head = torch.randn(inter, h), torch.randn(h, vocab)
    qs = [torch.randn(heads, length, d) for length in lengths]
    x_kept = torch.randn(kept, h)

    def run():
        for _ in range(config.num_hidden_layers):
            for w in weights:
                x @ w
            m @ down
            for q in qs:
                torch.bmm(torch.bmm(q, q.transpose(1, 2)), q)
        x_kept @ head

    flops = 2 * config.num_hidden_layers * (n * h * (2 * heads * d + 2 * kv * d + 3 * inter)
                                            + sum(2 * heads * length * length * d for length in lengths))
    return run, flops + 2 * kept * h * vocab


# ----------------------------------------------------------------------------- sections

def section_rescore(args):
    """(1) re-scoring tokens/s (padded, equal rows: no padding) vs the matmuls alone."""
    cases = [("tiny (4 layers, eager)", "tiny", None, 16, 448, 64, "eager"),
             ("tiny (4 layers, SDPA)", "tiny", None, 16, 448, 64, "sdpa"),
             ("qwen-0.5b-shaped, 2 layers", "qwen-0.5b", 2, 4, 448, 64, "sdpa")]
    if args.quick:
        cases = [("tiny (4 layers, eager)", "tiny", None, 4, 192, 32, "eager"),
                 ("qwen-0.5b-shaped, 1 layer", "qwen-0.5b", 1, 2, 192, 32, "sdpa")]
    print("\n## 1. re-scoring throughput vs this machine's matmul rate (same shapes)")
    print(f"{'model':>28} {'tokens':>7} {'fwd tok/s':>10} {'bound tok/s':>11} {'GFLOP/s':>8} {'of bound':>9}")
    results = {}
    for label, kind, layers, n_rows, prompt_len, response_len, attention in cases:
        model = random_model(kind, layers, attention)
        prompts, responses = random_rows([(prompt_len, response_len)] * n_rows, model.config.vocab_size)
        bound, flops = matmul_bound(model.config, [prompt_len + response_len] * n_rows, n_rows * response_len)
        forward = lambda: seed.response_logprobs(model, prompts, responses, 0, max_batch_tokens=1 << 20)
        with torch.no_grad():
            times = compare({"forward": forward, "bound": bound}, args.repeats)
        tokens = n_rows * (prompt_len + response_len)
        share = median_ratio(times, "bound", "forward")
        print(f"{label:>28} {tokens:>7} {tokens / med(times['forward']):>10.0f} {tokens / med(times['bound']):>11.0f} "
              f"{flops / med(times['bound']) / 1e9:>8.1f} {share:>8.0%}")
        results[label] = share
    return results


def section_packing(args):
    """(2) packed vs padded re-scoring on a realistic length mix: equal log-probs, time."""
    long_every = 6 if args.quick else 12
    cases = [("tiny (4 layers)", "tiny", None, 12 if args.quick else 48)]
    if not args.quick:
        cases.append(("qwen-0.5b-shaped, 1 layer", "qwen-0.5b", 1, 24))  # its rows cost ~50x more
    print(f"\n## 2. packed vs padded re-scoring (prompt 150-550 tokens, every {long_every}th 1,200-2,000; response "
          f"8-24, 30% 48-160; 16,384-token micro-batches)")
    print(f"{'model':>28} {'rows':>5} {'real tok':>9} {'padded tok':>10} {'padded s':>9} {'packed s':>9} {'speed-up':>9} "
          f"{'max |diff|':>10}")
    results = {}
    for label, kind, layers, n_rows in cases:
        model = random_model(kind, layers)
        prompts, responses = random_rows(realistic_mix(n_rows, long_every=long_every), model.config.vocab_size, 1)
        score = lambda layout: seed.response_logprobs(model, prompts, responses, 0, layout=layout)
        diff = (score("padded") - score("packed")).abs().max().item()
        times = compare({"padded": lambda: score("padded"), "packed": lambda: score("packed")}, min(args.repeats, 3),
                        warmup=0)
        speedup = median_ratio(times, "padded", "packed")
        real = sum(len(p) + len(r) for p, r in zip(prompts, responses))
        print(f"{label:>28} {n_rows:>5} {real:>9} {padded_tokens(prompts, responses, 16384):>10} "
              f"{med(times['padded']):>9.2f} {med(times['packed']):>9.2f} {speedup:>8.2f}x {diff:>10.1e}")
        results[label] = (speedup, diff)
    return results


def memory_child(kind, tokens, vocab, chunk_size=None):
    """Run in a fresh process: peak RSS growth (MB) of one per-token log-prob computation over (T, V) logits."""
    generator = torch.Generator().manual_seed(0)  # both processes score the same logits
    logits = torch.empty(tokens, vocab).uniform_(-4, 4, generator=generator)  # touched: counted in the baseline
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    with torch.no_grad():
        if kind == "chunked":
            extra, out = measure_peak_extra_mb(lambda: L.token_logprobs(logits, targets, chunk_size=chunk_size))
        else:
            extra, out = measure_peak_extra_mb(
                lambda: torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0])
    print(json.dumps({"extra_mb": extra, "checksum": float(out.sum())}))


def run_child(*child_args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *map(str, child_args)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def section_memory(args):
    """(3) peak extra memory of token_logprobs vs log_softmax + gather, each in a fresh subprocess."""
    tokens, vocab = (2048 if args.quick else 4096), 152000
    print(f"\n## 3. chunked log-probs: peak extra memory at T={tokens:,}, V={vocab:,} (fp32 logits "
          f"{tokens * vocab * 4 / 2**20:,.0f} MB; fresh subprocess each, peak RSS)")
    naive, chunked = run_child("memory", "naive", tokens, vocab), run_child("memory", "chunked", tokens, vocab)
    if abs(naive["checksum"] - chunked["checksum"]) > 1e-3 * abs(naive["checksum"]):
        raise RuntimeError(f"chunked and naive log-probs disagree: {chunked['checksum']} vs {naive['checksum']}")
    ratio = chunked["extra_mb"] / naive["extra_mb"]
    print(f"log_softmax + gather: {naive['extra_mb']:,.0f} MB   token_logprobs: {chunked['extra_mb']:,.0f} MB   "
          f"ratio {ratio:.3f}")
    return ratio


def bench_policy(args):
    """The tiny policy: --model folder, else the default run's warm-start (cached or shipped, as `python
    train.py` finds it), else (or with --model random) random weights with a BPE trained here."""
    folder = args.model
    if folder is None:
        import envs
        import train
        from warmup import warm_start
        cfg = train.get_config(["--cache-dir", os.path.join(REPO, "cache")], check=False)  # defaults only
        folder = warm_start.existing_warm_start(cfg, envs.env_options(cfg))[1] or "random"
    if folder != "random":
        return load_policy(folder, device="cpu", dtype="float32"), f"the tiny policy in {folder}"
    import envs
    import skills
    from warmup import warm_start
    env = envs.make_env("household", "train", 0)
    act, follow, analyzed = warm_start.demonstrations(env, 8, history_window=3, seed_value=0, desc=None)
    corpus = [p + r for p, r in act + follow] + [skills.analyzer_prompt(t) + c for t, c in analyzed]
    folder = tempfile.mkdtemp(prefix="bench_tiny_")
    return build_tiny_policy(corpus, folder, seed=0), "random-weight tiny (default sizes)"


def make_envs(n, max_steps):
    import envs
    return [envs.make_env("household", "train", i, max_steps=max_steps) for i in range(n)]


def section_rollout(args, policy):
    """(4) batched rollouts (all live envs in one generation batch) vs one env at a time."""
    tasks, group, max_steps, new_tokens = (2, 2, 2, 16) if args.quick else (4, 4, 3, 48)
    train_envs, task_seeds = make_envs(tasks * group, max_steps), list(range(100, 100 + tasks))
    counted = {}

    def batched():
        counted["batched"] = seed.rollout(policy, train_envs, task_seeds, group, max_steps, PROMPT, new_tokens,
                                          desc=None, generator=torch.Generator().manual_seed(0))

    def one_at_a_time():
        counted["single"] = [t for i, env in enumerate(train_envs) for t in seed.rollout(
            policy, [env], [task_seeds[i // group]], 1, max_steps, PROMPT, new_tokens, batch_size=1, desc=None,
            generator=torch.Generator().manual_seed(i))]

    times = compare({"batched": batched, "single": one_at_a_time}, min(args.repeats, 3), warmup=0)
    tokens = {k: sum(len(s.response_ids) for t in v for s in t.steps) for k, v in counted.items()}
    prompt_tokens = sum(len(s.prompt_ids) for t in counted["batched"] for s in t.steps)
    rate = {k: tokens[k] / med(times[k]) for k in times}
    speedup = median_ratio(times, "single", "batched") * tokens["batched"] / tokens["single"]
    print(f"\n## 4. rollouts: {tasks} tasks x {group} rollouts, {max_steps} steps, <= {new_tokens} new tokens per step")
    print(f"one env at a time: {med(times['single']):.2f} s, {rate['single']:.0f} tokens/s   batched: "
          f"{med(times['batched']):.2f} s, {rate['batched']:.0f} tokens/s   speed-up {speedup:.1f}x (per generated token)")
    print(f"(each step re-reads its whole prompt: {prompt_tokens:,} prompt tokens for {tokens['batched']:,} generated; "
          f"that prefill is the same work in both modes and bounds the gain)")
    return speedup


# the update's distillation term per arm: OPID's advantage path (the tiny preset's) and the paper's gated OPD loss
DISTILL = {"seed": {"distill_mode": "advantage", "distill_coef": 0.1},
           "seed-gated": {"distill_mode": "gated", "distill_coef": 0.01}, "grpo": {"distill_coef": 0.0}}


def one_update(policy, algo, train_envs, task_seeds, sizes):
    """One train.py update (same calls, same order) on a copy of the policy; returns {phase: seconds}. algo:
    grpo, seed (the advantage path) or seed-gated (the paper's gated loss)."""
    group, max_steps, new_tokens, analysis_tokens = sizes
    policy = Policy(copy.deepcopy(policy.model), policy.tokenizer)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=2e-4, weight_decay=0.0)
    times, clock = {}, time.perf_counter()

    def lap(phase):
        nonlocal clock
        now = time.perf_counter()
        times[phase], clock = now - clock, now

    trajectories = seed.rollout(policy, train_envs, task_seeds, group, max_steps, PROMPT, new_tokens, desc=None,
                                generator=torch.Generator().manual_seed(0))
    lap("rollout")
    skill_list = None
    if algo != "grpo":
        skill_list, _ = seed.analyze(policy, trajectories, 1024, analysis_tokens, desc=None)
        skill_list = [s or FIXED_SKILL for s in skill_list]  # worst case: every row gets a teacher pass
    lap("analyze")
    rows = seed.step_rows(trajectories, skill_list)
    with contextlib.redirect_stderr(io.StringIO()):  # its progress bars
        _, teacher, _, has_teacher = seed.rescore(policy, rows, need_old=False)
    lap("rescore")
    advantages = seed.step_advantages(trajectories, rows)  # (B,)
    seed.policy_update(policy, optimizer, rows.prompts, rows.responses, advantages, None,
                       None if algo == "grpo" else teacher, None, has_teacher, DISTILL[algo])
    lap("update")
    times["rows"] = len(rows.prompts)
    if algo == "seed":
        times["shared"] = shared_prefix_share(policy.tokenizer, rows)
    return times


def shared_prefix_share(tokenizer, rows):
    """Share of the teacher pass's tokens that repeat the longest prefix common to every teacher prompt of the same
    trajectory: the most that computing such a prefix once per trajectory could save."""
    by_trajectory = {}
    for text, response, index in zip(rows.teacher_prompts, rows.responses, rows.trajectory):
        if text is not None:
            by_trajectory.setdefault(index, []).append((seed.encode_chat(tokenizer, text), len(response)))
    total = repeated = 0
    for items in by_trajectory.values():
        prompts = [p for p, _ in items]
        common = next((i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1),
                      min(map(len, prompts)))
        total += sum(len(p) + n for p, n in items)
        repeated += common * (len(items) - 1)
    return repeated / max(total, 1)


def section_seed_overhead(args, policy):
    """(5) one SEED update (the advantage path and the paper's gated loss) vs one GRPO update at the same sizes, by
    phase, interleaved."""
    tasks, sizes = (2, (2, 2, 16, 24)) if args.quick else (4, (4, 20, 48, 96))
    group, max_steps, new_tokens, analysis_tokens = sizes
    train_envs, task_seeds = make_envs(tasks * group, max_steps), list(range(200, 200 + tasks))
    runs = {"grpo": [], "seed": [], "seed-gated": []}
    for r in range(min(args.repeats, 3)):
        order = list(runs)[r % 3:] + list(runs)[:r % 3]  # each arm first in turn
        for algo in order:
            runs[algo].append(one_update(policy, algo, train_envs, task_seeds, sizes))
    phases = ["rollout", "analyze", "rescore", "update"]
    total = {a: [sum(run[p] for p in phases) for run in runs[a]] for a in runs}
    ratio = statistics.median(s / g for s, g in zip(total["seed"], total["grpo"]))
    print(f"\n## 5. one SEED vs one GRPO update: {tasks} tasks x {group} rollouts, {max_steps} steps, <= {new_tokens} "
          f"new tokens, analysis <= {analysis_tokens} tokens ({runs['seed'][0]['rows']} step rows), median s")
    print(f"{'algo':>10} " + " ".join(f"{p:>8}" for p in phases) + f" {'total':>8}")
    for algo in runs:
        print(f"{algo:>10} " + " ".join(f"{med([run[p] for run in runs[algo]]):>8.2f}" for p in phases)
              + f" {med(total[algo]):>8.2f}")
    gated = statistics.median(s / g for s, g in zip(total["seed-gated"], total["grpo"]))
    # each phase's extra seconds over GRPO's median total, so the shares add up to the ratio minus 1 (GRPO has
    # no analyze or re-score phase: a per-phase ratio would divide by zero)
    grpo_total = med(total["grpo"])
    by_phase = "1 " + " ".join(f"{'+' if extra >= 0 else '-'} {abs(extra):.2f} {p}" for p in phases
                               for extra in [(med([r[p] for r in runs["seed-gated"]])
                                              - med([r[p] for r in runs["grpo"]])) / grpo_total])
    print(f"SEED / GRPO: {ratio:.2f}x, gated SEED / GRPO: {gated:.2f}x (medians of per-round ratios; "
          f"by phase, the medians over GRPO's median total: {by_phase}); "
          f"{runs['seed'][0]['shared']:.0%} of the teacher pass's tokens repeat a prefix shared by the trajectory's "
          "rows (the most prefix sharing could save there)")
    return ratio


def set_checkpointing(model, on):
    """Activation (gradient) checkpointing on or off, by transformers 5's name where it has it."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    if on:
        enable()
    else:
        disable()


def train_setup(quick):
    """The training-step case: (description, tokens, model, one policy_update over all rows)."""
    kind, layers, n_rows, prompt_len, response_len, micro = ("tiny", 4, 8, 224, 32, 512) if quick else \
        ("qwen-0.5b", 4, 8, 224, 32, 512)
    model = random_model(kind, layers).train()
    prompts, responses = random_rows([(prompt_len, response_len)] * n_rows, model.config.vocab_size)
    advantages = torch.randn(n_rows, generator=torch.Generator().manual_seed(0))  # (B,)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # no state: the memory is activations and gradients

    def step():
        seed.policy_update(bare_policy(model), optimizer, prompts, responses, advantages, None, max_batch_tokens=micro)
    tokens = n_rows * (prompt_len + response_len)
    about = (f"{kind}-shaped, {layers} layers, {n_rows} rows x {prompt_len}+{response_len} tokens, micro-batches of "
             f"{micro} tokens ({tokens // micro} accumulation steps)")
    return about, tokens, model, step


def rss_kb(field="VmRSS"):
    """Resident memory now (VmRSS) or its peak (VmHWM) in kB, from /proc/self/status (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure_peak_extra_mb(fn):
    """Peak resident memory above the current one while fn runs, in MB. The peak is reset first (clear_refs 5),
    so an earlier transient peak (imports, model construction) cannot leak into the figure."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # no peak reset here (some sandboxes): an earlier transient peak may then inflate the figure
        pass
    before = rss_kb()
    result = fn()
    return (rss_kb("VmHWM") - before) / 1024, result


def train_memory_child(checkpointing, quick):
    _, _, model, step = train_setup(quick == "quick")
    set_checkpointing(model, checkpointing == "on")
    print(json.dumps({"extra_mb": measure_peak_extra_mb(step)[0]}))


def section_train(args):
    """(6) tokens/s of forward + backward with gradient accumulation; gradient checkpointing off / on."""
    about, tokens, model, step = train_setup(args.quick)
    variants = {}
    for name, on in (("off", False), ("on", True)):
        variants[name] = lambda on=on: (set_checkpointing(model, on), step())
    times = compare(variants, min(args.repeats, 3))
    memory = {name: run_child("train", name, "quick" if args.quick else "full")["extra_mb"] for name in variants}
    print(f"\n## 6. training step: {about}")
    for name in variants:
        print(f"checkpointing {name:>3}: {tokens / med(times[name]):>6.0f} tokens/s fwd+bwd, "
              f"peak extra memory {memory[name]:,.0f} MB")
    print(f"checkpointing costs {median_ratio(times, 'on', 'off'):.2f}x time, saves "
          f"{1 - memory['on'] / memory['off']:.0%} of the step's extra memory")
    return {name: (tokens / med(times[name]), memory[name]) for name in variants}


def section_gpu(args):
    """(gpu) bf16 on CUDA: generation, re-scoring (equal rows at the paper's shapes, then the realistic length mix,
    padded vs packed with their max |diff| in bf16) and one 3B-shaped update, with peak memory for each."""
    if not torch.cuda.is_available():
        print("\n## gpu: skipped (no CUDA device; this section needs one)")
        return None
    sync, gib = torch.cuda.synchronize, lambda: torch.cuda.max_memory_allocated() / 2**30
    layers = 4 if args.quick else None  # the full 36 layers of Qwen2.5-3B unless --quick
    model = random_model("qwen-3b", layers, attn="sdpa", dtype=torch.bfloat16, device="cuda")
    policy, vocab = bare_policy(model), model.config.vocab_size
    rows, prompt_len, response_len = 128, 1024, 256  # paper: 16 tasks x 8 rollouts per generation batch
    prompts, responses = random_rows([(prompt_len, response_len)] * rows, vocab)
    print(f"\n## gpu: {torch.cuda.get_device_name()}, torch {torch.__version__}, qwen-3b-shaped "
          f"({model.config.num_hidden_layers} layers), bf16, weights {gib():.1f} GiB")
    torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    sampled, _ = seed.sample(policy, prompts, response_len, batch_size=rows)
    sync()
    generated = sum(len(r) for r in sampled)
    print(f"generation, {rows} rows x {prompt_len}+{response_len}: {generated / (time.perf_counter() - start):,.0f} "
          f"new tokens/s (KV cache), peak memory {gib():.1f} GiB")
    results = {}
    for label, (batch_prompts, batch_responses) in {
            f"equal rows, {rows} x {prompt_len}+{response_len}": (prompts, responses),
            f"realistic mix, {rows} rows": random_rows(realistic_mix(rows), vocab, 1)}.items():
        score = lambda layout: seed.response_logprobs(model, batch_prompts, batch_responses, 0, layout=layout)
        gap = (score("padded").float() - score("packed").float()).abs()  # (rows, longest response), 0 on padding
        timed = lambda layout: (score(layout), sync())
        torch.cuda.reset_peak_memory_stats()
        times = compare({"padded": lambda: timed("padded"), "packed": lambda: timed("packed")}, args.repeats)
        tokens = sum(len(p) + len(r) for p, r in zip(batch_prompts, batch_responses))
        print(f"re-scoring, {label}: padded {tokens / med(times['padded']):,.0f} tokens/s, packed "
              f"{tokens / med(times['packed']):,.0f} tokens/s, packed speed-up {median_ratio(times, 'padded', 'packed'):.2f}x, "
              f"max |diff| {gap.max().item():.1e} (mean {gap.mean().item():.1e}), peak memory {gib():.1f} GiB")
        results[label] = median_ratio(times, "padded", "packed")
    model.train()
    set_checkpointing(model, True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    advantages = torch.randn(rows)
    for attempt in ("first (allocates optimizer state)", "second"):
        torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        seed.policy_update(policy, optimizer, prompts, responses, advantages, None, max_batch_tokens=16384)
        sync()
        seconds = time.perf_counter() - start
        print(f"update {attempt} (checkpointing, AdamW, 16,384-token micro-batches, {rows * (prompt_len + response_len):,} "
              f"tokens): {seconds:.1f} s, {rows * (prompt_len + response_len) / seconds:,.0f} tokens/s, "
              f"peak memory {gib():.1f} GiB")
    return results


# ----------------------------------------------------------------------------- main

SECTIONS = ["rescore", "packing", "memory", "rollout", "overhead", "train", "gpu"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes and 3 repeats (under a minute)")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=SECTIONS, help="sections to run")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the matmul bound uses the same)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per comparison (default 3 quick, 5 full)")
    p.add_argument("--model", default=None,
                   help="tiny policy folder for sections 4-5, or 'random' (default: cached warm-up, else random)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # internal: a fresh-process memory measurement
    args = p.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        return memory_child(rest[0], *map(int, rest[1:])) if kind == "memory" else train_memory_child(*rest)
    args.repeats = args.repeats or (3 if args.quick else 5)
    torch.set_num_threads(args.threads)
    print(f"bench.py{' --quick' if args.quick else ''}: torch {torch.__version__}, {args.threads} thread(s), "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, {args.repeats} interleaved rounds")
    start, summary = time.perf_counter(), []
    if "rescore" in args.only:
        share = section_rescore(args)
        summary.append(("re-scoring, larger config, share of matmul bound", f"{list(share.values())[-1]:.0%}",
                        ">= 50%", list(share.values())[-1] >= 0.5))
    if "packing" in args.only:
        packing = section_packing(args)
        speedup, diff = list(packing.values())[-1]
        summary.append(("packed vs padded speed-up (max |diff|)", f"{speedup:.2f}x ({diff:.0e})", ">= 1.5x",
                        speedup >= 1.5 and diff < 1e-4))
    if "memory" in args.only:
        ratio = section_memory(args)
        summary.append((f"chunked / naive peak extra memory, T={2048 if args.quick else 4096}", f"{ratio:.3f}",
                        "<= 0.125", ratio <= 0.125))
    if "rollout" in args.only or "overhead" in args.only:
        policy, origin = bench_policy(args)
        print(f"\n(rollout and update sections use: {origin})")
        if "rollout" in args.only:
            speedup = section_rollout(args, policy)
            summary.append(("batched vs one-env rollouts", f"{speedup:.1f}x", ">= 5x", speedup >= 5))
        if "overhead" in args.only:
            ratio = section_seed_overhead(args, policy)
            summary.append(("SEED / GRPO update time", f"{ratio:.2f}x", "<= 1.3x", ratio <= 1.3))
    if "train" in args.only:
        section_train(args)
    if "gpu" in args.only:
        section_gpu(args)
    print(f"\n## summary ({time.perf_counter() - start:.0f} s)")
    for name, value, target, met in summary:
        print(f"{name:>50}: {value:>14}  target {target:>8}  {'met' if met else 'NOT met'}")
    return summary


if __name__ == "__main__":
    main()
