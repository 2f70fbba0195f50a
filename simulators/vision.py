"""Vision env "vision": MiniWoB-like click tasks on a screenshot, in pure numpy (no browser, no PIL).

Each step shows a 112x112x3 uint8 screenshot of a 4x4 grid of 28-pixel cells with coloured shapes in some cells,
and an instruction. Each cell's number (1-16, row by row) is drawn in black 6x10-pixel digits in the cell's
top-left 14x14 patch, the shape below and right of it, Set-of-Mark style: the action
names a cell, and a Qwen2-VL image token carries no absolute position in its features, so a model reads the
number off the pixels rather than having to count tokens. Actions are `click N` for N in 1..16, the same list for every
task, so neither the instruction nor the actions say where anything is: only the pixels do (tests/test_household.py shows a
text-only policy stays at chance). Six task families, MiniWoB in spirit:
  click-color        "Click the red shape."                  colours all differ
  click-shape        "Click the triangle."                   shapes all differ
  click-color-shape  "Click the blue circle."                every distractor shares its colour or its shape
  odd-one-out        "Click the item that differs from the others."  all alike but one (colour or shape)
  click-sequence     "Click the red shape, then the blue shape."     two steps, in that order
  click-all          "Click every square."                   two or three targets, any order
A clicked target disappears from the screenshot; a click on another item ends the episode as a failure (as a
wrong click ends a MiniWoB episode); a click on an empty cell changes nothing; anything else answers
"Nothing happens." with info["valid"] False. Reward 10 on success (like household), else 0; max_steps 6.

Splits: `train` and `valid_seen` draw from the same distribution with disjoint seed streams; in `valid_unseen`
the (first) target's (colour, shape) pair is one of the held-out pairs (crc32 % 4 == 0, HELD_OUT_PAIRS), which
train only ever shows as distractors. The expert reads the screenshot (read_screen: template matching, no hidden
state) and clicks the next target; info["gt"] on done tells the hindsight annotator where everything was.
The 28-pixel cells match Qwen2-VL's 28-pixel merged patches, so one image token sees exactly one cell.

Run: python simulators/vision.py --split valid_unseen --seed 3   (plays the expert, prints the screen as text)
"""
import argparse
import random
import re
import zlib

import numpy as np

from simulators.household import ACTIONS_LINE, HISTORY, INSTRUCTION

GRID, CELL = 4, 28
SIZE = GRID * CELL
MAX_STEPS = 6
COLORS = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30),
          "purple": (150, 60, 190), "orange": (240, 130, 20)}
SHAPES = ("circle", "square", "triangle", "diamond", "cross")
TASK_TYPES = ("click-color", "click-shape", "click-color-shape", "odd-one-out", "click-sequence", "click-all")
SPLITS = ("train", "valid_seen", "valid_unseen")
# the agent's prompt: ALFWorld's (simulators/household.py) with its own header and the task on every step, since
# the observation never states it (ours; verl-agent has no screenshot click env)
HEADER = "\nYou are an expert agent operating a web page from its screenshot. Your task is to: {task}\n"
PROMPT = {"first": HEADER + "Your current observation is: {observation}" + ACTIONS_LINE + INSTRUCTION,
          "history": HEADER + HISTORY + ACTIONS_LINE + INSTRUCTION, "action": "'{}'", "separator": "\n ",
          "tags": ("action",)}
ACTIONS = tuple(f"click {i}" for i in range(1, GRID * GRID + 1))
BACKGROUND, LINE, LABEL = 255, 215, 0
# 3x5 pixel digits for the cell numbers drawn (at double size) in each cell's top-left corner
DIGITS = ("111101101101111", "010110010010111", "111001111100111", "111001111001111", "101101111001001",
          "111100111001111", "111100111101111", "111001001001001", "111101111101111", "111101111001111")
OBSERVATION = f"The screenshot shows a {GRID}x{GRID} grid of cells numbered 1 to {GRID * GRID}, row by row."


def is_held_out(color, shape):
    """valid_unseen target pairs: a fixed quarter of (colour, shape), stable across runs and machines."""
    return zlib.crc32(f"{color} {shape}".encode()) % 4 == 0


HELD_OUT_PAIRS = frozenset((c, s) for c in COLORS for s in SHAPES if is_held_out(c, s))


def _shape_masks():
    """The shapes fill the cell below and right of its number (centre at pixel 19, radius 7.3), so the number
    keeps the cell's top-left 14x14 patch to itself."""
    y, x = np.mgrid[0:CELL, 0:CELL] - 19.0                          # pixel offsets from the shape centre
    r = CELL * 0.26
    return {"circle": x ** 2 + y ** 2 <= r ** 2,
            "square": (abs(x) <= r * 0.85) & (abs(y) <= r * 0.85),
            "triangle": (y <= r * 0.8) & (y >= -r) & (abs(x) <= (y + r) * 0.55),
            "diamond": abs(x) + abs(y) <= r * 1.15,
            "cross": ((abs(x) <= r * 0.3) | (abs(y) <= r * 0.3)) & (abs(x) <= r) & (abs(y) <= r)}


