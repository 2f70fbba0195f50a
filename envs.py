"""envs.py: every environment behind one gym-like face, `make_env(name, split, seed, **options)`,
and the registry that holds what is particular to each one.

The contract SEED's rollout relies on (and nothing more):
    env.reset(seed)   -> (obs, info)
    env.step(action)  -> (obs, reward, done, info)
obs is text, or for a screenshot env a dict {"text": str, "image": (H, W, 3) uint8}. info always
has "task" (the goal text), "admissible" (action strings; may be empty for free-form envs) and
"won"; on done it has "gt", the ground truth the stage-1 annotator may read. An unknown command
never raises: the env answers "Nothing happens." (or its own equivalent) and sets info["valid"] =
False. Splits: train, valid_seen (same distribution), valid_unseen (held-out combinations); task
families are named in info["task_type"] so success can be reported per family.

ENVS maps each name to an EnvSpec: where the env's class lives, its verl-agent prompt template
(PROMPT, in the same module), its default step limit, the train.py flags only it reads, the
make_env options it takes from the run's flags, the stage-1 annotator that reads its ground truth,
its probes, and how the tiny model is built for it. The method (seed.py, train.py) asks the spec
and never compares env names; adding an env is one simulator or adapter file plus one entry here
(docs/environments.md walks through one).

Each lives in its own folder and is imported only when asked for, so an optional package that is
missing costs nothing until its env is built; then it fails at construction with one message
saying what to install. This file also guards env calls: an env that raises or hangs past a
timeout is reported as EnvFailure, so the rollout drops that one trajectory and rebuilds the env.

Departures from the paper: the household and vision simulators stand in for ALFWorld and
MiniWoB++, and search, sokoban and ezpoints for verl-agent's Search-QA, gym-sokoban and gym_cards,
so the method runs on a laptop CPU (their docstrings list how they differ); the real engines are
here as well.

Run: python envs.py --env sokoban --split valid_unseen --seed 3   (an env's expert plays one task)
"""
import argparse
import dataclasses
import importlib
import os
import signal
import threading
from typing import Callable, Optional

SPLITS = ("train", "valid_seen", "valid_unseen")


