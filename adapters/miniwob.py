"""The real MiniWoB++ (package `miniwob`, headless Chromium) behind the envs.py interface: make_env("miniwob", ...).

Observation: {"text": ..., "image": the 210x160x3 uint8 screenshot}; the task is MiniWoB's utterance. With
elements=True the text also lists the page's visible leaf elements ("[5] button 'okay' at (24,73)") and the
admissible actions are their `click element N`; without it the action space is free-form (admissible empty).
Text actions, mapped to miniwob's ActionTypes:
    click element N        CLICK_ELEMENT on the element with ref N
    click X Y              CLICK_COORDS at screenshot pixel (X, Y), 0 <= X < 160, 0 <= Y < 210
    type element N TEXT    FOCUS_ELEMENT_AND_TYPE_TEXT (click the element, then type)
    type TEXT              TYPE_TEXT into whatever has the focus
    press KEY              PRESS_KEY, KEY one of miniwob's allowed keys (enter, tab, backspace, ...)
Anything else answers "Nothing happens." with info["valid"] False and does not touch the browser.
Reward 10 when the episode ends with MiniWoB's raw reward > 0 (as household), else 0; info["score"] holds the
raw reward. MiniWoB ends an episode after 10 s of wall clock (a slow model always times out): the adapter raises
core.EPISODE_MAX_TIME (max_time_ms, default 10 minutes) before every episode.

Browsers: each env borrows a browser (one gym env) for one episode from a per-task pool and returns it at the
end, so the train and evaluation envs of train.py share at most max(N x G, --eval-tasks) browsers (about 125 MB
each), started on first use. A browser that dies (crash, killed process, WebDriver error) is restarted: a reset
retries on a fresh browser, a step ends the episode with info["browser_restarted"] True and no reward.

Splits: MiniWoB generates each episode from a seed; train, valid_seen and valid_unseen use disjoint seed ranges
of the same task (MiniWoB has no held-out combinations: valid_unseen is only new seeds). A scripted DOM expert
(expert_action) plays the tasks in EXPERT_TASKS, for warm-up demonstrations and the tests.

Needs: pip install miniwob==1.1.0; apt-get install chromium chromium-driver; and
MINIWOB_CHROME_BINARY=/usr/bin/chromium MINIWOB_CHROMEDRIVER=/usr/bin/chromedriver (set here when unset and
both files exist). Run: python adapters/miniwob.py --task click-button   (plays the expert on 5 episodes)
"""
import argparse
import atexit
import logging
import os
import random
import re
import shutil

SPLIT_SEED_OFFSET = {"train": 0, "valid_seen": 10 ** 7, "valid_unseen": 2 * 10 ** 7}
EXPERT_TASKS = ("click-test", "click-test-2", "click-button", "click-link", "focus-text", "click-dialog",
                "enter-text", "click-option", "click-checkboxes")
CLICKABLE_TAGS = ("button", "span", "a", "input_text", "input_checkbox", "input_radio", "input_password",
                  "textarea", "select", "option", "label", "li", "p", "td", "h1", "h2", "h3", "t")
_POOL = {}  # task -> idle gym envs (browsers)


def _import_miniwob():
    """gymnasium, miniwob and ActionTypes, or one clear error saying what to install."""
    for variable, path in (("MINIWOB_CHROME_BINARY", "/usr/bin/chromium"),
                           ("MINIWOB_CHROMEDRIVER", "/usr/bin/chromedriver")):
        if not os.environ.get(variable) and all(os.path.exists(p) for p in ("/usr/bin/chromium", "/usr/bin/chromedriver")):
            os.environ[variable] = path
    try:
        import gymnasium
        import miniwob
        from miniwob.action import ActionTypes
    except ImportError as error:
        raise ImportError(f"--env miniwob needs the miniwob package ({error}): pip install miniwob==1.1.0") from None
    binary = os.environ.get("MINIWOB_CHROME_BINARY") or shutil.which("chromium") or shutil.which("google-chrome")
    driver = os.environ.get("MINIWOB_CHROMEDRIVER") or shutil.which("chromedriver")
    if not (binary and os.path.exists(binary) and driver and os.path.exists(driver)):
        raise RuntimeError("--env miniwob needs Chromium and its driver: apt-get install chromium chromium-driver, "
                           "then set MINIWOB_CHROME_BINARY=/usr/bin/chromium MINIWOB_CHROMEDRIVER=/usr/bin/chromedriver")
    if "miniwob/click-test-v1" not in gymnasium.registry:  # registering twice warns about every task
        gymnasium.register_envs(miniwob)
    logging.getLogger("root").setLevel(logging.ERROR)  # miniwob logs every restart at WARNING via the root logger
    return gymnasium, ActionTypes


