"""
warmup/warm_start.py: what a pretrained instruct model brings, taught to the tiny model; and stage-1 SFT.

`--model tiny` starts from random weights, so before RL it is taught, by supervised learning on
demonstrations in the real prompt format, the three things SEED assumes an instruct model can do:
  1. act: behaviour cloning of the household expert (a searching expert that does not know where things
     are) on states visited by an epsilon-noisy version of it, so the data covers recoveries; on heat/cool/
     clean tasks 60% of the demonstrators have a bad habit (they skip that step), which the greedy warm-start
     inherits: the room RL has to improve, measured by habit_probe in every household evaluation;
  2. follow a skill: the same prompts with a hindsight skill inserted (skills.with_skill), labelled with
     an oracle expert that knows what the skill says (where the object was), plus contrast pairs (a habit
     step's prompt labelled with the habit, the same prompt with its skill labelled right), so a skill in the
     context changes the action the way it would for an instruct model (the decision moves by 0.53);
  3. analyze: stage-1 SFT on (skills.analyzer_prompt -> annotator.annotate) for successes and failures.
The result is cached under --cache-dir keyed by the settings, so later runs start from it at once.
Stage 1 for any model (`stage1_sft`) is step 3 alone, on the annotator's outputs or a user's JSONL.

Departures from the paper: the paper starts from Qwen2.5-Instruct and annotates with a strong LLM; the
tiny model's warm-up and the rule-based annotator stand in for both, and the planted habit stands in for the
instruct model's own wrong priors about an environment it has never seen. Run: python train.py (calls this).
"""
import functools
import glob
import hashlib
import json
import math
import os
import random
import shutil

import torch
from tqdm.auto import tqdm

import envs
import seed
import skills
from models import tiny, vision
from simulators.household import TRANSFORMS, kind_of
from training.checkpoints import atomic_folder
from warmup.annotator import annotate, read_jsonl, vision_annotations

WARMUP_VERSION = 8  # bump when the demonstrations or the model change, so stale caches are not reused
# (5: verl-agent's exact prompt templates; 6: the skill side of the pairs alone, measured, not kept; 7: contrast
# pairs, the habit's steps with and without its skill; 8: TEXT_INIT_STD)
# the text model's initial weight std, 4x Qwen2's 0.02: at 0.02 a tiny model sits on a saddle before it learns to
# copy from its prompt (experiments/recall_probe.py: 0.33 vs 0.69 after 2,000 steps, 3 seeds); on the household
# demo RL then gains more, 3 seeds at 320 episodes: SEED +0.187, GRPO +0.090 valid_seen success, against +0.104 /
# +0.056 at 0.02 (docs/experiments.md). The vision warm-up keeps 0.02: on its cell probe 0.08 changed nothing
TEXT_INIT_STD = 0.08
HABIT_TASKS = ("pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_clean_then_place_in_recep")
# share of those tasks' demonstrations with the skip habit: above one half, so the warm-started greedy policy
# has the habit (RL's room to improve) while sampled rollouts still find the right workflow often
HABIT_RATE = 0.6
# how often each contrast pair (a habit step with and without its skill) enters the skill-following examples:
# measured skill lift on valid_seen: 0.094 without pairs, 0.216 with the skill side once, 0.529 with both sides x 3
CONTRAST_COPIES = 3
# warm-starts shipped with the repository (the default's, so a first run skips the ~16-minute build); one is used
# when its settings match the run's exactly, unless --build-warm-start
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "warm_starts")
VISION_ENVS = ("vision", "miniwob")  # screenshot observations: the tiny model is a Qwen2-VL (models/tiny.py)
SCREEN_VERSION = 9  # bumped with the screenshot warm-up alone, so the household caches stay valid
# (2: large cell numbers, white -> 0 pixel normalisation, lr 1e-3 and beta2 0.95; 3: the think names the target's
# look right before its cell number, VISION_LR_SCALE, drills, VISION_INIT_STD; 4: the screenshot after the text;
# 5: a failure's skill names the wrong click, not the target's cell; 6: a success's names cells, not looks;
# 7: skills without the quoted task, not kept; 8: skill_drills; 9: task_drills, the think names what the task
# names, DRILL_STEPS 1600)
# the vision tower trains at a tenth of the language model's rate: at the same rate its features collapse within
# the first steps and the policy never learns which item the instruction names (docs/vision.md: a 4-item cell
# probe read 0.21 at 600 steps at the same rate, 0.60 at a tenth)
VISION_LR_SCALE = 0.1
# the screenshot warm-up's first steps are drills: "Click the red circle." among 4 shapes (screen_drills) and the
# env's own tasks of every family (task_drills), answered in the demonstrations' format, short prompts that teach
# the hop from the named words to the cell before the long verl-agent prompts (docs/vision.md: after 800 drill
# steps 600 behaviour-cloning steps read 0.458 / 0.312 greedy valid_seen / valid_unseen success, against 0.312 /
# 0.125 after 600 without drills; on 144 tasks, warm-up seed 0, version 9's 1,600 steps of both kinds 0.771 /
# 0.597, version 8's 800 of the first kind 0.562 / 0.375; version 9's seed 1 0.549 / 0.451)
DRILL_STEPS, DRILL_SHAPES = 1600, 4
# and the screenshot model's language model starts from VISION_INIT_STD (the same probe: 0.417 / 0.188 at 0.02)
VISION_INIT_STD = 0.08
# skill-following examples in which the skill, not the screenshot, decides the click (skill_drills)
SKILL_DRILLS = 1000