SHAPE_MASKS = _shape_masks()  # name -> (CELL, CELL) bool


def _label_mask(number):
    """(CELL, CELL) bool: the digits of `number`, each 6x10 pixels (the 3x5 glyph at double size), in the cell's
    top-left 14x14 patch: measured, a from-scratch tiny VLM learned to name a lone shape's cell with these and
    stayed at chance with 3x5 ones (docs/vision.md)."""
    mask = np.zeros((CELL, CELL), dtype=bool)
    for i, digit in enumerate(str(number)):
        glyph = np.array([c == "1" for c in DIGITS[int(digit)]]).reshape(5, 3).repeat(2, 0).repeat(2, 1)
        mask[2:12, 1 + 7 * i:7 + 7 * i] = glyph
    return mask


LABEL_MASKS = [_label_mask(cell + 1) for cell in range(GRID * GRID)]
EMPTY = np.full((SIZE, SIZE, 3), BACKGROUND, dtype=np.uint8)
EMPTY[::CELL, :] = LINE
EMPTY[:, ::CELL] = LINE
for _cell, _mask in enumerate(LABEL_MASKS):
    EMPTY[_cell // GRID * CELL:(_cell // GRID + 1) * CELL, _cell % GRID * CELL:(_cell % GRID + 1) * CELL][_mask] = LABEL


def render(items):
    """items: {cell (0-based): (colour, shape)} -> (SIZE, SIZE, 3) uint8 screenshot: grid lines, cell numbers,
    shapes."""
    image = EMPTY.copy()
    for cell, (color, shape) in items.items():
        row, col = divmod(cell, GRID)
        view = image[row * CELL:(row + 1) * CELL, col * CELL:(col + 1) * CELL]
        view[SHAPE_MASKS[shape]] = COLORS[color]
    return image


def read_screen(image):
    """The items a screenshot shows, read from its pixels alone: {cell: (colour, shape)}. A cell's item is its
    coloured (non-grey) pixels: their one colour and the shape mask they fill exactly."""
    cells = image.reshape(GRID, CELL, GRID, CELL, 3).swapaxes(1, 2).reshape(GRID * GRID, CELL, CELL, 3).astype(int)
    painted = cells.max(-1) != cells.min(-1)                        # (cells, CELL, CELL): grey is background
    items = {}
    for cell in np.flatnonzero(painted.any((1, 2))):
        pixels = cells[cell][painted[cell]]                         # (n, 3)
        color = next((c for c, rgb in COLORS.items() if (pixels == rgb).all()), None)
        shape = next((s for s, mask in SHAPE_MASKS.items() if (painted[cell] == mask).all()), None)
        if color and shape:
            items[int(cell)] = (color, shape)
    return items


class VisionEnv:
    """Screenshot click tasks (module docstring): reset(seed) -> (obs, info); step(action) -> (obs, reward, done, info).
    obs = {"text": str, "image": (112, 112, 3) uint8}."""

    def __init__(self, split="train", seed=0, max_steps=MAX_STEPS):
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        self.split, self.max_steps = split, max_steps
        self._seed_stream = random.Random(f"vision/{split}/stream/{seed}")

    # ---- task generation ----
    def _target_pair(self, rng, colors=COLORS, shapes=SHAPES):
        """A (colour, shape) on the right side of the split's held-out rule."""
        pairs = [(c, s) for c in colors for s in shapes if is_held_out(c, s) == (self.split == "valid_unseen")]
        return rng.choice(pairs)

    def _generate(self, rng):
        family = rng.choice(TASK_TYPES)
        count = rng.randint(3, 5)
        color, shape = self._target_pair(rng)
        other_colors = [c for c in COLORS if c != color]
        other_shapes = [s for s in SHAPES if s != shape]
        if family == "click-color":
            items = [(color, shape)] + [(c, rng.choice(SHAPES)) for c in rng.sample(other_colors, count - 1)]
            task = f"Click the {color} shape."
        elif family == "click-shape":
            items = [(color, shape)] + [(rng.choice(list(COLORS)), s) for s in rng.sample(other_shapes, count - 1)]
            task = f"Click the {shape}."
        elif family == "click-color-shape":  # each distractor shares exactly one attribute with the target
            items = [(color, shape)] + [(color, rng.choice(other_shapes)) if rng.random() < 0.5
                                        else (rng.choice(other_colors), shape) for _ in range(count - 1)]
            task = f"Click the {color} {shape}."
        elif family == "odd-one-out":  # the target is the odd one; the others share one look
            if rng.random() < 0.5:
                common = (rng.choice(other_colors), shape)
            else:
                common = (color, rng.choice(other_shapes))
            items = [(color, shape)] + [common] * rng.randint(3, 5)
            task = "Click the item that differs from the others."
        elif family == "click-sequence":
            second = rng.choice(other_colors)
            rest = rng.sample([c for c in other_colors if c != second], count - 2)
            items = [(color, shape), (second, rng.choice(SHAPES))] + [(c, rng.choice(SHAPES)) for c in rest]
            task = f"Click the {color} shape, then the {second} shape."
        else:  # click-all
            n_targets = rng.randint(2, 3)
            items = [(color, shape)] + [(rng.choice(list(COLORS)), shape) for _ in range(n_targets - 1)]
            items += [(rng.choice(list(COLORS)), rng.choice(other_shapes)) for _ in range(rng.randint(1, 3))]
            task = f"Click every {shape}."
        cells = rng.sample(range(GRID * GRID), len(items))
        self.items = dict(zip(cells, items))
        n_targets = {"click-sequence": 2, "click-all": sum(s == shape for _, s in items)}.get(family, 1)
        self.targets = cells[:n_targets]  # in the required order (click-all: any order)
        self.task_type, self.task = family, task

    # ---- gym interface ----
    def reset(self, seed=None):
        if seed is None:
            seed = self._seed_stream.randrange(2 ** 31)
        self.seed = seed
        self._generate(random.Random(f"vision/{self.split}/{seed}"))
        self._noise_rng = random.Random(f"vision/{self.split}/noise/{seed}")
        self.initial_items = dict(self.items)
        self.clicked, self.steps, self.invalid_steps = [], 0, []
        self.done = self.won = False
        self.mistake = None
        return self._observation(OBSERVATION), self._info(valid=True)

    def step(self, action):
        if self.done:
            return self._observation("The episode is over."), 0.0, True, self._info(valid=False)
        self.steps += 1
        match = re.fullmatch(r"click\s+(?:cell\s+)?(\d+)", " ".join(str(action or "").lower().split()))
        cell = int(match.group(1)) - 1 if match else -1
        if not 0 <= cell < GRID * GRID:
            self.invalid_steps.append(self.steps - 1)
            text, valid = "Nothing happens.", False
        elif cell not in self.items:
            text, valid = f"You clicked cell {cell + 1}: it is empty.", True
            self.clicked.append((cell, None))
        else:
            valid = True
            item = self.items[cell]
            self.clicked.append((cell, item))
            expected = self.targets[:1] if self.task_type == "click-sequence" else self.targets
            if cell in expected:
                del self.items[cell]
                self.targets.remove(cell)
                text = f"You clicked cell {cell + 1}: the item disappeared."
                self.won = self.done = not self.targets
            else:
                text = f"You clicked cell {cell + 1}: wrong item, the task failed."
                self.mistake, self.done = {"cell": cell, "item": item, "step": self.steps - 1}, True
        if self.steps >= self.max_steps:
            self.done = True
        return self._observation(text), 10.0 if self.won else 0.0, self.done, self._info(valid)

    def _observation(self, text):
        return {"text": text, "image": render(self.items)}

    def _info(self, valid):
        info = {"task": self.task, "admissible": list(ACTIONS), "won": self.won, "valid": valid,
                "task_type": self.task_type}
        if self.done:
            info["gt"] = {"env": "vision", "task_type": self.task_type, "task": self.task, "won": self.won,
                          "steps": self.steps, "max_steps": self.max_steps, "invalid_steps": list(self.invalid_steps),
                          "items": {c + 1: list(v) for c, v in sorted(self.initial_items.items())},
                          "targets": [c + 1 for c in self._all_targets()],
                          "clicked": [[c + 1, list(v) if v else None] for c, v in self.clicked],
                          "mistake": self.mistake and {**self.mistake, "cell": self.mistake["cell"] + 1},
                          "split": self.split, "seed": self.seed}
        return info

    def _all_targets(self):
        """Every target cell of the episode in the order it must be clicked (clicked ones first)."""
        hits = [c for c, v in self.clicked if v is not None and (self.mistake is None or c != self.mistake["cell"])]
        return hits + [c for c in self.targets if c not in hits]

    # ---- expert ----
    def expert_action(self, epsilon=0.0, rng=None, oracle=False):
        """Click the next target, found in the screenshot by read_screen (pixels and instruction only); with
        probability epsilon a different action (noisy demonstrations). oracle is accepted for the warm-up's
        interface: the expert already sees everything a skill could tell it."""
        best = f"click {self._expert_cell() + 1}"
        rng = rng or self._noise_rng
        if epsilon > 0 and rng.random() < epsilon:
            return rng.choice([a for a in ACTIONS if a != best])
        return best

    def _expert_cell(self):
        screen = read_screen(render(self.items))
        words = self.task.rstrip(".").lower().split()
        if self.task_type == "odd-one-out":
            looks = list(screen.values())
            return next(c for c, look in screen.items() if looks.count(look) == 1)
        if self.task_type == "click-sequence":  # the first colour gone from the screen: it was clicked
            color = words[2] if any(col == words[2] for col, _ in screen.values()) else words[6]
            return next(c for c, (col, _) in screen.items() if col == color)
        if self.task_type == "click-color":
            return next(c for c, (color, _) in screen.items() if color == words[2])
        if self.task_type == "click-color-shape":
            return next(c for c, look in screen.items() if look == (words[2], words[3]))
        shape = words[-1]  # click-shape "click the triangle", click-all "click every triangle"
        return next(c for c, (_, s) in sorted(screen.items()) if s == shape)


def ascii_screen(image):
    """The screenshot as text, one letter pair per cell (colour, shape) -- for the command-line demo only."""
    screen = read_screen(image)
    return "\n".join(" ".join(f"{screen[c][0][:2]}-{screen[c][1][:3]}" if c in screen else "  .   "
                              for c in range(r * GRID, (r + 1) * GRID)) for r in range(GRID))


# ---------------------------------------------------------------------- stage-1 annotation

def annotate(trajectory, gt, rng):
    """The stage-1 hindsight annotator of this env (envs.py names it): vision_annotations' summary and one of its
    skills, drawn by rng (a random.Random)."""
    summary, options = vision_annotations(gt)
    return summary, rng.choice(options)


def names_fix(trajectory, skill):
    """Whether a skill about a failed episode names its fix (the self-analysis probe's "fixing skills"): the cell
    of the wrong click that ended it, or, after invalid answers, the click format. None for a success and for a
    failure on empty cells (its text shows no fix); False for a skill that did not parse."""
    gt = trajectory.gt or {}
    if trajectory.won or not (gt.get("mistake") or gt.get("invalid_steps")):
        return None
    if not skill:
        return False
    return f"cell {gt['mistake']['cell']}" in skill.lower() if gt.get("mistake") else "click" in skill.lower()


def vision_annotations(gt):
    """(summary, the skills the annotator may write) for a screenshot click episode's gt: only what the episode's
    text shows, for a success the target cells, for a failure the cell clicked wrongly or in vain. Not where a
    missed target was nor what an item looked like: an analyzer that reads the screen no better than the policy
    could only guess those, and a teacher given a guess pushes towards it (docs/vision.md)."""
    targets = " then ".join(f"cell {c}" for c in gt["targets"])
    clicks = [f"cell {c}" for c, _ in gt["clicked"]] or ["nothing"]
    if gt["won"]:  # the cells, not their looks: the text shows which clicks made an item disappear, not its colour
        return (f"The agent solved '{gt['task']}' by clicking {', '.join(clicks)}.",
                [f"For '{gt['task']}' the targets were {targets}; find them by colour and shape.",
                 f"'{gt['task']}': click {targets}; read colour and shape before each click."])
    mistake = gt.get("mistake")
    if mistake:
        return (f"The agent failed '{gt['task']}': it clicked cell {mistake['cell']}, a wrong item.",
                [f"Mistake: cell {mistake['cell']} was not what '{gt['task']}' asks for; check colour and shape "
                 "before clicking.",
                 f"Avoid cell {mistake['cell']}: the wrong item for '{gt['task']}'. Click only an item whose colour "
                 "and shape match."])
    what = "invalid actions" if gt.get("invalid_steps") else "empty cells"
    return (f"The agent failed '{gt['task']}': it used its steps on {what} ({', '.join(clicks)}).",
            [f"Answer 'click N' with the cell of the item '{gt['task']}' names, not {what}.",
             f"Do not waste steps on {what} ({', '.join(clicks)}); find the item the task names and click its cell."])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Play the vision expert on one task and print the screens.")
    parser.add_argument("--split", default="train", choices=SPLITS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    env = VisionEnv(args.split, args.seed)
    obs, info = env.reset(args.seed)
    print(f"{info['task']} ({info['task_type']})\n{ascii_screen(obs['image'])}")
    done = False
    while not done:
        action = env.expert_action()
        obs, reward, done, info = env.step(action)
        print(f"> {action}\n{obs['text']}\n{ascii_screen(obs['image'])}")
    print("won:", info["won"], "gt:", info["gt"])
