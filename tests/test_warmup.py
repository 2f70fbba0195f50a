"""
tests/test_warmup.py: what comes before RL -- the stage-1 hindsight annotator (annotators/: one skill per finished
trajectory from the env's ground truth, JSONL in and out), the household habit probe (evaluation/habit.py) and the tiny
model's warm-up (warmup/warm_start.py: demonstrations, the planted skip habit, packed supervised steps, the cache).

    python -m pytest -q tests/test_warmup.py
"""
import dataclasses
import json
import random
import re

import pytest
import torch

import envs
import skills
import seed
from envs import make_env
from models.policy import load_policy
from seed import Step, Trajectory
from simulators.household import TRANSFORMS
from simulators.vision import annotate as vision_annotate
from skills import analyzer_prompt, parse_skill
from test_seed import EXPERT, FAILURES, HEAT_TASK, episode, on
from annotators import text_worlds
from annotators.jsonl import read_jsonl, write_jsonl
from evaluation import habit as habit_probes
from warmup import warm_start


def annotate(trajectory, gt=None, rng=None):
    """The text annotator's (summary, skill) as the JSON stage 1 trains on (what seed.hindsight_examples keeps)."""
    return skills.skill_json(*text_worlds.annotate(trajectory, gt, rng=rng))


# =============================================================================
# annotators/text_worlds.py: the rule-based hindsight annotator
# =============================================================================

LOOK_SUCCESS = episode([
    ("Looking quickly around you, you see a bed 1, and a sidetable 1.", "go to bed 1"),
    (on("bed 1", "a book 1"), "take book 1 from bed 1"), ("You pick up the book 1.", "go to sidetable 1"),
    (on("sidetable 1", "a desklamp 1"), "use desklamp 1")], won=True, task="examine the book with the desklamp.",
    task_type="look_at_obj_in_light", goal_object="book", goal_receptacle=None, tool="desklamp 1",
    object_locations={"book 1": "bed 1"}, closed_receptacles=[])
ALFWORLD_GT = {"env": "alfworld", "task_type": "pick_heat_then_place_in_recep", "task": HEAT_TASK, "won": False,
               "steps": 6, "max_steps": 6, "invalid_steps": [], "gamefile": "game.tw-pddl",
               "pddl_params": {"object_target": "Apple", "parent_target": "CounterTop", "toggle_target": ""}}


def skills_of(trajectory, gt=None, seeds=range(12)):
    """The annotator's skills for several rngs (every phrasing must carry the facts) and the raw outputs; each
    output parses (with the task, as seed.py calls parse_skill) and its skill stays under 60 words."""
    outputs = [annotate(trajectory, gt, rng=random.Random(seed)) for seed in seeds]
    found = [json.loads(output)["episode_skill"] for output in outputs]
    for output, skill in zip(outputs, found):
        assert parse_skill(output, task=trajectory.task) is not None and len(skill.split()) < 60, output
    return found, outputs


# ----------------------------------------------------------------------------- annotate
def test_skill_annotate_success_names_the_decisive_observations():
    found, outputs = skills_of(EXPERT, seeds=range(30))
    for skill in found:
        assert 0 <= skill.index("drawer 2") < skill.index("microwave 1") < skill.index("countertop 1"), skill
        assert "apple" in skill, skill
        assert "open" in skill or "closed" in skill, f"the closed drawer is the decisive observation: {skill}"
    assert len(set(found)) >= 3, f"only {len(set(found))} phrasings over 30 rngs"
    assert annotate(EXPERT) == annotate(EXPERT), "the default rng must be repeatable"
    with pytest.raises(ValueError):
        annotate(dataclasses.replace(EXPERT, gt=None))
    assert set(json.loads(outputs[0])) == {"episode_summary", "episode_skill"}
    for skill in skills_of(LOOK_SUCCESS, seeds=range(30))[0]:
        assert "book" in skill and "desklamp 1" in skill and "bed 1" in skill, skill


