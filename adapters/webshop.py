"""WebShop over HTTP, plus an offline mini WebShop on loopback so `--env webshop` runs with no setup.

WebshopEnv talks to a WebShop server through the upstream Flask app's routes (session `fixed_<i>` plays goal i):
/<session>, /search_results/<session>/<keywords>/<page>, /item_page/<session>/<asin>/<keywords>/<page>/<options>,
/item_sub_page/<session>/<asin>/<keywords>/<page>/<sub_page>/<options>, /done/<session>/<asin>/<options>. Like
WebAgentTextEnv it reads a page's visible texts and clickables (buttons and product links lowercased, option values);
like verl-agent it splits the instruction off as the task, shows the parts after it quoted and joined with ' [SEP] ',
and lists `search[<your query>]` (where there is a search box) and `click[<clickable>]` as admissible. Buying reads the
score from the final page; the reward is 10 only when it is exactly 1.0 (the paper's setup), info["score"] holds it.
Splits: goals 0-499 are WebShop's test set, 500+ training. Mini WebShop: train = goals >= 500 and valid_seen = goals
0-499, both outside HELD_OUT_CATEGORY ("furniture"); valid_unseen = goals 0-499 of that category, never trained on.
A real server tells a goal's category only after the purchase, so there valid_seen = goals 0-249, valid_unseen =
250-499 (both unseen instructions of the test set; the paper reports all 500) and train = 500..num_goals-1.

The mini WebShop: 300 products of 20 kinds in 5 categories, with attributes, options and prices, and 1500 goals,
generated deterministically in WebShop's JSON schema, served by a stdlib http.server thread with the same routes and
page structure, and scored with WebShop's reward: (attribute matches + option matches + [price <= limit]) /
(goal attributes + goal options + 1) x type match. Departures from upstream: BM25 over the product texts instead of
Pyserini; thefuzz's token_set_ratio > 85 becomes "one token set contains the other"; spaCy's nouns of a title become
its product-kind words; no color normalisation; one fixed price per product; no images, scripts or POST search form.
The client departs from WebAgentTextEnv in accepting search[...] only where there is a search box, never listing the
no-op click[search], and not reading hidden page parts as text. Any action string is safe: an impossible one leaves
the page as it was (info["valid"] False). A server that is down, slow or answers garbage is retried with a bounded
backoff, then WebshopUnavailable (a RuntimeError) names the URL.

Run: python adapters/webshop.py --split valid_unseen --seed 3   (plays the expert on the mini WebShop; --url for a server)
"""
import argparse
import ast
import html
import http.client
import json
import math
import os
import random
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections import Counter
from html.parser import HTMLParser

# verl-agent's WebShop prompt (agent_system/environments/prompts/webshop.py), spelling and spacing included
# (its history sentence spells "observations"); seed.render_prompt fills it
_WEBSHOP = ("\nYou are an expert autonomous agent operating in the WebShop e\u2011commerce environment.{space}\n"
            "Your task is to: {{task}}.\n{state}.\nYour admissible actions of the current situation are: \n[\n"
            "{{admissible_actions}}\n].\n\nNow it's your turn to take one action for the current step.\nYou should "
            "first reason step-by-step about the current situation, then think carefully which admissible action "
            "best advances the shopping goal. This reasoning process MUST be enclosed within <think> </think> tags. "
            "\nOnce you've finished your reasoning, you should choose an admissible action for current step and "
            "present it within <action> </action> tags.\n")
_HISTORY = ("Prior to this step, you have already taken {step_count} step(s). Below are the most recent "
            "{history_length} observations and the corresponding actions you took: {action_history}\n"
            "You are now at step {current_step} and your current observation is: {observation}")
PROMPT = {"first": _WEBSHOP.format(space=" ", state="Your current observation is: {observation}"),
          "history": _WEBSHOP.format(space="", state=_HISTORY), "action": "'{}',", "separator": "\n",
          "tags": ("action",)}
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SPLITS = ("train", "valid_seen", "valid_unseen")
EVAL_GOALS, HELD_OUT_CATEGORY, REWARD_WON = 500, "furniture", 10.0
SEARCH_RETURN_N, PRODUCT_WINDOW = 50, 10  # upstream engine.py
PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # upstream goal.py: a goal's price limit is one of these
MAX_PAGE_BYTES, MAX_ACTION_CHARS = 2_000_000, 300
SUB_PAGES = ("description", "features", "reviews", "attributes")
ROUTES = {"index": ("session",), "search_results": ("session", "keywords", "page"),  # the Flask app's URL fields
          "item_page": ("session", "asin", "keywords", "page", "options"),
          "item_sub_page": ("session", "asin", "keywords", "page", "sub_page", "options"),
          "done": ("session", "asin", "options")}
DEPARTMENTS = {"beauty": "Beauty & Personal Care", "fashion": "Clothing, Shoes & Jewelry", "electronics": "Electronics",
               "food": "Grocery & Gourmet Food", "furniture": "Home & Kitchen › Furniture"}
