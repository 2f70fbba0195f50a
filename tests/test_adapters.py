"""
tests/test_adapters.py: the real benchmarks' adapters -- ALFWorld (adapters/alfworld.py, the engine; the
synthetic games of adapters/alfworld_games.py; train.py on them) and WebShop (adapters/webshop.py: the HTTP
client, the offline mini WebShop, the reward formula, bad servers, one SEED update on it). The real-engine tests
are skipped with a reason when alfworld is missing (.ci/run installs it). MiniWoB++ needs a browser and is
tested with the VLM in tests/test_vision.py.

    python -m pytest -q tests/test_adapters.py
"""
import importlib.util
import json
import math
import os
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoModelForCausalLM

import envs
import seed
import skills
from adapters import alfworld, webshop
from adapters import alfworld_games as game_generator  # (alfworld_games is a fixture here)
from adapters.alfworld import AlfworldEnv, EnvUnavailable
from annotators import text_worlds
from adapters.alfworld_games import generate_games
from adapters.webshop import HELD_OUT_CATEGORY, TYPE_WORDS, WebshopEnv, WebshopUnavailable, build_catalogue
from models.tiny import build_tiny_policy
from test_seed import final_weights, max_diff, numbers, read_lines, run_train


def annotate(trajectory, gt=None):
    """The text annotator's (summary, skill) as the JSON stage 1 trains on."""
    return skills.skill_json(*text_worlds.annotate(trajectory, gt))


# =============================================================================
# adapters/alfworld.py and adapters/alfworld_games.py: the real ALFWorld engine, synthetic games
# =============================================================================

HAS_ALFWORLD = importlib.util.find_spec("alfworld") is not None
needs_alfworld = pytest.mark.skipif(not HAS_ALFWORLD, reason="alfworld not installed (pip install alfworld==0.4.2)")
GARBAGE_ACTIONS = ["", "x" * 100_000, "prendre la pomme \u2603 \u4f60\u597d", "click[buy]", "<action>x</action>",
                   "go to", "take", "\n\n", "help me " * 50]


@pytest.fixture(scope="module")
def alfworld_data(tmp_path_factory):
    """Six synthetic games, one per task type, written by the generator (checked solvable there)."""
    root = tmp_path_factory.mktemp("alfworld_data")
    start = time.perf_counter()
    paths = generate_games(str(root), len(alfworld.TASK_TYPES), seed=0, split="train")
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
    assert len(paths) == len(alfworld.TASK_TYPES)
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
    assert seen_types == set(alfworld.TASK_TYPES), f"missing task types {set(alfworld.TASK_TYPES) - seen_types}"


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
    monkeypatch.setattr(game_generator, "_plan_wins", lambda engine, path: checked.append(path) or next(verdicts))
    paths = generate_games(str(tmp_path), 1, seed=0, task_types=["pick_heat_then_place_in_recep"])
    assert len(checked) == 3 and paths == checked[-1:], f"checked {checked}, kept {paths}"
    assert not any(os.path.exists(os.path.dirname(path)) for path in checked[:2]), "rejected games left on disk"
    assert os.path.exists(paths[0])


@needs_alfworld
def test_planner_wins_every_task_type_through_adapter(alfworld_data):
    root, paths = alfworld_data
    env = AlfworldEnv("train", data_dir=root, expert_plan=True)
    assert env.game_files == sorted(paths)
    for task_seed in range(len(alfworld.TASK_TYPES)):
        first_obs, first_info, rewards, info = play_plan(env, task_seed)
        gamefile = env.game_files[task_seed]
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
    assert env.reset(len(alfworld.TASK_TYPES) + 1)[0] == env.reset(1)[0], "seed % n must give the same game"


@needs_alfworld
def test_alfworld_garbage_actions_change_nothing(alfworld_data):
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


def test_missing_data_gives_one_clear_error(tmp_path):
    # Runs with or without the package: either way the message must say what to install, download and set.
    with pytest.raises(EnvUnavailable) as caught:
        AlfworldEnv("train", data_dir=str(tmp_path / "nowhere"))
    message = str(caught.value)
    for needed in ("pip install alfworld==0.4.2", "alfworld-download", "ALFWORLD_DATA"):
        assert needed in message, f"{needed!r} missing from: {message}"