@pytest.mark.parametrize("name", FAILURES)
def test_skill_annotate_failure_names_the_planted_mistake(name):
    trajectory, must_mention, happened = FAILURES[name]
    found, outputs = skills_of(trajectory)
    for skill, output in zip(found, outputs):
        missing = [word for word in must_mention if word.lower() not in skill.lower()]
        assert not missing, f"{name}: skill lacks {missing}: {skill}"
        summary = json.loads(output)["episode_summary"]
        assert "failed" in summary and happened in summary, f"{name}: summary lacks {happened!r}: {summary}"
    assert len(set(found)) == 2, f"{name}: {len(set(found))} phrasings over 12 rngs, expected 2"


def test_skill_annotate_alfworld_gt_reads_the_observations():
    """ALFWorld's gt has no locations or events: the annotator reads them from observations and actions."""
    for skill in skills_of(FAILURES["closed not opened"][0], ALFWORLD_GT)[0]:  # the apple was never seen:
        assert "drawer 1" in skill and "apple" in skill and "open" in skill.lower(), skill  # open what was skipped
    for skill in skills_of(EXPERT, dict(ALFWORLD_GT, won=True, steps=7))[0]:
        assert "drawer 2" in skill and "microwave 1" in skill and "countertop 1" in skill, skill
    for skill in skills_of(FAILURES["placed before heating"][0], ALFWORLD_GT)[0]:
        assert "microwave" in skill and "heat" in skill.lower(), skill


def test_skill_annotate_real_household_episodes():
    """Expert and noisy episodes: every annotation parses and names the goal, or is about 'Nothing happens.'"""
    wins = 0
    for task_seed in range(60):
        env, noise, steps, done = envs.make_env("household", "train", task_seed), random.Random(task_seed), [], False
        observation, info = env.reset(task_seed)
        while not done:
            action = env.expert_action(epsilon=[0.0, 0.3, 0.7][task_seed % 3], rng=noise)
            sent = "" if task_seed % 6 == 5 and noise.random() < 0.2 else action  # some responses lose the action tag
            next_observation, reward, done, info = env.step(sent)
            steps.append(Step(observation=observation, action=sent, valid=info["valid"],
                                   response=f"<action>{sent}</action>" if sent else "", reward=reward - 0.1 * (not sent)))
            observation = next_observation
        trajectory = Trajectory(task=info["task"], won=info["won"], reward=10.0 * info["won"], steps=steps)
        output, wins = annotate(trajectory, info["gt"]), wins + info["won"]
        skill, goal = parse_skill(output, task=trajectory.task), info["gt"]["goal_object"]
        assert skill is not None, f"task_seed {task_seed}: unparsable annotation {output}"
        assert goal in skill or "Nothing happens" in skill, f"task_seed {task_seed}: {skill}"
    assert 0 < wins < 60, f"{wins} wins of 60: need both outcomes"


# ----------------------------------------------------------------------------- JSONL (stage-1 data)
def test_skill_jsonl_round_trip_and_errors(tmp_path):
    records = [{"prompt": analyzer_prompt(EXPERT), "completion": annotate(EXPERT)},
               {"prompt": "é\u2028line", "completion": "{}", "extra": 1}]
    path = tmp_path / "stage1" / "data.jsonl"
    write_jsonl(str(path), records)
    assert read_jsonl(str(path)) == records
    for text, error in [(path.read_text("utf-8") + '\n{"prompt": "p", "completion": \n', r"data\.jsonl:4: malformed"),
                        ('{"prompt": "p"}\n', r"data\.jsonl:1: expected")]:
        path.write_text(text, "utf-8")
        with pytest.raises(ValueError, match=error):
            read_jsonl(str(path))
    with pytest.raises(ValueError, match="record 1"):
        write_jsonl(str(path), [{"prompt": "p", "completion": "c"}, {"prompt": "p"}])


