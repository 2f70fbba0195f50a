"""
experiments/success_bound.py: how much valid_seen success is there to gain on the household demo by unlearning the
planted habit, and how much by not issuing invalid commands? An answer to issue 38's "report what bounds them".

    python experiments/success_bound.py out/exp12/seed-6 out/exp12/grpo-6   # start model + each run's last checkpoint
    python experiments/success_bound.py out/exp11/seed-6 --tasks 48 --split valid_seen
    python experiments/success_bound.py out/exp21/seed-9 out/exp21/grpo-9 --lift-only  # only the skill lift's bound
    python experiments/success_bound.py out/exp21/seed-9 --lift-only --lift-temperature 0.4 --lift-samples 8

Each model plays the split's first --tasks tasks greedily (the evaluation's protocol) four times, with an env that
corrects it at one kind of step and otherwise plays what the policy wrote:

  as played      no correction: the evaluation's success;
  habit fixed    while it holds the goal object that still needs heating, cooling or cleaning, a command that is the
                 habit's (the skip-transform demonstrator's next command: walk to or put into the target) is
                 replaced by the expert's (walk to or use the appliance): success if the habit were unlearned fully
                 and nothing else changed, the most any teacher that fixes the habit could give;
  invalid fixed  a command the env would refuse ("Nothing happens.") is replaced by the expert's next command;
  both           both corrections.

The policy's prompt history keeps what it wrote, not the substitute (the rollout records the policy's command),
so a corrected step reads as its own command followed by the substitute's observation. The substitutions per
episode are reported beside the success.

Then, could SEED's teacher fix what bounds success? On the same greedy episodes (uncorrected), each model's teacher
re-scores its own commands with four skills in the context: its own analysis of the episode, another episode's
(shuffled), the ground-truth annotator's, a content-free one (the warm-up's). Printed per skill: the mean change of
a command's log-probability (teacher minus student, the whole response, nats) on invalid commands, on invalid
commands that repeat the step before (the greedy loops), and on valid ones, the invalid minus the valid (how much
more the skill argues against an invalid command than against a valid one) and the share of invalid commands the
teacher makes less likely; above them, the student's own mean log-prob of each kind (no skill). A teacher that can
break the loops lowers the invalid rows well below the valid ones.

Last, what bounds the self-analysis probe's skill lift (evaluation/self_analysis.py)? Each model plays the probe's
tasks (the start model's probe set) greedily, as the probe does (or --lift-samples times at --lift-temperature),
with no skill, with its own greedy analysis of each probe trajectory, with the next probe task's (cyclically over
all PROBE_TASKS; the probe cycles over its LIFT_TASKS, so only the last lift task's differs), with the annotator's
and with the next task's annotator skill. Printed: success on the probe's first LIFT_TASKS tasks (those the probe
plays) and on all PROBE_TASKS, and the lifts own - shuffled (the probe's skill lift) and annotator - annotator
shuffled (what a perfect analyzer's skills would give this policy: the lift's ceiling).
Greedy on the tiny model; the last digit can move with the thread count. Not in the paper (its benchmarks plant no
habit).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import envs  # noqa: E402
import seed  # noqa: E402
import train  # noqa: E402
from evaluation.self_analysis import LIFT_TASKS, PROBE_TASKS, probe_set, probe_set_path, shuffled  # noqa: E402
from experiments.analyzer_drift import run_config  # noqa: E402
from models.policy import load_policy  # noqa: E402
from simulators.household import TRANSFORMS, kind_of  # noqa: E402
from training.checkpoints import intact_checkpoints  # noqa: E402
from warmup.warm_start import GENERIC_SKILLS  # noqa: E402

CONDITIONS = {"as played": (False, False), "habit fixed": (True, False), "invalid fixed": (False, True),
              "both": (True, True)}


class Corrected:
    """A household env that plays the expert's command in place of the policy's at the steps it is told to fix."""

    def __init__(self, env, fix_habit, fix_invalid):
        self.env, self.fix_habit, self.fix_invalid = env, fix_habit, fix_invalid
        self.substitutions, self.reached_decision = 0, False

    def __getattr__(self, name):  # everything else is the wrapped env's
        return getattr(self.env, name)

    def reset(self, seed=None):
        self.substitutions, self.reached_decision = 0, False
        observation, info = self.env.reset(seed)
        self.admissible = set(info["admissible"])
        return observation, info

    def needs_transform(self):
        """The agent holds the goal object and it still lacks the task's heat / cool / clean property."""
        env = self.env
        if env.task_type not in TRANSFORMS or env.holding is None or kind_of(env.holding) != env.goal_object:
            return False
        return TRANSFORMS[env.task_type][2] not in env.properties[env.holding]

    def step(self, action):
        env, command = self.env, " ".join(str(action).split()).lower()
        if not env.done and self.needs_transform():
            self.reached_decision = True
            if self.fix_habit and command == env.expert_action(skip_transform=True) != env.expert_action():
                command, self.substitutions = env.expert_action(), self.substitutions + 1
        if not env.done and self.fix_invalid and command not in self.admissible:
            command, self.substitutions = env.expert_action(), self.substitutions + 1
        observation, reward, done, info = env.step(command)
        self.admissible = set(info["admissible"])
        return observation, reward, done, info