def load(path):
    """The object a "package.module:name" path names, imported on first use."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """What is particular to one environment; the "module:name" paths are imported when used."""
    name: str
    env_class: str                      # the env's class; its module also defines PROMPT
    max_steps: int                      # the default step limit (--max-steps)
    about: str                          # one line for the tables of README and docs
    prompt: str                         # its verl-agent prompt template (skills.render_prompt)
    annotator: str                      # stage 1's: (trajectory, gt, rng) -> (summary, skill)
    screens: bool = False               # the image is what to read: the tiny model is a Qwen2-VL
    own_flags: tuple = ()               # train.py flags only this env reads (an error elsewhere)
    options: Optional[Callable] = None  # cfg -> the env's own make_env options
    expert_options: tuple = ()          # extra make_env options of the env playing demonstrations
    probe: Optional[str] = None         # every evaluation: (policy, cfg, split) -> {column: value}
    names_fix: Optional[str] = None     # (trajectory, skill) -> does it name the failure's fix
    tiny_preset: tuple = ()             # the tiny preset's defaults that differ here: (flag, value)


def _alfworld_options(cfg):
    """ALFWorld data: --data-dir, else $ALFWORLD_DATA, else synthetic games in the out dir."""
    data_dir = cfg.data_dir or os.environ.get("ALFWORLD_DATA")
    return {"data_dir": data_dir or synthetic_alfworld(cfg.out_dir, cfg.seed)}


TEXT_ANNOTATOR, TEXT_FIX = "annotators.text_worlds:annotate", "annotators.text_worlds:names_fix"
ALFWORLD_PROMPT = "simulators.household:PROMPT"  # verl-agent's, shared by the simulator
ENVS = {spec.name: spec for spec in (
    EnvSpec("household", "simulators.household:HouseholdEnv", 20,
            "miniature ALFWorld in pure Python (the default)", ALFWORLD_PROMPT, TEXT_ANNOTATOR,
            probe="evaluation.habit:habit_column", names_fix=TEXT_FIX),
    # sokoban and ezpoints show an image too, but their text says it all: the tiny one reads text
    EnvSpec("vision", "simulators.vision:VisionEnv", 6, "screenshot click tasks in numpy",
            "simulators.vision:PROMPT", "simulators.vision:annotate", screens=True,
            names_fix="simulators.vision:names_fix",
            # the tiny VLM drifted at 1e-4, and at 3e-5 GRPO lost 0.035 valid_seen in 640 episodes
            # with its vision tower training, gained 0.011 with it frozen (3 seeds; docs/vision.md);
            # screens keep the advantage path they were measured with (the gated loss: household only)
            tiny_preset=(("lr", 3e-5), ("vision_lr_scale", 0.0), ("distill_mode", "advantage"),
                         ("distill_coef", 0.1))),
    EnvSpec("alfworld", "adapters.alfworld:AlfworldEnv", 30,
            "the real ALFWorld engine (pip install alfworld==0.4.2)", ALFWORLD_PROMPT,
            TEXT_ANNOTATOR, own_flags=("data_dir",), options=_alfworld_options,
            names_fix=TEXT_FIX, expert_options=(("expert_plan", True),)),
    EnvSpec("webshop", "adapters.webshop:WebshopEnv", 15,
            "a WebShop server ($WEBSHOP_URL), else the offline mini shop",
            "adapters.webshop:PROMPT", TEXT_ANNOTATOR),
    EnvSpec("miniwob", "adapters.miniwob:MiniwobEnv", 10,
            "real MiniWoB++ in headless Chromium (pip install miniwob)", "simulators.vision:PROMPT",
            "adapters.miniwob:annotate", screens=True, own_flags=("task", "miniwob_elements"),
            options=lambda cfg: {"task": cfg.task, "elements": cfg.miniwob_elements}),
    # the paper's other benchmarks (verl-agent's search, gym-sokoban, gym_cards), offline by default
    EnvSpec("search", "adapters.search_server:make_env", 4,
            "Search-QA over an embedded corpus with BM25 (--search-url: a retrieval server)",
            "simulators.search_qa:PROMPT", "simulators.search_qa:annotate",
            own_flags=("search_url",),
            options=lambda cfg: {"url": cfg.search_url or os.environ.get("SEARCH_URL")}),
    EnvSpec("sokoban", "simulators.sokoban:SokobanEnv", 15, "Sokoban 6x6 (image and a text grid)",
            "simulators.sokoban:PROMPT", "simulators.sokoban:annotate"),
    EnvSpec("ezpoints", "simulators.ezpoints:EzpointsEnv", 8,
            "EZPoints, two cards to 12 (image and card names)", "simulators.ezpoints:PROMPT",
            "simulators.ezpoints:annotate"),
)}
ENV_NAMES = tuple(ENVS)


def spec(name):
    """The EnvSpec of `name`, or one clear error listing the valid names."""
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; valid names: {', '.join(ENV_NAMES)}")
    return ENVS[name]


def make_env(name="household", split="train", seed=0, **options):
    """The env called `name` on `split`; options are the env's own knobs (max_steps, ...)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    return load(spec(name).env_class)(split, seed, **options)


def env_options(cfg):
    """The keyword options make_env gets for a run (cfg: train.py's config): max_steps (the env's
    default when None) and the env's own, taken from its flags."""
    env = spec(cfg.env)
    options = {"max_steps": cfg.max_steps or env.max_steps}
    return {**(env.options(cfg) if env.options else {}), **options}


