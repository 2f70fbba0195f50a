import importlib.util
import json
import os
import time

import pytest

import envs_alfworld
from envs_alfworld import (TASK_TYPES, AlfworldEnv, EnvUnavailable, ProcessAlfworldEnv, generate_games, reset_many,
                           step_many)

HAS_ALFWORLD = importlib.util.find_spec("alfworld") is not None
needs_alfworld = pytest.mark.skipif(not HAS_ALFWORLD, reason="alfworld not installed (pip install alfworld==0.4.2)")
GARBAGE_ACTIONS = ["", "x" * 100_000, "prendre la pomme \u2603 \u4f60\u597d", "click[buy]", "<action>x</action>",
                   "go to", "take", "\n\n", "help me " * 50]


@pytest.fixture(scope="module")
def alfworld_data(tmp_path_factory):
    """Six synthetic games, one per task type, written by the generator (checked solvable there)."""
    root = tmp_path_factory.mktemp("alfworld_data")
    start = time.perf_counter()
    paths = generate_games(str(root), len(TASK_TYPES), seed=0, split="train")
    print(f"\ngenerated {len(paths)} games in {time.perf_counter() - start:.2f}s")
    return str(root), paths


def play_plan(env, seed):
    """Plays the planner's plan from reset; returns (first observation, first info, rewards, last info)."""
    first_obs, first_info = env.reset(seed)
    rewards, info = [], first_info
    for command in first_info["expert_plan"]:
        assert command in info["admissible"], f"seed {seed}: planner command {command!r} not admissible"
        _, reward, done, info = env.step(command)
        rewards.append(reward)
    return first_obs, first_info, rewards, info


@needs_alfworld
def test_generator_writes_alfworld_format(alfworld_data):
    root, paths = alfworld_data
    assert len(paths) == len(TASK_TYPES)
    seen_types = set()
    for path in paths:
        trial_dir = os.path.dirname(path)
        task_dir = os.path.basename(os.path.dirname(trial_dir))
        assert os.path.relpath(path, root).startswith(os.path.join("json_2.1.1", "train")), path
        assert os.path.basename(trial_dir).startswith("trial_T2019"), trial_dir
        task_type, obj, mrecep, target, scene = task_dir.split("-")
        with open(path) as handle:
            game = json.load(handle)
        with open(os.path.join(trial_dir, "traj_data.json")) as handle:
            traj = json.load(handle)
        assert set(game) == {"pddl_domain", "grammar", "pddl_problem", "solvable"} and game["solvable"] is True
        assert "UNKNOWN GOAL" not in game["grammar"], "the task sentence was not filled into the grammar"
        assert traj["task_type"] == task_type and traj["pddl_params"]["object_target"] == obj and mrecep == "None"
        assert target in (traj["pddl_params"]["parent_target"], traj["pddl_params"]["toggle_target"])
        assert "_bar_" in game["pddl_problem"] and f"{obj}_bar_" in game["pddl_problem"], "ALFRED-style ids expected"
        assert int(scene) not in (10, 219, 308, 424), f"train game in an unseen scene {scene}"
        seen_types.add(task_type)
    assert seen_types == set(TASK_TYPES), f"missing task types {set(TASK_TYPES) - seen_types}"


@needs_alfworld
def test_generation_is_deterministic(tmp_path):
    first = generate_games(str(tmp_path / "a"), 2, seed=3, split="valid_unseen")
    second = generate_games(str(tmp_path / "b"), 2, seed=3, split="valid_unseen")
    for path_a, path_b in zip(first, second):
        assert os.path.relpath(path_a, tmp_path / "a") == os.path.relpath(path_b, tmp_path / "b")
        with open(path_a) as handle_a, open(path_b) as handle_b:
            assert json.load(handle_a) == json.load(handle_b), f"{path_a} and {path_b} differ"
        scene = int(os.path.basename(os.path.dirname(os.path.dirname(path_a))).split("-")[-1])
        assert scene in (10, 219, 308, 424), f"valid_unseen game in a seen scene {scene}"


@needs_alfworld
def test_unsolvable_games_are_regenerated(tmp_path, monkeypatch):
    verdicts = iter([False, False, True])  # the engine check rejects the first two candidates
    checked = []
    monkeypatch.setattr(envs_alfworld, "_plan_wins", lambda engine, path: checked.append(path) or next(verdicts))
    paths = generate_games(str(tmp_path), 1, seed=0, task_types=["pick_heat_then_place_in_recep"])
    assert len(checked) == 3 and paths == checked[-1:], f"checked {checked}, kept {paths}"
    assert not any(os.path.exists(os.path.dirname(path)) for path in checked[:2]), "rejected games left on disk"
    assert os.path.exists(paths[0])


