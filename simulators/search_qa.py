"""Search-QA "search": the paper's search-augmented QA benchmark (verl-agent's search env), offline, in pure Python.

The agent answers a question by searching a corpus: it sends `<search>query</search>`, the env answers with the
retrieved passages in Search-R1's format, "<information>Doc 1(Title: T) text\\nDoc 2(Title: ...) ...\\n</information>",
and it ends with `<answer>text</answer>`, scored by exact match of the normalised answer (SQuAD's normalize_answer:
lowercase, drop punctuation and the articles a/an/the, collapse whitespace) against the gold answer and its aliases.
Conventions and where they come from:
  - tags, one action per response, the first complete pair counts: verl-agent's search projection
    (agent_system/environments/env_package/search/projection.py, read in langfengQ/AgentOCR: the first
    <search>...</search>, else the first <answer>...</answer>); the training loop hands this env that pair;
  - max_steps=4 (env.max_steps=4) and topk=3 (--topk 3): zhangdw156/SEED examples/seed_trainer/_common/search.sh,
    examples/grpo_trainer/run_search.sh, examples/search/retriever/retrieval_launch.sh; every step, valid or
    not, uses one turn, as verl-agent's SearchEnv (skyrl_gym envs/search/env.py) counts turns;
  - the passage format "Doc i(Title: <first line>) <rest>\\n": Search-R1's _passages2string, passages being a
    corpus row's "contents" ("title\\ntext"), as the /retrieve server returns them (adapters/search_server.py);
    verl-agent's own search tool (skyrl_gym tools/search.py) writes "Doc i: <contents>" inside a JSON string
    {"result": ...} between the <information> tags, which this env leaves out;
  - the prompt (PROMPT): verl-agent's SEARCH_TEMPLATE_NO_HIS / SEARCH_TEMPLATE (SEED
    agent_system/environments/prompts/search.py), its instructions kept word for word, its history block
    rewritten for this repository's fields;
  - EM and normalisation: verl-agent's skyrl_gym envs/search/utils.py (em_check over the golden answers; read
    in GithubX-F/ProxMO-RL, a verl-agent fork), SQuAD's normalize_answer.
How this departs from verl-agent and the paper:
  - the corpus is not Wikipedia (wiki-18, 21M passages, an e5 dense index on a GPU server) but about 2,700
    short Wikipedia-like passages about fictional people, towns, countries, companies, inventions and rivers,
    generated in code from a fixed seed (no files, no download), so no answer can be guessed without retrieval;
    facts point one way only (a company's passage names its founder, the founder's passage does not name the
    company), so a multi-hop question needs one search per hop. Distractors: namesakes (same first name or
    surname, or a surname one letter off), towns one letter off, other towns in the same passage ("later
    settled in"), and event passages that mention people, companies and towns without the asked fact;
  - the retriever is BM25 written here (lowercased words, no stemming or stop words, k1=1.2, b=0.75, Lucene's
    idf), built once per process, not e5; pass retriever= (e.g. adapters/search_server.HttpRetriever) for a real
    server; the questions then still come from this corpus, so a real run needs verl-agent's data instead;
  - the questions are generated, not NQ/HotpotQA: families (info["task_type"]) are named by kind rather than by
    verl-agent's data sources (nq, triviaqa, popqa are single-hop; hotpotqa, 2wikimultihopqa, musique, bamboogle
    multi-hop), since none of these datasets is used: "single-hop" (one fact), "multi-hop" (two facts chained
    through a bridge entity, HotpotQA's "bridge" type) and "comparison" (two facts compared, HotpotQA's
    "comparison" type: who was born / which company was founded first);
  - reward 10 on a correct answer, as this repository's other envs give on success (verl-agent's is 1 for EM),
    at the <answer> step, which ends the episode whatever the answer; running out of steps ends it with 0;
  - an invalid step (no single well-formed tag pair, an empty query or answer, tags inside it, over
    MAX_ACTION_CHARS) answers one line saying what is wrong, with info["valid"] False; verl-agent instead sends
    the action on and lets the invalid-action penalty act. A search that finds nothing answers
    "<information>No results found.</information>" (BM25 returns only passages that share a word);
  - splits: `train` and `valid_seen` draw from the same distribution with disjoint seed streams; `valid_unseen`
    asks only held-out (question template, subject) combinations, crc32("<template>|<subject>") % 4 == 0
    (comparison: "<template>|<a>|<b>", names sorted), never asked in train although train asks the same
    templates about other subjects and other templates about the same subjects.
`expert_action()` plays a demonstrator that reads: it searches the entity of the hop it is on (for the second
hop the bridge name it read in a retrieved passage), reads the fact off a retrieved passage titled with that
entity, and answers once it has read everything; the gold passage is used only to choose, among a few
queries, one the retriever ranks it for. info["gt"] on done carries what the hindsight annotator (`annotate`)
reads.

Run: python envs.py --env search --split valid_seen --seed 3   (plays the expert, prints the episode)
"""
import functools
import math
import random
import re
import string
import zlib
from collections import Counter

import numpy as np

SPLITS = ("train", "valid_seen", "valid_unseen")
TASK_TYPES = ("single-hop", "multi-hop", "comparison")
MAX_STEPS, TOPK = 4, 3
MAX_ACTION_CHARS = 1000
REWARD_WON = 10.0
BM25_K1, BM25_B = 1.2, 0.75
TAGS = ("search", "answer")

