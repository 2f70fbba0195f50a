"""Real ALFWorld adapter (textworld PDDL engine) and a generator of synthetic ALFWorld games.

AlfworldEnv plays the user's ALFWorld games ($ALFWORLD_DATA/json_2.1.1/<split>/<task>-.../trial_*/)
through textworld with ALFWorld's own wrappers, so observations, admissible commands, `won` and the
10 x won reward are the benchmark's. generate_games writes small synthetic games in the same on-disk
format from the package's own PDDL domain, grammar and goal templates, each checked solvable by the
engine's planner, so `--env alfworld`, the tests and CI run without `alfworld-download`.

Departures from ALFWorld / verl-agent: one textworld env per AlfworldEnv instead of AlfredTWEnv's
config-driven batch env (ProcessAlfworldEnv + step_many run a batch in parallel); no THOR scene behind the
synthetic games, one location per receptacle, DeskLamp as the only light, and ALFRED's unseen
scenes (10, 219, 308, 424) are kept for valid_unseen. Newlines in an action are read as spaces.

    pip install alfworld==0.4.2
    python envs_alfworld.py --generate /tmp/alfworld_data --n 12   # then export ALFWORLD_DATA=/tmp/alfworld_data
"""
import argparse
import glob
import json
import multiprocessing
import os
import random
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
              "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")
SPLITS = ("train", "valid_seen", "valid_unseen")
REWARD_WON = 10.0
NOTHING_HAPPENS = "Nothing happens."
UNSEEN_SCENES = (10, 219, 308, 424)  # ALFRED's valid_unseen floor plans
# textworld is not thread-safe: loading a game rewrites module globals (translator options, sys.argv,
# sys.stdout) and every step derives text with one module-level parser (concurrent steps crash in tatsu).
# All engine calls in a process take this lock; parallel batches use one process per env (ProcessAlfworldEnv).
_ENGINE_LOCK = threading.Lock()
_GAME_LISTS = {}


class EnvUnavailable(RuntimeError):
    """The alfworld package or the ALFWorld games are missing."""


def _unavailable(reason):
    return EnvUnavailable(
        f"ALFWorld is unavailable: {reason}. Install the engine with `pip install alfworld==0.4.2`, get the "
        "games with `alfworld-download` (or write synthetic ones with `python envs_alfworld.py --generate DIR`), "
        "and set ALFWORLD_DATA to the folder that holds json_2.1.1/.")


def _engine():
    """Imports the engine lazily so this module imports without the optional package."""
    try:
        import textworld
        from textworld.envs.wrappers import Filter, GenericEnvironment
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
    except ImportError as error:
        raise _unavailable(f"cannot import it ({error})") from error

    def make(request_infos):
        # The wrapper chain textworld.gym builds, minus its game-cycling registry: one env that loads any
        # game keeps one copy of the planner library instead of copying the 34 MB .so on every reset.
        # AlfredDemangler is passed as a class: a shared instance would tie every env to the last one made.
        return Filter(AlfredInfos(AlfredDemangler(GenericEnvironment(request_infos))))
    return textworld, make


def _data_root(data_dir):
    # Read before alfworld is imported: importing it sets ALFWORLD_DATA to its default when unset.
    return data_dir or os.environ.get("ALFWORLD_DATA") or os.path.expanduser("~/.cache/alfworld")


def task_type_of(gamefile):
    """Task type from the game path, as ALFWorld reports per-type success."""
    return os.path.basename(os.path.dirname(os.path.dirname(gamefile))).split("-")[0]


def list_games(data_root, split):
    """Playable games of a split, sorted, filtered like AlfredTWEnv (six types, solvable, no movable/sliced)."""
    key = (os.path.abspath(data_root), split)
    if key not in _GAME_LISTS:
        games = []
        for path in sorted(glob.glob(os.path.join(data_root, "json_2.1.1", split, "*", "trial_*", "game.tw-pddl"))):
            if task_type_of(path) not in TASK_TYPES or "movable" in path or "Sliced" in path:
                continue
            with open(path) as handle:
                if json.load(handle).get("solvable", False):
                    games.append(path)
        _GAME_LISTS[key] = games
    return _GAME_LISTS[key]