# pool -> (the option's name on the product page, its values)
OPTIONS = {"scent": ("scent", "lavender|citrus|coconut|unscented|mint"), "volume": ("size", "8 fl oz|16 fl oz|32 oz"),
           "shade": ("color", "nude|berry|coral|plum|rose pink|burgundy"), "jar": ("size", "1.7 ounce|3.4 ounce"),
           "pack": ("size", "single|2 pack|6 pack"), "shoe size": ("size", "7|8|9|10|11|12"),
           "apparel size": ("size", "small|medium|large|x-large|xx-large"), "waist": ("size", "26|28|30|32|34"),
           "color": ("color", "black|white|grey|navy blue|olive green|beige"),
           "wash": ("color", "light wash|dark wash|black|stone grey"), "tech color": ("color", "black|white|rose gold"),
           "phone model": ("size", "iphone 13|iphone 14|iphone 15|galaxy s23"), "length": ("size", "3 ft|6 ft|10 ft"),
           "tea flavor": ("flavor name", "jasmine|mint|lemon ginger|original"),
           "bar flavor": ("flavor name", "chocolate chip|peanut butter|cookie dough|salted caramel"),
           "cocoa flavor": ("flavor name", "sea salt|almond|orange|mint"), "count": ("size", "12 count|24 count"),
           "weight": ("size", "12 ounce|2 pound|5 pound"), "wood color": ("color", "walnut|white|black|natural oak"),
           "bed size": ("size", "twin|full|queen|king")}
KINDS = """category | query | price range | attributes | option pools
beauty | shampoo | 6-30 | sulfate free, paraben free, dry hair, color safe, cruelty free | scent, volume
beauty | lipstick | 5-25 | long lasting, matte finish, moisturizing, vegan formula, high pigment | shade
beauty | face moisturizer | 8-45 | sensitive skin, fragrance free, hyaluronic acid, oil free, non comedogenic | jar
beauty | nail polish | 4-20 | quick dry, long lasting, non toxic, high shine, chip resistant | shade, pack
fashion | running shoes | 30-120 | non slip, rubber sole, breathable mesh, arch support, memory foam | shoe size, color
fashion | hoodie | 20-70 | machine wash, fleece lined, cotton blend, relaxed fit, kangaroo pocket | apparel size, color
fashion | jeans | 25-90 | slim fit, stretch denim, machine wash, high waist, straight leg | waist, wash
fashion | rain jacket | 35-150 | water resistant, packable hood, zipper closure, windproof | apparel size, color
electronics | wireless earbuds | 15-120 | noise cancelling, long battery life, touch control, quick charge | tech color
electronics | phone case | 6-35 | shockproof, slim design, magsafe compatible, raised edges | phone model, tech color
electronics | charging cable | 5-25 | quick charge, braided nylon, usb c, data transfer, tangle free | length
electronics | bluetooth speaker | 20-150 | waterproof, long battery life, portable design, deep bass | tech color
food | green tea | 5-30 | organic, loose leaf, non gmo, gluten free, individually wrapped | tea flavor, count
food | protein bar | 10-45 | gluten free, high fiber, low sugar, keto friendly, plant based | bar flavor, count
food | coffee beans | 8-40 | whole bean, medium roast, fair trade, single origin, bold roast | weight
food | dark chocolate | 5-30 | sugar free, dairy free, organic, fair trade, gluten free | cocoa flavor, count
furniture | office chair | 60-300 | lumbar support, adjustable height, breathable mesh, swivel wheels | color
furniture | bookshelf | 40-200 | solid wood, easy assemble, storage space, metal legs, wall mounted | wood color
furniture | coffee table | 50-250 | storage space, solid wood, tempered glass, easy assemble, lift top | wood color
furniture | bed frame | 80-400 | steel slats, no box spring, easy assemble, storage drawers, noise free | bed size"""
BRANDS = "Aurelle Brightwell Corvana Dunmore Elkhart Fennway Glenrock Halvorsen Iverly Kestrel Lumora Marlowe".split()
TEMPLATES = ("i am looking for {query} that is {attributes}", "i need {attributes} {query}",
             "find me {query} with {attributes}", "i want to buy {query} which is {attributes}")
# template and option-name words the expert ignores when it compares an instruction with a title
STOPWORDS = set("i am a an the is are that which with and or for me need want to buy find looking of in it price "
                "lower than dollars size color scent flavor name".split())


def _words(text):
    return re.findall(r"[a-z0-9]+", str(text).lower())


TYPE_WORDS = {w for line in KINDS.splitlines()[1:] for w in _words(line.split("|")[1])}  # spaCy's title nouns, here