def play(policy, cfg, split, tasks, options, template, fix_habit, fix_invalid):
    """Greedy episodes on tasks 0..tasks-1 -> (success, substitutions per episode, reached-decision share,
    the trajectories)."""
    env_list = [Corrected(envs.make_env(cfg.env, split, i, **options), fix_habit, fix_invalid) for i in range(tasks)]
    trajectories = seed.rollout(policy, env_list, list(range(tasks)), 1, cfg.max_steps, template, cfg.max_new_tokens,
                                0.0, cfg.history_window, cfg.invalid_penalty, cfg.max_prompt_tokens,
                                desc=f"{split} {'habit' if fix_habit else ''} {'invalid' if fix_invalid else ''}")
    return (sum(t.won for t in trajectories) / tasks, sum(e.substitutions for e in env_list) / tasks,
            sum(e.reached_decision for e in env_list) / tasks, trajectories)


def teacher_on_commands(policy, cfg, trajectories):
    """The policy's own finished trajectories -> ({skill source: (mean delta on invalid, on repeated invalid, on valid
    commands, share of invalid lowered, (counts))}, (the student's mean log-prob of invalid, repeated invalid, valid
    commands)): how each skill in the teacher's context moves the log-probability of the policy's own commands, and
    where they stand without one."""
    own, _ = seed.analyze(policy, trajectories, cfg.analysis_prompt_tokens, cfg.analysis_max_new_tokens)
    annotate = envs.load(envs.spec(cfg.env).annotator)
    sources = {"own": own, "shuffled": own[1:] + own[:1],  # the next episode's analysis
               "annotator": [annotate(t, t.gt)[1] if t.gt else None for t in trajectories],
               "content-free": [GENERIC_SKILLS[0]] * len(trajectories)}
    kinds = []  # per step row: "invalid", "repeated" (invalid and the command before it) or "valid"
    for trajectory in trajectories:
        for index, step in enumerate(trajectory.steps):
            repeated = index > 0 and step.action == trajectory.steps[index - 1].action
            kinds.append("valid" if step.valid else "repeated" if repeated else "invalid")
    mean = lambda values: sum(values) / max(len(values), 1)  # noqa: E731
    pick = lambda values, wanted, keep: [v for v, kind, has in zip(values, kinds, keep)  # noqa: E731
                                         if has and kind in wanted]
    results, old = {}, None
    for name, skill_list in sources.items():
        rows = seed.step_rows(trajectories, skill_list)  # the same student rows under every source: scored once
        scored, teacher, _, has_teacher = seed.rescore(policy, rows, cfg.temperature, cfg.layout, cfg.max_batch_tokens,
                                                       need_old=old is None)
        old = scored if old is None else old  # (B, R)
        delta = (teacher - old).sum(dim=1)  # (B,) per command; padding is 0 in both, rows without a skill are dropped
        keep, delta = has_teacher.tolist(), delta.tolist()
        invalid, repeated = pick(delta, ("invalid", "repeated"), keep), pick(delta, ("repeated",), keep)
        valid = pick(delta, ("valid",), keep)
        results[name] = (mean(invalid), mean(repeated), mean(valid), mean([d < 0 for d in invalid]),
                         (len(invalid), len(repeated), len(valid)))
    command_logp = old.sum(dim=1).tolist()  # (B,) the student's, no skill: the same under every source
    student = tuple(mean(pick(command_logp, wanted, [True] * len(kinds)))
                    for wanted in (("invalid", "repeated"), ("repeated",), ("valid",)))
    return results, student