# ----------------------------------------------------------------------------- demonstrations

def demonstration_env(cfg, options, seed_value):
    """The env whose expert plays the demonstrations: the run's own env on its train split (ALFWorld's
    through the engine's planner, on synthetic games when no data is installed)."""
    extra = {"expert_plan": True} if cfg.env == "alfworld" else {}
    return envs.make_env(cfg.env, "train", seed_value, **options, **extra)


WEBSHOP_SUBGOALS = (("search[", "search for the product"), ("click[buy now]", "buy the item"),
                    ("click[b0", "open a matching item"), ("click[", "choose what the goal asks"))


def subgoal(gt, holding, transformed, action=""):
    """A short reasoning text for the expert's <think>: the current subgoal."""
    if gt.get("env") == "vision" and action.startswith("click "):
        cell = int(action.split()[1])
        look = gt.get("items", {}).get(cell)
        if look:  # " red circle7": the look the instruction picks out, then its cell, so the number's first digit
            # is predicted right after the words it matches; where the instruction names only the colour or only
            # the shape, only that word (" red7"), so no second hop reads the other off the pixels first
            named = {"click-color": look[:1], "click-sequence": look[:1], "click-shape": look[1:],
                     "click-all": look[1:]}.get(gt.get("task_type"), look)
            return " " + " ".join(named) + str(cell)
    if gt.get("env") in ("vision", "miniwob"):
        return "find what the task names in the screenshot"
    if gt.get("env") == "webshop":
        return next(text for prefix, text in WEBSHOP_SUBGOALS + (("", "shop"),) if action.startswith(prefix))
    obj = gt.get("goal_object") or "object"
    if not holding:
        return f"find the {obj}"
    verb = TRANSFORMS.get(gt.get("task_type"), (None,))[0]
    if verb and not transformed:
        return f"{verb} the {obj}"
    if gt.get("task_type") == "look_at_obj_in_light":
        return "find the desklamp"
    return f"put the {obj} in the {gt.get('goal_receptacle') or 'target'}"


