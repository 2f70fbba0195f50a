"""Tests of skills.py: the skill parser, the teacher context, the analyzer prompt, the hindsight annotator,
stage-1 JSONL files and the token view. Fast, CPU only, seeded. Run: python -m pytest -q test_skills_part.py"""
import json
import random
import time

import pytest

import skills
from skills import (JSON_SHAPE, SKILL_HEADER, analyzer_prompt, annotate, discounted_returns, parse_skill,
                    read_jsonl, show_tokens, with_skill, write_jsonl)

try:  # the household env is another file of the project; its test here is skipped without it
    import envs
except ImportError:
    envs = None

GOOD = "Open closed drawers before searching them, then take the apple."

# ----------------------------------------------------------------------------- parse_skill

PARSE_CASES = [
    ("clean json", json.dumps({"episode_summary": "ok", "episode_skill": GOOD}), GOOD),
    ("fenced", "Here is my analysis:\n```json\n{\"episode_summary\": \"s\",\n \"episode_skill\": \"" + GOOD
     + "\"}\n```\nHope it helps.", GOOD),
    ("trailing commas", '{"episode_summary": "s", "episode_skill": "' + GOOD + '",}', GOOD),
    ("single quotes", "{'episode_summary': 's', 'episode_skill': \"Don't skip the drawers; open each closed one.\"}",
     "Don't skip the drawers; open each closed one."),
    ("chatter around", 'Sure! {"episode_skill": "' + GOOD + '"} Let me know.', GOOD),
    ("label line", "Summary: it failed.\nSkill: Open closed drawers before searching them.",
     "Open closed drawers before searching them."),
    ("key as label", "episode_skill: Heat the apple in the microwave before placing it.",
     "Heat the apple in the microwave before placing it."),
    ("markdown label", "**Episode Skill**: Keep track of visited places and do not revisit them.",
     "Keep track of visited places and do not revisit them."),
    ("bold label", "**Skill:** Open the fridge before taking the apple.", "Open the fridge before taking the apple."),
    ("wrapped value", "Skill: **\"[Open the fridge before taking the apple.]\"**", "Open the fridge before taking the apple."),
    ("quote at the end", '{"episode_skill": "Warning sign: \'The drawer 2 is closed.\'"}',
     "Warning sign: 'The drawer 2 is closed.'"),
    ("nested", '{"analysis": {"episode_summary": "s", "episode_skill": "' + GOOD + '"}}', GOOD),
    ("brace missing, value closed", '{"episode_summary": "s", "episode_skill": "' + GOOD + '"', GOOD),
    ("escaped quotes", r'{"episode_skill": "Use \"open drawer 2\" when the drawer is closed."}',
     'Use "open drawer 2" when the drawer is closed.'),
    ("curly quotes", "{\u201cepisode_skill\u201d: \u201c" + GOOD + "\u201d}", GOOD),
    ("key spelled out", '{"Episode Skill": "' + GOOD + '"}', GOOD),
    ("list value", '{"episode_skill": ["Open the fridge first.", "Then take the apple."]}',
     "Open the fridge first. Then take the apple."),
    ("control characters", '{"episode_skill": "Open\\u0000 the\\u200b fridge\\n before taking the apple.\x07"}',
     "Open the fridge before taking the apple."),
    ("first object lacks skill", '{"episode_summary": "s"} and then {"episode_skill": "' + GOOD + '"}', GOOD),
    ("braces in value", '{"episode_skill": "Use {the microwave} to heat the apple before placing it."}',
     "Use {the microwave} to heat the apple before placing it."),
    ("special tokens", '{"episode_skill": "Open the fridge<|im_end|> before taking the apple."}',
     "Open the fridge before taking the apple."),
    ("bytes", json.dumps({"episode_skill": GOOD}).encode(), GOOD),
    ("empty", "", None),
    ("none", None, None),
    ("not text", 12345, None),
    ("truncated value", '{"episode_summary": "s", "episode_skill": "Always open the closed dr', None),
    ("truncated pretty json", '{\n  "episode_summary": "s",\n  "episode_skill": "Always open the closed dr', None),
    ("format echoed", JSON_SHAPE, None),
    ("too short", '{"episode_skill": "Open it."}', None),
    ("not a string", '{"episode_skill": 42, "episode_summary": "s"}', None),
    ("restates the task", '{"episode_skill": "Your task is to: heat some apple and put it in countertop."}', None),
    ("degenerate", '{"episode_skill": "' + "go to drawer 1 " * 12 + '"}', None),
    ("symbols", '{"episode_skill": "!!!! ???? #### $$$$ %%%% ^^^^"}', None),
    ("no function words", '{"episode_skill": "aaaa bbbb cccc dddd eeee"}', None),
    ("unlabelled sentence", "Open closed drawers before searching them.", None),
    ("deep nesting", "[" * 5000 + "{" * 5000, None),
    ("lone surrogate", '{"episode_skill": "Open the fridge \\ud800before taking the apple."}',
     "Open the fridge before taking the apple."),
    ("huge tail", json.dumps({"episode_skill": GOOD}) + "x" * 2_000_000, GOOD),
    ("beyond scan window", " " * (skills.MAX_PARSE_CHARS + 10) + json.dumps({"episode_skill": GOOD}), None),
]


