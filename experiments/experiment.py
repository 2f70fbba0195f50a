"""
experiment.py: SEED vs GRPO on the embedded household env (or another, `-- --env vision`), and a picture of the
distillation signal.

    python experiments/experiment.py --seeds 0 1 2                       # both algorithms x 3 seeds, one warm-start
    python experiments/experiment.py --seeds 0 1 2 --updates 20 --eval-every 4 --root out/vision-experiment \
        -- --env vision                                                  # on screenshots (docs/vision.md)
    python experiments/experiment.py --seeds 0 --updates 2 --smoke       # a quick check that the pipeline runs
    python experiments/experiment.py --picture out/experiment/seed-0     # one trajectory's delta (HTML, terminal)
    python experiments/experiment.py --probes MODEL_DIR                  # habit probe, skill lift, loop warnings,
                                                                        # fixing-skill share
                                                                        # (a vision model: skills right about pixels)
    python experiments/experiment.py --mechanism MODEL_DIR               # SEED vs GRPO updates on all-failed groups
    python experiments/experiment.py --evaluate DIR [DIR ...]            # sampled evaluation of finished models
    python experiments/experiment.py --evaluate DIR --eval-temperature 0 --eval-tasks 1440 -- --env vision

Every run starts from the same cached warm-start (train.py --warmup-seed), gets the same episode budget
(--updates x --tasks-per-update x --group-size) and is evaluated every --eval-every updates on valid_seen
and valid_unseen. The table (mean and spread over seeds against training episodes), the episodes SEED
needs to reach GRPO's final success, and the analyzer parse rate and delta statistics over training go
to <root>/experiment.md, plus experiment.png when matplotlib is installed. Extra arguments after `--`
go to every train.py run (e.g. -- --distill-coef 0.1 --distill-mode gated). On a --root that holds runs, a
finished one is reused, one that finished fewer --updates or was killed after a checkpoint is continued
(train.py --resume, exactly as if it had not stopped), and --rerun starts them over.
"""
import argparse
import html
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root holds train.py
sys.path.insert(0, REPO)
from training.logs import read_records as read_jsonl  # noqa: E402  one JSONL reader for the whole repository


# the arms an experiment can run, each train.py's flags on top of the shared ones: SEED and GRPO, the paper's
# objective (its gated OPD loss) and its three ablations (REFERENCE 1b), the shuffled-skill control, and the
# analyzer-training candidates and the teacher anchor (training/analyzer.py); docs/experiments.md reports each
ARMS = {"seed": [], "grpo": ["--algo", "grpo"],  # seed: the tiny defaults, the paper's gated loss since version 9
        "seed-advantage": ["--distill-mode", "advantage", "--distill-coef", "0.1"],  # OPID's path, the default before
        "shuffled": ["--teacher-skill", "shuffled"],  # each teacher gets another task's skill
        "annotator": ["--teacher-skill", "annotator"],  # each teacher gets the ground-truth annotator's skill
        "start-analyzer": ["--analyzer", "start"],  # the paper's "without on-policy skills"
        "no-stage1": ["--warmup-analyzer-share", "0"],  # the paper's "without hindsight-skill SFT" (tiny)
        "analyzer-confirmed": ["--analyzer-training", "confirmed"],
        "analyzer-explored": ["--analyzer-training", "explored"],
        "analyzer-confirmed-and-explored": ["--analyzer-training", "confirmed-and-explored"],
        "analyzer-explored-where-wrong": ["--analyzer-training", "explored-where-wrong"],
        "analyzer-explored-balanced": ["--analyzer-training", "explored-balanced"],
        "analyzer-explored-balanced-8": ["--analyzer-training", "explored-balanced", "--explore-samples", "8"],
        "analyzer-lift": ["--analyzer-training", "lift"],
        "analyzer-anchor": ["--analyzer-training", "anchor"],
        "teacher-anchor": ["--teacher-anchor", "1.0"],  # keeps the teacher's response to skills during RL
        "teacher-effect-anchor": ["--teacher-anchor", "1.0", "--teacher-anchor-target", "effect"],
        "centered": ["--distill-center"],  # only the skill's relative verdict is distilled
        "centered-shuffled": ["--distill-center", "--teacher-skill", "shuffled"],  # its control
        "centered-effect-anchor": ["--teacher-anchor", "1.0", "--teacher-anchor-target", "effect", "--distill-center"],
        # the analyzer learns to write the fix while the teacher keeps its response to skills: the lift needs both
        "explored-effect-anchor": ["--analyzer-training", "explored", "--teacher-anchor", "1.0",
                                   "--teacher-anchor-target", "effect"],
        "teacher-rl": ["--teacher-rl", "1.0"]}  # RL trains the teacher's context too (its own skill in the prompt)


def analyzer_limits():
    """(analysis prompt tokens, analysis max new tokens) of the tiny preset: the probes analyze as training does."""
    import train
    preset = train.PRESETS["tiny"]
    return preset["analysis_prompt_tokens"], preset["analysis_max_new_tokens"]


def warm_up_flags(flags):
    """The tiny warm-up's own flags among an arm's (flag, value) pairs: an arm with some needs its own warm-start."""
    return tuple(x for pair in zip(flags[::2], flags[1::2]) if pair[0].startswith("--warmup") for x in pair)