# ---------------------------------------------------------------------------------------------- the prompt
_INSTRUCTION = (
    "Now it's your turn to respond for the current step.\n"
    "You should first conduct reasoning process. This process MUST be enclosed within <think> </think> tags. \n"
    "After completing your reasoning, choose only one of the following actions (do not perform both):\n"
    "(1) If you find you lack some knowledge, you can call a search engine to get more external information "
    "using format: <search> your query </search>.\n"
    "(2) If you have enough knowledge to answer the question confidently, provide your final answer within "
    "<answer> </answer> tags, without detailed illustrations. For example, <answer>Beijing</answer>.\n")
_HEAD = "\nYou are an expert agent tasked with answering the given question step-by-step.\nYour question: {task}\n\n"
PROMPT = {
    "first": _HEAD + _INSTRUCTION,
    "history": _HEAD + (
        "Prior to this step, you have already taken {step_count} step(s). Below are the most recent "
        "{history_length} of them, where <search> </search> wraps your past search queries and <information> "
        "</information> wraps the results the search engine returned. History:\n{action_history}\n\n"
        "You are now at step {current_step} and your current observation is: {observation}\n\n") + _INSTRUCTION,
    "action": "{}",
    "separator": ", ",
    "tags": TAGS,
}


# ------------------------------------------------------------------------------------- answers and tokens
def normalize_answer(text):
    """SQuAD's normalisation: lowercase, no punctuation, no articles (a, an, the), single spaces."""
    text = "".join(ch for ch in str(text).lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(prediction, golds):
    """True when the normalised prediction equals one normalised gold answer (golds: a str or a list)."""
    golds = [golds] if isinstance(golds, str) else golds
    return normalize_answer(prediction) in {normalize_answer(gold) for gold in golds}


def tokenize(text):
    """Lowercased words (letters and digits of any script); the en dash in '1931–2004' splits."""
    return re.findall(r"[^\W_]+", text.lower())


_ACTION = re.compile(r"\s*<(search|answer)>(.*?)</\1>\s*", re.I | re.S)
_ANY_TAG = re.compile(r"</?\s*(search|answer|information|think)\s*>", re.I)


def parse_action(action):
    """(kind, text, None) for one well-formed '<search>q</search>' or '<answer>a</answer>', else
    (None, None, the one-line reason it is invalid)."""
    if not isinstance(action, str) or not action.strip():
        return None, None, "Invalid action: it is empty; give <search>query</search> or <answer>text</answer>."
    if len(action) > MAX_ACTION_CHARS:
        return None, None, f"Invalid action: longer than {MAX_ACTION_CHARS} characters."
    match = _ACTION.fullmatch(action)
    if match is None:
        return None, None, ("Invalid action: expected exactly one <search>query</search> or "
                            "<answer>text</answer> pair.")
    kind, text = match.group(1).lower(), " ".join(match.group(2).split())
    if _ANY_TAG.search(text):
        return None, None, f"Invalid action: tags inside the {kind}; put plain text between the tags."
    if not text:
        return None, None, f"Invalid action: the {kind} is empty."
    if kind == "search" and not tokenize(text):
        return None, None, "Invalid action: the query has no words to search for."
    return kind, text, None


# ------------------------------------------------------------------------------------------------ BM25
class BM25:
    """Okapi BM25 over passage strings: search(query, topk) -> [passage str], best first, only passages that
    share a word with the query; ties go to the earlier passage."""

    def __init__(self, passages, k1=BM25_K1, b=BM25_B):
        self.passages = list(passages)
        counts = [Counter(tokenize(p)) for p in self.passages]
        lengths = np.array([sum(c.values()) for c in counts], dtype=float)
        postings = {}
        for doc, doc_counts in enumerate(counts):
            for term, tf in doc_counts.items():
                postings.setdefault(term, ([], []))
                postings[term][0].append(doc)
                postings[term][1].append(tf)
        n, norm = len(self.passages), k1 * (1 - b + b * lengths / lengths.mean())
        self._index = {}  # term -> (doc indices, their precomputed BM25 term weights)
        for term, (docs, tfs) in postings.items():
            docs, tfs = np.array(docs), np.array(tfs, dtype=float)
            idf = math.log(1 + (n - len(docs) + 0.5) / (len(docs) + 0.5))
            self._index[term] = (docs, idf * tfs * (k1 + 1) / (tfs + norm[docs]))

    def scores(self, query):
        scores = np.zeros(len(self.passages))
        for term in tokenize(query):
            if term in self._index:
                docs, weights = self._index[term]
                scores[docs] += weights
        return scores

    def search(self, query, topk=TOPK):
        scores = self.scores(query)
        hits = np.flatnonzero(scores > 0)
        best = hits[np.lexsort((hits, -scores[hits]))[:topk]]
        return [self.passages[i] for i in best]


# ------------------------------------------------------------------------------------------- the corpus
# Sentence templates. {s} is the passage's subject, {sur} a person's surname; each relation is read back from
# the templates that state it (RELATIONS), so writing a passage and reading it are one definition.
PERSON_INTRO = ("{s} ({year}–{death}) was {job} known for {topic}.",
                "{s} (born {year}) is {job} known for {topic}.")
PERSON_BIRTH = ("{sur} was born in {town} and later settled in {other}.",
                "Born in {town}, {sur} spent most of a long career in {other}.")
PERSON_EXTRA = ("{sur} wrote {count} books on {topic2}.", "{sur} is remembered by students of {topic2}.")
COMPANY_FOUNDING = ("{s} is a {industry} company founded in {year} by {founder}.",
                    "Founded by {founder} in {year}, {s} makes {product}.")
COMPANY_HQ = ("It is headquartered in {town}, and it runs a second plant in {other}.",
              "The company has its head office in {town} and a warehouse near {other}.")
INVENTION_ORIGIN = ("The {s} is a {category} first built in {year} by {inventor}.",
                    "The {s} was invented by {inventor} in {year} as a kind of {category}.")
INVENTION_EXTRA = ("It was later produced in {town} by {company}.", "Copies were sold in {town} by {company}.")
TOWN_INTRO = ("{s} is a {size} in {country}, with about {people} inhabitants.",
              "{s} is a {size} in the {side} of {country}.")
TOWN_EXTRA = ("The economy of {s} rests on {trade}.", "In {s} the local {trade} trade employs many residents.")
RIVER_COURSE = ("The {s} flows through {town} before emptying into Lake {lake}.",
                "The {s} rises in the {hills} Hills and flows through {town}.")
COUNTRY_INTRO = "{s}, officially the Republic of {s}, is a country in {region}."
COUNTRY_CAPITAL = ("Its capital is {capital}.", "The capital and largest city is {capital}.")
EVENTS = ("The {year} {word} Exhibition in {town} showed work by {person} and {person2}.",
          "{company} sponsors the annual {word} Regatta, held on a lake near {town}.",
          "The {word} Medal went to {person} in {year} for a study of the {invention}.")
# relation -> (subject kind, templates that state it, the template field holding the value)
RELATIONS = {
    "born_in": ("person", PERSON_BIRTH, "town"), "birth_year": ("person", PERSON_INTRO, "year"),
    "founded_by": ("company", COMPANY_FOUNDING, "founder"), "founded_year": ("company", COMPANY_FOUNDING, "year"),
    "headquartered_in": ("company", COMPANY_HQ, "town"), "invented_by": ("invention", INVENTION_ORIGIN, "inventor"),
    "located_in": ("town", TOWN_INTRO, "country"), "flows_through": ("river", RIVER_COURSE, "town"),
    "capital": ("country", COUNTRY_CAPITAL, "capital"),
}
# relation -> (the expert's goal phrase, words a query adds to the entity, what the value is called)
RELATION_WORDS = {
    "born_in": ("find where {e} was born", ("born",), "birthplace"),
    "birth_year": ("find when {e} was born", ("born",), "birth year"),
    "founded_by": ("find who founded {e}", ("founded by",), "founder"),
    "founded_year": ("find when {e} was founded", ("founded",), "founding year"),
    "headquartered_in": ("find where {e} is headquartered", ("headquartered", "head office"), "headquarters town"),
    "invented_by": ("find who invented the {e}", ("invented by",), "inventor"),
    "located_in": ("find which country {e} is in", ("town country",), "country"),
    "flows_through": ("find which town the {e} flows through", ("flows through",), "town it flows through"),
    "capital": ("find the capital of {e}", ("capital",), "capital"),
}
# template -> (family, subject kind, relations in hop order, two phrasings); {e}, or {a} and {b} for comparisons
TEMPLATES = {
    "born_in": ("single-hop", "person", ("born_in",), ("Where was {e} born?", "In which town was {e} born?")),
    "birth_year": ("single-hop", "person", ("birth_year",), ("In what year was {e} born?", "When was {e} born?")),
    "founded_by": ("single-hop", "company", ("founded_by",), ("Who founded {e}?", "Who was the founder of {e}?")),
    "headquartered_in": ("single-hop", "company", ("headquartered_in",),
                         ("Where is {e} headquartered?", "In which town does {e} have its headquarters?")),
    "invented_by": ("single-hop", "invention", ("invented_by",), ("Who invented the {e}?", "Who built the first {e}?")),
    "located_in": ("single-hop", "town", ("located_in",),
                   ("In which country is {e}?", "{e} is a town in which country?")),
    "flows_through": ("single-hop", "river", ("flows_through",),
                      ("Which town does the {e} flow through?", "Through which town does the {e} flow?")),
    "capital": ("single-hop", "country", ("capital",),
                ("What is the capital of {e}?", "Which city is the capital of {e}?")),
    "born_in>located_in": ("multi-hop", "person", ("born_in", "located_in"),
                           ("In which country was {e} born?", "{e} was born in a town in which country?")),
    "founded_by>born_in": ("multi-hop", "company", ("founded_by", "born_in"),
                           ("Where was the founder of {e} born?", "In which town was the founder of {e} born?")),
    "invented_by>born_in": ("multi-hop", "invention", ("invented_by", "born_in"),
                            ("Where was the inventor of the {e} born?",
                             "In which town was the inventor of the {e} born?")),
    "founded_by>birth_year": ("multi-hop", "company", ("founded_by", "birth_year"),
                              ("In what year was the founder of {e} born?", "When was the founder of {e} born?")),
    "headquartered_in>located_in": ("multi-hop", "company", ("headquartered_in", "located_in"),
                                    ("In which country is {e} headquartered?",
                                     "In which country is the head office of {e}?")),
    "flows_through>located_in": ("multi-hop", "river", ("flows_through", "located_in"),
                                 ("Which country does the {e} flow through?",
                                  "Through which country does the {e} flow?")),
    "earlier_born": ("comparison", "person", ("birth_year", "birth_year"),
                     ("Who was born first, {a} or {b}?", "Which person was born earlier, {a} or {b}?")),
    "earlier_founded": ("comparison", "company", ("founded_year", "founded_year"),
                        ("Which company was founded first, {a} or {b}?", "Which is older, {a} or {b}?")),
}

JOBS = ("chemist", "painter", "engineer", "composer", "surveyor", "botanist", "architect", "printer", "astronomer",
        "clockmaker", "cartographer", "weaver", "physician", "mathematician", "glassblower", "shipwright")
TOPICS = ("tidal clocks", "river charts", "glass lenses", "folk songs", "soil surveys", "paper dyes", "bridge arches",
          "star catalogues", "wool looms", "steam valves", "herb gardens", "tin alloys", "canal locks", "bell casting")
INDUSTRIES = {"Works": ("steel", "iron tools"), "Mills": ("textile", "woollen cloth"), "Foundry": ("metal", "bells"),
              "Motors": ("engine", "tractors"), "Instruments": ("precision", "measuring gauges"),
              "Press": ("printing", "maps and almanacs"), "Ceramics": ("pottery", "tiles"),
              "Shipyards": ("shipbuilding", "river barges")}
DEVICES = {"lamp": "oil lamp", "loom": "weaving machine", "engine": "heat engine", "pump": "water pump",
           "lens": "optical lens", "valve": "pressure valve", "kiln": "drying kiln", "compass": "magnetic compass",
           "sextant": "navigation instrument", "barometer": "weather instrument"}
SIZES = ("town", "small town", "market town", "city", "port city")
SIDES = ("north", "south", "east", "west")
TRADES = ("fishing", "timber", "wool", "salt", "barley", "copper", "tanning", "brewing")
REGIONS = ("the northern Selvan basin", "the Orrin highlands", "the western coastlands", "the eastern steppe",
           "the southern lake district", "the Amber Gulf")
_ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "tr",
           "v", "w", "z", "th", "sk")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ei", "au")
