"""The household simulator: a miniature ALFWorld in pure Python, the embedded default env (envs.make_env("household")).

"household" (the default) is a miniature ALFWorld in pure Python: one procedurally generated room per
seed, ALFWorld's six task types, its command grammar, its replies ("You arrive at fridge 1. The fridge 1
is closed.", "Nothing happens.") and its admissible-command lists (sorted, no "help"), so prompts, action
parsers and skills move unchanged to the real engine. "alfworld" is the real engine (adapters/alfworld.py,
optional package and data).

How household departs from ALFWorld (and so from the paper, which trains on ALFWorld):
  - rooms are small (6-9 receptacles, 2-4 distractor objects) and episodes short (max_steps=20), so a
    prompt stays a few hundred tokens and a tiny model on a CPU can learn it; knobs: num_receptacles,
    num_distractors (an int or a (low, high) range) and max_steps;
  - three room kinds: kitchen (heat, cool, clean, put tasks), bathroom (clean, put), bedroom (look, put; it
    has a desklamp on the desk or a sidetable); num_receptacles is capped by what a room kind holds;
  - the world has regularities a hindsight skill can name and reuse: every object kind has 1-3 typical
    places, the first one the likeliest (apples: fridge, countertop, diningtable); the microwave heats,
    the fridge cools, the sinkbasin cleans; openable receptacles (fridge, microwave, cabinet, drawer,
    safe) start closed and hide their contents until opened;
  - splits: `train` and `valid_seen` draw from the same distribution with disjoint seed streams;
    `valid_unseen` uses only the held-out (goal object kind, target kind) pairs, where the target is the
    receptacle kind the object must end in, or the lamp for look_at_obj_in_light. A pair is held out when
    crc32("<object> in <target>") % 4 == 0 (HELD_OUT_PAIRS lists them): about a quarter of the pairs of
    every task type (for look: alarmclock, cellphone, creditcard, laptop). So train never puts an apple
    in a garbagecan nor looks at a laptop under the desklamp, yet sees apples, garbagecans and laptops;
  - ALFWorld's numbering of instances by mangled ids is replaced by plain 1..n per kind;
  - actions are matched after collapsing whitespace and lowercasing (ALFWorld only strips).
`expert_action()` is a searching expert: it knows the room's receptacles but not their contents, checks
the goal object's typical places in order (opening closed ones), remembers what it has seen and then
acts; it wins every generated task within the default max_steps. `info["gt"]` on done carries the
ground truth the hindsight annotator reads.

Run: python envs.py --split valid_unseen --seed 3   (plays this expert and prints the episode)
"""
import copy
import random
import zlib

SPLITS = ("train", "valid_seen", "valid_unseen")

# verl-agent's ALFWorld prompt (agent_system/environments/prompts/alfworld.py), spelling and spacing included,
# shared with the real engine (adapters/alfworld.py): seed.render_prompt fills it. No task line on step 1: the
# first observation states the task. The instruction and the history sentence are the vision env's too.
INSTRUCTION = ("Now it's your turn to take an action.\nYou should first reason step-by-step about the current "
               "situation. This reasoning process MUST be enclosed within <think> </think> tags. \nOnce you've "
               "finished your reasoning, you should choose an admissible action for current step and present it "
               "within <action> </action> tags.\n")
HISTORY = ("Prior to this step, you have already taken {step_count} step(s). Below are the most recent "
           "{history_length} observaitons and the corresponding actions you took: {action_history}\n"  # (sic)
           "You are now at step {current_step} and your current observation is: {observation}")
ACTIONS_LINE = "\nYour admissible actions of the current situation are: [{admissible_actions}].\n\n"
HEADER = "\nYou are an expert agent operating in the ALFRED Embodied Environment."
PROMPT = {"first": HEADER + "\nYour current observation is: {observation}" + ACTIONS_LINE + INSTRUCTION,
          "history": HEADER + " Your task is to: {task}\n" + HISTORY + ACTIONS_LINE + INSTRUCTION,
          "action": "'{}'", "separator": "\n ", "tags": ("action",)}

TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
              "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")
