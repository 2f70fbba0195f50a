"""EZPoints env "ezpoints": gym_cards' EZPoints (RL4VLM, used by verl-agent) in pure numpy, with the cards in words.

Two playing cards are dealt; the agent builds a formula worth 12 from both card numbers, each used once, one
token a step, and ends it with "=". Taken from gym_cards (RL4VLM's gym-cards/gym_cards/envs/ezpoints.py, the copy
in verl-agent's env_package/gym_cards): the 13 actions "1".."10", "+", "*", "=" (no "-", "/" or brackets in
EZPoints); J, Q and K count 10 and the first card is 2..K; the deal: the second card is 12 // first (when the first
is 2, 3, 4 or 6, half the time) else 12 - first, then the two are swapped half the time, so every deal has a
solution; a number that is not on the cards, or is used up, is refused with reward -1 and leaves a blank in the
formula; operators are never refused; "=" scores the formula: +10 when it equals 12 with both cards used (won), else
-1, and ends the episode; an action on a formula of more than 5 tokens ends it with -1. max_steps 8 (SEED's
examples/seed_trainer/_common/ezpoints.sh, env.max_steps=8).

The observation is {"text", "image"}: the text says what the last token did and shows the formula so far (as
verl-agent prints it, tokens joined, blanks as spaces) and (text_cards=True) the two cards in words, so a text-only
model can play; the image is 112x112x3 uint8: two white cards on gym_cards' green table, each with its rank in
3x5-pixel glyphs (large in the middle, small in the corner with a suit mark), red for hearts and diamonds, black for
spades and clubs, and the formula in white glyphs below.

Departures from gym_cards / verl-agent:
  - the formula is scored without eval: tokens joined as gym_cards joins them and read as Python reads them
    (unary plus, "57" from "5" then "7", "5 7" a syntax error), except that "**" (power, which can never make 12
    from two cards) is a syntax error here;
  - what verl-agent's projection (env_package/gym_cards/projection.py) does with the text inside <action>: it is
    lowercased, "10" is taken out first, and the action counts when exactly one token remains in it ("5", "'+'",
    "append 7" are valid; "5+7", "12" and "" are not); text that names no single token answers "Nothing
    happens." with reward 0 and info["valid"] False (verl-agent's newer no-op action -1) and takes one of the
    max_steps; a refused number has info["valid"] False too;
  - an over-long formula ends the episode (gym_cards only truncates and keeps answering -1 until max_steps);
  - the images are drawn here, in 3x5-pixel glyphs like simulators/vision.py's digits (gym_cards pastes card
    pictures with PIL on 300x300);
  - splits: train and valid_seen draw from gym_cards' deal with disjoint seed streams; valid_unseen deals only the
    held-out card pairs HELD_OUT_PAIRS, which train never deals: one pair per family, each of whose ranks train
    still shows in another pair (3 and 4, 6 and 6);
  - task_type: "ezpoints-sum" (a + b = 12) or "ezpoints-product" (a * b = 12), the operator the solution needs;
  - the expert (expert_action) enumerates token sequences for the shortest completion worth 12; info["gt"] on
    done has the cards, the tokens taken, a correct formula and the first wrong token, for annotate.

Run: python envs.py --env ezpoints --split valid_seen --seed 3   (plays the expert, prints the episode)
"""
import collections
import random
import re

import numpy as np

TARGET = 12
MAX_STEPS = 8
MAX_SCORED_TOKENS = 5            # gym_cards ends the episode on any action once the formula is longer
SPLITS = ("train", "valid_seen", "valid_unseen")
TASK_TYPES = ("ezpoints-sum", "ezpoints-product")
TASK = "Build a formula equal to 12 with the two cards."
ACTIONS = tuple(str(n) for n in range(1, 11)) + ("+", "*", "=")
OPERATORS = ("+", "*")
SUITS = ("hearts", "spades", "diamonds", "clubs")
FACES = {11: ("J", "jack"), 12: ("Q", "queen"), 13: ("K", "king")}
HELD_OUT_PAIRS = frozenset({"3 4", "6 6"})
BLANK = " "                      # what gym_cards writes into the formula for a refused number

