"""Skills: the text side of SEED's episode-level hindsight skills. Plain data in, strings out.

`analyzer_prompt` (the policy analyzes its own episode into JSON {"episode_summary", "episode_skill"}), `parse_skill`
(never raises), `with_skill` (the teacher context), `annotate` (stage-1 completions), `write_jsonl` / `read_jsonl`
(stage-1 records, so a strong LLM's annotations can replace `annotate`) and `show_tokens` (trained tokens coloured).

Departures from the paper (and from OPID, whose prompt the paper's is inferred from):
- Stage-1 skills come from `annotate`, a rule-based hindsight annotator reading the env's ground truth (household
  gt, or ALFWorld's pddl_params plus the observations), not from a strong LLM: for a success the workflow with its
  decisive observations, for a failure the first decisive mistake and what to do instead, in rng-drawn phrasings.
- The analyzer prompt is compact for a tiny model: one line per step ("Step 3 | return 8.57 | obs: ... | thought:
  ... | action: ..."). Over a token budget, middle steps go first ("... (N steps omitted) ..."), then long texts
  are cut; never the task, outcome or instruction.

Run the tests: python -m pytest -q test_seed.py -k skill
"""
import ast
import itertools
import json
import os
import random
import re
import unicodedata
import warnings
import zlib

GAMMA = 0.95
MAX_SKILL_CHARS = 600
SKILL_HEADER = ("**Episode-Level Skill**\n"
                "Refer to this episode-level skill when deciding what action to take in the current episode:")
JSON_SHAPE = '{"episode_summary": "...", "episode_skill": "..."}'


# ----------------------------------------------------------------------------------------- analyzer prompt
def discounted_returns(rewards, gamma=GAMMA):
    """G_t = r_t + gamma * G_{t+1}, computed backwards from the step rewards."""
    returns = []
    for reward in reversed(rewards):
        returns.append(float(reward) + gamma * (returns[-1] if returns else 0.0))
    return returns[::-1]


def _one_line(text):
    return " ".join(str(text or "").split())