def build_catalogue(products_per_kind=15, goals_per_product=5, seed=0):
    """{"products", "goals"} in WebShop's schema (products as load_products leaves them, goals as
    get_synthetic_goals makes them, shuffled with random.seed(233) as the Flask app does). Deterministic."""
    rng, products = random.Random(f"webshop-mini/{seed}"), []
    for line in KINDS.splitlines()[1:]:
        category, query, prices, attributes, pools = (field.strip() for field in line.split("|"))
        low, high = map(float, prices.split("-"))
        for _ in range(products_per_kind):
            asin = "B0" + "".join(rng.choices("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789", k=8))
            brand, attrs = rng.choice(BRANDS), rng.sample(attributes.split(", "), rng.randint(2, 4))
            title = f"{brand} {query.title()} - " + ", ".join(a.title() for a in attrs)
            options = {}
            for pool in pools.split(", "):
                name, values = OPTIONS[pool][0], OPTIONS[pool][1].split("|")
                chosen = set(rng.sample(values, rng.randint(2, len(values))))
                options[name] = [v for v in values if v in chosen]  # in the pool's order, as a product page lists them
            price = round(rng.uniform(low, high), 2)
            products.append({"asin": asin, "category": category, "query": query, "name": title, "Title": title,
                             "product_category": f"{DEPARTMENTS[category]} › {query.title()}",
                             "Description": f"{title}. Made by {brand} for everyday use.",
                             "BulletPoints": [a.capitalize() + "." for a in attrs] + [f"Sold by {brand}."],
                             "Price": f"${price}", "pricing": [price], "options": options, "option_to_image": {},
                             "Attributes": attrs, "Reviews": [], "Rating": "N.A.", "MainImage": ""})
    assert len({p["asin"] for p in products}) == len(products), "asin collision: change the seed"
    goals = []
    for product in products:
        brackets = [p for p in PRICE_RANGE if p > product["pricing"][0]][:4]
        for _ in range(goals_per_product):
            attrs = rng.sample(product["Attributes"], rng.randint(1, min(3, len(product["Attributes"]))))
            options = {name: rng.choice(values) for name, values in product["options"].items()}
            price_upper = sorted(rng.sample(brackets, 2))[1]
            phrase = attrs[0] if len(attrs) == 1 else ", ".join(attrs[:-1]) + " and " + attrs[-1]
            text = rng.choice(TEMPLATES).format(query=product["query"], attributes=phrase) + " with " + ", and ".join(
                f"{k}: {v}" for k, v in options.items()) + f", and price lower than {price_upper:.2f} dollars"
            goals.append({"asin": product["asin"], "category": product["category"], "query": product["query"],
                          "name": product["Title"], "product_category": product["product_category"],
                          "instruction_text": text, "attributes": attrs, "price_upper": price_upper,
                          "goal_options": options, "weight": 1})
    random.Random(233).shuffle(goals)
    return {"products": products, "goals": goals}


def _fuzzy(a, b):
    """Stands in for thefuzz's token_set_ratio(a, b) > 85: one token set contains the other (ratio 100)."""
    a, b = set(_words(a)), set(_words(b))
    return bool(a and b) and (a <= b or b <= a)


def score_purchase(product, goal, price, options):
    """Upstream get_reward: (attribute matches + option matches + [price <= limit]) / (goal attributes + goal options
    + 1) x r_type. Returns (score, info): upstream's verbose info plus the goal attributes and options matched."""
    fields = [product["Title"].lower(), " ".join(product["BulletPoints"]).lower(), product["Description"].lower()]
    levels = lambda path: {level.strip() for level in path.split("›")}
    query_match = product["query"] == goal["query"]
    category_match = len(levels(product["product_category"]) & levels(goal["product_category"])) >= 2
    desired = set(_words(goal["name"])) & TYPE_WORDS
    title_score = len(set(_words(product["name"])) & desired) / len(desired) if desired else 0.2
    r_type = 1.0 if query_match or category_match or title_score > 0.2 else 0.5
    r_type = 0.0 if title_score == 0.0 else 0.1 if title_score < 0.1 else r_type
    attributes = [g for g in goal["attributes"]
                  if any(_fuzzy(p, g) for p in product["Attributes"]) or any(g in field for field in fields)]
    wanted = list(goal["goal_options"].values() if isinstance(goal["goal_options"], dict) else goal["goal_options"])
    # upstream counts the purchased options that match a goal option: size exactly, the others fuzzily
    matched = [v for k, v in options.items() if any(v in field for field in fields)
               or (v in wanted if k.lower() == "size" else any(_fuzzy(g, v) for g in wanted))]
    total = len(goal["attributes"]) + len(wanted) + 1
    info = {"r_type": r_type, "r_att": len(attributes) / len(goal["attributes"]),
            "w_att": len(goal["attributes"]) / total,
            "query_match": query_match, "category_match": category_match, "title_score": title_score,
            "r_price": price <= goal["price_upper"], "w_price": 1 / total, "attributes_matched": attributes,
            "options_matched": matched}
    if wanted:
        info.update(r_option=len(matched) / len(wanted), w_option=len(wanted) / total)
    return (len(attributes) + len(matched) + info["r_price"]) / total * r_type, info


# ----------------------------------------------------------------------------------------- the mini server

def _url(*parts):
    return "/" + "/".join(urllib.parse.quote(str(part), safe="") for part in parts)


def _button(action, text, kind="btn btn-primary"):
    return (f'<form method="post" action="{action}"><button type="submit" class="{kind}">{html.escape(text)}</button>'
            '</form>')