def run_all(args, extra):
    """Every (arm, seed) run -> [(arm, seed, out_dir)]. --jobs > 1 runs that many at a time, each with
    cores / jobs torch threads and its output in <out_dir>.log, after building each warm-start the arms need
    once. The root is held by this process (training/locks.py): a second experiment on it stops at once."""
    from training.locks import LOCK_NAME, FolderLock
    FolderLock(os.path.join(args.root, LOCK_NAME), "experiments/experiment.py").acquire()
    runs, running, threads = [], [], max(1, (os.cpu_count() or 1) // args.jobs)
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads)} if args.jobs > 1 else None
    shared = ["--cache-dir", args.cache_dir, "--warmup-seed", str(args.warmup_seed)] + extra
    # runs side by side would each build the same missing warm-start: each one the arms need is built first
    warm_ups = sorted({warm_up_flags(ARMS[arm]) for arm in args.arms}) if args.jobs > 1 else []
    for index, flags in enumerate(warm_ups):
        subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "--stage", "sft", "--overwrite",
                        "--out-dir", os.path.join(args.root, f"warm-start-{index}")] + shared + list(flags),
                       check=True)
    for seed_value in args.seeds:
        for arm in args.arms:
            out_dir = os.path.join(args.root, f"{arm}-{seed_value}")
            runs.append((arm, seed_value, out_dir))
            how = plan_run(out_dir, args.updates, args.rerun)
            if how == "reuse":
                print(f"{out_dir}: done before, reusing (--rerun to redo)")
                continue
            command = [sys.executable, os.path.join(REPO, "train.py"), "--seed", str(seed_value),
                       "--out-dir", out_dir, "--" + how, "--updates", str(args.updates),
                       "--eval-every", str(args.eval_every)] + ARMS[arm] + shared
            while len(running) >= args.jobs:
                wait(running.pop(0))
            print("running:", " ".join(command), flush=True)
            log = open(out_dir + ".log", "a" if how == "resume" else "w") if args.jobs > 1 else None
            running.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT if log else None,
                                             env=environment), command, log))
    for process in running:
        wait(process)
    return runs


def plan_run(out_dir, updates, rerun=False):
    """What run_all does with one run folder: "overwrite" (start it over: --rerun, or nothing to continue),
    "reuse" (it finished at --updates) or "resume" (train.py --resume continues it exactly: a run killed before
    its end, or one that finished fewer updates, so a budget raised on the same --root trains only the new
    updates). A run past --updates is refused: its table would mix budgets."""
    from training.checkpoints import intact_checkpoints
    summary = os.path.join(out_dir, "summary.json")
    if rerun or not os.path.isdir(out_dir):
        return "overwrite"
    if os.path.exists(summary):
        with open(summary) as file:
            trained = max((row.get("update", 0) for row in json.load(file).get("eval", [])), default=0)
    else:  # killed: its newest checkpoint's update (folders are named update_000015)
        saved = intact_checkpoints(out_dir)
        if not saved:
            return "overwrite"
        trained = int(os.path.basename(saved[-1]).split("_")[1])
    if trained > updates:
        raise SystemExit(f"{out_dir} trained {trained} updates, more than --updates {updates}: use --rerun or "
                         "another --root")
    return "reuse" if trained == updates and os.path.exists(summary) else "resume"


def wait(running_run):
    process, command, log = running_run
    returncode = process.wait()
    if log is not None:
        log.close()
    if returncode != 0:
        raise subprocess.CalledProcessError(process.returncode, command)


def spread(values):
    return (statistics.mean(values), statistics.pstdev(values)) if values else (float("nan"), float("nan"))


# eval.jsonl keys (the probes' in r["probes"]) and what they mean; the last three: evaluation/self_analysis.py
METRICS = (("micro", "success"), ("habit", "habit unlearned"), ("parse_fail", "parse failures (probe)"),
           ("fixing", "fixing skills (probe)"), ("lift", "skill lift (probe)"), ("raw_lift", "raw skill lift (probe)"))


def evaluations(run_dir):
    """A run's eval.jsonl records with their probe columns (e.g. the household habit) as keys of their own."""
    return [{**r, **r.get("probes", {})} for r in read_jsonl(os.path.join(run_dir, "eval.jsonl"))]