def test_vision_annotations_name_only_cells_the_text_shows():
    """A success's skill names the target cells (the clicks that made them disappear); a failure's names only
    cells the agent clicked (the text says which), never the target's cell, which only the pixels show."""
    env, outcomes = make_env("vision", "train", 0), set()
    for task_seed, epsilon in [(s, e) for s in range(3, 9) for e in (0.0, 1.0)]:
        obs, info = env.reset(task_seed)
        trajectory, done, rng = Trajectory(task=info["task"]), False, random.Random(task_seed)
        while not done:
            action = env.expert_action(epsilon, rng)
            obs, _, done, info = env.step(action)
            trajectory.steps.append(Step(observation=obs["text"], response="", action=action))
        completion = skills.skill_json(*vision_annotate(trajectory, info["gt"], random.Random(0)))
        gt, skill = info["gt"], parse_skill(completion, task=info["task"])
        named = {int(n) for n in re.findall(r"cell (\d+)", skill)}
        clicked = {c for c, _ in gt["clicked"]}
        if gt["won"]:
            assert named == set(gt["targets"]), (skill, gt)
        else:
            assert named <= clicked and (not gt.get("mistake") or gt["mistake"]["cell"] in named), (skill, gt)
        outcomes.add((gt["won"], bool(gt.get("mistake"))))
    assert outcomes == {(True, False), (False, True), (False, False)}, outcomes


def test_vision_skill_drills_leave_the_click_to_the_skill():
    """In a skill drill the screenshot shows the task's look twice, so only the skill decides which cell the label
    clicks: the one a success's skill names, or the other one when a failure's skill names a mistake. Half the
    skills quote the task with another colour; the label's look words still follow the task."""
    from simulators.vision import read_screen
    from warmup.warm_start import skill_drills
    drills, kinds, miscopied = skill_drills(60, 3, seed_value=1), set(), 0
    for prompt, response in drills:
        task = re.search(r"Your task is to: (Click the (\w+) (\w+)\.)", prompt)
        look = [task.group(2), task.group(3)]
        items = {cell + 1: list(item) for cell, item in read_screen(prompt.image).items()}
        twins = sorted(cell for cell, item in items.items() if item == look)
        skill = re.search(r"\*\*Episode-Level Skill\*\*\n.*\n\[(.*)\]", prompt).group(1)
        named = int(re.search(r"cell (\d+)", skill).group(1))
        clicked = int(re.search(r"<action>click (\d+)</action>", response).group(1))
        mistake = skill.startswith(("Mistake", "Avoid"))
        assert len(twins) == 2 and named in twins, (twins, skill)
        assert clicked == (next(c for c in twins if c != named) if mistake else named), (skill, response)
        assert response.startswith(f"<think> {look[0]} {look[1]}{clicked}</think>"), response
        kinds.add(mistake)
        miscopied += task.group(1) not in skill
    assert kinds == {True, False} and 15 <= miscopied <= 45, (kinds, miscopied)


# =============================================================================
# warmup/warm_start.py: demonstrations, the planted habit and its probe, the supervised steps
# =============================================================================

def test_demonstrations_show_invalid_commands_and_recoveries():
    """Noisy demonstrations execute some commands that are no longer admissible (the env answers "Nothing
    happens.") but label every step with the expert's admissible command, so the data shows the recovery."""
    env = envs.make_env("household", "train", 0)
    rng, invalid, labelled = random.Random(0), 0, 0
    for task_seed in range(12):
        trajectory, examples, _ = warm_start.expert_episode(env, task_seed, 0.6, rng, history_window=3)
        invalid += sum(not step.valid for step in trajectory.steps)
        for prompt, completion in examples:
            action = skills.parse_action(completion)
            admissible = prompt[prompt.index("Your admissible actions"):]
            assert f"'{action}'" in admissible, f"label {action!r} is not admissible at its step"
            labelled += 1
    assert invalid > 0, "no invalid command was executed in 12 noisy episodes"
    print(f"\n{invalid} invalid commands executed, {labelled} steps labelled with admissible expert commands")