def _close_all():
    for pool in _POOL.values():
        while pool:
            try:
                pool.pop().close()
            except Exception:  # a dead browser cannot be closed twice; nothing else to do at exit
                pass


atexit.register(_close_all)


def _number(value):
    return float(value[0]) if hasattr(value, "__len__") else float(value)


class MiniwobEnv:
    """One MiniWoB++ task (module docstring): reset(seed) -> (obs, info); step(action) -> (obs, reward, done, info)."""

    def __init__(self, split="train", seed=0, task="click-test", max_steps=10, elements=False, max_time_ms=600000):
        if split not in SPLIT_SEED_OFFSET:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLIT_SEED_OFFSET)}")
        self.gym, self.actions = _import_miniwob()
        if f"miniwob/{task}-v1" not in self.gym.registry:
            known = sorted(k.split("/")[1][:-3] for k in self.gym.registry if k.startswith("miniwob/"))
            raise ValueError(f"unknown MiniWoB task {task!r}; {len(known)} tasks, e.g. {', '.join(known[:8])}")
        self.split, self.task_name, self.max_steps = split, task, max_steps
        self.elements, self.max_time_ms = elements, max_time_ms
        self._seed_stream = random.Random(f"miniwob/{task}/{split}/{seed}")
        self.env, self.done = None, True

    # ---- browsers ----
    def _borrow(self):
        pool = _POOL.setdefault(self.task_name, [])
        return pool.pop() if pool else self.gym.make(f"miniwob/{self.task_name}-v1", render_mode=None)

    def _give_back(self):
        if self.env is not None:
            _POOL.setdefault(self.task_name, []).append(self.env)
            self.env = None

    def _instance(self):
        return self.env.unwrapped.instance

    def _restart(self):
        self.env.unwrapped._hard_reset_instance()
        self.restarts += 1

    def close(self):
        if self.env is not None:
            self.env.close()
            self.env = None

    # ---- gym interface ----
    def reset(self, seed=None):
        if seed is None:
            seed = self._seed_stream.randrange(10 ** 7)
        self.seed, self.restarts = seed, 0
        self._give_back()
        self.env = self._borrow()
        for attempt in range(3):
            try:
                if self._instance().died:
                    self._restart()
                self._instance().driver.execute_script(f"core.EPISODE_MAX_TIME = {int(self.max_time_ms)};")
                obs, _ = self.env.reset(seed=SPLIT_SEED_OFFSET[self.split] + seed)
                if not self._instance().died and obs.get("utterance") is not None:
                    break
            except Exception:  # WebDriver errors of a dead browser: start a new one and retry
                pass
            if attempt == 2:
                raise RuntimeError(f"MiniWoB task {self.task_name}: the browser failed to start three times")
            self._restart()
        self.task = obs["utterance"]
        self.fields = dict(obs["fields"])
        self.steps, self.history, self.invalid_steps = 0, [], []
        self.done = self.won = False
        self.score = 0.0
        self._read(obs)
        self._plan = self._expert_plan()
        return self._observation(), self._info(valid=True)

    def step(self, action):
        if self.done:
            return self._observation("The episode is over."), 0.0, True, self._info(valid=False)
        self.steps += 1
        action = " ".join(str(action or "").split())
        self.history.append(action)
        command = self._command(action)
        restarted, text = False, None
        if command is None:
            self.invalid_steps.append(self.steps - 1)
            text = "Nothing happens."
        else:
            try:
                obs, raw, done, _, info = self.env.step(command)
                restarted = self._instance().died or not obs
            except Exception:
                restarted = True
            if restarted:  # the browser died: end the episode without reward, start a new one for the next reset
                self._restart()
                self.done, text = True, "The browser stopped; the episode ended."
            elif done:
                self.done, self.score = True, float(info.get("raw_reward", raw))
                self.won = self.score > 0
                text = "The episode ended with success." if self.won else "The episode ended with failure."
            else:
                self._read(obs)
        if self.steps >= self.max_steps:
            self.done = True
        info = self._info(valid=command is not None and not restarted)
        info["browser_restarted"] = restarted
        if self.done:
            self._give_back()
        return self._observation(text), 10.0 if self.won else 0.0, self.done, info

    def _command(self, action):
        """The miniwob action for a text action, or None when the text is not one (module docstring)."""
        create = lambda kind, **kw: self.env.unwrapped.create_action(getattr(self.actions, kind), **kw)
        lower = action.lower()
        if m := re.fullmatch(r"click element (-?\d+)", lower):
            return create("CLICK_ELEMENT", ref=int(m.group(1))) if int(m.group(1)) in self.refs else None
        if m := re.fullmatch(r"click \(?(\d+(?:\.\d+)?),? (\d+(?:\.\d+)?)\)?", lower):
            x, y = float(m.group(1)), float(m.group(2))
            if x < self.width and y < self.height:
                import numpy as np
                return create("CLICK_COORDS", coords=np.array([x, y], dtype=np.float32))
            return None
        if m := re.fullmatch(r"type element (-?\d+) (.+)", action, re.I):
            if int(m.group(1)) in self.refs:
                return create("FOCUS_ELEMENT_AND_TYPE_TEXT", ref=int(m.group(1)), text=m.group(2))
            return None
        if m := re.fullmatch(r"type (.+)", action, re.I):
            return create("TYPE_TEXT", text=m.group(1))
        if m := re.fullmatch(r"press (.+)", action, re.I):  # "press enter" -> <Enter>; letters keep their case
            keys = list(self.env.unwrapped.action_space_config.allowed_keys)
            names = {(k[1:-1].lower() if k.startswith("<") else k): i for i, k in enumerate(keys)}
            key = names.get(m.group(1), names.get(m.group(1).strip("<>").lower()))
            return None if key is None else create("PRESS_KEY", key=key)
        return None

    def _read(self, obs):
        """Remember the page: screenshot, size and the visible leaf elements."""
        self.image = obs["screenshot"]
        self.height, self.width = self.image.shape[:2]
        self.dom = [{"ref": int(e["ref"]), "tag": e["tag"], "text": e["text"], "classes": e["classes"],
                     "value": e["value"], "x": _number(e["left"]) + _number(e["width"]) / 2,
                     "y": _number(e["top"]) + _number(e["height"]) / 2} for e in obs["dom_elements"]]
        self.refs = {e["ref"] for e in self.dom}
        self.leaves = [e for e in self.dom if 0 <= e["x"] < self.width and 0 <= e["y"] < self.height
                       and e["tag"] in CLICKABLE_TAGS and (e["text"] or e["tag"] != "t")
                       and e["ref"] not in (1, 2, 3)]  # body, #wrap, #area

    def _observation(self, text=None):
        if text is None:
            text = "The screenshot shows the page."
            if self.elements:
                text += " Elements: " + "; ".join(
                    f"[{e['ref']}] {e['tag']}" + (f" '{e['text'][:30]}'" if e["text"] else "")
                    + f" at ({e['x']:.0f},{e['y']:.0f})" for e in self.leaves)
        return {"text": text, "image": self.image}

    def _info(self, valid):
        admissible = [f"click element {e['ref']}" for e in self.leaves] if self.elements and not self.done else []
        info = {"task": self.task, "admissible": admissible, "won": self.won, "valid": valid,
                "task_type": self.task_name, "score": self.score}
        if self.done:
            info["gt"] = {"env": "miniwob", "task_type": self.task_name, "task": self.task, "won": self.won,
                          "score": self.score, "steps": self.steps, "max_steps": self.max_steps,
                          "invalid_steps": list(self.invalid_steps), "fields": self.fields,
                          "expert_plan": list(self._plan), "actions": list(self.history), "seed": self.seed}
        return info

    # ---- scripted expert ----
    def _expert_plan(self):
        """The actions that solve this episode, read from the DOM at reset (EXPERT_TASKS only, else [])."""
        task, dom, fields = self.task_name, self.dom, self.fields
        find = lambda test: next((e for e in dom if test(e)), None)
        submit = find(lambda e: e["tag"] == "button" and e["text"].lower() == "submit")

        def beside(text, tag):  # the checkbox or radio on the same line as the label text
            label = find(lambda e: e["text"] == text)
            boxes = [e for e in dom if e["tag"] == tag]
            return min(boxes, key=lambda e: abs(e["y"] - label["y"])) if label and boxes else None

        if task == "click-test":
            targets = [find(lambda e: e["tag"] == "button")]
        elif task in ("click-test-2", "click-button", "click-link"):
            targets = [find(lambda e: e["tag"] in ("button", "span") and e["text"] == fields.get("target"))]
        elif task == "focus-text":
            targets = [find(lambda e: e["tag"] == "input_text")]
        elif task == "click-dialog":
            targets = [find(lambda e: "ui-dialog-titlebar-close" in e["classes"])]
        elif task == "enter-text":
            box = find(lambda e: e["tag"] == "input_text")
            return [f"type element {box['ref']} {fields.get('target', '')}", f"click element {submit['ref']}"]
        elif task == "click-option":
            targets = [beside(fields.get("target"), "input_radio"), submit]
        elif task == "click-checkboxes":
            wanted = [v for k, v in sorted(fields.items()) if k.startswith("target")]
            targets = [beside(text, "input_checkbox") for text in wanted] + [submit]
        else:
            return []
        return [f"click element {e['ref']}" for e in targets if e is not None]

    def expert_action(self, epsilon=0.0, rng=None, oracle=False):
        """The scripted expert's next action (the first planned action not yet taken); with probability epsilon
        a random listed element click instead. Raises for a task outside EXPERT_TASKS."""
        if not self._plan:
            raise ValueError(f"no scripted expert for MiniWoB task {self.task_name!r}; "
                             f"tasks with one: {', '.join(EXPERT_TASKS)}")
        best = next((a for a in self._plan if a not in self.history), self._plan[-1])
        rng = rng or random.Random(f"{self.seed}/{self.steps}")
        if epsilon > 0 and rng.random() < epsilon and self.leaves:
            return f"click element {rng.choice(self.leaves)['ref']}"
        return best


