"""annotators/text_worlds.py: the stage-1 data maker for the text worlds -- a rule-based hindsight annotator for
household, ALFWorld and WebShop episodes (envs.py names it as their annotator).

annotate(trajectory, gt, rng) writes what stage 1 trains the analyzer on (seed.hindsight_examples turns it into
the JSON {"episode_summary", "episode_skill"}): for a success the workflow with its decisive observations, for a
failure the first decisive mistake and what to do instead, in rng-drawn phrasings. It reads the env's ground
truth (household gt, ALFWorld's pddl_params plus the observations). The screenshot envs' annotators live with
those envs (simulators/vision.py, adapters/miniwob.py); annotators/jsonl.py keeps {"prompt", "completion"}
records, so a strong LLM's annotations can replace these (train.py --sft-data).

Departure from the paper: the paper's stage-1 skills were written by a strong external LLM.
"""
import json
import random
import re
import zlib

from simulators.household import TRANSFORMS
from skills import _one_line

# ALFWorld's heat/cool/clean facts have one home, the household simulator's TRANSFORMS
_TASK_VERB = {**{task: verb for task, (verb, _, _) in TRANSFORMS.items()}, "look_at_obj_in_light": "use"}
_TOOL_KIND = {verb: appliance for verb, appliance, _ in TRANSFORMS.values()}
_PAST = {verb: verb + "ed" for verb in _TOOL_KIND}
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
    steps, task_type = trajectory.steps, gt.get("task_type") or ""
    verb, params = _TASK_VERB.get(task_type), gt.get("pddl_params") or {}
    goal = _kind(gt.get("goal_object") or params.get("object_target"))
    if not goal:
        raise ValueError("annotate needs gt['goal_object'] (household) or gt['pddl_params']['object_target']")
    tool_kind = _kind(gt.get("tool") or (params.get("toggle_target") if verb == "use" else None)) or \
        _TOOL_KIND.get(verb) or ("lamp" if verb == "use" else None)
    invalid = set(gt.get("invalid_steps") or []) | {i for i, step in enumerate(steps) if not step.valid}
    actions = [_one_line(step.action) for step in steps]
    events = gt["events"] if isinstance(gt.get("events"), list) else [
        dict(event, step=i) for i, event in enumerate(map(_parse_action, actions)) if event and i not in invalid]
    seen, closed = {}, set(gt.get("closed_receptacles") or [])
    texts = [_one_line(step.observation).lower() for step in steps]
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
            "invalid": invalid, "steps": len(steps), "won": bool(gt.get("won", trajectory.won)),
            "taken": [event for event in events if event["kind"] == "take" and _kind(event["object"]) == goal],
            "needed": 2 if task_type == "pick_two_obj_and_place" else 1,
            "task": _one_line(gt.get("task") or trajectory.task)}


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
        shut = facts["closed"] - {other["target"] for other in events if other["kind"] == "open"
                                  and other["step"] < step}
        found.append((1, step, "invalid", _refusal(action, count, shut)))
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


def _refusal(action, count, shut=()):
    """The fields of the "invalid" mistake: a command (or, as "", a reply without an action tag) that the env
    refused `count` times, and what to do instead (shut: the receptacles still closed at that step)."""
    event = _parse_action(action) or {"kind": None, "target": None}
    hint = ("always end the reply with one admissible command inside the action tags" if not action
            else f"open {event['target']} first" if event["kind"] == "take" and event["target"] in shut
            else "take only objects listed in the current observation" if event["kind"] == "take"
            else "pick a command from the admissible actions")
    return {"what": f"'{action}'" if action else "replies without an action tag", "count": count, "hint": hint}


def refusal_skill(action, count, rng):
    """The skill this annotator writes when a failure's first decisive mistake is `action` refused `count` times
    (experiments/experiment.py loop_decisions asks for it with the refused command and with another one)."""
    return rng.choice(_FAILURES["invalid"][1]).format(**_with_capitals(_refusal(action, count)))


def _with_capitals(fields):
    """fields plus, for each text field, its capitalized twin ("hint" -> "Hint") for a sentence's start."""
    return {**fields, **{key.capitalize(): value[:1].upper() + value[1:] for key, value in fields.items()
                         if isinstance(value, str)}}


def _first_mistake(facts):
    """The first decisive mistake: the lowest tier, then the earliest -> (tier, step, name, fields)."""
    return min(_mistakes(facts), key=lambda mistake: mistake[:2])