_CODAS = ("", "n", "r", "l", "s", "th", "m", "rk", "nd", "st", "x", "k", "ll")
_SUFFIXES = {"country": ("land", "ia", "mark", "ora"), "town": ("", "", "", "burg", "ton", "holm", "wick", "by"),
             "first": ("", "a", "o", "in"), "surname": ("", "", "er", "is", "ov", "an")}
COUNTS = {"country": 14, "town": 210, "person": 800, "namesake": 300, "company": 360, "invention": 360, "river": 70,
          "event": 600}


def _a(noun):
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _slug(name):
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


class _Namer:
    """Unique made-up words: no two entities share a word, and none is a word of the templates."""

    def __init__(self, rng, reserved):
        self.rng, self.used = rng, set(reserved)

    def word(self, kind, syllables=(2, 2)):
        while True:
            word = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS)
                           for _ in range(self.rng.randint(*syllables)))
            word = (word + self.rng.choice(_CODAS) + self.rng.choice(_SUFFIXES.get(kind, ("",)))).capitalize()
            if 4 <= len(word) <= 10 and self._claim(word):
                return word

    def variant(self, word):
        """`word` with one vowel changed (Kessel -> Kessal), or None when every such word is taken."""
        spots = [i for i, ch in enumerate(word) if ch in "aeiou"]
        self.rng.shuffle(spots)
        for i in spots:
            for vowel in self.rng.sample("aeiou", 5):
                candidate = word[:i] + vowel + word[i + 1:]
                if candidate != word and self._claim(candidate):
                    return candidate
        return None

    def _claim(self, word):
        if word.lower() in self.used:
            return False
        self.used.add(word.lower())
        return True


