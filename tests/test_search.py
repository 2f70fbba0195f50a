"""
tests/test_search.py: the Search-QA env (simulators/search_qa.py) and its retrieval-server client
(adapters/search_server.py): determinism, splits, garbage actions, the reading expert, BM25, exact match, held-out
combinations, the need for two searches on multi-hop questions, the hindsight annotator, the prompt, and
HttpRetriever against a local http.server (a good answer, garbage, a wrong shape, an HTTP error, a timeout, a
closed port).

    python -m pytest -q tests/test_search.py
"""
import json
import random
import socket
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import skills
from adapters.search_server import HttpRetriever, RetrievalError, make_env
from simulators import search_qa
from simulators.search_qa import (SPLITS, TASK_TYPES, Corpus, SearchQAEnv, annotate, corpus, exact_match,
                                  normalize_answer, parse_action)

INFO_KEYS = {"task", "admissible", "won", "valid", "task_type"}
GT_KEYS = {"env", "task", "task_type", "won", "steps", "invalid_steps", "answer", "aliases", "gold_passages",
           "queries", "retrieved", "hops", "bridge", "answered"}


def play(env, seed, policy=None):
    """(first obs, [(action, obs, reward, done, info)]) of one episode; policy(env) -> action, default the expert."""
    obs, _ = env.reset(seed)
    steps, done = [], False
    while not done:
        action = policy(env) if policy else env.expert_action()
        result = env.step(action)
        steps.append((action, *result))
        done = result[2]
    return obs, steps


def trajectory_of(env, first_obs, steps):
    """The training loop's trajectory record: .task, .won, .reward, .steps (observation, action, valid, reward)."""
    observations = [first_obs] + [s[1] for s in steps[:-1]]
    records = [types.SimpleNamespace(observation=o, action=a, valid=info["valid"], reward=r)
               for o, (a, _, r, _, info) in zip(observations, steps)]
    return types.SimpleNamespace(task=env.task, won=steps[-1][4]["won"], reward=sum(s[2] for s in steps),
                                 steps=records)


def test_every_split_resets_and_unknown_split_raises():
    for split in SPLITS:
        obs, info = SearchQAEnv(split).reset(0)
        assert obs == info["task"] and obs.endswith("?") and INFO_KEYS <= set(info)
        assert info["admissible"] == [] and info["valid"] and not info["won"] and info["task_type"] in TASK_TYPES
    with pytest.raises(ValueError, match="valid_seen"):
        SearchQAEnv("test")


def test_parse_action_on_literal_strings():
    assert parse_action("<search>Ilse Varro born</search>") == ("search", "Ilse Varro born", None)
    assert parse_action("  <ANSWER> Kessel </ANSWER>\n") == ("answer", "Kessel", None)
    for bad in ("", "Kessel", "<search></search>", "<search>a</search> and more", "<search><b>a</search>x",
                "<search>a <answer>b</answer></search>", "x" * 1001):
        kind, _, error = parse_action(bad)
        assert kind is None and error.startswith("Invalid action") and "\n" not in error, bad


def test_expert_wins_valid_seen_with_every_family():
    env, wins, families = SearchQAEnv("valid_seen"), 0, set()
    for seed in range(40):
        env.reset(seed)
        families.add(env.task_type)
        done = False
        while not done:
            action = env.expert_action()
            assert 0 < len(env.expert_thought(action).split()) <= 12
            _, reward, done, info = env.step(action)
        wins += info["won"]
        assert info["won"] == (reward == 10.0)
        if env.task_type != "single-hop":
            assert len(info["gt"]["queries"]) == 2, info["gt"]
    rate = wins / 40
    assert rate >= 0.95, f"expert won {rate:.0%} of 40 valid_seen tasks"
    assert families == set(TASK_TYPES), families


def test_expert_answers_only_what_it_retrieved():
    env = SearchQAEnv("train")
    for seed in range(30):
        _, steps = play(env, seed)
        gt = steps[-1][4]["gt"]
        retrieved = {pid for ids in gt["retrieved"] for pid in ids}
        assert all(p["id"] in retrieved for p in gt["gold_passages"]), gt
        assert gt["answer_supported"] or env.task_type == "comparison"