def mistake_kind(trajectory):
    """The name of a failed episode's first decisive mistake as the annotator finds it ("invalid", "placed_early",
    "circling", ...; the keys of names_fix's fixes); None for a success or an episode without ground truth."""
    if trajectory.won or not isinstance(trajectory.gt, dict):
        return None
    return _first_mistake(_facts(trajectory, trajectory.gt))[2]


def _failure(facts, rng):
    """The first decisive mistake and what to do instead."""
    _, step, name, details = _first_mistake(facts)
    verb, target = facts["verb"] or "", facts["target"]
    fields = {"goal": facts["goal"], "a_goal": _a(facts["goal"]), "goals": _plural(facts["goal"]), "verb": verb,
              "tool": facts["tool"], "tool_kind": facts["tool_kind"], "target": target, "family": facts["family"],
              "at_target": _at(target, _a(target)) if target else "in its place", "past": _PAST.get(verb, ""),
              "ready": _PAST.get(verb, "in hand"), "purpose": "examine" if verb == "use" else verb,
              "typical": _listing(map(_plural, facts["typical"])) or "every receptacle", **details}
    if name == "unfinished":
        fields["stage"], fields["next"] = (text.format(**fields) for text in _STAGES[details["stage"]])
    fields = _with_capitals(fields)
    what, options = _FAILURES[name]
    summary = (f"The agent failed '{facts['task']}' after {facts['steps']} step{'s' * (facts['steps'] != 1)}: "
               + what.format(**fields) + (f" (step {step + 1})." if step < facts["steps"] else "."))
    return summary, rng.choice(options).format(**fields)


def annotate(trajectory, gt=None, rng=None):
    """(summary, skill) for a finished text-world trajectory (a seed.Trajectory): a skill of one or two sentences
    under 60 words. gt: the env's info["gt"] (household, ALFWorld or WebShop), default trajectory.gt; rng: a
    random.Random choosing among phrasings, default one seeded from the trajectory (repeatable)."""
    gt = gt if gt is not None else trajectory.gt
    if not isinstance(gt, dict):
        raise ValueError("annotate needs the env's ground truth dict (info['gt'] of the last step)")
    if rng is None:
        key = json.dumps([trajectory.task, [step.action for step in trajectory.steps]])
        rng = random.Random(zlib.crc32(key.encode("utf-8", "replace")))
    facts = _facts(trajectory, gt)
    return (_success if facts["won"] else _failure)(facts, rng)


def names_fix(trajectory, skill):
    """Whether a skill written about a failed episode names the fix its ground truth gives (the self-analysis
    probe's "fixing skills"): the first decisive mistake, as the annotator finds it, and the words that fix it --
    the verb or appliance of a skipped or wrong heat / cool / clean step, the object a wrong one was taken
    instead of, the closed or unchecked place where the object was, the commands to use instead of ones that did
    nothing (not inside a quoted command the env refused). A verb, appliance or object counts only outside quotes:
    a warning that quotes a command ("'examine microwave 1' did nothing") reports it, it does not say what to do.
    None for a success (nothing to fix); False for a skill that did not parse."""
    if trajectory.won or not isinstance(trajectory.gt, dict):
        return None
    if not skill:
        return False
    facts = _facts(trajectory, trajectory.gt)
    _, _, name, details = _first_mistake(facts)
    places = sorted(set(facts["locations"].values()))
    fixes = {"wrong_tool": [facts["tool_kind"]], "placed_early": [facts["verb"], facts["tool_kind"]],
             "wrong_object": [facts["goal"]], "closed": [details.get("place"), "open"],
             "circling": places, "never_found": places,
             "invalid": ["admissible", "listed", "action tag", "open"] if "open" in details.get("hint", "") or
             not details.get("what", "").startswith("'") else ["admissible", "listed"],
             "unfinished": {"transform": [facts["verb"], facts["tool_kind"]], "lamp": ["lamp", "use"],
                            "second": ["second", "two", "another"], "place": [facts["target"]],
                            "finish": [facts["goal"]]}.get(details.get("stage"), [])}[name]
    text = skill.lower()
    if name in ("wrong_tool", "placed_early", "wrong_object") or details.get("stage") == "transform":
        text = re.sub(r"'[^']*'", " ", text)  # 11 of 21 start-model habit "fixes" named it only inside quotes
    else:  # a command fix ("open", "admissible") does not count inside a quoted command the env refused
        for step in trajectory.steps:
            if not step.valid and step.action:
                text = text.replace(f"'{step.action.lower()}'", " ")
    return any(word and word.lower() in text for word in fixes)