class MiniWebshop:
    """The catalogue behind the Flask app's routes, on a ThreadingHTTPServer in a daemon thread. Stateless: the
    session id picks the goal (fixed_<i> is goal i, any other id a hashed one) and the URL carries the rest."""

    def __init__(self, catalogue, host="127.0.0.1", port=0):
        self.goals, self.products = catalogue["goals"], {p["asin"]: p for p in catalogue["products"]}
        self.lengths, self.postings = {}, {}  # BM25 index: document lengths, term -> {asin: count}
        for asin, p in self.products.items():
            text = " ".join([p["Title"], p["Description"], *p["BulletPoints"], *sum(p["options"].values(), [])])
            words = _words(text)
            self.lengths[asin] = len(words)
            for term, count in Counter(words).items():
                self.postings.setdefault(term, {})[asin] = count
        self.httpd = _Server((host, port), _Handler)
        self.httpd.site, self.url = self, f"http://{host}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def search(self, query, k1=0.9, b=0.4):
        """BM25 (Pyserini's default k1, b): the best SEARCH_RETURN_N products, ties by asin."""
        scores, average = {}, sum(self.lengths.values()) / len(self.lengths)
        for term in set(_words(query)):
            hits = self.postings.get(term, {})
            idf = math.log(1 + (len(self.lengths) - len(hits) + 0.5) / (len(hits) + 0.5))
            for asin, tf in hits.items():
                scores[asin] = scores.get(asin, 0.0) + idf * tf * (k1 + 1) / (
                    tf + k1 * (1 - b + b * self.lengths[asin] / average))
        return [self.products[a] for a in sorted(scores, key=lambda a: (-scores[a], a))[:SEARCH_RETURN_N]]

    def goal(self, session):
        match = re.fullmatch(r"fixed_(\d+)", session)
        return self.goals[int(match.group(1)) if match else zlib.crc32(session.encode()) % len(self.goals)]

    def render(self, path):
        """The HTML of a route; KeyError, IndexError, ValueError or SyntaxError for a bad URL (answered 404)."""
        parts = [urllib.parse.unquote(p) for p in urllib.parse.urlsplit(path).path.strip("/").split("/")]
        route, values = (parts[0], parts[1:]) if len(parts) > 1 else ("index", parts)
        if len(values) != len(ROUTES[route]):
            raise KeyError(f"/{route} takes {'/'.join(ROUTES[route])}")
        fields = dict(zip(ROUTES[route], values))
        session, asin, keywords, page = (fields.get(k) for k in ("session", "asin", "keywords", "page"))
        goal, page, options = self.goal(session), int(page or 1), fields.get("options", "{}")
        selected = _options(options)  # a malformed selection is a bad URL on every page that carries one
        logo = '<div id="logo"><h2>WebShop</h2></div>' if route == "index" else ""
        head = (f'<!DOCTYPE html><html><head><title>WebShop</title></head><body><div class="container">{logo}'
                f'<div id="instruction-text"><h4>Instruction:<br>{html.escape(goal["instruction_text"])}</h4></div>')
        tail = "</div></body></html>"
        if route == "index":
            return (head + f'<form role="form" id="form-buscar" method="post" action="{_url(session)}"><input '
                    'id="search_input" class="form-control" type="text" name="search_query" required/><button '
                    'class="btn btn-success" type="submit">Search</button></form>' + tail)
        if route == "done":
            return self._done(goal, self.products[asin], selected)
        head += _button(_url(session), "Back to Search", "btn btn-success")
        if route == "search_results":
            query = " ".join(ast.literal_eval(keywords)) if keywords.startswith("[") else keywords  # as the Flask app
            found, body = self.search(query), ""
            body += _button(_url(route, session, keywords, page - 1), "< Prev") if page > 1 else ""
            body += _button(_url(route, session, keywords, page + 1), "Next >") if page * 10 < len(found) else ""
            for p in found[(page - 1) * PRODUCT_WINDOW:page * PRODUCT_WINDOW]:
                body += (f'<div class="grid-item"><h4 class="product-asin"><a class="product-link" href="'
                         f'{_url("item_page", session, p["asin"], keywords, page, "{}")}">{p["asin"]}</a></h4><h4 '
                         f'class="product-title">{html.escape(p["Title"])}</h4><h5 class="product-price">{p["Price"]}'
                         '</h5></div>')
            return head + f"<p>Page {page} (Total results: {len(found)})</p>" + body + tail
        product = self.products[asin]
        if route == "item_page":
            body = _button(_url("search_results", session, keywords, page), "< Prev")
            for name, choices in product["options"].items():
                name = html.escape(name)
                body += f'<h4>{name}</h4><div class="radio-toolbar">' + "".join(
                    f'<input type="radio" id="radio_{name}{i}" name="{name}" value="{html.escape(v)}"><label '
                    f'for="radio_{name}{i}">{html.escape(v)}</label>' for i, v in enumerate(choices)) + "</div>"
            body += (f'<h2>{html.escape(product["Title"])}</h2><h4>Price: {product["Price"]}</h4><h4>Rating: '
                     f'{product["Rating"]}</h4>')
            body += "".join(_button(_url("item_sub_page", session, asin, keywords, page, sub, options), sub)
                            for sub in ("Description", "Features", "Reviews"))
            return head + body + _button(_url("done", session, asin, options), "Buy Now", "btn btn-lg purchase") + tail
        texts = {"description": [product["Description"]], "features": product["BulletPoints"],
                 "reviews": ["No reviews found"], "attributes": product["Attributes"]}[fields["sub_page"].lower()]
        return (head + _button(_url("item_page", session, asin, keywords, page, options), "< Prev")
                + "".join(f'<p class="product-info">{html.escape(text)}</p>' for text in texts) + tail)

    def _done(self, goal, product, options):
        """The score, visible, and the purchase and goal details, hidden, under upstream's element ids."""
        reward, info = score_purchase(product, goal, product["pricing"][0], options)
        hidden = "".join(f'<h4 id="{key}">{key}<pre>{html.escape(str(value))}</pre></h4>' for key, value in (
            ("asin", product["asin"]), ("options", json.dumps(options)), ("purchased_attrs", product["Attributes"]),
            ("purchased-category", product["category"]), ("purchased-query", product["query"]),
            ("goal-asin", goal["asin"]), ("goal-options", goal["goal_options"]), ("goal-attrs", goal["attributes"]),
            ("goal-price", goal["price_upper"]), ("goal-category", goal["category"]), ("goal-query", goal["query"])))
        return ('<!DOCTYPE html><html><head><title>WebShop</title></head><body><div id="thankyou"><h1>Thank you for '
                f'shopping with us!</h1></div><div style="display:none">{hidden}</div><h3 id="reward">Your score '
                f'(min 0.0, max 1.0)<pre>{reward}</pre></h3><h4 hidden>Reward Details <div id="reward_info"><pre>'
                f'{html.escape(repr(info))}</pre></div></h4></body></html>')


