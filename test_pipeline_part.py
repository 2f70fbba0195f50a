"""Tests of the SEED pipeline (seed.py, train.py, warmup.py) on a tiny random Qwen2: one SEED and one GRPO
update, packed == padded, sampled == re-scored log-probs, teacher/student alignment, parse failures,
train.py end to end, --resume, --env alfworld and bad configs. CPU only, seeded.
Run: python -m pytest -q --durations=0 test_pipeline_part.py"""
import copy
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

import envs
import envs_alfworld
import loss as L
import seed
import skills
import train
import warmup

REPO = os.path.dirname(os.path.abspath(__file__))
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1)
SKILL = "The apple was in the fridge 1: open the fridge 1 first, take the apple, then go to the countertop 1."
HAS_ALFWORLD = importlib.util.find_spec("alfworld") is not None
needs_alfworld = pytest.mark.skipif(not HAS_ALFWORLD, reason="alfworld not installed (pip install alfworld==0.4.2)")
# One intra-op thread: on a 2-core machine shared with other jobs, OpenMP's spinning threads made one forward
# pass of the tiny model 40x slower (1.3 s vs 0.03 s measured); a model this small gains nothing from more.
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def weight_change(before, model):
    """Largest absolute change of any parameter since `before` (a snapshot)."""
    return max(max_diff(b, p.detach()) for b, p in zip(before, model.parameters()))


def fresh(policy):
    """A policy on a copy of the weights: tests that train never touch the shared fixture."""
    return seed.Policy(copy.deepcopy(policy.model), policy.tokenizer)