class AlfworldEnv:
    """One ALFWorld game at a time; reset(seed) picks game seed % n of the split's sorted list."""

    def __init__(self, split="train", seed=0, data_dir=None, max_steps=30, expert_plan=False,
                 max_action_chars=300, **options):
        # make_env forwards every env's knobs; the household size options mean nothing here.
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        data_root = _data_root(data_dir)
        textworld, make = _engine()
        self.game_files = list_games(data_root, split)
        if not self.game_files:
            raise _unavailable(f"no games under {os.path.join(data_root, 'json_2.1.1', split)}")
        self.split, self.seed, self.max_steps, self.max_action_chars = split, seed, max_steps, max_action_chars
        self.expert_plan = expert_plan
        # policy_commands makes the engine replan after every step: only asked for when wanted.
        self._engine = make(textworld.EnvInfos(won=True, admissible_commands=True, policy_commands=expert_plan,
                                               extras=["gamefile"]))
        self._episode = None

    def reset(self, seed=None):
        seed = self.seed if seed is None else seed
        gamefile = self.game_files[seed % len(self.game_files)]
        with _ENGINE_LOCK:
            self._engine.load(gamefile)
            observation, engine_infos = self._engine.reset()
        with open(os.path.join(os.path.dirname(gamefile), "traj_data.json")) as handle:
            pddl_params = json.load(handle).get("pddl_params", {})
        task = observation.partition("Your task is to: ")[2].strip().split("\n")[0]
        self._episode = {"gamefile": gamefile, "task": task, "task_type": task_type_of(gamefile),
                         "pddl_params": pddl_params, "steps": 0, "invalid_steps": [], "won": False,
                         "done": False, "observation": observation, "engine_infos": engine_infos}
        return observation, self._info(valid=True)

    def step(self, action):
        if self._episode is None:
            raise RuntimeError("call reset() before step()")
        episode = self._episode
        if episode["done"]:
            return episode["observation"], 0.0, True, self._info(valid=False)
        # The engine matches the exact command text; newlines and megabyte strings can only miss, so
        # they are flattened and cut rather than passed on.
        command = str(action)[:self.max_action_chars].replace("\n", " ").replace("\r", " ")
        with _ENGINE_LOCK:
            observation, _, _, engine_infos = self._engine.step(command)
        valid = observation.strip() != NOTHING_HAPPENS
        if not valid:
            episode["invalid_steps"].append(episode["steps"])
        episode["steps"] += 1
        won_now = bool(engine_infos["won"]) and not episode["won"]
        episode["won"] = episode["won"] or bool(engine_infos["won"])
        episode["done"] = episode["won"] or episode["steps"] >= self.max_steps
        episode["observation"], episode["engine_infos"] = observation, engine_infos
        return observation, REWARD_WON if won_now else 0.0, episode["done"], self._info(valid=valid)

    def expert_action(self):
        """The engine planner's next command from the current state (needs expert_plan=True)."""
        if not self.expert_plan:
            raise ValueError("the planner runs only when asked: construct AlfworldEnv(..., expert_plan=True)")
        plan = self._episode["engine_infos"]["policy_commands"]
        return plan[0] if plan else "look"  # nothing left to plan (won): a harmless command

    def _info(self, valid):
        episode = self._episode
        info = {"task": episode["task"], "task_type": episode["task_type"], "won": episode["won"], "valid": valid,
                # verl-agent drops "help" from the list shown to the model; the engine still answers it.
                "admissible": [c for c in episode["engine_infos"]["admissible_commands"] if c != "help"],
                "gamefile": episode["gamefile"]}
        if self.expert_plan:
            info["expert_plan"] = list(episode["engine_infos"]["policy_commands"])
        if episode["done"]:
            info["gt"] = {"env": "alfworld", "task_type": episode["task_type"], "task": episode["task"],
                          "won": episode["won"], "steps": episode["steps"], "max_steps": self.max_steps,
                          "invalid_steps": list(episode["invalid_steps"]),
                          "pddl_params": dict(episode["pddl_params"]), "gamefile": episode["gamefile"]}
        return info