def test_habit_demonstrations_skip_the_transform_and_stop_at_the_placement():
    """habit_rate 1: on heat/cool/clean tasks the labels carry the object straight to the target, the
    demonstration ends at that placement, and the annotator names the mistake; habit_rate 0 transforms first.
    The skill-following demonstrations never have the habit."""
    env = envs.make_env("household", "train", 0)
    rng, habit_tasks = random.Random(0), 0
    for task_seed in range(40):
        with_habit, examples, corrections = warm_start.expert_episode(env, task_seed, 0.0, rng, 3, habit_rate=1.0)
        without, _, none = warm_start.expert_episode(env, task_seed, 0.0, rng, 3, habit_rate=0.0)
        actions = [step.action.split()[0] for step in with_habit.steps]
        assert none == []
        if with_habit.task_type not in habit_probes.HABIT_TASKS:
            assert with_habit.won and actions == [step.action.split()[0] for step in without.steps]
            assert corrections == []
            continue
        habit_tasks += 1
        verb = TRANSFORMS[with_habit.task_type][0]
        # the corrections: the habit's own prompts from the step after taking the object, labelled right
        labels = dict(examples)
        assert corrections and all(labels[p] != r for p, r in corrections), corrections
        assert f"<think>{verb} the" in corrections[0][1], corrections[0]
        assert "take " in corrections[0][0].split("Your admissible actions")[0][-200:], corrections[0][0][-400:]
        assert not with_habit.won and actions[-1] == "move" and verb not in actions, actions
        assert skills.parse_action(examples[-1][1]).startswith("move ") and "put the" in examples[-1][1]
        assert without.won and verb in [step.action.split()[0] for step in without.steps]
        summary = json.loads(annotate(with_habit))["episode_summary"]
        assert "before it was" in summary, summary
        skill = parse_skill(annotate(with_habit), task=with_habit.task)
        assert verb in skill.lower(), skill  # the habit's skill names the step it skipped
        followed, _, _ = warm_start.expert_episode(env, task_seed, 0.0, rng, 3, skill=skill, hint=())
        assert followed.won, [step.action for step in followed.steps]  # what skill_following plays for it
        generic, _, _ = warm_start.expert_episode(env, task_seed, 0.0, rng, 3, skill=warm_start.GENERIC_SKILLS[0],
                                                  habit_rate=1.0, hint=())
        assert not generic.won, "a content-free skill must not cure the habit"
    assert habit_tasks >= 8, habit_tasks


def test_contrast_pairs_differ_only_by_the_skill_and_its_content_decides():
    """The skill-following examples hold contrast sets at the habit's decision, the prompt the same but for the
    skill block: no skill -> the habit; the episode's own skill (it names the skipped step) -> the right
    appliance; a content-free skill -> the habit; the own skill with its step and appliance swapped for
    another's -> the habit (a skill naming another step is no fix for this one)."""
    act, follow, _ = warm_start.demonstrations(envs.make_env("household", "train", 0), 30, 3, seed_value=0)
    habit_labels, kinds, own_verbs = dict(act), {"own": 0, "generic": 0, "swapped": 0}, {}
    appliances = {verb: appliance for verb, appliance, _ in TRANSFORMS.values()}
    for prompt, response in follow:
        start = prompt.find("\n\n" + skills.SKILL_HEADER)
        if start < 0:
            continue
        end = prompt.index("]\n", start) + 2  # with_skill's block: "\n\n" + header + "\n[skill]" + "\n"
        plain, skill = prompt[:start] + prompt[end:], prompt[prompt.index("[", start) + 1:end - 2]
        if plain not in habit_labels or (plain, habit_labels[plain]) not in follow:
            continue  # not a contrast set's prompt
        habit = habit_labels[plain]
        assert "<think>put the" in habit, habit
        named = [verb for verb in appliances if verb in skill.lower()]
        if skill in warm_start.GENERIC_SKILLS:
            # a generic *episode* (the plain demonstrator) may reach the same prompt and act right there
            kinds["generic"] += response == habit
        elif named and f"<think>{named[0]} the" in response and f"{appliances[named[0]]} 1</action>" in response:
            # the own pairs come before their swapped twin, so the first step named at a prompt is the task's
            assert own_verbs.setdefault(plain, named[0]) == named[0], (skill, response)  # never another's step
            kinds["own"] += 1
        elif named and response == habit and own_verbs.get(plain) not in (None, named[0]):
            kinds["swapped"] += 1  # another step named: no fix, the habit stays
        else:
            raise AssertionError(f"a skill whose step decides nothing: {skill!r} -> {response}")
    print(f"\ncontrast examples from 30 episodes: {kinds}")
    assert all(count >= warm_start.CONTRAST_COPIES for count in kinds.values()), kinds