W, H = 112, 112
TABLE, CARD, BORDER = (53, 101, 77), (250, 250, 250), (150, 150, 150)   # the table is gym_cards' #35654d
RED, BLACK, WHITE = (200, 30, 30), (20, 20, 20), (255, 255, 255)
CARD_W, CARD_H, CARD_TOP, CARD_LEFTS = 44, 64, 8, (8, 60)
FORMULA_TOP, FORMULA_LEFT = 86, 6
# 3x5 glyphs, row by row: the digits (vision.py's), the face letters and the operators
GLYPHS = {"0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
          "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
          "8": "111101111101111", "9": "111101111001111",
          "J": "001001001101010", "Q": "010101101111011", "K": "101101110101101",
          "+": "000010111010000", "*": "000101010101000", "=": "000111000111000"}
SUIT_GLYPHS = {"hearts": "0101011111111110111000100", "diamonds": "0010001110111110111000100",
               "spades": "0010001110111110010001110", "clubs": "0111001110111110010001110"}

# verl-agent's GYM_CARDS_EZPOINTS_TEMPLATE (agent_system/environments/prompts/gym_cards.py) with this contract's
# answer format (<think>, <action>) in place of its JSON, the task line (where the teacher's skill block goes), the
# rewards gym_cards really gives (-1, where the template says 0) and a history variant (verl-agent has none: the
# formula is the state) in the words of its other templates; its Ace line is left out: EZPoints deals no ace.
_EZPOINTS_HEAD = ("\nYou are an expert card game player helping to build a math formula that evaluates to **12**, "
                  "using only the two numbers shown on the playing cards in the image.\nYour task is to: {task}\nYou "
                  "may choose from the following actions: one of the two available card numbers, the operators '+' "
                  "or '*', or the equals sign '='. You must build the formula step by step, adding only one "
                  "character at a time to the end of the current formula.\n\nCard Rules:\n1. The image shows exactly "
                  "two playing cards.\n2. Each card represents one number:\n   - Number cards (2\u201310) equal their "
                  "face value.\n   - Face cards ('J', 'Q', 'K') are treated as the number 10.\n3. You can only use "
                  "these two card numbers \u2014 no other numbers are allowed.\n4. Each number can be used only once "
                  "in the formula.\n\nFormula Rules:\n1. At each step, you append only one character: a number (from "
                  "the two card values), an operator ('+' or '*'), or '='.\n2. Once you add '=', the formula is "
                  "evaluated and the game ends.\n\nRewards:\n+10: if the formula evaluates exactly to 12.\n-1: for a "
                  "number not shown on the cards or already used, and for a formula that is not 12 (e.g. incorrect "
                  "syntax) when you add '='.\n\n")
_EZPOINTS_TAIL = ("\nYour admissible actions are [{admissible_actions}].\n\nNow it's your turn to append the next "
                  "character.\nYou should first reason step-by-step: identify the two card numbers, review the "
                  "current formula, and choose the next valid character to reach 12. This reasoning process MUST be "
                  "enclosed within <think> </think> tags. \nOnce you've finished your reasoning, you should choose "
                  "an admissible action for current step and present it within <action> </action> tags.\n")
PROMPT = {
    "first": _EZPOINTS_HEAD + "Your current observation is: {observation}" + _EZPOINTS_TAIL,
    "history": _EZPOINTS_HEAD + "Prior to this step, you have already taken {step_count} step(s). Below are the most "
                                "recent {history_length} observations and the corresponding actions you took: "
                                "{action_history}\nYou are now at step {current_step} and your current observation "
                                "is: {observation}" + _EZPOINTS_TAIL,
    "action": "'{}'",
    "separator": ", ",
    "tags": ("action",),
}


def card_value(rank):
    return min(rank, 10)


def rank_label(rank):
    return FACES[rank][0] if rank in FACES else str(rank)


def card_words(rank, suit):
    return f"{FACES[rank][1] if rank in FACES else rank} of {suit}"


def pair_name(ranks):
    """The unordered card pair as HELD_OUT_PAIRS writes it: "3 4", "2 K"."""
    return " ".join(rank_label(rank) for rank in sorted(ranks))


def family(numbers):
    return "ezpoints-product" if numbers[0] * numbers[1] == TARGET else "ezpoints-sum"


def deal(rng):
    """Two (rank, suit) cards by gym_cards' rule: rank 2..13, the second making 12 with the first by * or +."""
    first = rng.randint(2, 13)
    value = card_value(first)
    second = TARGET // value if value in (2, 3, 4, 6) and rng.random() <= 0.5 else TARGET - value
    cards = [(first, rng.choice(SUITS)), (second, rng.choice(SUITS))]
    return cards[::-1] if rng.random() <= 0.5 else cards