def _serve(connection, args, kwargs):
    """Worker loop of ProcessAlfworldEnv: owns one AlfworldEnv, answers (method, argument) requests."""
    try:
        env = AlfworldEnv(*args, **kwargs)
        connection.send((True, None))
    except Exception as error:  # construction errors (EnvUnavailable) are raised in the parent
        connection.send((False, error))
        return
    while True:
        method, argument = connection.recv()
        if method == "close":
            return
        try:
            connection.send((True, getattr(env, method)(argument)))
        except Exception as error:
            connection.send((False, error))


class ProcessAlfworldEnv:
    """AlfworldEnv in its own process (same interface): the only way a batch steps in parallel, since the
    engine is single-threaded Python. Each costs about a second to start and 80 MB (synthetic games)."""

    def __init__(self, *args, **kwargs):
        # spawn, not fork: the parent may hold torch threads or a CUDA context that must not be forked.
        context = multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, args, kwargs), daemon=True)
        self._process.start()
        self._receive()

    def _receive(self):
        ok, result = self._connection.recv()
        if not ok:
            raise result
        return result

    def reset(self, seed=None):
        self._connection.send(("reset", seed))
        return self._receive()

    def step(self, action):
        self._connection.send(("step", action))
        return self._receive()

    def close(self):
        if self._process.is_alive():
            try:
                self._connection.send(("close", None))
            except OSError:  # the worker died: nothing to tell it
                pass
            self._process.join(timeout=5)
            if self._process.is_alive():  # hung (the rollout gave up on it): end it
                self._process.kill()
                self._process.join()


def _parallel(calls):
    # Threads only wait on ProcessAlfworldEnv pipes (which frees the GIL); in-process envs still work but
    # run one at a time behind the engine lock.
    with ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
        return list(pool.map(lambda call: call(), calls))


def reset_many(envs, seeds):
    """[env.reset(seed) ...] for a batch of distinct envs."""
    return _parallel([lambda env=env, seed=seed: env.reset(seed) for env, seed in zip(envs, seeds)])


def step_many(envs, actions):
    """[env.step(action) ...] for a batch of distinct envs; parallel when they are ProcessAlfworldEnv."""
    return _parallel([lambda env=env, action=action: env.step(action) for env, action in zip(envs, actions)])


