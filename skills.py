"""skills.py: the text side of SEED, strings in and strings out -- the agent's prompt and action
format, the prompt under which the policy reads its own finished episode, the parser that finds the
skill it wrote, stage 1's examples, and the teacher context with that skill inserted.

    render_prompt(template, ...) -> the agent's user message (the env's verl-agent template)
    parse_action(response, tags) -> the action in a response or None (response_is_valid: format)
    analyzer_prompt(trajectory)  -> text; the policy answers {"episode_summary", "episode_skill"}
    parse_skill(output, task)    -> the skill (one line) or None; never raises
    hindsight_examples(...)      -> stage 1's (analyzer prompt, skill JSON) pairs, format-checked
    with_skill(prompt, skill)    -> the teacher prompt: the skill block after "Your task is to:"

Departures from the paper (and from OPID, whose prompt the paper's is inferred from): the analyzer
prompt is compact for a tiny model, one line per step ("Step 3 | return 8.57 | obs: ... | thought:
... | action: ..."); over a token budget middle steps go first ("... (N steps omitted) ..."), then
long texts are cut, never the task, outcome or instruction. The stage-1 annotators that write
training skills are data makers (envs.py names each env's), not part of the method.

Run the tests: python -m pytest -q test_seed.py -k skill
"""
import ast
import json
import random
import re
import unicodedata
import warnings

GAMMA = 0.95
MAX_SKILL_CHARS = 600
SKILL_HEADER = ("**Episode-Level Skill**\nRefer to this episode-level skill when deciding what "
                "action to take in the current episode:")
JSON_SHAPE = '{"episode_summary": "...", "episode_skill": "..."}'


# ------------------------------------------------------------ the agent's prompt and action
def render_prompt(template, task, history, observation, admissible, history_window=5):
    """The user message of one step in verl-agent's format: the env's template (a dict: "first"
    without history, "history" with the last `history_window` (observation, action) pairs numbered
    from the episode's start, how one admissible action is shown, what separates them) filled in."""
    recent = history[-history_window:] if history_window > 0 else []
    start = len(history) - len(recent)
    records = "\n".join(f"[Observation {start + i + 1}: '{o}', Action {start + i + 1}: '{a}']"
                        for i, (o, a) in enumerate(recent))
    actions = template["separator"].join(template["action"].format(a) for a in admissible)
    return template["history" if recent else "first"].format(
        task=task, observation=observation, admissible_actions=actions, step_count=len(history),
        history_length=len(recent), action_history=records, current_step=len(history) + 1)


def parse_action(response, tags=("action",)):
    """The text inside the first <action>...</action>, stripped; for an env whose template names
    other tags (search's <search>, <answer>), the first complete pair of them, tags included, for
    the env to read. None when there is none."""
    found = [(bounds, tag) for tag in tags if (bounds := tag_bounds(response, tag))]
    if not found:
        return None
    (start, end), tag = min(found)
    inside = response[start + len(tag) + 2:end - len(tag) - 3]
    return inside.strip() if tag == "action" else response[start:end]


def response_is_valid(response, tags=("action",)):
    """verl-agent's rule for a step without the invalid-format penalty: a <think>...</think> pair,
    an action (parse_action) and no Chinese characters."""
    return (tag_bounds(response, "think") is not None
            and parse_action(response, tags) is not None
            and not any("\u4e00" <= ch <= "\u9fff" for ch in response))


# ------------------------------------------------------------------------------ analyzer prompt
def discounted_returns(rewards, gamma=GAMMA):
    """G_t = r_t + gamma * G_{t+1}, computed backwards from the step rewards."""
    returns = []
    for reward in reversed(rewards):
        returns.append(float(reward) + gamma * (returns[-1] if returns else 0.0))
    return returns[::-1]


def tag_bounds(response, tag="action"):
    """(start, end) of the first "<tag>...</tag>" in response, end past the closing tag; None when
    there is none. Two str.find calls: the regex <tag>(.*?)</tag> is quadratic on unclosed tags."""
    start = response.find(f"<{tag}>")
    end = response.find(f"</{tag}>", start + len(tag) + 2) if start >= 0 else -1
    return None if end < 0 else (start, end + len(tag) + 3)


def _one_line(text):
    return " ".join(str(text or "").split())


