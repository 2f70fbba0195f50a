"""
warmup/warm_start.py: what a pretrained instruct model brings, taught to the tiny model (`--model tiny` only).

`--model tiny` starts from random weights, so before RL it is taught, by supervised learning on
demonstrations in the real prompt format, the three things SEED assumes an instruct model can do:
  1. act: behaviour cloning of the household expert (a searching expert that does not know where things
     are) on states visited by an epsilon-noisy version of it, so the data covers recoveries; on heat/cool/
     clean tasks 60% of the demonstrators have a bad habit (they skip that step), which the greedy warm-start
     inherits: the room RL has to improve, measured by habit_probe in every household evaluation;
  2. follow a skill, so that what the skill says decides (skill_following, version 10): the episode with its
     own skill in the prompts, the expert searching first where the skill says; the same with the skill's
     places swapped, the search going there; a content-free skill, the plain demonstrator with its habit; and
     contrast sets at the habit's decision (no skill -> habit, own skill -> the right appliance, its step
     swapped for another's -> habit, content-free -> habit). On the shipped start model a skill's habit-probe
     lift is own +0.441, shuffled -0.056, content-free +0.080; the same code from --warmup-seed 1 lifts own and
     shuffled alike, +0.317 and +0.288 (docs/experiments.md);
  3. analyze: stage-1 SFT on (skills.analyzer_prompt -> annotator.annotate) for successes and failures.
The result is cached under --cache-dir keyed by the settings the warm-up reads (never RL-only flags), so
later runs start from it at once. The paper's stage 1 for any other model is seed.stage1_sft (train.py).

Departures from the paper: the paper starts from Qwen2.5-Instruct and annotates with a strong LLM; the
tiny model's warm-up and the rule-based annotator stand in for both, and the planted habit stands in for the
instruct model's own wrong priors about an environment it has never seen. Run: python train.py (calls this).
"""
import glob
import hashlib
import json
import os
import random
import re
import shutil

import torch
from tqdm.auto import tqdm

import envs
import seed
import skills
from models import tiny, vision
from models.policy import parameter_groups, save_policy
from evaluation.habit import HABIT_TASKS
from seed import Step, Trajectory
from simulators.household import TRANSFORMS, expert_thought, kind_of
from simulators.vision import vision_annotations
from training.checkpoints import atomic_folder
from training.locks import FolderLock

WARMUP_VERSION = 10  # bump when the demonstrations or the model change, so stale caches are not reused
# (5: verl-agent's exact prompt templates; 6: the skill side of the pairs alone, measured, not kept; 7: contrast
# pairs, the habit's steps with and without its skill; 8: TEXT_INIT_STD; 9: the skill's content decides,
# skill_following; 10: a skill naming another step -> the habit, at the habit's decision)
# the text model's initial weight std, 4x Qwen2's 0.02: at 0.02 a tiny model sits on a saddle before it learns to
# copy from its prompt (experiments/recall_probe.py: 0.33 vs 0.69 after 2,000 steps, 3 seeds); on the household
# demo RL then gains more, 3 seeds at 320 episodes: SEED +0.187, GRPO +0.090 valid_seen success, against +0.104 /
# +0.056 at 0.02 (docs/experiments.md). The vision warm-up keeps 0.02: on its cell probe 0.08 changed nothing
TEXT_INIT_STD = 0.08
# share of those tasks' demonstrations with the skip habit: above one half, so the warm-started greedy policy
# has the habit (RL's room to improve) while sampled rollouts still find the right workflow often
HABIT_RATE = 0.6
# how often each contrast pair (a habit step with and without its skill) enters the skill-following examples:
# measured skill lift on valid_seen: 0.094 without pairs, 0.216 with the skill side once, 0.529 with both sides x 3
CONTRAST_COPIES = 3
# warm-starts shipped with the repository (the default's, so a first run skips the ~10-minute build); one is used
# when its settings match the run's exactly, unless --build-warm-start
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "warm_starts")
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
    """The env whose expert plays the demonstrations: the run's own env on its train split, with the env's own
    expert options (ALFWorld's: the engine's planner, on synthetic games when no data is installed)."""
    return envs.make_env(cfg.env, "train", seed_value, **options, **dict(envs.spec(cfg.env).expert_options))


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
    return expert_thought(gt, holding, transformed)