def expert_episode(env, task_seed, epsilon, rng, history_window, env_name="household", skill=None, habit_rate=0.0):
    """Play one episode with the env's expert. The executed action is the expert's with probability
    1 - epsilon (else a random admissible one; and with probability epsilon / 2 a command that was admissible
    earlier but is not now, which the env answers "Nothing happens."); every step is labelled with the
    expert's own choice, so the data shows how to recover from a random or an invalid command.
    habit_rate: on heat/cool/clean tasks, the chance that this episode's demonstrator has the bad habit of
    skipping that step (envs expert skip_transform); its labels carry the object straight to the target and
    the demonstration stops at that placement (the demonstrator thinks it is done), so the policy learns the
    habit as a habit and never sees it repaired. RL has to unlearn it; a skill that says "heat it first" (the
    skill-following demonstrations never have the habit) shows how.
    With `skill`, the oracle expert acts (it knows where objects are, as the skill tells) and prompts
    carry the skill block. Returns (trajectory, labelled examples [(prompt, response)], corrections): for a
    habit episode, the steps whose habit label differs from the right one, as (prompt, right response), which
    demonstrations() pairs with the episode's own skill; else []."""
    observation, info = env.reset(task_seed)
    habit = info.get("task_type") in HABIT_TASKS and rng.random() < habit_rate and skill is None  # a skill cures it
    oracle = skill is not None

    def expert(noise, noise_rng=None, skip=habit):  # skip_transform only where needed: other envs' experts lack it
        return env.expert_action(noise, noise_rng, oracle=oracle, **({"skip_transform": True} if skip else {}))

    trajectory = {"task": info["task"], "task_type": info.get("task_type"), "won": False, "reward": 0.0,
                  "steps": [], "gt": None}
    history, examples, pending, done, earlier = [], [], [], False, set()
    while not done:
        prompt = vision.user_message(seed.render_prompt(info["task"], history, vision.observation_text(observation),
                                                     info.get("admissible", []), history_window, env_name), observation)
        best = expert(0.0)
        right = expert(0.0, skip=False) if habit else best  # what a demonstrator without the habit does
        skipping = habit and best.startswith("move ") and best != right
        action = best if skipping else expert(epsilon, rng)
        admissible = set(info.get("admissible", []))
        stale = sorted(earlier - admissible)  # once admissible, not now: "go to" where it stands, a gone object
        if stale and not skipping and rng.random() < epsilon / 2:
            action = rng.choice(stale)  # an invalid command ("Nothing happens."), so the data shows recoveries
        earlier |= admissible
        pending.append((prompt if skill is None else vision.same_image(prompt, skills.with_skill(prompt, skill)), best,
                        action, right))
        previous = vision.observation_text(observation)
        observation, reward, done, info = env.step(action)
        trajectory["steps"].append({"observation": previous, "action": action, "reward": float(reward),
                                    "valid": bool(info.get("valid", True)), "response": None})
        trajectory["reward"] += float(reward)
        history.append((previous, action))
        while skipping and not done:  # the habit's placement ends the demonstration; "look" runs out the
            observation, _, done, info = env.step("look")  # clock unrecorded, for the env's ground truth
    trajectory["won"], trajectory["gt"] = bool(info.get("won")), info.get("gt") or {}
    # the <think> text needs the goal from the ground truth, known at the end: fill responses now
    holding = transformed = False
    corrections = []
    for step, (prompt, best, action, right) in zip(trajectory["steps"], pending):
        think = subgoal(trajectory["gt"], holding, transformed or habit, best.lower())
        examples.append((prompt, f"<think>{think}</think><action>{best}</action>"))
        right_think = subgoal(trajectory["gt"], holding, transformed, right.lower())
        if (right, right_think) != (best, think):
            corrections.append((prompt, f"<think>{right_think}</think><action>{right}</action>"))
        step["response"] = f"<think>{think}</think><action>{action}</action>"
        if step["valid"]:
            verb = action.split(" ", 1)[0]
            holding = verb == "take" or (holding and verb != "move")
            transformed = transformed or verb in ("heat", "cool", "clean")
    return trajectory, examples, corrections


def screen_drills(count, seed_value=0, shapes=DRILL_SHAPES):
    """count drill examples for the vision env: a screenshot with `shapes` items of different looks and "Click the
    {colour} {shape}.", answered as the demonstrations answer (subgoal's think, then the click)."""
    from simulators.vision import COLORS, GRID, SHAPES, render
    rng, looks, drills = random.Random(seed_value), [(c, s) for c in COLORS for s in SHAPES], []
    for _ in range(count):
        cells, picked = rng.sample(range(1, GRID * GRID + 1), shapes), rng.sample(looks, shapes)
        items = dict(zip(cells, map(list, picked)))
        action = f"click {cells[0]}"
        think = subgoal({"env": "vision", "items": items}, False, False, action)
        image = render({cell - 1: tuple(look) for cell, look in items.items()})
        drills.append((vision.ImageText(f"Click the {picked[0][0]} {picked[0][1]}.", image),
                       f"<think>{think}</think><action>{action}</action>"))
    return drills


def task_drills(count, seed_value=0):
    """count drill examples from the vision env's own train tasks, every family: each step of an expert episode
    as a short prompt (the task line and the screenshot, as screen_drills) answered as the demonstrations answer.
    Every family is decidable from the screen alone (a clicked target disappears), so no history is needed."""
    from simulators.vision import VisionEnv
    env, rng, drills = VisionEnv("train", seed_value), random.Random(f"task drills {seed_value}"), []
    while len(drills) < count:
        observation, info = env.reset(rng.randrange(10 ** 6))
        looks, done = {cell + 1: list(look) for cell, look in env.items.items()}, False
        while not done and len(drills) < count:
            action = env.expert_action(0.0)
            think = subgoal({"env": "vision", "items": looks, "task_type": info["task_type"]}, False, False, action)
            drills.append((vision.ImageText(info["task"], observation["image"]),
                           f"<think>{think}</think><action>{action}</action>"))
            observation, _, done, info = env.step(action)
    return drills