@pytest.mark.parametrize("name,text,expected", PARSE_CASES, ids=[case[0] for case in PARSE_CASES])
def test_parse_skill_cases(name, text, expected):
    assert parse_skill(text) == expected, f"{name}: {parse_skill(text)!r} != {expected!r}"


def test_parse_skill_task_restatement_and_length_cap():
    task = "heat some apple and put it in countertop."
    assert parse_skill('{"episode_skill": "Heat the apple and put it in the countertop."}', task=task) is None
    kept = parse_skill('{"episode_skill": "Heat the apple with microwave 1 before putting it in countertop."}', task=task)
    assert kept == "Heat the apple with microwave 1 before putting it in countertop.", kept
    letters = "abcdefghijklmnopqrstuvwxyz"
    long = "Open the drawer " + " ".join(letters[i % 26] + letters[i // 26 % 26] + "ing" for i in range(300))
    capped = parse_skill(json.dumps({"episode_skill": long}))
    assert capped and len(capped) <= skills.MAX_SKILL_CHARS and long.startswith(capped), len(capped or "")
    assert long[len(capped)] == " ", f"cut inside a word: ...{capped[-20:]!r}"


def test_parse_skill_prefixes_of_a_valid_answer():
    """Every prefix cut before the skill's closing quote is truncated (None); after it, the skill is whole."""
    text = json.dumps({"episode_summary": "The agent won.", "episode_skill": GOOD})
    closing = text.index(GOOD) + len(GOOD)
    for cut in range(len(text) + 1):
        expected = GOOD if cut > closing else None
        assert parse_skill(text[:cut]) == expected, f"cut {cut}: {parse_skill(text[:cut])!r}"


def test_parse_skill_never_raises_on_random_strings():
    rng = random.Random(0)
    pieces = ['{', '}', '"', "'", '\\', ',', ':', '[', ']', '```json', '\n', 'episode_skill', 'Skill:', 'the ',
              'open ', 'drawer 1 ', '\x00', '\u200b', '\ud800', 'é', '<|im_end|>', ' ', 'a', 'Z', '9']
    valid = json.dumps({"episode_summary": "s", "episode_skill": GOOD})
    start, results = time.perf_counter(), []
    for index in range(10_000):
        if index % 4 == 0:  # mutations of a valid answer
            chars = list(valid)
            for _ in range(rng.randint(1, 5)):
                chars[rng.randrange(len(chars))] = rng.choice(pieces)
            text = "".join(chars)
        else:
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 60)))
        skill = parse_skill(text)
        assert skill is None or (isinstance(skill, str) and len(skill) <= skills.MAX_SKILL_CHARS
                                 and skill.isprintable()), f"bad result {skill!r} for {text!r}"
        results.append(skill)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"10,000 parses took {elapsed:.1f} s"
    print(f"parse_skill: 10,000 random strings in {elapsed:.2f} s, {sum(r is not None for r in results)} parsed")


# ----------------------------------------------------------------------------- with_skill