def summarise(args, runs):
    """Markdown tables: success (and, on the household env, how far the warm-up's skip habit is unlearned) on
    both splits vs training episodes, mean +- std over seeds; episodes SEED needs to reach GRPO's final value."""
    config = json.load(open(os.path.join(runs[0][2], "config.json")))
    per_update = config["tasks_per_update"] * config["group_size"]
    updates = evaluation_updates(runs)
    seeds = f"{len(args.seeds)} seed{'s' * (len(args.seeds) != 1)}"
    lines = [f"# SEED vs GRPO on the {config['env']} env ({seeds}, {per_update} episodes per update)"]
    curves = {}
    for metric, name in METRICS:
        rows = []
        for algo in args.arms:
            for split in ("valid_seen", "valid_unseen"):
                row = []
                for update in updates:
                    values = [r[metric] for a, _, d in runs if a == algo for r in evaluations(d)
                              if r["split"] == split and r["update"] == update and r.get(metric) is not None]
                    mean, std = spread(values)
                    curves.setdefault((metric, algo, split), []).append((update * per_update, mean, std))
                    row.append(f"{mean:.3f} ± {std:.3f}")
                if any(cell != "nan ± nan" for cell in row):  # the probes read valid_seen only
                    rows.append(f"| {algo} | {split} | " + " | ".join(row) + " |")
        if all(math.isnan(mean) for (m, _, _), points in curves.items() if m == metric for _, mean, _ in points):
            continue  # not measured on this env (the habit probe is household-only)
        lines += ["", f"{name}:", "", "| algo | split | " + " | ".join(f"{u * per_update} ep" for u in updates) + " |",
                  "|---|---|" + "---|" * len(updates)] + rows
    lines += ["", "| algo | parse_fail (first -> last update) | delta_abs_mean | teacher_token_share | adv_mean |",
              "|---|---|---|---|---|"]
    for algo in args.arms:
        metrics = [read_jsonl(os.path.join(d, "metrics.jsonl")) for a, _, d in runs if a == algo]
        first = [m[0].get("parse_fail") for m in metrics if m and m[0].get("parse_fail") is not None]
        last = [m[-1].get("parse_fail") for m in metrics if m and m[-1].get("parse_fail") is not None]
        delta = [x["delta_abs_mean"] for m in metrics for x in m if "delta_abs_mean" in x]
        share = [x["teacher_token_share"] for m in metrics for x in m if "teacher_token_share" in x]
        # the token mean of A_grpo + lambda delta
        advantage = [x["adv_mean"] for m in metrics for x in m if "adv_mean" in x]
        fmt = lambda v: f"{statistics.mean(v):.3f}" if v else "-"
        lines.append(f"| {algo} | {fmt(first)} -> {fmt(last)} | {fmt(delta)} | {fmt(share)} | {fmt(advantage)} |")
    if any(not math.isnan(mean) for (m, _, _), points in curves.items() if m == "habit"
           for _, mean, _ in points):
        lines += ["", ratio_line(curves, "habit", "habit unlearned")]
    lines += [""] + [self_analysis_line(curves, arm) for arm in args.arms if ("lift", arm, "valid_seen") in curves]
    lines += [ablation_line(curves, "shuffled", "shuffled skills")] if "shuffled" in args.arms else []
    lines += ablation_table(curves, args.arms)
    lines += ["", ratio_line(curves)]  # success last
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.root, "experiment.md"), "w") as f:
        f.write(text)
    print(text)
    plot(args, curves)


def self_analysis_line(curves, arm):
    """`self-analysis over training (ARM): parse failures A -> B; fixing skills F0 -> F1; skill lift X ± s ->
    Y ± t`: the probe's numbers at the first and the last evaluation, mean (± std) over seeds."""
    point = lambda metric, index: (curves.get((metric, arm, "valid_seen")) or [(0, float("nan"), 0.0)])[index]
    show = lambda metric: " -> ".join(f"{point(metric, i)[1]:.3f}" for i in (0, -1))
    (_, x, s), (_, y, t) = point("lift", 0), point("lift", -1)
    return (f"self-analysis over training ({arm}): parse failures {show('parse_fail')}; fixing skills "
            f"{show('fixing')}; skill lift {x:.3f} ± {s:.3f} -> {y:.3f} ± {t:.3f}")


def ablation_line(curves, arm, name):
    """`ablation (NAME): final valid_seen success SEED A ± s, ARM B ± t`."""
    (_, a, s), (_, b, t) = curves[("micro", "seed", "valid_seen")][-1], curves[("micro", arm, "valid_seen")][-1]
    return f"ablation ({name}): final valid_seen success SEED {a:.3f} ± {s:.3f}, {arm} {b:.3f} ± {t:.3f}"


def ablation_table(curves, arms):
    """Every arm's final valid_seen and valid_unseen success, mean ± std over seeds (the paper's Table 2 form)."""
    final = lambda arm, split: curves[("micro", arm, split)][-1]
    lines = ["", "| arm | final valid_seen success | final valid_unseen success | gain over the start (seen) |",
             "|---|---|---|---|"]
    for arm in arms:
        (_, seen, seen_std), (_, unseen, unseen_std) = final(arm, "valid_seen"), final(arm, "valid_unseen")
        gain = seen - curves[("micro", arm, "valid_seen")][0][1]
        lines.append(f"| {arm} | {seen:.3f} ± {seen_std:.3f} | {unseen:.3f} ± {unseen_std:.3f} | {gain:+.3f} |")
    return lines


def episodes_to_reach(curve, target):
    """The first training-episode count at which a [(episodes, mean, std)] curve reaches target, linear
    between evaluations; None when it never does."""
    if curve and curve[0][1] >= target:
        return curve[0][0]
    for (x0, y0, _), (x1, y1, _) in zip(curve, curve[1:]):
        if y1 >= target:  # y0 < target <= y1
            return x0 + (x1 - x0) * (target - y0) / (y1 - y0)
    return None