def skill_drills(count, history_window, seed_value=0):
    """count skill-following examples for the vision env in which the skill decides the click: the screenshot
    shows the named look twice, and the skill (in the annotator's words) names the right cell as a success's
    target or the other one as a failure's mistake; the label clicks the right one. The expert's own
    skill-following episodes cannot teach this: the screenshot alone already decides their label, so the
    teacher learns to ignore the skill (docs/vision.md: version 6's first click on the target 0.542 without a
    skill, 0.490 with one that names its cell). Half the skills quote the task with another colour, as the
    self-written ones often do: the think's look words follow the task line and the pixels, not the quote
    (version 6's teacher delta at won steps -0.506, version 8's -0.025)."""
    from simulators.vision import ACTIONS, COLORS, GRID, OBSERVATION, SHAPES, render
    rng, drills = random.Random(f"skill drills {seed_value}"), []
    for _ in range(count):
        color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
        others = [(color, s) for s in SHAPES if s != shape] + [(c, shape) for c in COLORS if c != color]
        cells = rng.sample(range(1, GRID * GRID + 1), 4)
        right, twin = cells[:2]
        items = {right: [color, shape], twin: [color, shape], **dict(zip(cells[2:], map(list, rng.sample(others, 2))))}
        task = f"Click the {color} {shape}."
        quoted = task if rng.random() < 0.5 else f"Click the {rng.choice([c for c in COLORS if c != color])} {shape}."
        won = {"task": quoted, "won": True, "targets": [right], "clicked": [[right, [color, shape]]]}
        lost = {"task": quoted, "won": False, "targets": [right], "clicked": [[twin, [color, shape]]],
                "mistake": {"cell": twin}}
        skill = rng.choice(vision_annotations(won)[1] + vision_annotations(lost)[1])
        prompt = seed.render_prompt(task, [], OBSERVATION, list(ACTIONS), history_window, "vision")
        image = render({cell - 1: tuple(look) for cell, look in items.items()})
        think = subgoal({"env": "vision", "items": items}, False, False, f"click {right}")
        drills.append((vision.ImageText(skills.with_skill(prompt, skill), image),
                       f"<think>{think}</think><action>click {right}</action>"))
    return drills


def demonstrations(env, n_episodes, history_window, seed_value=0, env_name="household", desc="demonstrations",
                   habit_rate=HABIT_RATE):
    """Behaviour-cloning, skill-following and analyzer examples from n_episodes expert episodes with
    mixed noise (epsilon 0 to 0.6: successes and failures for the analyzer) and the skip habit on a
    habit_rate share of heat/cool/clean episodes."""
    rng = random.Random(seed_value)
    act, follow, analyze = [], [], []
    for episode in tqdm(range(n_episodes), desc=desc, leave=False):
        task_seed = rng.randrange(10 ** 6)
        epsilon = rng.choice([0.0, 0.1, 0.2, 0.4, 0.6])
        trajectory, examples, corrections = expert_episode(env, task_seed, epsilon, rng, history_window, env_name,
                                                           habit_rate=habit_rate if env_name == "household" else 0.0)
        act += examples
        completion = annotate(trajectory, trajectory["gt"], rng=rng)
        analyze.append((trajectory, completion))
        skill = skills.parse_skill(completion, task=trajectory["task"])
        if skill is not None and hasattr(env, "expert_action"):
            _, followed, _ = expert_episode(env, task_seed, 0.0, rng, history_window, env_name, skill=skill)
            # contrast pairs: the habit's own prompts labelled with the habit, and the same prompts with its
            # skill in them labelled right, so the skill is the one difference; rare (the steps from taking
            # the object to its placement), hence CONTRAST_COPIES copies
            habit_labels = dict(examples)
            pairs = [pair for p, r in corrections for pair in ((p, habit_labels[p]), (skills.with_skill(p, skill), r))]
            follow += followed + pairs * CONTRAST_COPIES
    return act, follow, analyze


