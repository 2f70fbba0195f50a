"""
tests/test_self_analysis.py: the analyzer measured and trained -- the self-analysis probe (evaluation/
self_analysis.py: a fixed probe set, cached; parse failures, fixing skills, skill lift), the fixes the annotators
check (names_fix), the shuffled-skill ablation, --analyzer start, --analyzer-training and --teacher-anchor
(training/analyzer.py).

    python -m pytest -q tests/test_self_analysis.py
"""
import json

import pytest
import torch

import envs
import seed
import skills
import train
from annotators.text_worlds import annotate, mistake_kind, names_fix
from evaluation import self_analysis
from models.scoring import forward_logprobs, padded_logprobs, response_logprobs, response_mask
from test_seed import FAILURES, NOTHING, PICKED, TO_DRAWER_2, TRAIN_FLAGS, episode, fresh, on, read_lines, run_train
from training.analyzer import (ANALYZER_LR_SCALE, analyzer_examples, analyzer_step, centered_teacher,
                               teacher_anchor, teacher_rl, token_deltas, trajectory_deltas)


def probe_config(**flags):
    cfg = train.get_config(["--max-steps", "3", "--max-new-tokens", "8", "--analysis-max-new-tokens", "16",
                            "--analysis-prompt-tokens", "1024"])
    for name, value in flags.items():
        setattr(cfg, name, value)
    return cfg


def test_probe_set_is_recorded_once_cached_and_rebuilt_when_corrupt(tiny, tmp_path, capsys):
    policy, _ = tiny
    cfg, template = probe_config(), envs.load(envs.spec("household").prompt)
    path = str(tmp_path / "probe_set.json")
    first = self_analysis.probe_set(policy, cfg, template, {"max_steps": 3}, path)
    assert len(first) == self_analysis.PROBE_TASKS and all(t.gt is not None for t in first)
    assert [t.seed for t in first] == list(range(self_analysis.PROBE_TASKS))
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(said) == 1 and "none cached yet" in said[0], said
    again = self_analysis.probe_set(None, cfg, template, {"max_steps": 3}, path)  # read, never re-recorded
    assert [(t.task, [s.action for s in t.steps]) for t in again] == [(t.task, [s.action for s in t.steps])
                                                                      for t in first]
    assert not capsys.readouterr().out
    for damage in ("{ torn", json.dumps({"env": "vision", "trajectories": []})):
        (tmp_path / "probe_set.json").write_text(damage)
        rebuilt = self_analysis.probe_set(policy, cfg, template, {"max_steps": 3}, path)
        said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
        assert len(said) == 1 and "unusable" in said[0] and len(rebuilt) == len(first), said


def test_the_probe_gives_the_same_numbers_twice_and_counts_unparsed_analyses(tiny, tmp_path, monkeypatch):
    policy, _ = tiny
    cfg, template = probe_config(), envs.load(envs.spec("household").prompt)
    probes = self_analysis.probe_set(policy, cfg, template, {"max_steps": 3}, str(tmp_path / "p.json"))
    factory = lambda i: envs.make_env("household", "valid_seen", i, max_steps=3)
    without = [0.0] * len(probes)
    first = self_analysis.self_analysis(policy, cfg, probes, template, factory, without)
    second = self_analysis.self_analysis(policy, cfg, probes, template, factory, without)
    print(f"\nthe tiny random model's probe: {first}")
    assert first == second and set(first) == {"parse_fail", "fixing", "lift", "raw_lift"}
    assert first["parse_fail"] == 1.0  # a random model's analyses never parse: no skill, no crash
    assert first["lift"] == 0.0 and first["raw_lift"] == 0.0  # no skill in either condition
    # skills that parse (a stand-in analyzer): the shuffled condition gives each task another task's skill
    monkeypatch.setattr(seed, "analyze", lambda policy, trajectories, *a, **k: (
        [f"Skill number {i}: search the drawers before the shelves." for i in range(len(trajectories))],
        [""] * len(trajectories)))
    given = []
    rollout = seed.rollout
    monkeypatch.setattr(seed, "rollout", lambda *a, **k: given.append(k["skill_per_rollout"]) or rollout(*a, **k))
    parsed = self_analysis.self_analysis(policy, cfg, probes, template, factory, without)
    own, shuffled = given
    assert parsed["parse_fail"] == 0.0 and all(a != b for a, b in zip(own, shuffled)) and sorted(own) == sorted(
        shuffled), (own, shuffled)