def bound_and_teacher(policy, cfg, args, options, template, name):
    """The first table's row (success under each correction) and the second table's lines for one model."""
    cells, reached = [], 0.0
    for fix_habit, fix_invalid in CONDITIONS.values():
        success, substitutions, decision, trajectories = play(policy, cfg, args.split, args.tasks, options, template,
                                                              fix_habit, fix_invalid)
        cells.append(f"{success:.3f} ({substitutions:4.2f})")
        if not (fix_habit or fix_invalid):  # as played: the episodes the teacher re-scores
            reached, played = decision, trajectories
    results, student = teacher_on_commands(policy, cfg, played)
    lines = [f"{name:<30} {'(no skill)':<13} {student[0]:7.3f} {'':6} {student[1]:9.3f} {'':6} "
             f"{student[2]:7.3f}  <- the student's own log-prob"]
    lines += [f"{name:<30} {source:<13} {invalid:+7.3f} ({counts[0]:4d}) {repeated:+9.3f} ({counts[1]:4d}) "
              f"{valid:+7.3f} ({counts[2]:4d}) {invalid - valid:>+16.3f} {lowered:>16.3f}"
              for source, (invalid, repeated, valid, lowered, counts) in results.items()]
    return f"{name:<30} " + " ".join(f"{cell:>20}" for cell in cells) + f" {reached:>9.3f}", lines