@functools.lru_cache(maxsize=8)  # every evaluation of a run asks for the same decisions
def habit_decisions(split, count=48, history_window=3, max_steps=20):
    """The decision the skip habit gets wrong, on `count` heat/cool/clean tasks of a household split: the prompt
    when the expert has just taken the goal object, with the right response (go and transform it) and the
    habit's (carry it to the target), in the demonstrations' format, and the skill that names the mistake
    (as the annotator would). -> [(prompt, right, habit, skill)]."""
    decisions, task_seed = [], 0
    while len(decisions) < count and task_seed < 50 * count:
        env = envs.make_env("household", split, task_seed, max_steps=max_steps)
        observation, info = env.reset(task_seed)
        task_seed += 1
        history, done = [], info.get("task_type") not in HABIT_TASKS
        while not done:
            if env.holding is not None and kind_of(env.holding) == env.goal_object:
                prompt = seed.render_prompt(info["task"], history, observation, info["admissible"], history_window)
                goal = {"task_type": env.task_type, "goal_object": env.goal_object,
                        "goal_receptacle": env.goal_receptacle}
                right = f"<think>{subgoal(goal, True, False)}</think><action>{env.expert_action()}</action>"
                habit = (f"<think>{subgoal(goal, True, True)}</think>"
                         f"<action>{env.expert_action(skip_transform=True)}</action>")
                verb, appliance, _ = TRANSFORMS[env.task_type]
                skill = (f"{verb.capitalize()} the {env.goal_object} with {appliance} 1 right after taking "
                         f"it; carrying it straight to the {env.goal_receptacle} fails the task.")
                decisions.append((prompt, right, habit, skill))
                break
            action = env.expert_action()
            history.append((observation, action))
            observation, _, done, info = env.step(action)
    return decisions


def habit_task_seeds(count, split="train"):
    """The first `count` task seeds of a household split whose task is heat, cool or clean."""
    env, found, task_seed = envs.make_env("household", split, 0), [], 0
    while len(found) < count:
        if env.reset(task_seed)[1]["task_type"] in HABIT_TASKS:
            found.append(task_seed)
        task_seed += 1
    return found


def habit_probe(policy, decisions, temperature=1.0, with_skill=False):
    """Mean over decisions of P(right) / (P(right) + P(habit)), whole-response probabilities under the policy:
    0.5 = no preference, 1 = the habit unlearned. The warm-start's value shows how strong the habit is; its
    rise under RL is the learning a success rate shows only through the evaluation noise. with_skill: the
    decision's skill sits in the prompt (skills.with_skill), as in the teacher context."""
    stop = policy.stop_ids[0] if policy.stop_ids else policy.tokenizer.eos_token_id
    prompts = [skills.with_skill(d[0], d[3]) if with_skill else d[0] for d in decisions]
    prompts = [seed.encode_chat(policy.tokenizer, prompt) for prompt in prompts] * 2
    responses = [policy.tokenizer(text, add_special_tokens=False)["input_ids"] + [stop]
                 for column in (1, 2) for text in [decision[column] for decision in decisions]]
    logp = seed.response_logprobs(policy.model, prompts, responses, policy.pad_id, temperature).sum(-1)  # (2n,)
    right, habit = logp.view(2, len(decisions))                                                       # (n,), (n,)
    return torch.sigmoid(right - habit).mean().item()


def skill_lift(policy, decisions, temperature=1.0):
    """How far a skill in the context moves the decision it is about: habit_probe with the skill in the
    prompt minus without it. An instruct model that follows its context lifts it well above 0."""
    return (habit_probe(policy, decisions, temperature, with_skill=True)
            - habit_probe(policy, decisions, temperature))


def habit_failure(trajectory):
    """True when a household heat/cool/clean episode failed the planted habit's way: the goal object was put
    down at a receptacle of the target kind before any heat, cool or clean event."""
    gt = trajectory.get("gt") or {}
    if trajectory.get("won") or gt.get("task_type") not in HABIT_TASKS:
        return False
    for event in gt.get("events") or []:
        if event["kind"] in ("heat", "cool", "clean"):
            return False
        if event["kind"] == "put" and kind_of(event["target"]) == gt.get("goal_receptacle"):
            return True
    return False


def fixing_skill_share(trajectories, skill_list):
    """Of the episodes that failed the habit's way, the share whose self-written skill names the fix (the
    task's heat / cool / clean verb): (share, how many such episodes). None share when there are none."""
    failed = [(t, s) for t, s in zip(trajectories, skill_list) if habit_failure(t)]
    fixed = sum(s is not None and TRANSFORMS[t["gt"]["task_type"]][0] in s.lower() for t, s in failed)
    return (fixed / len(failed) if failed else None), len(failed)