def check_own_flags(cfg, defaults, error):
    """error(message) for a flag only another env reads, set on this one (it would be ignored)."""
    for other in ENVS.values():
        for name in other.own_flags:
            if other.name != cfg.env and getattr(cfg, name) != defaults[name]:
                error(f"--{name.replace('_', '-')} is for --env {other.name}; --env {cfg.env} "
                      "does not read it")


def synthetic_alfworld(out_dir, seed=0):
    """A folder of synthetic ALFWorld games (adapters/alfworld_games.py), made on first use."""
    from adapters.alfworld import _engine
    from adapters.alfworld_games import generate_games
    _engine()  # the package first: a missing one is one clear error before anything is announced
    data_dir = os.path.join(out_dir, "alfworld_synthetic")
    if os.path.isdir(os.path.join(data_dir, "json_2.1.1")):
        print(f"no ALFWorld data given: using the synthetic games in {data_dir}")
        return data_dir
    print(f"no ALFWorld data given (--data-dir or $ALFWORLD_DATA): generating synthetic games in "
          f"{data_dir}")
    for split in SPLITS:
        generate_games(data_dir, 6 if split == "train" else 3, seed=seed, split=split)
    return data_dir


# ---------------------------------------------------------------------------- guarded env calls

class EnvFailure(Exception):
    """An env raised or hung: the rollout drops that trajectory and rebuilds the env."""


def call_env(method, argument, timeout=None):
    """method(argument), an env's reset or step, under a wall-clock limit of `timeout` seconds (None
    or 0: none). Any exception, or a hang past the limit, becomes EnvFailure(reason). The limit is a
    SIGALRM timer, which interrupts an env stuck in Python code or in a blocking call; it needs Unix
    and the main thread, elsewhere the call runs without a limit (an env stuck inside C code that
    holds the GIL cannot be interrupted)."""
    main_thread = threading.current_thread() is threading.main_thread()
    timed = bool(timeout) and hasattr(signal, "setitimer") and main_thread

    def on_alarm(signum, frame):
        raise TimeoutError(f"no answer within {timeout:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm) if timed else None
    try:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, timeout)
        return method(argument)
    except Exception as error:
        name = getattr(method, "__name__", "call")
        raise EnvFailure(f"env.{name} failed: {type(error).__name__}: {error}"[:300]) from error
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def step_env(env, action, timeout=None):
    """env.step(action) under call_env; a MiniWoB step whose browser died (and was restarted by the
    env) is a failure too, since that episode cannot go on."""
    observation, reward, done, info = call_env(env.step, action, timeout)
    if info.get("browser_restarted"):
        raise EnvFailure("env.step: the browser died; the env restarted it")
    return observation, reward, done, info


def restart_env(envs, index, env_factory=None, timeout=None):
    """Close the broken envs[index] (its errors ignored) and put env_factory(index) in its place.
    Without a factory the env stays, and its next reset decides whether it still works."""
    if env_factory is None:
        return
    if hasattr(envs[index], "close"):
        try:
            call_env(lambda _: envs[index].close(), None, timeout)
        except EnvFailure:
            pass
    envs[index] = env_factory(index)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="An env's expert plays one task, printed.")
    parser.add_argument("--env", default="household", choices=ENV_NAMES)
    parser.add_argument("--split", default="train", choices=SPLITS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    env = make_env(args.env, args.split, args.seed, max_steps=spec(args.env).max_steps)
    obs, info = env.reset(args.seed)
    text = lambda observation: observation["text"] if isinstance(observation, dict) else observation
    print(f"{info['task']} ({info.get('task_type')})\n{text(obs)}")
    print(f"admissible: {info['admissible']}")
    done = False
    while not done:
        action = env.expert_action()
        thought = env.expert_thought(action) if hasattr(env, "expert_thought") else None
        obs, reward, done, info = env.step(action)
        print(f"> {action}" + (f"   ({thought})" if thought else "") + f"   reward {reward:+.1f}")
        print(text(obs))
    print("won:", info["won"], "steps:", info["gt"].get("steps"))