def _options(text):
    """The <options> URL field: a dict literal, read with literal_eval as the Flask app does."""
    options = ast.literal_eval(text)
    if not isinstance(options, dict):
        raise ValueError("options must be a dict")
    return {str(k): str(v) for k, v in options.items()}


class _Server(ThreadingHTTPServer):
    daemon_threads, request_queue_size = True, 128  # many envs may connect at once


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # the env reports failures itself; a line per request would flood stderr
        pass

    def do_GET(self):
        try:
            status, body = 200, self.server.site.render(self.path)
        except (KeyError, IndexError, ValueError, SyntaxError, TypeError, RecursionError, MemoryError) as error:
            status, body = 404, f"<html><body>Not found: {html.escape(repr(error)[:200])}</body></html>"
        data = body.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_POST = do_GET  # the pages' buttons post to the same routes


_CATALOGUE, _MINI, _MINI_LOCK = None, None, threading.Lock()


def mini_catalogue():
    global _CATALOGUE
    with _MINI_LOCK:
        _CATALOGUE = _CATALOGUE or build_catalogue()
        return _CATALOGUE


def mini_server():
    """This process's MiniWebshop, started on first use (loopback, a free port); says so once on stderr."""
    global _MINI
    catalogue = mini_catalogue()
    with _MINI_LOCK:
        if _MINI is None:
            _MINI = MiniWebshop(catalogue)
            print(f"webshop: no server URL (url= or $WEBSHOP_URL): serving the offline mini WebShop at {_MINI.url} "
                  f"({len(catalogue['products'])} products, {len(catalogue['goals'])} goals)", file=sys.stderr)
        return _MINI


# ----------------------------------------------------------------------------------------- the client

class WebshopUnavailable(RuntimeError):
    """The WebShop server did not answer with a WebShop page (down, too slow, or garbage)."""


class _PageParser(HTMLParser):
    """Visible texts (with the tag and classes around each), the search box and the radio options of a page."""
    VOID, IGNORED = {"input", "br", "img", "meta", "link", "hr"}, {"style", "script", "head", "title", "meta"}

    def __init__(self):
        super().__init__()
        self.stack, self.texts, self.search_bar, self.option_names = [], [], False, {}

    def handle_starttag(self, tag, attrs):
        attrs = {key: value or "" for key, value in attrs}
        self.search_bar |= tag == "input" and attrs.get("id") == "search_input"
        if tag == "input" and attrs.get("type") == "radio":
            self.option_names[attrs.get("value", "")] = attrs.get("name", "")
        if tag not in self.VOID:
            hidden = "hidden" in attrs or "display:none" in attrs.get("style", "").replace(" ", "")
            self.stack.append((tag, attrs.get("class", "").split(), hidden))

    def handle_endtag(self, tag):  # upstream pages close tags they never opened (<h4>...</h5>): pop to a match
        depth = next((d for d in range(len(self.stack) - 1, -1, -1) if self.stack[d][0] == tag), None)
        if depth is not None:
            del self.stack[depth:]

    def handle_data(self, data):
        if data.strip() and not any(tag in self.IGNORED or hidden for tag, _, hidden in self.stack):
            tag, classes, _ = self.stack[-1] if self.stack else ("", [], False)
            self.texts.append((data.strip(), tag, classes))