def analyzer_examples(policy, analyzed, max_tokens):
    count = lambda text: len(policy.tokenizer(text, add_special_tokens=False)["input_ids"])
    return [(skills.analyzer_prompt(t, max_tokens=max_tokens, count_tokens=count), c) for t, c in analyzed]


def supervised_step(policy, optimizer, examples, max_batch_tokens=16384, grad_clip=1.0, prompt_weight=0.0,
                    layout="padded"):
    """One SFT step (warm-up and stage 1) on (prompt_text, completion_text) pairs: token-mean negative
    log-likelihood of the completion plus end-of-turn. prompt_weight > 0 adds that times the token-mean
    language-modelling loss on the prompt tokens (the tiny model's stand-in for pretraining: every token is
    a training signal, which teaches it to read the task and copy names far sooner than the ~15 completion
    tokens alone). Returns the completion loss."""
    tokenizer, model = policy.tokenizer, policy.model
    stop = policy.stop_ids[0] if policy.stop_ids else tokenizer.eos_token_id
    prompts = [seed.encode_chat(tokenizer, p) for p, _ in examples]
    completions = [tokenizer(c, add_special_tokens=False)["input_ids"] + [stop] for _, c in examples]
    prompt_part = torch.zeros(len(prompts), dtype=torch.long)  # leading scored tokens that belong to the prompt
    if prompt_weight > 0:  # score the whole sequence after its first token; weights split prompt/completion
        completions = [p[1:] + c for p, c in zip(prompts, completions)]
        prompt_part = torch.tensor([len(p) - 1 for p in prompts])
        prompts = [p[:1] for p in prompts]
    mask = seed.response_mask(completions)                                          # (B, R)
    is_prompt = (torch.arange(mask.shape[1])[None, :] < prompt_part[:, None]).float()  # (B, R)
    answer = mask * (1 - is_prompt)                                                 # (B, R)
    weights = answer / answer.sum() + prompt_weight * is_prompt / is_prompt.sum().clamp(min=1)
    value = 0.0
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for rows in seed.micro_batches(prompts, completions, max_batch_tokens):
        logp, _ = seed.forward_logprobs(model, [prompts[i] for i in rows], [completions[i] for i in rows],
                                        policy.pad_id, layout=layout)               # (b, r)
        micro_loss = -(logp * weights[rows, :logp.shape[1]].to(logp.device)).sum()
        micro_loss.backward()
        value += float(-(logp.detach() * (answer[rows, :logp.shape[1]] / answer.sum()).to(logp.device)).sum())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if math.isfinite(value) and torch.isfinite(grad_norm):  # a NaN/inf loss or gradient: skip the step
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value


def parameter_groups(model, lr, vision_lr_scale=1.0):
    """AdamW parameter groups: a Qwen2-VL's vision tower (model.model.visual) at lr * vision_lr_scale, the rest
    at lr (one group when the model has no tower)."""
    tower = getattr(getattr(model, "model", None), "visual", None)
    tower_ids = {id(p) for p in tower.parameters()} if tower is not None else set()
    groups = [{"params": [p for p in model.parameters() if id(p) not in tower_ids], "lr": lr}]
    if tower_ids:
        groups.append({"params": list(tower.parameters()), "lr": lr * vision_lr_scale})
    return groups


def warmup_optimizer(policy, lr, steps, beta2=0.999, vision_lr_scale=1.0):
    """(AdamW, its schedule): 30 steps of linear warm-up, then linear decay to 10% at `steps`.
    vision_lr_scale: a Qwen2-VL's vision tower trains at lr times this, the language model at lr."""
    optimizer = torch.optim.AdamW(parameter_groups(policy.model, lr, vision_lr_scale), lr=lr, weight_decay=0.01,
                                  betas=(0.9, beta2))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 30) * max(0.1, 1.0 - s / max(1, steps)))
    return optimizer, schedule