def evaluate(formula):
    """The value of the formula tokens joined as gym_cards joins them, read as Python reads +, * and numbers
    (unary plus allowed: "5*+7" is 35), or None for a syntax error."""
    terms, product, expect_number = [], 1, True
    for piece in re.findall(r"\d+|\S", "".join(formula)):  # numbers apart only by blanks stay two pieces: an error
        if expect_number and piece == "+":
            continue
        if expect_number and piece.isdigit():
            product, expect_number = product * int(piece), False
        elif not expect_number and piece in OPERATORS:
            if piece == "+":
                terms.append(product)
                product = 1
            expect_number = True
        else:
            return None
    return None if expect_number else sum(terms) + product


def shortest_completion(formula, used, numbers):
    """The fewest tokens (ending with "=") that finish `formula` with the value 12 and both cards used, trying
    the unused card numbers (in card order), then "+", "*", "=" at each step; None when none can."""
    start = (tuple(formula), tuple(used))
    parent, queue = {start: None}, collections.deque([start])
    while queue:
        state = queue.popleft()
        tokens, spent = state
        if len(tokens) > MAX_SCORED_TOKENS:
            continue
        if len(spent) == 2 and evaluate(tokens) == TARGET:
            plan = ["="]
            while parent[state] is not None:
                state, token = parent[state]
                plan.append(token)
            return plan[::-1]
        left = list(numbers)
        for value in spent:
            left.remove(value)
        for token in [str(v) for v in dict.fromkeys(left)] + list(OPERATORS):
            following = (tokens + (token,), spent + ((int(token),) if token.isdigit() else ()))
            if following not in parent:
                parent[following] = (state, token)
                queue.append(following)
    return None


def parse_token(action):
    """verl-agent's gym_cards projection on the text inside <action>: lowercased, "10" taken out first, the
    token when exactly one distinct token is in it, else None."""
    text = action.lower() if isinstance(action, str) else ""
    found = set()
    if "10" in text:
        found.add("10")
        text = text.replace("10", "")
    found |= {token for token in ACTIONS if token in text}
    return found.pop() if len(found) == 1 else None


# ---------------------------------------------------------------------------- pictures

def _glyph_mask(bits, scale, width=3):
    return np.array([b == "1" for b in bits]).reshape(-1, width).repeat(scale, 0).repeat(scale, 1)


def _stamp(image, text, top, left, scale, color):
    """Draws `text` in 3x5 glyphs (scale x scale pixels each), a glyph-wide gap for a blank; returns the end x."""
    for char in text:
        if char in GLYPHS:
            mask = _glyph_mask(GLYPHS[char], scale)
            image[top:top + mask.shape[0], left:left + mask.shape[1]][mask] = color
        left += 4 * scale
    return left


