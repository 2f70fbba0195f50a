"""Real gym_cards adapter: simulators/ezpoints.py's contract on gym_cards' own EZPoints (EZPointEnv).

GymCardsEzpointsEnv deals with EZPointEnv.reset (its deal draws from Python's global generator, so that is
seeded here and restored afterwards), steps EZPointEnv with the action index of each token (0-9: "1".."10",
10: "+", 11: "*", 12: "=") for the rewards, and shows its 300x300 picture. The simulator it extends plays the same
token alongside, for the text, the enumerating expert and info["gt"]: the rules are the same, so the two stay in
step.

Departures: the text, the admissible list, garbage answers ("Nothing happens.", reward 0, as verl-agent's no-op
action -1), max_steps and the splits are the simulator's: a deal is redrawn until its card pair is on the split's
side of simulators.ezpoints.HELD_OUT_PAIRS (gym_cards has no held-out split); an over-long formula ends the episode.

gym_cards is not on PyPI: install it from the RL4VLM repository's gym-cards folder (pip install -e gym-cards).
"""
import random

import numpy as np

from simulators.ezpoints import ACTIONS, HELD_OUT_PAIRS, MAX_STEPS, SUITS, EzpointsEnv, pair_name, parse_token

RANKS = {"A": 1, "T": 10, "J": 11, "Q": 12, "K": 13}      # gym_cards' card names: suit letter, then rank


class GymCardsEzpointsEnv(EzpointsEnv):
    """gym_cards' EZPoints behind simulators/ezpoints.py's contract (module docstring)."""

    def __init__(self, split="train", seed=0, max_steps=MAX_STEPS, text_cards=True):
        try:
            from gym_cards.envs import EZPointEnv
        except ImportError as error:
            raise ImportError(f"gym_cards is unavailable ({error}): pip install -e gym-cards, from the RL4VLM "
                              "repository (it is not on PyPI)") from error
        super().__init__(split, seed, max_steps, text_cards)
        self.env = EZPointEnv()

    def _deal(self, rng):
        while True:
            seeded = rng.randrange(2 ** 32)
            saved = random.getstate()
            random.seed(seeded)
            try:
                image, info = self.env.reset(seed=seeded)
            finally:
                random.setstate(saved)
            suits = {suit[0].upper(): suit for suit in SUITS}
            cards = [(RANKS.get(name[1:]) or int(name[1:]), suits[name[0]]) for name in info["Cards"]]
            if (pair_name([rank for rank, _ in cards]) in HELD_OUT_PAIRS) == (self.split == "valid_unseen"):
                self._image = np.asarray(image, dtype=np.uint8)
                return cards

    def step(self, action):
        token = None if self.done else parse_token(action)
        real_reward = None
        if token is not None:
            image, real_reward = self.env.step(ACTIONS.index(token))[:2]
            self._image = np.asarray(image, dtype=np.uint8)
        obs, reward, done, info = super().step(action)
        return obs, reward if real_reward is None else float(real_reward), done, info

    def _observation(self, text):
        return {**super()._observation(text), "image": self._image}