AGENT_PROMPT = (
    "You are an expert agent operating in the ALFRED Embodied Environment. Your task is to: heat some apple and put "
    "it in countertop.\nPrior to this step, you have already taken 2 step(s). Below are the most recent 2 "
    "observations and the corresponding actions you took: [Observation 1: 'You arrive at drawer 1. Your task is to: "
    "x', Action 1: 'go to drawer 1']\nYou are now at step 3 and your current observation is: Nothing happens.\n"
    "Your admissible actions of the current situation are: ['go to fridge 1', 'look'].\n\n"
    "Now it's your turn to take an action.\nYou should first reason step-by-step about the current situation.")


def split_insert(prompt, teacher):
    """(k, inserted) with teacher == prompt[:k] + inserted + prompt[k:], or None if no single split exists."""
    if len(teacher) < len(prompt):
        return None
    k = 0
    while k < len(prompt) and prompt[k] == teacher[k]:
        k += 1
    rest = prompt[k:]
    if not teacher.endswith(rest):
        return None
    return k, teacher[k:len(teacher) - len(rest)]


def test_with_skill_after_the_task_line():
    teacher = with_skill(AGENT_PROMPT, GOOD)
    block = f"\n\n{SKILL_HEADER}\n[{GOOD}]\n"
    assert split_insert(AGENT_PROMPT, teacher) is not None, "ordinary prompt is not prefix + suffix of the teacher"
    k = AGENT_PROMPT.index("\nPrior to this step")
    assert teacher == AGENT_PROMPT[:k] + block + AGENT_PROMPT[k:], teacher
    assert teacher.count("**Episode-Level Skill**") == 1
    assert "countertop.\n\n**Episode-Level Skill**\nRefer to this episode-level skill" in teacher
    assert f"[{GOOD}]\n\nPrior to this step" in teacher


def test_with_skill_fallbacks_and_errors():
    no_task = AGENT_PROMPT.replace("Your task is to:", "Goal:")
    teacher = with_skill(no_task, GOOD)
    k = no_task.index("Now it's your turn")
    assert teacher == no_task[:k] + f"{SKILL_HEADER}\n[{GOOD}]\n\n" + no_task[k:], teacher
    bare = "Pick an action."
    assert with_skill(bare, GOOD) == bare + f"\n\n{SKILL_HEADER}\n[{GOOD}]\n"
    last_line = "Your task is to: put a mug in cabinet."
    assert with_skill(last_line, GOOD) == last_line + f"\n\n{SKILL_HEADER}\n[{GOOD}]\n"
    crlf = "Your task is to: put a mug in cabinet.\r\nNow it's your turn."
    assert with_skill(crlf, GOOD) == ("Your task is to: put a mug in cabinet." + f"\n\n{SKILL_HEADER}\n[{GOOD}]\n"
                                      + "\r\nNow it's your turn.")
    for prompt in (AGENT_PROMPT, no_task, bare, last_line, crlf):
        found = split_insert(prompt, with_skill(prompt, GOOD))
        assert found is not None and GOOD in found[1], f"not a single insertion for {prompt[:40]!r}"
    for bad in (None, "", "   "):
        with pytest.raises(ValueError):
            with_skill(AGENT_PROMPT, bad)


# ----------------------------------------------------------------------------- trajectories (contract dicts)

WELCOME = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, you "
           "see a cabinet 1, a countertop 1, a drawer 1, a drawer 2, a fridge 1, a microwave 1, and a sinkbasin 1."
           "\n\nYour task is to: heat some apple and put it in countertop.")
HEAT_TASK = "heat some apple and put it in countertop."


def skill_step(observation, action, valid=True, reward=0.0, think="I should act."):
    response = f"<think>{think}</think><action>{action}</action>" if action else f"<think>{think}</think>"
    return {"observation": observation, "response": response, "action": action, "reward": reward, "valid": valid}


def heat_gt(won, steps, invalid_steps, events, max_steps=30):
    return {"env": "household", "task_type": "pick_heat_then_place_in_recep", "task": HEAT_TASK,
            "goal_object": "apple", "goal_receptacle": "countertop", "tool": "microwave 1",
            "object_locations": {"apple 1": "drawer 2"},
            "closed_receptacles": ["cabinet 1", "drawer 1", "drawer 2", "fridge 1", "microwave 1"],
            "expert_plan": ["go to drawer 2", "open drawer 2", "take apple 1 from drawer 2", "go to microwave 1",
                            "heat apple 1 with microwave 1", "go to countertop 1", "move apple 1 to countertop 1"],
            "won": won, "steps": steps, "max_steps": max_steps, "invalid_steps": invalid_steps, "events": events}


