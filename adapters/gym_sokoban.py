"""Real gym-sokoban adapter: simulators/sokoban.py's contract on gym-sokoban's own levels, rules and pictures.

GymSokobanEnv draws each level with gym-sokoban's generate_room (random-walk room, boxes placed by reverse play),
seeded as verl-agent seeds it (Python's and numpy's global generators, restored afterwards), steps gym-sokoban's
SokobanEnv with its push actions 1-4 (verl-agent's up, down, left, right) for the rewards, and shows its 16-pixel
sprite picture (96x96 for the 6x6 room). The simulator it extends plays the same move alongside, for the text
grid, the BFS expert and info["gt"]: the rules are the same, so the two stay in step.

Departures: the text, the admissible list, garbage answers ("Nothing happens.", reward 0), max_steps and the
splits are the simulator's: a level is drawn again until its wall pattern is on the split's side of
simulators.sokoban.is_held_out (gym-sokoban has no held-out split); levels are not filtered by solution length
(gym-sokoban's can be one push). Checked by hand against gym-sokoban 0.0.6 with gym 0.26.2; the tests only check the
missing-package error, the package is not installed for them.

    pip install gym-sokoban==0.0.6 gym==0.26.2 'setuptools<81'   # it imports gym and pkg_resources
"""
import random

import numpy as np

from simulators.sokoban import ACTIONS, MAX_STEPS, NUM_BOXES, ROOM, SokobanEnv, is_held_out, parse_move, solve


class GymSokobanEnv(SokobanEnv):
    """gym-sokoban behind simulators/sokoban.py's contract (module docstring)."""

    def __init__(self, split="train", seed=0, max_steps=MAX_STEPS, num_boxes=NUM_BOXES, text_grid=True):
        try:
            from gym_sokoban.envs.room_utils import generate_room
            from gym_sokoban.envs.sokoban_env import SokobanEnv as RealSokobanEnv
        except ImportError as error:
            raise ImportError(f"gym-sokoban is unavailable ({error}): pip install gym-sokoban==0.0.6 gym==0.26.2 "
                              "'setuptools<81'") from error
        super().__init__(split, seed, max_steps, num_boxes, text_grid)
        self._generate_room = generate_room
        # our step counter ends the episode; gym-sokoban's own limit is set out of reach
        self.env = RealSokobanEnv(dim_room=(ROOM, ROOM), max_steps=10 ** 9, num_boxes=num_boxes, reset=False)

    def _generate(self, rng):
        while True:
            seeded = rng.randrange(2 ** 32)
            saved = random.getstate(), np.random.get_state()
            random.seed(seeded)
            np.random.seed(seeded)
            try:
                fixed, state, box_mapping = self._generate_room(dim=(ROOM, ROOM), num_steps=self.env.num_gen_steps,
                                                                num_boxes=self.num_boxes)
            except (RuntimeError, RuntimeWarning):  # gym-sokoban's "no usable room": verl-agent draws again too
                continue
            finally:
                random.setstate(saved[0])
                np.random.set_state(saved[1])
            walls = frozenset(map(tuple, np.argwhere(fixed == 0).tolist()))
            if is_held_out(walls) != (self.split == "valid_unseen"):
                continue
            targets = frozenset(map(tuple, np.argwhere(fixed == 2).tolist()))
            boxes = frozenset(map(tuple, np.argwhere(np.isin(state, (3, 4))).tolist()))
            player = tuple(np.argwhere(state == 5)[0].tolist())
            solution = solve(walls, targets, boxes, player)
            if solution:
                break
        self.walls, self.targets, self.boxes, self.player, self.solution = walls, targets, boxes, player, solution
        env = self.env
        env.room_fixed, env.room_state, env.box_mapping = fixed, state, box_mapping
        env.player_position = np.argwhere(state == 5)[0]
        env.num_env_steps = env.reward_last = env.boxes_on_target = 0

    def step(self, action):
        move = None if self.done else parse_move(action)
        real_reward = self.env.step(ACTIONS.index(move) + 1)[1] if move else None
        obs, reward, done, info = super().step(action)
        return obs, reward if real_reward is None else float(real_reward), done, info

    def _observation(self, text):
        obs = super()._observation(text)
        obs["image"] = np.asarray(self.env.render(mode="rgb_array"), dtype=np.uint8)
        return obs
