"""seed.py: the SEED method, top to bottom -- sample, roll out, self-analyze, re-score, update.

One RL update of SEED (train.py calls these functions in this order):
  1. rollout   N tasks x G rollouts with the ORDINARY prompt, live envs batched into one `sample`;
               the sampler records each response token, its log-prob and its mask (1 = sampled);
  2. analyze   the SAME weights read each finished trajectory (skills.analyzer_prompt) and write
               one hindsight skill; an output that does not parse gives that trajectory no teacher;
  3. re-score  `step_rows` makes one row per env step; `rescore` scores the SAME response tokens
               under the teacher prompt (skills.with_skill: the skill after the task line) and, with
               a KL term, under the reference model;
  4. advantage GRPO over each task's G episode scores, broadcast to every step of a trajectory;
  5. update    `ppo_update`: PPO-clip with A_t = A_grpo + lambda * delta_t (loss.seed_loss), where
               delta_t = log pi(y_t | teacher prompt) - log pi(y_t | prompt), in micro-batches.

Layout convention: every per-token tensor is response-aligned, (B, R) with R the longest response of
the batch, and `mask` is 1 exactly on policy-sampled tokens. The mask is made by the sampler;
prompts, observations and skill text never enter these tensors, so student and teacher rows align
token for token. The forward passes that score tokens are models/scoring.py.

Harness as verl-agent's: its prompt templates, the invalid-format penalty on the invalid step's own
row, GRPO statistics over the group's step rows. Departures from the paper: one PPO epoch split into
verl-style mini-batches; `step_advantages` can also scale by one std over the whole update (the tiny
preset's `--advantage-norm batch`) or take the statistics over episodes (`--grpo-stats
trajectories`); the update's forward runs with dropout off, as sampling and re-scoring do.
Command: see train.py.
"""
import torch
from tqdm.auto import tqdm

import envs
import loss as L
import skills
from models import vision
from models.scoring import (dropout_free, forward_logprobs, left_pad, micro_batches,
                            response_logprobs, response_mask)

# -------------------------------------------------------------------------- prompts and actions

# verl-agent's templates (agent_system/environments/prompts), spelling and spacing included: a
# no-history one for step 1 (and for history_window 0), one with the last k (observation, action)
INSTRUCTION = ("Now it's your turn to take an action.\nYou should first reason step-by-step about "
               "the current situation. This reasoning process MUST be enclosed within <think> "
               "</think> tags. \nOnce you've finished your reasoning, you should choose an "
               "admissible action for current step and present it within <action> </action> "
               "tags.\n")
ALFWORLD = "You are an expert agent operating in the ALFRED Embodied Environment."
SCREEN = "You are an expert agent operating a web page from its screenshot."  # ours
HISTORY = ("Prior to this step, you have already taken {count} step(s). Below are the most recent "
           "{shown} observaitons and the corresponding actions you took: {records}\n"  # (sic)
           "You are now at step {now} and your current observation is: {observation}")
WEBSHOP = ("\nYou are an expert autonomous agent operating in the WebShop e\u2011commerce "
           "environment.{space}\nYour task is to: {task}.\n{state}.\nYour admissible actions "
           "of the current situation are: \n[\n{actions}\n].\n\nNow it's your turn to take one "
           "action for the current step.\nYou should first reason step-by-step about the current "
           "situation, then think carefully which admissible action best advances the shopping "
           "goal. This reasoning process MUST be enclosed within <think> </think> tags. \nOnce "
           "you've finished your reasoning, you should choose an admissible action for current "
           "step and present it within <action> </action> tags.\n")


def render_prompt(task, history, observation, admissible, history_window=5, env_name="household"):
    """The user message for one step in verl-agent's format: ALFWorld's template (household,
    alfworld; the task is in the first observation), WebShop's (webshop), or for the screenshot envs
    ALFWorld's with their own header and the task on every step. history: (observation, action)."""
    recent = history[-history_window:] if history_window > 0 else []
    start = len(history) - len(recent)
    records = "\n".join(f"[Observation {start + i + 1}: '{o}', Action {start + i + 1}: '{a}']"
                        for i, (o, a) in enumerate(recent))
    past = HISTORY.format(count=len(history), shown=len(recent), records=records,
                          now=len(history) + 1, observation=observation)
    if env_name == "webshop":
        webshop_past = past.replace("observaitons", "observations")  # WebShop's template spells it
        state = webshop_past if recent else f"Your current observation is: {observation}"
        actions = "\n".join(f"'{a}'," for a in admissible)
        return WEBSHOP.format(space="" if recent else " ", task=task, state=state,
                              actions=actions)
    head = ALFWORLD if env_name in ("household", "alfworld") else SCREEN
    if head == SCREEN or recent:  # the screenshot envs' observation never states the task
        head += f" Your task is to: {task}"
    state = past if recent else f"Your current observation is: {observation}"
    actions = "\n ".join(f"'{a}'" for a in admissible if a != "help")
    return (f"\n{head}\n{state}\nYour admissible actions of the current situation are: "
            f"[{actions}].\n\n{INSTRUCTION}")