def analyzer_prompt(trajectory, max_tokens=None, count_tokens=None):
    """The prompt under which the policy turns its finished seed.Trajectory into one skill (JSON).
    Over max_tokens (counted by count_tokens: str -> int, default len // 4) middle steps are
    dropped, then texts cut; the fixed part (task, outcome, instruction) is never cut, so a budget
    below it cannot be met."""
    count_tokens = count_tokens or (lambda text: len(text) // 4)
    steps = trajectory.steps
    rows = []
    returns = discounted_returns([step.reward for step in steps])
    for number, (step, ret) in enumerate(zip(steps, returns), 1):
        action, response = _one_line(step.action), step.response or ""
        bounds = tag_bounds(response)  # the first <action>...</action> (else the action) goes
        thought = response if bounds is None else response[:bounds[0]] + " " + response[bounds[1]:]
        if bounds is None and step.action:  # an env's own tags: its action is the tagged text
            thought = thought.replace(step.action, " ", 1)
        thought = _one_line(re.sub(r"</?think>", " ", thought))  # a bare action tag leaves none
        invalid = "" if step.valid or not action else " (invalid)"
        rows.append((number, ret, _one_line(step.observation), "" if thought == action else thought,
                     (action or "(none)") + invalid))
    won, reward = bool(trajectory.won), float(trajectory.reward)
    head = (f"Analyze the agent's episode.\nTask: {_one_line(trajectory.task)}\n"
            f"Outcome: {'success' if won else 'failure'} (reward {reward:g}, {len(steps)} steps)\n")
    tail = ("The episode succeeded. Give one reusable workflow: the core decision rule and the "
            "action order." if won else
            "The episode failed. Give one avoidance rule: the core mistake and its warning signs.")
    tail += f"\nReply with only JSON: {JSON_SHAPE}"

    def cut(text, limit):  # at a word boundary, so a truncated observation still reads as words
        head = text[:limit] if limit is not None and len(text) > limit else None
        return text if head is None else (head.rsplit(" ", 1)[0] if " " in head else head) + " ..."

    def render(keep, limit):
        shown = rows[:(keep + 1) // 2] + rows[len(rows) - keep // 2:]  # the middle dropped
        lines = []
        for index, (number, ret, obs, thought, action) in enumerate(shown):
            if index and number > shown[index - 1][0] + 1:
                lines.append(f"... ({number - shown[index - 1][0] - 1} steps omitted) ...")
            text = f"Step {number} | return {ret:.2f} | obs: {cut(obs, limit)}"
            text += f" | thought: {cut(thought, limit)}" if thought else ""
            lines.append(text + f" | action: {cut(action, limit)}")
        return head + "".join(line + "\n" for line in lines) + tail

    # all steps, then one middle step fewer each time (down to first and last), then shorter texts
    tries = [(keep, None) for keep in range(len(rows), min(len(rows), 2) - 1, -1)]
    for keep, limit in tries + [(min(len(rows), 2), limit) for limit in (400, 200, 100, 50, 25)]:
        prompt = render(keep, limit)
        if max_tokens is None or count_tokens(prompt) <= max_tokens:
            break
    return prompt


def skill_json(summary, skill):
    """JSON {"episode_summary", "episode_skill"}: the analyzer's answer, what stage 1 trains on."""
    return json.dumps({"episode_summary": summary, "episode_skill": skill}, ensure_ascii=False)


def hindsight_examples(trajectories, annotate, max_prompt_tokens=None, count_tokens=None,
                       seed_value=0):
    """Stage-1 data: (analyzer prompt, skill JSON) per finished trajectory, the skill written by
    `annotate` (the env's annotator: (trajectory, gt, rng) -> (summary, skill); the paper's is a
    strong LLM), kept only when its JSON passes the check the analyzer's own output must pass
    (parse_skill). Returns (examples, counts {"collected", "kept", "dropped"})."""
    rng, examples = random.Random(seed_value), []
    for trajectory in trajectories:
        if trajectory.gt is None or trajectory.dropped:
            continue
        completion = skill_json(*annotate(trajectory, trajectory.gt, rng))
        if parse_skill(completion, task=trajectory.task) is not None:
            prompt = analyzer_prompt(trajectory, max_prompt_tokens, count_tokens)
            examples.append((prompt, completion))
    return examples, {"collected": len(trajectories), "kept": len(examples),
                      "dropped": len(trajectories) - len(examples)}


# --------------------------------------------------------------------------------- skill parser
MAX_PARSE_CHARS = 20000  # analyzer output beyond this is never one skill; bounds the parser's work
_FUNCTION_WORDS = set("a an the to it in on of and or before after then with if when not do don't "
                      "first from is are was were be for by at so until into only never always any "
                      "each every".split())
_LABEL = re.compile(r"^[ \t>*#-]*(?:episode[ _-]?(?:level[ _-]?)?skill|skill)(?:\*\*)?[ \t]*[:=](.+)$",
                    re.I | re.M)
# a quoted value (or a list of them) under an episode_skill key, JSON or Python quoting, anywhere:
# in fenced or chatty answers, with trailing commas, nested, or in an object cut off after it
_KEY_VALUE = re.compile(r"""(?:["']?episode[^a-z\d"':]?(?:level[^a-z\d"':]?)?skill["']?|["']skill["'])\s*:\s*"""
                        r"""("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|\[[^\[\]{}]*\])""", re.I)
_CURLY_QUOTES = {0x201C: '"', 0x201D: '"', 0x2018: "'", 0x2019: "'"}


def _candidates(text):
    """Possible skill strings, most trustworthy first: key-value pairs (as written, then with curly
    quotes made straight), then a label at the start of a line ("Skill: ...")."""
    for source in dict.fromkeys([text, text.translate(_CURLY_QUOTES)]):
        for match in _KEY_VALUE.finditer(source):
            value = match.group(1)[1:-1]  # unless it decodes as a JSON / Python string or list
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
        bold_label = value.startswith("**") and not value.endswith("**")  # "**Skill:** text"
        yield value[2:] if bold_label else value


def _clean_skill(value, task):
    """One line of readable text, or None when too short, degenerate, a placeholder or the task."""
    # control, format (zero-width, bidi) and lone-surrogate characters go, and chat special tokens,
    # which would break the teacher prompt; quotes, brackets or bold around it are wrappers
    skill = "".join(ch for ch in value
                    if ch in "\n\t\r" or unicodedata.category(ch) not in ("Cc", "Cf", "Cs"))
    skill = " ".join(re.sub(r"<\|[^|<>]{0,40}\|>", " ", skill).split())
    while len(skill) > 1 and skill[0] + skill[-1] in ('""', "''", "``", "[]", "**"):
        skill = skill[1:-1].strip()
    words = re.findall(r"[a-z0-9']+", skill.lower())
    new_words = set(words) - set(re.findall(r"[a-z0-9']+", (task or "").lower())) - _FUNCTION_WORDS
    if (len(words) < 4 or len(skill) < 20 or not _FUNCTION_WORDS & set(words)
            or len(set(words)) < 0.35 * len(words)
            or sum(ch.isalpha() for ch in skill) < 0.6 * len(skill.replace(" ", ""))
            or (task and len(new_words - {"you", "your", "task", "some", "should"}) < 2)
            or "episode_skill" in skill or "episode_summary" in skill
            or skill.lower().startswith("your task is to")):
        return None
    if len(skill) <= MAX_SKILL_CHARS:
        return skill
    return skill[:MAX_SKILL_CHARS].rsplit(" ", 1)[0].rstrip(" ,;:-")  # at a word boundary


def parse_skill(text, task=None):
    """The episode skill in the analyzer's output, or None if there is no usable one. Never raises.

    Accepts clean or fenced JSON, trailing commas, single quotes, chatter around it, and a sentence
    after a label at a line start ("Skill: ..."). Rejects empty, truncated (the skill's closing
    quote missing), degenerate or placeholder output and, given `task`, a skill that only restates
    it. Returns one printable line, <= 600 chars.
    """
    try:
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        if not isinstance(text, str):
            return None
        text = "".join(ch for ch in text[:MAX_PARSE_CHARS]
                       if ch in "\n\t" or unicodedata.category(ch) != "Cc")
        with warnings.catch_warnings():  # stray backslashes in model text warn in ast.literal_eval
            warnings.simplefilter("ignore")
            cleaned = (_clean_skill(value, task) for value in _candidates(text))
            return next(filter(None, cleaned), None)
    except Exception:  # a bad analysis must cost one trajectory's signal, never the run
        return None


# ------------------------------------------------------------------------------ teacher context
def with_skill(prompt, skill):
    """The teacher prompt: `prompt` with "\\n\\n" + SKILL_HEADER + "\\n[skill]\\n" inserted at the
    end of the first line with "Your task is to:", else at the start of the line with "Now it's your
    turn" (block + "\\n\\n"), else appended. The ordinary prompt is exactly prompt[:k] + prompt[k:]
    around the block, byte for byte."""
    if not isinstance(skill, str) or not skill.strip():
        raise ValueError("with_skill needs a non-empty skill (skip trajectories without one)")
    block = f"{SKILL_HEADER}\n[{skill.strip()}]"
    task_line = re.search(r"Your task is to:[^\r\n]*", prompt)  # the block goes after this line ...
    turn_line = re.search(r"^.*Now it's your turn", prompt, re.M)  # ... or else before this one
    if task_line:
        return prompt[:task_line.end()] + "\n\n" + block + "\n" + prompt[task_line.end():]
    if turn_line:
        return prompt[:turn_line.start()] + block + "\n\n" + prompt[turn_line.start():]
    return prompt + "\n\n" + block + "\n"