def expert_episode(env, task_seed, epsilon, rng, history_window, env_name="household", skill=None, habit_rate=0.0,
                   hint=None):
    """Play one episode with the env's expert. The executed action is the expert's with probability
    1 - epsilon (else a random admissible one; and with probability epsilon / 2 a command that was admissible
    earlier but is not now, which the env answers "Nothing happens."); every step is labelled with the
    expert's own choice, so the data shows how to recover from a random or an invalid command.
    habit_rate: on heat/cool/clean tasks, the chance that this episode's demonstrator has the bad habit of
    skipping that step (envs expert skip_transform); its labels carry the object straight to the target and
    the demonstration stops at that placement (the demonstrator thinks it is done), so the policy learns the
    habit as a habit and never sees it repaired. RL has to unlearn it; a skill that says "heat it first" (the
    skill-following demonstrations never have the habit) shows how.
    With `skill`, prompts carry the skill block; the expert then acts on what the skill says when `hint` is given
    (the receptacles it names, searched first: the household env, whose skill-following demonstrations must
    depend on the skill's content), else as an oracle that knows where objects are (the other envs).
    Returns (trajectory, labelled examples [(prompt, response)], corrections): for a habit episode, the steps
    whose habit label differs from the right one, as (prompt, right response), which skill_following pairs with
    the episode's skills; else []."""
    observation, info = env.reset(task_seed)
    habit = info.get("task_type") in HABIT_TASKS and rng.random() < habit_rate
    oracle, options = skill is not None and hint is None, {"hint": hint} if hint else {}  # hint=(): no oracle

    def expert(noise, noise_rng=None, skip=habit):  # skip_transform only where needed: other envs' experts lack it
        return env.expert_action(noise, noise_rng, oracle=oracle, **({"skip_transform": True} if skip else {}),
                                 **options)

    trajectory = Trajectory(task=info["task"], task_type=info.get("task_type"))
    template, screens = envs.load(envs.spec(env_name).prompt), envs.spec(env_name).screens
    history, examples, pending, done, earlier = [], [], [], False, set()
    while not done:
        prompt = skills.render_prompt(template, info["task"], history, vision.observation_text(observation),
                                      info.get("admissible", []), history_window)
        prompt = vision.user_message(prompt, observation) if screens else prompt  # a text model: the text
        best = expert(0.0)
        right = expert(0.0, skip=False) if habit else best  # what a demonstrator without the habit does
        skipping = habit and best.startswith("move ") and best != right
        action = best if skipping else expert(epsilon, rng)
        admissible = set(info.get("admissible", []))
        stale = sorted(earlier - admissible)  # once admissible, not now: "go to" where it stands, a gone object
        if stale and not skipping and rng.random() < epsilon / 2:
            action = rng.choice(stale)  # an invalid command ("Nothing happens."), so the data shows recoveries
        earlier |= admissible
        thought = env.expert_thought(best) if hasattr(env, "expert_thought") else None  # an env that says it itself
        pending.append((prompt if skill is None else vision.same_image(prompt, skills.with_skill(prompt, skill)), best,
                        action, right, thought))
        previous = vision.observation_text(observation)
        observation, reward, done, info = env.step(action)
        trajectory.steps.append(Step(observation=previous, response="", action=action, reward=float(reward),
                                     valid=bool(info.get("valid", True))))
        trajectory.reward += float(reward)
        history.append((previous, action))
        while skipping and not done:  # the habit's placement ends the demonstration; "look" runs out the
            observation, _, done, info = env.step("look")  # clock unrecorded, for the env's ground truth
    trajectory.won, trajectory.gt = bool(info.get("won")), info.get("gt") or {}
    # the <think> text needs the goal from the ground truth, known at the end: fill responses now
    holding = transformed = False
    corrections = []
    for step, (prompt, best, action, right, thought) in zip(trajectory.steps, pending):
        think = thought or subgoal(trajectory.gt, holding, transformed or habit, best.lower())
        examples.append((prompt, f"<think>{think}</think><action>{best}</action>"))
        right_think = thought or subgoal(trajectory.gt, holding, transformed, right.lower())
        if (right, right_think) != (best, think):
            corrections.append((prompt, f"<think>{right_think}</think><action>{right}</action>"))
        step.response = f"<think>{think}</think><action>{action}</action>"
        if step.valid:
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
    from simulators.vision import ACTIONS, COLORS, GRID, OBSERVATION, PROMPT, SHAPES, render
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
        prompt = skills.render_prompt(PROMPT, task, [], OBSERVATION, list(ACTIONS), history_window)
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
    annotate = envs.load(envs.spec(env_name).annotator)
    act, follow, analyze = [], [], []
    for episode in tqdm(range(n_episodes), desc=desc, leave=False):
        task_seed = rng.randrange(10 ** 6)
        epsilon = rng.choice([0.0, 0.1, 0.2, 0.4, 0.6])
        trajectory, examples, corrections = expert_episode(env, task_seed, epsilon, rng, history_window, env_name,
                                                           habit_rate=habit_rate if env_name == "household" else 0.0)
        act += examples
        completion = skills.skill_json(*annotate(trajectory, trajectory.gt, rng))
        analyze.append((trajectory, completion))
        skill = skills.parse_skill(completion, task=trajectory.task)
        if skill is not None and env_name == "household":  # the skill's content decides (skill_following)
            follow += skill_following(env, task_seed, skill, trajectory, examples, corrections, rng, history_window,
                                      habit_rate)
        elif skill is not None and hasattr(env, "expert_action"):
            follow += expert_episode(env, task_seed, 0.0, rng, history_window, env_name, skill=skill)[1]
    return act, follow, analyze