def test_shuffled_never_gives_a_task_its_own_skill():
    assert self_analysis.shuffled(["a", None, "c", "d"]) == ["c", "c", "d", "a"]
    assert self_analysis.shuffled([None, "b"]) == ["b", None]
    assert self_analysis.shuffled([None, None]) == [None, None]


def test_names_fix_reads_the_first_decisive_mistake():
    placed, _, _ = FAILURES["placed before heating"]
    assert names_fix(placed, "Heat the apple with microwave 1 before you put it down.") is True
    assert names_fix(placed, "Look around the room carefully before acting.") is False
    assert names_fix(placed, None) is False
    closed, _, _ = FAILURES["closed not opened"]
    assert names_fix(closed, "The apple was in drawer 2: open closed drawers.") is True
    won = FAILURES["never found"][0]
    assert names_fix(seed.Trajectory(won=True, gt=won.gt), "anything at all") is None
    # a loop warning quoting a refused command that names the appliance is not the fix (before, it counted as one)
    tried = episode(TO_DRAWER_2 + [(PICKED, "heat apple 1 with microwave 1", False), (NOTHING, "go to countertop 1"),
                                   (on("countertop 1", "a bread 1"), "move apple 1 to countertop 1")])
    assert mistake_kind(tried) == "placed_early"
    assert names_fix(tried, "Warning sign: 'Nothing happens.' after 'heat apple 1 with microwave 1'.") is False
    assert names_fix(tried, "Heat it with microwave 1 first: 'heat apple 1 with microwave 1' did nothing.") is True
    # nor is one quoting a command the episode never issued; a fix after a quoted wrong command still counts
    assert names_fix(placed, "Do not repeat what answers 'Nothing happens.': 'examine microwave 1' did nothing.") \
        is False
    assert names_fix(placed, "Wrong appliance: 'cool apple 1 with fridge 1'. To heat it, go to microwave 1.") is True
    # the kind it reads, which experiments/analyzer_drift.py counts the fixing skills by
    assert [mistake_kind(FAILURES[name][0]) for name in ("placed before heating", "closed not opened")] == [
        "placed_early", "closed"]
    assert mistake_kind(seed.Trajectory(won=True, gt=won.gt)) is None


def test_every_evaluation_reports_the_probe_and_the_final_summary_line(tiny, tmp_path, capsys):
    flags = TRAIN_FLAGS + ["--model", tiny[1], "--stage", "rl", "--eval-tasks", self_analysis.LIFT_TASKS]
    run_train(*flags, "--out-dir", tmp_path / "out")
    output = capsys.readouterr().out
    evals = read_lines(tmp_path / "out" / "eval.jsonl")
    seen = [e["probes"] for e in evals if e["split"] == "valid_seen"]
    assert len(seen) == 2 and all({"parse_fail", "fixing", "lift", "raw_lift"} <= set(p) for p in seen), seen
    assert all("lift" not in e["probes"] for e in evals if e["split"] == "valid_unseen")
    assert "parse_fail" in output and "self-analysis probe, first to last evaluation: parse failures" in output
    assert (tmp_path / "out" / self_analysis.FILE_NAME).exists()  # an HF-style start: the set sits in the out dir