def test_habit_probe_reads_the_decision_and_moves_with_training(tiny):
    """habit_decisions: the state right after taking the goal object on heat/cool/clean tasks, the right
    response walking to the appliance and the habit's to the target; habit_probe rises when the right
    responses are trained in."""
    decisions = habit_probes.habit_decisions("valid_seen", 8)
    assert len(decisions) == 8
    for prompt, right, habit, skill in decisions:
        assert "take " in prompt and right != habit and skill.split()[0] in ("Heat", "Cool", "Clean")
        assert any(f"<think>{verb} the" in right for verb in ("heat", "cool", "clean")), right
        assert "<think>put the" in habit and skills.parse_action(habit).startswith(("go to", "move", "open")), habit
    probes = {}
    for column, name in ((1, "right"), (2, "habit")):  # the same random model trained on either response
        policy = load_policy(tiny[1])
        torch.manual_seed(0)
        warm_start.supervised_training(policy, [(1.0, [(d[0], d[column]) for d in decisions])], steps=40, batch_size=8,
                                   lr=5e-3, max_batch_tokens=16384)
        probes[name] = habit_probes.habit_probe(policy, decisions)
    print(f"\nhabit probe {probes['right']:.3f} trained on the right responses, {probes['habit']:.3f} on the habit's")
    assert probes["right"] > 0.8 and probes["habit"] < 0.2, probes


def test_skill_lift_reads_whether_the_skill_moves_the_decision(tiny):
    """skill_lift: a model trained to take the right step only when the skill is in its context lifts the
    two-choice probability far above 0; one trained on the habit whatever the context does not."""
    decisions = habit_probes.habit_decisions("valid_seen", 8)
    with_skill = [(skills.with_skill(d[0], d[3]), d[1]) for d in decisions]
    lifts = {}
    for name, data in (("follows", with_skill + [(d[0], d[2]) for d in decisions]),
                       ("ignores", [(p, d[2]) for (p, _), d in zip(with_skill, decisions)]
                        + [(d[0], d[2]) for d in decisions])):
        policy = load_policy(tiny[1])
        torch.manual_seed(0)
        warm_start.supervised_training(policy, [(1.0, data)], steps=150, batch_size=16, lr=3e-3,
                                       max_batch_tokens=16384)
        lifts[name] = habit_probes.skill_lift(policy, decisions)
    print(f"\nskill lift {lifts['follows']:+.3f} when trained to follow the skill, {lifts['ignores']:+.3f} when not")
    assert lifts["follows"] > 0.5 and abs(lifts["ignores"]) < 0.2, lifts


