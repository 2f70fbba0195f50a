"""Tests of skills.py: the skill parser, the teacher context, the analyzer prompt, the hindsight annotator,
stage-1 JSONL files and the token view. Fast, CPU only, seeded. Run: python -m pytest -q test_skills_part.py"""
import array
import json
import random
import time
import types

import pytest

import skills
from skills import (JSON_SHAPE, SKILL_HEADER, analyzer_prompt, annotate, discounted_returns, parse_skill,
                    read_jsonl, show_tokens, with_skill, write_jsonl)

try:  # the household env is another file of the project; its test here is skipped without it
    import envs
except ImportError:
    envs = None

GOOD = "Open closed drawers before searching them, then take the apple."
FRIDGE = "Open the fridge before taking the apple."
HEAT_TASK = "heat some apple and put it in countertop."


def raw(skill, before='{"episode_summary": "s", '):
    """An analyzer answer with the skill pasted in verbatim (escapes and all) after `before`."""
    return before + '"episode_skill": "' + skill + '"}'


# ----------------------------------------------------------------------------- parse_skill
PARSE_CASES = [  # (name, analyzer output, expected skill[, task])
    ("clean json", json.dumps({"episode_summary": "ok", "episode_skill": GOOD}), GOOD),
    ("fenced", "Here is my analysis:\n```json\n" + raw(GOOD, '{"episode_summary": "s",\n ') + "\n```\nBye.", GOOD),
    ("trailing commas", raw(GOOD)[:-1] + ",}", GOOD), ("wrapped value", f'Skill: **"[{FRIDGE}]"**', FRIDGE),
    ("single quotes", "{'episode_summary': 's', 'episode_skill': \"Don't skip drawers; open each closed one.\"}",
     "Don't skip drawers; open each closed one."),
    ("chatter around", "Sure! " + raw(GOOD, "{") + " Let me know.", GOOD),
    ("label line", "Summary: it failed.\nSkill: " + FRIDGE, FRIDGE),
    ("key as label", "episode_skill: " + FRIDGE, FRIDGE), ("markdown label", "**Episode Skill**: " + FRIDGE, FRIDGE),
    ("bold label", "**Skill:** " + FRIDGE, FRIDGE), ("bytes", raw(GOOD).encode(), GOOD),
    ("quote at the end", raw("Warning sign: 'The drawer 2 is closed.'"), "Warning sign: 'The drawer 2 is closed.'"),
    ("nested", '{"analysis": ' + raw(GOOD) + "}", GOOD), ("brace missing, value closed", raw(GOOD)[:-1], GOOD),
    ("escaped quotes", raw(r"Use \"open drawer 2\" when it is closed."), 'Use "open drawer 2" when it is closed.'),
    ("curly quotes", "{\u201cepisode_skill\u201d: \u201c" + GOOD + "\u201d}", GOOD),
    ("key spelled out", '{"Episode Skill": "' + GOOD + '"}', GOOD), ("huge tail", raw(GOOD) + "x" * 2_000_000, GOOD),
    ("list value", '{"episode_skill": ["Open the fridge first.", "Then take the apple."]}',
     "Open the fridge first. Then take the apple."),
    ("control characters", raw("Open\\u0000 the\\u200b fridge\\n before taking the apple.\x07"), FRIDGE),
    ("first object lacks skill", '{"episode_summary": "s"} and then ' + raw(GOOD, "{"), GOOD),
    ("braces in value", raw("Use {the microwave} to heat the apple."), "Use {the microwave} to heat the apple."),
    ("special tokens", raw("Open the fridge<|im_end|> before taking the apple."), FRIDGE),
    ("lone surrogate", raw("Open the fridge \\ud800before taking the apple."), FRIDGE),
    ("new facts beyond the task", raw("Heat the apple with microwave 1 before putting it in countertop."),
     "Heat the apple with microwave 1 before putting it in countertop.", HEAT_TASK),
    ("empty", "", None), ("none", None, None), ("not text", 12345, None), ("format echoed", JSON_SHAPE, None),
    ("truncated value", raw("Always open the closed dr")[:-2], None),
    ("truncated pretty json", '{\n  "episode_summary": "s",\n  "episode_skill": "Always open the closed dr', None),
    ("too short", raw("Open it."), None), ("not a string", '{"episode_skill": 42, "episode_summary": "s"}', None),
    ("restates the task", raw("Your task is to: " + HEAT_TASK), None),
    ("only the task's words", raw("Heat the apple and put it in the countertop."), None, HEAT_TASK),
    ("degenerate", raw("go to drawer 1 " * 12), None), ("symbols", raw("!!!! ???? #### $$$$ %%%% ^^^^"), None),
    ("no function words", raw("aaaa bbbb cccc dddd eeee"), None), ("deep nesting", "[" * 5000 + "{" * 5000, None),
    ("unlabelled sentence", "Open closed drawers before searching them.", None),
    ("beyond scan window", " " * (skills.MAX_PARSE_CHARS + 10) + raw(GOOD), None),
]