EXPERT = {
    "task": HEAT_TASK, "won": True, "reward": 10.0,
    "steps": [
        skill_step(WELCOME, "go to drawer 2", think="Apples are often in drawers."),
        skill_step("You arrive at drawer 2. The drawer 2 is closed.", "open drawer 2"),
        skill_step("You open the drawer 2. The drawer 2 is open. In it, you see a apple 1, and a spoon 1.",
                   "take apple 1 from drawer 2"),
        skill_step("You pick up the apple 1 from the drawer 2.", "go to microwave 1"),
        skill_step("You arrive at microwave 1. The microwave 1 is closed.", "heat apple 1 with microwave 1"),
        skill_step("You heat the apple 1 using the microwave 1.", "go to countertop 1"),
        skill_step("You arrive at countertop 1. On the countertop 1, you see a bread 1.",
                   "move apple 1 to countertop 1", reward=10.0),
    ],
    "gt": heat_gt(True, 7, [], [
        {"step": 0, "kind": "go", "object": None, "target": "drawer 2"},
        {"step": 1, "kind": "open", "object": None, "target": "drawer 2"},
        {"step": 2, "kind": "take", "object": "apple 1", "target": "drawer 2"},
        {"step": 3, "kind": "go", "object": None, "target": "microwave 1"},
        {"step": 4, "kind": "heat", "object": "apple 1", "target": "microwave 1"},
        {"step": 5, "kind": "go", "object": None, "target": "countertop 1"},
        {"step": 6, "kind": "put", "object": "apple 1", "target": "countertop 1"}]),
}

PLACED_UNHEATED = {  # took the apple straight to the countertop: the planted mistake is skipping the microwave
    "task": HEAT_TASK, "won": False, "reward": 0.0,
    "steps": [
        skill_step(WELCOME, "go to drawer 2"),
        skill_step("You arrive at drawer 2. The drawer 2 is closed.", "open drawer 2"),
        skill_step("You open the drawer 2. The drawer 2 is open. In it, you see a apple 1, and a spoon 1.",
                   "take apple 1 from drawer 2"),
        skill_step("You pick up the apple 1 from the drawer 2.", "go to countertop 1"),
        skill_step("You arrive at countertop 1. On the countertop 1, you see a bread 1.",
                   "move apple 1 to countertop 1"),
        skill_step("You move the apple 1 to the countertop 1.", "look"),
    ],
    "gt": heat_gt(False, 6, [], [
        {"step": 0, "kind": "go", "object": None, "target": "drawer 2"},
        {"step": 1, "kind": "open", "object": None, "target": "drawer 2"},
        {"step": 2, "kind": "take", "object": "apple 1", "target": "drawer 2"},
        {"step": 3, "kind": "go", "object": None, "target": "countertop 1"},
        {"step": 4, "kind": "put", "object": "apple 1", "target": "countertop 1"}], max_steps=6),
}

CLOSED_UNOPENED = {  # walked past closed drawers and the fridge without opening any: the apple was in drawer 2
    "task": HEAT_TASK, "won": False, "reward": 0.0,
    "steps": [
        skill_step(WELCOME, "go to drawer 1"),
        skill_step("You arrive at drawer 1. The drawer 1 is closed.", "go to drawer 2"),
        skill_step("You arrive at drawer 2. The drawer 2 is closed.", "go to fridge 1"),
        skill_step("You arrive at fridge 1. The fridge 1 is closed.", "go to countertop 1"),
        skill_step("You arrive at countertop 1. On the countertop 1, you see a bread 1.", "go to cabinet 1"),
        skill_step("You arrive at cabinet 1. The cabinet 1 is closed.", "go to drawer 1"),
    ],
    "gt": heat_gt(False, 6, [], [
        {"step": 0, "kind": "go", "object": None, "target": "drawer 1"},
        {"step": 1, "kind": "go", "object": None, "target": "drawer 2"},
        {"step": 2, "kind": "go", "object": None, "target": "fridge 1"},
        {"step": 3, "kind": "go", "object": None, "target": "countertop 1"},
        {"step": 4, "kind": "go", "object": None, "target": "cabinet 1"},
        {"step": 5, "kind": "go", "object": None, "target": "drawer 1"}], max_steps=6),
}