# alfworld.gen.goal_library.gdict[task_type]["templates"]; the grammar adds the final period.
TEMPLATES = {
    "pick_and_place_simple": ("put a {obj} in {recep}", "put some {obj} on {recep}"),
    "look_at_obj_in_light": ("look at {obj} under the {toggle}", "examine the {obj} with the {toggle}"),
    "pick_clean_then_place_in_recep": ("put a clean {obj} in {recep}", "clean some {obj} and put it in {recep}"),
    "pick_heat_then_place_in_recep": ("put a hot {obj} in {recep}", "heat some {obj} and put it in {recep}"),
    "pick_cool_then_place_in_recep": ("put a cool {obj} in {recep}", "cool some {obj} and put it in {recep}"),
    "pick_two_obj_and_place": ("put two {obj} in {recep}", "find two {obj} and put them in {recep}"),
}
# task type -> (verb, appliance kind, object property the appliance sets)
TRANSFORMS = {"pick_clean_then_place_in_recep": ("clean", "sinkbasin", "clean"),
              "pick_heat_then_place_in_recep": ("heat", "microwave", "hot"),
              "pick_cool_then_place_in_recep": ("cool", "fridge", "cool")}
VERB_PROPERTY = {"clean": "clean", "heat": "hot", "cool": "cool"}
EVENT_KINDS = ("take", "put", "heat", "cool", "clean", "use", "open", "close", "go")  # what gt["events"] records