# ----------------------------------------------------------------------------- train.py on ALFWorld

@pytest.fixture(scope="module")
def alfworld_games(tmp_path_factory):
    """Synthetic ALFWorld games: 2 train, 1 valid_seen, 1 valid_unseen."""
    data = tmp_path_factory.mktemp("alfworld")
    for split, n in (("train", 2), ("valid_seen", 1), ("valid_unseen", 1)):
        generate_games(str(data), n, seed=0, split=split)
    return data


@needs_alfworld
def test_train_alfworld_one_update(tiny, alfworld_games, tmp_path, capsys):
    seconds = run_train("--env", "alfworld", "--data-dir", alfworld_games, "--model", tiny[1], "--stage", "rl",
                        "--updates", 1, "--tasks-per-update", 2, "--group-size", 2, "--max-steps", 3,
                        "--max-new-tokens", 8, "--eval-tasks", 1, "--analysis-max-new-tokens", 16,
                        "--analysis-prompt-tokens", 1024,
                        "--out-dir", tmp_path / "out")
    output = capsys.readouterr().out
    (metrics,) = read_lines(tmp_path / "out" / "metrics.jsonl")
    print(f"\ntrain.py --env alfworld, one update: {seconds:.1f}s in all, the update {metrics['time']:.1f}s")
    assert "update 1/1 |" in output, output[-2000:]
    assert metrics["skipped"] is None and metrics["rows"] > 0 and metrics["parse_fail"] is not None, metrics
    assert all(math.isfinite(v) for v in numbers(metrics).values()), metrics
    evals = read_lines(tmp_path / "out" / "eval.jsonl")
    assert {e["split"] for e in evals} == {"valid_seen", "valid_unseen"} and len(evals) == 4, evals
    assert all(e["per_type"] and set(e["per_type"]) <= set(alfworld.TASK_TYPES) for e in evals), evals
    final_weights(str(tmp_path / "out"))  # loadable


@needs_alfworld
def test_train_alfworld_default_tiny_on_generated_games(tmp_path, capsys, monkeypatch):
    """`train.py --env alfworld` as typed: no data (synthetic games are generated and the log says so) and
    --model tiny, whose warm-up demonstrations the engine's planner plays on those games."""
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    seconds = run_train("--env", "alfworld", "--warmup-steps", 2, "--updates", 1, "--tasks-per-update", 2,
                        "--group-size", 2, "--max-steps", 2, "--max-new-tokens", 8, "--eval-tasks", 1,
                        "--analysis-max-new-tokens", 8, "--cache-dir", tmp_path / "cache",
                        "--out-dir", tmp_path / "out")
    output = capsys.readouterr().out
    print(f"\ntrain.py --env alfworld --model tiny, synthetic games: {seconds:.1f}s")
    assert "generating synthetic games" in output and "tiny-alfworld-" in output, output[-3000:]
    assert os.path.isdir(tmp_path / "out" / "alfworld_synthetic" / "json_2.1.1" / "valid_unseen")
    (metrics,) = read_lines(tmp_path / "out" / "metrics.jsonl")
    assert metrics["skipped"] is None and all(math.isfinite(v) for v in numbers(metrics).values()), metrics


@needs_alfworld
def test_stage1_sft_on_alfworld(tiny, alfworld_games, tmp_path, capsys):
    """--stage sft for a (local) HF model on --env alfworld: analyzer SFT, saved as a loadable folder."""
    run_train("--env", "alfworld", "--data-dir", alfworld_games, "--model", tiny[1], "--stage", "sft",
              "--sft-tasks", 2, "--sft-rollouts", 2, "--tasks-per-update", 2, "--sft-epochs", 1, "--max-steps", 3,
              "--max-new-tokens", 8, "--analysis-prompt-tokens", 1024, "--analysis-max-new-tokens", 16,
              "--sft-batch-size", 2, "--sft-lr", 1e-3, "--out-dir", tmp_path / "out")
    output = capsys.readouterr().out
    assert "stage 1 done" in output and "stage 1: 4 trajectories collected, 4 kept, 0 dropped" in output, output
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out" / "sft"))
    moved = max(max_diff(a, b) for a, b in zip(tiny[0].model.parameters(), trained.parameters()))
    assert moved > 1e-5, f"stage 1 left the weights unchanged (max change {moved})"


