"""Sokoban env "sokoban": verl-agent's Sokoban 6x6 (gym-sokoban, one box) in pure numpy, with a text grid and a picture.

One 6x6 room per seed, the outer ring walls (verl-agent's dim_room (6, 6): a 4x4 inside), one box (num_boxes=1, as
verl-agent's sokoban config) and as many targets. Actions are verl-agent's words "up", "down", "left", "right":
each walks one cell and pushes a box it walks into, when the cell behind the box is free (gym-sokoban's push
actions 1-4). Rewards are gym-sokoban's: -0.1 per step, +1 when a push puts a box on a target, -1 when one pushes
it off, +10 when every box is on a target (the episode is then won and over); max_steps 15 (SEED's
examples/seed_trainer/_common/sokoban_visual.sh, env.max_steps=15).

The observation is {"text", "image"}: the text is one line saying what the last move did, then (text_grid=True)
the room row by row in verl-agent's symbols (# wall, _ floor, O target, X box, P player, √ box on target,
S player on target), space-separated as verl-agent's "list" render mode, so a text-only model can play; the image
is 96x96x3 uint8, 16-pixel tiles like gym-sokoban's rgb_array, drawn here in numpy (red brick walls, black floor,
targets outlined in red with a red diamond, a yellow box with an orange X (green X on a target), a green player
with two antennae and black eyes).

Departures from gym-sokoban / verl-agent:
  - levels: the floor is a random walk over the 4x4 inside (20 steps, gym-sokoban's 1.7 x (6 + 6), turning with
    probability 0.35 as gym-sokoban's), then player, boxes and targets are placed at random and the level is kept
    only when the BFS solver below solves it in 3 to 12 moves (unsolvable and trivial levels are drawn again);
    gym-sokoban instead places the boxes by reverse play (pulls) from the targets, so its layouts differ;
  - what verl-agent's projection (env_package/sokoban/projection.py) does with the text inside <action>: it is
    lowercased and the first of up, down, left, right found in it is taken ("UP", "up up", "move left" are
    valid; "down-right" is "down", as the projection checks the words in that order); text with none of them,
    and "still" (its invalid action 0), answers "Nothing happens." with info["valid"] False and reward 0, and
    takes one of the max_steps (verl-agent's loop counts the turn too); a move into a wall or a stuck box is
    valid (a real action: -0.1, nothing moves);
  - splits: train and valid_seen draw from one distribution with disjoint seed streams; valid_unseen only
    draws rooms whose wall pattern (the 4x4 inside) is held out (crc32 % 4 == 0, is_held_out), which train
    never generates; gym-sokoban has no such split (verl-agent only takes validation seeds from another range);
  - task_type: "sokoban-short" (an optimal solution of at most 4 moves) or "sokoban-long" (5 to 12);
  - the expert (expert_action) replans with the BFS solver at every step; info["gt"] on done has the level, an
    optimal solution, the moves taken and the first step after which the level could no longer be solved (a box
    stuck, and whether in a corner), for the rule-based annotator (annotate).

Run: python envs.py --env sokoban --split valid_seen --seed 3   (plays the expert, prints the episode)
"""
import collections
import itertools
import random
import zlib

import numpy as np

ROOM, TILE = 6, 16
SIZE = ROOM * TILE
MAX_STEPS = 15
NUM_BOXES = 1
WALK_STEPS, TURN_PROBABILITY = int(1.7 * (ROOM + ROOM)), 0.35
MIN_SOLUTION, MAX_SOLUTION, SHORT_SOLUTION = 3, 12, 4
SPLITS = ("train", "valid_seen", "valid_unseen")
TASK_TYPES = ("sokoban-short", "sokoban-long")
TASK = "Push every box onto a target."
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
ACTIONS = tuple(MOVES)
INSIDE = tuple((r, c) for r in range(1, ROOM - 1) for c in range(1, ROOM - 1))
TEXT_HELP = "The room, row by row:"  # the prompt names the symbols