REPEATED_INVALID = {  # kept trying to take an apple that is not on the countertop
    "task": HEAT_TASK, "won": False, "reward": 0.0,
    "steps": [
        skill_step(WELCOME, "go to countertop 1"),
        skill_step("You arrive at countertop 1. On the countertop 1, you see a bread 1.",
                   "take apple 1 from countertop 1", valid=False),
        skill_step("Nothing happens.", "take apple 1 from countertop 1", valid=False),
        skill_step("Nothing happens.", "take apple 1 from countertop 1", valid=False),
        skill_step("Nothing happens.", "", valid=False, reward=-0.1),
    ],
    "gt": heat_gt(False, 5, [1, 2, 3, 4], [{"step": 0, "kind": "go", "object": None, "target": "countertop 1"}],
                  max_steps=5),
}

WRONG_APPLIANCE = {  # tried to heat the apple with the fridge
    "task": HEAT_TASK, "won": False, "reward": 0.0,
    "steps": [
        skill_step(WELCOME, "go to drawer 2"),
        skill_step("You arrive at drawer 2. The drawer 2 is closed.", "open drawer 2"),
        skill_step("You open the drawer 2. The drawer 2 is open. In it, you see a apple 1.", "take apple 1 from drawer 2"),
        skill_step("You pick up the apple 1 from the drawer 2.", "go to fridge 1"),
        skill_step("You arrive at fridge 1. The fridge 1 is closed.", "heat apple 1 with fridge 1", valid=False),
        skill_step("Nothing happens.", "go to countertop 1"),
    ],
    "gt": heat_gt(False, 6, [4], [
        {"step": 0, "kind": "go", "object": None, "target": "drawer 2"},
        {"step": 1, "kind": "open", "object": None, "target": "drawer 2"},
        {"step": 2, "kind": "take", "object": "apple 1", "target": "drawer 2"},
        {"step": 3, "kind": "go", "object": None, "target": "fridge 1"},
        {"step": 5, "kind": "go", "object": None, "target": "countertop 1"}], max_steps=6),
}

WRONG_OBJECT = {  # took the tomato and put it on the countertop
    "task": HEAT_TASK, "won": False, "reward": 0.0,
    "steps": [
        skill_step(WELCOME, "go to countertop 1"),
        skill_step("You arrive at countertop 1. On the countertop 1, you see a tomato 1.", "take tomato 1 from countertop 1"),
        skill_step("You pick up the tomato 1 from the countertop 1.", "go to microwave 1"),
        skill_step("You arrive at microwave 1. The microwave 1 is closed.", "heat tomato 1 with microwave 1"),
        skill_step("You heat the tomato 1 using the microwave 1.", "go to countertop 1"),
        skill_step("You arrive at countertop 1. On the countertop 1, you see nothing.", "move tomato 1 to countertop 1"),
    ],
    "gt": heat_gt(False, 6, [], [
        {"step": 0, "kind": "go", "object": None, "target": "countertop 1"},
        {"step": 1, "kind": "take", "object": "tomato 1", "target": "countertop 1"},
        {"step": 2, "kind": "go", "object": None, "target": "microwave 1"},
        {"step": 3, "kind": "heat", "object": "tomato 1", "target": "microwave 1"},
        {"step": 4, "kind": "go", "object": None, "target": "countertop 1"},
        {"step": 5, "kind": "put", "object": "tomato 1", "target": "countertop 1"}], max_steps=6),
}

CIRCLING = {  # went back and forth between two open places; the apple was in the never-visited drawer 2
    "task": HEAT_TASK, "won": False, "reward": 0.0,
    "steps": [skill_step(WELCOME, "go to countertop 1")] + [
        skill_step(f"You arrive at {place}. On the {place}, you see nothing.", f"go to {other}")
        for place, other in [("countertop 1", "sinkbasin 1"), ("sinkbasin 1", "countertop 1")] * 3],
    "gt": heat_gt(False, 7, [], [{"step": i, "kind": "go", "object": None, "target": place} for i, place in
                                 enumerate(["countertop 1", "sinkbasin 1", "countertop 1"] * 2 + ["sinkbasin 1"])],
                  max_steps=7),
}

