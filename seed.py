"""seed.py: the SEED method, top to bottom -- records, sample, roll out, self-analyze, re-score,
update, and the paper's stage 1. One RL update (train.py calls these in this order):
  1. rollout   N tasks x G rollouts with the ORDINARY prompt, live envs batched into one `sample`,
               which records each response token, its log-prob and its mask (1 = sampled);
  2. analyze   the SAME weights write one hindsight skill per finished trajectory; an output
               that does not parse gives that trajectory no teacher;
  3. re-score  one row per env step (`step_rows`); `rescore` scores the SAME response tokens under
               the teacher prompt (skills.with_skill) and, with a KL term, the reference model;
  4. advantage GRPO over each task's group, broadcast to the trajectory's step rows;
  5. update    `ppo_update`: PPO-clip plus loss.seed_loss's distillation term, in micro-batches.
Stage 1 (any model): skills.hindsight_examples pairs trajectories with an annotator's skills;
`stage1_sft` trains the analyzer on them. Every per-token tensor is response-aligned, (B, R), and
`mask` is 1 exactly on sampled tokens (made by the sampler), so student and teacher rows align
token for token; the forward passes are models/scoring.py. Harness as verl-agent's (each env's
template, the format penalty on its own row, GRPO statistics over step rows). Departures from the
paper: one PPO epoch in verl-style mini-batches; `step_advantages` can scale by one std over the
update (the tiny preset) or take episode statistics; the update's forward runs without dropout.
Command: see train.py.
"""
import collections
import dataclasses
import math
import random

import torch
from tqdm.auto import tqdm

import envs
import loss as L
import skills
from models import vision
from models.policy import parameter_groups
from models.scoring import (dropout_free, forward_logprobs, left_pad, micro_batches,
                            padded_logprobs, response_logprobs, response_mask)


# ------------------------------------------------------------------------------------ records

@dataclasses.dataclass
class Step:
    """One env step as the policy took it; reward is the env's minus this step's format penalty."""
    observation: str             # the text the policy saw
    response: str                # the sampled text
    action: str                  # what the env received ("" when the response had no action)
    reward: float = 0.0
    penalty: float = 0.0         # the invalid-format penalty of this step (verl-agent)
    valid: bool = True           # the env accepted the command and the response had one
    prompt: str = ""             # the user message (a vision.ImageText for a screenshot env)
    prompt_ids: list = None      # the ids the sampler was given
    response_ids: list = None    # the ids it sampled, and their log-probs at its temperature
    sampled_logp: list = None
    truncated: bool = False      # the prompt was cut to --max-prompt-tokens (task line gone)


@dataclasses.dataclass
class Trajectory:
    """One episode: reward is its outcome (penalties apart), group its task's index in the update
    (the GRPO group), gt the env's ground truth at the end, dropped why its env failed (if so)."""
    task: str = ""
    task_type: str = None
    won: bool = False
    reward: float = 0.0
    steps: list = dataclasses.field(default_factory=list)
    gt: dict = None
    group: int = 0
    seed: int = 0
    dropped: str = None


# an update's training rows, one per env step, as parallel lists (teacher_prompts: text, None where
# the trajectory has no teacher; trajectory: its index)
Rows = collections.namedtuple("Rows", "prompts responses sampled_logp teacher_prompts trajectory")


# ----------------------------------------------------------------------------------- sampling