def finite(metrics):
    return all(math.isfinite(v) for v in metrics.values())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(policy, folder): a random 2-layer Qwen2 with a 512-token BPE trained on rendered household prompts,
    expert responses and analyzer prompts from 8 demonstration episodes."""
    env = envs.make_env("household", "train", 0)
    act, follow, analyzed = warmup.demonstrations(env, 8, history_window=3, seed_value=0)
    corpus = [p + r for p, r in act + follow] + [skills.analyzer_prompt(t) + c for t, c in analyzed]
    folder = str(tmp_path_factory.mktemp("tiny_policy"))
    return seed.build_tiny_policy(corpus, folder, seed=0, **TINY), folder


@pytest.fixture(scope="module")
def trajectories(tiny):
    """2 household tasks x 2 rollouts of up to 3 steps, 12 new tokens per step, sampled by the tiny policy."""
    policy, _ = tiny
    train_envs = [envs.make_env("household", "train", i, max_steps=3) for i in range(4)]
    return seed.rollout(policy, train_envs, [11, 12], group_size=2, max_steps=3, max_new_tokens=12,
                        generator=torch.Generator().manual_seed(0))


def update(policy, trajectories, skill_list=None, **loss_kwargs):
    """step_rows -> rescore -> trajectory_advantages -> policy_update (AdamW without weight decay, as train.py)
    on `policy`; returns (metrics, skipped, rows, has_teacher)."""
    rows = seed.step_rows(trajectories, skill_list)
    old, teacher, ref, has_teacher = seed.rescore(policy, rows)
    advantages = seed.trajectory_advantages(trajectories)[rows["trajectory"]]  # (B,)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-3, weight_decay=0.0)
    metrics, skipped = seed.policy_update(policy, optimizer, rows["prompts"], rows["responses"], advantages, old,
                                          teacher if skill_list else None, ref, has_teacher, loss_kwargs)
    return metrics, skipped, rows, has_teacher


# ----------------------------------------------------------------------------- one update, SEED and GRPO

def test_seed_update_end_to_end(tiny):
    policy = fresh(tiny[0])
    torch.manual_seed(0)
    train_envs = [envs.make_env("household", "train", i, max_steps=3) for i in range(4)]
    trajectories = seed.rollout(policy, train_envs, [3, 4], group_size=2, max_steps=3, max_new_tokens=12)
    assert [t["group"] for t in trajectories] == [0, 0, 1, 1]
    for t in trajectories:
        assert 1 <= len(t["steps"]) <= 3 and t["gt"] is not None, f"episode not finished: {len(t['steps'])} steps"
        for step in t["steps"]:
            assert len(step["response_ids"]) == len(step["sampled_logp"]) <= 12
    parsed, texts = seed.analyze(policy, trajectories, max_new_tokens=16)
    assert len(parsed) == len(texts) == 4

    # the analyzer's own skills (a random model parses none): GRPO still applies, metrics stay finite
    metrics, skipped, rows, has_teacher = update(fresh(policy), trajectories, parsed)
    assert skipped is None and finite(metrics), metrics
    mask = seed.response_mask(rows["responses"])  # (B, R)
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
    scores = [t["reward"] for t in trajectories]
    policy = fresh(tiny[0])
    before = snapshot(policy.model)
    metrics, skipped, *_ = update(policy, trajectories, distill_coef=0.0)
    assert skipped is None and finite(metrics), (skipped, metrics)
    if scores[0] == scores[1] and scores[2] == scores[3]:
        assert weight_change(before, policy.model) == 0.0, "zero advantages must give a zero update"
    # credit the first rollout of each task with a win (+10): advantages +-0.707 and the weights move
    won = copy.deepcopy(trajectories)
    for t in won[0::2]:
        t["reward"] += 10.0
    policy = fresh(tiny[0])
    metrics, skipped, *_ = update(policy, won, distill_coef=0.0)
    change = weight_change(before, policy.model)
    advantages = seed.trajectory_advantages(won)
    assert max_diff(advantages, torch.tensor([1, -1, 1, -1]) / math.sqrt(2)) < 1e-5, advantages
    assert skipped is None and finite(metrics) and metrics["delta_abs_mean"] == 0.0, metrics
    assert metrics["grad_norm"] > 0 and change > 1e-5, f"GRPO update: max weight change {change}"


# ----------------------------------------------------------------------------- packed == padded

def test_packed_equals_padded_logprobs(tiny, trajectories):
    policy, _ = tiny
    generator = torch.Generator().manual_seed(1)
    full = trajectories[-1]["steps"][-1]["prompt_ids"]
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
    advantages = torch.randn(len(rows["prompts"]), generator=torch.Generator().manual_seed(2))  # (B,)
    kwargs = dict(distill_coef=0.1, distill_mode="gated", entropy_coef=0.01)
    results = {}
    for layout in ("padded", "packed"):
        policy = fresh(tiny[0])
        optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
        metrics, skipped = seed.policy_update(policy, optimizer, rows["prompts"], rows["responses"], advantages, old,
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
    advantages = torch.randn(len(rows["prompts"]), generator=torch.Generator().manual_seed(6))  # (B,)
    results = []
    for max_batch_tokens in (100_000, 1):
        policy = fresh(tiny[0])
        metrics, skipped = seed.policy_update(policy, torch.optim.SGD(policy.model.parameters(), lr=1.0),
                                              rows["prompts"], rows["responses"], advantages, old, teacher, None,
                                              has_teacher, dict(distill_coef=0.1, agg=agg, entropy_coef=0.01),
                                              max_batch_tokens=max_batch_tokens)
        assert skipped is None, skipped
        results.append((list(policy.model.parameters()), metrics))
    diff = max(max_diff(a, b) for a, b in zip(results[0][0], results[1][0]))
    loss_diff = abs(results[0][1]["loss"] - results[1][1]["loss"])
    print(f"\n{agg}: one batch vs {len(rows['prompts'])} micro-batches: max weight diff {diff:.2e}, loss {loss_diff:.2e}")
    assert diff < 1e-6 and loss_diff < 1e-6, f"{agg}: weights {diff}, loss {loss_diff}"


# ----------------------------------------------------------------------------- teacher rows, parse failures

def test_teacher_and_student_rows_share_response_tokens(tiny, trajectories):
    policy, _ = tiny
    skill_list = [SKILL, None, SKILL, None]
    rows = seed.step_rows(trajectories, skill_list)
    steps = [(t, s) for t, trajectory in enumerate(trajectories) for s in trajectory["steps"]]
    assert len(rows["prompts"]) == len(steps) and rows["trajectory"] == [t for t, _ in steps]
    for i, (t, step) in enumerate(steps):
        assert rows["responses"][i] is step["response_ids"], f"row {i}: the response is not the sampled one"
        assert rows["prompts"][i] == step["prompt_ids"] == seed.encode_chat(policy.tokenizer, step["prompt"])
        if skill_list[t] is None:
            assert rows["teacher_prompts"][i] is None, f"row {i}: teacher prompt without a skill"
            continue
        assert rows["teacher_prompts"][i] == skills.with_skill(step["prompt"], SKILL)
        teacher_ids = seed.encode_chat(policy.tokenizer, rows["teacher_prompts"][i])
        assert len(teacher_ids) > len(step["prompt_ids"]) and teacher_ids != step["prompt_ids"]
    old, teacher, ref, has_teacher = seed.rescore(policy, rows)
    assert ref is None and has_teacher.tolist() == [skill_list[t] is not None for t, _ in steps]
    assert torch.equal(teacher[~has_teacher], old[~has_teacher]), "rows without a skill must hold the old log-probs"
    # the teacher log-probs line up with the response tokens: row by row scoring under the skill prompt agrees
    alignment = 0.0
    for i in has_teacher.nonzero().flatten().tolist():
        alone = seed.response_logprobs(policy.model, [seed.encode_chat(policy.tokenizer, rows["teacher_prompts"][i])],
                                       [rows["responses"][i]], policy.pad_id)[0]
        alignment = max(alignment, max_diff(teacher[i, :alone.shape[0]], alone))
        assert (teacher[i, len(rows["responses"][i]):] == 0).all(), f"row {i}: teacher log-prob past the response"
    shift = max_diff(teacher[has_teacher], old[has_teacher])
    print(f"\nteacher row-by-row alignment: max diff {alignment:.2e}; skill shifts log-probs by up to {shift:.3f}")
    assert alignment < 1e-5, f"teacher log-probs misaligned: max diff {alignment}"
    assert shift > 1e-3, f"the skill block changed no teacher log-prob (max diff {shift})"


def test_parse_failure_gives_zero_delta(tiny, trajectories):
    policy, _ = tiny
    rows = seed.step_rows(trajectories, [SKILL, None, SKILL, None])
    old, teacher, _, has_teacher = seed.rescore(policy, rows)
    mask = seed.response_mask(rows["responses"])  # (B, R)
    failed = torch.tensor([t % 2 == 1 for t in rows["trajectory"]])  # (B,) rows of trajectories 1 and 3
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
    prompts, responses = [rows["prompts"][i] for i in subset], [rows["responses"][i] for i in subset]
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
    advantages = torch.randn(len(rows["prompts"]), generator=torch.Generator().manual_seed(4))  # (B,)
    results = []
    for old_logp, teacher_logp in [(old, teacher), (None, teacher_only)]:
        policy = fresh(tiny[0])
        metrics, skipped = seed.policy_update(policy, torch.optim.SGD(policy.model.parameters(), lr=1.0),
                                              rows["prompts"], rows["responses"], advantages, old_logp, teacher_logp,
                                              None, has_teacher, dict(distill_coef=0.1))
        assert skipped is None, skipped
        results.append((list(policy.model.parameters()), metrics))
    diff = max(max_diff(a, b) for a, b in zip(results[0][0], results[1][0]))
    metric_diff = max(abs(results[0][1][k] - results[1][1][k]) for k in results[0][1])
    print(f"\nneed_old=False vs student pass: max weight diff {diff:.2e}, metrics {metric_diff:.2e}")
    assert diff < 1e-6 and metric_diff < 1e-5, f"weights {diff}, metrics {metric_diff}"


# ----------------------------------------------------------------------------- sampling

def test_sample_greedy_stop_and_logprobs(tiny, trajectories):
    policy, _ = tiny
    full = trajectories[0]["steps"][-1]["prompt_ids"]
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
    stopping = seed.Policy(policy.model, policy.tokenizer)
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


# ----------------------------------------------------------------------------- train.py

def run_train(*args):
    """train.main in this process on the given flags; returns its wall time in seconds."""
    start = time.perf_counter()
    train.main(train.get_config([str(a) for a in args]))
    return time.perf_counter() - start


def read_jsonl(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def numbers(record):
    """The numeric fields of a metrics line, times excluded (they differ run to run)."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not k.startswith("time")}