def response_is_valid(response):
    """verl-agent's rule for a step without the invalid-format penalty: a <think>...</think> and an
    <action>...</action> pair, and no Chinese characters."""
    think = response.find("<think>")
    has_think = think >= 0 and response.find("</think>", think) >= 0
    return (has_think and skills.action_bounds(response) is not None
            and not any("\u4e00" <= ch <= "\u9fff" for ch in response))


def parse_action(response):
    """The text inside the first <action>...</action>, stripped; None when there is no such pair."""
    bounds = skills.action_bounds(response)
    if bounds is None:
        return None
    return response[bounds[0] + len("<action>"):bounds[1] - len("</action>")].strip()


def encode_chat(tokenizer, user_text):
    """Token ids of one user turn plus the assistant header, through the model's own chat template.
    A message with a screenshot (models.vision.ImageText) gives ids carrying the pixels (ImageIds)."""
    if getattr(user_text, "image", None) is not None:
        return vision.encode_image_chat(tokenizer, user_text)
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------- sampling

@torch.no_grad()
def sample(policy, prompts, max_new_tokens, temperature=1.0, batch_size=64, desc=None, generator=None):
    """One response per prompt (list of id lists); temperature 0 is greedy. Returns (responses,
    logps): per row the sampled ids up to and including the first stop token, and the log-prob of
    each under softmax(logits / temperature) (greedy: temperature 1). `generator` (on the model's
    device) keeps evaluation from consuming the training RNG."""
    responses, logps = [None] * len(prompts), [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths pad less
    model, device = policy.model, policy.device
    was_training = model.training
    model.eval()
    stop = torch.tensor(policy.stop_ids, device=device)
    banned = torch.tensor(policy.banned_ids, dtype=torch.long, device=device)
    bar = tqdm(total=len(prompts), desc=desc, leave=False, disable=desc is None)
    for first in range(0, len(order), batch_size):
        rows = order[first:first + batch_size]
        ids, attention, positions = left_pad([prompts[i] for i in rows], policy.pad_id, device)
        images = vision.image_inputs(model, [prompts[i] for i in rows], ids, attention)  # {}: text
        positions = images.pop("position_ids", positions)              # (B, P) or M-RoPE (3, B, P)
        cache, step_input, step_positions = None, ids, positions
        alive = torch.ones(len(rows), dtype=torch.bool, device=device)  # (b,)
        tokens, token_logps, token_alive = [], [], []
        for _ in range(max_new_tokens):
            out = model(input_ids=step_input, attention_mask=attention, position_ids=step_positions,
                        use_cache=True, logits_to_keep=1, cache=cache, **images)
            images, cache = {}, out.cache  # the pixels go in with the prompt only
            logits = out.logits[:, -1].float()                          # (b, V)
            logits = torch.nan_to_num(logits, nan=0.0, posinf=1e4, neginf=-1e4)  # the update skips
            logprobs = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
            # banned ids (a VLM's vision tokens) are never drawn; recorded log-probs are the model's
            allowed = logprobs.index_fill(-1, banned, float("-inf")) if len(banned) else logprobs
            token = (torch.multinomial(allowed.exp(), 1, generator=generator).squeeze(-1) if temperature > 0
                     else allowed.argmax(-1))                           # (b,)
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
        for j, i in enumerate(rows):
            n = int(token_alive[j].sum())
            responses[i], logps[i] = tokens[j, :n].tolist(), token_logps[j, :n].tolist()
        bar.update(len(rows))
    bar.close()
    model.train(was_training)
    return responses, logps


# ------------------------------------------------------------------------ rollouts and analysis

def rollout(policy, env_list, task_seeds, group_size, max_steps, max_new_tokens=64, temperature=1.0,
            history_window=5, invalid_penalty=0.1, max_prompt_tokens=2048, batch_size=64,
            env_name="household", desc="rollout", generator=None, env_factory=None,
            env_timeout=None):
    """Play len(task_seeds) tasks x group_size rollouts together; env_list holds one env per
    rollout. Returns trajectories: {task, task_type, won, reward, steps, gt, group (task index),
    seed}, each step {observation, response, action, reward, valid, prompt, prompt_ids,
    response_ids, sampled_logp, truncated}. An env that raises or hangs (envs.call_env) ends its
    trajectory with 'dropped' = the reason (callers leave those out) and is replaced by
    env_factory(index)."""
    assert len(env_list) >= len(task_seeds) * group_size, "need one env per rollout"
    trajectories, live = [], []
    for task_index, task_seed in enumerate(task_seeds):
        for _ in range(group_size):
            index = len(trajectories)
            trajectory = {"task": "", "task_type": None, "won": False, "reward": 0.0, "steps": [],
                          "gt": None, "group": task_index, "seed": task_seed}
            trajectories.append(trajectory)
            live.append(None)
            try:
                observation, info = envs.call_env(env_list[index].reset, task_seed, env_timeout)
            except envs.EnvFailure as failure:
                trajectory["dropped"] = str(failure)
                envs.restart_env(env_list, index, env_factory, env_timeout)
                continue
            trajectory.update(task=info["task"], task_type=info.get("task_type"))
            live[-1] = {"env": env_list[index], "index": index, "obs": observation, "info": info,
                        "history": []}
    truncated = 0
    bar = tqdm(total=max_steps, desc=desc, leave=False)
    for _ in range(max_steps):
        active = [i for i, state in enumerate(live) if state is not None]
        if not active:
            break
        prompts, prompt_ids, cut = [], [], []
        for i in active:
            state = live[i]
            text = render_prompt(trajectories[i]["task"], state["history"],
                                 vision.observation_text(state["obs"]),
                                 state["info"].get("admissible", []), history_window, env_name)
            text = vision.user_message(text, state["obs"])  # the screenshot rides along, if any
            ids = encode_chat(policy.tokenizer, text)
            # over the budget keep the end (observation, instruction); an image prompt is never cut
            cut.append(len(ids) > max_prompt_tokens and not vision.has_images([ids]))
            if cut[-1]:
                ids, truncated = ids[-max_prompt_tokens:], truncated + 1
            prompts.append(text)
            prompt_ids.append(ids)
        responses, logps = sample(policy, prompt_ids, max_new_tokens, temperature, batch_size,
                                  generator=generator)
        sampled = zip(active, prompts, prompt_ids, responses, logps, cut)
        for i, text, ids, response, logp, was_cut in sampled:
            state, trajectory = live[i], trajectories[i]
            response_text = policy.tokenizer.decode(response, skip_special_tokens=True)
            action = parse_action(response_text)
            try:
                observation, reward, done, info = envs.step_env(state["env"], action or "",
                                                                env_timeout)
            except envs.EnvFailure as failure:
                trajectory["dropped"], live[i] = str(failure), None
                envs.restart_env(env_list, state["index"], env_factory, env_timeout)
                continue
            penalty = 0.0 if response_is_valid(response_text) else invalid_penalty  # on this step
            observed = vision.observation_text(state["obs"])
            trajectory["steps"].append({"observation": observed, "response": response_text,
                                        "action": action or "", "reward": float(reward) - penalty,
                                        "penalty": penalty, "valid": bool(info.get("valid", True))
                                        and action is not None,
                                        "prompt": text, "prompt_ids": ids, "response_ids": response,
                                        "sampled_logp": logp, "truncated": was_cut})
            trajectory["reward"] += float(reward)  # the episode's outcome, penalties apart
            state["history"].append((observed, action or ""))
            state["obs"], state["info"] = observation, info
            if done or len(trajectory["steps"]) >= max_steps:
                trajectory["won"], trajectory["gt"] = bool(info.get("won", False)), info.get("gt")
                live[i] = None
        bar.update(1)
    bar.close()
    for trajectory in trajectories:
        trajectory["truncated_prompts"] = truncated
    return trajectories


def analyze(policy, trajectories, max_prompt_tokens=1024, max_new_tokens=128, temperature=0.0,
            batch_size=32, desc="analyze"):
    """The current policy writes one hindsight skill per finished trajectory. Returns (skills,
    raw_outputs); a skill is None where the output could not be parsed."""
    count = lambda text: len(policy.tokenizer(text, add_special_tokens=False)["input_ids"])
    prompts = [encode_chat(policy.tokenizer, skills.analyzer_prompt(t, max_prompt_tokens, count))
               for t in trajectories]
    outputs, _ = sample(policy, prompts, max_new_tokens, temperature, batch_size, desc=desc)
    texts = [policy.tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
    return [skills.parse_skill(text, task=t["task"]) for text, t in zip(texts, trajectories)], texts


# ----------------------------------------------------------------------------------- re-scoring

def step_rows(trajectories, skill_per_trajectory=None):
    """One training row per step. Returns a dict of lists: prompts (ordinary prompt ids), responses,
    sampled_logp (recorded while sampling), teacher_prompts (text; None where the trajectory has no
    skill or the prompt was cut, so its task line is gone), trajectory (index)."""
    keys = ("prompts", "responses", "sampled_logp", "teacher_prompts", "trajectory")
    rows = {key: [] for key in keys}
    for index, trajectory in enumerate(trajectories):
        skill = skill_per_trajectory[index] if skill_per_trajectory else None
        for step in trajectory["steps"]:
            rows["prompts"].append(step["prompt_ids"])
            rows["responses"].append(step["response_ids"])
            rows["sampled_logp"].append(step["sampled_logp"])
            teacher = None  # the skill after the task line; a cut prompt lost that line: no teacher
            if skill is not None and not step.get("truncated", False):  # same screenshot, if any
                teacher = skills.with_skill(step["prompt"], skill)
                teacher = vision.same_image(step["prompt"], teacher)
            rows["teacher_prompts"].append(teacher)
            rows["trajectory"].append(index)
    return rows


def rescore(policy, rows, temperature=1.0, layout="padded", max_batch_tokens=16384, reference=None,
            need_old=True):
    """Old (ordinary prompt), teacher (skill prompt) and reference log-probs, (B, R) each, of the
    rows' response tokens under the current, not yet updated weights, and has_teacher (B,) bool.
    Teacher rows without a skill hold the old log-probs (delta exactly 0); ref is None without a
    reference model. need_old=False skips the student pass (old is None): with one PPO mini-batch
    the update's own forward runs on these same weights, so policy_update takes old = logp.detach()
    for free; teacher rows without a skill are then zeros, and has_teacher keeps them out of the
    loss."""
    score = lambda model, prompts, responses, desc: response_logprobs(
        model, prompts, responses, policy.pad_id, temperature, layout, max_batch_tokens, desc)
    old = None
    if need_old:
        old = score(policy.model, rows["prompts"], rows["responses"], "re-score student")
    teacher = old.clone() if need_old else response_mask(rows["responses"]) * 0.0  # (B, R)
    with_skill = [i for i, text in enumerate(rows["teacher_prompts"]) if text is not None]
    if with_skill:
        prompts = [encode_chat(policy.tokenizer, rows["teacher_prompts"][i]) for i in with_skill]
        responses = [rows["responses"][i] for i in with_skill]
        scored = score(policy.model, prompts, responses, "re-score teacher")  # (b, r)
        teacher[with_skill, :scored.shape[1]] = scored
    ref = None if reference is None else score(reference, rows["prompts"], rows["responses"],
                                               "re-score reference")
    has_teacher = torch.tensor([text is not None for text in rows["teacher_prompts"]])  # (B,)
    return old, teacher, ref, has_teacher


# -------------------------------------------------------------------- advantages and the update

def step_advantages(trajectories, rows, norm="group", stats="steps"):
    """GRPO advantage of every step row, (B,). A row's score is its episode's outcome reward minus
    its own step's invalid-format penalty (verl-agent). stats="steps": a group's (a task's G
    rollouts) mean and std over all its step rows (verl-agent's compute_mean_std_cross_steps);
    "trajectories": over its episodes' scores (outcome minus all penalties), broadcast to the rows.
    norm: "group" divides by the group std (GRPO); "batch" by one std over the update, so a group
    that only differs by a format penalty keeps advantages near 0; "none": Dr. GRPO."""
    index = torch.tensor(rows["trajectory"], dtype=torch.long)                  # (B,)
    penalty = torch.tensor([s.get("penalty", 0.0) for t in trajectories
                            for s in t["steps"]])                               # (B,)
    outcome = torch.tensor([t["reward"] for t in trajectories], dtype=torch.float32)  # (N,)
    groups = torch.tensor([t["group"] for t in trajectories])                  # (N,)
    if stats == "trajectories":
        episode_penalty = torch.zeros(len(trajectories)).index_add_(0, index, penalty)  # (N,)
        scores, group_of = outcome - episode_penalty, groups                   # (N,)
    elif stats == "steps":
        scores, group_of = outcome[index] - penalty, groups[index]             # (B,)
    else:
        raise ValueError(f"stats must be 'steps' or 'trajectories', got {stats!r}")
    centered = L.grpo_advantages(scores, group_of, norm_std=norm == "group")
    if norm == "batch" and centered.numel() > 1:
        centered = centered / (centered.std() + 1e-6)
    return centered[index] if stats == "trajectories" else centered            # (B,)


def skip_reason(prompts, advantages, *logps):
    """Why an update must not run (no rows; NaN/inf in an advantage or a re-scored log-prob, which
    would reach the weights), or None. Past the inputs, policy_update skips on a non-finite loss or
    gradient."""
    if not prompts:
        return "no rows to train on (every trajectory was dropped)"
    names = ("advantages", "old log-probs", "teacher log-probs", "reference log-probs")
    for name, value in zip(names, (advantages, *logps)):
        if value is not None and not torch.isfinite(value).all():
            rows = (~torch.isfinite(value)).reshape(len(value), -1).any(-1).sum()
            return f"non-finite {name} in {int(rows)} of {len(value)} rows"
    return None


def policy_update(policy, optimizer, prompts, responses, advantages, old_logp, teacher_logp=None,
                  ref_logp=None, has_teacher=None, loss_kwargs=None, temperature=1.0,
                  layout="padded", max_batch_tokens=16384, grad_clip=1.0, desc="update", sync=None):
    """One optimizer step over all rows with gradient accumulation. advantages (B,) per row; old,
    teacher and ref log-probs (B, R) response-aligned (old None: this forward's own detached
    log-probs, exact on unchanged weights); has_teacher (B,) marks the rows whose trajectory got a
    skill. Micro-batch losses are weighted so they sum to the full-batch loss (token-mean: by share
    of tokens; seq-mean-*: of rows). sync (torchrun, training/distributed.py): normalises by every
    rank's tokens and sums gradients and metrics over ranks before the step. Returns (metrics,
    skipped reason or None)."""
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
        for rows in tqdm(batches, desc=desc, leave=False):
            width = max(1, max(len(responses[i]) for i in rows))
            pick = lambda x: None if x is None else x[rows, :width].to(device)
            micro_mask = mask[rows, :width].to(device)                       # (b, r)
            weight = count(micro_mask) / total.clamp(min=1)
            logp, entropy = forward_logprobs(  # (b, r) each
                model, [prompts[i] for i in rows], [responses[i] for i in rows], policy.pad_id,
                temperature, layout, entropy=bool(loss_kwargs.get("entropy_coef", 0)))
            taught = None  # (b, r): 1 on the tokens of rows whose trajectory got a skill
            if has_teacher is not None:
                taught = micro_mask * has_teacher[rows].to(device)[:, None]
            old = logp.detach() if old_logp is None else pick(old_logp)  # same weights: ratio 1
            loss, metrics = L.seed_loss(logp, old, advantages[rows].to(device)[:, None], micro_mask,
                                        teacher_logp=pick(teacher_logp), ref_logp=pick(ref_logp),
                                        entropy=entropy, teacher_mask=taught, **loss_kwargs)
            if not torch.isfinite(loss):
                skipped = f"non-finite loss {loss.item()}"
                break
            (loss * weight).backward()
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value * float(weight)
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


def padded_logprobs(rows):
    """Per-token log-prob lists -> (B, R) tensor, zeros past each row's end (the mask's layout)."""
    width = max([1] + [len(row) for row in rows])
    padded = [row + [0.0] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=torch.float32).reshape(-1, width)  # (B, R)


def ppo_update(policy, optimizer, rows, advantages, teacher_logp=None, ref_logp=None,
               has_teacher=None, mini_batches=1, generator=None, **update_kwargs):
    """PPO over one rollout batch: the rows are shuffled into `mini_batches` parts, one optimizer
    step (policy_update) each, as verl's ppo_mini_batch_size does. One part: old = the update's own
    detached log-probs. Several: later parts run on moved weights, so the ratio uses the behaviour
    policy's log-probs recorded while sampling. Returns (metrics averaged over parts, skip reasons
    or None)."""
    count = len(rows["prompts"])
    # tensor_split gives exactly that many parts (chunk may give fewer): torchrun ranks step alike
    parts = [torch.arange(count)]
    if mini_batches > 1:
        order = torch.randperm(count, generator=generator)
        parts = order.tensor_split(max(1, min(mini_batches, count)))
    old_logp = padded_logprobs(rows["sampled_logp"]) if mini_batches > 1 else None  # (B, R)
    pick = lambda x, part: None if x is None else x[part]
    totals, reasons = {}, []
    for part in parts:
        indices = part.tolist()
        metrics, skipped = policy_update(
            policy, optimizer, [rows["prompts"][i] for i in indices],
            [rows["responses"][i] for i in indices], advantages[part], pick(old_logp, part),
            pick(teacher_logp, part), pick(ref_logp, part), pick(has_teacher, part),
            **update_kwargs)
        reasons += [skipped] if skipped else []
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value / len(parts)
    return totals, ("; ".join(reasons) or None)