def ratio_line(curves, metric="micro", name="success"):
    """The experiment's last line: GRPO's episodes divided by the episodes SEED needs to reach GRPO's final
    valid_seen mean (linear between evaluations), and both final means +- std over seeds. "not different"
    instead of a ratio when GRPO's gain or the final SEED-GRPO gap is within the spread over seeds. Another
    metric than success (the habit probe) names itself after "episodes ratio (GRPO/SEED)"."""
    head = "episodes ratio (GRPO/SEED)" + ("" if metric == "micro" else f" on {name}")
    grpo, seed_curve = curves.get((metric, "grpo", "valid_seen")), curves.get((metric, "seed", "valid_seen"))
    if not grpo or not seed_curve:
        return f"{head}: needs both algorithms"
    (budget, target, grpo_std), (_, final, seed_std) = grpo[-1], seed_curve[-1]
    finals = f"final valid_seen {name} SEED {final:.3f} ± {seed_std:.3f}, GRPO {target:.3f} ± {grpo_std:.3f}"
    gain, gap = target - grpo[0][1], final - target
    if gain <= grpo_std or abs(gap) <= max(seed_std, grpo_std):
        return f"{head}: not different; {finals}"
    if gap < 0:  # SEED may pass GRPO's final mid-run and fall back: a run that ends behind gets no ratio
        return f"{head}: < 1 (SEED ends below GRPO); {finals}"
    reached = episodes_to_reach(seed_curve, target)
    ratio = f"{budget / max(reached, 1e-9):.2f}" if reached else f"< 1 (SEED short of GRPO at {budget})"
    return f"{head}: {ratio}; {finals}"


def evaluation_updates(runs):
    return sorted({r["update"] for _, _, d in runs for r in read_jsonl(os.path.join(d, "eval.jsonl"))})


def plot(args, curves):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return
    metrics = [(metric, name) for metric, name in METRICS
               if any(not math.isnan(mean) for (m, _, _), points in curves.items() if m == metric
                      for _, mean, _ in points)]
    figure, axes = plt.subplots(len(metrics), 2, figsize=(10, 4 * len(metrics)), squeeze=False)
    for (metric, name), axis_row in zip(metrics, axes):
        for axis, split in zip(axis_row, ("valid_seen", "valid_unseen")):
            for algo in args.arms:
                points = curves.get((metric, algo, split), [])
                x, mean, std = zip(*points) if points else ([], [], [])
                axis.plot(x, mean, marker="o", label=algo)
                axis.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
            axis.set_title(f"{name}, {split}")
            axis.set_xlabel("training episodes")
            axis.grid(alpha=0.3)
        axis_row[0].set_ylabel(name)
    axes[0][0].legend()
    path = os.path.join(args.root, "experiment.png")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


def probes(model, episodes=48, history_window=3, max_steps=20, seed_value=0):
    """What decides whether SEED can help on the household demo, for a model folder (a warm-start or a
    checkpoint): the habit probe, how far the skill in the context lifts the decision it is about
    (skill_lift, both splits), whether a warning about a refused command breaks the loop only when it names that
    command (loop_controls: the analyzer's commonest failure skill), and of the sampled episodes that failed the
    habit's way, the share whose self-written skill names the fix. Prints one line per measure, returns them."""
    import envs
    import seed
    from models.policy import load_policy
    from evaluation import habit
    from simulators.household import PROMPT
    policy = load_policy(model, device="cpu", dtype="float32")
    found = {}
    for split in ("valid_seen", "valid_unseen"):
        decisions = habit.habit_decisions(split, 48, history_window, max_steps)
        found[f"habit {split}"] = habit.habit_probe(policy, decisions)
        controls = habit.skill_controls(policy, decisions)
        for name, lifts in controls.items():  # does what the skill says decide? paired per decision
            found[f"skill lift {split}, {name} skill"] = lifts.mean().item()
        for name in ("shuffled", "generic"):
            found[f"own minus {name} lift {split}: mean, std, decisions where own is higher"] = paired(
                controls["own"] - controls[name])
    controls = loop_controls(policy, loop_decisions("valid_seen", 48, history_window, max_steps))
    found["loop decisions valid_seen: preference for the expert's command over the repeat"] = \
        controls.pop("none").mean().item()
    for name, lifts in controls.items():  # the analyzer's commonest failure skill: does what it names decide?
        found[f"loop lift valid_seen, {name} ({len(lifts)} decisions)"] = lifts.mean().item()
    found["own minus another command's warning, loop lift: mean, std, decisions where own is higher"] = paired(
        controls["own warning"] - controls["another command's warning"])
    env_list = [envs.make_env("household", "train", i, max_steps=max_steps) for i in range(episodes)]
    tasks = habit.habit_task_seeds(episodes)
    trajectories = seed.rollout(policy, env_list, tasks, 1, max_steps, PROMPT, 48, 1.0, history_window,
                                generator=torch.Generator().manual_seed(seed_value))
    skill_list, _ = seed.analyze(policy, trajectories, *analyzer_limits())
    share, failed = habit.fixing_skill_share(trajectories, skill_list)
    found["fixing skill share"], found["habit failures"] = share, failed
    for name, value in found.items():
        print(f"{name}: {value if value is None or isinstance(value, (int, str)) else f'{value:.3f}'}")
    return found


def paired(gap):
    """A paired control's (n,) per-decision differences as "mean, std, k of n" (k: decisions above 0)."""
    return f"{gap.mean().item():+.3f}, {gap.std().item():.3f}, {int((gap > 0).sum())} of {len(gap)}"