def parse_page(page_html):
    """A page as a dict: texts, instruction, clickables {lowercased: (kind, text)} as WebAgentTextEnv collects them,
    search_bar, products (results), title and price (item), option_names {value: option}, score and the done page's
    <pre> details. Raises ValueError when a score is there but is not a number."""
    parser = _PageParser()
    parser.feed(page_html)
    texts, clickables, products = [t for t, _, _ in parser.texts], {}, []
    page = {"texts": texts, "search_bar": parser.search_bar, "option_names": parser.option_names, "products": products,
            "instruction": None, "title": None, "price": None, "score": None, "details": {}}
    for index, (text, tag, classes) in enumerate(parser.texts):
        following = texts[index + 1] if index + 1 < len(texts) else None
        if text.startswith("Instruction:") and page["instruction"] is None:  # "Instruction:<br>task" or one text
            page["instruction"] = text[len("Instruction:"):].strip() or following
        if tag == "button" and "btn" in classes and text.lower() != "search":  # click[search] does nothing upstream
            clickables[text.lower()] = ("button", text)
        elif "product-link" in classes:
            clickables[text.lower()] = ("product", text)
            products.append({"asin": text, "title": "", "price": None})
        elif "product-title" in classes and products:
            products[-1]["title"] = text
        elif "product-price" in classes and products:
            products[-1]["price"] = _price(text)
        elif tag == "h2":
            page["title"] = text
        elif text.startswith("Price:"):
            page["price"] = _price(text)
        elif text.startswith("Your score (min 0.0, max 1.0)") and following is not None:
            page["score"] = float(following)
    clickables.update({value.lower(): ("option", value) for value in parser.option_names})
    page["clickables"] = clickables
    for match in re.finditer(r'id="([\w-]+)"[^>]*>[^<]*<pre>(.*?)</pre>', page_html, re.S):
        page["details"][match.group(1)] = html.unescape(match.group(2))
    return page


def _price(text):
    found = re.search(r"\$\s*([\d,]+(?:\.\d+)?)", text)
    return float(found.group(1).replace(",", "")) if found else None


def _literal(text, default):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return default