class Corpus:
    """The embedded corpus: passages ("title\\ntext"), entities with their facts, and a BM25 index over it."""

    def __init__(self, seed="search_qa/corpus/v1"):
        rng = random.Random(seed)
        reserved = set(tokenize(" ".join([*PERSON_INTRO, *PERSON_BIRTH, *PERSON_EXTRA, *COMPANY_FOUNDING, *COMPANY_HQ,
                                          *INVENTION_ORIGIN, *INVENTION_EXTRA, *TOWN_INTRO, *TOWN_EXTRA, *RIVER_COURSE,
                                          COUNTRY_INTRO, *COUNTRY_CAPITAL, *EVENTS, *JOBS, *TOPICS, *DEVICES, *SIZES,
                                          *TRADES, *REGIONS, *INDUSTRIES, *(" ".join(v) for v in INDUSTRIES.values()),
                                          *DEVICES.values(), *(" ".join(t[3]) for t in TEMPLATES.values())])))
        namer = _Namer(rng, reserved)
        self.entities, self.passages, self.text_of = {}, [], {}  # name -> {"kind", "id", "facts"}; [(id, text)]
        self._generate(rng, namer)
        self.id_of = {text: pid for pid, text in self.passages}
        self.by_kind = {}
        for name, entity in self.entities.items():
            self.by_kind.setdefault(entity["kind"], []).append(name)
        surnames = Counter(name.split()[1] for name in self.by_kind["person"])
        self.aliases = {name: [name.split()[1]] if surnames[name.split()[1]] == 1 else []
                        for name in self.by_kind["person"]}
        self.aliases.update({name: [f"Republic of {name}"] for name in self.by_kind["country"]})
        self.aliases.update({name: [name.split()[0]] for name in self.by_kind["company"]})
        self.bm25 = BM25(text for _, text in self.passages)

    def _add(self, kind, name, facts, text):
        pid = f"{kind}/{_slug(name)}"
        if pid in self.text_of:  # event titles may repeat
            pid += f"-{len(self.passages)}"
        self.text_of[pid] = f"{name}\n{text}"
        self.passages.append((pid, f"{name}\n{text}"))
        if kind != "event":
            self.entities[name] = {"kind": kind, "id": pid, "facts": facts}

    def _generate(self, rng, namer):
        countries = [namer.word("country") for _ in range(COUNTS["country"])]
        towns = []
        while len(towns) < COUNTS["town"]:
            towns.append(namer.word("town"))
            if rng.random() < 0.2 and len(towns) < COUNTS["town"]:  # a near namesake: Kessel and Kessal
                towns.append(namer.variant(towns[-1]) or namer.word("town"))
        town_country = {town: countries[i % len(countries)] for i, town in enumerate(rng.sample(towns, len(towns)))}
        capitals = {country: next(t for t in towns if town_country[t] == country) for country in countries}
        for country in countries:
            text = (COUNTRY_INTRO.format(s=country, region=rng.choice(REGIONS)) + " "
                    + rng.choice(COUNTRY_CAPITAL).format(capital=capitals[country]))
            self._add("country", country, {"capital": capitals[country]}, text)
        for town in towns:
            intro = rng.choice(TOWN_INTRO).format(s=town, size=rng.choice(SIZES), country=town_country[town],
                                                  people=f"{rng.randint(2, 90) * 1000:,}", side=rng.choice(SIDES))
            self._add("town", town, {"located_in": town_country[town]},
                      intro + " " + rng.choice(TOWN_EXTRA).format(s=town, trade=rng.choice(TRADES)))
        first_names = [namer.word("first", (1, 2)) for _ in range(160)]
        people = []
        for _ in range(COUNTS["person"]):
            people.append((rng.choice(first_names), namer.word("surname")))
        for first, surname in rng.sample(people, COUNTS["namesake"]):  # namesakes share a name or nearly do
            if rng.random() < 0.5:
                people.append((rng.choice([f for f in first_names if f != first]), surname))
            else:
                people.append((first, namer.variant(surname) or namer.word("surname")))
        for first, surname in dict.fromkeys(people):
            name, year = f"{first} {surname}", rng.randint(1790, 1960)
            death = year + rng.randint(45, 95)
            town, other = rng.sample(towns, 2)
            intro = PERSON_INTRO[0] if death <= 2024 else PERSON_INTRO[1]
            text = " ".join([
                intro.format(s=name, year=year, death=death, job=_a(rng.choice(JOBS)), topic=rng.choice(TOPICS)),
                rng.choice(PERSON_BIRTH).format(sur=surname, town=town, other=other),
                rng.choice(PERSON_EXTRA).format(sur=surname, count=rng.choice(("two", "three", "four", "several")),
                                                topic2=rng.choice(TOPICS))])
            self._add("person", name, {"born_in": town, "birth_year": str(year)}, text)
        persons = [f"{first} {surname}" for first, surname in dict.fromkeys(people)]
        companies = []
        for _ in range(COUNTS["company"]):
            suffix = rng.choice(sorted(INDUSTRIES))
            name, founder = f"{namer.word('company')} {suffix}", rng.choice(persons)
            year = int(self.entities[founder]["facts"]["birth_year"]) + rng.randint(22, 55)
            town, other = rng.sample(towns, 2)
            industry, product = INDUSTRIES[suffix]
            text = (rng.choice(COMPANY_FOUNDING).format(s=name, industry=industry, year=year, founder=founder,
                                                       product=product)
                    + " " + rng.choice(COMPANY_HQ).format(town=town, other=other))
            self._add("company", name, {"founded_by": founder, "founded_year": str(year), "headquartered_in": town},
                      text)
            companies.append(name)
        inventions = []
        for _ in range(COUNTS["invention"]):
            device = rng.choice(sorted(DEVICES))
            name, inventor = f"{namer.word('invention')} {device}", rng.choice(persons)
            year = int(self.entities[inventor]["facts"]["birth_year"]) + rng.randint(20, 60)
            text = (rng.choice(INVENTION_ORIGIN).format(s=name, category=DEVICES[device], year=year, inventor=inventor)
                    + " " + rng.choice(INVENTION_EXTRA).format(town=rng.choice(towns), company=rng.choice(companies)))
            self._add("invention", name, {"invented_by": inventor, "year": str(year)}, text)
            inventions.append(name)
        for _ in range(COUNTS["river"]):
            name, town = f"{namer.word('river')} River", rng.choice(towns)
            text = rng.choice(RIVER_COURSE).format(s=name, town=town, lake=namer.word("lake"),
                                                   hills=namer.word("hills"))
            self._add("river", name, {"flows_through": town}, text)
        for i in range(COUNTS["event"]):
            template, year, word = EVENTS[i % len(EVENTS)], rng.randint(1850, 2010), namer.word("event")
            person, person2 = rng.sample(persons, 2)
            town, company, invention = rng.choice(towns), rng.choice(companies), rng.choice(inventions)
            title = {0: f"{year} {word} Exhibition", 1: f"{word} Regatta", 2: f"{word} Medal"}[i % len(EVENTS)]
            text = template.format(year=year, town=town, person=person, person2=person2, company=company,
                                   word=word, invention=invention)
            self._add("event", title, {}, text)

    def passage(self, name):
        """{"id", "text"} of the entity's own passage."""
        pid = self.entities[name]["id"]
        return {"id": pid, "text": self.text_of[pid]}


