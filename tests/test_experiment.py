"""
tests/test_experiment.py: experiments/experiment.py -- the SEED vs GRPO experiment runs end to end on a smoke
scale, its episodes ratio refuses gains inside the noise, the probes measure a model,
and the delta picture and the token view show the tokens.

    python -m pytest -q tests/test_experiment.py
"""
import array
import os
import types

import pytest

import seed
import train
from experiments import experiment
from test_seed import SKILL, read_lines


def test_episodes_to_reach_interpolates_between_evaluations():
    curve = [(0, 0.3, 0), (160, 0.5, 0), (320, 0.7, 0)]
    assert experiment.episodes_to_reach(curve, 0.55) == pytest.approx(200)
    assert experiment.episodes_to_reach(curve, 0.3) == 0 and experiment.episodes_to_reach(curve, 0.71) is None


def test_ratio_line_divides_episodes_and_says_not_different_inside_the_noise():
    curves = {("micro", "grpo", "valid_seen"): [(0, 0.25, 0.0), (160, 0.35, 0.02), (320, 0.45, 0.02)],
              ("micro", "seed", "valid_seen"): [(0, 0.25, 0.0), (160, 0.45, 0.03), (320, 0.60, 0.03)]}
    line = experiment.ratio_line(curves)
    assert line == ("episodes ratio (GRPO/SEED): 2.00; final valid_seen success SEED 0.600 ± 0.030, "
                    "GRPO 0.450 ± 0.020"), line
    curves[("micro", "seed", "valid_seen")][-1] = (320, 0.47, 0.05)  # the gap inside the spread
    assert experiment.ratio_line(curves).startswith("episodes ratio (GRPO/SEED): not different;")
    curves[("micro", "seed", "valid_seen")][-1] = (320, 0.70, 0.03)
    curves[("micro", "grpo", "valid_seen")][-1] = (320, 0.28, 0.05)  # GRPO's own gain inside its spread
    assert "not different" in experiment.ratio_line(curves)  # today: "50% fewer" for two equal curves
    seed_curve = [(0, 0.25, 0.0), (160, 0.40, 0.01), (320, 0.20, 0.01)]  # passes GRPO's final, ends below it
    behind = {("micro", "grpo", "valid_seen"): [(0, 0.25, 0.0), (160, 0.30, 0.02), (320, 0.32, 0.02)],
              ("micro", "seed", "valid_seen"): seed_curve}
    assert experiment.ratio_line(behind).startswith("episodes ratio (GRPO/SEED): < 1 (SEED ends below GRPO);")
    habit = {("habit_unlearned", algo, "valid_seen"): points for (_, algo, _), points in curves.items()}
    assert experiment.ratio_line(habit, "habit_unlearned", "habit unlearned").startswith(
        "episodes ratio (GRPO/SEED) on habit unlearned: not different; final valid_seen habit unlearned SEED 0.700")


def test_plan_run_continues_a_shorter_or_killed_run_and_refuses_a_longer_one(tmp_path):
    """A run folder that finished fewer updates than asked is resumed (not reported at its old budget as before),
    one killed after a checkpoint is resumed, one past the budget is refused, --rerun starts over."""
    import json
    run = tmp_path / "seed-15"
    assert experiment.plan_run(str(run), 10) == "overwrite"  # nothing there
    (run / "checkpoints" / "update_000005").mkdir(parents=True)
    assert experiment.plan_run(str(run), 10) == "overwrite"  # a checkpoint folder without trainer.pt is not one
    (run / "checkpoints" / "update_000005" / "trainer.pt").write_bytes(b"")
    assert experiment.plan_run(str(run), 10) == "resume"  # killed at update 5
    (run / "summary.json").write_text(json.dumps({"eval": [{"update": 0}, {"update": 10}]}))
    assert [experiment.plan_run(str(run), n) for n in (10, 20)] == ["reuse", "resume"]
    assert experiment.plan_run(str(run), 10, rerun=True) == "overwrite"
    with pytest.raises(SystemExit, match="trained 10 updates, more than --updates 5"):
        experiment.plan_run(str(run), 5)