ALFWORLD_GT = {"env": "alfworld", "task_type": "pick_heat_then_place_in_recep", "task": HEAT_TASK, "won": False,
               "steps": 6, "max_steps": 6, "invalid_steps": [], "gamefile": "game.tw-pddl",
               "pddl_params": {"object_target": "Apple", "parent_target": "CounterTop", "toggle_target": "",
                               "mrecep_target": "", "object_sliced": False}}

LOOK_SUCCESS = {
    "task": "examine the book with the desklamp.", "won": True, "reward": 10.0,
    "steps": [
        skill_step("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, "
                   "you see a bed 1, a desk 1, and a sidetable 1.\n\nYour task is to: examine the book with the desklamp.",
                   "go to bed 1"),
        skill_step("You arrive at bed 1. On the bed 1, you see a book 1, and a pillow 1.", "take book 1 from bed 1"),
        skill_step("You pick up the book 1 from the bed 1.", "go to sidetable 1"),
        skill_step("You arrive at sidetable 1. On the sidetable 1, you see a desklamp 1.", "use desklamp 1", reward=10.0),
    ],
    "gt": {"env": "household", "task_type": "look_at_obj_in_light", "task": "examine the book with the desklamp.",
           "goal_object": "book", "goal_receptacle": None, "tool": "desklamp 1", "object_locations": {"book 1": "bed 1"},
           "closed_receptacles": [], "expert_plan": [], "won": True, "steps": 4, "max_steps": 20, "invalid_steps": [],
           "events": [{"step": 0, "kind": "go", "object": None, "target": "bed 1"},
                      {"step": 1, "kind": "take", "object": "book 1", "target": "bed 1"},
                      {"step": 2, "kind": "go", "object": None, "target": "sidetable 1"},
                      {"step": 3, "kind": "use", "object": None, "target": "desklamp 1"}]},
}

FAILURES = {"placed_unheated": PLACED_UNHEATED, "closed_unopened": CLOSED_UNOPENED,
            "repeated_invalid": REPEATED_INVALID, "wrong_appliance": WRONG_APPLIANCE, "wrong_object": WRONG_OBJECT,
            "circling": CIRCLING}


def skills_of(trajectory, gt=None, seeds=range(12)):
    """The annotator's skills for several rngs (every phrasing must carry the facts), and the raw outputs."""
    outputs = [annotate(trajectory, gt, rng=random.Random(seed)) for seed in seeds]
    return [json.loads(output)["episode_skill"] for output in outputs], outputs


# ----------------------------------------------------------------------------- analyzer_prompt

def test_skill_analyzer_prompt_content_and_returns():
    prompt = analyzer_prompt(EXPERT)
    returns = discounted_returns([step["reward"] for step in EXPERT["steps"]])
    expected = [10 * 0.95 ** (6 - i) for i in range(7)]
    assert max(abs(a - b) for a, b in zip(returns, expected)) < 1e-9, (returns, expected)
    assert prompt.startswith("Analyze the agent's episode.\nTask: " + HEAT_TASK + "\nOutcome: success"), prompt[:120]
    assert prompt.endswith(JSON_SHAPE) and "reusable workflow" in prompt
    assert "Step 1 | return 7.35 | obs: -= Welcome" in prompt and "thought: Apples are often in drawers." in prompt
    assert "Step 7 | return 10.00 |" in prompt and "action: move apple 1 to countertop 1" in prompt
    failed = analyzer_prompt(REPEATED_INVALID)
    assert "Outcome: failure" in failed and "avoidance rule" in failed
    assert "action: take apple 1 from countertop 1 (invalid)" in failed and "action: (none)" in failed
    bare = dict(EXPERT, steps=[dict(step, response=f"<action>{step['action']}</action>") for step in EXPERT["steps"]])
    assert "thought:" not in analyzer_prompt(bare), "a bare action tag should not repeat the action as a thought"