@functools.lru_cache(maxsize=1)
def corpus():
    """The embedded corpus and its BM25 index, built once per process (well under a second)."""
    return Corpus()


@functools.lru_cache(maxsize=4096)
def _patterns(relation, entity):
    """Regexes that read `relation`'s value out of the passage about `entity`, one per template stating it."""
    _, templates, slot = RELATIONS[relation]
    known = {"s": re.escape(entity), "sur": re.escape(entity.split()[-1])}
    value = r"\d{4}" if slot == "year" else r"[A-Z][\w'-]*(?: [A-Z][\w'-]*)*"
    patterns = []
    for template in templates:
        regex = ""
        for piece in re.split(r"(\{\w+\})", template):
            name = piece[1:-1] if piece.startswith("{") else None
            regex += (f"(?P<value>{value})" if name == slot else known.get(name, ".+?") if name else re.escape(piece))
        patterns.append(re.compile(regex))
    return patterns


def read_fact(passages, entity, relation):
    """The value of `relation` for `entity` as a passage titled `entity` among `passages` states it, or None."""
    for text in passages:
        title, _, body = text.partition("\n")
        if title.strip().strip('"') == entity:
            for pattern in _patterns(relation, entity):
                match = pattern.search(body)
                if match:
                    return match.group("value")
    return None