# =============================================================================
# adapters/webshop.py: the WebShop client and the offline mini WebShop
# =============================================================================

WEBSHOP_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1)
WEBSHOP_SKILL = "Search the product kind with its attributes, open a result whose title names them, pick the options."


@pytest.fixture(scope="module")
def mini_shop():
    return webshop.mini_server()


def token_set(text):
    return set(str(text).lower().replace(",", " ").replace("-", " ").split())


def play_webshop_expert(env, task_seed, epsilon=0.0, rng=None, oracle=False):
    """Expert episode from reset; returns (actions, rewards, last info). Every action must be admissible."""
    obs, info = env.reset(task_seed)
    actions, rewards, done = [], [], False
    while not done:
        action = env.expert_action(epsilon, rng, oracle=oracle)
        assert action in info["admissible"] or action.startswith("search["), (task_seed, action, info["admissible"])
        obs, reward, done, info = env.step(action)
        actions.append(action)
        rewards.append(reward)
    return actions, rewards, info


def buy_on_webshop(env, task_seed, product, options):
    """Search the product's title, open it, choose `options` (value list), buy; returns the last info."""
    env.reset(task_seed)
    _, _, _, info = env.step(f"search[{product['Title']}]")
    assert f"click[{product['asin'].lower()}]" in info["admissible"], f"{product['asin']} not on the first page"
    for action in [f"click[{product['asin'].lower()}]"] + [f"click[{v}]" for v in options] + ["click[buy now]"]:
        _, reward, done, info = env.step(action)
        assert info["valid"], f"{action} was refused: {info['admissible']}"
    assert done and info["gt"]["purchased"]["asin"] == product["asin"]
    return reward, info


# ----------------------------------------------------------------------------- the catalogue and the splits

def test_catalogue_is_deterministic_and_in_webshop_schema(mini_shop):
    catalogue = webshop.mini_catalogue()
    products, goals = catalogue["products"], catalogue["goals"]
    assert json.dumps(build_catalogue()) == json.dumps(catalogue), "the catalogue must not depend on the process"
    assert json.dumps(build_catalogue(seed=1)) != json.dumps(catalogue)
    assert len(products) == 300 and len(goals) == 1500, (len(products), len(goals))
    assert {p["category"] for p in products} == {"beauty", "fashion", "electronics", "food", "furniture"}
    product_keys = {"asin", "category", "query", "name", "product_category", "Title", "Description", "BulletPoints",
                    "Price", "pricing", "options", "Attributes", "Reviews", "Rating"}
    goal_keys = {"asin", "category", "query", "name", "product_category", "instruction_text", "attributes",
                 "price_upper", "goal_options", "weight"}
    assert all(product_keys <= set(p) for p in products) and all(goal_keys <= set(g) for g in goals)
    for p in products:  # a title's product-kind words come from its kind only (they stand in for its nouns)
        clash = {w for a in p["Attributes"] for w in webshop._words(a)} & TYPE_WORDS
        assert not clash, f"{p['asin']}: attribute words {clash} are product-kind words"
    by_asin = {p["asin"]: p for p in products}
    for index, goal in enumerate(goals):  # every goal is achievable: its own product scores 1.0
        product = by_asin[goal["asin"]]
        assert goal["instruction_text"].endswith(f"price lower than {goal['price_upper']:.2f} dollars")
        score, _ = webshop.score_purchase(product, goal, product["pricing"][0], goal["goal_options"])
        assert score == 1.0, f"goal {index}: its own product scores {score}"


def test_splits_follow_the_documented_rule(mini_shop):
    ids = {split: WebshopEnv(split, 0).goal_ids for split in webshop.SPLITS}
    category = [goal["category"] for goal in mini_shop.goals]
    assert all(i >= 500 and category[i] != HELD_OUT_CATEGORY for i in ids["train"])
    assert all(i < 500 and category[i] != HELD_OUT_CATEGORY for i in ids["valid_seen"])
    assert all(i < 500 and category[i] == HELD_OUT_CATEGORY for i in ids["valid_unseen"])
    assert len(ids["valid_seen"]) + len(ids["valid_unseen"]) == 500, {k: len(v) for k, v in ids.items()}
    assert len(ids["train"]) == sum(category[i] != HELD_OUT_CATEGORY for i in range(500, len(category)))
    env = WebshopEnv("valid_unseen", 0)
    types = {env.reset(s)[1]["task_type"] for s in range(20)}
    assert types == {HELD_OUT_CATEGORY}, types
    first, second = WebshopEnv("train", 1), WebshopEnv("train", 2)
    assert first.reset(42)[1]["task"] == second.reset(42)[1]["task"], "same seed, different task"


