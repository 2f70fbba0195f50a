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
  explored   like confirmed, but from --explore-samples extra analyses of each failed trajectory sampled at
             temperature 1 (the teacher keeps the update's greedy ones): a greedy analyzer only repeats itself, so
             confirmed can sharpen what it already writes, never find the fix it seldom writes (on 96 episodes the
             version-10 start model names the habit's fix for 5 of 23 habit failures greedily, 10 of 92 sampled);
  confirmed-and-explored  both pools at once: explored alone lowered the probe's fixing share on two fresh seeds
             of three (exp21: 0.526 -> 0.263, 0.316); the update's greedy analyses that name the fix join the step
             (they are almost all loop warnings naming the admissible commands);
  explored-where-wrong  explored, but only of the failures whose greedy analysis misses the fix: the others' samples
             are loop warnings the analyzer already writes (on 96 start-model episodes its greedy analyses name the
             fix of 32 of 36 invalid-command failures and 5 of 23 habit failures, experiments/analyzer_drift.py),
             so explored's step was mostly more of those;
  explored-balanced  explored-where-wrong's examples plus as many of explored's from the failures whose greedy
             analysis already names the fix: where-wrong learned new fixes and lost old ones (on 96 episodes, the
             invalid-command failures named 35 and 32 of 36 after two runs); this rehearses the old beside each new;
  anchor     the start model's analyses of this update's trajectories: it pulls the analysis tokens back towards
             the start analyzer (an anchor on those tokens alone, where the KL term covers the action tokens).

At most --sft-batch-size examples a step, drawn at random; the step uses the update's optimizer at ANALYZER_LR_SCALE
times its rate. The
paper's code base has an optional loss on the analyzer's tokens too (REFERENCE 1b), off in its ALFWorld launcher.

--teacher-anchor (beyond the paper, 0 = off) keeps the other half of self-analysis, the teacher's response to a
skill, from eroding: RL trains only skill-free contexts, and after exp13's SEED runs the own skill's push against
invalid commands (their log-prob change minus valid ones', -0.474 nats on the start model) was +0.248, +0.039 and
-0.273 (docs/experiments.md). `teacher_anchor` adds a k3 KL on the sampled tokens with the skill in context, inside
the PPO steps (their gradients add up, so no extra optimizer step moves the weights), to the frozen start model's
teacher (--teacher-anchor-target start; exp14: it held the whole policy at the start, habit included) or to the
current student plus the start model's skill effect (effect: only the response to the skill is held).
--teacher-rl (beyond the paper, 0 = off) trains the teacher's context itself: the update's policy gradient once
more on the same sampled tokens with each row's own skill in the prompt (`teacher_rl`), since trained SEED models
play the probe's tasks worse with a skill, even the annotator's, than without one (docs/experiments.md, exp22).
--distill-center (beyond the paper, off) subtracts the update's mean delta, so only the skill's relative verdict on
the sampled tokens is distilled (`centered_teacher`).
"""
import random

import torch

import envs
import loss as L
import seed
import skills
from models.scoring import forward_logprobs, micro_batches, padded_logprobs, response_logprobs, response_mask

# the analyzer's step runs at 3x the RL rate: offline, from the version-10 start model, 20 explored steps (measured
# every 5) at the tiny rate 1e-4 left it as it was (greedy skills naming the fix: 4-7 of 29 habit failures from 5;
# 9-10 of the probe's 19 failures from 10), at 3e-4 they moved it a little (5-10 of 29; 9-12 of 19), and at 1e-3
# they broke it (34 of its 48 analyses no longer parsed after 20 steps)
ANALYZER_LR_SCALE = 3.0


def token_deltas(rows, teacher_logp, has_teacher):
    """delta (teacher minus the log-probs recorded while sampling) on the sampled tokens that had a teacher, and
    that mask -> ((B, R), (B, R)); 0 off the mask."""
    sampled = padded_logprobs(rows.sampled_logp)                                  # (B, R)
    width = min(sampled.shape[1], teacher_logp.shape[1])
    mask = response_mask(rows.responses)[:, :width] * has_teacher[:, None]        # (B, R)
    return (teacher_logp[:, :width] - sampled[:, :width]) * mask, mask


def trajectory_deltas(rows, teacher_logp, has_teacher):
    """Mean delta over each trajectory's sampled tokens that had a teacher -> {trajectory index: mean delta}."""
    delta, mask = token_deltas(rows, teacher_logp, has_teacher)                   # (B, R) each
    found = {}
    for row, index in enumerate(rows.trajectory):
        total, count = found.get(index, (0.0, 0.0))
        found[index] = (total + float(delta[row].sum()), count + float(mask[row].sum()))
    return {index: total / count for index, (total, count) in found.items() if count > 0}


def centered_teacher(rows, teacher_logp, has_teacher):
    """--distill-center: the teacher's log-probs shifted by one number so that delta averages 0 over the update's
    teacher tokens -> (B, R). A skill that lowers every command (the start model's own skill: -0.673 nats on an
    invalid command, -0.199 on a valid one) then pushes down only the commands it lowers more than average and
    the rest up, instead of making the student less sure of everything (exp16)."""
    delta, mask = token_deltas(rows, teacher_logp, has_teacher)                   # (B, R) each
    return teacher_logp - delta.sum() / mask.sum().clamp(min=1)


def analyzer_examples(kind, policy, start, cfg, trajectories, skill_list, texts, rows, teacher_logp,
                      has_teacher, seed_value=0):
    """The (analyzer prompt, completion) pairs of --analyzer-training `kind` for this update (see the module
    docstring); [] when none qualifies."""
    if kind == "anchor":
        start_skills, start_texts = seed.analyze(start, trajectories, cfg.analysis_prompt_tokens,
                                                 cfg.analysis_max_new_tokens, 0.0, desc="anchor analyses")
        chosen = [(t, text) for t, s, text in zip(trajectories, start_skills, start_texts) if s is not None]
    elif kind in ("confirmed", "explored", "confirmed-and-explored", "explored-where-wrong", "explored-balanced"):
        names_fix = envs.spec(cfg.env).names_fix
        check = envs.load(names_fix) if names_fix else (lambda trajectory, skill: None)
        pool = list(zip(trajectories, skill_list, texts)) if kind.startswith("confirmed") else []
        if kind != "confirmed":  # fresh sampled analyses of the failures (successes have nothing to fix)
            failed = [t for t, s in zip(trajectories, skill_list) if not t.won and (
                kind != "explored-where-wrong" or not check(t, s))] * cfg.explore_samples
            if failed:
                sampled_skills, sampled_texts = seed.analyze(policy, failed, cfg.analysis_prompt_tokens,
                                                             cfg.analysis_max_new_tokens, 1.0, desc="explored analyses")
                pool += zip(failed, sampled_skills, sampled_texts)
        chosen = [(t, text) for t, s, text in pool if s is not None and check(t, s)]
        if kind == "explored-balanced":  # each new fix beside one the analyzer already writes, at most half each
            missed = {id(t) for t, s in zip(trajectories, skill_list) if not t.won and not check(t, s)}
            new_fixes = [pair for pair in chosen if id(pair[0]) in missed]
            known_fixes = [pair for pair in chosen if id(pair[0]) not in missed]
            count = min(len(new_fixes), len(known_fixes), cfg.sft_batch_size // 2)
            draw = random.Random(seed_value)
            chosen = draw.sample(new_fixes, count) + draw.sample(known_fixes, count)
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


def teacher_anchor(coef, policy, start, rows, parts, cfg, seed_value=0, target="start", ref_logp=None):
    """seed.ppo_update's extra_loss for --teacher-anchor `coef`: the rows with a teacher, dealt at random into `parts`
    shares (one per PPO step); each call back-propagates coef x the token-mean k3 KL of the policy, the skill in
    context, to the target over the next share's sampled tokens (loss.seed_loss with zero advantages: only its KL
    term), and returns {"teacher_anchor_kl": that share's KL}. target "start": the start model's teacher log-probs
    (--teacher-anchor-target start); "effect": the log-probs recorded while sampling plus the start model's skill
    effect (its teacher's minus its student's), so the teacher keeps the start's response to the skill wherever the
    student has moved. Scored once, here; ref_logp (B, R), the start model's skill-free log-probs that re-scoring
    made for the KL term, spares "effect" a second pass over the same rows."""
    with_skill, prompts, responses = teacher_rows(policy, rows)
    score = lambda prompt_list, desc: response_logprobs(start.model, prompt_list, responses, start.pad_id,
                                                        cfg.temperature, cfg.layout, cfg.max_batch_tokens, desc)
    start_logp = score(prompts, "anchor: start teacher")                                         # (b, R)
    if target == "effect":  # the student as it is now, plus what the skill did to the start model
        student = score([rows.prompts[i] for i in with_skill], "anchor: start student") if ref_logp is None \
            else ref_logp[with_skill, :start_logp.shape[1]].cpu()                                   # (b, R)
        effect = start_logp - student                                                               # (b, R)
        start_logp = padded_logprobs([rows.sampled_logp[i] for i in with_skill]) + effect           # (b, R)
    elif target != "start":
        raise ValueError(f"unknown --teacher-anchor-target {target!r}")

    def micro_loss(logp, picked, micro_mask):  # (b, r) each; only seed_loss's KL term
        loss, metrics = L.seed_loss(logp, logp.detach(), torch.zeros(len(picked), device=logp.device), micro_mask,
                                    ref_logp=start_logp[picked, :logp.shape[1]].to(logp.device), kl_coef=coef,
                                    distill_coef=0.0)
        return loss, metrics["kl"]
    return teacher_context_steps(policy, prompts, responses, parts, cfg, seed_value, micro_loss, "teacher_anchor_kl")


def teacher_rl(coef, policy, rows, advantages, parts, cfg, seed_value=0):
    """seed.ppo_update's extra_loss for --teacher-rl `coef`: the update's policy gradient once more on the same
    sampled tokens, with each row's skill in its context, so RL trains the teacher's context as well as the
    student's (the paper trains only the skill-free one; after exp21/exp22's SEED runs the policy plays the probe's
    tasks worse with any skill in the prompt, the annotator's included, than without one). The skill was written
    about that very trajectory, so a success's workflow and a failure's warning are reinforced as what to follow.
    Rows as teacher_anchor deals them; old log-probs are the share's own (ratio 1: coef x A x grad log pi, token
    mean); returns {"teacher_rl_loss": that share's policy loss}. advantages (B,), the update's."""
    with_skill, prompts, responses = teacher_rows(policy, rows)
    scaled = coef * advantages[with_skill].float().cpu()                                           # (b,)

    def micro_loss(logp, picked, micro_mask):  # (b, r) each; only seed_loss's policy term
        loss, _ = L.seed_loss(logp, logp.detach(), scaled[picked].to(logp.device), micro_mask, distill_coef=0.0)
        return loss, loss.item()
    return teacher_context_steps(policy, prompts, responses, parts, cfg, seed_value, micro_loss, "teacher_rl_loss")


def teacher_rows(policy, rows):
    """The rows with a teacher: their indices, their prompts with the skill (encoded) and their sampled responses."""
    with_skill = [i for i, text in enumerate(rows.teacher_prompts) if text is not None]
    return (with_skill, [seed.encode_chat(policy.tokenizer, rows.teacher_prompts[i]) for i in with_skill],
            [rows.responses[i] for i in with_skill])


def teacher_context_steps(policy, prompts, responses, parts, cfg, seed_value, micro_loss, name):
    """The extra_loss both teacher terms share: the rows (prompts with the skill, responses) dealt at random into
    `parts` shares, one per PPO step (their gradients add to the step's, so no extra optimizer step moves the
    weights); each call back-propagates micro_loss(logp (b, r), rows picked, mask (b, r)) -> (token-mean loss,
    float) weighted so the micro-batches' token means sum to the share's, and returns {name: the share's float}."""
    order = random.Random(seed_value).sample(range(len(prompts)), len(prompts))
    shares = iter([order[part::parts] for part in range(parts)])

    def step():
        share = next(shares, [])  # a share per call; past the last, nothing
        mask = response_mask([responses[i] for i in share])                   # (s, R)
        total, value = mask.sum().clamp(min=1), 0.0
        for batch in micro_batches([prompts[i] for i in share], [responses[i] for i in share],
                                   cfg.max_batch_tokens):
            picked = [share[j] for j in batch]
            logp, _ = forward_logprobs(policy.model, [prompts[i] for i in picked],
                                       [responses[i] for i in picked], policy.pad_id, cfg.temperature,
                                       cfg.layout)                               # (b, r)
            micro_mask = mask[batch, :logp.shape[1]].to(logp.device)            # (b, r)
            loss, found = micro_loss(logp, picked, micro_mask)
            weight = float(micro_mask.sum() / total)  # micro-batch token means sum to the share's mean
            (loss * weight).backward()
            value += found * weight
        return {name: value}
    return step


def teacher_terms(cfg, policy, start, rows, advantages, parts, seed_value=0, ref_logp=None):
    """train.py's extra_loss for seed.ppo_update: --teacher-anchor and --teacher-rl, whichever are on (their
    metrics in one dict); None when both are off, the paper's protocol."""
    steps = [teacher_anchor(cfg.teacher_anchor, policy, start, rows, parts, cfg, seed_value, cfg.teacher_anchor_target,
                            ref_logp)] if cfg.teacher_anchor > 0 else []
    steps += [teacher_rl(cfg.teacher_rl, policy, rows, advantages, parts, cfg, seed_value)] \
        if cfg.teacher_rl > 0 else []
    return (lambda: {key: value for step in steps for key, value in step().items()}) if steps else None