def test_skill_analyzer_prompt_fits_a_budget_and_keeps_first_and_last_steps():
    steps = [skill_step("You arrive at drawer 1. The drawer 1 is closed. " * 5, f"go to drawer {i}",
                        think="long reasoning " * 20) for i in range(1, 31)]
    steps[-1]["reward"] = 10.0
    trajectory = {"task": HEAT_TASK, "won": True, "reward": 10.0, "steps": steps}
    full = analyzer_prompt(trajectory)
    for budget in (2000, 800, 300, 150):
        prompt = analyzer_prompt(trajectory, max_tokens=budget)
        assert len(prompt) // 4 <= budget < len(full) // 4, f"budget {budget}: {len(prompt) // 4} tokens"
        assert "Step 1 |" in prompt and "Step 30 |" in prompt and "steps omitted) ..." in prompt, budget
        assert HEAT_TASK in prompt and "Outcome: success" in prompt and prompt.endswith(JSON_SHAPE), budget
        numbers = [int(line.split()[1]) for line in prompt.splitlines() if line.startswith("Step ")]
        head = [n for n in numbers if n <= len(numbers)]
        assert numbers == head + list(range(31 - (len(numbers) - len(head)), 31)), f"not head + tail: {numbers}"
    words = lambda text: len(text.split())
    tight = analyzer_prompt(trajectory, max_tokens=120, count_tokens=words)
    assert words(tight) <= 120 and "Step 30 |" in tight and " ..." in tight, words(tight)
    impossible = analyzer_prompt(trajectory, max_tokens=5)
    assert HEAT_TASK in impossible and "Step 1 |" in impossible, "the fixed part must never be cut"


# ----------------------------------------------------------------------------- annotate

def test_skill_annotate_success_names_the_decisive_observations():
    found, outputs = skills_of(EXPERT)
    for skill in found:
        assert "apple" in skill and "drawer 2" in skill and "microwave 1" in skill and "countertop 1" in skill, skill
        assert skill.index("drawer 2") < skill.index("microwave 1") < skill.index("countertop 1"), skill
        assert "open" in skill or "closed" in skill, f"the closed drawer is the decisive observation: {skill}"
    assert len(set(found)) >= 3, f"only {len(set(found))} phrasings over 12 rngs"
    assert annotate(EXPERT) == annotate(EXPERT), "the default rng must be repeatable"
    assert set(json.loads(outputs[0])) == {"episode_summary", "episode_skill"}
    for skill in skills_of(LOOK_SUCCESS)[0]:
        assert "book" in skill and "desklamp 1" in skill and "bed 1" in skill, skill


@pytest.mark.parametrize("name,must_mention", [
    ("placed_unheated", ["apple", "microwave 1", "countertop", "heat"]),
    ("closed_unopened", ["apple", "drawer 2", "open"]),
    ("repeated_invalid", ["take apple 1 from countertop 1", "3"]),
    ("wrong_appliance", ["fridge", "microwave", "heat"]),
    ("wrong_object", ["tomato 1", "apple"]),
    ("circling", ["countertop 1", "sinkbasin 1", "drawer 2"]),
])
def test_skill_annotate_failure_names_the_planted_mistake(name, must_mention):
    found, outputs = skills_of(FAILURES[name])
    for skill, output in zip(found, outputs):
        missing = [word for word in must_mention if word.lower() not in skill.lower()]
        assert not missing, f"{name}: skill lacks {missing}: {skill}"
        assert "failed" in json.loads(output)["episode_summary"], output


def test_skill_annotate_alfworld_gt_reads_the_observations():
    """ALFWorld's gt has no locations or events: the annotator reads them from observations and actions."""
    found, _ = skills_of(CLOSED_UNOPENED, ALFWORLD_GT)
    for skill in found:  # the apple was never seen, so the advice is to open what was skipped
        assert "drawer 1" in skill and "apple" in skill and "open" in skill.lower(), skill
    won = dict(ALFWORLD_GT, won=True, steps=7)
    for skill in skills_of(EXPERT, won)[0]:
        assert "drawer 2" in skill and "microwave 1" in skill and "countertop 1" in skill, skill
    for skill in skills_of(PLACED_UNHEATED, ALFWORLD_GT)[0]:
        assert "microwave" in skill and "heat" in skill.lower(), skill