def test_teacher_skill_shuffled_rotates_by_a_group(tiny, tmp_path, monkeypatch):
    """--teacher-skill shuffled: each trajectory's teacher gets the skill of the same position in the next group."""
    seen = []
    monkeypatch.setattr(seed, "analyze", lambda policy, trajectories, *a, **k: (
        [f"Skill {t.group}-{i}: search the drawers before the shelves." for i, t in enumerate(trajectories)],
        [""] * len(trajectories)))
    step_rows = seed.step_rows
    monkeypatch.setattr(seed, "step_rows", lambda t, skill_list: seen.append(skill_list) or step_rows(t, skill_list))
    run_train(*TRAIN_FLAGS, "--model", tiny[1], "--stage", "rl", "--updates", 1, "--teacher-skill", "shuffled",
              "--out-dir", tmp_path / "out")
    (skill_list,) = seen
    assert [s.split(":")[0] for s in skill_list] == ["Skill 1-2", "Skill 1-3", "Skill 0-0", "Skill 0-1"], skill_list


def test_teacher_skill_annotator_gives_each_teacher_the_ground_truth_skill(tiny, tmp_path, monkeypatch):
    """--teacher-skill annotator: each trajectory's teacher gets the env annotator's skill for that trajectory (the
    bound a perfect analyzer sets), whatever the policy wrote."""
    seen, played = [], []
    monkeypatch.setattr(seed, "analyze", lambda policy, trajectories, *a, **k: played.extend(trajectories) or (
        ["the policy's own skill"] * len(trajectories), [""] * len(trajectories)))
    step_rows = seed.step_rows
    monkeypatch.setattr(seed, "step_rows", lambda t, skill_list: seen.append(skill_list) or step_rows(t, skill_list))
    run_train(*TRAIN_FLAGS, "--model", tiny[1], "--stage", "rl", "--updates", 1, "--teacher-skill", "annotator",
              "--out-dir", tmp_path / "out")
    (skill_list,) = seen
    assert skill_list == [annotate(t, t.gt)[1] for t in played] and "the policy's own skill" not in skill_list


def test_the_start_analyzer_never_changes_while_the_policy_does(tiny, tmp_path, monkeypatch):
    """--analyzer start: every update's skills come from the frozen start model, whose weights stay as they were;
    the policy's move (--analyzer policy: the policy itself analyzes)."""
    used = []
    analyze = seed.analyze
    monkeypatch.setattr(seed, "analyze", lambda policy, *a, **k: used.append(
        [p.detach().clone() for p in policy.model.parameters()][:3]) or analyze(policy, *a, **k))
    flags = TRAIN_FLAGS + ["--model", tiny[1], "--stage", "rl", "--updates", 3, "--lr", 1e-3, "--eval-tasks", 1]
    run_train(*flags, "--analyzer", "start", "--out-dir", tmp_path / "start")
    assert len(used) == 3 and all(torch.equal(a, b) for weights in used[1:] for a, b in zip(used[0], weights))
    used.clear()
    run_train(*flags, "--out-dir", tmp_path / "policy")
    assert len(used) == 3 and not all(torch.equal(a, b) for a, b in zip(used[0], used[-1]))


@pytest.mark.parametrize("kind", ["confirmed", "explored", "confirmed-and-explored", "explored-where-wrong",
                                  "explored-balanced", "lift", "anchor"])
