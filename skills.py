"""Skills: the text side of SEED's episode-level hindsight skills. Plain data in, strings out.

A finished trajectory (the dict described in the shared contract: task, won, reward, steps with observation,
response, action, reward, valid, and the env's ground truth `gt`) becomes
- `analyzer_prompt(trajectory)`: the prompt under which the policy analyzes its own episode into
  JSON {"episode_summary", "episode_skill"} (success: one reusable workflow; failure: one avoidance rule);
- `parse_skill(text)`: the skill out of whatever the analyzer wrote, or None (never raises);
- `with_skill(prompt, skill)`: the teacher context, the ordinary prompt with the skill block inserted;
- `annotate(trajectory, gt)`: the stage-1 completion (the JSON the analyzer should have written);
- `write_jsonl` / `read_jsonl`: stage-1 {"prompt", "completion"} records, so annotations written by a
  strong LLM can replace `annotate`; `show_tokens`: a coloured row of trained vs masked tokens.

Departures from the paper (and from OPID, whose prompt the paper's is inferred from):
- The paper's stage-1 skills came from a strong LLM. `annotate` is a rule-based hindsight annotator that
  reads the env's ground truth (household `gt`, or ALFWorld's pddl_params plus the observations) and writes
  a specific skill: for a success the workflow with its decisive observations (where the object was, which
  appliance, in which order); for a failure the first decisive mistake and what to do instead. Several
  phrasings per case are drawn from an rng so a model learns the content, not one template.
- The analyzer prompt is compact because a tiny model trained from scratch must read it: one line per step
  "Step 3 | return 8.57 | obs: ... | thought: ... | action: ...". The response is shown as its reasoning
  text (think tags removed, only when there is any) and its parsed action, "(none)" when the action tag was
  missing and "(invalid)" when the env rejected it, instead of verbatim with its tags.
- Over a token budget the prompt is shortened predictably: middle steps are dropped first (marker
  "... (N steps omitted) ..."), then long texts are cut, never the task, outcome or instruction.

Run the tests: python -m pytest -q test_seed.py -k skill
"""

import ast
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

# ---------------------------------------------------------------------------------------------------------
# Analyzer prompt


def discounted_returns(rewards, gamma=GAMMA):
    """G_t = r_t + gamma * G_{t+1}, computed backwards from the step rewards."""
    returns, running = [], 0.0
    for reward in reversed(rewards):
        running = float(reward) + gamma * running
        returns.append(running)
    return returns[::-1]


def _one_line(text):
    return " ".join(str(text or "").split())


def _cut(text, limit):
    """Cut at a word boundary so a truncated observation still reads as words."""
    if limit is None or len(text) <= limit:
        return text
    head = text[:limit]
    return (head.rsplit(" ", 1)[0] if " " in head else head) + " ..."


def _thought(response, action):
    """What the response says besides its action: the reasoning, without the tags."""
    text = re.sub(r"<action>.*?</action>", " ", response or "", count=1, flags=re.S)
    text = re.sub(r"</?think>", " ", text)
    text = _one_line(text)
    return "" if text == action else text