def encode_chat(tokenizer, user_text):
    """Token ids of one user turn plus the assistant header, through the model's chat template.
    A message with a screenshot (models.vision.ImageText) gives ids carrying the pixels."""
    if getattr(user_text, "image", None) is not None:
        return vision.encode_image_chat(tokenizer, user_text)
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}],
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def sample(policy, prompts, max_new_tokens, temperature=1.0, batch_size=64, desc=None,
           generator=None):
    """One response per prompt (id lists); temperature 0 is greedy. Returns (responses, logps): the
    sampled ids up to and including the first stop token, and each one's log-prob under
    softmax(logits / temperature). `generator` keeps evaluation off the training RNG."""
    responses, logps = [None] * len(prompts), [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths pad less
    model, device = policy.model, policy.device
    was_training = model.training
    model.eval()
    stop = torch.tensor(policy.stop_ids, device=device)
    banned = torch.tensor(policy.banned_ids, dtype=torch.long, device=device)
    bar = tqdm(total=len(prompts), desc=desc, leave=False, disable=desc is None)
    for first in range(0, len(order), batch_size):
        batch = order[first:first + batch_size]
        ids, attention, positions = left_pad([prompts[i] for i in batch], policy.pad_id, device)
        images = vision.image_inputs(model, [prompts[i] for i in batch], ids, attention)  # {}: text
        positions = images.pop("position_ids", positions)          # (B, P) or M-RoPE (3, B, P)
        cache, step_input, step_positions = None, ids, positions
        alive = torch.ones(len(batch), dtype=torch.bool, device=device)  # (b,)
        tokens, token_logps, token_alive = [], [], []
        for _ in range(max_new_tokens):
            out = model(input_ids=step_input, attention_mask=attention, position_ids=step_positions,
                        use_cache=True, logits_to_keep=1, **{policy.cache_name: cache}, **images)
            images, cache = {}, getattr(out, policy.cache_name)  # the pixels go in with the prompt only
            logits = out.logits[:, -1].float()                          # (b, V)
            logits = torch.nan_to_num(logits, nan=0.0, posinf=1e4, neginf=-1e4)  # the update skips
            logprobs = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
            # banned ids (a VLM's vision tokens) are never drawn; recorded log-probs are the model's
            allowed = logprobs.index_fill(-1, banned, float("-inf")) if len(banned) else logprobs
            if temperature > 0:
                token = torch.multinomial(allowed.exp(), 1, generator=generator).squeeze(-1)  # (b,)
            else:
                token = allowed.argmax(-1)                                  # (b,)
            token = torch.where(alive, token, torch.full_like(token, policy.pad_id))
            tokens.append(token)
            token_logps.append(logprobs.gather(-1, token[:, None]).squeeze(-1))
            token_alive.append(alive.clone())                          # the mask is made here
            alive &= ~torch.isin(token, stop)
            if not alive.any():
                break
            step_input = token[:, None]
            step_positions = step_positions[..., -1:] + 1
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        tokens, token_logps, token_alive = (torch.stack(x, 1).cpu()        # (b, r) each
                                            for x in (tokens, token_logps, token_alive))
        for j, i in enumerate(batch):
            n = int(token_alive[j].sum())
            responses[i], logps[i] = tokens[j, :n].tolist(), token_logps[j, :n].tolist()
        bar.update(len(batch))
    bar.close()
    model.train(was_training)
    return responses, logps


# ---------------------------------------------------------------------- rollouts and analysis

def rollout(policy, env_list, task_seeds, group_size, max_steps, template, max_new_tokens=64,
            temperature=1.0, history_window=5, invalid_penalty=0.1, max_prompt_tokens=2048,
            batch_size=64, desc="rollout", generator=None, env_factory=None, env_timeout=None,
            skill_per_rollout=None):
    """len(task_seeds) tasks x group_size rollouts played together (one env of env_list each) ->
    Trajectory records. An env that raises or hangs ends its trajectory with `dropped` = why
    (callers leave those out) and is replaced by env_factory(index). skill_per_rollout: a skill (or
    None) in each rollout's prompts, as in the teacher context (the self-analysis probe's play)."""
    assert len(env_list) >= len(task_seeds) * group_size, "need one env per rollout"
    trajectories, live, tags = [], [], template.get("tags", ("action",))
    for task_index, task_seed in enumerate(task_seeds):
        for _ in range(group_size):
            index = len(trajectories)
            trajectory = Trajectory(group=task_index, seed=task_seed)
            trajectories.append(trajectory)
            live.append(None)
            try:
                observation, info = envs.call_env(env_list[index].reset, task_seed, env_timeout)
            except envs.EnvFailure as failure:
                trajectory.dropped = str(failure)
                envs.restart_env(env_list, index, env_factory, env_timeout)
                continue
            trajectory.task, trajectory.task_type = info["task"], info.get("task_type")
            live[-1] = {"env": env_list[index], "index": index, "obs": observation, "info": info,
                        "history": []}
    bar = tqdm(total=max_steps, desc=desc, leave=False)
    for _ in range(max_steps):
        active = [i for i, state in enumerate(live) if state is not None]
        if not active:
            break
        prompts, prompt_ids, cut = [], [], []
        for i in active:
            state = live[i]
            text = skills.render_prompt(template, trajectories[i].task, state["history"],
                                 vision.observation_text(state["obs"]),
                                 state["info"].get("admissible", []), history_window)
            if skill_per_rollout and skill_per_rollout[i]:
                text = skills.with_skill(text, skill_per_rollout[i])
            if policy.sees_images:  # the screenshot rides along, if there is one
                text = vision.user_message(text, state["obs"])
            ids = encode_chat(policy.tokenizer, text)
            # over the budget keep the end (observation, instruction); an image prompt is never cut
            cut.append(len(ids) > max_prompt_tokens and not vision.has_images([ids]))
            prompts.append(text)
            prompt_ids.append(ids[-max_prompt_tokens:] if cut[-1] else ids)
        responses, logps = sample(policy, prompt_ids, max_new_tokens, temperature, batch_size,
                                  generator=generator)
        for i, text, ids, response, logp, was_cut in zip(active, prompts, prompt_ids, responses,
                                                          logps, cut):
            state, trajectory = live[i], trajectories[i]
            response_text = policy.tokenizer.decode(response, skip_special_tokens=True)
            action = skills.parse_action(response_text, tags)
            try:
                observation, reward, done, info = envs.step_env(state["env"], action or "",
                                                                env_timeout)
            except envs.EnvFailure as failure:
                trajectory.dropped, live[i] = str(failure), None
                envs.restart_env(env_list, state["index"], env_factory, env_timeout)
                continue
            valid = skills.response_is_valid(response_text, tags)
            penalty = 0.0 if valid else invalid_penalty  # on this step's own row
            observed = vision.observation_text(state["obs"])
            trajectory.steps.append(Step(
                observation=observed, response=response_text, action=action or "",
                reward=float(reward) - penalty, penalty=penalty, prompt=text, prompt_ids=ids,
                valid=bool(info.get("valid", True)) and action is not None,
                response_ids=response, sampled_logp=logp, truncated=was_cut))
            trajectory.reward += float(reward)  # the episode's outcome, penalties apart
            state["history"].append((observed, action or ""))
            state["obs"], state["info"] = observation, info
            if done or len(trajectory.steps) >= max_steps:
                trajectory.won, trajectory.gt = bool(info.get("won", False)), info.get("gt")
                live[i] = None
        bar.update(1)
    bar.close()
    return trajectories


def analyze(policy, trajectories, max_prompt_tokens=1024, max_new_tokens=128, temperature=0.0,
            batch_size=32, desc="analyze"):
    """The policy writes one hindsight skill per finished trajectory. Returns (skills,
    raw_outputs); a skill is None where the output could not be parsed."""
    prompts = [encode_chat(policy.tokenizer, skills.analyzer_prompt(t, max_prompt_tokens,
                                                                    policy.count_tokens))
               for t in trajectories]
    outputs, _ = sample(policy, prompts, max_new_tokens, temperature, batch_size, desc=desc)
    texts = [policy.tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
    return [skills.parse_skill(text, task=t.task) for text, t in zip(texts, trajectories)], texts


# ------------------------------------------------------------ stage 1: hindsight-skill SFT

def supervised_step(policy, optimizer, examples, max_batch_tokens=16384, grad_clip=1.0,
                    prompt_weight=0.0, layout="padded"):
    """One SFT step on (prompt_text, completion_text) pairs: token-mean NLL of the completion plus
    end-of-turn; prompt_weight > 0 adds that times the LM loss on the prompt (the tiny warm-up's
    stand-in for pretraining). Returns the completion loss; a non-finite one skips the step."""
    tokenizer, model = policy.tokenizer, policy.model
    stop = policy.stop_ids[0] if policy.stop_ids else tokenizer.eos_token_id
    prompts = [encode_chat(tokenizer, p) for p, _ in examples]
    completions = [tokenizer(c, add_special_tokens=False)["input_ids"] + [stop]
                   for _, c in examples]
    prompt_part = torch.zeros(len(prompts), dtype=torch.long)  # scored tokens of the prompt
    if prompt_weight > 0:  # score the whole sequence after its first token
        completions = [p[1:] + c for p, c in zip(prompts, completions)]
        prompt_part = torch.tensor([len(p) - 1 for p in prompts])
        prompts = [p[:1] for p in prompts]
    mask = response_mask(completions)                                                # (B, R)
    is_prompt = (torch.arange(mask.shape[1])[None] < prompt_part[:, None]).float()  # (B, R)
    answer = mask * (1 - is_prompt) / (mask * (1 - is_prompt)).sum()                 # (B, R)
    weights = answer + prompt_weight * is_prompt / is_prompt.sum().clamp(min=1)      # (B, R)
    value = 0.0
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for batch in micro_batches(prompts, completions, max_batch_tokens):
        logp, _ = forward_logprobs(model, [prompts[i] for i in batch],
                                   [completions[i] for i in batch], policy.pad_id, layout=layout)
        width = logp.shape[1]
        (-(logp * weights[batch, :width].to(logp.device)).sum()).backward()     # logp (b, r)
        value += float(-(logp.detach() * answer[batch, :width].to(logp.device)).sum())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if math.isfinite(value) and torch.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value


def stage1_sft(policy, examples, epochs=3, batch_size=16, lr=1e-5, max_batch_tokens=16384,
               seed_value=0):
    """Stage 1: `epochs` passes over (analyzer prompt, skill JSON) examples in shuffled batches,
    AdamW at `lr`, so the policy can analyze trajectories before RL. Returns the last loss."""
    optimizer = torch.optim.AdamW(parameter_groups(policy.model, lr), lr=lr, weight_decay=0.0)
    layout = "padded" if policy.sees_images else "packed"  # packed rows: text models only
    rng, losses = random.Random(seed_value), []
    for epoch in range(epochs):
        order = rng.sample(range(len(examples)), len(examples))
        batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        losses = [supervised_step(policy, optimizer, [examples[i] for i in batch],
                                  max_batch_tokens, layout=layout)
                  for batch in tqdm(batches, desc=f"stage 1, epoch {epoch + 1}", leave=False)]
    return sum(losses) / max(1, len(losses))


# ---------------------------------------------------------------------------------- re-scoring

def step_rows(trajectories, skill_per_trajectory=None):
    """One training row per step (Rows). The teacher prompt is None where the trajectory has no
    skill or the step's prompt was cut (its task line, where the skill goes, is gone)."""
    rows = Rows([], [], [], [], [])
    for index, trajectory in enumerate(trajectories):
        skill = skill_per_trajectory[index] if skill_per_trajectory else None
        for step in trajectory.steps:
            rows.prompts.append(step.prompt_ids)
            rows.responses.append(step.response_ids)
            rows.sampled_logp.append(step.sampled_logp)
            teacher = None  # the skill after the task line; the same screenshot, if any
            if skill is not None and not step.truncated:
                teacher = vision.same_image(step.prompt, skills.with_skill(step.prompt, skill))
            rows.teacher_prompts.append(teacher)
            rows.trajectory.append(index)
    return rows


def rescore(policy, rows, temperature=1.0, layout="padded", max_batch_tokens=16384,
            reference=None, need_old=True):
    """Old (ordinary prompt), teacher (skill prompt) and reference log-probs, (B, R) each, of the
    rows' response tokens under the not yet updated weights, and has_teacher (B,). Rows without a
    skill hold the old log-probs (delta 0); ref is None without a reference model. need_old=False
    skips the student pass (old None; the update's own forward gives it): rows without a skill are
    then zeros, and has_teacher keeps them out of the loss."""
    score = lambda model, prompts, responses, desc: response_logprobs(
        model, prompts, responses, policy.pad_id, temperature, layout, max_batch_tokens, desc)
    old = score(policy.model, rows.prompts, rows.responses, "student") if need_old else None
    teacher = old.clone() if need_old else response_mask(rows.responses) * 0.0  # (B, R)
    with_skill = [i for i, text in enumerate(rows.teacher_prompts) if text is not None]
    if with_skill:
        prompts = [encode_chat(policy.tokenizer, rows.teacher_prompts[i]) for i in with_skill]
        responses = [rows.responses[i] for i in with_skill]
        scored = score(policy.model, prompts, responses, "re-score teacher")  # (b, r)
        teacher[with_skill, :scored.shape[1]] = scored
    ref = None if reference is None else score(  # (B, R) under the reference model, for the KL term
        reference, rows.prompts, rows.responses, "re-score reference")
    has_teacher = torch.tensor([text is not None for text in rows.teacher_prompts])  # (B,)
    return old, teacher, ref, has_teacher


# ---------------------------------------------------------------- advantages and the update

def step_advantages(trajectories, rows, norm="group", stats="steps"):
    """GRPO advantage of every step row, (B,): its episode's outcome minus its own step's format
    penalty (verl-agent), centred by its group's (a task's G rollouts) mean over all step rows
    (stats="steps", verl-agent's compute_mean_std_cross_steps) or over episode scores broadcast to
    the rows ("trajectories"). norm: "group" divides by the group std (GRPO); "batch" by one std
    over the update, so a group that differs by a format penalty stays near 0; "none": Dr. GRPO."""
    index = torch.tensor(rows.trajectory, dtype=torch.long)                        # (B,)
    penalty = torch.tensor([s.penalty for t in trajectories for s in t.steps])     # (B,)
    outcome = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)  # (N,)
    groups = torch.tensor([t.group for t in trajectories])                         # (N,)
    if stats == "trajectories":
        episode_penalty = torch.zeros(len(trajectories)).index_add_(0, index, penalty)  # (N,)
        scores, group_of = outcome - episode_penalty, groups                       # (N,)
    elif stats == "steps":
        scores, group_of = outcome[index] - penalty, groups[index]                 # (B,)
    else:
        raise ValueError(f"stats must be 'steps' or 'trajectories', got {stats!r}")
    centered = L.grpo_advantages(scores, group_of, norm_std=norm == "group")
    if norm == "batch" and centered.numel() > 1:
        centered = centered / (centered.std() + 1e-6)
    return centered[index] if stats == "trajectories" else centered                # (B,)


def skip_reason(prompts, advantages, *logps):
    """Why an update must not run (no rows; NaN/inf in an advantage or a re-scored log-prob, which
    would reach the weights), or None; policy_update also skips a non-finite loss or gradient."""
    if not prompts:
        return "no rows to train on (every trajectory was dropped)"
    names = ("advantages", "old log-probs", "teacher log-probs", "reference log-probs")
    for name, value in zip(names, (advantages, *logps)):
        if value is not None and not torch.isfinite(value).all():
            bad = (~torch.isfinite(value)).reshape(len(value), -1).any(-1).sum()
            return f"non-finite {name} in {int(bad)} of {len(value)} rows"
    return None


def policy_update(policy, optimizer, prompts, responses, advantages, old_logp, teacher_logp=None,
                  ref_logp=None, has_teacher=None, loss_kwargs=None, temperature=1.0,
                  layout="padded", max_batch_tokens=16384, grad_clip=1.0, desc="update", sync=None,
                  extra_loss=None):
    """One optimizer step over all rows with gradient accumulation. advantages (B,); old, teacher,
    ref log-probs (B, R) (old None: this forward's own detached ones, exact on unchanged weights);
    has_teacher (B,): rows whose trajectory got a skill. Micro-batch losses are weighted to sum to
    the full-batch loss. sync (torchrun): normalises by every rank's tokens and sums gradients and
    metrics over ranks. extra_loss(): back-propagates one more term into this step and returns its
    metrics (--teacher-anchor, training/analyzer.py). Returns (metrics, skipped reason or None)."""
    loss_kwargs = dict(loss_kwargs or {})
    model, device = policy.model, policy.device
    model.train()
    mask = response_mask(responses)                                      # (B, R)
    per_row = loss_kwargs.get("agg", "token-mean") != "token-mean"
    count = lambda m: (m.sum(1) > 0).sum() if per_row else m.sum()  # what the aggregation averages
    total = count(mask) if sync is None else sync.total(count(mask).to(device))
    totals, skipped = {}, skip_reason(prompts, advantages, old_logp, teacher_logp, ref_logp)
    optimizer.zero_grad(set_to_none=True)
    batches = [] if skipped else micro_batches(prompts, responses, max_batch_tokens)
    with dropout_free(model):  # the update's log-probs equal the eval-mode ones of re-scoring
        for batch in tqdm(batches, desc=desc, leave=False):
            width = max(1, max(len(responses[i]) for i in batch))
            pick = lambda x: None if x is None else x[batch, :width].to(device)
            micro_mask = mask[batch, :width].to(device)                      # (b, r)
            weight = count(micro_mask) / total.clamp(min=1)
            logp, entropy = forward_logprobs(  # (b, r) each
                model, [prompts[i] for i in batch], [responses[i] for i in batch], policy.pad_id,
                temperature, layout, entropy=bool(loss_kwargs.get("entropy_coef", 0)))
            taught = None if has_teacher is None else \
                micro_mask * has_teacher[batch].to(device)[:, None]  # (b, r): 1 where a skill came
            old = logp.detach() if old_logp is None else pick(old_logp)  # same weights: ratio 1
            loss, metrics = L.seed_loss(logp, old, advantages[batch].to(device)[:, None],
                                        micro_mask, teacher_logp=pick(teacher_logp),
                                        ref_logp=pick(ref_logp), entropy=entropy,
                                        teacher_mask=taught, **loss_kwargs)
            if not torch.isfinite(loss):
                skipped = f"non-finite loss {loss.item()}"
                break
            (loss * weight).backward()
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value * float(weight)
        if extra_loss is not None and skipped is None:  # its gradients join this step's
            totals.update(extra_loss())
    if sync is not None:  # a skip still reaches here, so every torchrun rank skips together
        skipped = sync.gradients(model, totals, skipped)
    grad_norm = None if skipped else torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if skipped is None and not torch.isfinite(grad_norm):
        skipped = f"non-finite gradient norm {grad_norm.item()}"
    if skipped is None:
        optimizer.step()
        totals["grad_norm"] = float(grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return totals, skipped


def ppo_update(policy, optimizer, rows, advantages, teacher_logp=None, ref_logp=None,
               has_teacher=None, mini_batches=1, generator=None, **update_kwargs):
    """PPO over one rollout batch: rows shuffled into `mini_batches` parts, one optimizer step each
    (verl's ppo_mini_batch_size). One part: old = the update's own detached log-probs; several:
    later parts run on moved weights, so the ratio uses the log-probs recorded while sampling.
    Returns (metrics averaged over parts, skip reasons or None)."""
    count = len(rows.prompts)
    # tensor_split gives exactly that many parts (chunk may give fewer): torchrun ranks step alike
    parts = [torch.arange(count)]
    if mini_batches > 1:
        order = torch.randperm(count, generator=generator)
        parts = order.tensor_split(max(1, min(mini_batches, count)))
    old_logp = padded_logprobs(rows.sampled_logp) if mini_batches > 1 else None  # (B, R)
    pick = lambda x, part: None if x is None else x[part]
    totals, reasons = {}, []
    for part in parts:
        indices = part.tolist()
        metrics, skipped = policy_update(
            policy, optimizer, [rows.prompts[i] for i in indices],
            [rows.responses[i] for i in indices], advantages[part], pick(old_logp, part),
            pick(teacher_logp, part), pick(ref_logp, part), pick(has_teacher, part),
            **update_kwargs)
        reasons += [skipped] if skipped else []
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value / len(parts)
    return totals, ("; ".join(reasons) or None)