def test_skill_annotate_outputs_parse_and_stay_short():
    trajectories = [EXPERT, LOOK_SUCCESS] + list(FAILURES.values())
    outputs = [output for trajectory in trajectories for output in skills_of(trajectory, seeds=range(30))[1]]
    parsed = [parse_skill(output, task=json.loads(output)["episode_summary"].split("'")[1]) for output in outputs]
    rate = sum(skill is not None for skill in parsed) / len(parsed)
    longest = max(len(json.loads(output)["episode_skill"].split()) for output in outputs)
    print(f"annotator parse rate (hand-built): {rate:.3f} of {len(parsed)}, longest skill {longest} words")
    assert rate == 1.0, [o for o, p in zip(outputs, parsed) if p is None][:3]
    assert longest < 60, f"longest skill has {longest} words"
    with pytest.raises(ValueError):
        annotate(dict(EXPERT, gt=None))


@pytest.mark.skipif(envs is None or not hasattr(envs, "make_env"), reason="envs.py with make_env not importable")
def test_skill_annotate_real_household_episodes():
    """Expert and noisy household episodes: every annotation parses and its skill names the goal object
    (except skills about the action format or a repeated invalid command, which are about the agent)."""
    records, about_format = [], ("action tag", "Nothing happens", "invalid command")
    for seed in range(60):
        env = envs.make_env("household", "train", seed)
        observation, info = env.reset(seed)
        noise, steps, done = random.Random(seed), [], False
        while not done:
            action = env.expert_action(epsilon=[0.0, 0.3, 0.7][seed % 3], rng=noise)
            sent = "" if seed % 6 == 5 and noise.random() < 0.2 else action  # some responses lose the action tag
            response = f"<think>next</think><action>{sent}</action>" if sent else "<think>next</think>"
            next_observation, reward, done, info = env.step(sent)
            steps.append({"observation": observation, "response": response, "action": sent,
                          "reward": reward - (0.0 if sent else 0.1), "valid": info["valid"]})
            observation = next_observation
        trajectory = {"task": info["task"], "won": info["won"], "reward": 10.0 * info["won"], "steps": steps,
                      "gt": info["gt"]}
        output = annotate(trajectory)
        skill, goal = parse_skill(output, task=trajectory["task"]), info["gt"]["goal_object"]
        assert skill is not None, f"seed {seed}: unparsable annotation {output}"
        assert goal in skill or any(marker in skill for marker in about_format), f"seed {seed}: {skill}"
        records.append({"prompt": analyzer_prompt(trajectory), "completion": output, "won": info["won"]})
    wins = sum(record["won"] for record in records)
    assert 0 < wins < len(records), f"{wins} wins of {len(records)}: need both outcomes"
    print(f"household: 60 episodes ({wins} won), all annotations parse; "
          f"analyzer prompts {min(len(r['prompt']) for r in records)}-{max(len(r['prompt']) for r in records)} chars")


# ----------------------------------------------------------------------------- JSONL and the token view

def test_skill_jsonl_round_trip_and_errors(tmp_path):
    records = [{"prompt": analyzer_prompt(EXPERT), "completion": annotate(EXPERT)},
               {"prompt": "é\u2028line", "completion": "{}", "extra": 1}]
    path = str(tmp_path / "stage1" / "data.jsonl")
    write_jsonl(path, records)
    assert read_jsonl(path) == records
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("\n{\"prompt\": \"p\", \"completion\": \n")
    with pytest.raises(ValueError, match=r"data\.jsonl:4: malformed JSON"):
        read_jsonl(path)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write('{"prompt": "p"}\n')
    with pytest.raises(ValueError, match=r"data\.jsonl:1: expected"):
        read_jsonl(path)
    with pytest.raises(ValueError, match="record 1"):
        write_jsonl(path, [{"prompt": "p", "completion": "c"}, {"prompt": "p"}])


class CharTokenizer:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class TensorLike(list):
    def tolist(self):
        return list(self)


def test_skill_show_tokens_marks_trained_tokens():
    ids, mask = [ord(c) for c in "ab<cd>e"], [0, 0, 0, 1, 1, 0, 0]
    assert show_tokens(ids, mask, CharTokenizer(), color=False) == "ab<[[cd]]>e"
    coloured = show_tokens(TensorLike(ids), TensorLike(mask), CharTokenizer())
    assert coloured == "\x1b[2mab<\x1b[30;42mcd\x1b[2m>e\x1b[0m", repr(coloured)
    assert show_tokens([ord("x")], [1], CharTokenizer(), color=False) == "[[x]]"
    with pytest.raises(ValueError):
        show_tokens([1, 2], [1], CharTokenizer())