# verl-agent's SOKOBAN_TEMPLATE_NO_HIS / SOKOBAN_TEMPLATE (agent_system/environments/prompts/sokoban.py), its text and
# visual versions in one: the task line (where the teacher's skill block goes), the admissible actions and the
# picture's tiles adapted to this env; "observaitons" is verl-agent's spelling.
_SOKOBAN_HEAD = """
You are an expert agent operating in the Sokoban environment.
Your task is to: {task}

# Symbols and Their Meaning
- Walls (`#`): These block movement. You can't move through or push anything into walls.
- Floor (`_`): Open spaces where you can walk and move boxes.
- Targets (`O`): The spots where boxes need to go.
- Boxes (`X`): These are what you need to push onto the targets.
- Player (`P`): That's you! You'll move around the grid to push boxes.
- Box on Target (`\u221a`): A box successfully placed on a target.
- Player on Target (`S`): You standing on a target.
The image shows the same room: red brick walls, black floor, a green figure with two antennae (you), a yellow box \
with an orange X (a green X once it is on a target), and targets outlined in red with a red diamond.

# Rules
You can only push boxes. You can't pull them, so plan ahead to avoid getting stuck.
You can't walk through or push boxes into walls (`#`).
To avoid traps, do not push boxes into corners or against walls where they can't be moved again.

# Current Step
"""
_SOKOBAN_TAIL = ("\nYour admissible actions are [{admissible_actions}].\n\n"
                 "Now it's your turn to make a move (choose ONE action only for the current step).\n"
                 "You should first reason step-by-step about the current situation \u2014 observe the positions of "
                 "boxes and targets, plan a path to push a box toward a target, and avoid traps like corners or "
                 "walls. This reasoning process MUST be enclosed within <think> </think> tags. \nOnce you've "
                 "finished your reasoning, you should choose an admissible action for current step and present it "
                 "within <action> </action> tags.\n")
PROMPT = {
    "first": _SOKOBAN_HEAD + "Your current observation is:\n{observation}" + _SOKOBAN_TAIL,
    "history": _SOKOBAN_HEAD + "Prior to this step, you have already taken {step_count} step(s). Below are the most "
                               "recent {history_length} observaitons and the corresponding actions you took: "
                               "{action_history}\nYou are now at step {current_step} and your current observation "
                               "is:\n{observation}" + _SOKOBAN_TAIL,
    "action": "'{}'",
    "separator": ", ",
    "tags": ("action",),
}


# ---------------------------------------------------------------------------- levels and the solver

def wall_pattern(walls):
    """The inside of the room as text, one row per line ("#" wall, "_" floor): what the held-out rule reads."""
    return "\n".join("".join("#" if (r, c) in walls else "_" for c in range(1, ROOM - 1)) for r in range(1, ROOM - 1))


def is_held_out(walls):
    """valid_unseen rooms: a fixed quarter of the wall patterns, stable across runs and machines."""
    return zlib.crc32(wall_pattern(walls).encode()) % 4 == 0


def solve(walls, targets, boxes, player):
    """An optimal (fewest moves) list of moves that puts every box on a target, by breadth-first search over
    (player, boxes) states; [] when they already are, None when no sequence does."""
    start = (player, frozenset(boxes))
    if start[1] <= targets:
        return []
    parent, queue = {start: None}, collections.deque([start])
    while queue:
        state = queue.popleft()
        for move in ACTIONS:
            following = next_state(walls, state, move)
            if following is None or following in parent:
                continue
            parent[following] = (state, move)
            if following[1] <= targets:
                plan = []
                while parent[following] is not None:
                    following, step = parent[following]
                    plan.append(step)
                return plan[::-1]
            queue.append(following)
    return None


def next_state(walls, state, move):
    """(player, boxes) after `move`, or None when nothing moves (a wall, or a box with something behind it)."""
    (row, col), boxes = state
    dr, dc = MOVES[move]
    ahead = (row + dr, col + dc)
    if ahead in walls:
        return None
    if ahead in boxes:
        beyond = (row + 2 * dr, col + 2 * dc)
        if beyond in walls or beyond in boxes:
            return None
        return ahead, (boxes - {ahead}) | {beyond}
    return ahead, boxes


def in_dead_corner(cell, walls, targets):
    """A box here can never move again: walls on two sides at a right angle, and it is not on a target."""
    row, col = cell
    vertical = (row - 1, col) in walls or (row + 1, col) in walls
    horizontal = (row, col - 1) in walls or (row, col + 1) in walls
    return cell not in targets and vertical and horizontal


def carve_walls(rng):
    """The room's walls: all but the cells a random walk over the inside visits (gym-sokoban's idea, one cell a
    step); the outer ring always stays wall."""
    directions = list(MOVES.values())
    (row, col), (dr, dc) = rng.choice(INSIDE), rng.choice(directions)
    floor = set()
    for _ in range(WALK_STEPS):
        if rng.random() < TURN_PROBABILITY:
            dr, dc = rng.choice(directions)
        row, col = min(max(row + dr, 1), ROOM - 2), min(max(col + dc, 1), ROOM - 2)
        floor.add((row, col))
    return frozenset((r, c) for r in range(ROOM) for c in range(ROOM) if (r, c) not in floor)


