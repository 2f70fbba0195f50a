"""
tests/test_sokoban.py: the Sokoban simulator (simulators/sokoban.py) against its contract -- determinism, splits,
garbage answers, gym-sokoban's rewards, the BFS solver and expert, the held-out layouts, the hindsight annotator, the
prompt -- and the gym-sokoban adapter's missing-package error.

    python -m pytest -q tests/test_sokoban.py
"""
import importlib
import random
import sys

import numpy as np
import pytest

from test_environments import assert_usable_skills, record
from simulators import sokoban
from simulators.sokoban import ACTIONS, SokobanEnv, annotate, is_held_out, solve

INFO_KEYS = {"task", "admissible", "won", "valid", "task_type"}
GARBAGE = ["", "x" * 10_000, "\u2603 \u00fcn\u00efcode \U0001f600", "None", None, "still", "<action>", "42", "north"]


def play(env, actions):
    """Steps `actions` in order; returns the (obs, reward, done, info) of each step."""
    return [env.step(action) for action in actions]


def set_level(env, rows):
    """Puts a hand-made level (verl-agent's symbols, one string per row, no spaces) into a reset env."""
    cells = {(r, c): symbol for r, row in enumerate(rows) for c, symbol in enumerate(row)}
    env.walls = frozenset(cell for cell, s in cells.items() if s == "#")
    env.targets = frozenset(cell for cell, s in cells.items() if s in "O\u221aS")
    env.boxes = frozenset(cell for cell, s in cells.items() if s in "X\u221a")
    env.player = next(cell for cell, s in cells.items() if s in "PS")
    env.solution = solve(env.walls, env.targets, env.boxes, env.player)
    env.states = [(env.player, env.boxes)]
    env.level = sokoban.grid_rows(env.walls, env.targets, env.boxes, env.player)


def test_verl_agent_projection_words_are_read_leniently():
    """The first of up, down, left, right that the lowercased answer contains, in that order; "still" is invalid."""
    cases = {"up": "up", "UP": "up", "up up": "up", "move Left": "left", "down-right": "down", "right then up": "up",
             "still": None, "": None, None: None, "west": None}
    assert {text: sokoban.parse_move(text) for text in cases} == cases


def test_rewards_follow_gym_sokoban():
    """-0.1 a step, +1 onto a target, -1 off it, +10 once every box is on a target; a blocked move is valid."""
    env = SokobanEnv("train", 0, num_boxes=2)
    env.reset(0)
    set_level(env, ["######", "#PXO_#", "#____#", "#_X__#", "#__O_#", "######"])
    (bump_obs, bump, _, bump_info), (_, onto, _, _), (_, off, done, _) = play(env, ["up", "right", "right"])
    assert bump == pytest.approx(-0.1) and bump_info["valid"] and "blocked" in bump_obs["text"]
    assert (onto, off, done) == (pytest.approx(0.9), pytest.approx(-1.1), False), (onto, off)
    env.reset(0)
    set_level(env, ["######", "#_PXO#", "#____#", "#__X_#", "#__O_#", "######"])
    (_, first, _, _), (_, walk, _, _), (_, last, done, info) = play(env, ["right", "down", "down"])
    assert (first, walk, last) == (pytest.approx(0.9), pytest.approx(-0.1), pytest.approx(10.9))
    assert done and info["won"] and info["gt"]["push_steps"] == [0, 2]


def test_noisy_expert_takes_other_actions_at_the_given_rate():
    env = SokobanEnv("train", 0)
    env.reset(3)
    best, rng = env.expert_action(), random.Random(1)
    noisy = [env.expert_action(epsilon=0.5, rng=rng, oracle=True) for _ in range(400)]
    assert 0.4 < sum(a != best for a in noisy) / 400 < 0.6 and set(noisy) <= set(ACTIONS)


def test_the_image_is_uint8_and_changes_after_a_valid_move():
    env = SokobanEnv("valid_unseen", 0)
    obs, _ = env.reset(2)
    assert obs["image"].shape == (96, 96, 3) and obs["image"].dtype == np.uint8
    after, _, _, info = env.step(env.expert_action())
    assert info["valid"] and not np.array_equal(obs["image"], after["image"])
    assert np.array_equal(env.step("nonsense")[0]["image"], after["image"])
    assert SokobanEnv(text_grid=False).reset(0)[0]["text"] == "You are in the room."