def final_weights(out_dir):
    with open(os.path.join(out_dir, "checkpoints", "latest")) as handle:
        folder = os.path.join(out_dir, "checkpoints", handle.read().strip())
    return AutoModelForCausalLM.from_pretrained(folder), folder


TRAIN_FLAGS = ["--updates", 2, "--tasks-per-update", 2, "--group-size", 2, "--max-steps", 3,
               "--max-new-tokens", 8, "--eval-tasks", 2, "--save-every", 1, "--analysis-max-new-tokens", 16]


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
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["update"] for m in metrics] == [1, 2], metrics
    for m in metrics:
        assert m["skipped"] is None and all(math.isfinite(v) for v in numbers(m).values()), m
        assert m["rows"] > 0 and 0 <= m["parse_fail"] <= 1 and m["entropy"] > 0, m
    evals = read_jsonl(out / "eval.jsonl")
    assert [(e["update"], e["split"]) for e in evals] == [(0, "valid_seen"), (0, "valid_unseen"),
                                                          (2, "valid_seen"), (2, "valid_unseen")], evals
    assert all(0 <= e["micro"] <= 1 and e["per_type"] for e in evals), evals
    model, folder = final_weights(str(out))
    assert folder.endswith("update_000002") and sorted(os.listdir(out / "checkpoints")) == [
        "latest", "update_000001", "update_000002"]
    assert torch.load(os.path.join(folder, "trainer.pt"), weights_only=True)["update"] == 2
    warm = [d for d in os.listdir(tmp_path / "cache") if d.startswith("tiny-household-")]
    assert len(warm) == 1, warm
    start = seed.load_policy(str(tmp_path / "cache" / warm[0]), "cpu", "float32").model
    moved = max(max_diff(a, b) for a, b in zip(start.parameters(), model.parameters()))
    assert moved > 0, "two RL updates with an entropy bonus left the warm-started weights unchanged"

    rerun = run_train(*flags, "--out-dir", tmp_path / "b")
    assert "reusing the cached tiny model" in capsys.readouterr().out
    again, _ = final_weights(str(tmp_path / "b"))
    diff = max(max_diff(a, b) for a, b in zip(model.parameters(), again.parameters()))
    pairs = zip(map(numbers, metrics), map(numbers, read_jsonl(tmp_path / "b" / "metrics.jsonl")))
    metrics_diff = max(abs(a[k] - b[k]) for a, b in pairs for k in a)
    print(f"\ntrain.py --model tiny: {seconds:.1f}s building the warm-up, {rerun:.1f}s reusing it; "
          f"cached vs built: max weight diff {diff:.2e}, metrics {metrics_diff:.2e}; RL moved weights {moved:.2e}")
    assert diff == 0.0 and metrics_diff == 0.0, f"the cached warm-up changed the run: {diff}, metrics {metrics_diff}"