# ---------------------------------------------------------------- synthetic games
# Room kinds: receptacle kind -> (min, max) count, and the object kinds that may appear.
ROOMS = {
    "Kitchen": ({"Cabinet": (2, 5), "CounterTop": (1, 2), "Drawer": (1, 3), "Fridge": (1, 1), "Microwave": (1, 1),
                 "SinkBasin": (1, 1), "StoveBurner": (1, 2), "CoffeeMachine": (1, 1), "Toaster": (0, 1),
                 "GarbageCan": (1, 1), "DiningTable": (0, 1), "Shelf": (0, 2)},
                ("Apple", "Bread", "Egg", "Potato", "Tomato", "Lettuce", "Mug", "Cup", "Plate", "Bowl", "Pan", "Pot",
                 "Knife", "Fork", "Spoon", "Spatula", "ButterKnife", "DishSponge", "SaltShaker", "PepperShaker",
                 "Kettle", "WineBottle", "SoapBottle")),
    "LivingRoom": ({"Sofa": (1, 1), "ArmChair": (0, 1), "CoffeeTable": (1, 1), "SideTable": (1, 2), "TVStand": (0, 1),
                    "Drawer": (1, 3), "Cabinet": (0, 2), "Shelf": (0, 3), "GarbageCan": (1, 1), "Dresser": (0, 1)},
                   ("Book", "CellPhone", "CreditCard", "KeyChain", "Laptop", "Newspaper", "Pillow", "RemoteControl",
                    "Statue", "Vase", "Watch", "Box", "Plate", "Bowl", "TissueBox", "WateringCan")),
    "Bedroom": ({"Bed": (1, 1), "Desk": (1, 1), "Drawer": (2, 4), "Dresser": (0, 1), "Shelf": (1, 3),
                 "SideTable": (0, 2), "GarbageCan": (1, 1), "LaundryHamper": (0, 1), "Safe": (0, 1)},
                ("AlarmClock", "Book", "CD", "CellPhone", "CreditCard", "KeyChain", "Laptop", "Mug", "Pen", "Pencil",
                 "Pillow", "BaseballBat", "TennisRacket", "BasketBall", "Bowl", "Cloth")),
    "Bathroom": ({"Toilet": (1, 1), "SinkBasin": (1, 2), "Cabinet": (1, 4), "CounterTop": (1, 1), "Drawer": (0, 2),
                  "GarbageCan": (1, 1), "TowelHolder": (0, 1), "HandTowelHolder": (0, 1), "ToiletPaperHanger": (1, 1),
                  "BathtubBasin": (0, 1), "Shelf": (0, 2)},
                 ("SoapBar", "SoapBottle", "Candle", "Cloth", "HandTowel", "SprayBottle", "ToiletPaper", "DishSponge",
                  "TissueBox", "Towel", "Plunger")),
}
# Task type -> (rooms it happens in, object property it needs, appliance receptacle it uses).
TASK_SETTINGS = {
    "pick_and_place_simple": (("Kitchen", "LivingRoom", "Bedroom", "Bathroom"), None, None),
    "look_at_obj_in_light": (("LivingRoom", "Bedroom"), None, None),
    "pick_clean_then_place_in_recep": (("Kitchen", "Bathroom"), "Cleanable", "SinkBasin"),
    "pick_heat_then_place_in_recep": (("Kitchen",), "Heatable", "Microwave"),
    "pick_cool_then_place_in_recep": (("Kitchen",), "Coolable", "Fridge"),
    "pick_two_obj_and_place": (("Kitchen", "LivingRoom", "Bedroom", "Bathroom"), None, None),
}
LAMP_HOLDERS = ("Desk", "SideTable", "Dresser")


def _alfred_id(kind, rng, taken):
    """ALFRED object id ("Apple|-01.00|+00.95|-02.10") mangled the way ALFWorld's PDDL writes it."""
    while True:
        coords = "|".join(f"{value:+06.2f}" for value in (rng.uniform(-3, 3), rng.uniform(0, 2), rng.uniform(-3, 3)))
        raw = {"SinkBasin": f"Sink|{coords}|SinkBasin", "BathtubBasin": f"Bathtub|{coords}|BathtubBasin"}.get(
            kind, f"{kind}|{coords}")
        mangled = raw.replace("-", "_minus_").replace("+", "_plus_").replace("|", "_bar_").replace(".", "_dot_")
        if mangled not in taken:
            taken.add(mangled)
            return mangled