def test_analyzer_training_chooses_its_analyses_and_runs(tiny, trajectories, kind, tmp_path, monkeypatch):
    policy = fresh(tiny[0])
    cfg = probe_config()
    rows = seed.step_rows(trajectories, ["Heat the apple with microwave 1 first."] * len(trajectories))
    _, teacher, _, has_teacher = seed.rescore(policy, rows, need_old=False)
    skill_list = ["Heat it with microwave 1 before putting it down."] * 4
    texts = ['{"episode_summary": "s", "episode_skill": "Heat it with microwave 1 first."}'] * 4
    chosen = analyzer_examples(kind, policy, policy, cfg, trajectories, skill_list, texts, rows, teacher,
                               has_teacher)
    assert all(prompt.startswith("Analyze the agent's episode.") for prompt, _ in chosen)
    if kind == "confirmed-and-explored":  # the update's greedy analyses that name the fix stay in the step
        right = [annotate(t)[1] for t in trajectories]  # the ground truth's skills name the fix of every failure
        confirmed, both = (analyzer_examples(name, policy, policy, cfg, trajectories, right, texts, rows, teacher,
                                             has_teacher) for name in ("confirmed", kind))
        assert confirmed and len(both) >= min(len(confirmed), cfg.sft_batch_size), (len(confirmed), len(both))
    if kind == "explored-where-wrong":  # it samples analyses of the failures its greedy analyzer got wrong only
        sampled, analyze = [], seed.analyze
        monkeypatch.setattr(seed, "analyze", lambda policy, given, *a, **k: sampled.append(len(given)) or analyze(
            policy, given, *a, **k))
        for greedy in ([annotate(t)[1] for t in trajectories], skill_list):  # right on every failure, then wrong
            analyzer_examples(kind, policy, policy, cfg, trajectories, greedy, texts, rows, teacher, has_teacher)
        failures = sum(not t.won for t in trajectories)
        assert failures and sampled == [failures * cfg.explore_samples], (failures, sampled)
        monkeypatch.undo()
    if kind == "explored-balanced":  # as many new fixes (greedy missed) as known ones (greedy named it)
        right = [annotate(t)[1] for t in trajectories]
        monkeypatch.setattr(seed, "analyze", lambda policy, given, *a, **k: (
            [annotate(t)[1] for t in given], [json.dumps({"episode_skill": annotate(t)[1]}) for t in given]))
        failed = [i for i, t in enumerate(trajectories) if not t.won]
        greedy = ["Look around the room carefully." if i == failed[0] else right[i] for i in range(len(right))]
        chosen = analyzer_examples(kind, policy, policy, cfg, trajectories, greedy, texts, rows, teacher,
                                   has_teacher)
        missed_prompt = skills.analyzer_prompt(trajectories[failed[0]], cfg.analysis_prompt_tokens,
                                               policy.count_tokens)
        new = sum(prompt == missed_prompt for prompt, _ in chosen)
        assert len(failed) >= 2 and new == cfg.explore_samples and len(chosen) == 2 * new, (
            len(failed), new, len(chosen))
        monkeypatch.undo()
    if kind == "lift":
        deltas = trajectory_deltas(rows, teacher, has_teacher)
        assert len(chosen) == sum((deltas[i] > 0) == t.won for i, t in enumerate(trajectories) if i in deltas)
    run_train(*TRAIN_FLAGS, "--model", tiny[1], "--stage", "rl", "--updates", 1, "--analyzer-training", kind,
              "--out-dir", tmp_path / "out")
    (metrics,) = read_lines(tmp_path / "out" / "metrics.jsonl")
    assert "analyzer_examples" in metrics and metrics["skipped"] is None, metrics


def test_analyzer_drift_kl_is_zero_against_itself_and_matches_a_reference_after_a_change(tiny):
    """experiments/analyzer_drift.py's token_kl: exactly 0 for the start model against itself; after one weight
    is moved, positive and equal to KL(p || q) summed over the vocabulary one position at a time."""
    from experiments.analyzer_drift import token_kl
    policy, _ = tiny
    prompts = [seed.encode_chat(policy.tokenizer, "go to the fridge"), seed.encode_chat(policy.tokenizer, "look")]
    responses = [policy.tokenizer("open fridge 1", add_special_tokens=False)["input_ids"], [5]]
    kl, change, mask = token_kl(policy, policy, prompts, responses, policy.pad_id)
    assert mask.sum() == len(responses[0]) + 1 and float(kl.abs().max()) == 0.0 and float(change.abs().max()) == 0.0
    moved = fresh(policy)
    with torch.no_grad():
        moved.model.lm_head.weight.add_(0.05 * torch.randn_like(moved.model.lm_head.weight,
                                                                generator=torch.Generator().manual_seed(0)))
    kl, _, mask = token_kl(policy, moved, prompts, responses, policy.pad_id)
    ids = torch.tensor([prompts[0] + responses[0]])
    with torch.no_grad():
        p = policy.model(ids).logits[0, len(prompts[0]) - 1:-1].float().log_softmax(-1)  # (R, V)
        q = moved.model(ids).logits[0, len(prompts[0]) - 1:-1].float().log_softmax(-1)  # (R, V)
    reference = (p.exp() * (p - q)).sum(-1)                                                # (R,)
    difference = float((kl[0, :len(responses[0])] - reference).abs().max())
    print(f"token_kl vs the one-sequence reference: max difference {difference:.2e}")
    assert float(kl[mask > 0].min()) > 0 and difference < 1e-5