class Killed(Exception):
    """Stands in for a run killed right after a checkpoint was written."""


def test_resume_continues_with_identical_state(tiny, tmp_path, capsys, monkeypatch):
    """2 updates straight vs a run killed after update 1's checkpoint + --resume, from the tiny fixture model.
    An entropy bonus and a KL term make every update move the weights (the random model's rewards tie, so
    GRPO alone would not) and put the optimizer state and the KL reference to the test."""
    flags = TRAIN_FLAGS + ["--model", tiny[1], "--stage", "rl", "--lr", 1e-3, "--entropy-coef", 0.01,
                           "--kl-coef", 0.05]
    straight = run_train(*flags, "--out-dir", tmp_path / "straight")
    save = train.save_checkpoint

    def save_then_die(cfg, policy, optimizer, update):
        path = save(cfg, policy, optimizer, update)
        if update == 1:
            raise Killed
        return path

    monkeypatch.setattr(train, "save_checkpoint", save_then_die)
    killed = time.perf_counter()
    with pytest.raises(Killed):
        run_train(*flags, "--out-dir", tmp_path / "resumed")
    killed = time.perf_counter() - killed
    monkeypatch.undo()
    second = run_train(*flags, "--out-dir", tmp_path / "resumed", "--resume")
    assert "resuming from" in capsys.readouterr().out
    expected, _ = final_weights(str(tmp_path / "straight"))
    resumed, _ = final_weights(str(tmp_path / "resumed"))
    diff = max(max_diff(a, b) for a, b in zip(expected.parameters(), resumed.parameters()))
    lines = {name: {m["update"]: numbers(m) for m in read_jsonl(tmp_path / name / "metrics.jsonl")}
             for name in ("straight", "resumed")}
    assert sorted(lines["resumed"]) == [1, 2], lines["resumed"]
    metric_diffs = {k: abs(lines["straight"][2][k] - lines["resumed"][2][k]) for k in lines["straight"][2]}
    worst = max(metric_diffs, key=metric_diffs.get)
    final_evals = [[e for e in read_jsonl(tmp_path / name / "eval.jsonl") if e["update"] == 2]
                   for name in ("straight", "resumed")]
    print(f"\nresume: {straight:.1f}s straight, {killed:.1f}s killed + {second:.1f}s resumed; max weight diff "
          f"{diff:.2e}, update-2 metrics max diff {metric_diffs[worst]:.2e} ({worst})")
    assert lines["straight"][2]["kl"] > 0, "the KL term did nothing: the reference must differ by update 2"
    assert diff < 1e-6, f"resumed weights differ: max diff {diff}"
    assert metric_diffs[worst] < 1e-6, f"update-2 metrics differ, worst {worst}: {metric_diffs}"
    assert len(final_evals[0]) == 2 and final_evals[0] == final_evals[1], final_evals