def _sample_game(rng, task_type, split, constants, goal_library):
    """One random room and goal: (task folder name, trial name, PDDL problem text, traj_data dict)."""
    rooms, needed_property, appliance = TASK_SETTINGS[task_type]
    room = rng.choice(rooms)
    scenes = [s for s in constants.SCENE_TYPE[room] if (s in UNSEEN_SCENES) == (split == "valid_unseen")]
    scene = rng.choice(scenes)
    taken = set()
    receptacles = [(kind, _alfred_id(kind, rng, taken)) for kind, (low, high) in ROOMS[room][0].items()
                   for _ in range(rng.randint(low, high))]
    kinds_present = sorted({kind for kind, _ in receptacles})
    holders = {obj: [r for r in receptacles if obj in constants.VAL_RECEPTACLE_OBJECTS.get(r[0], ())]
               for obj in ROOMS[room][1]}
    holders = {obj: options for obj, options in holders.items() if options}
    # (goal object, target receptacle kind) pairs where the object can start somewhere else and end in the target.
    pairs = [(obj, target) for obj in sorted(holders) for target in kinds_present
             if (needed_property is None or obj in constants.VAL_ACTION_OBJECTS[needed_property])
             and target != appliance and obj in constants.VAL_RECEPTACLE_OBJECTS.get(target, ())
             and any(kind != target and kind != appliance for kind, _ in holders[obj])]
    if task_type == "look_at_obj_in_light":
        pairs = sorted({(obj, "DeskLamp") for obj, _ in pairs})
    goal_object, target = rng.choice(pairs)
    others = [kind for kind in sorted(holders) if kind != goal_object]
    distractors = rng.sample(others, min(len(others), rng.randint(4, 7)))
    objects = []  # (kind, id, receptacle id)
    for kind in [goal_object] + distractors:
        pick_two = kind == goal_object and task_type == "pick_two_obj_and_place"
        count = rng.randint(2, 3) if pick_two else rng.randint(1, 2)
        # No goal instance may start where the goal already holds (the game would be won at reset).
        options = [r for r in holders[kind] if kind != goal_object or r[0] not in (target, appliance)]
        objects += [(kind, _alfred_id(kind, rng, taken), rng.choice(options)[1]) for _ in range(count)]
    lamp_holders = [r for r in receptacles if r[0] in LAMP_HOLDERS]
    if lamp_holders:
        objects.append(("DeskLamp", _alfred_id("DeskLamp", rng, taken), rng.choice(lamp_holders)[1]))
    locations = {}
    for _, receptacle_id in receptacles:
        locations[receptacle_id] = _alfred_location(rng, set(locations.values()))
    start = _alfred_location(rng, set(locations.values()))
    object_kinds = sorted({kind for kind, _, _ in objects})
    facts = [f"(atLocation agent1 {start})"]
    for kind, receptacle_id in receptacles:
        facts += [f"(receptacleType {receptacle_id} {kind}Type)",
                  f"(receptacleAtLocation {receptacle_id} {locations[receptacle_id]})"]
        facts += [f"(openable {receptacle_id})"] if kind in constants.OPENABLE_CLASS_LIST else []
    for kind, object_id, receptacle_id in objects:
        facts += [f"(objectType {object_id} {kind}Type)", f"(inReceptacle {object_id} {receptacle_id})",
                  f"(objectAtLocation {object_id} {locations[receptacle_id]})"]
        facts += [f"(toggleable {object_id})"] if kind == "DeskLamp" else [f"(pickupable {object_id})"]
        facts += [f"(isReceptacleObject {object_id})"] if kind in constants.MOVABLE_RECEPTACLES else []
        facts += [f"({name.lower()} {object_id})" for name in ("Heatable", "Coolable", "Cleanable")
                  if kind in constants.VAL_ACTION_OBJECTS[name]]
    facts += [f"(canContain {r}Type {o}Type)" for r in kinds_present for o in object_kinds
              if o in constants.VAL_RECEPTACLE_OBJECTS.get(r, ())]
    declarations = (["agent1 - agent"] + [f"{k}Type - otype" for k in object_kinds]
                    + [f"{k}Type - rtype" for k in kinds_present]
                    + [f"{o} - object" for _, o, _ in objects] + [f"{r} - receptacle" for _, r in receptacles]
                    + [f"{loc} - location" for loc in sorted(set(locations.values()) | {start})])
    is_look = task_type == "look_at_obj_in_light"
    pddl_params = {"object_target": goal_object, "parent_target": "" if is_look else target,
                   "toggle_target": target if is_look else "", "mrecep_target": "", "object_sliced": False}
    goal = goal_library.gdict[task_type]["pddl"].format(obj=goal_object, recep=target, toggle=target).replace("#", "-")
    stamp = (f"T2019{rng.randint(4, 9):02d}{rng.randint(1, 28):02d}_{rng.randint(0, 23):02d}{rng.randint(0, 59):02d}"
             f"{rng.randint(0, 59):02d}_{rng.randint(0, 999999):06d}")
    indent = "\n        "
    problem = (f"(define (problem plan_trial_{stamp})\n(:domain alfred)\n"
               f"(:objects{indent}{indent.join(declarations)}\n    )\n"
               f"(:init{indent}{indent.join(facts)}\n    )\n{goal}")
    folder = f"{task_type}-{goal_object}-None-{target}-{scene}"
    traj_data = {"task_id": f"trial_{stamp}", "task_type": task_type, "pddl_params": pddl_params,
                 "scene": {"floor_plan": f"FloorPlan{scene}", "scene_num": scene}}
    return folder, f"trial_{stamp}", problem, traj_data