def lift_bound(policy, cfg, probe, options, template, temperature=0.0, samples=1):
    """The probe trajectories -> {skill source: [success, per probe task]}, each task played `samples` times at
    `temperature` (greedy once: the probe's protocol) with that source's skill (none, own, own shuffled, annotator,
    annotator shuffled) in the prompt, as the probe plays its lift tasks."""
    own, _ = seed.analyze(policy, probe, cfg.analysis_prompt_tokens, cfg.analysis_max_new_tokens, 0.0)
    annotate = envs.load(envs.spec(cfg.env).annotator)
    annotator = [annotate(t, t.gt)[1] for t in probe]
    sources = {"none": [None] * len(probe), "own": own, "own shuffled": shuffled(own), "annotator": annotator,
               "annotator shuffled": shuffled(annotator)}
    won = {}
    for name, skill_list in sources.items():
        env_list = [envs.make_env(cfg.env, "valid_seen", i, **options) for i in range(len(probe) * samples)]
        played = seed.rollout(policy, env_list, [t.seed for t in probe], samples, cfg.max_steps, template,
                              cfg.max_new_tokens, temperature, cfg.history_window, cfg.invalid_penalty,
                              cfg.max_prompt_tokens, desc=f"probe tasks, {name}",
                              skill_per_rollout=[skill for skill in skill_list for _ in range(samples)],
                              generator=torch.Generator().manual_seed(0))
        won[name] = [sum(float(t.won) for t in played[i * samples:(i + 1) * samples]) / samples
                     for i in range(len(probe))]
    return won


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="household run folders (config.json, checkpoints/); the start "
                                                "model is the first run's")
    parser.add_argument("--split", default="valid_seen", help="split played (default: valid_seen)")
    parser.add_argument("--tasks", type=int, default=48, help="tasks played, 0..N-1 (default: 48)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--lift-only", action="store_true", help="only the last table, the skill lift's bound")
    parser.add_argument("--lift-temperature", type=float, default=0.0, help="the last table's sampling temperature "
                                                                            "(default: 0, greedy as the probe)")
    parser.add_argument("--lift-samples", type=int, default=1, help="the last table's episodes per task (default: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = run_config(args.runs[0])
    if cfg.env != "household":
        raise SystemExit(f"{args.runs[0]}: env {cfg.env}; the habit and its correction exist on household only")
    options = envs.env_options(cfg)
    template = envs.load(envs.spec(cfg.env).prompt)
    models = [("start", train.start_model(cfg, options))]
    models += [(f"{os.path.basename(os.path.normpath(run))} {os.path.basename(intact_checkpoints(run)[-1])}",
                intact_checkpoints(run)[-1]) for run in args.runs if intact_checkpoints(run)]
    if not args.lift_only:
        print(f"greedy {args.split} success on tasks 0-{args.tasks - 1} (substitutions per episode); "
              f"'decision' = share of episodes that took the goal object still needing its step")
        print(f"{'model':<30} " + " ".join(f"{name:>20}" for name in CONDITIONS) + f" {'decision':>9}")
    teacher_lines, lift_lines = [], []  # the second and third tables, printed after the first
    probe = probe_set(load_policy(models[0][1], "cpu", "float32"), cfg, template, options,
                      probe_set_path(models[0][1], cfg))
    for name, path in models:
        policy = load_policy(path, "cpu", "float32")
        if not args.lift_only:
            row, lines = bound_and_teacher(policy, cfg, args, options, template, name)
            print(row, flush=True)
            teacher_lines += lines
        lift_lines.append(lift_row(name, lift_bound(policy, cfg, probe, options, template,
                                                        args.lift_temperature, args.lift_samples)))
    if args.lift_only:
        return print_lift(lift_lines)
    print(f"\nthe teacher on the policy's own commands, greedy {args.split} episodes: mean log-prob change with the "
          f"skill in the context (nats per command; count)")
    print(f"{'model':<30} {'skill':<13} {'invalid':>14} {'repeated invalid':>17} {'valid':>14} "
          f"{'invalid - valid':>16} {'invalid lowered':>16}")
    print("\n".join(teacher_lines))
    print_lift(lift_lines)


def lift_row(name, won):
    """One model's row of the last table: success with each skill source on the lift tasks / all probe tasks, then
    the own and the perfect analyzer's lifts, each on the lift tasks / all."""
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    lift = lambda a, b, n: mean([x - y for x, y in zip(won[a][:n], won[b][:n])])  # noqa: E731
    return (f"{name:<30} " + " ".join(f"{mean(w[:LIFT_TASKS]):.3f}/{mean(w):.3f}".rjust(19) for w in won.values())
            + f" {lift('own', 'own shuffled', LIFT_TASKS):+.3f}/{lift('own', 'own shuffled', None):+.3f}"
            + f" {lift('annotator', 'annotator shuffled', LIFT_TASKS):+.3f}/"
            + f"{lift('annotator', 'annotator shuffled', None):+.3f}")


def print_lift(lift_lines):
    """The last table: the skill lift's bound."""
    print(f"\nthe probe's tasks played with a skill in the prompt: success on the first {LIFT_TASKS} (the "
          f"probe's lift tasks) / all {PROBE_TASKS}; lifts own - own shuffled (the probe's) and annotator - annotator "
          f"shuffled (a perfect analyzer's)")
    print(f"{'model':<30} " + " ".join(f"{name:>19}" for name in ("none", "own", "own shuffled", "annotator",
                                                                  "annotator shuffled")) + "  own lift  perfect lift")
    print("\n".join(lift_lines))


if __name__ == "__main__":
    main()