@needs_alfworld
def test_planner_wins_every_task_type_through_adapter(alfworld_data):
    root, paths = alfworld_data
    env = AlfworldEnv("train", data_dir=root, expert_plan=True)
    assert env.game_files == sorted(paths)
    for seed in range(len(TASK_TYPES)):
        first_obs, first_info, rewards, info = play_plan(env, seed)
        gamefile = env.game_files[seed]
        assert first_obs.startswith("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room.")
        assert f"Your task is to: {first_info['task']}" in first_obs and first_info["task"].endswith(".")
        assert first_info["task_type"] == os.path.basename(os.path.dirname(os.path.dirname(gamefile))).split("-")[0]
        assert "help" not in first_info["admissible"] and first_info["won"] is False
        assert rewards and rewards[-1] == 10.0 and sum(rewards) == 10.0, f"{first_info['task_type']}: rewards {rewards}"
        assert info["won"] is True and info["valid"] is True
        gt = info["gt"]
        assert gt["env"] == "alfworld" and gt["won"] is True and gt["steps"] == len(rewards)
        assert gt["invalid_steps"] == [] and gt["task_type"] == first_info["task_type"] and gt["gamefile"] == gamefile
        assert set(gt["pddl_params"]) == {"object_target", "parent_target", "toggle_target", "mrecep_target",
                                          "object_sliced"}
    assert env.reset(len(TASK_TYPES) + 1)[0] == env.reset(1)[0], "seed % n must give the same game"


@needs_alfworld
def test_garbage_actions_change_nothing(alfworld_data):
    root, _ = alfworld_data
    env = AlfworldEnv("train", data_dir=root, max_steps=30, expert_plan=True)
    obs, info = env.reset(4)
    plan, admissible = list(info["expert_plan"]), list(info["admissible"])
    for index, action in enumerate(GARBAGE_ACTIONS + [None, 42]):
        obs, reward, done, info = env.step(action)
        assert obs == "Nothing happens." and info["valid"] is False, f"{str(action)[:30]!r} -> {obs[:80]!r}"
        assert reward == 0.0 and not done and not info["won"]
        assert info["admissible"] == admissible and info["expert_plan"] == plan, "garbage changed the game state"
    while not done:
        obs, reward, done, info = env.step(env.expert_action())
    assert info["won"] and reward == 10.0
    assert info["gt"]["invalid_steps"] == list(range(len(GARBAGE_ACTIONS) + 2))
    assert env.step("look")[1:3] == (0.0, True), "after the end the env stays done"


@needs_alfworld
def test_max_steps_ends_episode(alfworld_data):
    root, _ = alfworld_data
    env = AlfworldEnv("train", data_dir=root, max_steps=3)
    env.reset(0)
    results = [env.step("inventory") for _ in range(3)]
    assert [done for _, _, done, _ in results] == [False, False, True]
    gt = results[-1][3]["gt"]
    assert gt["won"] is False and gt["steps"] == 3 and gt["max_steps"] == 3 and gt["invalid_steps"] == []


@needs_alfworld
def test_process_envs_match_in_process_envs(alfworld_data):
    root, _ = alfworld_data
    local = [AlfworldEnv("train", data_dir=root) for _ in range(2)]
    remote = [ProcessAlfworldEnv("train", data_dir=root) for _ in range(2)]
    try:
        local_first, remote_first = reset_many(local, [1, 2]), reset_many(remote, [1, 2])
        assert local_first == remote_first
        actions = [first[1]["admissible"][0] for first in local_first]
        assert step_many(local, actions) == step_many(remote, actions)
    finally:
        for env in remote:
            env.close()


def test_missing_data_gives_one_clear_error(tmp_path):
    # Runs with or without the package: either way the message must say what to install, download and set.
    with pytest.raises(EnvUnavailable) as caught:
        AlfworldEnv("train", data_dir=str(tmp_path / "nowhere"))
    message = str(caught.value)
    for needed in ("pip install alfworld==0.4.2", "alfworld-download", "ALFWORLD_DATA"):
        assert needed in message, f"{needed!r} missing from: {message}"