def analyzer_prompt(trajectory, max_tokens=None, count_tokens=None):
    """The prompt under which the policy turns its finished trajectory into one skill (as JSON).

    count_tokens: callable str -> int (e.g. lambda s: len(tokenizer(s).input_ids)); default len(text) // 4.
    If max_tokens is given, steps are dropped from the middle, then texts are cut, until it fits; the fixed
    part (task, outcome, instruction) is never cut, so a budget below that part cannot be met.
    """
    count_tokens = count_tokens or (lambda text: len(text) // 4)
    steps = trajectory.get("steps") or []
    returns = discounted_returns([step.get("reward", 0.0) for step in steps])
    rows = []
    for number, (step, ret) in enumerate(zip(steps, returns), start=1):
        action = _one_line(step.get("action"))
        rows.append((number, ret, _one_line(step.get("observation")), _thought(step.get("response"), action),
                     (action or "(none)") + ("" if step.get("valid", True) or not action else " (invalid)")))
    won = bool(trajectory.get("won"))
    head = (f"Analyze the agent's episode.\nTask: {_one_line(trajectory.get('task'))}\n"
            f"Outcome: {'success' if won else 'failure'} (reward {float(trajectory.get('reward', 0.0)):g}, "
            f"{len(steps)} steps)\n")
    if won:
        tail = "The episode succeeded. Give one reusable workflow: the core decision rule and the action order."
    else:
        tail = "The episode failed. Give one avoidance rule: the core mistake and its warning signs."
    tail += f"\nReply with only JSON: {JSON_SHAPE}"

    def render(keep, limit):
        shown = rows[:(keep + 1) // 2] + rows[len(rows) - keep // 2:]  # head and tail, the middle dropped
        lines = []
        for index, (number, ret, obs, thought, action) in enumerate(shown):
            if index and number > shown[index - 1][0] + 1:
                lines.append(f"... ({number - shown[index - 1][0] - 1} steps omitted) ...")
            text = f"Step {number} | return {ret:.2f} | obs: {_cut(obs, limit)}"
            text += f" | thought: {_cut(thought, limit)}" if thought else ""
            lines.append(text + f" | action: {_cut(action, limit)}")
        return head + "".join(line + "\n" for line in lines) + tail

    prompt = render(len(rows), None)
    if max_tokens is None or count_tokens(prompt) <= max_tokens:
        return prompt
    for keep in range(len(rows) - 1, 1, -1):  # drop middle steps, one more each time
        prompt = render(keep, None)
        if count_tokens(prompt) <= max_tokens:
            return prompt
    for limit in (400, 200, 100, 50, 25):  # then shorten what the kept steps say
        prompt = render(min(len(rows), 2), limit)
        if count_tokens(prompt) <= max_tokens:
            break
    return prompt


# ---------------------------------------------------------------------------------------------------------
# Skill parser

MAX_PARSE_CHARS = 20000  # analyzer output beyond this is never a single skill; bounds the parser's work
_FUNCTION_WORDS = set("a an the to it in on of and or before after then with if when not do don't first from "
                      "is are was were be for by at so until into only never always any each every".split())
_LABEL = re.compile(r"^[ \t>*#-]*(?:episode[ _-]?(?:level[ _-]?)?skill|skill)(?:\*\*)?[ \t]*[:=](.+)$", re.I | re.M)
_KEY_VALUE = re.compile(r"""["']?episode[ _-]?skill["']?\s*:\s*(?:"((?:[^"\\\n]|\\.)*)"|'((?:[^'\\\n]|\\.)*)')""",
                        re.I)


def _printable(text):
    """Drop control, format (zero-width, bidi) and lone-surrogate characters; newlines and tabs become spaces."""
    text = text.replace("\n", " ").replace("\t", " ").replace("\r", " ")
    return "".join(ch for ch in text if unicodedata.category(ch) not in ("Cc", "Cf", "Cs"))


def _json_objects(text, max_starts=8):
    """Top-level {...} spans, braces matched outside double-quoted strings; an unclosed '{' is skipped."""
    spans, start, starts = [], text.find("{"), 0
    while start >= 0 and starts < max_starts:
        starts += 1
        depth, in_string, escaped, end = 0, False, False, -1
        for index in range(start, len(text)):
            ch = text[index]
            if escaped:
                escaped = False
            elif in_string and ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = not in_string
            elif not in_string and ch in "{}":
                depth += 1 if ch == "{" else -1
                if depth == 0:
                    end = index
                    break
        if end < 0:  # truncated: look for a later object instead
            start = text.find("{", start + 1)
            continue
        spans.append(text[start:end + 1])
        start = text.find("{", end + 1)
    return spans


def _load_object(span):
    """json.loads, then with trailing commas and curly quotes repaired, then a Python literal (single quotes)."""
    repaired = re.sub(r",\s*([}\]])", r"\1", span.translate({0x201C: '"', 0x201D: '"', 0x2018: "'", 0x2019: "'"}))
    for candidate in (span, repaired):
        try:
            return json.loads(candidate)
        except ValueError:
            pass
    if span.count("{") + span.count("[") > 50:  # deep nesting is hostile, not an analysis
        return None
    try:
        with warnings.catch_warnings():  # stray backslashes in model text warn about escape sequences
            warnings.simplefilter("ignore")
            return ast.literal_eval(repaired)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def _skill_value(value, depth=0):
    """The string under an 'episode_skill' (or 'skill') key, looking into nested dicts and lists."""
    if depth > 4:
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if re.sub(r"[^a-z]", "", str(key).lower()) in ("episodeskill", "episodelevelskill", "skill"):
                if isinstance(item, str):
                    return item
                if isinstance(item, list) and item and all(isinstance(part, str) for part in item):
                    return " ".join(item)
        items = list(value.values())
    elif isinstance(value, list):
        items = value
    else:
        return None
    for item in items:
        found = _skill_value(item, depth + 1)
        if found is not None:
            return found
    return None


def _candidates(text):
    """Possible skill strings, most trustworthy first: JSON objects, a quoted key-value pair, a label line."""
    for span in _json_objects(text):
        value = _skill_value(_load_object(span))
        if value is not None:
            yield value
    for match in _KEY_VALUE.finditer(text):
        if match.group(1) is not None:
            try:
                yield json.loads('"' + match.group(1) + '"')
            except ValueError:
                yield match.group(1)
        else:
            yield match.group(2).replace("\\'", "'")
    for match in _LABEL.finditer(text):  # a label at the start of a line, never a JSON key (those are quoted)
        value = match.group(1).strip()
        yield value[2:] if value.startswith("**") and not value.endswith("**") else value  # "**Skill:** text"


def _words(text):
    return re.findall(r"[a-z0-9']+", text.lower())


def _clean_skill(value, task):
    """One line of readable text, or None when it is too short, degenerate, a placeholder or the task again."""
    skill = _printable(value)
    skill = re.sub(r"<\|[^|<>]{0,40}\|>", " ", skill)  # a chat special token inside the teacher prompt breaks it
    skill = " ".join(skill.split())
    while len(skill) > 1 and skill[0] + skill[-1] in ('""', "''", "``", "[]", "**"):  # wrappers, not content
        skill = skill[1:-1].strip()
    words = _words(skill)
    if len(words) < 4 or len(skill) < 20:
        return None
    letters = sum(ch.isalpha() for ch in skill)
    if letters < 0.6 * len(skill.replace(" ", "")) or not _FUNCTION_WORDS & set(words):
        return None
    if len(set(words)) < 0.35 * len(words) or "episode_skill" in skill or "episode_summary" in skill:
        return None
    if skill.lower().startswith("your task is to"):
        return None
    if task:
        new_words = set(words) - set(_words(task)) - _FUNCTION_WORDS - {"you", "your", "task", "some", "should"}
        if len(new_words) < 2:
            return None
    if len(skill) > MAX_SKILL_CHARS:
        skill = skill[:MAX_SKILL_CHARS].rsplit(" ", 1)[0].rstrip(" ,;:-")
    return skill


def parse_skill(text, task=None):
    """The episode skill in the analyzer's output, or None if there is no usable one. Never raises.

    Accepts clean or fenced JSON, trailing commas, single quotes, chatter around the object, and a plain
    sentence after a label at a line start ("Skill: ...", "episode_skill: ..."). Rejects empty, truncated
    (the skill's closing quote missing), degenerate or placeholder output, and, when `task` is given, a skill
    that only restates the task. The result is one line without control characters, at most 600 characters.
    """
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        if not isinstance(text, str):
            return None
        text = "".join(ch for ch in text[:MAX_PARSE_CHARS] if ch in "\n\t" or unicodedata.category(ch) != "Cc")
        for value in _candidates(text):
            skill = _clean_skill(value, task)
            if skill:
                return skill
        return None
    except Exception:  # top-level guard: a bad analysis must cost one trajectory's signal, never the run
        return None


# ---------------------------------------------------------------------------------------------------------
# Teacher context


def with_skill(prompt, skill):
    """The teacher prompt: `prompt` with "\\n\\n" + SKILL_HEADER + "\\n[skill]\\n" inserted.

    Where: at the end of the first line containing "Your task is to:" (so a blank line separates the block
    from the lines around it); else at the start of the line with "Now it's your turn" (block + "\\n\\n");
    else appended. The ordinary prompt is exactly prompt[:k] + prompt[k:] around the block, byte for byte.
    """
    if not isinstance(skill, str) or not skill.strip():
        raise ValueError("with_skill needs a non-empty skill string (skip trajectories whose skill is None)")
    block = f"{SKILL_HEADER}\n[{skill.strip()}]"
    anchor = prompt.find("Your task is to:")
    if anchor >= 0:
        end = prompt.find("\n", anchor)
        end = len(prompt) if end < 0 else end - (prompt[end - 1] == "\r")
        return prompt[:end] + "\n\n" + block + "\n" + prompt[end:]
    anchor = prompt.find("Now it's your turn")
    if anchor >= 0:
        start = prompt.rfind("\n", 0, anchor) + 1
        return prompt[:start] + block + "\n\n" + prompt[start:]
    return prompt + "\n\n" + block + "\n"


# ---------------------------------------------------------------------------------------------------------
# Hindsight annotator (stage-1 completions)

_TASK_VERB = {"pick_heat_then_place_in_recep": "heat", "pick_cool_then_place_in_recep": "cool",
              "pick_clean_then_place_in_recep": "clean", "look_at_obj_in_light": "use"}
_TOOL_KIND = {"heat": "microwave", "cool": "fridge", "clean": "sinkbasin"}
_PAST = {"heat": "heated", "cool": "cooled", "clean": "cleaned"}
_FAMILY = {"pick_and_place_simple": "pick-and-place", "look_at_obj_in_light": "examine-in-light",
           "pick_clean_then_place_in_recep": "clean", "pick_heat_then_place_in_recep": "heat",
           "pick_cool_then_place_in_recep": "cool", "pick_two_obj_and_place": "two-object"}
_SURFACES = set("countertop shelf desk diningtable sidetable coffeetable dresser sofa bed armchair stoveburner "
                "toilet cart ottoman tvstand".split())
_ACTIONS = [("go", r"go to (?P<target>.+)"), ("open", r"open (?P<target>.+)"), ("close", r"close (?P<target>.+)"),
            ("take", r"take (?P<object>.+?) from (?P<target>.+)"), ("put", r"move (?P<object>.+?) to (?P<target>.+)"),
            ("put", r"put (?P<object>.+?) (?:in/on|into|in|on) (?P<target>.+)"),  # ALFWorld before 0.4
            ("transform", r"(?P<verb>heat|cool|clean) (?P<object>.+?) with (?P<target>.+)"),
            ("use", r"use (?P<target>.+)")]

# Per mistake: what happened (for the summary) and the skill's phrasings; the fields come from _failure.
_FAILURES = {
    "wrong_tool": ("it used the {used} instead of the {tool_kind}", [
        "{Purpose} the {goal} with the {tool_kind} ({tool}), not the {used}: '{action}' {result}. Warning sign: "
        "picking an appliance without checking what it does.",
        "Wrong appliance: '{action}' {result}. To {purpose} {a_goal} you need the {tool_kind}, so go to {tool}.",
        "Only the {tool_kind} can {purpose} the {goal}; the agent tried '{action}', which {result}. Check the "
        "appliance before acting."]),
    "placed_early": ("it put the {goal} {at_target} before it was {past}", [
        "{Verb} the {goal} with {tool} before putting it {at_target}; here it was put there while not yet {past}. "
        "Warning sign: heading to the {target} with an object that is not {past}.",
        "Mistake: moved the {goal} to {place} before it was {past}. Always {verb} it with {tool} first, then "
        "place it.",
        "For {family} tasks the order matters: take the {goal} to {tool} and {verb} it, and only then put it "
        "{at_target}. Placing it first does not count."]),
    "wrong_object": ("it took {object} instead of {a_goal}", [
        "Take only the object the task names: it needs {a_goal}, but the agent picked up {object}. Warning sign: "
        "'You pick up the {object}' naming another kind.",
        "Mistake: took {object} instead of {a_goal}. Read the object names and take {a_goal}{where}.",
        "The {object} is not {a_goal}; check the name before taking anything and look for the {goal}{where}."]),
    "no_action": ("{count} responses had no action tag", [
        "End every response with one action tag holding an admissible command; {count} of {steps} responses had "
        "none and did nothing.",
        "Missing action tags wasted {count} steps. After thinking, always write the chosen command inside the "
        "action tags.",
        "Warning sign: a reply without an action tag. It costs a step every time ({count} here); always give "
        "exactly one admissible command."]),
    "repeated_invalid": ("it repeated the invalid command '{action}' {count} times", [
        "If a command answers 'Nothing happens.', do not repeat it: '{action}' failed {count} times. {Hint}.",
        "Repeating an invalid command wastes steps; '{action}' was tried {count} times with no effect. {Hint} "
        "instead.",
        "Warning sign: 'Nothing happens.' after '{action}'. Change the plan rather than retrying ({count} tries "
        "here): {hint}."]),
    "closed_held": ("it walked past the closed {place} that held the {goal}", [
        "When looking for {a_goal}, open closed receptacles you arrive at: the {goal} was inside {place}, which the "
        "agent visited but never opened. Warning sign: 'The {place} is closed.'",
        "A closed {kind} hides what is inside; after 'The {place} is closed.' use 'open {place}'. Here the {goal} "
        "sat unseen in {place}.",
        "Mistake: walked past the closed {place} without opening it, and the {goal} was in it. Open every closed "
        "{kind} while the {goal} is missing."]),
    "closed_skipped": ("it never opened the closed {skipped}", [
        "Open closed receptacles instead of walking past them: {skipped} stayed closed and the {goal} was never "
        "found.",
        "Warning sign: 'The {place} is closed.' and then leaving. Open {skipped} and look inside; {a_goal} may be "
        "hidden there."]),
    "circling": ("it kept revisiting {revisited} and ran out of steps", [
        "Keep track of searched receptacles and do not revisit them: the agent went back to {revisited} and ran "
        "out of steps. {lead}",
        "Warning sign: arriving again at a receptacle already searched ({revisited}). Go somewhere new. {lead}"]),
    "never_found": ("it never found the {goal}", [
        "Search every likely place for {a_goal} and open closed ones. {lead}",
        "The {goal} was never found. {lead} Check {typical} systematically."]),
    "not_transformed": ("it took the {goal} but never {past} it", [
        "After taking the {goal}, go straight to {tool} and {verb} it; here the agent held it but never {past} it "
        "before the steps ran out.",
        "Holding the {goal} is not enough: {verb} it with {tool} next, then put it {at_target}."]),
    "lamp_unused": ("it had the {goal} but never used {tool}", [
        "Hold the {goal} and turn on {tool} with 'use {tool}'; the agent had the {goal} but never used the lamp.",
        "Once the {goal} is in hand, go to {tool} and use it; the agent never turned the lamp on."]),
    "one_of_two": ("it placed only one of the two {goals}", [
        "Two {goals} are needed: after placing the first {at_target}, find a second one and put it in the same "
        "place; the agent placed only one.",
        "Warning sign: stopping after one {goal}. The task needs two {at_target}; search on for another."]),
    "not_placed": ("it never put the {goal} {at_target}", [
        "Once the {goal} is {ready}, put it {at_target} right away; the agent kept it until the steps ran out.",
        "Finish the task: go straight to the {target} with the {goal} and put it there. Do not wander while "
        "holding it."]),
    "unfinished": ("it did not finish the task", [
        "Follow the full order for {family} tasks without detours: find the {goal}, take it, then finish the task; "
        "the agent ran out of steps."]),
}


def _kind(name):
    """'drawer 2' -> 'drawer'; household and (demangled) ALFWorld names are 'kind number'."""
    return re.sub(r"\s+\d+$", "", str(name or "").strip().lower())


def _parse_action(action):
    """An ALFWorld command as an event {"kind", "object", "target"} (the gt events' shape), or None."""
    action = " ".join(str(action or "").lower().split())
    for kind, pattern in _ACTIONS:
        match = re.fullmatch(pattern, action)
        if match:
            groups = match.groupdict()
            return {"kind": groups.get("verb") or kind, "object": groups.get("object"), "target": groups["target"]}
    return None


def _items(listing):
    """'a apple 1, a mug 2, and a knife 1' -> ['apple 1', 'mug 2', 'knife 1']."""
    parts = re.split(r",\s*(?:and\s+)?|\s+and\s+", listing)
    return [re.sub(r"^(?:an?|some)\s+", "", part.strip()) for part in parts if part.strip() not in ("", "nothing")]


def _a(noun):
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def _plural(noun):
    irregular = {"shelf": "shelves", "knife": "knives", "potato": "potatoes", "tomato": "tomatoes"}
    return irregular.get(noun) or noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")


def _count(number, noun):
    return f"{number} {noun if number == 1 else _plural(noun)}"


def _listing(names, limit=3):
    """'a, b and 2 more': lists stay short so a skill stays under about 60 words."""
    names = list(dict.fromkeys(names))
    shown = names[:limit] + ([f"{len(names) - limit} more"] if len(names) > limit else []) or [""]
    return shown[0] if len(shown) < 2 else ", ".join(shown[:-1]) + " and " + shown[-1]


def _at(receptacle):
    return ("on " if _kind(receptacle) in _SURFACES else "in ") + receptacle


def _facts(trajectory, gt):
    """What the annotator knows: goal, appliance, target, where things were and what the agent did.

    Household gt gives object locations, closed receptacles and events; for ALFWorld (pddl_params only) they
    are read from the observations ("On the X, you see ...", "The X is closed.") and the valid actions.
    """
    steps = trajectory.get("steps") or []
    task_type = gt.get("task_type") or ""
    verb, params = _TASK_VERB.get(task_type), gt.get("pddl_params") or {}
    goal = _kind(gt.get("goal_object") or params.get("object_target"))
    if not goal:
        raise ValueError("annotate needs gt['goal_object'] (household) or gt['pddl_params']['object_target']")
    tool = gt.get("tool") or None
    tool_kind = _kind(tool or (params.get("toggle_target") if verb == "use" else None)) or \
        _TOOL_KIND.get(verb) or ("lamp" if verb == "use" else None)
    invalid = set(gt.get("invalid_steps") or []) | {i for i, step in enumerate(steps) if not step.get("valid", True)}
    actions = [_one_line(step.get("action")) for step in steps]
    events = gt.get("events")
    if not isinstance(events, list):
        events = [dict(event, step=i) for i, event in enumerate(map(_parse_action, actions))
                  if event and i not in invalid]
    seen, closed = {}, set(gt.get("closed_receptacles") or [])
    for step in steps:
        text = _one_line(step.get("observation")).lower()
        for place, listing in re.findall(r"(?:on the|the) ([a-z]+ \d+)(?:,| is open\. in it,) you see ([^.]*)\.", text):
            for item in _items(listing):
                seen.setdefault(item, place)
        if "closed_receptacles" not in gt:
            closed.update(re.findall(r"the ([a-z]+ \d+) is closed\.", text))
    room = re.search(r"looking quickly around you, you see ([^.]*)\.", _one_line(steps[0]["observation"]).lower()) \
        if steps else None
    return {"task_type": task_type, "family": _FAMILY.get(task_type, "such"), "verb": verb, "goal": goal,
            "tool": tool, "tool_kind": tool_kind, "target": _kind(gt.get("goal_receptacle") or
                                                                   params.get("parent_target")) or None,
            "locations": gt.get("object_locations") or {o: r for o, r in seen.items() if _kind(o) == goal},
            "closed": closed, "room": _items(room.group(1)) if room else [], "seen": seen,
            "typical": gt.get("typical_places") or [], "events": events, "actions": actions, "invalid": invalid,
            "steps": len(steps), "won": bool(gt.get("won", trajectory.get("won"))),
            "needed": 2 if task_type == "pick_two_obj_and_place" else 1,
            "task": _one_line(gt.get("task") or trajectory.get("task"))}


def _typical(facts, prepositions=False):
    """Where this object kind is usually kept (household gt), else where it turned up in this room: the
    part of 'where it was' that carries over to the next episode. 'shelves' or, with prepositions, 'on shelves'."""
    kinds = [kind for kind in facts["typical"] if kind != facts["target"]] or \
        sorted({_kind(place) for place in facts["locations"].values()})
    return _listing([("on " if kind in _SURFACES else "in ") * prepositions + _plural(kind) for kind in kinds[:2]])


def _taken(facts):
    return [event for event in facts["events"] if event["kind"] == "take" and _kind(event["object"]) == facts["goal"]]


def _tool_used(facts):
    """The appliance or lamp instance the agent used (e.g. 'microwave 1'), else the gt's, else one of that
    kind in the room or seen on a receptacle, else 'the <kind>'."""
    used = [event["target"] for event in facts["events"] if event["kind"] == facts["verb"] and event.get("target")]
    present = [name for name in facts["room"] + list(facts["seen"]) if _kind(name) == facts["tool_kind"]]
    return (used + [facts["tool"]] * bool(facts["tool"]) + present + [f"the {facts['tool_kind']}"])[0]


def _success(facts, rng):
    goal, verb, family, tool = facts["goal"], facts["verb"], facts["family"], _tool_used(facts)
    puts = [event["target"] for event in facts["events"] if event["kind"] == "put" and _kind(event["object"]) == goal]
    target = puts[-1] if puts else facts["target"]
    taken, wheres = _taken(facts)[:facts["needed"]], []
    for event in taken:  # the decisive observation: where each goal object was, and whether it was shut away
        source = facts["locations"].get(event["object"]) or event.get("target") or ""
        if source in facts["closed"]:
            wheres.append(rng.choice([f"it was in the closed {source}, open it first",
                                      f"{source} was closed and had to be opened", f"open {source}, it was inside"]))
        elif source:
            wheres.append(rng.choice([f"it was {_at(source)}", f"found {_at(source)}", f"it sat {_at(source)}"]))
    order = [rng.choice(["find", "locate", "look for"]) + f" the {goal}" + (f" ({wheres[0]})" if wheres else ""),
             rng.choice(["take it", "pick it up"])]
    if verb == "use":
        lamp_at = f" ({_at(facts['seen'][tool])})" if tool in facts["seen"] else ""
        order.append(rng.choice([f"carry it to {tool}{lamp_at} and use {tool}",
                                 f"turn on {tool}{lamp_at} while holding it"]))
    elif verb:
        order.append(rng.choice([f"{verb} it with {tool}", f"use {tool} to {verb} it"]))
    if target:
        order.append(rng.choice([f"put it {_at(target)}", f"move it to {target}", f"place it {_at(target)}"]))
    if facts["needed"] == 2:
        order.append(rng.choice(["find a second one", "repeat with another one"])
                     + (f" ({wheres[1]})" if len(wheres) > 1 else ""))
    sequence = ", ".join(order[:-1]) + ", then " + order[-1]
    skill = rng.choice([f"For {family} tasks: {sequence}.", f"Workflow for {family} tasks: {sequence}.",
                        f"{sequence[0].upper() + sequence[1:]}; this order solves {family} tasks."])
    typical, places = _typical(facts), _typical(facts, prepositions=True)
    if typical and rng.random() < 0.7:
        skill += " " + rng.choice([f"Look for {_a(goal)} {places} first.",
                                   f"{_a(goal).capitalize()} is usually {places}.",
                                   f"Search {typical} first when looking for {_a(goal)}."])
    summary = (f"The agent completed '{facts['task']}' in {_count(facts['steps'], 'step')}"
               + (f": it took the {goal} from {_listing([event.get('target') for event in taken])}" if taken else "")
               + (f", {_PAST[verb]} it with {tool}" if verb in _PAST else f", used {tool}" if verb else "")
               + (f" and put it {_at(target)}." if target else "."))
    return summary, skill


def _invalid_hint(facts, step, action):
    """Why an invalid command failed, phrased as what to do instead."""
    event, before = _parse_action(action) or {"kind": None}, [e for e in facts["events"] if e["step"] < step]
    held = None
    for earlier in before:
        held = earlier["object"] if earlier["kind"] == "take" else None if earlier["kind"] == "put" else held
    opened = {earlier["target"] for earlier in before if earlier["kind"] == "open"}
    visits = [earlier["target"] for earlier in before if earlier["kind"] == "go"]
    if event["kind"] == "take" and event["target"] in facts["closed"] - opened:
        return f"open {event['target']} first"
    if event["kind"] in ("put", "heat", "cool", "clean") and event["object"] != held:
        return f"pick up the {_kind(event['object'])} first"
    if event["kind"] == "go" and visits and visits[-1] == event["target"]:
        return f"act on {event['target']} instead of going there again"
    if event["kind"] == "take":
        return "take only objects listed in the current observation"
    return "pick a command from the admissible actions"


def _mistakes(facts):
    """Candidate mistakes as (tier, step, name, fields); the annotator reports the lowest (tier, step).

    Tier 0 makes the task impossible this way (wrong appliance, placed before heating/cooling/cleaning, a
    wrong object used for the task); tier 1 wastes the search (missing action tags, a repeated invalid
    command, walking past the closed receptacle that held the object); tier 2 explains a failed search
    (a wrong object kept in hand, circling, never found); tier 3, the fallback, names the stage never done.
    """
    goal, verb, target, events = facts["goal"], facts["verb"], facts["target"], facts["events"]
    found = []
    for step, action in enumerate(facts["actions"]):  # attempts count too: the env rejects a wrong appliance
        event = _parse_action(action)
        used = _kind(event["target"]) if event else ""
        transform = verb in _TOOL_KIND and event and event["kind"] in _TOOL_KIND and _kind(event["object"]) == goal
        lamp = verb == "use" and event and event["kind"] == "use" and used.endswith("lamp")
        if (transform or lamp) and used != facts["tool_kind"]:
            found.append((0, step, "wrong_tool", {"action": action, "used": used, "result": "did nothing"
                                                  if step in facts["invalid"] else "did the wrong thing"}))
            break
    done = set()
    for event in events if verb in _TOOL_KIND else []:
        if event["kind"] == verb:
            done.add(event["object"])
        elif event["kind"] == "put" and _kind(event["object"]) == goal and _kind(event["target"]) == target \
                and event["object"] not in done:
            found.append((0, event["step"], "placed_early", {"place": event["target"]}))
            break
    taken = _taken(facts)
    for event in events:  # a wrong object matters when used for the task, or when it blocked the hands for long
        if event["kind"] == "take" and _kind(event["object"]) != goal:
            later = [other for other in events
                     if other["step"] > event["step"] and other.get("object") == event["object"]]
            misused = any(other["kind"] in _TOOL_KIND or (other["kind"] == "put" and _kind(other["target"]) == target)
                          for other in later)
            kept = not taken and not any(other["kind"] == "put" for other in later) and \
                facts["steps"] - event["step"] >= max(3, facts["steps"] // 4)
            if misused or kept:
                hint = _listing([_at(place) for place in sorted(set(facts["locations"].values()))], 2)
                found.append((0 if misused else 2, event["step"], "wrong_object",
                              {"object": event["object"], "where": f" ({hint})" if hint else ""}))
                break
    missing = [step for step, action in enumerate(facts["actions"]) if not action]
    if len(missing) >= 2:
        found.append((1, missing[1], "no_action", {"count": len(missing)}))
    tries = {}
    for step in sorted(facts["invalid"]):
        if step < len(facts["actions"]) and facts["actions"][step]:
            tries.setdefault(facts["actions"][step], []).append(step)
    repeated = sorted((steps[1], action, len(steps)) for action, steps in tries.items() if len(steps) >= 2)
    if repeated:
        step, action, count = repeated[0]
        hint = _invalid_hint(facts, step, action)
        found.append((1, step, "repeated_invalid", {"action": action, "count": count, "hint": hint,
                                                    "Hint": hint[0].upper() + hint[1:]}))
    visits = [(event["step"], event["target"]) for event in events if event["kind"] == "go"]
    opened = {event["target"] for event in events if event["kind"] == "open"}
    holders = set(facts["locations"].values())
    checked = {place for _, place in visits if place not in facts["closed"] or place in opened}
    missed = sorted({place for item, place in facts["locations"].items() if item not in {e["object"] for e in taken}})
    if len(taken) < facts["needed"] and not facts["won"]:
        skipped = [(step, place) for step, place in visits if place in facts["closed"] and place not in opened]
        decisive = [(step, place) for step, place in skipped if place in holders]
        if decisive:
            found.append((1, decisive[0][0], "closed_held", {"place": decisive[0][1], "kind": _kind(decisive[0][1])}))
        elif skipped and not holders:  # location unknown: opening what was skipped is the sound advice
            found.append((1, skipped[0][0], "closed_skipped", {"place": skipped[0][1],
                                                               "skipped": _listing([p for _, p in skipped])}))
        unchecked = [place for place in missed if place not in checked]
        unvisited = [place for place in facts["room"] if place not in checked]
        if unchecked:
            lead = f"The {goal} was {_listing([_at(p) for p in unchecked])}, never checked."
        elif missed:
            lead = f"The {goal} was seen {_listing([_at(p) for p in missed])} but not taken; take it when you see it."
        elif unvisited:  # where it was is unknown (ALFWorld): name the places never searched
            lead = f"Unvisited: {_listing(unvisited)}."
        else:
            lead = "Open closed receptacles and look inside."
        visited, revisits = set(), []
        for step, place in visits:
            if place in visited:
                revisits.append((step, place))
            visited.add(place)
        if len(revisits) >= 3:
            found.append((2, revisits[0][0], "circling", {"revisited": _listing([p for _, p in revisits]),
                                                          "lead": lead}))
        found.append((2, facts["steps"], "never_found", {"lead": lead}))
    kinds_done = {event["kind"] for event in events if event.get("object") is None or _kind(event["object"]) == goal}
    placed = sum(1 for event in events if event["kind"] == "put" and _kind(event["object"]) == goal
                 and _kind(event["target"]) == target)
    if verb in _TOOL_KIND and verb not in kinds_done:
        found.append((3, facts["steps"], "not_transformed", {}))
    elif verb == "use" and "use" not in kinds_done:
        found.append((3, facts["steps"], "lamp_unused", {}))
    elif target and placed and facts["needed"] == 2:
        found.append((3, facts["steps"], "one_of_two", {}))
    elif target:
        found.append((3, facts["steps"], "not_placed", {"ready": _PAST.get(verb, "in hand")}))
    found.append((3, facts["steps"], "unfinished", {}))
    return found


def _failure(facts, rng):
    _, step, name, details = min(_mistakes(facts), key=lambda mistake: mistake[:2])
    verb, target = facts["verb"] or "", facts["target"]
    purpose = "examine" if verb == "use" else verb
    fields = {"goal": facts["goal"], "a_goal": _a(facts["goal"]), "goals": _plural(facts["goal"]),
              "tool": _tool_used(facts), "tool_kind": facts["tool_kind"], "target": target,
              "at_target": ("on " if target in _SURFACES else "in ") + _a(target) if target else "in its place",
              "verb": verb, "Verb": verb.capitalize(), "past": _PAST.get(verb, ""), "purpose": purpose,
              "Purpose": purpose.capitalize(), "family": facts["family"], "steps": facts["steps"],
              "typical": _typical(facts) or "every receptacle"}
    fields.update(details)
    what, options = _FAILURES[name]
    summary = (f"The agent failed '{facts['task']}' after {_count(facts['steps'], 'step')}: {what.format(**fields)}"
               + (f" (step {step + 1})." if step < facts["steps"] else "."))
    return summary, rng.choice(options).format(**fields)


def annotate(trajectory, gt=None, rng=None):
    """The stage-1 completion for `trajectory`: JSON {"episode_summary", "episode_skill"} from hindsight.

    gt: the env's info["gt"] (household or ALFWorld keys, see the shared contract); default trajectory["gt"].
    rng: a random.Random choosing among phrasings; default one seeded from the trajectory (repeatable).
    Success: the workflow with its decisive observations. Failure: the first decisive mistake (see
    _mistakes for the order) and what to do instead. Skills are one or two sentences, under 60 words.
    """
    gt = gt if gt is not None else trajectory.get("gt")
    if not isinstance(gt, dict):
        raise ValueError("annotate needs the env's ground truth dict (info['gt'] of the last step)")
    if rng is None:
        key = json.dumps([trajectory.get("task"), [step.get("action") for step in trajectory.get("steps") or []]])
        rng = random.Random(zlib.crc32(key.encode("utf-8", "replace")))
    facts = _facts(trajectory, gt)
    summary, skill = (_success if facts["won"] else _failure)(facts, rng)
    return json.dumps({"episode_summary": summary, "episode_skill": skill}, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------------------
# Stage-1 data files and token debugging


def write_jsonl(path, records):
    """Write {"prompt", "completion"} records one per line (UTF-8); checks every record before writing."""
    records = list(records)
    for index, record in enumerate(records):
        if not (isinstance(record, dict) and isinstance(record.get("prompt"), str)
                and isinstance(record.get("completion"), str)):
            raise ValueError(f"record {index} must be a dict with string 'prompt' and 'completion'")
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def read_jsonl(path):
    """Read {"prompt", "completion"} records; blank lines are skipped, a bad line raises naming file:line."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: malformed JSON line ({error.msg}, column {error.colno})") from None
            if not (isinstance(record, dict) and isinstance(record.get("prompt"), str)
                    and isinstance(record.get("completion"), str)):
                raise ValueError(f"{path}:{number}: expected an object with string 'prompt' and 'completion'")
            records.append(record)
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
    parts, trained = [_MASKED] if color else [], False
    for token_id, flag in zip(ids, mask):
        if bool(flag) != trained:
            parts.append(opening if flag else closing)
            trained = bool(flag)
        parts.append(tokenizer.decode([token_id]))
    if trained and not color:
        parts.append(closing)
    return "".join(parts) + (_RESET if color else "")