def supervised_training(policy, mixture, steps, batch_size, lr, max_batch_tokens, seed_value=0, desc="warm-up",
                        prompt_weight=0.0, layout="packed", beta2=0.999, vision_lr_scale=1.0, first=(0, ())):
    """warmup_optimizer's AdamW and schedule; each step draws batch_size examples from the mixture
    [(weight, examples)], the first first[0] of the steps from the examples first[1] alone (a curriculum under
    the same schedule). prompt_weight: see supervised_step. layout: packed rows skip
    the padding of these uneven mixtures (short acting prompts, long analyzer prompts): 2.4x faster per step
    than padded on the tiny warm-up mixture, same loss to 4 decimals; padded for screenshots. Returns the
    completion loss of the last 20 steps on average."""
    rng = random.Random(seed_value)
    optimizer, schedule = warmup_optimizer(policy, lr, steps, beta2, vision_lr_scale)
    weights = [w for w, examples in mixture if examples]
    pools = [examples for _, examples in mixture if examples]
    losses = []
    bar = tqdm(range(steps), desc=desc, leave=False)
    for step in bar:
        batch = [rng.choice(first[1]) if step < first[0] else rng.choice(rng.choices(pools, weights)[0])
                 for _ in range(batch_size)]
        losses.append(supervised_step(policy, optimizer, batch, max_batch_tokens, layout=layout,
                                      prompt_weight=0.0 if step < first[0] else prompt_weight))  # drills: answers
        schedule.step()
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return sum(losses[-20:]) / max(1, len(losses[-20:]))


def warm_start(cfg, options):
    """Path of the warm-started tiny model for this config, building and caching it when missing."""
    settings = {"version": WARMUP_VERSION, "env": cfg.env, "steps": cfg.warmup_steps, "seed": cfg.warmup_seed,
                "history_window": cfg.history_window, "analysis_prompt_tokens": cfg.analysis_prompt_tokens,
                "options": {k: v for k, v in options.items() if k != "default_max_steps"}}
    if cfg.env in VISION_ENVS:
        settings["screen_version"] = SCREEN_VERSION
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(cfg.cache_dir, f"tiny-{cfg.env}-{key}")
    if os.path.exists(os.path.join(path, "warmup.json")):
        print(f"warm-up: reusing the cached tiny model {path}")
        return path
    shipped = os.path.join(SHIPPED_DIR, os.path.basename(path))
    if not cfg.build_warm_start and os.path.exists(os.path.join(shipped, "warmup.json")):
        print(f"warm-up: using the warm-start shipped in {os.path.relpath(shipped)} (--build-warm-start builds "
              f"it here instead)")
        return shipped
    remove_unfinished(cfg.cache_dir)
    with atomic_folder(path) as temporary:  # complete or absent: a killed warm-up is redone, never half-used
        with open(os.path.join(temporary, "builder.pid"), "w") as f:
            f.write(str(os.getpid()))
        loss = build_warm_start(cfg, options, settings, temporary)
        os.remove(os.path.join(temporary, "builder.pid"))
    print(f"warm-up: done, final loss {loss:.3f}, cached in {path}")
    return path


def remove_unfinished(cache_dir):
    """Delete the *.tmp folders interrupted builds left in cache_dir (one still being built stays)."""
    stale = [folder for folder in glob.glob(os.path.join(cache_dir, "*.tmp")) if not building(folder)]
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    if stale:
        print(f"warm-up: removed {len(stale)} unfinished build(s) left in {cache_dir}")
    return stale


def building(folder):
    """True while the process that writes this unfinished cache folder is alive."""
    try:
        with open(os.path.join(folder, "builder.pid")) as f:
            os.kill(int(f.read()), 0)
        return True
    except (OSError, ValueError):
        return False


