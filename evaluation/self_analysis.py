"""evaluation/self_analysis.py: the analyzer measured like the policy -- at every evaluation, for every arm, the
current policy analyzes a fixed set of finished trajectories and plays their tasks with what it wrote.

The probe set: the first PROBE_TASKS valid_seen tasks played once by the start model, sampled at the training
temperature (so it holds successes and failures), cached as JSON beside the start model (the shipped warm-start
ships its own): the same trajectories for every evaluation, arm and seed. A missing or corrupt file is recorded
again, with one warning line. At each valid_seen evaluation:
  parse failures  the share of the policy's greedy analyses of the probe trajectories that do not parse;
  fixing skills   of the failed probe trajectories, the share whose skill names the fix the env's ground truth
                  gives (envs.EnvSpec.names_fix; None for an env without such a check);
  skill lift      greedy success on the first LIFT_TASKS probe tasks with the policy's own skill for that task in
                  the prompt minus with another of those tasks' skill (shuffled): the in-context value of what its
                  analysis *says*, paired per task; raw lift: with its own skill minus without (the evaluation's
                  own episodes of those tasks).
Analyses are cheap and episodes are not, so all PROBE_TASKS trajectories are analyzed (a step of 1/24 in parse
failures, about 1/18 in fixing skills) and LIFT_TASKS are played twice (a step of 1/8 in skill lift).
The GRPO arm is measured too: its policy can write skills, it only does not train on them. Departure from the
paper: the paper does not measure its analyzer. Run: python train.py (every evaluation reports it).
"""
import dataclasses
import json
import os

import torch

import envs
import seed

PROBE_TASKS = 24  # trajectories of valid_seen tasks 0..23 analyzed: 32 analyses take 1.8 s on the tiny demo, a
# rollout of 48 tasks 8.1 s (2 idle cores), so analyses are almost free beside the lift's episodes
LIFT_TASKS = 8  # the first 8 are played with their own and a shuffled skill; every evaluation also plays them
# without one (8: the whole probe costs about a quarter of an evaluation on the tiny demo, 12 lift tasks 0.35)
FILE_NAME = "probe_set.json"
STEP_FIELDS = ("observation", "response", "action", "reward", "penalty", "valid")  # what the analyzer reads


def probe_set_path(start_path, cfg):
    """Beside the start model when this repository made it (the tiny warm-up, a stage-1 model), so every run from
    it reads the same set; else (a model as the user gave it) in the run's out dir."""
    ours = start_path != cfg.model and os.path.isdir(start_path)
    return os.path.join(start_path if ours else cfg.out_dir, FILE_NAME)


def save_probe_set(path, trajectories, env_name):
    # field by field, not dataclasses.asdict: that would deep-copy every step's prompt, a screenshot's included
    records = [{**{f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name != "steps"},
                "steps": [{k: getattr(s, k) for k in STEP_FIELDS} for s in t.steps]} for t in trajectories]
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump({"env": env_name, "tasks": len(records), "trajectories": records}, f)
    os.replace(temporary, path)  # complete or absent


def read_probe_set(path, env_name):
    """The cached probe set as Trajectory records; raises ValueError saying what is wrong with the file."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("env") != env_name or not isinstance(data.get("trajectories"), list):
        raise ValueError(f"not a probe set of --env {env_name}")
    found = []
    for record in data["trajectories"]:
        steps = [seed.Step(**{k: step[k] for k in STEP_FIELDS}) for step in record["steps"]]
        found.append(seed.Trajectory(**{**{k: record[k] for k in ("task", "task_type", "won", "reward", "gt",
                                                                  "group", "seed")}, "steps": steps}))
    if len(found) != PROBE_TASKS or any(t.gt is None for t in found):
        raise ValueError(f"{len(found)} trajectories, {PROBE_TASKS} finished ones expected")
    return found


def probe_set(start_policy, cfg, template, options, path):
    """The cached probe set at `path`, or the start model's episodes on valid_seen tasks 0..PROBE_TASKS-1,
    recorded (and cached) now; a missing or unreadable cache costs one warning line."""
    try:
        return read_probe_set(path, cfg.env)
    except FileNotFoundError:
        why = "none cached yet"
    except (OSError, ValueError, KeyError, TypeError) as error:  # a torn or foreign file
        why = f"the cached one is unusable ({type(error).__name__}: {str(error)[:120]})"
    print(f"warning: self-analysis probe: {why}; recording {PROBE_TASKS} start-model episodes into {path}")
    env_list = [envs.make_env(cfg.env, "valid_seen", i, **options) for i in range(PROBE_TASKS)]
    trajectories = seed.rollout(start_policy, env_list, list(range(PROBE_TASKS)), 1, cfg.max_steps, template,
                                cfg.max_new_tokens, cfg.temperature, cfg.history_window, cfg.invalid_penalty,
                                cfg.max_prompt_tokens, desc="record probe set",
                                generator=torch.Generator(start_policy.device).manual_seed(1234))
    trajectories = [t for t in trajectories if t.gt is not None]
    save_probe_set(path, trajectories, cfg.env)
    return read_probe_set(path, cfg.env)


def shuffled(skill_list):
    """Each task gets the next task's skill that parsed (cyclically, never its own); None when no other did."""
    n = len(skill_list)
    return [next((skill_list[(i + k) % n] for k in range(1, n) if skill_list[(i + k) % n] is not None), None)
            for i in range(n)]


def self_analysis(policy, cfg, trajectories, template, env_factory, without_won):
    """The probe's numbers for the current policy (it analyzes the probe set, then plays its first LIFT_TASKS
    tasks with what it wrote); env_factory(i) builds valid_seen env i; without_won: the evaluation's outcome of
    those tasks without a skill."""
    skill_list, _ = seed.analyze(policy, trajectories, cfg.analysis_prompt_tokens, cfg.analysis_max_new_tokens,
                                 0.0, desc="self-analysis probe")
    names_fix = envs.spec(cfg.env).names_fix
    failed = [(t, s) for t, s in zip(trajectories, skill_list) if not t.won]
    checks = [envs.load(names_fix)(t, s) for t, s in failed] if names_fix else []
    checks = [c for c in checks if c is not None]
    won, lifted, own = {}, trajectories[:LIFT_TASKS], skill_list[:LIFT_TASKS]
    for name, skills_given in (("own", own), ("shuffled", shuffled(own))):
        env_list = [env_factory(i) for i in range(len(lifted))]
        played = seed.rollout(policy, env_list, [t.seed for t in lifted], 1, cfg.max_steps, template,
                              cfg.max_new_tokens, cfg.eval_temperature, cfg.history_window, cfg.invalid_penalty,
                              cfg.max_prompt_tokens, desc=f"probe, {name} skills", skill_per_rollout=skills_given,
                              generator=torch.Generator(policy.device).manual_seed(cfg.seed),
                              env_timeout=cfg.env_timeout)
        won[name] = [float(t.won) for t in played]
    mean = lambda values: sum(values) / max(1, len(values))
    return {"parse_fail": mean([s is None for s in skill_list]), "fixing": mean(checks) if checks else None,
            "lift": mean([a - b for a, b in zip(won["own"], won["shuffled"])]),
            "raw_lift": mean([a - b for a, b in zip(won["own"], without_won)])}