def analyzer_prompt(trajectory, max_tokens=None, count_tokens=None):
    """The prompt under which the policy turns its finished trajectory into one skill (as JSON). Over max_tokens
    (counted by count_tokens: str -> int, default len // 4) middle steps are dropped, then texts cut; the fixed
    part (task, outcome, instruction) is never cut, so a budget below it cannot be met."""
    count_tokens = count_tokens or (lambda text: len(text) // 4)
    steps = trajectory.get("steps") or []
    rows = []
    for number, (step, ret) in enumerate(zip(steps, discounted_returns([s.get("reward", 0.0) for s in steps])), 1):
        action = _one_line(step.get("action"))
        response = step.get("response") or ""
        start = response.find("<action>")  # the first <action>...</action> goes (str.find: a regex is quadratic here)
        end = response.find("</action>", start + len("<action>")) if start >= 0 else -1
        thought = response[:start] + " " + response[end + len("</action>"):] if end >= 0 else response
        thought = _one_line(re.sub(r"</?think>", " ", thought))  # the reasoning; a bare action tag leaves none
        rows.append((number, ret, _one_line(step.get("observation")), "" if thought == action else thought,
                     (action or "(none)") + ("" if step.get("valid", True) or not action else " (invalid)")))
    won = bool(trajectory.get("won"))
    head = (f"Analyze the agent's episode.\nTask: {_one_line(trajectory.get('task'))}\n"
            f"Outcome: {'success' if won else 'failure'} (reward {float(trajectory.get('reward', 0.0)):g}, "
            f"{len(steps)} steps)\n")
    tail = ("The episode succeeded. Give one reusable workflow: the core decision rule and the action order." if won
            else "The episode failed. Give one avoidance rule: the core mistake and its warning signs.")
    tail += f"\nReply with only JSON: {JSON_SHAPE}"

    def cut(text, limit):  # at a word boundary, so a truncated observation still reads as words
        head = text[:limit] if limit is not None and len(text) > limit else None
        return text if head is None else (head.rsplit(" ", 1)[0] if " " in head else head) + " ..."

    def render(keep, limit):
        shown = rows[:(keep + 1) // 2] + rows[len(rows) - keep // 2:]  # head and tail, the middle dropped
        lines = []
        for index, (number, ret, obs, thought, action) in enumerate(shown):
            if index and number > shown[index - 1][0] + 1:
                lines.append(f"... ({number - shown[index - 1][0] - 1} steps omitted) ...")
            text = f"Step {number} | return {ret:.2f} | obs: {cut(obs, limit)}"
            text += f" | thought: {cut(thought, limit)}" if thought else ""
            lines.append(text + f" | action: {cut(action, limit)}")
        return head + "".join(line + "\n" for line in lines) + tail

    # all steps, then one middle step fewer each time (down to the first and last), then shorter texts
    tries = [(keep, None) for keep in range(len(rows), min(len(rows), 2) - 1, -1)]
    for keep, limit in tries + [(min(len(rows), 2), limit) for limit in (400, 200, 100, 50, 25)]:
        prompt = render(keep, limit)
        if max_tokens is None or count_tokens(prompt) <= max_tokens:
            break
    return prompt


# ----------------------------------------------------------------------------------------- skill parser
MAX_PARSE_CHARS = 20000  # analyzer output beyond this is never a single skill; bounds the parser's work
_FUNCTION_WORDS = set("a an the to it in on of and or before after then with if when not do don't first from "
                      "is are was were be for by at so until into only never always any each every".split())
_LABEL = re.compile(r"^[ \t>*#-]*(?:episode[ _-]?(?:level[ _-]?)?skill|skill)(?:\*\*)?[ \t]*[:=](.+)$", re.I | re.M)
# a quoted value (or a list of them) under an episode_skill key, JSON or Python quoting, anywhere in the text: this
# finds it in fenced or chatty answers, with trailing commas, nested, or in an object cut off after the value
_KEY_VALUE = re.compile(r"""(?:["']?episode[^a-z\d"':]?(?:level[^a-z\d"':]?)?skill["']?|["']skill["'])\s*:\s*"""
                        r"""("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|\[[^\[\]{}]*\])""", re.I)
_CURLY_QUOTES = {0x201C: '"', 0x201D: '"', 0x2018: "'", 0x2019: "'"}


def _candidates(text):
    """Possible skill strings, most trustworthy first: key-value pairs (as written, then with curly quotes made
    straight), then a label at the start of a line ("Skill: ...")."""
    for source in dict.fromkeys([text, text.translate(_CURLY_QUOTES)]):
        for match in _KEY_VALUE.finditer(source):
            value = match.group(1)[1:-1]  # unless it decodes as a JSON or Python string or list of strings
            for decode in (json.loads, ast.literal_eval):
                try:
                    value = decode(match.group(1))
                    break
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    pass
            if isinstance(value, list) and value and all(isinstance(part, str) for part in value):
                value = " ".join(value)
            if isinstance(value, str):
                yield value
    for match in _LABEL.finditer(text):
        value = match.group(1).strip()
        yield value[2:] if value.startswith("**") and not value.endswith("**") else value  # "**Skill:** text"


def _clean_skill(value, task):
    """One line of readable text, or None when it is too short, degenerate, a placeholder or the task again."""
    # control, format (zero-width, bidi) and lone-surrogate characters go, and chat special tokens, which would
    # break the teacher prompt; quotes, brackets or bold around the whole skill are wrappers, not content
    skill = "".join(ch for ch in value if ch in "\n\t\r" or unicodedata.category(ch) not in ("Cc", "Cf", "Cs"))
    skill = " ".join(re.sub(r"<\|[^|<>]{0,40}\|>", " ", skill).split())
    while len(skill) > 1 and skill[0] + skill[-1] in ('""', "''", "``", "[]", "**"):
        skill = skill[1:-1].strip()
    words = re.findall(r"[a-z0-9']+", skill.lower())
    new_words = set(words) - set(re.findall(r"[a-z0-9']+", (task or "").lower())) - _FUNCTION_WORDS
    if (len(words) < 4 or len(skill) < 20 or not _FUNCTION_WORDS & set(words) or len(set(words)) < 0.35 * len(words)
            or sum(ch.isalpha() for ch in skill) < 0.6 * len(skill.replace(" ", ""))
            or (task and len(new_words - {"you", "your", "task", "some", "should"}) < 2)
            or "episode_skill" in skill or "episode_summary" in skill or skill.lower().startswith("your task is to")):
        return None
    return skill if len(skill) <= MAX_SKILL_CHARS else skill[:MAX_SKILL_CHARS].rsplit(" ", 1)[0].rstrip(" ,;:-")


def parse_skill(text, task=None):
    """The episode skill in the analyzer's output, or None if there is no usable one. Never raises.

    Accepts clean or fenced JSON, trailing commas, single quotes, chatter around it, and a sentence after a label
    at a line start ("Skill: ..."). Rejects empty, truncated (the skill's closing quote missing), degenerate or
    placeholder output and, given `task`, a skill that only restates it. Returns one printable line, <= 600 chars.
    """
    try:
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        if not isinstance(text, str):
            return None
        text = "".join(ch for ch in text[:MAX_PARSE_CHARS] if ch in "\n\t" or unicodedata.category(ch) != "Cc")
        with warnings.catch_warnings():  # stray backslashes in model text warn in ast.literal_eval
            warnings.simplefilter("ignore")
            return next(filter(None, (_clean_skill(value, task) for value in _candidates(text))), None)
    except Exception:  # top-level guard: a bad analysis must cost one trajectory's signal, never the run
        return None


# ----------------------------------------------------------------------------------------- teacher context
def with_skill(prompt, skill):
    """The teacher prompt: `prompt` with "\\n\\n" + SKILL_HEADER + "\\n[skill]\\n" inserted at the end of the first
    line with "Your task is to:", else at the start of the line with "Now it's your turn" (block + "\\n\\n"), else
    appended. The ordinary prompt is exactly prompt[:k] + prompt[k:] around the block, byte for byte."""
    if not isinstance(skill, str) or not skill.strip():
        raise ValueError("with_skill needs a non-empty skill string (skip trajectories whose skill is None)")
    block = f"{SKILL_HEADER}\n[{skill.strip()}]"
    task_line = re.search(r"Your task is to:[^\r\n]*", prompt)  # the block goes after this line ...
    turn_line = re.search(r"^.*Now it's your turn", prompt, re.M)  # ... or else before this one
    if task_line:
        return prompt[:task_line.end()] + "\n\n" + block + "\n" + prompt[task_line.end():]
    if turn_line:
        return prompt[:turn_line.start()] + block + "\n\n" + prompt[turn_line.start():]
    return prompt + "\n\n" + block + "\n"


# ----------------------------------------------------------------------------------------- hindsight annotator
_TASK_VERB = {"pick_heat_then_place_in_recep": "heat", "pick_cool_then_place_in_recep": "cool",
              "pick_clean_then_place_in_recep": "clean", "look_at_obj_in_light": "use"}
_TOOL_KIND = {"heat": "microwave", "cool": "fridge", "clean": "sinkbasin"}
_PAST = {"heat": "heated", "cool": "cooled", "clean": "cleaned"}
_SURFACES = set("countertop shelf desk diningtable sidetable coffeetable dresser sofa bed armchair stoveburner "
                "toilet cart ottoman tvstand".split())
_ACTIONS = [("go", r"go to (?P<target>.+)"), ("open", r"open (?P<target>.+)"), ("close", r"close (?P<target>.+)"),
            ("take", r"take (?P<object>.+?) from (?P<target>.+)"), ("put", r"move (?P<object>.+?) to (?P<target>.+)"),
            ("transform", r"(?P<verb>heat|cool|clean) (?P<object>.+?) with (?P<target>.+)"),
            ("use", r"use (?P<target>.+)")]
# Per mistake (see _mistakes): what happened, for the summary, and two phrasings of the skill. The str.format
# fields come from _failure; a capitalised field name gives the value capitalised.
_FAILURES = {
    "wrong_tool": ("it used the {used} instead of the {tool_kind}", [
        "{Purpose} the {goal} with the {tool_kind} ({tool}), not the {used}: '{action}' {result}.",
        "Wrong appliance: '{action}' {result}. To {purpose} {a_goal} you need the {tool_kind}, so go to {tool}."]),
    "placed_early": ("it put the {goal} {at_target} before it was {past}", [
        "{Verb} the {goal} with {tool} before putting it {at_target}; here it was put there while not yet {past}.",
        "Mistake: moved the {goal} to {place} before it was {past}. Always {verb} it with {tool} first."]),
    "wrong_object": ("it took {object} instead of {a_goal}", [
        "Take only the object the task names: it needs {a_goal}, but the agent picked up {object}.",
        "Mistake: took {object} instead of {a_goal}. Read the object names and take {a_goal}{where}."]),
    "invalid": ("{what} did nothing, {count} times", [
        "Do not repeat what answers 'Nothing happens.': {what} did nothing {count} times. {Hint}.",
        "Warning sign: 'Nothing happens.' after {what}. Change the plan, do not retry ({count} tries): {hint}."]),
    "closed": ("it never opened the closed {skipped}", [
        "When looking for {a_goal}, open closed receptacles you arrive at: {inside}.",
        "A closed {kind} hides what is inside; after 'The {place} is closed.' use 'open {place}'. Here {inside}."]),
    "circling": ("it kept revisiting {revisited} and ran out of steps", [
        "Keep track of searched receptacles and do not revisit them: the agent went back to {revisited}. {lead}",
        "Warning sign: arriving again at a receptacle already searched ({revisited}). Go somewhere new. {lead}"]),
    "never_found": ("it never found the {goal}", [
        "Search every likely place for {a_goal} and open closed ones. {lead}",
        "The {goal} was never found. {lead} Check {typical} systematically."]),
    "unfinished": ("{stage}", [  # the fallback: the stage never done (_STAGES) and what to do instead
        "{Next}; here {stage} before the steps ran out.",
        "Warning sign: steps running out with the task unfinished ({stage}). For {family} tasks: {next}."]),
}
_STAGES = {
    "transform": ("it took the {goal} but never {past} it", "{verb} it with {tool} right after taking it"),
    "lamp": ("it had the {goal} but never used {tool}", "hold the {goal} and turn on {tool} with 'use {tool}'"),
    "second": ("it placed only one of the two {goals}", "after the first {goal}, put a second one {at_target}"),
    "place": ("it never put the {goal} {at_target}", "once the {goal} is {ready}, take it straight to the {target}"),
    "finish": ("it did not finish the task", "find the {goal}, take it, then finish the task without detours")}


def _kind(name):
    """'drawer 2' -> 'drawer'; household and (demangled) ALFWorld names are 'kind number'."""
    return re.sub(r"\s+\d+$", "", str(name or "").strip().lower())


def _parse_action(action):
    """An ALFWorld command as an event {"kind", "object", "target"} (the gt events' shape), or None."""
    for kind, pattern in _ACTIONS:
        match = re.fullmatch(pattern, _one_line(action).lower())
        if match:
            return {"kind": match.groupdict().get("verb") or kind, "object": match.groupdict().get("object"),
                    "target": match["target"]}
    return None


def _items(listing):
    """'a apple 1, a mug 2, and a knife 1' -> ['apple 1', 'mug 2', 'knife 1']."""
    parts = [part.strip() for part in re.split(r",\s*(?:and\s+)?|\s+and\s+", listing)]
    return [re.sub(r"^(?:an?|some)\s+", "", part) for part in parts if part not in ("", "nothing")]


def _a(noun):
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def _plural(noun):
    irregular = {"shelf": "shelves", "knife": "knives", "potato": "potatoes", "tomato": "tomatoes"}
    return irregular.get(noun) or noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")


def _listing(names, limit=3):
    """'a, b and 2 more': lists stay short so a skill stays under about 60 words."""
    names = list(dict.fromkeys(names))
    shown = names[:limit] + ([f"{len(names) - limit} more"] if len(names) > limit else []) or [""]
    return shown[0] if len(shown) < 2 else ", ".join(shown[:-1]) + " and " + shown[-1]


def _at(receptacle, shown=None):
    """'on countertop 1', 'in drawer 2'; `shown` replaces the name after the preposition ('on a countertop')."""
    return ("on " if _kind(receptacle) in _SURFACES else "in ") + (shown or receptacle)


def _facts(trajectory, gt):
    """What the annotator knows. Household gt gives object locations, closed receptacles and events; for ALFWorld
    (pddl_params only) they are read from the observations and the valid actions."""
    steps, task_type = trajectory.get("steps") or [], gt.get("task_type") or ""
    verb, params = _TASK_VERB.get(task_type), gt.get("pddl_params") or {}
    goal = _kind(gt.get("goal_object") or params.get("object_target"))
    if not goal:
        raise ValueError("annotate needs gt['goal_object'] (household) or gt['pddl_params']['object_target']")
    tool_kind = _kind(gt.get("tool") or (params.get("toggle_target") if verb == "use" else None)) or \
        _TOOL_KIND.get(verb) or ("lamp" if verb == "use" else None)
    invalid = set(gt.get("invalid_steps") or []) | {i for i, step in enumerate(steps) if not step.get("valid", True)}
    actions = [_one_line(step.get("action")) for step in steps]
    events = gt["events"] if isinstance(gt.get("events"), list) else [
        dict(event, step=i) for i, event in enumerate(map(_parse_action, actions)) if event and i not in invalid]
    seen, closed = {}, set(gt.get("closed_receptacles") or [])
    texts = [_one_line(step.get("observation")).lower() for step in steps]
    for text in texts:  # "On the X, you see ...", "The X is open. In it, you see ...", "The X is closed."
        for place, listing in re.findall(r"(?:on the|the) ([a-z]+ \d+)(?:,| is open\. in it,) you see ([^.]*)\.", text):
            for item in _items(listing):
                seen.setdefault(item, place)
        closed.update(re.findall(r"the ([a-z]+ \d+) is closed\.", text) if "closed_receptacles" not in gt else [])
    room = re.findall(r"looking quickly around you, you see ([^.]*)\.", texts[0] if texts else "")
    room = _items(room[0]) if room else []
    target = _kind(gt.get("goal_receptacle") or params.get("parent_target")) or None
    locations = gt.get("object_locations") or {item: place for item, place in seen.items() if _kind(item) == goal}
    # where the kind is usually kept (household gt), else where it was here: what carries over to the next episode
    typical = [kind for kind in gt.get("typical_places") or [] if kind != target] or \
        sorted({_kind(place) for place in locations.values()})
    # the appliance or lamp the agent used, else the gt's, else one of that kind in the room, else "the <kind>"
    tools = [event["target"] for event in events if event["kind"] == verb] + [gt.get("tool")] + \
        [name for name in room + list(seen) if _kind(name) == tool_kind] + [f"the {tool_kind}"]
    family = {"use": "examine-in-light"}.get(verb, verb) or ("two-object" if "two" in task_type else "pick-and-place")
    return {"family": family, "verb": verb, "goal": goal, "tool_kind": tool_kind,
            "tool": next(filter(None, tools)), "target": target, "locations": locations, "closed": closed,
            "room": room, "seen": seen, "typical": typical[:2], "events": events, "actions": actions,
            "invalid": invalid, "steps": len(steps), "won": bool(gt.get("won", trajectory.get("won"))),
            "taken": [event for event in events if event["kind"] == "take" and _kind(event["object"]) == goal],
            "needed": 2 if task_type == "pick_two_obj_and_place" else 1,
            "task": _one_line(gt.get("task") or trajectory.get("task"))}


def _success(facts, rng):
    """The workflow in order, with its decisive observations: where the object was, which appliance."""
    goal, verb, family, tool, seen = facts["goal"], facts["verb"], facts["family"], facts["tool"], facts["seen"]
    puts = [event["target"] for event in facts["events"] if event["kind"] == "put" and _kind(event["object"]) == goal]
    target, taken = puts[-1] if puts else facts["target"], facts["taken"][:facts["needed"]]
    sources = [facts["locations"].get(event["object"]) or event.get("target") for event in taken]
    wheres = [rng.choice([f"it was in the closed {source}, open it first", f"{source} was closed and had to be opened"]
                         if source in facts["closed"] else [f"it was {_at(source)}", f"found {_at(source)}"])
              for source in sources if source]  # the decisive observation: where each one was, and if shut away
    order = [rng.choice(["find", "look for"]) + f" the {goal}" + (f" ({wheres[0]})" if wheres else ""),
             rng.choice(["take it", "pick it up"])]
    lamp = f"{tool} ({_at(seen[tool])})" if tool in seen else tool
    if verb:
        order.append(rng.choice([f"carry it to {lamp} and use {tool}", f"turn on {lamp} while holding it"]
                                if verb == "use" else [f"{verb} it with {tool}", f"use {tool} to {verb} it"]))
    if target:
        order.append(rng.choice([f"put it {_at(target)}", f"move it to {target}"]))
    if facts["needed"] == 2:
        order.append(rng.choice(["find a second one", "repeat with another one"])
                     + (f" ({wheres[1]})" if len(wheres) > 1 else ""))
    sequence = ", ".join(order[:-1]) + ", then " + order[-1]
    skill = rng.choice([f"For {family} tasks: {sequence}.",
                        f"{sequence[0].upper() + sequence[1:]}; this order solves {family} tasks."])
    if facts["typical"] and rng.random() < 0.7:
        places = _listing([("on " if kind in _SURFACES else "in ") + _plural(kind) for kind in facts["typical"]])
        skill += rng.choice([f" Look for {_a(goal)} {places} first.", f" {_a(goal).capitalize()} is usually {places}."])
    summary = (f"The agent completed '{facts['task']}' in {facts['steps']} step{'s' * (facts['steps'] != 1)}"
               + (f": it took the {goal} from {_listing([event.get('target') for event in taken])}" if taken else "")
               + (f", {_PAST[verb]} it with {tool}" if verb in _PAST else f", used {tool}" if verb else "")
               + (f" and put it {_at(target)}." if target else "."))
    return summary, skill


def _mistakes(facts):
    """Candidate mistakes as (tier, step, name, fields); the annotator reports the lowest (tier, step). Tier 0 makes
    the task impossible this way (wrong appliance, placed before heating/cooling/cleaning, a wrong object used for
    the task); tier 1 wastes steps (a command or a reply without action tag repeated though it did nothing; walking
    past closed receptacles); tier 2 explains a failed search (circling, never found); tier 3, the fallback, names
    the stage never done."""
    goal, verb, target, events, actions = (facts[key] for key in ("goal", "verb", "target", "events", "actions"))
    found, taken, done = [], facts["taken"], set()
    for step, event in enumerate(map(_parse_action, actions)):  # attempts count: the env rejects a wrong appliance
        used = _kind(event and event["target"])
        transform = verb in _TOOL_KIND and event and event["kind"] in _TOOL_KIND and _kind(event["object"]) == goal
        if (transform or verb == "use" and event and event["kind"] == "use" and "lamp" in used) \
                and used != facts["tool_kind"]:
            result = "did nothing" if step in facts["invalid"] else "did the wrong thing"
            found.append((0, step, "wrong_tool", {"action": actions[step], "used": used, "result": result}))
            break
    for event in events if verb in _TOOL_KIND else []:
        if event["kind"] == verb:
            done.add(event["object"])
        elif event["kind"] == "put" and _kind(event["object"]) == goal and _kind(event["target"]) == target \
                and event["object"] not in done:
            found.append((0, event["step"], "placed_early", {"place": event["target"]}))
            break
    for event in events:  # a wrong object taken and then used for the task (transformed, or put at the target)
        later = [other for other in events if other["step"] > event["step"] and other["object"] == event["object"]]
        if event["kind"] == "take" and _kind(event["object"]) != goal and any(
                other["kind"] in _TOOL_KIND or other["kind"] == "put" and _kind(other["target"]) == target
                for other in later):
            where = _listing([_at(place) for place in sorted(set(facts["locations"].values()))], 2)
            found.append((0, event["step"], "wrong_object", {"object": event["object"],
                                                             "where": where and f" ({where})"}))
            break
    tries = {}  # the same command doing nothing twice; a reply without an action tag counts as the command ""
    for step, action in enumerate(actions):
        if step in facts["invalid"] or not action:
            tries.setdefault(action, []).append(step)
    repeated = sorted((steps[1], action, len(steps)) for action, steps in tries.items() if len(steps) >= 2)
    if repeated:
        step, action, count = repeated[0]
        event = _parse_action(action) or {"kind": None, "target": None}
        shut = facts["closed"] - {other["target"] for other in events if other["kind"] == "open"
                                  and other["step"] < step}
        hint = ("always end the reply with one admissible command inside the action tags" if not action
                else f"open {event['target']} first" if event["kind"] == "take" and event["target"] in shut
                else "take only objects listed in the current observation" if event["kind"] == "take"
                else "pick a command from the admissible actions")
        found.append((1, step, "invalid", {"what": f"'{action}'" if action else "replies without an action tag",
                                           "count": count, "hint": hint}))
    visits = [(event["step"], event["target"]) for event in events if event["kind"] == "go"]
    opened = {event["target"] for event in events if event["kind"] == "open"}
    if len(taken) < facts["needed"] and not facts["won"]:
        skipped = [(step, place) for step, place in visits if place in facts["closed"] and place not in opened]
        decisive = [(step, place) for step, place in skipped if place in facts["locations"].values()]
        if decisive or skipped and not facts["locations"]:  # where it was is unknown: open what was skipped
            step, place = (decisive or skipped)[0]
            names = place if decisive else _listing([place for _, place in skipped])
            inside = (f"the {goal} was inside {place}, which the agent visited but never opened" if decisive
                      else f"{names} stayed closed and the {goal} was never found")
            found.append((1, step, "closed", {"place": place, "kind": _kind(place), "inside": inside,
                                              "skipped": names}))
        checked = {place for _, place in visits if place not in facts["closed"] or place in opened}
        missed = sorted({place for item, place in facts["locations"].items()
                         if item not in {event["object"] for event in taken}})
        unchecked = [_at(place) for place in missed if place not in checked]
        unvisited = [place for place in facts["room"] if place not in checked]
        lead = (f"The {goal} was {_listing(unchecked)}, never checked." if unchecked else
                f"The {goal} was seen {_listing(map(_at, missed))} but not taken; take it when you see it." if missed
                else f"Unvisited: {_listing(unvisited)}." if unvisited  # where it was is unknown (ALFWorld)
                else "Open closed receptacles and look inside.")
        revisits = [(step, place) for index, (step, place) in enumerate(visits)
                    if place in {earlier for _, earlier in visits[:index]}]
        if len(revisits) >= 3:
            found.append((2, revisits[0][0], "circling", {"revisited": _listing(place for _, place in revisits),
                                                          "lead": lead}))
        found.append((2, facts["steps"], "never_found", {"lead": lead}))
    kinds_done = {event["kind"] for event in events if event["object"] is None or _kind(event["object"]) == goal}
    placed = any(event["kind"] == "put" and _kind(event["object"]) == goal and _kind(event["target"]) == target
                 for event in events)
    stage = ("transform" if verb in _TOOL_KIND and verb not in kinds_done else
             "lamp" if verb == "use" and "use" not in kinds_done else
             "second" if target and placed and facts["needed"] == 2 else "place" if target else "finish")
    return found + [(3, facts["steps"], "unfinished", {"stage": stage})]


def _failure(facts, rng):
    """The first decisive mistake (lowest tier, then earliest) and what to do instead."""
    _, step, name, details = min(_mistakes(facts), key=lambda mistake: mistake[:2])
    verb, target = facts["verb"] or "", facts["target"]
    fields = {"goal": facts["goal"], "a_goal": _a(facts["goal"]), "goals": _plural(facts["goal"]), "verb": verb,
              "tool": facts["tool"], "tool_kind": facts["tool_kind"], "target": target, "family": facts["family"],
              "at_target": _at(target, _a(target)) if target else "in its place", "past": _PAST.get(verb, ""),
              "ready": _PAST.get(verb, "in hand"), "purpose": "examine" if verb == "use" else verb,
              "typical": _listing(map(_plural, facts["typical"])) or "every receptacle", **details}
    if name == "unfinished":
        fields["stage"], fields["next"] = (text.format(**fields) for text in _STAGES[details["stage"]])
    fields.update({key.capitalize(): value[:1].upper() + value[1:] for key, value in list(fields.items())
                   if isinstance(value, str)})
    what, options = _FAILURES[name]
    summary = (f"The agent failed '{facts['task']}' after {facts['steps']} step{'s' * (facts['steps'] != 1)}: "
               + what.format(**fields) + (f" (step {step + 1})." if step < facts["steps"] else "."))
    return summary, rng.choice(options).format(**fields)


def annotate(trajectory, gt=None, rng=None):
    """The stage-1 completion for `trajectory`: JSON {"episode_summary", "episode_skill"}, a skill of one or two
    sentences under 60 words. gt: the env's info["gt"] (household or ALFWorld), default trajectory["gt"]; rng: a
    random.Random choosing among phrasings, default one seeded from the trajectory (repeatable)."""
    gt = gt if gt is not None else trajectory.get("gt")
    if not isinstance(gt, dict):
        raise ValueError("annotate needs the env's ground truth dict (info['gt'] of the last step)")
    if rng is None:
        key = json.dumps([trajectory.get("task"), [step.get("action") for step in trajectory.get("steps") or []]])
        rng = random.Random(zlib.crc32(key.encode("utf-8", "replace")))
    if gt.get("env") in ("vision", "miniwob"):
        summary, skill = (_vision_annotation if gt["env"] == "vision" else _miniwob_annotation)(trajectory, gt, rng)
        return json.dumps({"episode_summary": summary, "episode_skill": skill}, ensure_ascii=False)
    facts = _facts(trajectory, gt)
    summary, skill = (_success if facts["won"] else _failure)(facts, rng)
    return json.dumps({"episode_summary": summary, "episode_skill": skill}, ensure_ascii=False)


def _vision_annotation(trajectory, gt, rng):
    """Screenshot click tasks (envs_vision gt): where the targets were, and for a failure the wrong click."""
    look = lambda cell: " ".join(gt["items"].get(cell, gt["items"].get(str(cell), ["empty", "cell"])))
    targets = " then ".join(f"the {look(c)} in cell {c}" for c in gt["targets"])
    clicks = [f"cell {c}" for c, _ in gt["clicked"]] or ["nothing"]
    if gt["won"]:
        summary = f"The agent solved '{gt['task']}' by clicking {', '.join(clicks)}."
        return summary, rng.choice([f"Find the target in the screenshot and click its cell: {targets}.",
                                    f"The task wanted {targets}; read colour and shape, then click that cell."])
    mistake = gt.get("mistake")
    if mistake:
        wrong = f"cell {mistake['cell']} held a {' '.join(mistake['item'])}"
        summary = f"The agent failed '{gt['task']}': it clicked cell {mistake['cell']}, a {' '.join(mistake['item'])}."
        return summary, rng.choice([f"Check colour and shape before clicking: {wrong}, but the task wanted {targets}.",
                                    f"Mistake: {wrong}. Click {targets}."])
    what = "invalid actions" if gt.get("invalid_steps") else "empty cells"
    summary = f"The agent failed '{gt['task']}': it used its steps on {what} ({', '.join(clicks)})."
    return summary, rng.choice([f"Answer 'click N' with the cell of the target: {targets}.",
                                f"Do not waste steps on {what}; the task wanted {targets}."])


def _miniwob_annotation(trajectory, gt, rng):
    """MiniWoB (envs_miniwob gt): the actions that worked, or the scripted solution the failure missed."""
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


# ----------------------------------------------------------------------------------------- stage-1 files, token view
def _checked(record, where):
    if not (isinstance(record, dict) and all(isinstance(record.get(key), str) for key in ("prompt", "completion"))):
        raise ValueError(f"{where}: expected a dict with string 'prompt' and 'completion'")
    return record


def write_jsonl(path, records):
    """Write {"prompt", "completion"} records one per line (UTF-8); checks every record before writing."""
    records = [_checked(record, f"record {index}") for index, record in enumerate(records)]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def read_jsonl(path):
    """Read {"prompt", "completion"} records; blank lines are skipped, a bad line raises naming file:line."""
    records = []
    with open(path, "rb") as handle:  # bytes: a line that is not UTF-8 is reported with its number too
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{number}: not UTF-8 (byte {error.start + 1} of the line)") from None
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: malformed JSON ({error.msg}, column {error.colno})") from None
                records.append(_checked(record, f"{path}:{number}"))
    return records


_TRAINED, _MASKED, _RESET = "\x1b[30;42m", "\x1b[2m", "\x1b[0m"


def show_tokens(ids, mask, tokenizer, color=True):
    """One row of tokens: trained ones (mask 1) highlighted green, masked ones dim; without colour, trained
    runs are wrapped in [[ ]]. `ids`/`mask` may be lists or tensors; `tokenizer` only needs .decode([id])."""
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    mask = mask.tolist() if hasattr(mask, "tolist") else list(mask)
    if len(ids) != len(mask):
        raise ValueError(f"ids and mask differ in length: {len(ids)} vs {len(mask)}")
    opening, closing = (_TRAINED, _MASKED) if color else ("[[", "]]")
    runs = [(trained, "".join(tokenizer.decode([token_id]) for token_id, _ in run))
            for trained, run in itertools.groupby(zip(ids, mask), key=lambda pair: bool(pair[1]))]
    text = "".join(opening + part + closing if trained else part for trained, part in runs)
    return _MASKED + text + _RESET if color else text