def _alfred_location(rng, taken):
    """ALFRED navigation point id (x, z, rotation, camera horizon), e.g. loc_bar__minus_5_bar_2_bar_3_bar_30."""
    while True:
        point = (rng.randint(-9, 9), rng.randint(-9, 9), rng.randint(0, 3), rng.choice((0, 30, 45, 60)))
        location = "loc_bar_" + "_bar_".join(str(value).replace("-", "_minus_") for value in point)
        if location not in taken:
            return location


def _plan_wins(engine, gamefile):
    """Solvable = the engine's planner finds a plan from the start and replaying it wins."""
    with _ENGINE_LOCK:
        engine.load(gamefile)
        _, infos = engine.reset()
        won = False
        for command in list(infos["policy_commands"]):
            _, _, _, step_infos = engine.step(command)
            won = bool(step_infos["won"])
    return won and bool(infos["policy_commands"])


def generate_games(out_dir, n, seed=0, split="train", task_types=None):
    """Writes n solvable synthetic games under out_dir/json_2.1.1/<split>/; returns their game.tw-pddl paths."""
    textworld, make = _engine()
    import alfworld.gen.constants as constants
    import alfworld.gen.goal_library as goal_library
    from alfworld.agents.utils.misc import add_task_to_grammar
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH
    with open(ALFRED_PDDL_PATH) as handle:
        domain = handle.read()
    with open(ALFRED_TWL2_PATH) as handle:
        grammar = handle.read()
    task_types = list(task_types or TASK_TYPES)
    if set(task_types) - set(TASK_TYPES):
        raise ValueError(f"unknown task types {sorted(set(task_types) - set(TASK_TYPES))}; known: {TASK_TYPES}")
    checker = make(textworld.EnvInfos(won=True, policy_commands=True))
    rng = random.Random(f"alfworld-{split}-{seed}")
    paths = []
    for index in range(n):
        for _ in range(20):
            folder, trial, problem, traj_data = _sample_game(rng, task_types[index % len(task_types)], split,
                                                             constants, goal_library)
            trial_dir = os.path.join(out_dir, "json_2.1.1", split, folder, trial)
            os.makedirs(trial_dir, exist_ok=True)
            # add_task_to_grammar picks its template with the global `random`: seed it from our rng, then restore.
            global_state = random.getstate()
            random.seed(rng.random())
            game = {"pddl_domain": domain, "grammar": add_task_to_grammar(grammar, traj_data),
                    "pddl_problem": problem, "solvable": True}
            random.setstate(global_state)
            gamefile = os.path.join(trial_dir, "game.tw-pddl")
            with open(gamefile, "w") as handle:
                json.dump(game, handle)
            with open(os.path.join(trial_dir, "traj_data.json"), "w") as handle:
                json.dump(traj_data, handle, indent=2)
            if _plan_wins(checker, gamefile):
                paths.append(gamefile)
                break
            shutil.rmtree(trial_dir)
        else:
            raise RuntimeError(f"could not generate a solvable {task_types[index % len(task_types)]} game")
    _GAME_LISTS.clear()  # new games on disk: listings made earlier in this process are stale
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write synthetic ALFWorld games (a folder usable as ALFWORLD_DATA).")
    parser.add_argument("--generate", metavar="DIR", required=True, help="output folder (gets json_2.1.1/<split>/)")
    parser.add_argument("--n", type=int, default=12, help="games per split (task types cycle through the six)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--splits", nargs="+", default=list(SPLITS), choices=SPLITS)
    arguments = parser.parse_args()
    for split_name in arguments.splits:
        written = generate_games(arguments.generate, arguments.n, seed=arguments.seed, split=split_name)
        print(f"{split_name}: {len(written)} games under {os.path.join(arguments.generate, 'json_2.1.1', split_name)}")
    print(f"export ALFWORLD_DATA={os.path.abspath(arguments.generate)}")
