"""evaluation/habit.py: the household env's extra probe -- how far a policy has unlearned the skip habit the tiny
warm-up plants on heat/cool/clean tasks, and what a skill in the context does to that decision.

At the decision the habit gets wrong (the goal object just taken), habit_probe reads the policy's preference
for the right response (go and heat/cool/clean it) over the habit's (carry it to the target) without sampling
noise: the mean of P(right) / (P(right) + P(habit)). envs.py names habit_column as the household env's probe,
so every household evaluation reports it (the `habit` column). Departure from the paper: the habit is planted
(warmup/warm_start.py) as the stand-in for an instruct model's wrong priors; the paper has no such probe.
Run: python experiments/experiment.py --probes MODEL_DIR
"""
import functools

import torch

import envs
import seed
import skills
from simulators.household import PROMPT, TRANSFORMS, expert_thought, kind_of

HABIT_TASKS = ("pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_clean_then_place_in_recep")


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
                prompt = skills.render_prompt(PROMPT, info["task"], history, observation, info["admissible"],
                                            history_window)
                goal = {"task_type": env.task_type, "goal_object": env.goal_object,
                        "goal_receptacle": env.goal_receptacle}
                right = f"<think>{expert_thought(goal, True, False)}</think><action>{env.expert_action()}</action>"
                habit = (f"<think>{expert_thought(goal, True, True)}</think>"
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


def preferences(policy, decisions, skill_per_decision, temperature=1.0):
    """Per decision, P(right) / (P(right) + P(habit)) with whole-response probabilities under the policy, the
    decision's prompt holding skill_per_decision[i] (skills.with_skill, as the teacher context; None: none)."""
    stop = policy.stop_ids[0] if policy.stop_ids else policy.tokenizer.eos_token_id
    prompts = [skills.with_skill(d[0], skill) if skill else d[0] for d, skill in zip(decisions, skill_per_decision)]
    prompts = [seed.encode_chat(policy.tokenizer, prompt) for prompt in prompts] * 2
    responses = [policy.tokenizer(text, add_special_tokens=False)["input_ids"] + [stop]
                 for column in (1, 2) for text in [decision[column] for decision in decisions]]
    logp = seed.response_logprobs(policy.model, prompts, responses, policy.pad_id, temperature).sum(-1)  # (2n,)
    right, habit = logp.view(2, len(decisions))                                                       # (n,), (n,)
    return torch.sigmoid(right - habit)                                                               # (n,)


def habit_probe(policy, decisions, temperature=1.0, with_skill=False):
    """Mean over decisions of P(right) / (P(right) + P(habit)): 0.5 = no preference, 1 = the habit unlearned.
    The warm-start's value shows how strong the habit is; its rise under RL is the learning a success rate
    shows only through the evaluation noise. with_skill: the decision's own skill sits in the prompt."""
    return preferences(policy, decisions, [d[3] if with_skill else None for d in decisions],
                       temperature).mean().item()


def skill_controls(policy, decisions, temperature=1.0, generic=None):
    """Does what a skill says decide, or only that there is one? Per decision, the lift over no skill of its own
    skill, of another decision's (shuffled: the next one whose task verb differs) and of a content-free one
    (generic), paired -> {control: (n,) lifts}. A policy that reads its skills lifts only with its own."""
    generic = generic or "Look around the room carefully before acting."
    verb = lambda d: d[3].split()[0]
    shuffled = [next((e[3] for e in decisions[i + 1:] + decisions[:i] if verb(e) != verb(d)), None)
                for i, d in enumerate(decisions)]
    plain = preferences(policy, decisions, [None] * len(decisions), temperature)
    return {name: preferences(policy, decisions, given, temperature) - plain
            for name, given in (("own", [d[3] for d in decisions]), ("shuffled", shuffled),
                                ("generic", [generic] * len(decisions)))}


def skill_lift(policy, decisions, temperature=1.0):
    """How far a skill in the context moves the decision it is about: habit_probe with the skill in the
    prompt minus without it. An instruct model that follows its context lifts it well above 0."""
    return (habit_probe(policy, decisions, temperature, with_skill=True)
            - habit_probe(policy, decisions, temperature))


def habit_failure(trajectory):
    """True when a household heat/cool/clean episode failed the planted habit's way: the goal object was put
    down at a receptacle of the target kind before any heat, cool or clean event."""
    gt = trajectory.gt or {}
    if trajectory.won or gt.get("task_type") not in HABIT_TASKS:
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
    fixed = sum(s is not None and TRANSFORMS[t.gt["task_type"]][0] in s.lower() for t, s in failed)
    return (fixed / len(failed) if failed else None), len(failed)


def habit_column(policy, cfg, split):
    """The household evaluation's extra column: habit_probe on the split's first --eval-tasks decisions."""
    decisions = habit_decisions(split, cfg.eval_tasks, cfg.history_window, cfg.max_steps)
    return {"habit": habit_probe(policy, decisions, cfg.temperature)}