def build_warm_start(cfg, options, settings, folder):
    """Demonstrations, a fresh tiny model and its supervised warm-up, saved into `folder`; returns the
    final loss."""
    env = demonstration_env(cfg, options, cfg.warmup_seed)
    n_episodes = max(64, cfg.warmup_steps)
    act, follow, analyzed = demonstrations(env, n_episodes, cfg.history_window, cfg.warmup_seed, cfg.env)
    follow += skill_drills(SKILL_DRILLS, cfg.history_window, cfg.warmup_seed) if cfg.env == "vision" else []
    corpus = [p + r for p, r in act[:2000] + follow[:1000]]
    corpus += [skills.analyzer_prompt(t) + c for t, c in analyzed[:1000]]
    screens = cfg.env in VISION_ENVS
    drills = screen_drills(4000, cfg.warmup_seed) + task_drills(4000, cfg.warmup_seed) if cfg.env == "vision" else []
    if screens:
        policy = tiny.build_tiny_vlm(corpus + [p + r for p, r in drills[:500]], folder, seed=cfg.warmup_seed,
                                     initializer_range=VISION_INIT_STD)
    else:
        policy = tiny.build_tiny_policy(corpus, folder, seed=cfg.warmup_seed, initializer_range=TEXT_INIT_STD)
    analyze = analyzer_examples(policy, analyzed, cfg.analysis_prompt_tokens)
    print(f"warm-up: {len(act)} acting, {len(follow)} skill-following and {len(analyze)} analyzer examples "
          f"from {n_episodes} expert episodes; {sum(p.numel() for p in policy.model.parameters()) / 1e6:.2f}M "
          f"parameters, vocabulary {len(policy.tokenizer)}")
    # lr 3e-3 and a 0.3-weighted language-modelling loss on the prompts: a model from scratch learns to read
    # the task and copy names from far back in the prompt only after many steps; measured on 60 held-out
    # steps, completion loss 0.34 vs 0.53 after 400 steps with the prompt loss vs without
    # screenshots: lr 1e-3 and beta2 0.95. The first steps send the from-scratch vision tower gradients 100x
    # larger than later ones; beta2 0.999 remembers them for ~1000 steps and the tower barely moves (docs/vision.md:
    # a 6-way cell-number probe read 0.62 at 300 steps with 0.999, 1.00 from step 175 with 0.95)
    # screenshots: micro-batches of at most 4,096 tokens, so the short acting rows are not padded to the analyzer's
    first = (DRILL_STEPS, drills) if drills else (0, ())
    loss = supervised_training(policy, [(0.45, act), (0.25, follow), (0.30, analyze)], first[0] + cfg.warmup_steps,
                               cfg.sft_batch_size, 1e-3 if screens else 3e-3,
                               min(cfg.max_batch_tokens, 4096) if screens else cfg.max_batch_tokens, cfg.warmup_seed,
                               prompt_weight=0.3, layout="padded" if screens else "packed",
                               beta2=0.95 if screens else 0.999, vision_lr_scale=VISION_LR_SCALE, first=first)
    policy.model.save_pretrained(folder)
    policy.tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, "warmup.json"), "w") as f:
        json.dump({**settings, "final_loss": loss, "examples": [len(act), len(follow), len(analyze)]}, f, indent=1)
    return loss


def stage1_sft(cfg, policy, options):
    """Stage 1: teach the policy to analyze trajectories, on --sft-data JSONL or on the annotator's skills
    for expert episodes (successes and failures) of the training split."""
    if cfg.sft_steps == 0:
        return
    if cfg.sft_data:
        examples = [(r["prompt"], r["completion"]) for r in read_jsonl(cfg.sft_data)]
        source = cfg.sft_data
        if not examples:
            raise ValueError(f"--sft-data {cfg.sft_data}: no records (expected one JSON object per line)")
    else:
        env = demonstration_env(cfg, options, cfg.seed + 1)
        # the env's own episodes, and no planted habit: that belongs to the tiny household demo alone
        _, _, analyzed = demonstrations(env, max(32, cfg.sft_steps), cfg.history_window, cfg.seed + 1, cfg.env,
                                        desc="stage-1 data", habit_rate=0.0)
        examples = analyzer_examples(policy, analyzed, cfg.analysis_prompt_tokens)
        source = "warmup.annotator.annotate on expert episodes"
    loss = supervised_training(policy, [(1.0, examples)], cfg.sft_steps, cfg.sft_batch_size, cfg.sft_lr,
                               cfg.max_batch_tokens, cfg.seed, desc="stage 1",
                               layout="padded" if cfg.env in VISION_ENVS else "packed")
    print(f"stage 1: {cfg.sft_steps} steps on {len(examples)} examples from {source}, final loss {loss:.3f}")


def start_model(cfg, options):
    """Folder of the policy RL starts from, made on first use: the tiny model's cached warm-up (whose
    mixture includes stage 1), or an HF model after stage-1 analyzer SFT (saved in <out-dir>/sft), or the
    HF model itself for --stage rl, --algo grpo or --sft-steps 0."""
    from models.policy import load_policy
    if cfg.model == "tiny":
        return warm_start(cfg, options)
    if cfg.stage == "rl" or cfg.algo == "grpo" or cfg.sft_steps == 0:
        return cfg.model
    path = os.path.join(cfg.out_dir, "sft")
    if not os.path.exists(os.path.join(path, "config.json")):
        policy = load_policy(cfg.model, cfg.device, cfg.dtype, cfg.gradient_checkpointing)
        stage1_sft(cfg, policy, options)
        with atomic_folder(path) as temporary:  # complete or absent
            policy.model.save_pretrained(temporary)
            policy.tokenizer.save_pretrained(temporary)
    return path
