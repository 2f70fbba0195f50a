"""
experiments/vision_picture.py: the vision policy's clicks before and after RL, on the same screens, with the skill
each policy wrote about its own episode -- a picture rather than a table.

    python experiments/vision_picture.py --before cache/tiny-vision-KEY --after out/checkpoints/update-10 \
        --out docs/vision_clicks.png

For each of the first --tasks tasks of --split, both policies play one greedy episode (as train.py evaluates)
and then analyze it (seed.analyze, the analyzer SEED's teacher gets its skill from). One row per task: the first
screenshot, enlarged, with each click drawn as a numbered ring (green: a target, red: a wrong item, grey: an empty
cell or no valid click), before on the left and after on the right, each with its responses and skill below.
Pillow only (a requirement of the vision path); not in the paper.
"""
import argparse
import os
import sys
import textwrap

import torch
from PIL import Image, ImageDraw

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import envs  # noqa: E402
import seed  # noqa: E402
from models.policy import load_policy  # noqa: E402
from simulators.vision import CELL, GRID, MAX_STEPS, PROMPT  # noqa: E402

SCALE, TEXT_LINES, WRAP = 3, 12, 58  # screenshot enlargement; text lines and characters per line below a panel
PANEL = GRID * CELL * SCALE
COLOURS = {"target": (30, 160, 60), "wrong": (220, 30, 30), "nothing": (130, 130, 130)}


def play(policy, split, tasks, max_new_tokens=48):
    """One greedy episode per task, then the policy's own skill for each: (trajectories, skills)."""
    env_list = [envs.make_env("vision", split, i) for i in range(tasks)]
    trajectories = seed.rollout(policy, env_list, list(range(tasks)), 1, MAX_STEPS, PROMPT, max_new_tokens, 0.0, 3,
                                desc=None,
                                generator=torch.Generator().manual_seed(0))
    found, raw = seed.analyze(policy, trajectories, desc=None)
    return trajectories, [skill or f"(unparsed: {text[:80]})" for skill, text in zip(found, raw)]


def clicks(trajectory):
    """[(cell, kind)] in order, from the episode's ground truth: kind "target", "wrong" (the click that failed
    the task) or "nothing" (an empty cell). Answers that were no click at all are not drawn."""
    gt = trajectory.gt
    wrong = (gt.get("mistake") or {}).get("cell")
    return [(cell, "nothing" if look is None else "wrong" if cell == wrong else "target")
            for cell, look in gt["clicked"]]


def panel(trajectory, skill, title):
    """(PANEL, PANEL + text) image: the episode's first screenshot with its clicks, its responses and skill."""
    screen = trajectory.steps[0].prompt.image
    canvas = Image.new("RGB", (PANEL, PANEL + 14 * TEXT_LINES), "white")
    canvas.paste(Image.fromarray(screen).resize((PANEL, PANEL), Image.NEAREST))
    draw = ImageDraw.Draw(canvas)
    for index, (cell, kind) in enumerate(clicks(trajectory)):
        row, column = divmod(cell - 1, GRID)
        x, y = (column + 0.5) * CELL * SCALE, (row + 0.5) * CELL * SCALE
        radius = CELL * SCALE * (0.42 - 0.05 * index)  # a cell clicked twice shows both rings
        draw.ellipse([x - radius, y - radius, x + radius, y + radius], outline=COLOURS[kind], width=4)
        draw.text((x + radius * 0.55, y - radius), str(index + 1), fill=COLOURS[kind])
    outcome = "won" if trajectory.won else "lost"
    lines = [f"{title}: {outcome}"] + [f"{i + 1}. {step.response}" for i, step in enumerate(trajectory.steps)]
    lines.append(f"skill: {skill}")
    wrapped = [piece for line in lines for piece in textwrap.wrap(line, WRAP)][:TEXT_LINES]
    for i, line in enumerate(wrapped):
        draw.text((4, PANEL + 2 + 14 * i), line, fill="black")
    return canvas


def picture(before, after, split="valid_seen", tasks=4, out="vision_clicks.png"):
    """Play, analyze and draw; returns the PNG's path and the rows' outcomes [(task, before won, after won)]."""
    rows, outcomes = [], []
    played = [play(policy, split, tasks) for policy in (before, after)]
    for index in range(tasks):
        (first, first_skills), (second, second_skills) = played
        header = Image.new("RGB", (2 * PANEL + 10, 18), "white")
        ImageDraw.Draw(header).text((4, 2), f"{split} task {index}: {first[index].task}", fill="black")
        row = Image.new("RGB", (2 * PANEL + 10, header.height + PANEL + 14 * TEXT_LINES), "white")
        row.paste(header, (0, 0))
        row.paste(panel(first[index], first_skills[index], "before RL"), (0, header.height))
        row.paste(panel(second[index], second_skills[index], "after RL"), (PANEL + 10, header.height))
        rows.append(row)
        outcomes.append((first[index].task, first[index].won, second[index].won))
    sheet = Image.new("RGB", (rows[0].width, sum(r.height for r in rows)), "white")
    for i, row in enumerate(rows):
        sheet.paste(row, (0, sum(r.height for r in rows[:i])))
    sheet.save(out)
    return out, outcomes


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="model folder before RL (the warm-start)")
    p.add_argument("--after", required=True, help="model folder after RL (a checkpoint's model)")
    p.add_argument("--split", default="valid_seen", choices=["train", "valid_seen", "valid_unseen"])
    p.add_argument("--tasks", type=int, default=4, help="rows: the first K tasks of the split")
    p.add_argument("--out", default="out/vision_clicks.png", help="where the PNG goes")
    args = p.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    models = [load_policy(folder, device="cpu", dtype="float32") for folder in (args.before, args.after)]
    path, outcomes = picture(*models, args.split, args.tasks, args.out)
    for task, was, now in outcomes:
        print(f"{task:50s} before {'won' if was else 'lost'}, after {'won' if now else 'lost'}")
    print(f"wrote {path}")
