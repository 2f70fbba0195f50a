"""training/analyzer.py: beyond the paper and off by default (--analyzer-training none) -- one extra SFT step per
update on chosen analyses, so the analyzer improves (or stays put) while RL trains only the action tokens. Measured
without it on the tiny demo, RL hardly moves the analyzer (per-token KL to the start model 10-20x smaller on
analyses than on actions) and the rise of parse failures seen earlier was a token limit (docs/experiments.md,
experiments/analyzer_drift.py). Which analyses:

  confirmed  the policy's own analyses of this update's failed trajectories whose skill names the fix their
             ground truth gives (envs.EnvSpec.names_fix): it learns from the analyses that were right;
  lift       the policy's own analyses whose skill moved its own trajectory's teacher the right way: the mean
             delta over the trajectory's sampled tokens above 0 for a success (the skill endorses what worked),
             below 0 for a failure (it disowns what failed): an analyzer that learns from its own results;
  explored   like confirmed, but from EXPLORE_SAMPLES extra analyses of each failed trajectory sampled at
             temperature 1 (the teacher keeps the update's greedy ones): a greedy analyzer only repeats itself, so
             confirmed can sharpen what it already writes, never find the fix it seldom writes (the version-10
             start model names the skipped step in 1 of 35 habit failures greedily, 14 of 140 sampled);
  anchor     the start model's analyses of this update's trajectories: it pulls the analysis tokens back towards
             the start analyzer (an anchor on those tokens alone, where the KL term covers the action tokens).

At most --sft-batch-size examples a step, drawn at random; the step uses the update's optimizer at ANALYZER_LR_SCALE
times its rate. The
paper's code base has an optional loss on the analyzer's tokens too (REFERENCE 1b), off in its ALFWorld launcher.
"""
import random

import torch

import envs
import seed
import skills
from models.scoring import padded_logprobs, response_mask

EXPLORE_SAMPLES = 2  # sampled analyses per failed trajectory for --analyzer-training explored
# the analyzer's step runs at 3x the RL rate: offline, from the version-10 start model, 20 explored steps (measured
# every 5) at the tiny rate 1e-4 left it as it was (greedy skills naming the fix: 4-7 of 29 habit failures from 5;
# 9-10 of the probe's 19 failures from 10), at 3e-4 they moved it a little (5-10 of 29; 9-12 of 19), and at 1e-3
# they broke it (34 of its 48 analyses no longer parsed after 20 steps)
ANALYZER_LR_SCALE = 3.0


def trajectory_deltas(rows, teacher_logp, has_teacher):
    """Mean delta (teacher minus the log-probs recorded while sampling) over each trajectory's sampled tokens
    that had a teacher -> {trajectory index: mean delta}."""
    sampled = padded_logprobs(rows.sampled_logp)                                  # (B, R)
    width = min(sampled.shape[1], teacher_logp.shape[1])
    mask = response_mask(rows.responses)[:, :width] * has_teacher[:, None]        # (B, R)
    delta = (teacher_logp[:, :width] - sampled[:, :width]) * mask                 # (B, R)
    found = {}
    for row, index in enumerate(rows.trajectory):
        total, count = found.get(index, (0.0, 0.0))
        found[index] = (total + float(delta[row].sum()), count + float(mask[row].sum()))
    return {index: total / count for index, (total, count) in found.items() if count > 0}


def analyzer_examples(kind, policy, start, cfg, trajectories, skill_list, texts, rows, teacher_logp,
                      has_teacher, seed_value=0):
    """The (analyzer prompt, completion) pairs of --analyzer-training `kind` for this update (see the module
    docstring); [] when none qualifies."""
    if kind == "anchor":
        start_skills, start_texts = seed.analyze(start, trajectories, cfg.analysis_prompt_tokens,
                                                 cfg.analysis_max_new_tokens, 0.0, desc="anchor analyses")
        chosen = [(t, text) for t, s, text in zip(trajectories, start_skills, start_texts) if s is not None]
    elif kind in ("confirmed", "explored"):
        names_fix = envs.spec(cfg.env).names_fix
        check = envs.load(names_fix) if names_fix else (lambda trajectory, skill: None)
        if kind == "explored":  # fresh sampled analyses of the failures (successes have nothing to fix)
            trajectories = [t for t in trajectories if not t.won] * EXPLORE_SAMPLES
            skill_list, texts = seed.analyze(policy, trajectories, cfg.analysis_prompt_tokens,
                                             cfg.analysis_max_new_tokens, 1.0, desc="explored analyses")
        chosen = [(t, text) for t, s, text in zip(trajectories, skill_list, texts)
                  if s is not None and check(t, s)]
    elif kind == "lift":
        deltas = trajectory_deltas(rows, teacher_logp, has_teacher)
        chosen = [(t, text) for index, (t, s, text) in enumerate(zip(trajectories, skill_list, texts))
                  if s is not None and index in deltas and (deltas[index] > 0) == bool(t.won)]
    else:
        raise ValueError(f"unknown --analyzer-training {kind!r}")
    chosen = random.Random(seed_value).sample(chosen, min(len(chosen), cfg.sft_batch_size))
    return [(skills.analyzer_prompt(t, cfg.analysis_prompt_tokens, policy.count_tokens), text)
            for t, text in chosen]


def analyzer_step(kind, policy, start, optimizer, cfg, trajectories, skill_list, texts, rows, teacher_logp,
                  has_teacher, seed_value=0):
    """One SFT step on the chosen analyses; returns {"analyzer_examples", "analyzer_loss"} for the update's
    metrics (no step, and a loss of None, when none qualified)."""
    examples = analyzer_examples(kind, policy, start, cfg, trajectories, skill_list, texts, rows,
                                 teacher_logp, has_teacher, seed_value)
    loss = None
    if examples:
        rates = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] *= ANALYZER_LR_SCALE
        with torch.enable_grad():
            loss = seed.supervised_step(policy, optimizer, examples, cfg.max_batch_tokens,
                                        layout="padded" if policy.sees_images else "packed")
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate
    return {"analyzer_examples": len(examples), "analyzer_loss": loss}