@pytest.fixture(scope="module")
def alfworld_data(tmp_path_factory):
    """Synthetic ALFWorld games: 2 train, 1 valid_seen, 1 valid_unseen."""
    data = tmp_path_factory.mktemp("alfworld")
    for split, n in (("train", 2), ("valid_seen", 1), ("valid_unseen", 1)):
        envs_alfworld.generate_games(str(data), n, seed=0, split=split)
    return data


@needs_alfworld
def test_train_alfworld_one_update(tiny, alfworld_data, tmp_path, capsys):
    seconds = run_train("--env", "alfworld", "--data-dir", alfworld_data, "--model", tiny[1], "--stage", "rl",
                        "--updates", 1, "--tasks-per-update", 2, "--group-size", 2, "--max-steps", 3,
                        "--max-new-tokens", 8, "--eval-tasks", 1, "--analysis-max-new-tokens", 16,
                        "--out-dir", tmp_path / "out")
    output = capsys.readouterr().out
    (metrics,) = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    print(f"\ntrain.py --env alfworld, one update: {seconds:.1f}s in all, the update {metrics['time']:.1f}s")
    assert "update 1/1 |" in output, output[-2000:]
    assert metrics["skipped"] is None and metrics["rows"] > 0 and metrics["parse_fail"] is not None, metrics
    assert all(math.isfinite(v) for v in numbers(metrics).values()), metrics
    evals = read_jsonl(tmp_path / "out" / "eval.jsonl")
    assert {e["split"] for e in evals} == {"valid_seen", "valid_unseen"} and len(evals) == 4, evals
    assert all(e["per_type"] and set(e["per_type"]) <= set(envs_alfworld.TASK_TYPES) for e in evals), evals
    final_weights(str(tmp_path / "out"))  # loadable


@needs_alfworld
def test_train_alfworld_default_tiny_on_generated_games(tmp_path, capsys, monkeypatch):
    """`train.py --env alfworld` as typed: no data (synthetic games are generated and the log says so) and
    --model tiny, whose warm-up demonstrations come from the household env (ALFWorld has no noisy expert)."""
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    seconds = run_train("--env", "alfworld", "--warmup-steps", 2, "--updates", 1, "--tasks-per-update", 2,
                        "--group-size", 2, "--max-steps", 2, "--max-new-tokens", 8, "--eval-tasks", 1,
                        "--analysis-max-new-tokens", 8, "--cache-dir", tmp_path / "cache",
                        "--out-dir", tmp_path / "out")
    output = capsys.readouterr().out
    print(f"\ntrain.py --env alfworld --model tiny, synthetic games: {seconds:.1f}s")
    assert "generating synthetic games" in output and "household env" in output, output[-3000:]
    assert os.path.isdir(tmp_path / "out" / "alfworld_synthetic" / "json_2.1.1" / "valid_unseen")
    (metrics,) = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert metrics["skipped"] is None and all(math.isfinite(v) for v in numbers(metrics).values()), metrics


@needs_alfworld
def test_stage1_sft_on_alfworld(tiny, alfworld_data, tmp_path, capsys):
    """--stage sft for a (local) HF model on --env alfworld: analyzer SFT, saved as a loadable folder."""
    run_train("--env", "alfworld", "--data-dir", alfworld_data, "--model", tiny[1], "--stage", "sft",
              "--sft-steps", 1, "--sft-batch-size", 2, "--sft-lr", 1e-3, "--out-dir", tmp_path / "out")
    assert "stage 1 done" in capsys.readouterr().out
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out" / "sft"))
    moved = max(max_diff(a, b) for a, b in zip(tiny[0].model.parameters(), trained.parameters()))
    assert moved > 1e-5, f"stage 1 left the weights unchanged (max change {moved})"


# ----------------------------------------------------------------------------- bad configs

def test_unknown_env_is_one_clear_error(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "--env", "nosuchenv",
                             "--out-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                            env=SUBPROCESS_ENV, cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(errors) == 1 and "nosuchenv" in errors[0] and "household" in errors[0], result.stderr[-2000:]


@pytest.mark.parametrize("flags, message", [
    (["--group-size", "1"], "--group-size"),
    (["--group-size", "1", "--algo", "grpo"], "--group-size"),
    (["--updates", "0"], "--updates"),
    (["--max-steps", "0"], "--max-steps"),
])
def test_bad_sizes_are_clean_argparse_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.get_config(flags)
    err = capsys.readouterr().err
    assert exit_info.value.code != 0 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], err