def loop_decisions(split="valid_seen", count=48, history_window=3, max_steps=20, epsilon=0.4):
    """The loop's decision: the step right after a command the env refused, in noisy expert episodes of a split
    (as the warm-up makes them: warmup/warm_start.py expert_episode), where the expert's label is another command.
    -> [(prompt, expert's response, the response repeating the refused command with the same think, the
    annotator's warning naming the refused command, the same warning naming another command of the episode)]."""
    import random
    import envs
    from annotators.text_worlds import refusal_skill
    from warmup.warm_start import expert_episode
    decisions, task_seed = [], 0
    while len(decisions) < count and task_seed < 20 * count:
        env, rng = envs.make_env("household", split, task_seed, max_steps=max_steps), random.Random(task_seed)
        trajectory, examples, _ = expert_episode(env, task_seed, epsilon, rng, history_window)
        task_seed += 1
        refused = [(index + 1, step.action) for index, step in enumerate(trajectory.steps[:-1]) if not step.valid
                   and step.action and f"<action>{step.action}</action>" not in examples[index + 1][1]]
        for index, command in refused[:1]:
            others = sorted({step.action for step in trajectory.steps if step.action} - {command})
            prompt, right = examples[index]
            repeat = re.sub(r"<action>.*</action>", f"<action>{command}</action>", right)
            if others:
                decisions.append((prompt, right, repeat, refusal_skill(command, 2, rng),
                                  refusal_skill(rng.choice(others), 2, rng)))
    return decisions


def loop_controls(policy, decisions):
    """Does a warning about a loop break it, and only when it names the command looped? Per loop decision, the
    lift over no skill of P(expert's command) / (P(expert's) + P(repeat)) with the warning naming the refused
    command (own), the warning naming another command and a content-free skill, paired -> {context: (n,) lifts}
    (and "none": the preference itself)."""
    from evaluation import habit
    from warmup.warm_start import GENERIC_SKILLS
    plain = habit.preferences(policy, decisions, [None] * len(decisions))  # (n,)
    return {"none": plain, **{name: habit.preferences(policy, decisions, given) - plain for name, given in (
        ("own warning", [d[3] for d in decisions]), ("another command's warning", [d[4] for d in decisions]),
        ("generic", [GENERIC_SKILLS[0]] * len(decisions)))}}


def screen_skill_probes(model, episodes=64, seed_value=0):
    """Are a vision model's self-written skills right about the screen? It plays `episodes` train tasks (one
    sampled episode each, as in training) and analyzes them. Of the parsed skills: for won episodes the share
    that names every target's cell ("cell 7"); for failed ones the share that names a cell the episode never
    clicked (the text does not show what is there: a guess, which the teacher would then follow), and of the
    failures by a wrong click, the share that names that cell. Then the teacher's delta at the wrong clicks and
    at the steps of won episodes, and screen_skill_lift."""
    import envs
    import seed
    from models.policy import load_policy
    from models.scoring import response_mask
    from simulators.vision import PROMPT
    policy = load_policy(model, device="cpu", dtype="float32")
    env_list = [envs.make_env("vision", "train", i) for i in range(episodes)]
    trajectories = seed.rollout(policy, env_list, list(range(10_000, 10_000 + episodes)), 1, 6, PROMPT, 48, 1.0, 3,
                                generator=torch.Generator().manual_seed(seed_value))
    skill_list, _ = seed.analyze(policy, trajectories, *analyzer_limits())
    found = screen_skill_checks([t.gt for t in trajectories], skill_list)
    # what the teacher does with those skills: delta summed over a step's response, at the wrong click of a
    # failure (negative: the skill lowers the mistake) and at the steps of won episodes (positive: it raises them)
    # and which tokens take it: the think's cell digits (where the click is decided: the action copies them) or
    # its look words ("red circle")
    rows = seed.step_rows(trajectories, skill_list)
    old, teacher, _, has_teacher = seed.rescore(policy, rows)
    delta = (teacher - old) * response_mask(rows.responses)                  # (B, R)
    cells, looks = torch.zeros_like(delta), torch.zeros_like(delta)             # (B, R) each
    for row, response in enumerate(rows.responses):
        cell_positions, look_positions = think_parts(policy.tokenizer, response)
        cells[row, cell_positions], looks[row, look_positions] = 1.0, 1.0
    step_of = [step for t in trajectories for step in range(len(t.steps))]  # step_rows' order
    for name, keep in (("wrong click", lambda gt, step: (gt.get("mistake") or {}).get("step") == step),
                       ("won episode's step", lambda gt, step: gt["won"])):
        chosen = [i for i, t in enumerate(rows.trajectory)
                  if has_teacher[i] and keep(trajectories[t].gt, step_of[i])]
        for part, weights in (("", None), (" at the cell digits", cells), (" at the look words", looks)):
            values = [float((delta[i] if weights is None else delta[i] * weights[i]).sum()) for i in chosen]
            found[f"{name}: summed delta{part}, mean"] = (statistics.mean(values) if values else None, len(values))
        found[f"{name}: share with delta < 0"] = share_of([float(delta[i].sum()) < 0 for i in chosen])
    found.update(screen_skill_lift(policy, episodes))
    for name, (value, count) in found.items():
        print(f"{name}: {'-' if value is None else f'{value:.3f}'} of {count}")
    return found


