"""Tests of the WebShop client and the offline mini WebShop (envs_webshop.py): the catalogue, the client against the
loopback server (search, paginate, open an item, sub pages, choose options, buy), the expert, the reward formula,
garbage actions, a server that is down, slow, failing or answering garbage, and one SEED update with a tiny model.
Network only on 127.0.0.1. Run: python -m pytest -q --durations=0 test_webshop_part.py"""
import json
import math
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import envs
import envs_webshop
import seed
import skills
from envs_webshop import HELD_OUT_CATEGORY, SPLITS, TYPE_WORDS, WebshopEnv, WebshopUnavailable, build_catalogue

WEBSHOP_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1)
WEBSHOP_SKILL = "Search the product kind with its attributes, open a result whose title names them, pick the options."


@pytest.fixture(scope="module")
def mini_shop():
    return envs_webshop.mini_server()


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
    catalogue = envs_webshop.mini_catalogue()
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
        clash = {w for a in p["Attributes"] for w in envs_webshop._words(a)} & TYPE_WORDS
        assert not clash, f"{p['asin']}: attribute words {clash} are product-kind words"
    by_asin = {p["asin"]: p for p in products}
    for index, goal in enumerate(goals):  # every goal is achievable: its own product scores 1.0
        product = by_asin[goal["asin"]]
        assert goal["instruction_text"].endswith(f"price lower than {goal['price_upper']:.2f} dollars")
        score, _ = envs_webshop.score_purchase(product, goal, product["pricing"][0], goal["goal_options"])
        assert score == 1.0, f"goal {index}: its own product scores {score}"


def test_splits_follow_the_documented_rule(mini_shop):
    ids = {split: WebshopEnv(split, 0).goal_ids for split in SPLITS}
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
    score, _ = envs_webshop.score_purchase(product, goal, product["pricing"][0], chosen)
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
    for split in SPLITS:
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
    score, info = envs_webshop.score_purchase(product, goal, 39.99, {"size": "x-large", "color": "blue"})
    # attributes 2 of 3 (no cotton); options: size is exact (x-large misses), color fuzzy ("blue" in "navy blue")
    assert abs(score - (2 + 1 + 1) / 6) < 1e-12 and info["attributes_matched"] == ["fleece lined", "machine wash"]
    assert info["options_matched"] == ["blue"] and info["r_type"] == 1.0 and info["query_match"], info
    score, info = envs_webshop.score_purchase(product, goal, 40.01, {"size": "large", "color": "navy blue"})
    assert abs(score - (2 + 2 + 0) / 6) < 1e-12 and info["r_price"] is False, (score, info)
    chair = dict(product, query="office chair", name="Lumora Office Chair", Title="Lumora Office Chair")
    score, info = envs_webshop.score_purchase(chair, goal, 10.0, {})
    assert score == 0.0 and info["title_score"] == 0.0 and info["r_type"] == 0.0, info  # no kind word shared
    hooded = dict(chair, name="Lumora Office Chair Hoodie")  # the goal's one kind word: title score 1, type kept
    assert envs_webshop.score_purchase(hooded, goal, 10.0, {})[1]["r_type"] == 1.0


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
    monkeypatch.setattr(envs_webshop, "_MINI", None)
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
    trajectory = {"task": info["task"], "task_type": info["task_type"], "won": False, "reward": 0.0, "steps": []}
    done = False
    while not done:
        action = env.expert_action(epsilon, rng)
        response = f"<think>mini_shop for the goal</think><action>{action}</action>"
        prompt = seed.render_prompt(info["task"], [(s["observation"], s["action"]) for s in trajectory["steps"]], obs,
                                    info["admissible"], 3, env_name="webshop")
        before = obs
        obs, reward, done, info = env.step(action)
        trajectory["steps"].append({"observation": before, "action": action, "response": response,
                                    "reward": reward, "valid": info["valid"], "prompt": prompt})
        trajectory["reward"] += reward
    trajectory["won"], trajectory["gt"] = info["won"], info["gt"]
    return trajectory