# ----------------------------------------------------------------------------- the client against the loopback server

def test_client_search_paginate_item_options_buy(mini_shop):
    env = WebshopEnv("valid_seen", 0, max_steps=30)
    obs, info = env.reset(7)
    goal = mini_shop.goals[env.goal_ids[7]]
    assert obs == "'Search'" and info["task"] == goal["instruction_text"] and info["task_type"] == goal["category"]
    assert info["admissible"] == ["search[<your query>]"] and info["valid"] and not info["won"]
    expected = [p["asin"] for p in mini_shop.search(goal["query"])]
    assert len(expected) > 10, "the query should give more than one page"
    obs, reward, done, info = env.step(f"search[{goal['query']}]")
    assert obs.startswith(f"'Back to Search' [SEP] 'Page 1 (Total results: {len(expected)})' [SEP] 'Next >'"), obs
    clicks = [a for a in info["admissible"] if a.startswith("click[b0")]
    assert clicks == [f"click[{asin.lower()}]" for asin in expected[:10]], clicks
    assert "search[<your query>]" not in info["admissible"] and "click[< prev]" not in info["admissible"]
    obs, _, _, info = env.step("click[Next >]")  # case and spacing do not matter, as upstream lowercases
    assert info["valid"] and "'Page 2 (Total results:" in obs and "click[< prev]" in info["admissible"]
    page_two = [a for a in info["admissible"] if a.startswith("click[b0")]
    assert page_two == [f"click[{asin.lower()}]" for asin in expected[10:20]], page_two
    obs, _, _, info = env.step("click[< prev]")
    assert "'Page 1 (Total results:" in obs and clicks[0] in info["admissible"]
    product = mini_shop.products[expected[0]]
    obs, _, _, info = env.step(clicks[0])
    assert f"'{product['Title']}' [SEP] 'Price: {product['Price']}'" in obs, obs
    values = [v for values in product["options"].values() for v in values]
    assert [a for a in info["admissible"] if a[6:-1] in values] == [f"click[{v}]" for v in values]
    assert {"click[description]", "click[features]", "click[reviews]", "click[buy now]"} <= set(info["admissible"])
    obs, _, _, info = env.step("click[features]")
    assert all(f"'{bullet}'" in obs for bullet in product["BulletPoints"]), obs
    obs, _, _, info = env.step("click[< prev]")
    assert "click[buy now]" in info["admissible"]
    chosen = {name: values[-1] for name, values in product["options"].items()}
    for value in chosen.values():
        _, _, done, info = env.step(f"click[{value}]")
        assert info["valid"] and not done and env.state["options"][env.page["option_names"][value]] == value
    obs, reward, done, info = env.step("click[buy now]")
    score, _ = webshop.score_purchase(product, goal, product["pricing"][0], chosen)
    assert done and obs == f"Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] {score}", obs
    assert info["admissible"] == []
    assert abs(info["score"] - score) < 1e-9, (info["score"], score)
    assert reward == (10.0 if score == 1.0 else 0.0) and info["won"] == (score == 1.0)
    gt = info["gt"]
    assert gt["purchased"]["options"] == chosen and gt["purchased"]["title"] == product["Title"]
    assert gt["goal"]["attributes"] == goal["attributes"] and gt["invalid_steps"] == []
    assert gt["steps"] == 7 + len(chosen), gt["steps"]
    assert gt["searches"] == [goal["query"]] and gt["visited"] == [expected[0]], (gt["searches"], gt["visited"])
    assert env.step("click[buy now]")[1:3] == (0.0, True), "nothing happens after the end"