def test_noisy_expert_stays_valid():
    env, rng, wins = SearchQAEnv("train"), random.Random(1), 0
    for seed in range(40):
        _, steps = play(env, seed, lambda e: e.expert_action(epsilon=0.5, rng=rng))
        assert all(info["valid"] for *_, info in steps)
        wins += steps[-1][4]["won"]
    assert 0.1 < wins / 40 < 0.9, wins


def test_bm25_ranks_gold_first_and_returns_topk():
    env, first, total = SearchQAEnv("valid_seen"), 0, 0
    for seed in range(60):
        env.reset(seed)
        done = False
        while not done:
            action = env.expert_action()
            kind, query, _ = parse_action(action)
            if kind == "search":
                results = env.corpus.bm25.search(query, 3)
                assert len(results) == 3
                gold = {env.corpus.passage(hop["entity"])["text"] for hop in env.hops}
                first += results[0] in gold
                total += 1
            done = env.step(action)[2]
    assert first / total >= 0.9, f"gold passage first for {first}/{total} expert queries"
    assert len(corpus().bm25.search("born in the town", 5)) == 5
    assert corpus().bm25.search("zzqx qqzz", 3) == []
    env = SearchQAEnv("train", topk=2)
    env.reset(0)
    obs = env.step("<search>born town</search>")[0]
    assert obs.startswith("<information>Doc 1(Title: ") and "Doc 2(Title: " in obs and "Doc 3" not in obs


def test_corpus_size_and_build_time():
    start = time.perf_counter()
    fresh = Corpus()
    seconds = time.perf_counter() - start
    assert seconds < 2.0, f"corpus and index took {seconds:.2f} s"
    assert 2000 <= len(fresh.passages) <= 4000 and len(fresh.text_of) == len(fresh.passages)
    assert [p for _, p in fresh.passages[:50]] == [p for _, p in corpus().passages[:50]]  # deterministic


def test_normalisation_and_exact_match():
    assert normalize_answer("  The  Kessel-Works, Inc.! ") == "kesselworks inc"
    assert normalize_answer("An apple a day") == "apple day"
    assert exact_match("the Republic of Varnland", ["Varnland", "Republic of Varnland"])
    assert exact_match("KESSEL.", "Kessel") and not exact_match("Kessal", "Kessel")
    assert not exact_match("", ["Kessel"]) and exact_match("1931", ["1931"])


def test_valid_unseen_combinations_never_in_train():
    def combinations(split):
        env = SearchQAEnv(split)
        keys = []
        for seed in range(300):
            env.reset(seed)
            keys.append(env.combination)
        return set(keys)

    train, unseen, seen = combinations("train"), combinations("valid_unseen"), combinations("valid_seen")
    assert not train & unseen and not seen & unseen
    assert all(search_qa.is_held_out(*key.split("|")) for key in unseen)
    assert not any(search_qa.is_held_out(*key.split("|")) for key in train)
    templates = {key.split("|")[0] for key in unseen}
    assert templates >= {key.split("|")[0] for key in train} - {"capital"}  # 14 countries: few held-out pairs


def test_multi_hop_needs_two_searches():
    env, both, total = SearchQAEnv("train"), 0, 0
    for seed in range(400):
        env.reset(seed)
        if env.task_type != "multi-hop":
            continue
        results = env.corpus.bm25.search(env.task, 3)
        both += all(env.corpus.passage(hop["entity"])["text"] in results for hop in env.hops)
        total += 1
    assert total >= 80 and both / total <= 0.2, f"one question-text search held both gold passages {both}/{total}"


def _seed_of(family, split="train"):
    env = SearchQAEnv(split)
    return next(seed for seed in range(200) if env.reset(seed) and env.task_type == family)


def _annotation(env, seed, policy=None, rng=None):
    first_obs, steps = play(env, seed, policy)
    gt = steps[-1][4]["gt"]
    summary, skill = annotate(trajectory_of(env, first_obs, steps), gt, rng or random.Random(0))
    assert summary and skill and len(skill.split()) < 60
    assert skills.parse_skill(json.dumps({"episode_summary": summary, "episode_skill": skill}), env.task) == skill
    return gt, summary, skill