def test_experiment_smoke_writes_the_table(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # its train.py processes: spinning OpenMP threads cost 6x on 2 cores
    root = tmp_path / "experiment"
    experiment.main(["--seeds", "0", "--updates", "1", "--eval-every", "1", "--smoke", "--root", str(root),
                     "--cache-dir", str(tmp_path / "cache")])
    table = (root / "experiment.md").read_text()
    assert "| seed | valid_seen |" in table and "| grpo | valid_unseen |" in table, table
    for algo in ("seed", "grpo"):
        assert len(read_lines(str(root / f"{algo}-0" / "metrics.jsonl"))) == 1
    # a raised budget on the same root continues each run (train.py --resume) instead of reporting the old one
    experiment.main(["--seeds", "0", "--updates", "2", "--eval-every", "1", "--smoke", "--jobs", "2",
                     "--root", str(root), "--cache-dir", str(tmp_path / "cache")])
    for algo in ("seed", "grpo"):
        assert [row["update"] for row in read_lines(str(root / f"{algo}-0" / "metrics.jsonl"))] == [1, 2]
        assert "resuming from" in (root / f"{algo}-0.log").read_text()


def test_delta_picture_shows_the_trajectory_tokens(tmp_path, monkeypatch):
    """The picture needs a parsed skill; a random model writes none, so the analysis is stubbed with a fixed
    skill (the re-scoring under it is real)."""
    out = tmp_path / "run"
    train.main(train.get_config(["--warmup-steps", "2", "--updates", "1", "--tasks-per-update", "2", "--group-size",
                                 "2", "--max-steps", "3", "--max-new-tokens", "8", "--eval-tasks", "2",
                                 "--analysis-max-new-tokens", "8", "--out-dir", str(out),
                                 "--cache-dir", str(tmp_path / "cache")]))
    monkeypatch.setattr(seed, "analyze", lambda policy, trajectories, *a, **k: ([SKILL] * len(trajectories),
                                                                               ["stub"] * len(trajectories)))
    path = experiment.picture(str(out))
    page = open(path).read()
    assert SKILL in page and page.count("<span") >= 3, page[:500]


def test_probes_measure_a_model(tiny):
    """--probes on a model folder: the habit probe and the skill lift on both splits, the loop warnings' controls,
    and the fixing-skill share over sampled heat/cool/clean episodes (None when none failed the habit's way)."""
    found = experiment.probes(tiny[1], episodes=2, max_steps=3)
    controls = {f"skill lift {split}, {name} skill" for split in ("valid_seen", "valid_unseen")
                for name in ("own", "shuffled", "generic")}
    gaps = {f"own minus {name} lift {split}: mean, std, decisions where own is higher"
            for split in ("valid_seen", "valid_unseen") for name in ("shuffled", "generic")}
    loops = {"loop decisions valid_seen: preference for the expert's command over the repeat",
             "own minus another command's warning, loop lift: mean, std, decisions where own is higher"} | {
        f"loop lift valid_seen, {name} (48 decisions)" for name in ("own warning", "another command's warning",
                                                                   "generic")}
    assert set(found) == {"habit valid_seen", "habit valid_unseen", "fixing skill share", "habit failures"} \
        | controls | gaps | loops, sorted(found)
    assert 0 <= found["habit valid_seen"] <= 1 and -1 <= found["skill lift valid_unseen, own skill"] <= 1
    assert found["own minus generic lift valid_seen: mean, std, decisions where own is higher"].endswith("of 48")


def test_screen_skill_checks_tell_guessed_cells_from_shown_ones():
    """Vision --probes: a won skill must name every target cell; a failed one that names a cell the episode never
    clicked is a guess (the text does not show it); a wrong click's cell should be named."""
    won = {"won": True, "targets": [7, 2], "clicked": [[7, ["red", "circle"]], [2, ["red", "cross"]]]}
    wrong = {"won": False, "targets": [9], "clicked": [[5, ["blue", "square"]]],
             "mistake": {"cell": 5, "item": ["blue", "square"]}}
    empty = {"won": False, "targets": [3], "clicked": [[4, None]], "mistake": None}
    found = experiment.screen_skill_checks(
        [won, won, wrong, wrong, empty, empty],
        ["The task wanted the red circle in cell 7 then the red cross in cell 2.", "Click cell 7.",
         "Mistake: cell 5 was not what the task asks for.", "The task wanted the blue square in cell 9.",
         "Do not waste steps on empty cells (cell 4).", None])
    assert found["parsed"] == (5 / 6, 6)
    assert found["won: skill names every target cell"] == (0.5, 2)  # "cell 17" would not count as cell 7
    assert found["failed: skill names a cell never clicked (a guess)"] == (1 / 3, 3)
    assert found["failed by a wrong click: skill names that cell"] == (0.5, 2)


def test_think_parts_split_the_cell_digits_from_the_look_words():
    """Vision --probes splits the teacher's delta: the think's digits (the decided cell) vs its look words; the
    action after </think> and the tags are neither."""
    pieces = ["<think>", " red", " circle", "1", "4", "</think>", "<action>", "click", " 1", "4", "</action>"]
    tokenizer = types.SimpleNamespace(decode=lambda ids: "".join(pieces[i] for i in ids))
    assert experiment.think_parts(tokenizer, list(range(len(pieces)))) == ([3, 4], [1, 2])
    assert experiment.think_parts(tokenizer, [6, 7, 8]) == ([], [])  # no think: nothing


def test_skill_show_tokens_marks_trained_tokens():
    tokenizer = types.SimpleNamespace(decode=lambda ids: "".join(map(chr, ids)))
    ids, mask = [ord(c) for c in "ab<cd>e"], [0, 0, 0, 1, 1, 0, 0]
    assert experiment.show_tokens(ids, mask, tokenizer, color=False) == "ab<[[cd]]>e"
    coloured = experiment.show_tokens(array.array("i", ids), array.array("i", mask), tokenizer)  # has .tolist(), like a tensor
    assert coloured == "\x1b[2mab<\x1b[30;42mcd\x1b[2m>e\x1b[0m", repr(coloured)
    assert experiment.show_tokens([ord("x")], [1], tokenizer, color=False) == "[[x]]"
    with pytest.raises(ValueError):
        experiment.show_tokens([1, 2], [1], tokenizer)


@pytest.fixture(scope="module")
def shipped():
    """The warm-start shipped in warm_starts/ (the default run's)."""
    from warmup import warm_start
    return os.path.join(warm_start.SHIPPED_DIR, sorted(os.listdir(warm_start.SHIPPED_DIR))[0])


def test_evaluate_models_reads_finished_models_again(shipped):
    """--evaluate: the shipped warm-start evaluated by evaluation.evaluate on 2 tasks per split, sampled."""
    rows = experiment.evaluate_models([shipped], temperature=0.4, tasks=2)
    assert len(rows) == 1 and rows[0]["temperature"] == 0.4
    for split in ("valid_seen", "valid_unseen"):
        assert 0.0 <= rows[0][split] <= 1.0 and 0.0 <= rows[0][f"{split} invalid"] <= 1.0, rows


def test_a_seed_run_ends_with_the_delta_picture_command(tmp_path, capsys):
    from training import logs
    record = {"update": 1, "parse_fail": 0.1, "delta_abs_mean": 0.05, "delta_mean": -0.01, "delta_pos_share": 0.4,
              "teacher_token_share": 0.9}
    logs.save_metrics_line(str(tmp_path / "metrics.jsonl"), record)
    logs.print_self_analysis(str(tmp_path / "metrics.jsonl"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("self-analysis over updates 1-1: parse failures 0.10 -> 0.10"), lines
    assert lines[-1] == f"the delta picture of one episode: python experiments/experiment.py --picture {tmp_path}"


def test_mechanism_updates_both_arms_on_all_failed_groups_only(shipped):
    """--mechanism on the shipped warm-start, one round of one heat/cool/clean task x 2 rollouts: every kept
    group failed, each arm reports the habit probe before and after its own update."""
    found = experiment.mechanism(shipped, rounds=1, tasks=1, group_size=2)
    assert set(found) == {"seed", "grpo"}, found  # the warm-start fails this task both times in either arm
    for algo in ("seed", "grpo"):
        for record in found[algo]:
            assert record["all_failed_groups"] == 1 and record["rows"] > 0, record
            assert 0 < record["habit_before"] < 1 and 0 < record["habit_after"] < 1, record
            assert record["habit_after"] != record["habit_before"], record  # the update moved the policy
            assert record["delta_abs_all"] >= 0 and record["advantage_abs"] >= 0, record


def test_success_bound_corrects_only_the_steps_it_is_told_to():
    """experiments/success_bound.py's env: the skip-transform demonstrator wins only with the habit corrected, a
    player of nothing but invalid commands only with those corrected; each correction is counted."""
    from evaluation.habit import habit_task_seeds
    from experiments.success_bound import Corrected
    import envs

    def play(env, task_seed, command):
        env.reset(task_seed)
        done, info = False, {}
        while not done:
            _, _, done, info = env.step(command(env))
        return info["won"]

    task_seed = habit_task_seeds(1, "valid_seen")[0]
    habit = lambda env: env.expert_action(skip_transform=True)  # noqa: E731
    nonsense = lambda env: "go to nowhere 1"  # noqa: E731
    results = {}
    for name, command, fix_habit, fix_invalid in [("habit", habit, False, False), ("habit fixed", habit, True, False),
                                                  ("invalid", nonsense, False, False),
                                                  ("invalid fixed", nonsense, False, True),
                                                  ("invalid, habit fixed", nonsense, True, False)]:
        env = Corrected(envs.make_env("household", "valid_seen", task_seed), fix_habit, fix_invalid)
        results[name] = (play(env, task_seed, command), env.substitutions, env.reached_decision)
    assert results["habit"] == (False, 0, True)
    assert results["habit fixed"][:2] == (True, 2)  # walking to the appliance, then using it, not the target
    assert results["invalid"] == (False, 0, False) and results["invalid, habit fixed"] == (False, 0, False)
    assert results["invalid fixed"][0] and results["invalid fixed"][1] >= 3


def test_teacher_on_commands_tallies_every_command_once(shipped):
    """success_bound.teacher_on_commands on the shipped model, 2 greedy tasks: each skill source sorts every
    command with a teacher into invalid (repeats among them) or valid; a content-free skill reaches them all."""
    import envs
    from experiments.success_bound import play, teacher_on_commands
    from models.policy import load_policy
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    cfg = train.get_config([], check=False)
    policy = load_policy(shipped, "cpu", "float32")
    *_, trajectories = play(policy, cfg, "valid_seen", 2, envs.env_options(cfg), envs.load(envs.spec(cfg.env).prompt),
                            False, False)
    results, student = teacher_on_commands(policy, cfg, trajectories)
    assert set(results) == {"own", "shuffled", "annotator", "content-free"}
    steps = sum(results["content-free"][4][i] for i in (0, 2))
    assert steps > 0
    for name, (invalid, repeated, valid, lowered, (n_invalid, n_repeated, n_valid)) in results.items():
        assert n_repeated <= n_invalid and n_invalid + n_valid <= steps, (name, results[name])
        assert 0.0 <= lowered <= 1.0 and all(abs(x) < 50 for x in (invalid, repeated, valid)), (name, results[name])
    assert results["content-free"][2] != 0.0 or results["content-free"][0] != 0.0  # a skill block moves log-probs
    assert all(value <= 0.0 for value in student) and min(student) < 0.0, student  # log-probs of sampled commands


def test_lift_bound_plays_each_probe_task_once_per_skill_source(shipped):
    """success_bound.lift_bound on the shipped model and 3 probe trajectories: one outcome per task and source, and
    the skill-free play is the evaluation's own greedy play of those tasks (play, as played); sampled twice, a task's
    success is a mean of two outcomes."""
    import envs
    from evaluation.self_analysis import read_probe_set
    from experiments.success_bound import lift_bound, play
    from models.policy import load_policy
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    cfg = train.get_config([], check=False)
    options, template = envs.env_options(cfg), envs.load(envs.spec(cfg.env).prompt)
    policy = load_policy(shipped, "cpu", "float32")
    probe = read_probe_set(os.path.join(shipped, "probe_set.json"), cfg.env)[:3]
    won = lift_bound(policy, cfg, probe, options, template)
    assert list(won) == ["none", "own", "own shuffled", "annotator", "annotator shuffled"]
    assert all(len(w) == 3 and set(w) <= {0.0, 1.0} for w in won.values()), won
    *_, trajectories = play(policy, cfg, "valid_seen", 3, options, template, False, False)
    assert won["none"] == [float(t.won) for t in trajectories]
    sampled = lift_bound(policy, cfg, probe[:2], options, template, temperature=1.0, samples=2)
    assert all(len(w) == 2 and set(w) <= {0.0, 0.5, 1.0} for w in sampled.values()), sampled