def is_held_out(template, *subjects):
    """valid_unseen combinations: a fixed quarter of (template, subject), stable across runs and machines."""
    return zlib.crc32("|".join((template, *sorted(subjects))).encode()) % 4 == 0


def _appears(text, passages):
    """Whether `text`'s words appear, in order and whole, in one of `passages` (normalised as answers are)."""
    words = " ".join(tokenize(normalize_answer(text)))
    return bool(words) and any(f" {words} " in f" {' '.join(tokenize(normalize_answer(p)))} " for p in passages)


def format_passages(passages):
    """Search-R1's rendering: 'Doc i(Title: <first line>) <rest>' per passage, each line ending in a newline."""
    if not passages:
        return "<information>No results found.</information>"
    docs = "".join(f"Doc {i + 1}(Title: {p.split(chr(10), 1)[0]}) {' '.join(p.split(chr(10))[1:])}\n"
                   for i, p in enumerate(passages))
    return f"<information>{docs}</information>"


class SearchQAEnv:
    """Search-QA (module docstring): reset(seed) -> (obs, info); step(action) -> (obs, reward, done, info)."""

    def __init__(self, split="train", seed=0, max_steps=MAX_STEPS, topk=TOPK, retriever=None):
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        self.split, self.max_steps, self.topk = split, max_steps, topk
        self.corpus = corpus()
        self.retriever = retriever if retriever is not None else self.corpus.bm25
        self._seed_stream = random.Random(f"search_qa/{split}/stream/{seed}")  # seeds for reset(None)

    # ---- question generation ----
    def _generate(self, rng):
        family = rng.choice(TASK_TYPES)
        template = rng.choice(sorted(t for t, spec in TEMPLATES.items() if spec[0] == family))
        _, kind, relations, phrasings = TEMPLATES[template]
        unseen, names = self.split == "valid_unseen", self.corpus.by_kind[kind]
        if family == "comparison":
            while True:
                a, b = rng.sample(names, 2)
                years = [self.corpus.entities[n]["facts"][relations[0]] for n in (a, b)]
                if years[0] != years[1] and is_held_out(template, a, b) == unseen:
                    break
            self.subjects, self.task = [a, b], rng.choice(phrasings).format(a=a, b=b)
            self.answer = a if int(years[0]) < int(years[1]) else b
            self.plan = [(a, relations[0]), (b, relations[1])]
        else:
            subject = rng.choice([n for n in names if is_held_out(template, n) == unseen])
            self.subjects, self.task = [subject], rng.choice(phrasings).format(e=subject)
            self.plan = [(subject, relations[0])] + [(None, r) for r in relations[1:]]  # None: the bridge
        self.task = self.task[0].upper() + self.task[1:]
        self.task_type, self.template = family, template
        self.combination = "|".join((template, *sorted(self.subjects)))
        self.hops = self._gold_hops()
        if family != "comparison":
            self.answer = self.hops[-1]["value"]

    def _gold_hops(self):
        """[{"entity", "relation", "value"}] in hop order, from the corpus facts."""
        hops, value = [], None
        for entity, relation in self.plan:
            entity = entity or value
            value = self.corpus.entities[entity]["facts"][relation]
            hops.append({"entity": entity, "relation": relation, "value": value})
        return hops

    # ---- gym interface ----
    def reset(self, seed=None):
        if seed is None:
            seed = self._seed_stream.randrange(2 ** 31)
        self.seed = seed
        self._generate(random.Random(f"search_qa/{self.split}/{seed}"))  # str seeds: stable across runs
        self._noise_rng = random.Random(f"search_qa/{self.split}/noise/{seed}")
        self.steps, self.invalid_steps, self.won, self.done = 0, [], False, False
        self.queries, self.retrieved, self.seen, self.answered = [], [], [], None
        self._results, self._thoughts = {}, {}
        self.observation = self.task
        return self.observation, self._info(valid=True)

    def step(self, action):
        if self.done:
            return "The episode is over.", 0.0, True, self._info(valid=False)
        kind, text, error = parse_action(action)
        reward = 0.0
        if error:
            self.invalid_steps.append(self.steps)
            self.observation = error
        elif kind == "search":
            passages = self._search(text)  # a retriever's exception goes up: the loop drops the trajectory
            self.queries.append(text)
            self.retrieved.append([self._passage_id(p) for p in passages])
            self.seen.extend(p for p in passages if p not in self.seen)
            self.observation = format_passages(passages)
        else:
            self.answered, self.done = text, True
            self.won = exact_match(text, [self.answer, *self.corpus.aliases.get(self.answer, [])])
            reward = REWARD_WON if self.won else 0.0
            self.observation = f"The episode is over: you answered {text!r}."
        self.steps += 1
        self.done = self.done or self.steps >= self.max_steps
        return self.observation, reward, self.done, self._info(valid=error is None)

    def _search(self, query):
        if query not in self._results:
            self._results[query] = [str(p) for p in self.retriever.search(query, self.topk)][:self.topk]
        return self._results[query]

    def _passage_id(self, passage):
        """The embedded corpus's id, else (a real server's passage) its title line."""
        return self.corpus.id_of.get(passage) or passage.split("\n", 1)[0].strip().strip('"')

    def _info(self, valid):
        info = {"task": self.task, "admissible": [], "won": self.won, "valid": valid, "task_type": self.task_type}
        if self.done:
            gold = [self.corpus.passage(hop["entity"]) for hop in self.hops]
            info["gt"] = {
                "env": "search", "task": self.task, "task_type": self.task_type, "template": self.template,
                "won": self.won, "steps": self.steps, "max_steps": self.max_steps,
                "invalid_steps": list(self.invalid_steps), "answer": self.answer,
                "aliases": list(self.corpus.aliases.get(self.answer, [])), "gold_passages": gold,
                "queries": list(self.queries), "retrieved": [list(ids) for ids in self.retrieved],
                "hops": [dict(hop) for hop in self.hops],
                "bridge": self.hops[0]["value"] if self.task_type == "multi-hop" else None,
                "answered": self.answered,
                "answer_supported": self.answered is not None and _appears(self.answered, self.seen),
                "combination": self.combination, "split": self.split, "seed": self.seed}
        return info

    # ---- expert ----
    def expert_action(self, epsilon=0.0, rng=None, oracle=False):
        """The reading expert's next action (module docstring); with probability epsilon a worse one instead, a
        vague query or a premature answer (noisy demonstrations). oracle is accepted for the warm-up's interface
        and ignored: the expert already uses the gold passage as far as it may, to choose its query."""
        best, thought = self._expert_step()
        rng = rng or self._noise_rng
        if epsilon > 0 and rng.random() < epsilon:
            best, thought = self._worse_action(rng, best)
        self._thoughts[best] = thought
        return best

    def expert_thought(self, action):
        """A short reason (<= 12 words) for the expert's <think> before `action`."""
        thought = self._thoughts.get(action)
        if thought is None:
            kind, text, _ = parse_action(action)
            thought = f"search for {text}" if kind == "search" else f"answer {text}" if kind else "try a valid action"
        return " ".join(thought.split()[:12])

    def _expert_step(self):
        values = []
        for index, (entity, relation) in enumerate(self.plan):
            entity = entity or values[-1]
            value = read_fact(self.seen, entity, relation)
            if value is None:
                goal = RELATION_WORDS[relation][0].format(e=entity)
                lead = "next, " if index and self.task_type == "multi-hop" else "now " if index else ""
                return f"<search>{self._query_for(entity, relation)}</search>", lead + goal
            values.append(value)
        if self.task_type == "comparison":
            (a, _), (b, _) = self.plan
            earlier, year = (a, values[0]) if int(values[0]) < int(values[1]) else (b, values[1])
            return f"<answer>{earlier}</answer>", f"{earlier} came first, in {year}"
        return f"<answer>{values[-1]}</answer>", f"the passage says {values[-1]}"

    def _query_for(self, entity, relation):
        """The first of a few queries (entity plus relation words, then the name alone) that brings the entity's
        passage back; with a retriever over another corpus, the first one not yet searched."""
        candidates = [f"{entity} {words}" for words in RELATION_WORDS[relation][1]] + [entity]
        fresh = [q for q in candidates if q not in self.queries] or candidates
        if self.retriever is self.corpus.bm25 and entity in self.corpus.entities:
            gold = self.corpus.passage(entity)["text"]
            return next((q for q in fresh if gold in self._search(q)), fresh[0])
        return fresh[0]

    def _worse_action(self, rng, best):
        """A vague query (the question without its names) or an answer taken from the wrong place."""
        if rng.random() < 0.5:
            names = set(tokenize(" ".join(self.subjects)))
            words = [w for w in tokenize(self.task) if w not in names] or ["who"]
            return f"<search>{' '.join(words)}</search>", "search the question words"
        kind = self.corpus.entities.get(self.answer, {}).get("kind")
        titles = [p.split("\n", 1)[0] for p in self.seen]
        pool = [t for t in titles if t != self.answer] or sorted(self.corpus.by_kind.get(kind) or self.subjects)
        guess = rng.choice(pool)
        action = f"<answer>{guess}</answer>"
        return (action, f"guess {guess} without checking") if action != best else (best, "answer now")