def screen_skill_lift(policy, tasks=64):
    """Does the teacher follow a skill that is right? On the first step of `tasks` valid_seen tasks, the greedy
    first click without a skill, with a success skill that names the target's cell, and with a mistake skill that
    names a distractor's cell (both in the annotator's words): the household probe's skill lift, on screens."""
    import envs
    import seed
    import skills
    from models import vision
    from simulators.vision import PROMPT, vision_annotations
    env, prompts, answers = envs.make_env("vision", "valid_seen", 0), [], []
    for task_seed in range(tasks):
        observation, info = env.reset(task_seed)
        target, task = env.targets[0] + 1, info["task"]
        distractor = next(cell + 1 for cell in sorted(env.items) if cell not in env.targets)
        prompt = vision.user_message(skills.render_prompt(PROMPT, task, [], vision.observation_text(observation),
                                                        info["admissible"], 3), observation)
        right = vision_annotations({"task": task, "won": True, "targets": [target], "clicked": []})[1][1]
        wrong = vision_annotations({"task": task, "won": False, "targets": [target], "clicked": [],
                                    "mistake": {"cell": distractor}})[1][0]
        for skill in (None, right, wrong):
            prompts.append(prompt if skill is None else vision.same_image(prompt, skills.with_skill(prompt, skill)))
        answers.append((target, distractor))
    responses, _ = seed.sample(policy, [seed.encode_chat(policy.tokenizer, p) for p in prompts], 48, 0.0)
    clicks = [skills.parse_action(policy.tokenizer.decode(r, skip_special_tokens=True)) for r in responses]
    # the share of tasks whose prompt `variant` (0: no skill, 1: success, 2: mistake) clicked the target (which
    # 0) or the distractor (1)
    share = lambda variant, which: share_of([clicks[3 * i + variant] == f"click {cells[which]}"
                                             for i, cells in enumerate(answers)])
    return {"first click on the target: no skill": share(0, 0),
            "first click on the target: a skill names it": share(1, 0),
            "first click on a distractor: no skill": share(0, 1),
            "first click on a distractor: a skill names it a mistake": share(2, 1)}


def think_parts(tokenizer, response):
    """(cell digit positions, look word positions) inside a vision response's <think>...</think>: in
    " red circle14" the tokens of "14" and of "red circle"."""
    cells, looks, text = [], [], ""
    for position, token in enumerate(response):
        piece = tokenizer.decode([token])
        if "</think>" in text + piece:
            break
        if "<think>" in text and piece.strip():
            (cells if piece.strip().isdigit() else looks).append(position)
        text += piece
    return cells, looks


def screen_skill_checks(ground_truths, skill_list):
    """screen_skill_probes' measures from the episodes' ground truth (simulators/vision.py gt) and their skills
    (None: unparsed) -> {measure: (share or None, count)}."""
    cells = lambda skill: {int(n) for n in re.findall(r"cell (\d+)", skill)}
    parsed = [(gt, s) for gt, s in zip(ground_truths, skill_list) if s]
    won = [set(gt["targets"]) <= cells(s) for gt, s in parsed if gt["won"]]
    guessed = [bool(cells(s) - {c for c, _ in gt["clicked"]}) for gt, s in parsed if not gt["won"]]
    wrong = [gt["mistake"]["cell"] in cells(s) for gt, s in parsed if gt.get("mistake")]
    return {"parsed": (len(parsed) / len(skill_list), len(skill_list)),
            "won: skill names every target cell": share_of(won),
            "failed: skill names a cell never clicked (a guess)": share_of(guessed),
            "failed by a wrong click: skill names that cell": share_of(wrong)}


def share_of(flags):
    """(share of True or None when empty, count)"""
    return (sum(flags) / len(flags) if flags else None, len(flags))


def mechanism(model, rounds=3, tasks=16, group_size=4, distill_coef=0.1, lr=1e-4, kl_coef=0.1, seed_value=0):
    """Where SEED's gain can come from that GRPO's cannot: groups in which every rollout failed. Their outcome
    advantage is 0 (a format penalty aside), so GRPO learns nothing there, while SEED's delta still says which
    tokens the hindsight skill would change. Each arm, from the same model, plays `rounds` rounds of `tasks`
    heat/cool/clean training tasks x group_size rollouts, keeps only the all-failed groups and makes one
    update on them with the tiny defaults (4 mini-batches, batch-std advantages, k3 KL to the start);
    SEED adds lambda x delta, GRPO does not. Prints the habit probe before and after each round, |delta| at
    the decision step (the step after taking the goal object) and over all sampled tokens, and mean |A|."""
    import envs
    import seed
    from loss import seed_delta
    from models.policy import load_policy
    from evaluation import habit
    from simulators.household import PROMPT
    decisions = habit.habit_decisions("valid_seen", 48)
    habit_tasks = habit.habit_task_seeds(rounds * tasks)
    env_list = [envs.make_env("household", "train", i) for i in range(tasks * group_size)]
    reference = load_policy(model, device="cpu", dtype="float32").model.eval()
    found = {}
    for algo, coef in (("seed", distill_coef), ("grpo", 0.0)):
        policy = load_policy(model, device="cpu", dtype="float32")
        optimizer = torch.optim.AdamW(policy.model.parameters(), lr=lr, weight_decay=0.0)
        torch.manual_seed(seed_value)
        probes = [habit.habit_probe(policy, decisions)]
        for round_index in range(rounds):
            task_seeds = habit_tasks[round_index * tasks:(round_index + 1) * tasks]
            trajectories = seed.rollout(policy, env_list, task_seeds, group_size, 20, PROMPT, 48, 1.0, 3,
                                        generator=torch.Generator().manual_seed(seed_value + round_index))
            won = {}
            for t in trajectories:
                won[t.group] = won.get(t.group, False) or t.won
            failed = [t for t in trajectories if not won[t.group]]
            if not failed:
                probes.append(probes[-1])
                continue
            skill_list, _ = seed.analyze(policy, failed, *analyzer_limits())
            rows = seed.step_rows(failed, skill_list)
            _, teacher, ref, has_teacher = seed.rescore(policy, rows, 1.0, reference=reference, need_old=False)
            sampled = seed.padded_logprobs(rows.sampled_logp)                            # (B, R)
            response = seed.response_mask(rows.responses)                                  # (B, R')
            mask = response[:, :sampled.shape[1]] * has_teacher[:, None]  # no skill, no teacher: delta 0 (B, R)
            delta = seed_delta(teacher[:, :sampled.shape[1]], sampled, mask)                # (B, R)
            decision_rows = decision_steps(failed, rows)
            advantages = seed.step_advantages(failed, rows, "batch", "steps")                # (B,)
            seed.ppo_update(policy, optimizer, rows, advantages, teacher if coef else None, ref, has_teacher, 4,
                            loss_kwargs=dict(distill_coef=coef, kl_coef=kl_coef), temperature=1.0)
            probes.append(habit.habit_probe(policy, decisions))
            tokens = response.sum().clamp(min=1)
            found.setdefault(algo, []).append({
                "round": round_index + 1, "all_failed_groups": len(failed) // group_size,
                "rows": len(rows.prompts), "habit_before": probes[-2], "habit_after": probes[-1],
                "delta_abs_all": float(delta.abs().sum() / tokens),
                "delta_abs_decision": float(delta[decision_rows].abs().amax(-1).mean()) if decision_rows else None,
                "advantage_abs": float(advantages.abs().mean())})
    print("| algo | round | all-failed groups | rows | habit before -> after | max abs delta at the decision step "
          "| mean abs delta, all tokens | mean abs A |")
    print("|---|---|---|---|---|---|---|---|")
    for algo, records in found.items():
        for r in records:
            decision = "-" if r["delta_abs_decision"] is None else f"{r['delta_abs_decision']:.3f}"
            print(f"| {algo} | {r['round']} | {r['all_failed_groups']} | {r['rows']} | {r['habit_before']:.3f} -> "
                  f"{r['habit_after']:.3f} | {decision} | {r['delta_abs_all']:.4f} | {r['advantage_abs']:.3f} |")
    return found