def test_annotator_and_analyzer_take_webshop_trajectories(mini_shop):
    env, rng = WebshopEnv("train", 0, max_steps=6), random.Random(0)
    epsilons = [0.0, 0.0, 0.7, 0.7, 1.0]
    trajectories = [webshop_expert_trajectory(env, s, epsilon, rng) for s, epsilon in enumerate(epsilons)]
    assert any(t["won"] for t in trajectories) and not all(t["won"] for t in trajectories)
    for t in trajectories:
        gt = t["gt"]
        assert {"env", "task_type", "task", "won", "steps", "max_steps", "invalid_steps", "goal_object", "goal",
                "purchased", "score", "mistakes"} <= set(gt), sorted(gt)
        assert gt["won"] == t["won"] and (gt["mistakes"] == []) == t["won"], gt["mistakes"]
        completion = json.loads(skills.annotate(t, gt))
        assert set(completion) == {"episode_summary", "episode_skill"} and t["task"] in completion["episode_summary"]
        prompt = skills.analyzer_prompt(t)
        assert prompt.count("Step ") >= len(t["steps"]) and t["task"] in prompt
    teacher = skills.with_skill(trajectories[0]["steps"][0]["prompt"], WEBSHOP_SKILL)
    assert teacher.startswith(seed.HEADERS["webshop"] + " Your task is to: " + trajectories[0]["task"] + "\n\n"
                              + skills.SKILL_HEADER), teacher[:300]


def test_one_seed_update_on_the_mini_webshop(mini_shop, tmp_path):
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small gains nothing from more threads on a shared CPU
    try:
        demo_env, rng = WebshopEnv("train", 0), random.Random(0)
        demos = [webshop_expert_trajectory(demo_env, s, 0.3, rng) for s in range(6)]
        corpus = [s["prompt"] + s["response"] for t in demos for s in t["steps"]]
        corpus += [skills.analyzer_prompt(t) + skills.annotate(t) for t in demos]
        policy = seed.build_tiny_policy(corpus, str(tmp_path), seed=0, **WEBSHOP_TINY)
        start = time.perf_counter()
        train_envs = [envs.make_env("webshop", "train", i, max_steps=4) for i in range(4)]
        trajectories = seed.rollout(policy, train_envs, [5, 6], group_size=2, max_steps=4, max_new_tokens=12,
                                    env_name="webshop", generator=torch.Generator().manual_seed(0))
        assert [t["group"] for t in trajectories] == [0, 0, 1, 1]
        assert all(t["gt"] is not None and 1 <= len(t["steps"]) <= 4 for t in trajectories)
        assert all(s["prompt"].startswith(seed.HEADERS["webshop"]) for t in trajectories for s in t["steps"])
        parsed, texts = seed.analyze(policy, trajectories, max_new_tokens=16)
        assert len(parsed) == len(texts) == 4
        skill_list = [p or WEBSHOP_SKILL for p in parsed]  # a random model parses none: a fixed skill tests the teacher
        rows = seed.step_rows(trajectories, skill_list)
        old, teacher, ref, has_teacher = seed.rescore(policy, rows)
        advantages = seed.trajectory_advantages(trajectories)[rows["trajectory"]]  # (B,)
        before = [p.detach().clone() for p in policy.model.parameters()]
        optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-3, weight_decay=0.0)
        metrics, skipped = seed.policy_update(policy, optimizer, rows["prompts"], rows["responses"], advantages, old,
                                              teacher, ref, has_teacher)
        elapsed = time.perf_counter() - start
        print(f"\none SEED update on the mini WebShop (2 tasks x 2, 4 steps): {elapsed:.2f}s, "
              f"{len(rows['prompts'])} rows")
        assert skipped is None and all(math.isfinite(v) for v in metrics.values()), (skipped, metrics)
        assert bool(has_teacher.all()) and old.shape == teacher.shape, (has_teacher, old.shape, teacher.shape)
        change = max((b - p.detach()).abs().max().item() for b, p in zip(before, policy.model.parameters()))
        assert change > 0, "the update changed no weight"
        for t in trajectories:  # the annotator reads these trajectories' gt without failing
            assert json.loads(skills.annotate(t))["episode_skill"]
    finally:
        torch.set_num_threads(threads)