def test_the_analyzer_step_trains_at_its_own_rate_and_gives_the_optimizer_back(tiny, monkeypatch):
    """--analyzer-training's SFT step runs at ANALYZER_LR_SCALE x the RL rate and leaves the rate as it found it."""
    policy = fresh(tiny[0])
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-4)
    rates = []
    monkeypatch.setattr(seed, "supervised_step", lambda policy, optimizer, *a, **k: rates.append(
        optimizer.param_groups[0]["lr"]) or 0.5)
    placed, _, _ = FAILURES["placed before heating"]  # a skill that names its fix: confirmed
    skill = "Heat the apple with microwave 1 before you put it down."
    text = json.dumps({"episode_summary": "s", "episode_skill": skill})
    found = analyzer_step("confirmed", policy, policy, optimizer, probe_config(), [placed], [skill], [text],
                          None, None, None)
    assert found["analyzer_examples"] > 0 and found["analyzer_loss"] == 0.5, found
    assert rates == [pytest.approx(1e-4 * ANALYZER_LR_SCALE)] and optimizer.param_groups[0]["lr"] == 1e-4, rates


def test_the_teacher_anchor_is_the_k3_kl_to_the_start_model_on_the_teacher_tokens_and_pulls_back(tiny, trajectories):
    """--teacher-anchor: zero (and no gradient) on the start model itself; on moved weights each call is its share's
    token-mean k3 KL to the start model with the skill in context, the shares together the KL over every teacher
    token (against a direct computation); a step down its gradient lowers it; past the last share, nothing. With
    target "effect" it is the KL to the recorded log-probs plus the start's skill effect: ~0 for the start model."""
    start, cfg = tiny[0], probe_config()
    skill_list = ["Heat the apple with microwave 1 first.", None, "Cool it with fridge 1.", "Look around."]
    rows = seed.step_rows(trajectories, skill_list)
    taught = [i for i, text in enumerate(rows.teacher_prompts) if text is not None]
    assert 0 < len(taught) < len(rows.prompts)  # the unparsed analysis gives its rows no teacher
    policy = fresh(start)
    teacher_anchor(1.0, policy, start, rows, 2, cfg)()
    grads = [p.grad for p in policy.model.parameters() if p.grad is not None]
    assert grads and max(float(g.abs().max()) for g in grads) < 1e-6  # the start model's KL is flat at 0
    policy.model.zero_grad(set_to_none=True)
    with torch.no_grad():
        policy.model.lm_head.weight.add_(0.05 * torch.randn_like(policy.model.lm_head.weight,
                                                                 generator=torch.Generator().manual_seed(0)))
    anchor = teacher_anchor(1.0, policy, start, rows, 2, cfg)
    shares = [anchor()["teacher_anchor_kl"], anchor()["teacher_anchor_kl"]]
    assert anchor() == {"teacher_anchor_kl": 0.0}  # a third PPO step finds no share left
    prompts = [seed.encode_chat(start.tokenizer, rows.teacher_prompts[i]) for i in taught]
    responses = [rows.responses[i] for i in taught]
    score = lambda model: response_logprobs(model, prompts, responses, start.pad_id)  # (b, R)
    mask = response_mask(responses)
    x = score(start.model) - score(policy.model)
    direct = float(((x.exp() - x - 1) * mask).sum() / mask.sum())
    order = __import__("random").Random(0).sample(range(len(prompts)), len(prompts))
    tokens = [float(mask[order[part::2]].sum()) for part in range(2)]
    combined = sum(kl * n for kl, n in zip(shares, tokens)) / sum(tokens)
    print(f"\nteacher anchor KL {combined:.6f} vs direct {direct:.6f}: difference {abs(combined - direct):.2e}")
    assert direct > 1e-4 and abs(combined - direct) < 1e-5
    with torch.no_grad():  # one plain step down the two shares' summed gradients
        for p in policy.model.parameters():
            p.add_(-0.5 * p.grad if p.grad is not None else 0)
    x = score(start.model) - score(policy.model)
    assert float(((x.exp() - x - 1) * mask).sum() / mask.sum()) < direct
    # target "effect": the recorded log-probs plus the start's skill effect; the start model's own KL to it is ~0
    sampled = padded_logprobs([rows.sampled_logp[i] for i in taught])                                # (b, R)
    student = lambda model: response_logprobs(model, [rows.prompts[i] for i in taught], responses, start.pad_id)
    effect_target = sampled + score(start.model) - student(start.model)                              # (b, R)
    for model, anchored in ((start, fresh(start)), (policy, policy)):
        found = teacher_anchor(1.0, anchored, start, rows, 1, cfg, target="effect")()["teacher_anchor_kl"]
        x = effect_target - score(model.model)
        direct = float(((x.exp() - x - 1) * mask).sum() / mask.sum())
        print(f"effect anchor KL {found:.6f} vs direct {direct:.6f}")
        assert abs(found - direct) < 1e-5 and (direct < 1e-6) == (model is start)
    _, _, ref_logp, _ = seed.rescore(start, rows, reference=start.model, need_old=False)  # what training passes
    reused = teacher_anchor(1.0, policy, start, rows, 1, cfg, target="effect", ref_logp=ref_logp)()
    print(f"effect anchor KL with re-scoring's reference log-probs {reused['teacher_anchor_kl']:.6f}")
    assert abs(reused["teacher_anchor_kl"] - direct) < 1e-5