class WebshopEnv:
    """WebShop over HTTP (module docstring): reset(seed) -> (obs, info); step(action) -> (obs, reward, done, info).
    url: a running WebShop server; None reads $WEBSHOP_URL, and without it this process's mini WebShop serves."""

    def __init__(self, split="train", seed=0, url=None, max_steps=15, timeout=10.0, retries=3, num_goals=12087,
                 **options):  # make_env forwards every env's knobs; the household ones mean nothing here
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        url = url or os.environ.get("WEBSHOP_URL")
        self.shop = None if url else mini_server()
        self.url, self.split, self.max_steps = (url or self.shop.url).rstrip("/"), split, max_steps
        self.timeout, self.retries = timeout, retries
        if self.shop:
            unseen = [goal["category"] == HELD_OUT_CATEGORY for goal in self.shop.goals]
            self.goal_ids = {"train": [i for i in range(EVAL_GOALS, len(unseen)) if not unseen[i]],
                             "valid_seen": [i for i in range(EVAL_GOALS) if not unseen[i]],
                             "valid_unseen": [i for i in range(EVAL_GOALS) if unseen[i]]}[split]
        else:
            self.goal_ids = {"train": range(EVAL_GOALS, num_goals), "valid_seen": range(EVAL_GOALS // 2),
                             "valid_unseen": range(EVAL_GOALS // 2, EVAL_GOALS)}[split]
        self._seed_stream = random.Random(f"webshop/{split}/stream/{seed}")  # seeds for reset(None)
        self._noise_rng = random.Random(f"webshop/{split}/noise/{seed}")
        self.session = f"fixed_{self.goal_ids[0]}"
        self._fetch({"route": "index"})  # a server that is down fails here, not in the middle of a rollout

    # ---- HTTP ----
    def _path(self, state):
        fields = {**state, "session": self.session, "options": json.dumps(state.get("options", {}))}
        path = _url(*(fields[name] for name in ROUTES[state["route"]]))
        return path if state["route"] == "index" else f"/{state['route']}{path}"

    def _fetch(self, state):
        """The parsed page of a navigation state. An unreachable, slow (timeout), failing (5xx) or garbage answer
        is retried after 0.1, 0.2, 0.4, ... s (at most 2 s each); then WebshopUnavailable."""
        url, error = self.url + self._path(state), None
        for attempt in range(self.retries + 1):
            time.sleep(min(2.0, 0.05 * 2 ** attempt) if attempt else 0.0)
            try:
                with urllib.request.urlopen(url, timeout=self.timeout) as response:
                    page = parse_page(response.read(MAX_PAGE_BYTES).decode("utf-8", "replace"))
                if page["score" if state["route"] == "done" else "instruction"] is not None:
                    return page
                error = "the answer is not a WebShop page"
            except urllib.error.HTTPError as failure:
                if failure.code < 500:  # the server understood and refused: asking again changes nothing
                    raise WebshopUnavailable(f"WebShop server at {self.url} answered HTTP {failure.code} to {url}: "
                                             "is it the upstream WebShop app (web_agent_site/app.py)?") from None
                error = f"HTTP {failure.code}"
            except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as failure:
                error = f"{type(failure).__name__}: {getattr(failure, 'reason', failure)}"
        raise WebshopUnavailable(
            f"WebShop server at {self.url} is unavailable ({error}; {self.retries + 1} tries of {url}). Start the "
            "upstream server (python -m web_agent_site.app) and pass url= or set WEBSHOP_URL, or unset both to use "
            "the offline mini WebShop.")

    # ---- gym interface ----
    def reset(self, seed=None):
        self.seed = self._seed_stream.randrange(2 ** 31) if seed is None else seed
        self.goal_index = self.goal_ids[self.seed % len(self.goal_ids)]
        self.goal = self.shop.goals[self.goal_index] if self.shop else None
        self.session = f"fixed_{self.goal_index}"
        self.state = {"route": "index", "keywords": "", "page": 1, "asin": None, "options": {}, "sub_page": None}
        self.page = self._fetch(self.state)
        self.task = self.page["instruction"]
        self.task_type = self.goal["category"] if self.goal else "webshop"  # a real server tells it only at the end
        self.steps, self.score, self.won, self.done = 0, 0.0, False, False
        self.invalid_steps, self.searches, self.visited, self.item = [], [], [], None
        return self._observation(), self._info(valid=True)

    def step(self, action):
        if self.done:
            return self._observation(), 0.0, True, self._info(valid=False)
        state = self._transition(action)
        if state is None:
            self.invalid_steps.append(self.steps)
        else:
            page = self._fetch(state)  # raises before anything changes when the server fails
            if state["route"] == "done":  # what was bought, as its page showed it
                self.item = {"asin": state["asin"], "title": self.page["title"], "price": self.page["price"]}
            if self.state["route"] == "index":  # a search: the only way off the search page
                self.searches.append(state["keywords"])
            self.page, self.state = page, state
            if state["route"] == "item_page" and state["asin"] not in self.visited:
                self.visited.append(state["asin"])
        self.steps += 1
        if self.state["route"] == "done":
            self.score = self.page["score"]
            self.won = abs(self.score - 1.0) < 1e-9
        self.done = self.state["route"] == "done" or self.steps >= self.max_steps
        return self._observation(), REWARD_WON if self.won else 0.0, self.done, self._info(valid=state is not None)

    def _transition(self, action):
        """The navigation state an action leads to; None when the page does not offer it."""
        match = re.fullmatch(r"\s*(search|click)\[(.+)\]\s*", action, re.S | re.I) \
            if isinstance(action, str) and len(action) <= MAX_ACTION_CHARS else None
        if match is None:
            return None
        verb, argument = match.group(1).lower(), " ".join(match.group(2).split()).lower()
        state, route = self.state, self.state["route"]
        if verb == "search":  # '/' and brackets would break the route or the Flask app's literal_eval
            query = " ".join(re.sub(r"[/\[\]]", " ", argument).split())
            return {**state, "route": "search_results", "keywords": query, "page": 1, "options": {}} \
                if query and self.page["search_bar"] else None
        kind, text = self.page["clickables"].get(argument, (None, None))
        if kind == "product":
            return {**state, "route": "item_page", "asin": text, "options": {}}
        if kind == "option":
            return {**state, "options": {**state["options"], self.page["option_names"][text]: text}}
        if argument == "back to search" and kind:
            return {**state, "route": "index", "options": {}}
        if argument == "next >" and kind and route == "search_results":
            return {**state, "page": state["page"] + 1}
        if argument in ("< prev", "< back to results", "< back to item page") and kind:
            if route == "search_results":
                return {**state, "page": state["page"] - 1} if state["page"] > 1 else None
            back = "item_page" if route == "item_sub_page" else "search_results"
            return {**state, "route": back, "options": state["options"] if back == "item_page" else {}}
        if argument in SUB_PAGES and kind and route == "item_page":
            return {**state, "route": "item_sub_page", "sub_page": text}
        return {**state, "route": "done"} if argument == "buy now" and kind and route == "item_page" else None

    def _observation(self):
        """verl-agent's text: the parts after the instruction, quoted, joined with ' [SEP] ' (all parts if none)."""
        texts = self.page["texts"]
        start = next((i + 1 for i, text in enumerate(texts) if text in (self.task, f"Instruction: {self.task}")), 0)
        return " [SEP] ".join(f"'{text}'" if start else text for text in texts[start:])

    def _admissible(self):
        return ["search[<your query>]"] * self.page["search_bar"] + [f"click[{key}]" for key in self.page["clickables"]]

    def _info(self, valid):
        info = {"task": self.task, "admissible": self._admissible(), "won": self.won,
                "valid": valid, "task_type": self.task_type, "score": self.score}
        if self.done:
            info["gt"] = self._ground_truth()
        return info

    def _ground_truth(self):
        """What the goal needed, what was bought and what was wrong: for the hindsight annotator."""
        details = self.page["details"] if self.state["route"] == "done" else {}
        goal, purchased, reward_info = None, None, _literal(details.get("reward_info", ""), {})
        if self.goal or details:
            source = self.goal or {"query": details.get("goal-query"), "category": details.get("goal-category"),
                                   "attributes": _literal(details.get("goal-attrs", ""), []),
                                   "goal_options": _literal(details.get("goal-options", ""), {}),
                                   "price_upper": float(_literal(details.get("goal-price", ""), 0.0) or 0.0)}
            goal = {"query": source["query"], "category": source["category"], "attributes": list(source["attributes"]),
                    "options": source["goal_options"], "price_upper": source["price_upper"]}
        if details:
            purchased = {**self.item, "query": details.get("purchased-query"),
                         "category": details.get("purchased-category"),
                         "attributes": _literal(details.get("purchased_attrs", ""), []),
                         "options": _literal(details.get("options", ""), {})}
        return {"env": "webshop", "task_type": self.task_type, "task": self.task,
                "goal_object": (goal or {}).get("query") or "product", "won": self.won, "steps": self.steps,
                "max_steps": self.max_steps, "invalid_steps": list(self.invalid_steps), "score": self.score,
                "goal": goal, "purchased": purchased, "reward_info": reward_info,
                "mistakes": mistakes(goal, purchased, reward_info, self.max_steps), "searches": list(self.searches),
                "visited": list(self.visited), "split": self.split, "seed": self.seed, "goal_index": self.goal_index}

    # ---- expert ----
    def expert_action(self, epsilon=0.0, rng=None, oracle=False):
        """The expert's next action; with probability epsilon a different admissible one (noisy demonstrations).
        It reads only the instruction and the pages: search with the goal words, open the result whose title holds
        all of them within the price limit (next page when none does), go back when the item lacks a wanted option,
        else choose the options the instruction names and buy; so it also plays a real server. oracle=True (mini
        WebShop only): it opens only products that score 1.0 for the goal, as a hindsight skill could tell it."""
        best = self._expert_command(oracle and self.goal is not None)
        rng = rng or self._noise_rng
        if epsilon > 0 and rng.random() < epsilon:
            others = [a for a in self._admissible() if a != best]
            return rng.choice(others) if others else best
        return best

    def _expert_command(self, oracle):
        page, state = self.page, self.state
        limit = float((re.findall(r"price lower than ([\d.]+) dollars", self.task) or ["inf"])[0])
        wanted = list(self.goal["goal_options"].values()) if oracle else \
            [value.strip() for value in re.findall(r": ([^,]+)", self.task)]  # "with size: large, and color: black"
        words = set(_words(re.sub(r": [^,]+|price lower than [\d.]+ dollars", " ", self.task))) - STOPWORDS
        if state["route"] == "index":
            return f"search[{self.task.split(', and price lower than')[0]}]"
        if state["route"] in ("item_sub_page", "done"):
            return "click[< prev]"
        if state["route"] == "search_results":
            fits = lambda p: words <= set(_words(p["title"])) and (p["price"] or 0.0) <= limit
            if oracle:
                fits = lambda p: self._scores_one(p["asin"])
            fresh = [p for p in page["products"] if p["asin"] not in self.visited]
            good = [p for p in fresh if fits(p)]
            if good or "next >" not in page["clickables"]:  # none fits on the last page: the closest title
                best = good or sorted(fresh, key=lambda p: -len(words & set(_words(p["title"]))))
                return f"click[{best[0]['asin'].lower()}]" if best else "click[back to search]"
            return "click[next >]"
        offered = {value.lower(): value for value in page["option_names"]}
        if (page["price"] or 0.0) > limit or any(value.lower() not in offered for value in wanted):
            return "click[< prev]"
        for value in wanted:
            value = offered[value.lower()]
            if state["options"].get(page["option_names"][value]) != value:
                return f"click[{value.lower()}]"
        return "click[buy now]"

    def _scores_one(self, asin):
        product = self.shop.products.get(asin)
        if product is None:
            return False
        options = {k: v for k, v in self.goal["goal_options"].items() if v in product["options"].get(k, [])}
        return score_purchase(product, self.goal, product["pricing"][0], options)[0] == 1.0


def mistakes(goal, purchased, reward_info, max_steps):
    """What kept a purchase below score 1.0, one short phrase each (matching as score_purchase does)."""
    if purchased is None:
        return [f"no purchase: Buy Now was not clicked within {max_steps} steps"]
    if goal is None:
        return []
    bought = purchased.get("query") or purchased.get("title")
    found = [] if reward_info.get("r_type", 1.0) >= 1.0 else [f"wrong product type: bought {bought}"]
    texts = purchased["attributes"] + [str(purchased.get("title") or "").lower()]
    found += [f"missing attribute: {a}" for a in goal["attributes"] if not any(_fuzzy(a, t) or a in t for t in texts)]
    chosen = purchased["options"] if isinstance(purchased["options"], dict) else {}
    for name, value in goal["options"].items() if isinstance(goal["options"], dict) else []:
        if chosen.get(name) != value:
            found.append(f"option {name}: chose {chosen[name]}, wanted {value}" if name in chosen
                         else f"option {name}: {value} not selected")
    if not reward_info.get("r_price", True):
        found.append(f"price ${purchased.get('price')} above the ${goal['price_upper']:.2f} limit")
    return found


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Play the WebShop expert on one goal and print the episode.")
    parser.add_argument("--split", default="train", choices=SPLITS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", default=None, help="a WebShop server (default: $WEBSHOP_URL, else the mini one)")
    args = parser.parse_args()
    env = WebshopEnv(args.split, args.seed, url=args.url)
    obs, info = env.reset(args.seed)
    print(f"task: {info['task']}\n{obs}\nadmissible: {info['admissible']}")
    done = False
    while not done:
        action = env.expert_action()
        obs, reward, done, info = env.step(action)
        print(f"> {action}\n{obs}")
    print("score:", info["score"], "won:", info["won"], "mistakes:", info["gt"]["mistakes"])