def test_expert_reaches_score_one_on_every_split(mini_shop):
    for split in webshop.SPLITS:
        env = WebshopEnv(split, 0)
        for task_seed in range(15):
            actions, rewards, info = play_webshop_expert(env, task_seed)
            assert info["won"] and info["score"] == 1.0, (split, task_seed, actions, info["gt"]["mistakes"])
            assert rewards[-1] == 10.0 and sum(rewards) == 10.0 and len(actions) <= 8, (rewards, actions)
            assert info["gt"]["mistakes"] == [] and actions[-1] == "click[buy now]"
        assert play_webshop_expert(env, 3, oracle=True)[2]["won"], "the oracle expert must win too"


def test_client_reads_a_server_at_a_url_like_the_upstream_app(mini_shop, monkeypatch):
    """With WEBSHOP_URL the env is a plain HTTP client: the goal is known only from the done page."""
    monkeypatch.setenv("WEBSHOP_URL", mini_shop.url)
    env = envs.make_env("webshop", "valid_unseen", 0)
    assert env.shop is None and list(env.goal_ids) == list(range(250, 500))
    for task_seed in range(5):
        actions, rewards, info = play_webshop_expert(env, task_seed)
        goal = mini_shop.goals[250 + task_seed]
        assert info["task_type"] == "webshop" and info["won"] and rewards[-1] == 10.0, (actions, info["gt"])
        assert info["gt"]["goal"] == {"query": goal["query"], "category": goal["category"],
                                      "attributes": goal["attributes"], "options": goal["goal_options"],
                                      "price_upper": goal["price_upper"]}, info["gt"]["goal"]


# ----------------------------------------------------------------------------- the reward formula

def test_score_purchase_follows_upstream_rules_on_hand_made_data():
    goal = {"query": "hoodie", "name": "Kestrel Hoodie - Fleece Lined", "product_category": "A › B › Hoodies",
            "attributes": ["fleece lined", "machine wash", "cotton"], "price_upper": 40.0,
            "goal_options": {"size": "large", "color": "navy blue"}}
    product = {"query": "hoodie", "name": "Lumora Hoodie", "Title": "Lumora Hoodie", "product_category": "A › C",
               "Attributes": ["fleece lined hood"],  # token superset of "fleece lined": fuzzy match
               "BulletPoints": ["Machine wash cold."], "Description": "Soft fabric."}  # "machine wash" by substring
    score, info = webshop.score_purchase(product, goal, 39.99, {"size": "x-large", "color": "blue"})
    # attributes 2 of 3 (no cotton); options: size is exact (x-large misses), color fuzzy ("blue" in "navy blue")
    assert abs(score - (2 + 1 + 1) / 6) < 1e-12 and info["attributes_matched"] == ["fleece lined", "machine wash"]
    assert info["options_matched"] == ["blue"] and info["r_type"] == 1.0 and info["query_match"], info
    score, info = webshop.score_purchase(product, goal, 40.01, {"size": "large", "color": "navy blue"})
    assert abs(score - (2 + 2 + 0) / 6) < 1e-12 and info["r_price"] is False, (score, info)
    chair = dict(product, query="office chair", name="Lumora Office Chair", Title="Lumora Office Chair")
    score, info = webshop.score_purchase(chair, goal, 10.0, {})
    assert score == 0.0 and info["title_score"] == 0.0 and info["r_type"] == 0.0, info  # no kind word shared
    hooded = dict(chair, name="Lumora Office Chair Hoodie")  # the goal's one kind word: title score 1, type kept
    assert webshop.score_purchase(hooded, goal, 10.0, {})[1]["r_type"] == 1.0