# ------------------------------------------------------------------------------------ hindsight annotator
def _field(obj, name, default=None):
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def _hit_query(gt, passage_id, fallback):
    """The agent's first query whose results held `passage_id`, else `fallback`."""
    return next((q for q, ids in zip(gt["queries"], gt["retrieved"]) if passage_id in ids), fallback)


def annotate(trajectory, gt, rng=None):
    """(episode summary, skill) for stage 1 from the env's info["gt"]: for a success the workflow (what to search
    first, which bridge to search next, where the answer was read), for a failure the first decisive mistake and
    what to do instead. The skill is one or two plain sentences under 60 words; rng (random.Random) picks one of
    two phrasings, default one seeded from the task."""
    rng = rng or random.Random(zlib.crc32(str(gt.get("task")).encode()))
    task, hops, family = gt["task"], gt["hops"], gt["task_type"]
    gold_ids = [p["id"] for p in gt["gold_passages"]]
    nouns = [RELATION_WORDS[hop["relation"]][2] for hop in hops]
    queries = [_hit_query(gt, pid, hop["entity"]) for pid, hop in zip(gold_ids, hops)]
    if _field(trajectory, "won", gt["won"]):
        summary = (f"The agent answered '{task}' correctly with {gt['answer']} after searching "
                   + "; ".join(f"'{q}'" for q in gt["queries"]) + ".")
        first = hops[0]["entity"]
        if family == "multi-hop":
            bridge = gt["bridge"]
            options = [f"Two hops: search '{queries[0]}' first to get the {nouns[0]} ({bridge}), then search "
                       f"'{queries[1]}' and answer with the {nouns[1]} that passage gives.",
                       f"First find the {nouns[0]} of {first}; the passage names {bridge}, so search {bridge} next "
                       f"and answer from its passage, not from the first one."]
        elif family == "comparison":
            a, b = hops[0]["entity"], hops[1]["entity"]
            options = [f"Search each name on its own ({a}, then {b}), read both {nouns[0]}s from their passages, "
                       f"and answer with the one that comes first.",
                       f"Do not compare from memory: query '{queries[0]}' and '{queries[1]}' separately, note the "
                       f"two years, then answer with the earlier name."]
        else:
            options = [f"Search the exact name with the relation, like '{queries[0]}', first; then answer with the "
                       f"{nouns[0]} exactly as the passage about {first} states it.",
                       f"One search is enough when the question names the entity: query '{queries[0]}', find the "
                       f"passage titled {first}, and copy its {nouns[0]} into the answer."]
        return summary, rng.choice(options)
    what, options = _failure(gt, hops, family, gold_ids, nouns, queries)
    summary = f"The agent failed '{task}' after {gt['steps']} step{'s' * (gt['steps'] != 1)}: {what}."
    return summary, rng.choice(options)