# receptacle kind -> (openable, most instances in one room, what it accepts: None = any object,
# a property name, or a set of object kinds), like ALFWorld's canContain.
RECEPTACLES = {
    "armchair": (False, 1, None), "bed": (False, 1, None), "cabinet": (True, 3, None),
    "coffeemachine": (False, 1, {"mug", "cup"}), "countertop": (False, 2, None), "desk": (False, 1, None),
    "diningtable": (False, 1, None), "drawer": (True, 3, None), "dresser": (False, 1, None),
    "fridge": (True, 1, "cool"), "garbagecan": (False, 1, None), "microwave": (True, 1, "hot"),
    "safe": (True, 1, None), "shelf": (False, 2, None), "sidetable": (False, 2, None),
    "sinkbasin": (False, 1, "clean"), "stoveburner": (False, 2, {"pan", "pot", "kettle"}),
    "toilet": (False, 1, None), "towelholder": (False, 1, {"cloth", "towel"}),
}
# object kind -> (typical places, likeliest first; what can be done to it)
OBJECTS = {
    # kitchen
    "apple": (("fridge", "countertop", "diningtable"), {"hot", "cool", "clean"}),
    "tomato": (("countertop", "fridge", "sinkbasin"), {"hot", "cool", "clean"}),
    "potato": (("countertop", "diningtable", "fridge"), {"hot", "cool", "clean"}),
    "egg": (("fridge", "countertop"), {"hot", "cool", "clean"}),
    "bread": (("countertop", "diningtable", "cabinet"), {"hot", "cool"}),
    "lettuce": (("fridge", "countertop", "diningtable"), {"cool", "clean"}),
    "mug": (("cabinet", "coffeemachine", "sinkbasin"), {"hot", "cool", "clean"}),
    "cup": (("cabinet", "shelf", "countertop"), {"hot", "cool", "clean"}),
    "plate": (("cabinet", "diningtable", "countertop"), {"hot", "cool", "clean"}),
    "bowl": (("cabinet", "shelf", "diningtable"), {"cool", "clean"}),
    "pan": (("stoveburner", "cabinet"), {"cool", "clean"}),
    "pot": (("stoveburner", "cabinet", "shelf"), {"cool", "clean"}),
    "kettle": (("stoveburner", "cabinet"), {"clean"}),
    "spatula": (("drawer", "countertop"), {"clean"}),
    "knife": (("drawer", "countertop"), {"clean"}),
    "fork": (("drawer", "diningtable"), {"clean"}),
    "spoon": (("drawer", "diningtable", "sinkbasin"), {"clean"}),
    "saltshaker": (("cabinet", "shelf", "countertop"), set()),
    "winebottle": (("fridge", "cabinet", "shelf"), {"cool"}),
    # bedroom
    "book": (("desk", "shelf", "bed"), set()),
    "cellphone": (("bed", "desk", "sidetable"), set()),
    "keychain": (("drawer", "dresser", "sidetable"), set()),
    "pen": (("desk", "drawer"), set()),
    "pencil": (("desk", "drawer", "shelf"), set()),
    "alarmclock": (("desk", "sidetable", "dresser"), set()),
    "cd": (("drawer", "safe", "shelf"), set()),
    "creditcard": (("desk", "drawer", "dresser"), set()),
    "pillow": (("bed", "armchair"), set()),
    "laptop": (("bed", "desk"), set()),
    "watch": (("safe", "dresser", "sidetable"), set()),
    "vase": (("shelf", "dresser"), set()),
    # bathroom
    "soapbar": (("countertop", "toilet", "sinkbasin"), {"clean"}),
    "cloth": (("cabinet", "towelholder", "countertop"), {"clean"}),
    "dishsponge": (("sinkbasin", "countertop", "cabinet"), {"clean"}),
    "spraybottle": (("cabinet", "toilet", "garbagecan"), set()),
    "toiletpaper": (("toilet", "cabinet", "shelf"), set()),
    "candle": (("countertop", "shelf", "toilet"), set()),
    "soapbottle": (("countertop", "cabinet", "shelf"), set()),
    "towel": (("towelholder", "shelf"), set()),
}
LAMP, LAMP_PLACES = "desklamp", ("desk", "sidetable")  # the lamp cannot be picked up, only used
# room -> (receptacle kinds always present, kinds that may be added, object kinds found there)
ROOMS = {
    "kitchen": (("countertop", "fridge", "microwave", "sinkbasin"),
                ("cabinet", "coffeemachine", "countertop", "diningtable", "drawer", "garbagecan", "shelf",
                 "stoveburner"),
                ("apple", "tomato", "potato", "egg", "bread", "lettuce", "mug", "cup", "plate", "bowl", "pan",
                 "pot", "kettle", "spatula", "knife", "fork", "spoon", "saltshaker", "winebottle")),
    "bedroom": (("bed", "desk", "sidetable"),
                ("armchair", "drawer", "dresser", "garbagecan", "safe", "shelf", "sidetable"),
                ("book", "cellphone", "keychain", "pen", "pencil", "alarmclock", "cd", "creditcard", "pillow",
                 "laptop", "watch", "vase")),
    "bathroom": (("countertop", "sinkbasin", "toilet"),
                 ("cabinet", "countertop", "drawer", "garbagecan", "shelf", "towelholder"),
                 ("soapbar", "cloth", "dishsponge", "spraybottle", "toiletpaper", "candle", "soapbottle", "towel")),
}
TASK_ROOMS = {"pick_and_place_simple": ("kitchen", "bedroom", "bathroom"), "look_at_obj_in_light": ("bedroom",),
              "pick_clean_then_place_in_recep": ("kitchen", "bathroom"),
              "pick_heat_then_place_in_recep": ("kitchen",), "pick_cool_then_place_in_recep": ("kitchen",),
              "pick_two_obj_and_place": ("kitchen", "bedroom", "bathroom")}


def is_held_out(obj_kind, target_kind):
    """valid_unseen pairs: a fixed quarter of (goal object kind, target kind), stable across runs and machines."""
    return zlib.crc32(f"{obj_kind} in {target_kind}".encode()) % 4 == 0


def accepts(receptacle_kind, obj_kind):
    allowed = RECEPTACLES[receptacle_kind][2]
    if allowed is None:
        return True
    return obj_kind in allowed if isinstance(allowed, set) else allowed in OBJECTS[obj_kind][1]


HELD_OUT_PAIRS = frozenset((o, r) for o in OBJECTS for r in (*RECEPTACLES, LAMP) if is_held_out(o, r))


def kind_of(name):
    return name.rsplit(" ", 1)[0]


def _listing(names):
    """ALFWorld's list: 'nothing', 'a x 1', 'a x 1, and a y 2', 'a x 1, a y 2, and a z 1' (always 'a')."""
    items = [f"a {n}" for n in names]
    if len(items) < 2:
        return items[0] if items else "nothing"
    return ", ".join(items[:-1]) + ", and " + items[-1]


def _sample_count(rng, spec):
    return rng.randint(*spec) if isinstance(spec, tuple) else spec