def render(cards, formula):
    """(112, 112, 3) uint8: the two cards on the table and the formula below them."""
    image = np.empty((H, W, 3), dtype=np.uint8)
    image[:] = TABLE
    for (rank, suit), left in zip(cards, CARD_LEFTS):
        color = RED if suit in ("hearts", "diamonds") else BLACK
        view = image[CARD_TOP:CARD_TOP + CARD_H, left:left + CARD_W]
        view[:] = BORDER
        view[1:-1, 1:-1] = CARD
        label = rank_label(rank)
        _stamp(view, label, 3, 3, 2, color)
        view[14:19, 4:9][_glyph_mask(SUIT_GLYPHS[suit], 1, 5)] = color
        width = 4 * 4 * len(label) - 4
        _stamp(view, label, (CARD_H - 20) // 2, (CARD_W - width) // 2, 4, color)
    _stamp(image, "".join(formula), FORMULA_TOP, FORMULA_LEFT, 2, WHITE)
    return image


class EzpointsEnv:
    """EZPoints (module docstring): reset(seed) -> (obs, info); step(action) -> (obs, reward, done, info).
    obs = {"text": str, "image": (112, 112, 3) uint8}."""

    def __init__(self, split="train", seed=0, max_steps=MAX_STEPS, text_cards=True):
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        self.split, self.max_steps, self.text_cards = split, max_steps, text_cards
        self._seed_stream = random.Random(f"ezpoints/{split}/stream/{seed}")

    def _deal(self, rng):
        """Two cards by gym_cards' deal, dealt again until the pair is on the split's side of HELD_OUT_PAIRS."""
        while True:
            cards = deal(rng)
            if (pair_name([rank for rank, _ in cards]) in HELD_OUT_PAIRS) == (self.split == "valid_unseen"):
                return cards

    # ---- gym interface ----
    def reset(self, seed=None):
        if seed is None:
            seed = self._seed_stream.randrange(2 ** 31)
        self.seed = seed
        self.cards = self._deal(random.Random(f"ezpoints/{self.split}/{seed}"))
        self._noise_rng = random.Random(f"ezpoints/{self.split}/noise/{seed}")
        self.numbers = [card_value(rank) for rank, _ in self.cards]
        self.task_type = family(self.numbers)
        self.solution = "".join(shortest_completion([], [], self.numbers)[:-1])
        self.formula, self.used, self.tokens, self.invalid_steps = [], [], [], []
        self.steps, self.done, self.won = 0, False, False
        self.value = self.first_wrong = self.end = None
        return self._observation("The cards are dealt."), self._info(valid=True)

    def step(self, action):
        if self.done:
            return self._observation("The episode is over."), 0.0, True, self._info(valid=False)
        self.steps += 1
        token, before = parse_token(action), "".join(self.formula)
        self.tokens.append(token)
        reward, valid = 0.0, token is not None
        if token is None:
            text = "Nothing happens."
        elif len(self.formula) > MAX_SCORED_TOKENS:
            reward, self.done, self.end = -1.0, True, "too long"
            text = "The formula is too long: the game ends."
            self._mistake(token, "too long", before)
        elif token.isdigit() and self.used.count(int(token)) >= self.numbers.count(int(token)):
            reward, valid = -1.0, False
            self.formula.append(BLANK)
            text = f"{token} is not a card number you can still use."
            self._mistake(token, "reused" if int(token) in self.numbers else "not a card", before)
        elif token == "=":
            self.value = evaluate(self.formula)
            self.won = self.value == TARGET and len(self.used) == 2
            reward, self.done, self.end = (10.0 if self.won else -1.0), True, "equals"
            worth = "is not a formula" if self.value is None else f"equals {self.value}"
            text = f"The formula {''.join(self.formula) or 'is empty and'} {worth}."
            if not self.won:
                self._mistake(token, "not twelve", before)
        else:
            self.formula.append(token)
            self.used += [int(token)] if token.isdigit() else []
            text = f"You appended {token}."
            if shortest_completion(self.formula, self.used, self.numbers) is None:
                self._mistake(token, "dead end", before)
        if not valid:
            self.invalid_steps.append(self.steps - 1)
        if self.steps >= self.max_steps and not self.done:
            self.done, self.end = True, "max steps"
        return self._observation(text), reward, self.done, self._info(valid)

    def _mistake(self, token, reason, formula_before):
        """Keeps the episode's first wrong token: the step, the token, why it was wrong and the formula before it."""
        if self.first_wrong is None:
            self.first_wrong = {"step": self.steps - 1, "token": token, "reason": reason,
                                "formula_before": formula_before}

    def _observation(self, text):
        text = f"{text} The formula so far: '{''.join(self.formula)}'."
        if self.text_cards:
            faces = " (a jack, queen or king counts as 10)" if any(rank in FACES for rank, _ in self.cards) else ""
            text += f" Your cards: the {card_words(*self.cards[0])} and the {card_words(*self.cards[1])}{faces}."
        return {"text": text, "image": render(self.cards, self.formula)}

    def _info(self, valid):
        info = {"task": TASK, "admissible": list(ACTIONS), "won": self.won, "valid": valid,
                "task_type": self.task_type}
        if self.done:
            info["gt"] = {"env": "ezpoints", "task": TASK, "task_type": self.task_type, "won": self.won,
                          "steps": self.steps, "max_steps": self.max_steps, "invalid_steps": list(self.invalid_steps),
                          "cards": [card_words(*card) for card in self.cards],
                          "ranks": [rank_label(rank) for rank, _ in self.cards], "numbers": list(self.numbers),
                          "tokens": list(self.tokens), "formula": "".join(self.formula), "value": self.value,
                          "solution": self.solution, "first_wrong": self.first_wrong, "end": self.end,
                          "split": self.split, "seed": self.seed}
        return info

    # ---- expert ----
    def _plan(self):
        return shortest_completion(self.formula, self.used, self.numbers)

    def expert_action(self, epsilon=0.0, rng=None, oracle=False):
        """The next token of the shortest formula worth 12 ("=" at once when none is left: the formula is lost);
        with probability epsilon a different action instead (noisy demonstrations). oracle is accepted for the
        warm-up's interface: the expert already sees everything."""
        plan = self._plan()
        best = plan[0] if plan else "="
        rng = rng or self._noise_rng
        if epsilon > 0 and rng.random() < epsilon:
            return rng.choice([a for a in ACTIONS if a != best])
        return best

    def expert_thought(self, action):
        """A short reason (<= 12 words) for appending `action` now, from the shortest formula worth 12."""
        token, plan = parse_token(action), self._plan()
        if token is None:
            return "answer with one token: a card number, +, * or ="
        if plan is None:
            return "12 is out of reach now, so end with =" if token == "=" else f"12 is out of reach; try {token}"
        formula = "".join(self.formula) + "".join(plan[:-1])
        first, second = self.numbers
        if token != plan[0]:
            return f"{token} does not lead to 12; {formula} does"
        if token == "=":
            return f"{formula} equals 12, so close with ="
        if token in OPERATORS:
            return f"{formula} makes 12, so append {token}"
        if not self.formula:
            return f"the cards are worth {first} and {second}: {formula}, start with {token}"
        return f"finish {formula} with the {token}"


# ---------------------------------------------------------------------------- hindsight annotator

def annotate(trajectory, gt, rng):
    """(summary, skill) for a finished EZPoints episode from its gt: for a success the formula pattern; for a
    failure the first wrong token and the formula that works. rng (random.Random) picks one of two phrasings."""
    first, second = gt["numbers"]
    cards = " and ".join(gt["cards"])
    operation = "multiply" if gt["task_type"] == "ezpoints-product" else "add"
    sign = "*" if operation == "multiply" else "+"
    faces = " A face card counts as 10." if any(rank in "JQK" for rank in gt["ranks"]) else ""
    task = getattr(trajectory, "task", gt["task"])
    wrong = gt["first_wrong"]
    if gt["won"]:
        summary = f"The agent solved '{task}' with the {cards}: {''.join(gt['formula'].split())} = 12."
        options = [f"Read both card numbers first; when they {operation} to 12, write one number, then {sign}, then "
                   f"the other, then the equals sign.{faces}",
                   f"For {first} and {second} the pattern is number, {sign}, number, equals: check whether the sum "
                   f"or the product is 12 before the first token.{faces}"]
    elif wrong and wrong["reason"] in ("not a card", "reused"):  # "too long" falls through to the last case
        what = "is not on the cards" if wrong["reason"] == "not a card" else "was already used"
        summary = f"The agent failed '{task}': at step {wrong['step'] + 1} it chose {wrong['token']}, which {what}."
        options = [f"Use only the two card numbers, each once: {wrong['token']} {what}. The cards were {first} and "
                   f"{second}, and {gt['solution']} makes 12.{faces}",
                   f"Mistake: {wrong['token']} {what}. Read the cards before choosing a number; with {first} and "
                   f"{second} the formula is {gt['solution']}, then the equals sign."]
    elif wrong and wrong["reason"] == "dead end":
        after = f"after '{wrong['formula_before']}'" if wrong["formula_before"] else "at the start"
        summary = f"The agent failed '{task}': the token {wrong['token']} {after} could no longer give 12."
        options = [f"The cards {first} and {second} {operation} to 12, so the formula is {gt['solution']}; the "
                   f"token {wrong['token']} {after} was the mistake.{faces}",
                   f"Check the operator before writing it: with {first} and {second} only {sign} reaches 12, as in "
                   f"{gt['solution']}. Then add the other number and the equals sign."]
    elif wrong and wrong["reason"] == "not twelve":
        worth = "is not a formula" if gt["value"] is None else f"equals {gt['value']}"
        summary = f"The agent failed '{task}': it ended with '=' while '{gt['formula']}' {worth}."
        options = [f"Add the equals sign only when the formula uses both cards and equals 12: with {first} and "
                   f"{second} that is {gt['solution']}.{faces}",
                   f"Do not close the formula early: '{gt['formula']}' {worth}. Write {gt['solution']} first, one "
                   "token a step, then the equals sign."]
    else:
        count = len(gt["invalid_steps"])
        summary = f"The agent failed '{task}': the steps ran out ({count} answers were not a token)."
        options = [f"Answer with one token a step, a card number, {sign} or the equals sign; here {gt['solution']} "
                   "and then the equals sign wins.",
                   f"Do not waste steps on answers that are not tokens; build {gt['solution']} token by token and "
                   "finish with the equals sign."]
    return summary, rng.choice(options)