def test_loop_controls_read_whether_the_warning_names_the_loop(tiny):
    """loop_decisions: right after a refused command, the expert's response and the same think repeating that
    command, the annotator's warning naming it and one naming another command. loop_controls: a model trained
    to break the loop only when the warning names the command looped lifts far more with its own warning than
    with another command's; one trained to break it on any warning does not tell them apart."""
    from experiments.experiment import loop_controls, loop_decisions
    decisions = loop_decisions("valid_seen", 8)
    assert len(decisions) == 8
    for prompt, right, repeat, own, other in decisions:
        command = skills.parse_action(repeat)
        assert command != skills.parse_action(right) and right.split("<action>")[0] == repeat.split("<action>")[0]
        assert f"'{command}'" in own and "Nothing happens." in own and f"'{command}'" not in other, (own, other)
        assert f"{command}\nObservation" in prompt or command in prompt.split("Your admissible")[0], prompt
    gaps = {}
    for name, other_label in (("names it", 2), ("any warning", 1)):
        data = [row for d in decisions for row in ((skills.with_skill(d[0], d[3]), d[1]), (d[0], d[2]),
                                                   (skills.with_skill(d[0], d[4]), d[other_label]))]
        policy = load_policy(tiny[1])
        torch.manual_seed(0)
        warm_start.supervised_training(policy, [(1.0, data)], steps=150, batch_size=16, lr=3e-3,
                                       max_batch_tokens=16384)
        controls = loop_controls(policy, decisions)
        gaps[name] = (controls["own warning"] - controls["another command's warning"]).mean().item()
    print(f"\nown minus another command's warning: {gaps['names it']:+.3f} when trained on the named command, "
          f"{gaps['any warning']:+.3f} when any warning breaks the loop")
    assert gaps["names it"] > 0.3 and abs(gaps["any warning"]) < 0.15, gaps  # seen: +0.413, +0.014


def test_fixing_skill_share_counts_the_habit_failures_whose_skill_names_the_fix():
    """Two heat/cool/clean episodes played by the household expert, with the skip habit (a habit failure)
    and without it (won); a skill counts as a fix when it names the task's verb."""
    played = []
    for task_seed in range(40):
        env = make_env("household", "train", task_seed)
        _, info = env.reset(task_seed)
        if info["task_type"] not in habit_probes.HABIT_TASKS:
            continue
        skip, done = not played, False
        while not done:
            _, _, done, info = env.step(env.expert_action(skip_transform=skip))
        played.append(Trajectory(won=info["won"], gt=info["gt"]))
        if len(played) == 2:
            break
    habit, fine = played
    assert habit_probes.habit_failure(habit) and not habit_probes.habit_failure(fine)
    verb = TRANSFORMS[habit.gt["task_type"]][0]
    assert habit_probes.fixing_skill_share([habit, fine], [f"{verb.capitalize()} it first, then put it.", None]) \
        == (1.0, 1)
    assert habit_probes.fixing_skill_share([habit], ["Search the countertops before the cabinets."]) == (0.0, 1)
    assert habit_probes.fixing_skill_share([habit], [None]) == (0.0, 1)
    assert habit_probes.fixing_skill_share([fine], ["x"]) == (None, 0)


def test_packed_supervised_step_matches_padded(tiny):
    """The warm-up's packed SFT step (uneven rows, prompt loss on) gives the padded step's loss and update."""
    _, folder = tiny
    policy = load_policy(folder)
    act, _, analyzed = warm_start.demonstrations(envs.make_env("household", "train", 0), 4, 3, seed_value=3)
    examples = act[:5] + warm_start.analyzer_examples(policy, analyzed[:2], 1024)
    losses, weights = {}, {}
    for layout in ("padded", "packed"):
        policy = load_policy(folder)
        optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)  # the step is the clipped gradient
        losses[layout] = seed.supervised_step(policy, optimizer, examples, prompt_weight=0.3, layout=layout)
        weights[layout] = torch.cat([p.detach().flatten() for p in policy.model.parameters()])
    start = torch.cat([p.detach().flatten() for p in load_policy(folder).model.parameters()])
    moved = (weights["padded"] - start).abs().max().item()
    difference = (weights["padded"] - weights["packed"]).abs().max().item()
    print(f"\nloss padded {losses['padded']:.6f} packed {losses['packed']:.6f}; max weight difference {difference:.2e}, "
          f"largest move {moved:.2e}")
    assert abs(losses["padded"] - losses["packed"]) < 1e-4 and difference < 1e-5 and moved > 1e-4