def evaluate_models(folders, temperature=0.4, tasks=96, extra=()):
    """A second reading of finished runs: each model folder (a warm-start or a checkpoint) evaluated with
    evaluation.evaluate at `temperature` on `tasks` tasks per split of the env that `extra` (train.py flags,
    e.g. ["--env", "vision"]) names, household by default. Prints and returns one dict each."""
    import envs
    import train
    from evaluation.evaluate import evaluate
    from models.policy import load_policy
    cfg = train.get_config(["--eval-temperature", str(temperature), "--eval-tasks", str(tasks), *extra], check=False)
    options = envs.env_options(cfg)
    found = []
    for folder in folders:
        policy = load_policy(folder, device="cpu", dtype="float32")
        row = {"model": folder, "temperature": temperature, "tasks": tasks}
        for split in ("valid_seen", "valid_unseen"):
            result = evaluate(policy, cfg, split, [envs.make_env(cfg.env, split, i, **options)
                                                         for i in range(tasks)], envs.load(envs.spec(cfg.env).prompt))
            row[split], row[f"{split} invalid"] = result["micro"], result["invalid_share"]
        print(" | ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
        found.append(row)
    return found


def decision_steps(trajectories, rows):
    """Row indices of each trajectory's step right after it took its goal object (the habit's decision)."""
    found, row = [], 0
    for trajectory in trajectories:
        goal = (trajectory.gt or {}).get("goal_object")
        after_take = None
        for number, step in enumerate(trajectory.steps):
            if after_take is None and step.valid and goal and step.action.startswith(f"take {goal} "):
                after_take = number + 1
        if after_take is not None and after_take < len(trajectory.steps):
            found.append(row + after_take)
        row += len(trajectory.steps)
    return found


_TRAINED, _MASKED, _RESET = "\x1b[30;42m", "\x1b[2m", "\x1b[0m"


def show_tokens(ids, mask, tokenizer, color=True):
    """One row of tokens: trained ones (mask 1) highlighted green, masked ones dim; without colour, trained
    runs are wrapped in [[ ]]. `ids`/`mask` may be lists or tensors; `tokenizer` only needs .decode([id])."""
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    mask = mask.tolist() if hasattr(mask, "tolist") else list(mask)
    if len(ids) != len(mask):
        raise ValueError(f"ids and mask differ in length: {len(ids)} vs {len(mask)}")
    opening, closing = (_TRAINED, _MASKED) if color else ("[[", "]]")
    runs = [(trained, "".join(tokenizer.decode([token_id]) for token_id, _ in run))
            for trained, run in itertools.groupby(zip(ids, mask), key=lambda pair: bool(pair[1]))]
    text = "".join(opening + part + closing if trained else part for trained, part in runs)
    return _MASKED + text + _RESET if color else text


def picture(run_dir, task_seed=0, max_tries=8):
    """One trajectory of the run's latest policy, its self-written skill, and every response token
    coloured by delta = log p(token | prompt + skill) - log p(token | prompt): green up, red down."""
    import envs
    import seed
    from models.policy import load_policy
    from training.checkpoints import latest_checkpoint
    config = json.load(open(os.path.join(run_dir, "config.json")))
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        sys.exit(f"error: no checkpoint in {run_dir}/checkpoints")
    policy = load_policy(checkpoint, device="cpu", dtype="float32")
    options = envs.env_options(argparse.Namespace(**{"data_dir": None, "task": "click-test",
                                                     "miniwob_elements": False, **config}))
    max_steps = options["max_steps"]  # the env as the run had it
    env = envs.make_env(config["env"], "train", 0, **options)
    for attempt in range(max_tries):  # the picture needs a trajectory whose analysis parsed
        trajectories = seed.rollout(policy, [env], [task_seed + attempt], 1, max_steps,
                                    envs.load(envs.spec(config["env"]).prompt), config["max_new_tokens"],
                                    config["temperature"], config["history_window"])
        skill_list, raw = seed.analyze(policy, trajectories, config["analysis_prompt_tokens"],
                                       config["analysis_max_new_tokens"])
        if skill_list[0] is not None:
            break
    else:
        sys.exit(f"error: the policy's analysis did not parse in {max_tries} tries (last output: {raw[0][:200]!r})")
    rows = seed.step_rows(trajectories, skill_list)
    old, teacher, _, _ = seed.rescore(policy, rows, config["temperature"])
    delta = (teacher - old) * seed.response_mask(rows.responses)                 # (B, R)
    scale = max(1e-6, float(delta.abs().max()))
    parts_html, parts_terminal = [], []
    for row, response in enumerate(rows.responses):
        spans, colored = [], []
        for position, token in enumerate(response):
            text = policy.tokenizer.decode([token])
            value = float(delta[row, position])
            strength = min(1.0, abs(value) / scale)
            rgb = (int(255 * (1 - strength)), 255, int(255 * (1 - strength))) if value > 0 else \
                (255, int(255 * (1 - strength)), int(255 * (1 - strength)))
            spans.append(f'<span title="{value:+.3f}" style="background:rgb{rgb}">{html.escape(text)}</span>')
            code = 42 if value > 0.05 * scale else 41 if value < -0.05 * scale else 0
            colored.append(f"\033[{code}m{text}\033[0m" if code else text)
        parts_html.append(f"<p><b>step {row + 1}</b> {''.join(spans)}</p>")
        parts_terminal.append(f"step {row + 1:2d}  {''.join(colored)}")
    trajectory = trajectories[0]
    header = f"task: {trajectory.task} | won: {trajectory.won} | skill: {skill_list[0]}"
    page = (f"<html><body style='font-family:monospace'><h3>{html.escape(header)}</h3>"
            f"<p>green: the skill made the sampled token likelier; red: less likely (hover for delta)</p>"
            + "".join(parts_html) + "</body></html>")
    path = os.path.join(run_dir, "delta.html")
    with open(path, "w") as f:
        f.write(page)
    print(header)
    print("\n".join(parts_terminal))
    print(f"wrote {path} (max |delta| {scale:.3f})")
    return path


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="RL seeds per arm")
    p.add_argument("--arms", nargs="+", default=["seed", "grpo"], choices=list(ARMS), help="what to compare "
                   "(ARMS: train.py's flags each)")
    p.add_argument("--updates", type=int, default=10, help="RL updates per run (equal episode budgets)")
    p.add_argument("--eval-every", type=int, default=2, help="evaluate every K updates")
    p.add_argument("--root", default="out/experiment", help="one sub-folder per run, plus the table")
    p.add_argument("--cache-dir", default="cache", help="where the shared warm-start is cached")
    p.add_argument("--warmup-seed", type=int, default=0, help="the one warm-start all runs share")
    p.add_argument("--rerun", action="store_true", help="redo runs that finished before (without it, a run that "
                   "finished fewer than --updates is continued, one that finished more is refused)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="runs at a time, each with cores / jobs threads (default: 2, or 1 on one core)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the pipeline, measures nothing")
    p.add_argument("--picture", metavar="RUN_DIR", help="write the delta picture for a finished run and exit")
    p.add_argument("--probes", metavar="MODEL_DIR", help="habit probe, skill lift, loop-warning controls "
                   "and fixing-skill share of a model; of a vision model: are its skills right about the pixels")
    p.add_argument("--evaluate", metavar="MODEL_DIR", nargs="+", help="evaluate finished models again "
                   "(--eval-temperature, --eval-tasks) and exit")
    p.add_argument("--eval-temperature", type=float, default=0.4, help="--evaluate: sampling temperature (OPID's)")
    p.add_argument("--eval-tasks", type=int, default=96, help="--evaluate: tasks per split")
    p.add_argument("--mechanism", metavar="MODEL_DIR", help="one SEED and one GRPO update per round on all-failed "
                   "groups only, from MODEL_DIR: the habit probe before and after, |delta| and |A|")
    args = p.parse_args(argv)
    if args.picture:
        return picture(args.picture)
    if args.probes:
        from models.vision import is_vlm
        return screen_skill_probes(args.probes) if is_vlm(args.probes) else probes(args.probes)
    if args.evaluate:
        return evaluate_models(args.evaluate, args.eval_temperature, args.eval_tasks, extra)
    if args.mechanism:
        return mechanism(args.mechanism, seed_value=args.seeds[0])
    if args.smoke:
        extra = ["--warmup-steps", "2", "--tasks-per-update", "2", "--group-size", "2", "--max-steps", "3",
                 "--max-new-tokens", "8", "--eval-tasks", "2", "--analysis-max-new-tokens", "16"] + extra
    os.makedirs(args.root, exist_ok=True)
    runs = run_all(args, extra)
    summarise(args, runs)
    return runs


if __name__ == "__main__":
    main()