def test_wrong_purchases_score_what_the_formula_says(mini_shop):
    env = WebshopEnv("train", 0, max_steps=30)
    goals = [(s, mini_shop.goals[i]) for s, i in enumerate(env.goal_ids)]
    products = list(mini_shop.products.values())

    def one_attribute_missing(goal, p):
        text = " ".join([p["Title"], p["Description"], *p["BulletPoints"]]).lower()
        missing = [a for a in goal["attributes"] if a not in p["Attributes"]]
        return len(missing) == 1 and missing[0] not in text and not any(
            token_set(missing[0]) <= token_set(a) or token_set(a) <= token_set(missing[0]) for a in p["Attributes"])

    cases = 0
    for task_seed, goal in goals:  # one attribute missing and one wrong option, within the price limit
        names = list(goal["goal_options"])
        for p in products:
            if p["query"] != goal["query"] or p["pricing"][0] > goal["price_upper"] or len(goal["attributes"]) < 2 \
                    or not one_attribute_missing(goal, p) or any(goal["goal_options"][n] not in p["options"][n]
                                                                 for n in names):
                continue
            wrong = [v for v in p["options"][names[0]] if v != goal["goal_options"][names[0]]
                     and not token_set(v) & token_set(goal["goal_options"][names[0]])
                     and v not in p["Description"].lower()]
            if not wrong:
                continue
            options = [wrong[0]] + [goal["goal_options"][n] for n in names[1:]]
            reward, info = buy_on_webshop(env, task_seed, p, options)
            n_attributes, n_options = len(goal["attributes"]), len(names)
            expected = (n_attributes - 1 + n_options - 1 + 1) / (n_attributes + n_options + 1)
            assert abs(info["score"] - expected) < 1e-9, f"score {info['score']} vs formula {expected} for {p['asin']}"
            assert reward == 0.0 and not info["won"]
            mistakes = info["gt"]["mistakes"]
            assert len(mistakes) == 2 and mistakes[0].startswith("missing attribute") and wrong[0] in mistakes[1]
            cases += 1
            break
        if cases == 3:
            break
    assert cases == 3, f"only {cases} cases found"
    for task_seed, goal in goals:  # everything right but the price
        over = [p for p in products if p["query"] == goal["query"] and p["pricing"][0] > goal["price_upper"]
                and set(goal["attributes"]) <= set(p["Attributes"])
                and all(v in p["options"][n] for n, v in goal["goal_options"].items())]
        if over:
            _, info = buy_on_webshop(env, task_seed, over[0], list(goal["goal_options"].values()))
            total = len(goal["attributes"]) + len(goal["goal_options"]) + 1
            assert abs(info["score"] - (total - 1) / total) < 1e-9, (info["score"], (total - 1) / total)
            assert info["gt"]["mistakes"] == [f"price ${over[0]['pricing'][0]} above the "
                                              f"${goal['price_upper']:.2f} limit"], info["gt"]["mistakes"]
            break
    else:
        pytest.fail("no over-price product found")
    task_seed, goal = goals[0]  # another kind of product: no kind word in common, type reward 0
    other = next(p for p in products if not token_set(p["query"]) & token_set(goal["query"]))
    _, info = buy_on_webshop(env, task_seed, other, [])
    assert info["score"] == 0.0 and info["gt"]["reward_info"]["r_type"] == 0.0
    assert info["gt"]["mistakes"][0] == f"wrong product type: bought {other['query']}"


# ----------------------------------------------------------------------------- garbage actions and bad servers

def test_garbage_actions_are_no_op_steps(mini_shop):
    env = WebshopEnv("train", 0, max_steps=100)
    obs, info = env.reset(1)
    garbage = ["", "search[]", "click[search]", "click[buy now]", "click[< prev]", "click[next >]", "x" * 100_000,
               "search[" + "a" * 400 + "]", "\u2603 click[\u4f60\u597d]", "<action>search[x]</action>", None, 42,
               "click[b000000000]", "Search [shoes]", "click[]]", "\n\n"]
    for action in garbage:
        after, reward, done, info = env.step(action)
        assert after == obs and reward == 0.0 and not done and not info["valid"], repr(action)[:60]
    _, _, _, info = env.step("search[[1, 2] / shoes]")  # brackets and '/' are cleaned out of the query
    assert info["valid"] and env.state["keywords"] == "1, 2 shoes", env.state
    results = env._observation()
    for action in ["search[shoes]", "click[description]", "click[buy now]", "click[black]", "click[b0]"]:
        after, _, _, info = env.step(action)
        assert after == results and not info["valid"], action
    assert env.invalid_steps == list(range(len(garbage))) + list(range(len(garbage) + 1, len(garbage) + 6))


def closed_local_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_server_down_gives_one_clear_error_quickly():
    url = f"http://127.0.0.1:{closed_local_port()}"
    start = time.perf_counter()
    with pytest.raises(WebshopUnavailable) as raised:
        envs.make_env("webshop", "train", 0, url=url, retries=2)
    elapsed = time.perf_counter() - start
    assert isinstance(raised.value, RuntimeError) and url in str(raised.value) and "3 tries" in str(raised.value)
    assert elapsed < 2.0, f"took {elapsed:.2f}s"