GENERIC_SKILLS = ("Look around the room carefully before acting.", "Take your time and think before each action.",
                  "Read the observation and choose a sensible action.", "Be careful and avoid wasting steps.")


def named_places(text, receptacles, exclude=()):
    """The room's receptacles a skill names, in the order it names them, less `exclude` (the target) and the
    tools it names ("with microwave 1"): where it says the object is."""
    found = [(match.start(), r) for r in receptacles if r not in exclude
             for match in [re.search(rf"(?<!with )(?<!with the )\b{re.escape(r)}\b", text)] if match]
    return [r for _, r in sorted(found)]


def skill_following(env, task_seed, skill, trajectory, examples, corrections, rng, history_window, habit_rate):
    """The household env's skill-following demonstrations, in which what a skill says decides what is done, so a
    teacher context helps only as far as its skill is right (issue: a skill block alone must fix nothing):
      - the episode with its own skill in the prompts, the expert searching first where the skill says the
        object is (no habit: the skill names the step);
      - with the skill's places swapped for others of the room: the expert searches there first (and then on);
      - with a content-free skill (GENERIC_SKILLS): the plain demonstrator, habit and all;
      - at the habit's decision (the contrast steps): without a skill the habit; with the own skill the right
        appliance (twice: it is the one pair of four that leaves the habit); with the skill's verb and appliance
        swapped for another of the room, the habit (version 10: a skill naming another step is no fix for this
        one; version 9 sent it to that appliance, and then any step-naming skill killed the habit); with a
        content-free skill the habit. Rare steps, hence CONTRAST_COPIES copies."""
    gt = trajectory.gt or {}
    verb_of = {appliance: verb for verb, appliance, _ in TRANSFORMS.values()}
    appliances = [r for r in env.receptacles if kind_of(r) in verb_of]
    exclude = [r for r in env.receptacles if kind_of(r) == gt.get("goal_receptacle")]
    places = named_places(skill, env.receptacles, exclude)
    task_verb = TRANSFORMS.get(gt.get("task_type"), (None, None))
    names_step = task_verb[0] is None or task_verb[0] in skill.lower()  # else the habit stays, as without it
    follow = expert_episode(env, task_seed, 0.0, rng, history_window, skill=skill, hint=places,
                            habit_rate=0.0 if names_step else habit_rate)[1]
    others = [r for r in env.receptacles if r not in exclude and r not in places]
    if places and others:  # the same skill, naming other places: the search goes there first
        swap = dict(zip(places, rng.sample(others, min(len(places), len(others)))))
        wrong = re.sub("|".join(rf"\b{re.escape(p)}\b" for p in swap), lambda m: swap[m.group(0)], skill)
        follow += expert_episode(env, task_seed, 0.0, rng, history_window, skill=wrong,
                                 hint=named_places(wrong, env.receptacles, exclude),
                                 habit_rate=0.0 if names_step else habit_rate)[1]
    generic = rng.choice(GENERIC_SKILLS)
    follow += expert_episode(env, task_seed, 0.0, rng, history_window, skill=generic, habit_rate=habit_rate,
                             hint=())[1]
    habit_labels = dict(examples)
    other = [a for a in appliances if kind_of(a) != task_verb[1]]
    pairs = []
    for prompt, right in corrections:
        pairs += [(prompt, habit_labels[prompt])] + [(skills.with_skill(prompt, skill), right)] * 2 + [
                  (skills.with_skill(prompt, generic), habit_labels[prompt])]
        if other and task_verb[0] and names_step:  # the skill's step swapped for another's: no fix, the habit
            appliance = rng.choice(other)
            verb = verb_of[kind_of(appliance)]
            swapped = re.sub(rf"\b{task_verb[1]}\b(?! \d)", kind_of(appliance),
                             skill.replace(f"{task_verb[1]} 1", appliance))
            swapped = re.sub(rf"\b{task_verb[0]}", verb, swapped, flags=re.I)
            pairs.append((skills.with_skill(prompt, swapped), habit_labels[prompt]))
    return follow + pairs * CONTRAST_COPIES