def test_the_solvers_solution_replays_to_a_win_and_is_optimal():
    env = SokobanEnv("train", 0)
    for task_seed in range(30):
        _, info = env.reset(task_seed)
        solution = list(env.solution)
        assert sokoban.MIN_SOLUTION <= len(solution) <= sokoban.MAX_SOLUTION
        assert info["task_type"] == ("sokoban-long" if len(solution) > sokoban.SHORT_SOLUTION else "sokoban-short")
        results = play(env, solution)
        assert results[-1][2] and results[-1][3]["won"] and not any(done for _, _, done, _ in results[:-1])
        assert sum(r for _, r, _, _ in results) == pytest.approx(-0.1 * len(solution) + 11)
        assert results[-1][3]["gt"]["solution"] == solution and results[-1][3]["gt"]["stuck_step"] is None
    env.reset(0)
    set_level(env, ["######", "#P_XO#", "#____#", "#____#", "#____#", "######"])
    assert env.solution == ["right", "right"]


def test_valid_unseen_layouts_never_appear_in_train():
    def patterns(split, seeds):
        env = SokobanEnv(split, 0)
        found = set()
        for task_seed in seeds:
            env.reset(task_seed)
            found.add(sokoban.wall_pattern(env.walls))
            assert is_held_out(env.walls) == (split == "valid_unseen")
        return found
    seen = patterns("train", range(300)) | patterns("valid_seen", range(100))
    unseen = patterns("valid_unseen", range(100))
    assert len(unseen) > 30 and not seen & unseen


AGAINST_THE_WALL = ["######", "#____#", "#_X__#", "#_P__#", "#___O#", "######"]  # "up" leaves the box on row 1
INTO_THE_CORNER = ["######", "#____#", "#X___#", "#P___#", "#O___#", "######"]   # "up" puts it in the corner


def test_a_stuck_box_is_reported_with_its_step():
    env = SokobanEnv("train", 0, max_steps=3)
    env.reset(0)
    set_level(env, AGAINST_THE_WALL)
    gt = play(env, ["right", "up", "up"])[-1][3]["gt"]  # walks aside: still solvable; then the same push
    assert gt["stuck_step"] is None and gt["push_steps"] == []
    env.reset(0)
    set_level(env, AGAINST_THE_WALL)
    gt = play(env, ["up", "left", "right"])[-1][3]["gt"]
    assert (gt["stuck_step"], gt["stuck_in_corner"], gt["won"]) == (0, False, False)
    env.reset(0)
    set_level(env, INTO_THE_CORNER)
    gt = play(env, ["down", "up", "up"])[-1][3]["gt"]
    assert (gt["stuck_step"], gt["stuck_in_corner"], gt["moves"]) == (2, True, ["down", "up", "up"])


def test_annotate_writes_a_usable_skill_for_a_success_and_a_failure():
    env = SokobanEnv("valid_seen", 0)
    env.reset(4)
    won = record(env, list(env.solution))
    env.reset(4)
    wasted = record(env, ["nonsense"] * 9 + ["up", "down"] * 3)
    env.reset(4)
    set_level(env, INTO_THE_CORNER)
    trapped = record(env, ["up"] + ["down"] * 14)
    for (trajectory, gt), word in ((won, "push"), (wasted, "move"), (trapped, "corner")):
        assert_usable_skills(annotate, trajectory, gt, word)
    assert "step 1" in annotate(*trapped, random.Random(0))[0]


def test_gym_sokoban_adapter_says_what_to_install(monkeypatch):
    adapter = importlib.import_module("adapters.gym_sokoban")  # imports without the package
    monkeypatch.setitem(sys.modules, "gym_sokoban", None)
    with pytest.raises(ImportError, match="pip install gym-sokoban==0.0.6"):
        adapter.GymSokobanEnv("train", 0)