class ScriptedWebshopHandler(BaseHTTPRequestHandler):
    """Answers with server.answer(path, count) -> (status, body, delay seconds)."""

    def do_GET(self):
        with self.server.lock:
            self.server.count += 1
            count = self.server.count
        status, body, delay = self.server.answer(self.path, count)
        time.sleep(delay)
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted_server():
    servers = []

    def start(answer):
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedWebshopHandler)
        httpd.daemon_threads, httpd.answer, httpd.count, httpd.lock = True, answer, 0, threading.Lock()
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def test_slow_failing_and_garbage_servers(mini_shop, scripted_server):
    slow, url = scripted_server(lambda path, count: (200, mini_shop.render(path), 1.0))
    start = time.perf_counter()
    with pytest.raises(WebshopUnavailable, match="timed out"):
        WebshopEnv("train", 0, url=url, timeout=0.2, retries=1)
    assert time.perf_counter() - start < 1.5 and slow.count == 2, slow.count
    garbage, url = scripted_server(lambda path, count: (200, "<html><body>{'not': 'a shop'}</body></html>", 0.0))
    with pytest.raises(WebshopUnavailable, match="not a WebShop page"):
        WebshopEnv("train", 0, url=url, retries=2)
    assert garbage.count == 3
    missing, url = scripted_server(lambda path, count: (404, "no", 0.0))
    with pytest.raises(WebshopUnavailable, match="HTTP 404"):
        WebshopEnv("train", 0, url=url, retries=5)
    assert missing.count == 1, "a 4xx answer is not retried"
    # fails twice on every third request, then answers: retries hide it from the episode
    answer = lambda path, count: (503, "busy", 0.0) if count % 3 else (200, mini_shop.render(path), 0.0)
    flaky, url = scripted_server(answer)
    env = WebshopEnv("valid_seen", 0, url=url, retries=2)
    actions, rewards, info = play_webshop_expert(env, 0)
    assert info["won"] and flaky.count == 3 * (len(actions) + 2), (flaky.count, len(actions))
    answer = lambda path, count: (200, mini_shop.render(path), 0.0) if count <= 2 else (500, "", 0.0)
    broken, url = scripted_server(answer)
    env = WebshopEnv("valid_seen", 0, url=url, retries=1)
    env.reset(0)
    with pytest.raises(WebshopUnavailable, match="HTTP 500"):  # mid-episode: the same clear error, no other one
        env.step("search[shampoo]")
    assert env.steps == 0 and env.state["route"] == "index", "a failed step must not change the episode"


def test_default_env_starts_the_mini_server_once_and_says_so(monkeypatch, capsys):
    monkeypatch.delenv("WEBSHOP_URL", raising=False)
    monkeypatch.setattr(webshop, "_MINI", None)
    first, second = envs.make_env("webshop", "train", 0), envs.make_env("webshop", "valid_seen", 1)
    try:
        message = capsys.readouterr().err
        assert message.count("offline mini WebShop") == 1 and first.shop is second.shop, message
        assert first.url == first.shop.url.rstrip("/") and first.url.startswith("http://127.0.0.1:")
    finally:
        first.shop.close()


# ----------------------------------------------------------------------------- the annotator and one SEED update

def webshop_expert_trajectory(env, task_seed, epsilon, rng):
    obs, info = env.reset(task_seed)
    trajectory = seed.Trajectory(task=info["task"], task_type=info["task_type"])
    done = False
    while not done:
        action = env.expert_action(epsilon, rng)
        response = f"<think>mini_shop for the goal</think><action>{action}</action>"
        prompt = skills.render_prompt(webshop.PROMPT, info["task"], [(s.observation, s.action) for s in trajectory.steps],
                                    obs, info["admissible"], 3)
        before = obs
        obs, reward, done, info = env.step(action)
        trajectory.steps.append(seed.Step(observation=before, action=action, response=response, reward=reward,
                                          valid=info["valid"], prompt=prompt))
        trajectory.reward += reward
    trajectory.won, trajectory.gt = info["won"], info["gt"]
    return trajectory


