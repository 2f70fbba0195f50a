"""
tests/test_environments.py: the paper's other benchmarks through the registry -- search, sokoban and ezpoints built by
envs.make_env as train.py builds them (the simulators themselves: tests/test_search.py, test_sokoban.py,
test_ezpoints.py): deterministic resets, garbage never raises, the expert wins, the observations' shapes, and a
tiny train.py run on each.

    python -m pytest -q tests/test_environments.py
"""
import json
import os
import random

import numpy as np
import pytest

import envs
import seed
import skills
import train
from test_seed import REPO, TRAIN_FLAGS, read_lines, run_train

NEW_ENVS = ("search", "sokoban", "ezpoints")
GARBAGE = ["", "x" * 10_000, "\u2603 \u4f60\u597d", "<action>up</action>", "up up up", "<search></search>",
           "<answer>", "12", "click 3", None]


def built(name, split="valid_seen", seed=0):
    cfg = train.get_config(["--env", name], check=False)  # the defaults only, not the out dir
    return envs.make_env(name, split, seed, **envs.env_options(cfg))


def record(env, actions):
    """Plays `actions` from the env's current state until done -> (seed.Trajectory, gt), as annotate reads them."""
    steps = []
    for action in actions:
        obs, reward, done, info = env.step(action)
        steps.append(seed.Step(observation=text_of(obs), response=action, action=action, valid=info["valid"],
                               reward=reward))
        if done:
            break
    outcome = sum(step.reward for step in steps)
    return seed.Trajectory(task=info["task"], won=info["won"], reward=outcome, steps=steps), info["gt"]


def assert_usable_skills(annotate, trajectory, gt, word):
    """An annotator's contract: two phrasings over rng seeds, each under 60 words, naming `word`, read back
    by skills.parse_skill unchanged; the summary says whether the episode was solved."""
    phrasings = {annotate(trajectory, gt, random.Random(rng_seed))[1] for rng_seed in range(8)}
    assert len(phrasings) == 2, phrasings
    for skill in phrasings:
        parsed = skills.parse_skill(json.dumps({"episode_skill": skill}), trajectory.task)
        assert parsed == skill and len(skill.split()) < 60 and word in skill, skill
    summary, _ = annotate(trajectory, gt, random.Random(0))
    assert ("solved" if gt["won"] else "failed") in summary


def text_of(observation):
    return observation["text"] if isinstance(observation, dict) else observation


@pytest.mark.parametrize("name", NEW_ENVS)
def test_new_env_resets_deterministically_on_every_split(name):
    for split in envs.SPLITS:
        first, second = built(name, split), built(name, split)
        for task_seed in (0, 7, 123):
            (obs_a, info_a), (obs_b, info_b) = first.reset(task_seed), second.reset(task_seed)
            assert info_a["task"] == info_b["task"] and text_of(obs_a) == text_of(obs_b), (split, task_seed)
            assert {"task", "admissible", "won", "task_type"} <= set(info_a), sorted(info_a)


@pytest.mark.parametrize("name", NEW_ENVS)
def test_new_env_survives_random_and_garbage_actions(name):
    env, rng, steps = built(name, "train"), random.Random(0), 0
    _, info = env.reset(0)
    while steps < 1000:
        admissible = info.get("admissible") or ["<search>a query</search>", "<answer>an answer</answer>"]
        action = rng.choice(GARBAGE) if rng.random() < 0.5 else rng.choice(admissible)
        _, reward, done, info = env.step(action)
        steps += 1
        assert {"task", "admissible", "won", "valid"} <= set(info) and np.isfinite(reward), info
        if done:
            assert "gt" in info and info["gt"]["env"] == name, sorted(info)
            _, info = env.reset(rng.randrange(10 ** 6))


@pytest.mark.parametrize("name", NEW_ENVS)
def test_new_env_expert_wins_through_make_env(name):
    env, wins = built(name), 0
    for task_seed in range(40):
        _, info = env.reset(task_seed)
        done = False
        while not done:
            _, _, done, info = env.step(env.expert_action())
        wins += info["won"]
    assert wins >= 38, f"{name}: the expert won {wins} of 40 valid_seen tasks"


@pytest.mark.parametrize("name", ("sokoban", "ezpoints"))
def test_vision_envs_return_an_image(name):
    observation, _ = built(name).reset(0)
    image = observation["image"]
    assert image.ndim == 3 and image.shape[2] == 3 and image.dtype == np.uint8, (image.shape, image.dtype)


@pytest.mark.parametrize("name", NEW_ENVS)
def test_train_runs_on_each_new_env_with_the_tiny_model(name, tmp_path, capsys):
    """python train.py --env NAME with the tiny model (a 2-step warm-up here; the real one is cached): the warm-up's
    demonstrations come from the env's expert, stage-1 skills from its annotator, and one SEED update runs."""
    flags = TRAIN_FLAGS + ["--warmup-steps", 2, "--cache-dir", tmp_path / "cache"]
    run_train("--env", name, *flags, "--updates", 1, "--out-dir", tmp_path / "out")
    output = capsys.readouterr().out
    assert "update 1/1 |" in output and "final evaluation" in output, output[-2000:]
    (metrics,) = read_lines(tmp_path / "out" / "metrics.jsonl")
    assert metrics["skipped"] is None and metrics["rows"] > 0, metrics


def test_the_worked_example_of_docs_environments_is_one_file_and_one_registry_entry(tmp_path, monkeypatch, capsys):
    """docs/environments.md's `echo` env, taken from the page as it stands: its module and its one EnvSpec line
    are all it needs for make_env, the tiny warm-up and a SEED update through train.py."""
    import re
    import sys
    page = open(os.path.join(REPO, "docs", "environments.md")).read()
    module, entry = re.findall(r"```python\n(.*?)```", page, re.S)[1:3]
    package = tmp_path / "example_envs"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "echo.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = eval(entry.strip().rstrip(",").replace("simulators.echo", "example_envs.echo"),
                {"EnvSpec": envs.EnvSpec})
    monkeypatch.setitem(envs.ENVS, "echo", spec)
    monkeypatch.setattr(envs, "ENV_NAMES", tuple(envs.ENVS))
    env = envs.make_env("echo", "valid_seen", 0)
    _, info = env.reset(0)
    _, reward, done, info = env.step(env.expert_action())
    assert done and info["won"] and reward == 10.0, info
    run_train("--env", "echo", *TRAIN_FLAGS, "--updates", 1, "--warmup-steps", 2, "--cache-dir", tmp_path / "cache",
              "--out-dir", tmp_path / "out")
    assert "update 1/1 |" in capsys.readouterr().out
    sys.modules.pop("example_envs.echo", None)