def test_annotate_success_and_failures():
    env = SearchQAEnv("train")
    multi = _seed_of("multi-hop")
    gt, summary, skill = _annotation(env, multi)
    assert gt["won"] and gt["bridge"] in skill and "correctly" in summary
    phrasings = {_annotation(env, multi, rng=random.Random(i))[2] for i in range(8)}
    assert len(phrasings) == 2

    _, summary, skill = _annotation(env, multi, lambda e: "<answer>Nowhere</answer>")  # no search at all
    assert "without searching" in summary and "search" in skill.lower()

    def stop_at_bridge(e):  # the first hop, then answer with the bridge itself
        return e.expert_action() if not e.queries else f"<answer>{e.hops[0]['value']}</answer>"
    _, summary, skill = _annotation(env, multi, stop_at_bridge)
    assert "bridge" in summary and env.hops[0]["value"] in skill

    def vague(e):
        return "<search>where was it born</search>" if e.steps < 3 else "<answer>Kessel</answer>"
    _, summary, skill = _annotation(env, _seed_of("single-hop"), vague)
    assert "never named" in summary and env.hops[0]["entity"] in skill

    def invent(e):  # read everything, then answer a name no passage holds
        action = e.expert_action()
        return "<answer>Zzyzx</answer>" if action.startswith("<answer>") else action
    _, summary, skill = _annotation(env, multi, invent)
    assert "no retrieved passage" in summary and env.answer in skill

    def later(e):  # read both years, then answer with the other name
        action = e.expert_action()
        return f"<answer>{next(s for s in e.subjects if s != e.answer)}</answer>" if "<answer>" in action else action
    _, summary, skill = _annotation(env, _seed_of("comparison"), later)
    assert "years" in skill and env.answer in skill and all(hop["value"] in skill for hop in env.hops)

    _, summary, skill = _annotation(env, multi, lambda e: "garbage")
    assert "invalid" in summary and "<search>" in skill


# ---------------------------------------------------------------------------------- HttpRetriever
class _Handler(BaseHTTPRequestHandler):
    mode = "ok"

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.mode == "slow":  # answer nothing before the client gives up
            time.sleep(1.0)
            return
        if self.mode == "error":
            self.send_error(500, "boom")
            return
        if self.mode == "ok":  # Search-R1's shape from the embedded BM25, so the env's expert still wins
            hits = corpus().bm25.search(request["queries"][0], request["topk"])
            body = json.dumps({"result": [[{"document": {"id": str(i), "contents": h}, "score": 1.0 / (i + 1)}
                                           for i, h in enumerate(hits)]]})
        else:
            body = {"garbage": "this is {not json", "shape": json.dumps({"result": "nothing here"})}[self.mode]
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/retrieve"
    httpd.shutdown()
    httpd.server_close()


def test_http_retriever_answers_and_drives_the_env(server):
    _Handler.mode = "ok"
    passages = HttpRetriever(server).search("Ilse Varro born", 3)
    assert len(passages) == 3 and all("\n" in p for p in passages)
    env = make_env("valid_seen", url=server)
    assert isinstance(env.retriever, HttpRetriever) and make_env().retriever is corpus().bm25
    _, steps = play(env, 2)
    assert steps[0][1].startswith("<information>Doc 1(Title: ") and steps[-1][4]["won"]


@pytest.mark.parametrize("mode, words", [("garbage", "non-JSON"), ("shape", "unexpected shape"),
                                         ("error", "HTTP 500"), ("slow", "within 0.3 s")])
def test_http_retriever_bad_answers_raise_one_line(server, mode, words):
    _Handler.mode = mode
    with pytest.raises(RetrievalError) as caught:
        HttpRetriever(server, timeout=0.3).search("Ilse Varro", 3)
    message = str(caught.value)
    assert server in message and words in message and "\n" not in message


def test_http_retriever_down_server_raises_from_env_step():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/retrieve"
    env = make_env("train", url=url, timeout=2)
    env.reset(0)
    with pytest.raises(RetrievalError) as caught:
        env.step("<search>Ilse Varro</search>")
    assert url in str(caught.value) and "unreachable" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ValueError):
        HttpRetriever("localhost:8000/retrieve")