# ---------------------------------------------------------------------- stage-1 annotation

def annotate(trajectory, gt, rng):
    """The stage-1 hindsight annotator of this env (envs.py names it): the actions that worked, or the scripted
    solution the failure missed; rng (a random.Random) draws the phrasing."""
    done = "; ".join(gt.get("actions") or []) or "nothing"
    plan = "; ".join(gt.get("expert_plan") or [])
    if gt["won"]:
        return (f"The agent solved '{gt['task']}' with: {done}.",
                rng.choice([f"Read the task and act on the element it names: {done}.", f"Workflow: {done}."]))
    summary = f"The agent failed '{gt['task']}' (score {gt.get('score', 0):g}) after: {done}."
    if plan:
        return summary, rng.choice([f"The solution was: {plan}. Act on the elements the task names.",
                                    f"Mistake: {done} did not solve it; do {plan}."])
    return summary, f"Read the task again and act on the element it names; {done} did not solve it."


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Play the scripted MiniWoB expert on a few episodes.")
    parser.add_argument("--task", default="click-button", choices=EXPERT_TASKS)
    parser.add_argument("--episodes", type=int, default=5)
    args = parser.parse_args()
    env = MiniwobEnv(task=args.task, elements=True)
    for episode in range(args.episodes):
        obs, info = env.reset(episode)
        print(f"== {info['task']}\n{obs['text']}")
        done = False
        while not done:
            action = env.expert_action()
            obs, reward, done, info = env.step(action)
            print(f"> {action} -> reward {reward}, {obs['text']}")