def analyzer_examples(policy, analyzed, max_tokens):
    """(analyzer prompt within max_tokens, completion) for each (trajectory, completion) pair."""
    count = policy.count_tokens
    return [(skills.analyzer_prompt(t, max_tokens=max_tokens, count_tokens=count), c) for t, c in analyzed]


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
        losses.append(seed.supervised_step(policy, optimizer, batch, max_batch_tokens, layout=layout,
                                      prompt_weight=0.0 if step < first[0] else prompt_weight))  # drills: answers
        schedule.step()
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return sum(losses[-20:]) / max(1, len(losses[-20:]))


# what the warm-up reads, by its name in the cache key: the flag that sets it. RL-only flags (--max-steps, the
# sizes, the coefficients) never enter the key, so they never trigger a rebuild; the demonstrations play with
# the env's default step limit
KEY_FLAGS = {"steps": "--warmup-steps", "seed": "--warmup-seed", "history_window": "--history-window",
             "analysis_prompt_tokens": "--analysis-prompt-tokens", "analyzer_share": "--warmup-analyzer-share",
             "options": "the env's own flags"}
MINUTES_PER_1000_STEPS = 10  # the household build on an idle 2-core CPU (v10: 9 min 38 s; v9: 26 min at one thread beside other runs)


def warmup_settings(cfg, options):
    """The cache key's contents: exactly what build_warm_start reads."""
    settings = {"version": WARMUP_VERSION, "env": cfg.env, "steps": cfg.warmup_steps, "seed": cfg.warmup_seed,
                "history_window": cfg.history_window, "analysis_prompt_tokens": cfg.analysis_prompt_tokens,
                "analyzer_share": cfg.warmup_analyzer_share,
                "options": {k: v for k, v in options.items() if k != "max_steps"}}
    if envs.spec(cfg.env).screens:
        settings["screen_version"] = SCREEN_VERSION
    return settings