# what is in a cell -> verl-agent's symbol for it
SYMBOLS = {"wall": "#", "floor": "_", "target": "O", "box": "X", "box_on_target": "\u221a", "player": "P",
           "player_on_target": "S"}


def cell_kind(cell, walls, targets, boxes, player):
    """What a cell shows: a key of SYMBOLS (and of TILES)."""
    if cell in walls:
        return "wall"
    if cell in boxes:
        return "box_on_target" if cell in targets else "box"
    if cell == player:
        return "player_on_target" if cell in targets else "player"
    return "target" if cell in targets else "floor"


def grid_rows(walls, targets, boxes, player):
    """The room in verl-agent's symbols, one string per row, cells separated by spaces."""
    return [" ".join(SYMBOLS[cell_kind((r, c), walls, targets, boxes, player)] for c in range(ROOM))
            for r in range(ROOM)]


# ---------------------------------------------------------------------------- pictures

def _tiles():
    """16x16x3 uint8 tiles: wall, floor, target, box, box on target, player, player on target."""
    y, x = np.mgrid[0:TILE, 0:TILE]
    wall = np.full((TILE, TILE, 3), (170, 70, 50), dtype=np.uint8)
    mortar = (y % 4 == 3) | ((x + 4 * (y // 4 % 2)) % 8 == 7)  # bricks: rows of 4, joints offset per row
    wall[mortar] = (90, 40, 30)
    ring = np.maximum(abs(x - 7.5), abs(y - 7.5))                  # 7.5 on the tile's edge, 0.5 at its centre
    floor = np.zeros((TILE, TILE, 3), dtype=np.uint8)
    target = floor.copy()
    target[(ring == 6.5) | (abs(x - 7.5) + abs(y - 7.5) <= 2.5)] = (220, 30, 30)
    box = np.full((TILE, TILE, 3), (230, 190, 50), dtype=np.uint8)
    box[ring == 7.5] = (120, 80, 20)
    cross = ((abs(x - y) <= 1) | (abs(x + y - (TILE - 1)) <= 1)) & (ring <= 5.5)
    box_on_target = box.copy()
    box[cross] = (230, 110, 20)
    box_on_target[cross] = (40, 170, 60)
    body = ((x - 7.5) ** 2 / 25 + (y - 9) ** 2 / 30 <= 1) | ((abs(x - 7.5) == 3.5) & (y >= 1) & (y <= 4))
    eyes = (abs(abs(x - 7.5) - 2) <= 0.5) & (y >= 7) & (y <= 8)
    player, player_on_target = floor.copy(), target.copy()
    for tile in (player, player_on_target):
        tile[body] = (80, 200, 80)
        tile[eyes] = (0, 0, 0)
    return {"wall": wall, "floor": floor, "target": target, "box": box, "box_on_target": box_on_target,
            "player": player, "player_on_target": player_on_target}


TILES = _tiles()


def render(walls, targets, boxes, player):
    """(96, 96, 3) uint8: the room in 16-pixel tiles."""
    image = np.empty((SIZE, SIZE, 3), dtype=np.uint8)
    for r in range(ROOM):
        for c in range(ROOM):
            kind = cell_kind((r, c), walls, targets, boxes, player)
            image[r * TILE:(r + 1) * TILE, c * TILE:(c + 1) * TILE] = TILES[kind]
    return image


def parse_move(action):
    """verl-agent's Sokoban projection on the text inside <action>: the first of up, down, left, right (in that
    order) that the lowercased text contains, else None (garbage, and "still", its invalid action)."""
    text = action.lower() if isinstance(action, str) else ""
    return next((move for move in ACTIONS if move in text), None)


class SokobanEnv:
    """Sokoban 6x6 (module docstring): reset(seed) -> (obs, info); step(action) -> (obs, reward, done, info).
    obs = {"text": str, "image": (96, 96, 3) uint8}."""

    def __init__(self, split="train", seed=0, max_steps=MAX_STEPS, num_boxes=NUM_BOXES, text_grid=True):
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        self.split, self.max_steps, self.num_boxes, self.text_grid = split, max_steps, num_boxes, text_grid
        self._seed_stream = random.Random(f"sokoban/{split}/stream/{seed}")

    # ---- task generation ----
    def _generate(self, rng):
        """Sets walls, targets, boxes, player and an optimal solution: drawn until the room is on the split's
        side of the held-out rule and the solver solves it in MIN_SOLUTION..MAX_SOLUTION moves."""
        while True:
            walls = carve_walls(rng)
            floor = [cell for cell in INSIDE if cell not in walls]
            if is_held_out(walls) != (self.split == "valid_unseen") or len(floor) < 2 * self.num_boxes + 1:
                continue
            cells = rng.sample(floor, 2 * self.num_boxes + 1)
            targets, boxes = frozenset(cells[:self.num_boxes]), frozenset(cells[self.num_boxes:-1])
            solution = solve(walls, targets, boxes, cells[-1])
            if solution is not None and MIN_SOLUTION <= len(solution) <= MAX_SOLUTION:
                self.walls, self.targets, self.boxes, self.player = walls, targets, boxes, cells[-1]
                self.solution = solution
                return

    # ---- gym interface ----
    def reset(self, seed=None):
        if seed is None:
            seed = self._seed_stream.randrange(2 ** 31)
        self.seed = seed
        self._generate(random.Random(f"sokoban/{self.split}/{seed}"))
        self._noise_rng = random.Random(f"sokoban/{self.split}/noise/{seed}")
        self.task_type = "sokoban-long" if len(self.solution) > SHORT_SOLUTION else "sokoban-short"
        self.level = grid_rows(self.walls, self.targets, self.boxes, self.player)
        self.states = [(self.player, self.boxes)]                   # after each step; [0] is the start
        self.moves, self.invalid_steps, self.blocked_steps, self.push_steps = [], [], [], []
        self.steps, self.done, self.won = 0, False, False
        return self._observation("You are in the room."), self._info(valid=True)

    def step(self, action):
        if self.done:
            return self._observation("The episode is over."), 0.0, True, self._info(valid=False)
        self.steps += 1
        move = parse_move(action)
        self.moves.append(move)
        reward, valid = 0.0, move is not None
        if not valid:
            self.invalid_steps.append(self.steps - 1)
            text = "Nothing happens."
        else:
            reward, text = self._apply(move)
        self.states.append((self.player, self.boxes))
        self.done = self.won or self.steps >= self.max_steps
        return self._observation(text), reward, self.done, self._info(valid)

    def _apply(self, move):
        """Plays one valid move; returns (gym-sokoban's reward, what happened)."""
        following = next_state(self.walls, (self.player, self.boxes), move)
        if following is None:
            self.blocked_steps.append(self.steps - 1)
            return -0.1, f"You cannot move {move}: it is blocked."
        before = len(self.boxes & self.targets)
        pushed = following[1] != self.boxes
        self.player, self.boxes = following
        after = len(self.boxes & self.targets)
        reward = -0.1 + (1.0 if after > before else -1.0 if after < before else 0.0)
        self.won = self.boxes <= self.targets
        if self.won:
            reward += 10.0
        if not pushed:
            return reward, f"You moved {move}."
        self.push_steps.append(self.steps - 1)
        where = " onto a target" if after > before else " off a target" if after < before else ""
        return reward, f"You pushed the box {move}{where}."

    def _observation(self, text):
        if self.text_grid:
            text = "\n".join([text, TEXT_HELP] + grid_rows(self.walls, self.targets, self.boxes, self.player))
        return {"text": text, "image": render(self.walls, self.targets, self.boxes, self.player)}

    def _info(self, valid):
        info = {"task": TASK, "admissible": list(ACTIONS), "won": self.won, "valid": valid,
                "task_type": self.task_type}
        if self.done:
            stuck_step, stuck_in_corner = self._first_stuck_step()
            info["gt"] = {"env": "sokoban", "task": TASK, "task_type": self.task_type, "won": self.won,
                          "steps": self.steps, "max_steps": self.max_steps, "invalid_steps": list(self.invalid_steps),
                          "level": list(self.level), "solution": list(self.solution), "moves": list(self.moves),
                          "push_steps": list(self.push_steps), "blocked_steps": list(self.blocked_steps),
                          "stuck_step": stuck_step, "stuck_in_corner": stuck_in_corner,
                          "final": grid_rows(self.walls, self.targets, self.boxes, self.player),
                          "split": self.split, "seed": self.seed}
        return info

    def _first_stuck_step(self):
        """(0-based index of the step after which no move sequence could win any more, whether a box then sat in a
        dead corner), or (None, False) when the level stayed solvable. Only a push can cause it: walking is undone
        by walking back."""
        for step in self.push_steps:
            player, boxes = self.states[step + 1]
            if solve(self.walls, self.targets, boxes, player) is None:
                return step, any(in_dead_corner(box, self.walls, self.targets) for box in boxes)
        return None, False

    # ---- expert ----
    def expert_action(self, epsilon=0.0, rng=None, oracle=False):
        """The first move of an optimal solution from the current state (a move that changes something when the
        level can no longer be solved); with probability epsilon a different action instead (noisy
        demonstrations). oracle is accepted for the warm-up's interface: the expert already sees everything."""
        plan = solve(self.walls, self.targets, self.boxes, self.player)
        if plan:
            best = plan[0]
        else:
            state = (self.player, self.boxes)
            best = next((m for m in ACTIONS if next_state(self.walls, state, m) is not None), ACTIONS[0])
        rng = rng or self._noise_rng
        if epsilon > 0 and rng.random() < epsilon:
            return rng.choice([a for a in ACTIONS if a != best])
        return best

    def expert_thought(self, action):
        """A short reason (<= 12 words) for taking `action` now, from what it does in the current state."""
        move = parse_move(action)
        if move is None:
            return "answer with one move: up, down, left or right"
        state = (self.player, self.boxes)
        following = next_state(self.walls, state, move)
        if following is None:
            return f"moving {move} is blocked here"
        if following[1] != self.boxes:
            if len(following[1] & self.targets) > len(self.boxes & self.targets):
                return f"push the box {move} onto the target"
            if solve(self.walls, self.targets, following[1], following[0]) is None:
                return f"pushing the box {move} would trap it"
            return f"push the box {move} toward the target"
        plan = solve(self.walls, self.targets, following[1], following[0])
        if plan and next_state(self.walls, following, plan[0])[1] != following[1]:
            return f"walk {move} to stand behind the box"
        return f"walk {move} toward the side of the box"


# ---------------------------------------------------------------------------- hindsight annotator

def describe_moves(moves):
    """["left", "left", "up"] -> "left twice, then up"; runs of a move counted in words."""
    counts = {1: "", 2: " twice", 3: " three times"}
    words = [f"{move}{counts.get(n, f' {n} times')}" for move, n in
             ((move, len(list(run))) for move, run in itertools.groupby(moves))]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + ", then " + words[-1]


def annotate(trajectory, gt, rng):
    """(summary, skill) for a finished Sokoban episode from its gt: for a success the pushes that won; for a
    failure the first decisive mistake (the push that trapped the box, invalid answers, or wandering) and what
    to do instead. rng (random.Random) picks one of two phrasings."""
    moves = [move for move in gt["moves"] if move]
    pushes = [gt["moves"][step] for step in gt["push_steps"]]
    plan = describe_moves(gt["solution"])
    task = getattr(trajectory, "task", gt["task"])
    if gt["won"]:
        summary = f"The agent solved '{task}' in {len(moves)} moves (the shortest plan has {len(gt['solution'])})."
        options = [f"Walk around to the side opposite the push first, then push the box {describe_moves(pushes)} "
                   "onto the target; never push it against a wall.",
                   f"Plan the pushes before walking: stand behind the box and push it {describe_moves(pushes)}, so "
                   "it ends on the target."]
    elif gt["stuck_step"] is not None:
        step, move = gt["stuck_step"], gt["moves"][gt["stuck_step"]]
        place = "in a corner" if gt["stuck_in_corner"] else "stuck against a wall"
        where = "into a corner, where it can never move again" if gt["stuck_in_corner"] else \
            "to a spot from which it can no longer reach the target"
        summary = f"The agent failed '{task}': at step {step + 1} it pushed the box {move} {where}."
        options = [f"Never push the box into a corner or against a wall away from the target: at step {step + 1} "
                   f"the push {move} left it {place}. The shortest plan was {plan}.",
                   f"Before each push, check that the box can still reach the target; pushing it {move} at step "
                   f"{step + 1} left it {place}. Instead go {plan}."]
    elif len(gt["invalid_steps"]) * 2 >= gt["steps"]:
        count = len(gt["invalid_steps"])
        summary = f"The agent failed '{task}': {count} of its {gt['steps']} answers were not moves."
        options = [f"Answer with exactly one move word in the action tags: up, down, left or right. Here the "
                   f"shortest plan was {plan}.",
                   f"Invalid answers waste the steps: {count} were not a move. Write one of up, down, left or right, "
                   f"and follow the plan {plan}."]
    else:
        bumps = len(gt["blocked_steps"])
        summary = (f"The agent failed '{task}': the box never reached the target in {gt['steps']} steps "
                   f"({bumps} moves into walls).")
        options = [f"Do not walk back and forth or into walls; count the moves and follow the shortest plan: {plan}.",
                   f"The steps ran out with the box still free. Get behind the box at once and go {plan}."]
    return summary, rng.choice(options)
