"""
tests/test_ezpoints.py: the EZPoints simulator (simulators/ezpoints.py) against its contract -- determinism, splits,
garbage answers, gym_cards' rules and rewards, the formula reader, the enumerating expert, the held-out card pairs,
the hindsight annotator, the prompt -- and the gym_cards adapter's missing-package error.

    python -m pytest -q tests/test_ezpoints.py
"""
import importlib
import itertools
import random
import sys

import numpy as np
import pytest

from test_environments import assert_usable_skills, record
from simulators import ezpoints
from simulators.ezpoints import ACTIONS, EzpointsEnv, annotate, evaluate, pair_name, parse_token

INFO_KEYS = {"task", "admissible", "won", "valid", "task_type"}
GARBAGE = ["", "x" * 10_000, "\u2603 \u00fcn\u00efcode \U0001f600", "None", None, "5+7", "12", "<action>", "plus"]


def play(env, actions):
    return [env.step(action) for action in actions]


def deal_of(env, ranks):
    """Resets `env` on the first seed whose deal has these ranks, in this order."""
    for task_seed in itertools.count():
        env.reset(task_seed)
        if [rank for rank, _ in env.cards] == ranks:
            return task_seed


def test_verl_agent_projection_reads_exactly_one_token():
    cases = {"5": "5", "'+'": "+", " = ": "=", "10": "10", "append 7": "7", "*": "*", "5+7": None, "12": None,
             "10 or 1": None, "": None, None: None, "plus": None}
    assert {text: parse_token(text) for text in cases} == cases


def test_the_formula_reader_agrees_with_python_on_gym_cards_tokens():
    """evaluate reads joined tokens as Python's eval does (gym_cards scores with eval), "**" aside."""
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.choice(("2", "5", "10", "+", "*", " ")) for _ in range(rng.randint(1, 6))]
        text = "".join(tokens)
        if "**" in text.replace(" ", ""):
            assert evaluate(tokens) is None
            continue
        try:
            expected = eval(text) if text.strip() else None  # the test's oracle only: these six symbols
        except SyntaxError:
            expected = None
        assert evaluate(tokens) == expected, text


def test_rewards_follow_gym_cards():
    """A number not on the cards (or used up) is -1 and leaves a blank; '=' scores +10 or -1 and ends; a formula
    longer than 5 tokens ends the episode with -1; garbage is 0."""
    env = EzpointsEnv("train", 0)
    deal_of(env, [5, 7])
    results = play(env, ["9", "5", "5", "nonsense", "+", "7"])
    assert [r for _, r, _, _ in results] == [-1.0, 0.0, -1.0, 0.0, 0.0, 0.0]
    assert [info["valid"] for _, _, _, info in results] == [False, True, False, False, True, True]
    assert env.formula == [" ", "5", " ", "+", "7"] and not results[-1][2]
    obs, reward, done, info = env.step("=")  # "5 +7" is 12 for Python too: blanks are harmless
    assert (reward, done, info["won"]) == (10.0, True, True)
    assert info["gt"]["first_wrong"] == {"step": 0, "token": "9", "reason": "not a card", "formula_before": ""}
    deal_of(env, [5, 7])
    obs, reward, done, info = play(env, ["5", "*", "7", "="])[-1]
    assert (reward, done, info["won"], info["gt"]["value"]) == (-1.0, True, False, 35)
    assert info["gt"]["first_wrong"]["token"] == "*" and info["gt"]["first_wrong"]["reason"] == "dead end"
    deal_of(env, [5, 7])
    results = play(env, ["+", "+", "+", "+", "+", "+", "5"])
    assert results[-1][1:3] == (-1.0, True) and results[-1][3]["gt"]["end"] == "too long"


def test_the_expert_ends_a_lost_formula_and_noise_picks_other_actions():
    env = EzpointsEnv("train", 0)
    deal_of(env, [5, 7])
    assert env.expert_thought("5") == "the cards are worth 5 and 7: 5+7, start with 5"
    env.step("5")
    env.step("*")
    assert env.expert_action() == "=" and "out of reach" in env.expert_thought("=")
    env.reset(3)
    best, rng = env.expert_action(), random.Random(1)
    noisy = [env.expert_action(epsilon=0.5, rng=rng, oracle=True) for _ in range(400)]
    assert 0.4 < sum(a != best for a in noisy) / 400 < 0.6 and set(noisy) <= set(ACTIONS)


def test_the_image_is_uint8_and_changes_after_a_valid_token():
    env = EzpointsEnv("valid_unseen", 0)
    obs, _ = env.reset(1)
    assert obs["image"].shape == (112, 112, 3) and obs["image"].dtype == np.uint8
    after, _, _, info = env.step(env.expert_action())
    assert info["valid"] and not np.array_equal(obs["image"], after["image"])
    assert np.array_equal(env.step("nonsense")[0]["image"], after["image"])
    hearts, spades = (ezpoints.render([(5, suit), (7, suit)], []) for suit in ("hearts", "spades"))
    assert not np.array_equal(hearts, spades)
    assert EzpointsEnv(text_cards=False).reset(0)[0]["text"] == "The cards are dealt. The formula so far: ''."


def test_the_shortest_formula_replays_to_a_win():
    env = EzpointsEnv("train", 0)
    for task_seed in range(30):
        _, info = env.reset(task_seed)
        plan = ezpoints.shortest_completion([], [], env.numbers)
        assert len(plan) == 4 and "".join(plan[:-1]) == env.solution
        operator = "*" if info["task_type"] == "ezpoints-product" else "+"
        assert plan[1] == operator and evaluate(plan[:-1]) == 12
        obs, reward, done, info = play(env, plan)[-1]
        assert (reward, done, info["won"]) == (10.0, True, True)


def test_valid_unseen_card_pairs_never_appear_in_train():
    def pairs(split, seeds):
        env = EzpointsEnv(split, 0)
        found = set()
        for task_seed in seeds:
            env.reset(task_seed)
            assert ezpoints.shortest_completion([], [], env.numbers) is not None  # every deal has a solution
            found.add(pair_name([rank for rank, _ in env.cards]))
        return found
    seen = pairs("train", range(300)) | pairs("valid_seen", range(100))
    unseen = pairs("valid_unseen", range(100))
    assert unseen == ezpoints.HELD_OUT_PAIRS and not seen & unseen
    assert {rank for pair in unseen for rank in pair.split()} <= {rank for pair in seen for rank in pair.split()}
    assert len(seen) == 8, seen  # all of gym_cards' other pairs, J, Q and K each with a 2


def test_annotate_writes_a_usable_skill_for_a_success_and_a_failure():
    env = EzpointsEnv("train", 0)
    cases = []
    for actions, word in ((["2", "*", "6", "="], "*"), (["9"] * 8, "9"), (["2", "+"] + ["nonsense"] * 6, "2*6"),
                          (["2", "="], "equals"), (["nonsense"] * 8, "token")):
        deal_of(env, [2, 6])
        cases.append((record(env, actions), word))
    for (trajectory, gt), word in cases:
        assert_usable_skills(annotate, trajectory, gt, word)
    assert "it chose 9, which is not on the cards" in annotate(*cases[1][0], random.Random(0))[0]


def test_gym_cards_adapter_says_what_to_install(monkeypatch):
    adapter = importlib.import_module("adapters.gym_cards")  # imports without the package
    monkeypatch.setitem(sys.modules, "gym_cards", None)
    with pytest.raises(ImportError, match="pip install -e gym-cards"):
        adapter.GymCardsEzpointsEnv("train", 0)