def _failure(gt, hops, family, gold_ids, nouns, queries):
    """(what went wrong, two phrasings of the skill) for the first decisive mistake of a failed episode."""
    found = [any(pid in ids for ids in gt["retrieved"]) for pid in gold_ids]
    answered, gold, first = gt["answered"], gt["answer"], hops[0]["entity"]
    entity_query = f"{first} {RELATION_WORDS[hops[0]['relation']][1][0]}"
    if answered is not None and not gt["queries"]:
        return (f"it answered '{answered}' without searching", [
            f"Never answer from memory: search '{entity_query}' first and answer only with what a retrieved "
            f"passage says.",
            f"Answering '{answered}' before any search failed. Always search the name in the question first, "
            f"then read the {nouns[0]} in its passage."])
    if not gt["queries"]:
        return (f"it made {len(gt['invalid_steps'])} invalid steps and never searched", [
            "Give exactly one action per step, in the form <search>your query</search> or <answer>the "
            "answer</answer>, and search before answering.",
            f"Invalid steps used up the turns. Write <search>{entity_query}</search> first, with nothing else "
            f"around the tags."])
    if not found[0]:
        named = any(_appears(first, [q]) for q in gt["queries"])
        what = "its searches never named" if not named else "its searches never retrieved the passage on"
        return (f"{what} {first}", [
            f"Put the exact name from the question into the query: search '{entity_query}' so the passage "
            f"titled {first} comes back before answering.",
            f"Mistake: the searches missed {first}. Copy the full name {first} into the query, and read the "
            f"{nouns[0]} only from the passage titled with it."])
    bridge = hops[0]["value"]
    if family == "multi-hop" and not found[1]:
        if answered is not None and exact_match(answered, bridge):
            return (f"it answered with the bridge {bridge} instead of following it", [
                f"{bridge} is only the {nouns[0]}; the question asks for its {nouns[1]}. Search {bridge} next "
                f"and answer with what that passage says.",
                f"Do not stop at the first hop: after reading {bridge}, search '{bridge}' and answer with the "
                f"{nouns[1]} from its passage."])
        return (f"it found the {nouns[0]} {bridge} but never searched it", [
            f"After the first passage names the {nouns[0]} ({bridge}), search '{bridge}' next and read the "
            f"{nouns[1]} there before answering.",
            f"Two hops are needed: the passage on {first} gives {bridge}, and only the passage on {bridge} "
            f"gives the {nouns[1]}. Search it before you answer."])
    if family == "comparison" and not all(found):
        missing = hops[found.index(False)]["entity"]
        return (f"it never retrieved the passage on {missing}", [
            f"Compare only after reading both: search {first} and {missing} separately, then answer with the "
            f"one whose year is earlier.",
            f"Mistake: one side of the comparison was never looked up. Search '{missing}' too before "
            f"choosing between the two names."])
    if answered is None:
        return (f"it retrieved every passage it needed but never answered {gold}", [
            f"Once the passages state the answer, give <answer>{gold}</answer> right away instead of searching "
            f"again until the steps run out.",
            f"Warning sign: searching again after the answer is already in a passage. Answer as soon as the "
            f"passage on {hops[-1]['entity']} gives the {nouns[-1]}."])
    if family == "comparison":
        (a, year_a), (b, year_b) = ((hop["entity"], hop["value"]) for hop in hops)
        return (f"it chose {answered}, but {a} has {year_a} and {b} has {year_b}", [
            f"Compare the two years before answering: {a} has {year_a} and {b} has {year_b}, so the earlier one, "
            f"{gold}, was the answer.",
            f"Mistake: picked {answered} without comparing the years. Write both years down ({year_a}, "
            f"{year_b}) and answer with the name that has the smaller one, here {gold}."])
    if not gt["answer_supported"]:
        return (f"it answered '{answered}', a name in no retrieved passage", [
            f"Copy the answer from the passage, never invent it: the passage on {hops[-1]['entity']} says "
            f"{gold}, so the answer was {gold}.",
            f"Mistake: '{answered}' appears in no retrieved passage. The passage about {hops[-1]['entity']} gives "
            f"{gold} as the {nouns[-1]}; answer only with words like that."])
    return (f"it answered '{answered}' although the passage says {gold}", [
        f"Read the sentence for the {nouns[-1]} in the passage titled {hops[-1]['entity']}; it says {gold}, "
        f"not {answered}, which belongs to another sentence or passage.",
        f"Check the title before reading: only the passage about {hops[-1]['entity']} answers this, and it "
        f"gives {gold} as the {nouns[-1]}."])