def test_annotator_and_analyzer_take_webshop_trajectories(mini_shop):
    env, rng = WebshopEnv("train", 0, max_steps=6), random.Random(0)
    epsilons = [0.0, 0.0, 0.7, 0.7, 1.0]
    trajectories = [webshop_expert_trajectory(env, s, epsilon, rng) for s, epsilon in enumerate(epsilons)]
    assert any(t.won for t in trajectories) and not all(t.won for t in trajectories)
    for t in trajectories:
        gt = t.gt
        assert {"env", "task_type", "task", "won", "steps", "max_steps", "invalid_steps", "goal_object", "goal",
                "purchased", "score", "mistakes"} <= set(gt), sorted(gt)
        assert gt["won"] == t.won and (gt["mistakes"] == []) == t.won, gt["mistakes"]
        completion = json.loads(annotate(t, gt))
        assert set(completion) == {"episode_summary", "episode_skill"} and t.task in completion["episode_summary"]
        prompt = skills.analyzer_prompt(t)
        assert prompt.count("Step ") >= len(t.steps) and t.task in prompt
    teacher = skills.with_skill(trajectories[0].steps[0].prompt, WEBSHOP_SKILL)
    first = webshop.PROMPT["first"]  # verl-agent's WebShop template
    first_step = first[:first.index("{task}.") + len("{task}.")]
    assert teacher.startswith(first_step.format(task=trajectories[0].task) + "\n\n" + skills.SKILL_HEADER), teacher[:300]


def test_one_seed_update_on_the_mini_webshop(mini_shop, tmp_path):
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small gains nothing from more threads on a shared CPU
    try:
        demo_env, rng = WebshopEnv("train", 0), random.Random(0)
        demos = [webshop_expert_trajectory(demo_env, s, 0.3, rng) for s in range(6)]
        corpus = [s.prompt + s.response for t in demos for s in t.steps]
        corpus += [skills.analyzer_prompt(t) + annotate(t) for t in demos]
        policy = build_tiny_policy(corpus, str(tmp_path), seed=0, **WEBSHOP_TINY)
        start = time.perf_counter()
        train_envs = [envs.make_env("webshop", "train", i, max_steps=4) for i in range(4)]
        trajectories = seed.rollout(policy, train_envs, [5, 6], group_size=2, max_steps=4, template=webshop.PROMPT,
                                    max_new_tokens=12, generator=torch.Generator().manual_seed(0))
        assert [t.group for t in trajectories] == [0, 0, 1, 1]
        assert all(t.gt is not None and 1 <= len(t.steps) <= 4 for t in trajectories)
        header = webshop.PROMPT["first"][:webshop.PROMPT["first"].index("environment.")]
        assert all(s.prompt.startswith(header) for t in trajectories for s in t.steps)
        parsed, texts = seed.analyze(policy, trajectories, max_new_tokens=16)
        assert len(parsed) == len(texts) == 4
        skill_list = [p or WEBSHOP_SKILL for p in parsed]  # a random model parses none: a fixed skill tests the teacher
        rows = seed.step_rows(trajectories, skill_list)
        old, teacher, ref, has_teacher = seed.rescore(policy, rows)
        advantages = seed.step_advantages(trajectories, rows, stats="trajectories")  # (B,)
        before = [p.detach().clone() for p in policy.model.parameters()]
        optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-3, weight_decay=0.0)
        metrics, skipped = seed.policy_update(policy, optimizer, rows.prompts, rows.responses, advantages, old,
                                              teacher, ref, has_teacher)
        elapsed = time.perf_counter() - start
        print(f"\none SEED update on the mini WebShop (2 tasks x 2, 4 steps): {elapsed:.2f}s, "
              f"{len(rows.prompts)} rows")
        assert skipped is None and all(math.isfinite(v) for v in metrics.values()), (skipped, metrics)
        assert bool(has_teacher.all()) and old.shape == teacher.shape, (has_teacher, old.shape, teacher.shape)
        change = max((b - p.detach()).abs().max().item() for b, p in zip(before, policy.model.parameters()))
        assert change > 0, "the update changed no weight"
        for t in trajectories:  # the annotator reads these trajectories' gt without failing
            assert json.loads(annotate(t))["episode_skill"]
    finally:
        torch.set_num_threads(threads)