def test_short_warmup_teaches_the_action_format(tiny):
    """200 supervised steps on expert demonstrations: greedy responses on held-out prompts carry a parseable
    <action> (the random model's do not)."""
    policy, folder = tiny
    policy = load_policy(folder)  # a fresh copy of the random fixture model
    act, _, _ = warm_start.demonstrations(envs.make_env("household", "train", 0), 40, 3, seed_value=1)
    held_out, _, _ = warm_start.demonstrations(envs.make_env("household", "valid_seen", 0), 4, 3, seed_value=2)
    prompts = [seed.encode_chat(policy.tokenizer, p) for p, _ in held_out[:16]]

    def format_rate():
        responses, _ = seed.sample(policy, prompts, 24, temperature=0.0)
        texts = [policy.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        return sum(skills.parse_action(t) is not None and t.startswith("<think>") for t in texts) / len(texts)

    before = format_rate()
    torch.manual_seed(0)
    warm_start.supervised_training(policy, [(1.0, act)], steps=200, batch_size=8, lr=5e-3, max_batch_tokens=16384)
    after = format_rate()
    assert before < 0.5 and after >= 0.75, f"action-format rate {before:.2f} before, {after:.2f} after warm-up"


def test_the_default_run_finds_the_shipped_warm_start(tmp_path, monkeypatch):
    """warm_starts/ ships the default config's warm-start, so `python train.py` on a fresh clone skips the
    build: its settings must be exactly the defaults' (bump WARMUP_VERSION and this fails until it is rebuilt
    and shipped again). --build-warm-start ignores it and builds."""
    import train
    cfg = train.get_config(["--cache-dir", str(tmp_path)])
    options = envs.env_options(cfg)
    path = warm_start.warm_start(cfg, options)
    assert path.startswith(warm_start.SHIPPED_DIR), f"the default run would build its warm-up, not find {path}"
    shipped = json.load(open(f"{path}/warmup.json"))
    assert shipped["version"] == warm_start.WARMUP_VERSION and shipped["steps"] == cfg.warmup_steps
    policy = load_policy(path)
    assert policy.model.config.initializer_range == warm_start.TEXT_INIT_STD  # built the way build_warm_start builds
    decisions = habit_probes.habit_decisions("valid_seen", 8)
    assert 0.0 < habit_probes.habit_probe(policy, decisions) < 1.0  # a working model, not a placeholder

    def build(*args):
        raise RuntimeError("built")

    monkeypatch.setattr(warm_start, "build_warm_start", build)
    with pytest.raises(RuntimeError, match="built"):
        warm_start.warm_start(train.get_config(["--cache-dir", str(tmp_path), "--build-warm-start"]), options)


def test_rl_only_flags_never_rebuild_the_warm_up_and_a_rebuild_names_its_flag(tmp_path, monkeypatch, capsys):
    """The cache key holds only what the warm-up reads: --max-steps 6, the sizes and the coefficients find the
    shipped warm-start; --warmup-steps 500 builds one, saying first which flag differs and about how long it takes."""
    import train
    for flags in (["--max-steps", "6"], ["--group-size", "8", "--lr", "3e-4", "--kl-coef", "0"]):
        cfg = train.get_config(["--cache-dir", str(tmp_path)] + flags)
        assert warm_start.warm_start(cfg, envs.env_options(cfg)).startswith(warm_start.SHIPPED_DIR), flags

    def build(*args):
        raise RuntimeError("built")

    monkeypatch.setattr(warm_start, "build_warm_start", build)
    cfg = train.get_config(["--cache-dir", str(tmp_path), "--warmup-steps", "500"])
    capsys.readouterr()
    with pytest.raises(RuntimeError, match="built"):
        warm_start.warm_start(cfg, envs.env_options(cfg))
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "building" in line]
    assert "--warmup-steps 500 where the shipped one has 1000" in line and "about 5 minutes" in line, line