def warm_start(cfg, options):
    """Path of the warm-started tiny model for this config: the cached or shipped one with these settings, else
    one built now (saying first which flag made the build necessary and about how long it takes) and cached."""
    settings = warmup_settings(cfg, options)
    path, found = existing_warm_start(cfg, options)
    if found == path:
        print(f"warm-up: reusing the cached tiny model {path}")
        return path
    if found:
        print(f"warm-up: using the warm-start shipped in {os.path.relpath(found)} (--build-warm-start builds "
              f"it here instead)")
        return found
    minutes = MINUTES_PER_1000_STEPS * cfg.warmup_steps / 1000
    print(f"warm-up: building a tiny model for --env {cfg.env} ({why_build(cfg, settings)}), "
          + (f"about {minutes:.0f} minutes" if minutes >= 1 else "under a minute") + " on 2 idle cores; later "
          "runs reuse it")
    with FolderLock(path + ".lock", "warm-up build").acquire(wait=True):  # two runs: one builds, one waits
        if os.path.exists(os.path.join(path, "warmup.json")):  # the run it waited for built it
            print(f"warm-up: reusing the tiny model another run just built, {path}")
            return path
        remove_unfinished(cfg.cache_dir)
        with atomic_folder(path) as temporary:  # complete or absent: a killed warm-up is redone, never half-used
            with open(os.path.join(temporary, "builder.pid"), "w") as f:
                f.write(str(os.getpid()))
            loss = build_warm_start(cfg, options, settings, temporary)
            os.remove(os.path.join(temporary, "builder.pid"))
    print(f"warm-up: done, final loss {loss:.3f}, cached in {path}")
    return path


def existing_warm_start(cfg, options):
    """(the cache path of this config's warm-start, the folder holding it now: that path, the shipped copy
    (unless --build-warm-start), or None)."""
    settings = warmup_settings(cfg, options)
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(cfg.cache_dir, f"tiny-{cfg.env}-{key}")
    shipped = os.path.join(SHIPPED_DIR, os.path.basename(path))
    if os.path.exists(os.path.join(path, "warmup.json")):
        return path, path
    if not cfg.build_warm_start and os.path.exists(os.path.join(shipped, "warmup.json")):
        return path, shipped
    return path, None


def why_build(cfg, settings):
    """Which setting differs from the shipped warm-start of this env, named by its flag, or why none applies."""
    if cfg.build_warm_start:
        return "--build-warm-start"
    for shipped in sorted(glob.glob(os.path.join(SHIPPED_DIR, f"tiny-{cfg.env}-*", "warmup.json"))):
        with open(shipped) as f:
            theirs = json.load(f)
        differ = [key for key in settings if settings[key] != theirs.get(key)]
        if "version" in differ or "screen_version" in differ:
            return "the warm-up's code changed since the shipped warm-start was built"
        return ", ".join(f"{KEY_FLAGS[key]} {settings[key]} where the shipped one has {theirs.get(key)}"
                         for key in differ)
    return f"no warm-start is shipped for --env {cfg.env}"


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
    env = demonstration_env(cfg, {**options, "max_steps": envs.spec(cfg.env).max_steps}, cfg.warmup_seed)
    n_episodes = max(16, cfg.warmup_steps)  # a short (test) warm-up needs few demonstrations
    act, follow, analyzed = demonstrations(env, n_episodes, cfg.history_window, cfg.warmup_seed, cfg.env)
    follow += skill_drills(SKILL_DRILLS, cfg.history_window, cfg.warmup_seed) if cfg.env == "vision" else []
    corpus = [p + r for p, r in act[:2000] + follow[:1000]]
    corpus += [skills.analyzer_prompt(t) + c for t, c in analyzed[:1000]]
    screens = envs.spec(cfg.env).screens
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
    mixture = [(0.45, act), (0.25, follow), (cfg.warmup_analyzer_share, analyze)]  # 0: no analyzer (ablation)
    loss = supervised_training(policy, mixture, first[0] + cfg.warmup_steps,
                               cfg.sft_batch_size, 1e-3 if screens else 3e-3,
                               min(cfg.max_batch_tokens, 4096) if screens else cfg.max_batch_tokens, cfg.warmup_seed,
                               prompt_weight=0.3, layout="padded" if screens else "packed",
                               beta2=0.95 if screens else 0.999, vision_lr_scale=VISION_LR_SCALE, first=first)
    save_policy(policy, folder)
    with open(os.path.join(folder, "warmup.json"), "w") as f:
        json.dump({**settings, "final_loss": loss, "examples": [len(act), len(follow), len(analyze)]}, f, indent=1)
    return loss