def test_the_teacher_anchor_trains_inside_the_ppo_steps_and_is_seed_only(tiny, tmp_path, monkeypatch, capsys):
    """A run with --teacher-anchor logs the anchor's KL and takes the same optimizer steps as without it (its
    gradients join the PPO steps); --algo grpo has no teacher to anchor: one error line."""
    steps = []
    step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: steps.append(1) or step(self, *a, **k))
    flags = [*TRAIN_FLAGS, "--model", tiny[1], "--stage", "rl", "--updates", 1, "--mini-batches", 2]
    run_train(*flags, "--out-dir", tmp_path / "plain")
    plain, steps[:] = len(steps), []
    run_train(*flags, "--teacher-anchor", 1.0, "--out-dir", tmp_path / "anchored")
    (metrics,) = read_lines(tmp_path / "anchored" / "metrics.jsonl")
    assert metrics["skipped"] is None and metrics["teacher_anchor_kl"] >= 0 and len(steps) == plain == 2, metrics
    with pytest.raises(SystemExit):
        train.get_config(["--algo", "grpo", "--teacher-anchor", "1.0"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--teacher-anchor" in errors[0], errors


def test_teacher_rl_is_the_policy_gradient_with_the_skill_in_context(tiny, trajectories, tmp_path, capsys):
    """--teacher-rl: two shares' gradients add up to coef x the token-mean policy gradient -A grad log pi over every
    token whose row has a teacher, the skill in its context (against a direct computation); rows without a teacher
    and the skill-free prompts get none; a run logs its loss; --algo grpo has no teacher context: one error line."""
    policy, cfg = fresh(tiny[0]), probe_config()
    rows = seed.step_rows(trajectories, ["Heat the apple with microwave 1 first.", None, "Cool it.", "Look around."])
    taught = [i for i, text in enumerate(rows.teacher_prompts) if text is not None]
    advantages = torch.linspace(-1.0, 1.0, len(rows.prompts))                                      # (B,)
    step = teacher_rl(0.5, policy, rows, advantages, 2, cfg)
    step(), step()
    assert step() == {"teacher_rl_loss": 0.0}  # a third PPO step finds no share left
    found = [p.grad.clone() for p in policy.model.parameters()]
    policy.model.zero_grad(set_to_none=True)
    prompts = [seed.encode_chat(policy.tokenizer, rows.teacher_prompts[i]) for i in taught]
    responses = [rows.responses[i] for i in taught]
    mask = response_mask(responses)                                                                  # (b, R)
    order = __import__("random").Random(0).sample(range(len(prompts)), len(prompts))
    for part in range(2):  # each share's token mean, as each PPO step takes it
        share = order[part::2]
        logp, _ = forward_logprobs(policy.model, [prompts[i] for i in share], [responses[i] for i in share],
                                   policy.pad_id, cfg.temperature, cfg.layout)                       # (s, r)
        width = logp.shape[1]
        weights = -0.5 * advantages[[taught[i] for i in share]][:, None] * mask[share, :width]
        ((weights * logp).sum() / mask[share].sum()).backward()
    direct = [p.grad for p in policy.model.parameters()]
    difference = max(float((a - b).abs().max()) for a, b in zip(found, direct))
    with capsys.disabled():
        print(f"\nteacher RL gradient vs direct: max difference {difference:.2e}")
    assert max(float(g.abs().max()) for g in direct) > 1e-4 and difference < 1e-6
    flags = [*TRAIN_FLAGS, "--model", tiny[1], "--stage", "rl", "--updates", 1, "--teacher-skill", "annotator"]
    run_train(*flags, "--teacher-rl", 1.0, "--out-dir", tmp_path / "taught")
    (metrics,) = read_lines(tmp_path / "taught" / "metrics.jsonl")
    assert metrics["skipped"] is None and "teacher_rl_loss" in metrics, metrics
    with pytest.raises(SystemExit):
        train.get_config(["--algo", "grpo", "--teacher-rl", "1.0"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--teacher-rl" in errors[0], errors


def test_distill_center_zeroes_the_updates_mean_delta_and_keeps_every_difference(tiny, trajectories, tmp_path, capsys):
    """--distill-center: after the shift delta averages 0 over the teacher tokens and every token keeps its delta
    relative to the others (one constant moved); a run logs a mean delta of ~0 where the plain run's is not;
    --algo grpo has no teacher to shift: one error line."""
    policy = fresh(tiny[0])
    rows = seed.step_rows(trajectories, ["Heat the apple with microwave 1 first.", None, "Cool it.", "Look around."])
    _, teacher, _, has_teacher = seed.rescore(policy, rows, need_old=False)
    before, mask = token_deltas(rows, teacher, has_teacher)                       # (B, R) each
    after, _ = token_deltas(rows, centered_teacher(rows, teacher, has_teacher), has_teacher)
    shift = (after - before)[mask.bool()]
    with capsys.disabled():
        print(f"\nmean delta {float(before.sum() / mask.sum()):+.6f} -> {float(after.sum() / mask.sum()):+.2e}; "
              f"spread of the shift {float(shift.max() - shift.min()):.2e}")
    assert abs(float(before.sum() / mask.sum())) > 1e-4 and abs(float(after.sum() / mask.sum())) < 1e-6
    assert float(shift.max() - shift.min()) < 1e-5 and bool((after[~mask.bool()] == 0).all())
    flags = [*TRAIN_FLAGS, "--model", tiny[1], "--stage", "rl", "--updates", 1, "--mini-batches", 1,
             "--teacher-skill", "annotator"]  # the untrained analyzer's skills seldom parse; the annotator's do
    means = {}
    for name, extra in (("plain", []), ("centered", ["--distill-center"])):
        run_train(*flags, *extra, "--out-dir", tmp_path / name)
        (metrics,) = read_lines(tmp_path / name / "metrics.jsonl")
        means[name] = metrics["delta_mean"]
    with capsys.disabled():
        print(f"logged delta_mean: plain {means['plain']:+.6f}, centered {means['centered']:+.2e}")
    assert abs(means["plain"]) > 1e-4 and abs(means["centered"]) < 1e-5, means
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.get_config(["--algo", "grpo", "--distill-center"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--distill-center" in errors[0], errors