class HouseholdEnv:
    """Miniature ALFWorld (module docstring): reset(seed) -> (obs, info); step(action) -> (obs, reward, done, info)."""

    def __init__(self, split="train", seed=0, num_receptacles=(6, 9), num_distractors=(2, 4), max_steps=20):
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        self.split, self.max_steps = split, max_steps
        self.num_receptacles, self.num_distractors = num_receptacles, num_distractors
        self._seed_stream = random.Random(f"household/{split}/stream/{seed}")  # seeds for reset(None)

    # ---- world generation ----
    def _sample_task(self, rng):
        """Task type uniformly, then a room, goal object and target allowed by the split's pair rule."""
        task_type = rng.choice(TASK_TYPES)
        want_held_out = self.split == "valid_unseen"
        while True:
            room = rng.choice(TASK_ROOMS[task_type])
            required, optional, objects = ROOMS[room]
            _, tool, prop = TRANSFORMS.get(task_type, (None, None, None))
            obj = rng.choice([o for o in objects if prop is None or prop in OBJECTS[o][1]])
            if task_type == "look_at_obj_in_light":
                targets = [LAMP]
            else:  # the target must accept the object, differ from the appliance, and leave a typical start place
                targets = sorted({k for k in required + optional if accepts(k, obj) and k != tool
                                  and any(p != k and p in required + optional for p in OBJECTS[obj][0])})
            targets = [t for t in targets if is_held_out(obj, t) == want_held_out]
            if targets:
                return task_type, room, obj, rng.choice(targets), tool

    def _generate(self, rng):
        task_type, room, obj, target, tool = self._sample_task(rng)
        required, optional, room_objects = ROOMS[room]
        kinds_here = set(required + optional)
        # The goal object starts at a typical place that is not the target (else the task is already solved).
        starts = [p for p in OBJECTS[obj][0] if p != target and p in kinds_here]
        counts = {k: 1 for k in required}
        counts.setdefault(starts[0], 1)  # the likeliest start place is always there
        if target != LAMP:
            counts.setdefault(target, 1)
        wanted = max(_sample_count(rng, self.num_receptacles), sum(counts.values()))
        while sum(counts.values()) < wanted:
            room_for_more = [k for k in kinds_here if counts.get(k, 0) < RECEPTACLES[k][1]]
            if not room_for_more:
                break
            kind = rng.choice(sorted(room_for_more))
            counts[kind] = counts.get(kind, 0) + 1
        self.receptacles = [f"{k} {i}" for k in sorted(counts) for i in range(1, counts[k] + 1)]
        self.where = {}  # object -> receptacle it is in (held objects are absent)

        def place(name, places):
            present = [p for p in places if p in counts]
            if present:  # likelier the earlier the typical place: weights 3, 2, 1
                kind = rng.choices(present, weights=[3 - places.index(p) for p in present])[0]
                options = [r for r in self.receptacles if kind_of(r) == kind]
            else:
                options = [r for r in self.receptacles if accepts(kind_of(r), kind_of(name))]
            self.where[name] = rng.choice(options)

        goal_count = 2 if task_type == "pick_two_obj_and_place" else 1
        for i in range(1, goal_count + 1):
            place(f"{obj} {i}", starts)
        if room == "bedroom":
            place(f"{LAMP} 1", LAMP_PLACES)
        others = [o for o in room_objects if o != obj]
        distractors = rng.sample(others, min(len(others), _sample_count(rng, self.num_distractors)))
        for kind in distractors:
            place(f"{kind} 1", OBJECTS[kind][0])
        template = rng.choice(TEMPLATES[task_type])
        self.task = template.format(obj=obj, recep=target, toggle=LAMP) + "."
        self.task_type, self.room, self.goal_object = task_type, room, obj
        self.goal_receptacle = None if target == LAMP else target
        self.tool = f"{LAMP} 1" if target == LAMP else (f"{tool} 1" if tool else None)

    # ---- gym interface ----
    def reset(self, seed=None):
        if seed is None:
            seed = self._seed_stream.randrange(2 ** 31)
        self.seed = seed
        rng = random.Random(f"household/{self.split}/{seed}")  # str seeds hash with sha512: stable across runs
        self._generate(rng)
        self._noise_rng = random.Random(f"household/{self.split}/noise/{seed}")
        self.location, self.holding = None, None  # None = the middle of the room
        self.opened, self.observed = set(), set()  # observed: receptacles whose contents the agent has seen
        self.properties = {name: set() for name in self.where}  # "hot", "cool", "clean"
        self.lamp_on, self.won, self.done, self.steps = False, False, False, 0
        self.invalid_steps, self.events = [], []
        self.start_locations = dict(self.where)
        self._expert_plan, self._oracle, self._skip_transform, self._hint = [], False, False, ()
        self._commands = self._admissible_commands()
        # ALFWorld lists kinds alphabetically and, from its id mangling, each kind's numbers in descending order.
        listed = sorted(self.receptacles, key=lambda r: (kind_of(r), -int(r.rsplit(" ", 1)[1])))
        self.observation = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly "
                            f"around you, you see {_listing(listed)}.\n\nYour task is to: {self.task}")
        self._expert_plan = self._play_expert()
        return self.observation, self._info(valid=True)

    def step(self, action):
        if self.done:  # nothing changes after the end, as in ALFWorld
            return self.observation, 0.0, True, self._info(valid=False)
        command = " ".join(action.split()).lower() if isinstance(action, str) and len(action) <= 200 else ""
        effect = self._commands.get(command)
        if effect is None:
            self.invalid_steps.append(self.steps)
            self.observation = "Nothing happens."
        else:
            self.observation = self._apply(*effect)
            self.won = self._goal_reached()
        self.steps += 1
        self.done = self.won or self.steps >= self.max_steps
        self._commands = self._admissible_commands()
        reward = 10.0 if self.won else 0.0
        return self.observation, reward, self.done, self._info(valid=effect is not None)

    def _info(self, valid):
        info = {"task": self.task, "admissible": sorted(self._commands), "won": self.won, "valid": valid,
                "task_type": self.task_type}
        if self.done:
            info["gt"] = {
                "env": "household", "task_type": self.task_type, "task": self.task,
                "goal_object": self.goal_object, "goal_receptacle": self.goal_receptacle, "tool": self.tool,
                "object_locations": {o: r for o, r in self.start_locations.items() if kind_of(o) == self.goal_object},
                "closed_receptacles": [r for r in self.receptacles if RECEPTACLES[kind_of(r)][0]],
                "expert_plan": list(self._expert_plan), "won": self.won, "steps": self.steps,
                "max_steps": self.max_steps, "invalid_steps": list(self.invalid_steps), "events": list(self.events),
                "typical_places": list(OBJECTS[self.goal_object][0]), "room": self.room,
                "split": self.split, "seed": self.seed}
        return info

    # ---- rules: ALFWorld's PDDL preconditions and effects ----
    def _visible(self, receptacle):
        return not RECEPTACLES[kind_of(receptacle)][0] or receptacle in self.opened

    def _admissible_commands(self):
        """command -> (kind, object, receptacle or lamp) for every command the current state allows."""
        here, held = self.location, self.holding
        commands = {"inventory": ("inventory", None, None), "look": ("look", None, None)}
        commands.update({f"go to {r}": ("go", None, r) for r in self.receptacles if r != here})
        if held:
            commands[f"examine {held}"] = ("examine", held, None)
        if here is None:
            return commands
        commands[f"examine {here}"] = ("examine", None, here)
        if RECEPTACLES[kind_of(here)][0]:
            commands[("close " if here in self.opened else "open ") + here] = (
                "close" if here in self.opened else "open", None, here)
        visible = self._visible(here)
        for obj in self._contents(here):
            if kind_of(obj) == LAMP:
                commands[f"use {obj}"] = ("use", None, obj)
            elif visible and held is None:
                commands[f"take {obj} from {here}"] = ("take", obj, here)
        if held and visible and accepts(kind_of(here), kind_of(held)):
            commands[f"move {held} to {here}"] = ("put", held, here)
        for verb, appliance, prop in TRANSFORMS.values():
            if held and kind_of(here) == appliance and prop in OBJECTS[kind_of(held)][1]:
                commands[f"{verb} {held} with {here}"] = (verb, held, here)
        return commands

    def _contents(self, receptacle):
        return sorted((o for o, r in self.where.items() if r == receptacle),
                      key=lambda o: (kind_of(o), int(o.rsplit(" ", 1)[1])))

    def _describe(self, receptacle):
        if self._visible(receptacle):
            self.observed.add(receptacle)
        if not RECEPTACLES[kind_of(receptacle)][0]:
            return f"On the {receptacle}, you see {_listing(self._contents(receptacle))}."
        if receptacle in self.opened:
            return f"The {receptacle} is open. In it, you see {_listing(self._contents(receptacle))}."
        return f"The {receptacle} is closed."

    def _apply(self, kind, obj, target):
        if kind in EVENT_KINDS:
            self.events.append({"step": self.steps, "kind": kind, "object": obj, "target": target})
        if kind == "go":
            self.location = target
            return f"You arrive at {target}. {self._describe(target)}"
        if kind == "open":
            self.opened.add(target)
            return f"You open the {target}. {self._describe(target)}"
        if kind == "close":
            self.opened.discard(target)
            return f"You close the {target}."
        if kind == "take":
            del self.where[obj]
            self.holding = obj
            return f"You pick up the {obj} from the {target}."
        if kind == "put":
            self.where[obj], self.holding = target, None
            return f"You move the {obj} to the {target}."
        if kind in VERB_PROPERTY:  # heating undoes cooling and the other way round, as in the PDDL domain
            self.properties[obj].add(VERB_PROPERTY[kind])
            self.properties[obj].discard({"hot": "cool", "cool": "hot"}.get(VERB_PROPERTY[kind]))
            return f"You {kind} the {obj} using the {target}."
        if kind == "use":
            self.lamp_on = True  # ALFWorld's isToggled never goes back to false
            return f"You turn on the {target}."
        if kind == "inventory":
            return f"You are carrying: a {self.holding}." if self.holding else "You are not carrying anything."
        if kind == "look":  # ALFWorld lists nothing from the middle of the room and no floor objects
            if self.location is None:
                return "You are in the middle of a room. Looking quickly around you, you see nothing."
            return f"You are facing the {self.location}. Next to it, you see nothing."
        if target is not None:  # examine a receptacle
            return self._describe(target)
        temperature = next((p for p in ("hot", "cool") if p in self.properties[obj]), None)
        if "clean" in self.properties[obj]:
            return f"This is a {temperature} and clean {obj}." if temperature else f"This is a clean {obj}."
        if temperature:
            return f"This is a {'hot' if temperature == 'hot' else 'cold'} {obj}."
        return f"There's nothing special about {obj}."

    def _goal_reached(self):
        if self.task_type == "look_at_obj_in_light":
            lamp_place = self.where[self.tool]
            return (self.lamp_on and self.location == lamp_place and self.holding is not None
                    and kind_of(self.holding) == self.goal_object)
        prop = TRANSFORMS.get(self.task_type, (None, None, None))[2]
        per_receptacle = {}
        for obj, receptacle in self.where.items():
            if (kind_of(obj) == self.goal_object and kind_of(receptacle) == self.goal_receptacle
                    and (prop is None or prop in self.properties[obj])):
                per_receptacle[receptacle] = per_receptacle.get(receptacle, 0) + 1
        needed = 2 if self.task_type == "pick_two_obj_and_place" else 1
        return any(n >= needed for n in per_receptacle.values())

    # ---- expert ----
    def expert_action(self, epsilon=0.0, rng=None, oracle=False, skip_transform=False, hint=()):
        """The expert's next command; with probability epsilon a different admissible one (noisy demos).
        oracle=True: the expert already knows where every object is. hint: receptacles it searches first, in
        that order, before its usual ones (where a skill says the object is, rightly or not).
        skip_transform=True: a sub-optimal demonstrator's habit, it carries the object straight to the target
        without heating, cooling or cleaning it (the warm-up's failures that RL must unlearn)."""
        self._oracle, self._skip_transform, self._hint = oracle, skip_transform, tuple(hint)
        best = self._expert_command()
        rng = rng or self._noise_rng
        if epsilon > 0 and rng.random() < epsilon:
            others = sorted(c for c in self._commands if c != best)
            if others:
                return rng.choice(others)
        return best

    def _known_place(self, obj):
        receptacle = self.where.get(obj)
        return receptacle if receptacle in self.observed or self._oracle else None

    def _act_at(self, receptacle, command):
        """Walk to the receptacle, open it if the command needs to see inside, then act."""
        if self.location != receptacle:
            return f"go to {receptacle}"
        if command.split()[0] in ("take", "move") and not self._visible(receptacle):
            return f"open {receptacle}"
        return command

    def _search(self, kinds):
        """Next unseen receptacle: the hinted ones, then typical kinds in their order, then the rest of the room."""
        ordered = [r for r in self._hint if r in self.receptacles]
        ordered += [r for k in kinds for r in self.receptacles if kind_of(r) == k and r not in ordered]
        ordered += [r for r in self.receptacles if r not in ordered]
        for receptacle in ordered:
            if receptacle not in self.observed:
                return f"go to {receptacle}" if self.location != receptacle else f"open {receptacle}"
        return "look"  # unreachable: every object is in some receptacle, and all have been seen

    def _target(self):
        """The target instance: one already holding a goal object (pick two), else open ones, then by number."""
        candidates = [r for r in self.receptacles if kind_of(r) == self.goal_receptacle]
        started = [r for r in candidates if any(kind_of(o) == self.goal_object for o in self._contents(r))]
        if self.task_type == "pick_two_obj_and_place" and started:
            return started[0]
        return min(candidates, key=lambda r: (not self._visible(r), self.receptacles.index(r)))

    def _expert_command(self):
        held = self.holding
        if held is not None and kind_of(held) != self.goal_object:  # put a wrong object back down
            homes = [r for r in self.receptacles if accepts(kind_of(r), kind_of(held))]
            home = self.location if self.location in homes else homes[0]
            return self._act_at(home, f"move {held} to {home}")
        if held is not None:
            if self.task_type in TRANSFORMS and not self._skip_transform:
                verb, appliance, prop = TRANSFORMS[self.task_type]
                if prop not in self.properties[held]:
                    return self._act_at(f"{appliance} 1", f"{verb} {held} with {appliance} 1")
            if self.task_type == "look_at_obj_in_light":
                lamp_place = self._known_place(self.tool)
                return self._act_at(lamp_place, f"use {self.tool}") if lamp_place else self._search(LAMP_PLACES)
            target = self._target()
            return self._act_at(target, f"move {held} to {target}")
        # Only the pick-two task can have a goal object that already counts (one of the two is in place).
        placed = self._target() if self.task_type == "pick_two_obj_and_place" else None
        for obj in sorted(self.where):
            place = self._known_place(obj)
            if kind_of(obj) == self.goal_object and place is not None and place != placed:
                return self._act_at(place, f"take {obj} from {place}")
        # A goal object never starts in the target kind (the task would be solved), so look there last.
        return self._search([k for k in OBJECTS[self.goal_object][0] if k != self.goal_receptacle])

    def _play_expert(self):
        """The expert's commands from the current state, played on a copy of the env."""
        # The simulation never draws random numbers, so it shares the generators (copying them dominates reset).
        shared = {id(self._seed_stream): self._seed_stream, id(self._noise_rng): self._noise_rng}
        simulation = copy.deepcopy(self, shared)
        plan = []
        while not simulation.done:
            plan.append(simulation._expert_command())
            simulation.step(plan[-1])
        return plan


def expert_thought(gt, holding, transformed):
    """The expert's short reasoning before its next command, the <think> of the demonstrations and of the habit
    probe's responses: the current subgoal, from the goal in gt (household or ALFWorld ground truth), whether the
    goal object is held and whether it has been heated, cooled or cleaned yet."""
    obj = gt.get("goal_object") or "object"
    if not holding:
        return f"find the {obj}"
    verb = TRANSFORMS.get(gt.get("task_type"), (None,))[0]
    if verb and not transformed:
        return f"{verb} the {obj}"
    if gt.get("task_type") == "look_at_obj_in_light":
        return "find the desklamp"
    return f"put the {obj} in the {gt.get('goal_receptacle') or 'target'}"