@pytest.mark.parametrize("name,text,expected,task", [(*case, None)[:4] for case in PARSE_CASES],
                         ids=[case[0] for case in PARSE_CASES])
def test_parse_skill_cases(name, text, expected, task):
    assert parse_skill(text, task=task) == expected, f"{name}: {parse_skill(text, task=task)!r} != {expected!r}"


def test_parse_skill_length_cap_and_prefixes_of_a_valid_answer():
    """Capped at a word boundary; every prefix cut before the skill's closing quote is None, after it whole."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    long = "Open the drawer " + " ".join(letters[i % 26] + letters[i // 26 % 26] + "ing" for i in range(300))
    capped = parse_skill(json.dumps({"episode_skill": long}))
    assert capped and len(capped) <= skills.MAX_SKILL_CHARS and long.startswith(capped), len(capped or "")
    assert long[len(capped)] == " ", f"cut inside a word: ...{capped[-20:]!r}"
    text = json.dumps({"episode_summary": "The agent won.", "episode_skill": GOOD})
    closing = text.index(GOOD) + len(GOOD)
    for cut in range(len(text) + 1):
        assert parse_skill(text[:cut]) == (GOOD if cut > closing else None), f"cut {cut}: {parse_skill(text[:cut])!r}"


def test_parse_skill_never_raises_on_random_strings():
    rng, start, parsed = random.Random(0), time.perf_counter(), 0
    pieces = ['{', '}', '"', "'", '\\', ',', ':', '[', ']', '```json', '\n', 'episode_skill', 'Skill:', 'the ',
              'open ', 'drawer 1 ', '\x00', '\u200b', '\ud800', 'é', '<|im_end|>', ' ', 'a', 'Z', '9']
    for index in range(10_000):  # a quarter are mutations of a valid answer, the rest random pieces
        chars = list(raw(GOOD)) if index % 4 == 0 else [rng.choice(pieces) for _ in range(rng.randint(0, 60))]
        for _ in range(rng.randint(1, 5) if index % 4 == 0 else 0):
            chars[rng.randrange(len(chars))] = rng.choice(pieces)
        skill = parse_skill(text := "".join(chars))
        assert skill is None or (len(skill) <= skills.MAX_SKILL_CHARS and skill.isprintable()), f"{skill!r} <- {text!r}"
        parsed += skill is not None
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"10,000 parses took {elapsed:.1f} s"
    print(f"parse_skill: 10,000 random strings in {elapsed:.2f} s, {parsed} parsed")


# ----------------------------------------------------------------------------- with_skill
AGENT_PROMPT = (
    f"You are an expert agent operating in the ALFRED Embodied Environment. Your task is to: {HEAT_TASK}\nPrior to "
    "this step, you have already taken 2 step(s). Below are the most recent 2 observations and the corresponding "
    "actions you took: [Observation 1: 'You arrive at drawer 1. Your task is to: x', Action 1: 'go to drawer 1']\n"
    "You are now at step 3 and your current observation is: Nothing happens.\nYour admissible actions of the current "
    "situation are: ['go to fridge 1', 'look'].\n\nNow it's your turn to take an action.\nYou should first reason.")
BLOCK, LAST_LINE = f"{SKILL_HEADER}\n[{GOOD}]", "Your task is to: put a mug in cabinet."
NO_TASK = AGENT_PROMPT.replace("Your task is to:", "Goal:")
AFTER_TASK, BEFORE_TURN = AGENT_PROMPT.index("\nPrior to this step"), NO_TASK.index("Now it's your turn")


@pytest.mark.parametrize("prompt,expected", [
    (AGENT_PROMPT, AGENT_PROMPT[:AFTER_TASK] + f"\n\n{BLOCK}\n" + AGENT_PROMPT[AFTER_TASK:]),
    (NO_TASK, NO_TASK[:BEFORE_TURN] + f"{BLOCK}\n\n" + NO_TASK[BEFORE_TURN:]),
    ("Pick an action.", f"Pick an action.\n\n{BLOCK}\n"),
    (LAST_LINE, f"{LAST_LINE}\n\n{BLOCK}\n"),
    (LAST_LINE + "\r\nNow it's your turn.", f"{LAST_LINE}\n\n{BLOCK}\n\r\nNow it's your turn."),
], ids=["after the task line", "before your turn", "appended", "task on the last line", "crlf"])
def test_with_skill_inserts_one_block_and_keeps_the_prompt_byte_for_byte(prompt, expected):
    teacher = with_skill(prompt, GOOD)
    assert teacher == expected, teacher
    inserted = len(teacher) - len(prompt)  # the prompt must be teacher[:k] + teacher[k + inserted:] for some k
    assert any(teacher[:k] + teacher[k + inserted:] == prompt and GOOD in teacher[k:k + inserted]
               for k in range(len(prompt) + 1)), "the ordinary prompt is not prefix + suffix around the block"
    assert teacher.count("**Episode-Level Skill**") == 1
    for bad in (None, "", "   "):
        with pytest.raises(ValueError):
            with_skill(prompt, bad)


# ----------------------------------------------------------------------------- trajectories (contract dicts)
WELCOME = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, you "
           "see a cabinet 1, a countertop 1, a drawer 1, a drawer 2, a fridge 1, a microwave 1, and a sinkbasin 1."
           f"\n\nYour task is to: {HEAT_TASK}")
HEAT_GT = {"env": "household", "task_type": "pick_heat_then_place_in_recep", "task": HEAT_TASK, "goal_object": "apple",
           "goal_receptacle": "countertop", "tool": "microwave 1", "object_locations": {"apple 1": "drawer 2"},
           "closed_receptacles": ["cabinet 1", "drawer 1", "drawer 2", "fridge 1", "microwave 1"], "expert_plan": []}
closed, on = "You arrive at {0}. The {0} is closed.".format, "You arrive at {0}. On the {0}, you see {1}.".format
empty, NOTHING = "You arrive at {0}. On the {0}, you see nothing.".format, "Nothing happens."


def episode(rows, won=False, **gt):
    """A trajectory from rows (observation, action[, valid]) with the household gt; its events are written out
    here, independently of skills.py. A missing action tag (action "") costs the -0.1 format penalty."""
    steps, events = [], []
    for index, (observation, action, valid) in enumerate((*row, True)[:3] for row in rows):
        steps.append({"observation": observation, "action": action, "valid": valid, "reward": -0.1 * (not action),
                      "response": "<think>I should act.</think>" + (f"<action>{action}</action>" if action else "")})
        verb, *words = action.split() or ["look"]  # "go to X 1", "open X 1", "take A 1 from X 1", "move A 1 to X 1"
        if valid and verb != "look":
            events.append({"step": index, "kind": "put" if verb == "move" else verb, "target": " ".join(words[-2:]),
                           "object": None if verb in ("go", "open", "use") else " ".join(words[:2])})
    steps[-1]["reward"] += 10.0 * won
    gt = dict(HEAT_GT, **gt, won=won, steps=len(steps), max_steps=len(steps), events=events,
              invalid_steps=[index for index, step in enumerate(steps) if not step["valid"]])
    return {"task": gt["task"], "won": won, "reward": 10.0 * won, "steps": steps, "gt": gt}


TO_DRAWER_2 = [(WELCOME, "go to drawer 2"), (closed("drawer 2"), "open drawer 2"),
               ("You open the drawer 2. The drawer 2 is open. In it, you see a apple 1.", "take apple 1 from drawer 2")]
PICKED = "You pick up the apple 1 from the drawer 2."
EXPERT = episode(TO_DRAWER_2 + [
    (PICKED, "go to microwave 1"), (closed("microwave 1"), "heat apple 1 with microwave 1"),
    ("You heat the apple 1.", "go to countertop 1"), (on("countertop 1", "a bread 1"), "move apple 1 to countertop 1")],
    won=True)
LOOK_SUCCESS = episode([
    ("Looking quickly around you, you see a bed 1, and a sidetable 1.", "go to bed 1"),
    (on("bed 1", "a book 1"), "take book 1 from bed 1"), ("You pick up the book 1.", "go to sidetable 1"),
    (on("sidetable 1", "a desklamp 1"), "use desklamp 1")], won=True, task="examine the book with the desklamp.",
    task_type="look_at_obj_in_light", goal_object="book", goal_receptacle=None, tool="desklamp 1",
    object_locations={"book 1": "bed 1"}, closed_receptacles=[])
TAKE = "take apple 1 from countertop 1"
FAILURES = {  # name: (trajectory with the planted mistake, words every skill phrasing has, part of the summary)
    "placed before heating": (episode(TO_DRAWER_2 + [
        (PICKED, "go to countertop 1"), (on("countertop 1", "a bread 1"), "move apple 1 to countertop 1"),
        ("You move the apple 1.", "look")]),
        ["apple", "microwave 1", "countertop", "heat"], "before it was heated"),
    "closed not opened": (episode([(WELCOME, "go to drawer 1")] + [(closed(place), f"go to {then}") for place, then in [
        ("drawer 1", "drawer 2"), ("drawer 2", "fridge 1"), ("fridge 1", "cabinet 1"), ("cabinet 1", "drawer 1")]]),
        ["apple", "drawer 2", "open"], "never opened the closed drawer 2"),
    "repeated invalid": (episode([(WELCOME, "go to countertop 1"), (empty("countertop 1"), TAKE, False),
                                  (NOTHING, TAKE, False), (NOTHING, TAKE, False), (NOTHING, "", False)]),
                         [TAKE, "3", "listed"], f"'{TAKE}' did nothing, 3 times"),
    "missing action tags": (episode([(WELCOME, "go to drawer 1")] + [(NOTHING, "", False)] * 3),
                            ["action tag", "3", NOTHING], "without an action tag did nothing, 3 times"),
    "wrong appliance": (episode(TO_DRAWER_2 + [
        (PICKED, "go to fridge 1"), (closed("fridge 1"), "heat apple 1 with fridge 1", False),
        (NOTHING, "go to countertop 1")]),
        ["fridge", "microwave", "heat"], "used the fridge instead of the microwave"),
    "wrong object": (episode([
        (WELCOME, "go to countertop 1"), (on("countertop 1", "a tomato 1"), "take tomato 1 from countertop 1"),
        ("You pick up the tomato 1.", "go to microwave 1"), (closed("microwave 1"), "heat tomato 1 with microwave 1"),
        ("You heat the tomato 1.", "go to countertop 1"), (empty("countertop 1"), "move tomato 1 to countertop 1")]),
        ["tomato 1", "apple"], "took tomato 1 instead of an apple"),
    "circling": (episode([(WELCOME, "go to countertop 1")] + [(empty(place), f"go to {then}") for place, then in [
        ("countertop 1", "sinkbasin 1"), ("sinkbasin 1", "countertop 1")] * 3]),  # the apple was in unvisited drawer 2
        ["countertop 1", "sinkbasin 1", "drawer 2"], "kept revisiting"),
    "never found": (episode([(WELCOME, "go to countertop 1"), (empty("countertop 1"), "go to sinkbasin 1"),
                             (empty("sinkbasin 1"), "go to cabinet 1")]), ["apple", "drawer 2", "never"],
                    "never found the apple"),
    "never heated": (episode(TO_DRAWER_2 + [(PICKED, "go to countertop 1"), (empty("countertop 1"), "look")]),
                     ["apple", "microwave 1", "never heated"], "never heated it"),
}
ALFWORLD_GT = {"env": "alfworld", "task_type": "pick_heat_then_place_in_recep", "task": HEAT_TASK, "won": False,
               "steps": 6, "max_steps": 6, "invalid_steps": [], "gamefile": "game.tw-pddl",
               "pddl_params": {"object_target": "Apple", "parent_target": "CounterTop", "toggle_target": ""}}


def skills_of(trajectory, gt=None, seeds=range(12)):
    """The annotator's skills for several rngs (every phrasing must carry the facts) and the raw outputs; each
    output parses (with the task, as seed.py calls parse_skill) and its skill stays under 60 words."""
    outputs = [annotate(trajectory, gt, rng=random.Random(seed)) for seed in seeds]
    found = [json.loads(output)["episode_skill"] for output in outputs]
    for output, skill in zip(outputs, found):
        assert parse_skill(output, task=trajectory["task"]) is not None and len(skill.split()) < 60, output
    return found, outputs


# ----------------------------------------------------------------------------- analyzer_prompt
def test_skill_analyzer_prompt_content_and_returns():
    prompt, returns = analyzer_prompt(EXPERT), discounted_returns([step["reward"] for step in EXPERT["steps"]])
    expected = [10 * 0.95 ** (6 - i) for i in range(7)]
    assert max(abs(a - b) for a, b in zip(returns, expected)) < 1e-9, (returns, expected)
    assert prompt.startswith("Analyze the agent's episode.\nTask: " + HEAT_TASK + "\nOutcome: success"), prompt[:120]
    assert prompt.endswith(JSON_SHAPE) and "reusable workflow" in prompt
    assert "Step 1 | return 7.35 | obs: -= Welcome" in prompt and "thought: I should act. | action: go to" in prompt
    assert "Step 7 | return 10.00 |" in prompt and "action: move apple 1 to countertop 1" in prompt
    failed = analyzer_prompt(FAILURES["repeated invalid"][0])
    assert "Outcome: failure" in failed and "avoidance rule" in failed
    assert "action: take apple 1 from countertop 1 (invalid)" in failed and "action: (none)" in failed
    bare = dict(EXPERT, steps=[dict(step, response=f"<action>{step['action']}</action>") for step in EXPERT["steps"]])
    assert "thought:" not in analyzer_prompt(bare), "a bare action tag should not repeat the action as a thought"


def test_skill_analyzer_prompt_fits_a_budget_and_keeps_first_and_last_steps():
    trajectory = episode([(closed(f"drawer {i}") * 8, f"go to drawer {i}") for i in range(1, 31)], won=True)
    full = analyzer_prompt(trajectory)
    for budget in (2000, 800, 300, 150):
        prompt = analyzer_prompt(trajectory, max_tokens=budget)
        assert len(prompt) // 4 <= budget < len(full) // 4, f"budget {budget}: {len(prompt) // 4} tokens"
        assert "Step 1 |" in prompt and "Step 30 |" in prompt and "steps omitted) ..." in prompt, budget
        assert HEAT_TASK in prompt and "Outcome: success" in prompt and prompt.endswith(JSON_SHAPE), budget
        numbers = [int(line.split()[1]) for line in prompt.splitlines() if line.startswith("Step ")]
        head = [n for n in numbers if n <= len(numbers)]
        assert numbers == head + list(range(31 - (len(numbers) - len(head)), 31)), f"not head + tail: {numbers}"
        assert (len(numbers) > 2 and " ... | " not in prompt) == (budget >= 800), f"{budget}: cut before dropping steps"
    tight = analyzer_prompt(trajectory, max_tokens=120, count_tokens=lambda text: len(text.split()))
    assert len(tight.split()) <= 120 and "Step 30 |" in tight and " ..." in tight, len(tight.split())
    impossible = analyzer_prompt(trajectory, max_tokens=5)
    assert HEAT_TASK in impossible and "Step 1 |" in impossible, "the fixed part must never be cut"


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
        annotate(dict(EXPERT, gt=None))
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


@pytest.mark.skipif(envs is None or not hasattr(envs, "make_env"), reason="envs.py with make_env not importable")
def test_skill_annotate_real_household_episodes():
    """Expert and noisy episodes: every annotation parses and names the goal, or is about 'Nothing happens.'"""
    wins = 0
    for seed in range(60):
        env, noise, steps, done = envs.make_env("household", "train", seed), random.Random(seed), [], False
        observation, info = env.reset(seed)
        while not done:
            action = env.expert_action(epsilon=[0.0, 0.3, 0.7][seed % 3], rng=noise)
            sent = "" if seed % 6 == 5 and noise.random() < 0.2 else action  # some responses lose the action tag
            next_observation, reward, done, info = env.step(sent)
            steps.append({"observation": observation, "action": sent, "valid": info["valid"],
                          "response": f"<action>{sent}</action>" if sent else "", "reward": reward - 0.1 * (not sent)})
            observation = next_observation
        trajectory = {"task": info["task"], "won": info["won"], "reward": 10.0 * info["won"], "steps": steps}
        output, wins = annotate(trajectory, info["gt"]), wins + info["won"]
        skill, goal = parse_skill(output, task=trajectory["task"]), info["gt"]["goal_object"]
        assert skill is not None, f"seed {seed}: unparsable annotation {output}"
        assert goal in skill or "Nothing happens" in skill, f"seed {seed}: {skill}"
    assert 0 < wins < 60, f"{wins} wins of 60: need both outcomes"


# ----------------------------------------------------------------------------- JSONL and the token view
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


def test_skill_show_tokens_marks_trained_tokens():
    tokenizer = types.SimpleNamespace(decode=lambda ids: "".join(map(chr, ids)))
    ids, mask = [ord(c) for c in "ab<cd>e"], [0, 0, 0, 1, 1, 0, 0]
    assert show_tokens(ids, mask, tokenizer, color=False) == "ab<[[cd]]>e"
    coloured = show_tokens(array.array("i", ids), array.array("i", mask), tokenizer)  # has .tolist(), like a tensor
    assert coloured == "\x1b[2mab<\x1b[30;42mcd\x1b[2m>e\x1b[0m", repr(coloured)
    assert show_tokens([ord("x")], [1], tokenizer, color=False) == "[[x]]"
    with pytest.raises(ValueError):
        show_tokens([1, 2], [1], tokenizer)
