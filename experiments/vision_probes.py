"""
experiments/vision_probes.py: does a fresh tiny VLM learn to see? The probes behind docs/vision.md's tables.

    python experiments/vision_probes.py --probe colour                    # name the colour of the only shape
    python experiments/vision_probes.py --probe colour --clip-statistics  # the same under CLIP's normalisation
    python experiments/vision_probes.py --probe cell                      # "Click the red circle." with one shape
    python experiments/vision_probes.py --probe cell --shapes 4           # ... among 4 shapes
    python experiments/vision_probes.py --probe cell --shapes 4 --distractors colour   # ... all 4 of one shape
    python experiments/vision_probes.py --probe cell --shapes 4 --screen-as-text       # ... the screen as text
    python experiments/vision_probes.py --probe task --steps 800          # the vision env's first click
    python experiments/vision_probes.py --probe cell --shapes 4 --init-std 0.08 --recall-steps 2500   # recall first
    python experiments/vision_probes.py --probe cell --shapes 4 --init-std 0.08 --own-recall 2:1500 4:1500
    python experiments/vision_probes.py --probe cell --shapes 4 --screen-as-text --distinct 64000 --init-std 0.08 \
        --own-recall 2:1500 3:5000 4:8000 --own-recall-until 0.8 --own-recall-restarts 5   # stages until learned

Each probe builds a fresh tiny Qwen2-VL (models/tiny.py), trains it with the warm-up's SFT step
(seed.supervised_step) on (screenshot + question, "<action>click K</action>") pairs and prints,
every --eval-every steps, the accuracy (argmax over the K answers) and the mean probability of the right answer
on held-out screens. The task probe clones the env's expert (acting examples only) and scores its first click
on valid_seen and valid_unseen. Numbers move from machine to machine and with the thread count; the step at
which a probe leaves chance moves with the seed. --recall-steps and --own-recall put recall stages before the
probe: the bare task of recall_probe.py in arbitrary tokens, or the same hop in the probe's own words.
"""
import argparse
import functools
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import envs  # noqa: E402
import seed  # noqa: E402
from experiments import recall_probe  # noqa: E402
from loss import aggregate  # noqa: E402
from models import tiny, vision  # noqa: E402
from models.policy import parameter_groups  # noqa: E402
from simulators.vision import COLORS, GRID, MAX_STEPS, PROMPT, SHAPES, render  # noqa: E402
from warmup import warm_start  # noqa: E402

CLIP_STATISTICS = ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])


def colour_example(rng, shapes=1):
    """One shape; the answer is its colour's index (1-6)."""
    colour = rng.choice(list(COLORS))
    image = render({rng.randrange(GRID * GRID): (colour, rng.choice(SHAPES))})
    return vision.ImageText("What colour is the item?", image), list(COLORS).index(colour) + 1


def cell_example(rng, shapes=1, distractors="any", screen_as_text=False):
    """`shapes` shapes of different looks; the answer is the cell (1-16) of the one the instruction names.
    distractors: "any" (looks differ in colour, shape or both), "colour" (one shape, the colours differ: the
    instruction's colour word alone decides), "shape" (one colour, the shapes differ).
    screen_as_text: no image; the screen is written out, items in random order ("On the screen: cell 12 yellow
    cross, cell 3 red cross, ... Click the yellow cross."), a perfect reader: what is left is the language hop."""
    cells = rng.sample(range(GRID * GRID), shapes)
    colour, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
    pool = {"any": [(c, s) for c in COLORS for s in SHAPES], "colour": [(c, shape) for c in COLORS],
            "shape": [(colour, s) for s in SHAPES]}[distractors]
    looks = rng.sample(pool, shapes)
    instruction = f"Click the {looks[0][0]} {looks[0][1]}."
    if screen_as_text:
        items = [f"cell {cell + 1} {c} {s}" for cell, (c, s) in zip(cells, looks)]
        rng.shuffle(items)
        return f"On the screen: {', '.join(items)}. {instruction}", cells[0] + 1
    return vision.ImageText(instruction, render(dict(zip(cells, looks)))), cells[0] + 1


HOP_WORDS = [f" {c}" for c in COLORS] + [f" {s}" for s in SHAPES] + [f" q{chr(96 + k)}" for k in range(1, 17)]


def run_hop_probe(steps=1000, items=4, vision_lr_scale=1.0, gap=0, freeze_tower=False, seed_value=0, batch_size=32,
                  eval_every=100, log=print):
    """The vision hop stripped of the prompt: a fresh tiny VLM reads [screenshot] + " yellow cross" (+ `gap` pairs
    of template tokens) and answers the named item's cell as ONE token (" qa" .. " qp" for cells 1-16), loss on
    it alone, fresh examples every step, AdamW at a constant lr 1e-3 (the vision tower at vision_lr_scale times
    that, or frozen). Returns [(step, accuracy)] on 256 held-out screens."""
    rng = random.Random(seed_value)
    with tempfile.TemporaryDirectory(prefix="hop_probe_") as scratch:
        policy = tiny.build_tiny_vlm(HOP_WORDS * 50, scratch, seed=seed_value)
    tokenizer, model = policy.tokenizer, policy.model
    word = {w: tokenizer(w, add_special_tokens=False)["input_ids"] for w in HOP_WORDS}
    assert all(len(ids) == 1 for ids in word.values()), word  # one token each, the answer above all
    answers = torch.tensor([word[f" q{chr(96 + k)}"][0] for k in range(1, 17)])                     # (16,)
    start, end, pad = (tokenizer.convert_tokens_to_ids(t) for t in (vision.VISION_START, vision.VISION_END,
                                                                    vision.IMAGE_PAD))
    template = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|im_start|>")] * gap
    looks = [(c, s) for c in COLORS for s in SHAPES]

    def batch(draw, count):
        screens, rows, cells = [], [], []
        for _ in range(count):
            chosen, picked = draw.sample(range(GRID * GRID), items), draw.sample(looks, items)
            screens.append(render(dict(zip(chosen, picked))))
            rows.append([start] + [pad] * GRID * GRID + [end] + word[f" {picked[0][0]}"] + word[f" {picked[0][1]}"]
                        + template)
            cells.append(chosen[0])
        ids = torch.tensor(rows)                                                                       # (N, T)
        prompts = [vision.ImageIds(row) for row in rows]
        for prompt, processed in zip(prompts, [tokenizer.image_processor(images=[i], return_tensors="pt")
                                               for i in screens]):
            prompt.pixel_values, prompt.grid_thw = processed["pixel_values"], processed["image_grid_thw"][0]
        return ids, vision.image_inputs(model, prompts, ids, torch.ones_like(ids)), torch.tensor(cells)

    if freeze_tower:
        model.model.visual.requires_grad_(False)
    optimizer = torch.optim.AdamW(parameter_groups(model, 1e-3, vision_lr_scale), weight_decay=0.01,
                                  betas=(0.9, 0.95))
    held_ids, held_inputs, held_cells = batch(random.Random(10 ** 6), 256)
    results, begin = [], time.time()
    for step in range(1, steps + 1):
        ids, inputs, cells = batch(rng, batch_size)
        logits = model(input_ids=ids, **inputs).logits[:, -1, answers]                                 # (B, 16)
        loss = torch.nn.functional.cross_entropy(logits, cells)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % eval_every == 0 or step == steps:
            with torch.no_grad():
                guess = model(input_ids=held_ids, **held_inputs).logits[:, -1, answers].argmax(-1)     # (256,)
            results.append((step, (guess == held_cells).float().mean().item()))
            log(f"hop step {step} | loss {loss.item():.3f} | held-out accuracy {results[-1][1]:.3f} | "
                f"{time.time() - begin:.0f}s")
    return results


def own_words_recall_batch(tokenizer, rng, count, items):
    """Recall in the cell probe's own tokens, short: per item its number then its look (" 13 yellow circle"),
    then every look again in a random order, each followed by its number. Returns tokens (count, T), right-padded,
    and the loss mask (count, T): 1 on the tokens of the asked numbers."""
    piece = functools.lru_cache(maxsize=None)(lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    rows, masks = [], []
    for _ in range(count):
        cells = rng.sample(range(GRID * GRID), items)
        looks = rng.sample([(c, s) for c in COLORS for s in SHAPES], items)
        numbers, words = [piece(f" {cell + 1}") for cell in cells], [piece(f" {c} {s}") for c, s in looks]
        row = [t for number, word in zip(numbers, words) for t in number + word]
        mask = [0] * len(row)
        for i in rng.sample(range(items), items):
            row += words[i] + numbers[i]
            mask += [0] * len(words[i]) + [1] * len(numbers[i])
        rows.append(row)
        masks.append(mask)
    width = max(map(len, rows))
    tokens = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])  # (N, T)
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks])                             # (N, T)
    return tokens, mask


def own_words_recall(policy, stages, seed_value=0, batch_size=32, log=print, until=None, check_every=250,
                     abandon_unlearned_first=False):
    """Train the policy's language model on own_words_recall_batch, stage by stage [(items, steps)], with
    recall_probe.py's optimizer; logs the share of held-out sequences whose first asked number is right
    token for token (teacher-forced), every check_every steps. until: end a stage early once that share reaches
    it (steps is then the stage's most). abandon_unlearned_first: stop after the first stage if it ends below
    until. Returns [(items, steps run, last held-out share)] for the stages run."""
    optimizer = recall_probe.recall_optimizer(policy.model)
    rng, start, ends = random.Random(seed_value + 2), time.time(), []
    for items, steps in stages:
        held_out = own_words_recall_batch(policy.tokenizer, random.Random(10 ** 6), 256, items)
        for step in range(1, steps + 1):
            tokens, mask = own_words_recall_batch(policy.tokenizer, rng, batch_size, items)      # (B, T), (B, T)
            logits = policy.model(input_ids=tokens[:, :-1]).logits                              # (B, T-1, V)
            losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
            loss = aggregate(losses, mask[:, 1:])                                               # token mean
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % check_every == 0 or step == steps:
                share = first_answer_accuracy(policy.model, *held_out)
                log(f"own-words recall, {items} items, step {step} | loss {loss.item():.3f} | first asked number "
                    f"right {share:.3f} | {time.time() - start:.0f}s")
                if until is not None and share >= until:
                    break
        ends.append((items, step, share))
        if abandon_unlearned_first and until is not None and share < until:
            break
    return ends


def first_answer_accuracy(model, tokens, mask):
    """Share of rows whose first masked run of tokens (the first asked number) the model predicts token for
    token, teacher-forced."""
    with torch.no_grad():
        right = (model(input_ids=tokens[:, :-1]).logits.argmax(-1) == tokens[:, 1:]).tolist()  # (N, T-1)
    hits = 0
    for row_right, row_mask in zip(right, mask[:, 1:].tolist()):
        begin = row_mask.index(1)
        end = row_mask.index(0, begin) if 0 in row_mask[begin:] else len(row_mask)
        hits += all(row_right[begin:end])
    return hits / len(right)


def greedy_task_scores(policy, split, count=48):
    """(greedy success, share of first clicks on a target) over the first `count` tasks of a split, played as
    train.py evaluates (one greedy episode per task, the env's step limit)."""
    env_list = [envs.make_env("vision", split, i) for i in range(count)]
    trajectories = seed.rollout(policy, env_list, list(range(count)), 1, MAX_STEPS, PROMPT, 48, 0.0, 3, desc=None,
                                generator=torch.Generator().manual_seed(0))

    def first_click_right(trajectory):
        action, targets = trajectory.steps[0].action or "", trajectory.gt["targets"]
        hit = [t for t in targets if action == f"click {t}"]
        return bool(hit) and (trajectory.task_type == "click-all" or hit[0] == targets[0])
    return (sum(t.won for t in trajectories) / count, sum(map(first_click_right, trajectories)) / count)


def answer_text(prompt, k):
    """The bare response: "<action>click 7</action>" (the colour probe's k is a colour's index)."""
    return f"<action>click {k}</action>"


def named_answer_text(prompt, k):
    """The response when the policy first names what it looks for, then its number (name_first): "<think> yellow
    cross7</think><action>click 7</action>", so the number's first digit is predicted right after the words that
    pick it (its tokens: " yellow", " cross", "7", the words as the instruction writes them)."""
    look = str(prompt).rsplit("Click the ", 1)[1].rstrip(".")  # an ImageText is the instruction itself
    return f"<think> {look}{k}</think>" + answer_text(prompt, k)


def evaluate(policy, examples, answers, write=answer_text):
    """(accuracy, mean probability of the right answer) over examples [(prompt, k)], answers 1..`answers`, each
    answer's response written by write(prompt, k)."""
    stop = policy.stop_ids[0]
    candidates = [[policy.tokenizer(write(prompt, k), add_special_tokens=False)["input_ids"] + [stop]
                   for k in range(1, answers + 1)] for prompt, _ in examples]
    prompts = [seed.encode_chat(policy.tokenizer, prompt) for prompt, _ in examples]
    with torch.no_grad():
        logp = seed.response_logprobs(policy.model, [p for p in prompts for _ in range(answers)],
                                      [c for row in candidates for c in row], policy.pad_id).sum(-1)
    logp = logp.view(len(examples), answers)                                         # (N, answers)
    truth = torch.tensor([k - 1 for _, k in examples])                              # (N,)
    right = logp.softmax(-1)[torch.arange(len(examples)), truth]                    # (N,)
    return (logp.argmax(-1) == truth).float().mean().item(), right.mean().item()


def run_probe(probe="colour", steps=300, batch_size=32, lr=1e-3, beta2=0.95, shapes=1, clip_statistics=False,
              eval_every=50, seed_value=0, folder=None, log=print, first_steps=0, distractors="any",
              screen_as_text=False, distinct=3900, init_std=0.02, recall_steps=0, own_recall=(),
              own_recall_until=None, own_recall_restarts=0, name_first=False, vision_lr_scale=1.0, task_episodes=0,
              first_shapes=1):
    """Train a fresh tiny VLM on the probe; returns [(step, accuracy, p_right[, unseen accuracy, p_right])].
    first_steps: a curriculum, the first steps on the cell probe with first_shapes shapes (one unless said), in the
    probe's answer format.
    distractors, screen_as_text: the cell probe's (cell_example). distinct: how many different training examples
    the colour and cell probes draw from (3,900: 3,000 steps of 32 see each about 25 times). init_std: the language
    model's initializer_range. recall_steps: a stage before everything, the bare recall task of recall_probe.py
    written in arbitrary tokens (byte tokens 100-140), the hop the cell probe needs without its long prompt.
    own_recall: stages [(items, steps)] of own_words_recall after it, the same hop in the probe's own words;
    own_recall_until: each stage ends once its held-out share reaches this (its steps are then a most).
    own_recall_restarts: while the first own-words stage ends below own_recall_until, start again from new initial
    weights, at most this many times (whether the stage escapes its plateau depends on the initial weights).
    name_first: cell probe, the response names the look first and then the number (named_answer_text).
    vision_lr_scale: the vision tower's learning rate as a share of the language model's.
    task_episodes: task probe, how many expert episodes the demonstrations come from (0: max(64, steps))."""
    rng = random.Random(seed_value)
    if probe == "task":
        demo_env = envs.make_env("vision", "train", seed_value)
        train = []
        for _ in range(task_episodes or max(64, steps)):
            _, pairs, _ = warm_start.expert_episode(demo_env, rng.randrange(10 ** 6), rng.choice([0, 0.1, 0.2, 0.4]),
                                                    rng, 3, "vision")
            train += pairs
        held_out = {split: [] for split in ("valid_seen", "valid_unseen")}  # scored by greedy_task_scores
        answers, write = GRID * GRID, named_answer_text  # write: the one-shape stage's
    else:
        make = colour_example if probe == "colour" else functools.partial(cell_example, distractors=distractors,
                                                                          screen_as_text=screen_as_text)
        examples = [make(rng, shapes) for _ in range(distinct + 100)]
        write = named_answer_text if name_first and probe == "cell" else answer_text
        train = [(prompt, write(prompt, k)) for prompt, k in examples[:distinct]]
        held_out = {"held_out": examples[distinct:distinct + 48]}
        answers = len(COLORS) if probe == "colour" else GRID * GRID
    easy_rng = random.Random(seed_value + 1)  # its own stream: the probe's data and batches stay as without it
    easy = [cell_example(easy_rng, first_shapes, screen_as_text=screen_as_text)
            for _ in range(4000 if first_steps else 0)]
    easy = [(prompt, (answer_text if write is answer_text else named_answer_text)(prompt, k)) for prompt, k in easy]
    for attempt in range(own_recall_restarts + 1):  # attempt k draws its initial weights from seed + 1000 k
        with tempfile.TemporaryDirectory(prefix="vision_probe_") as scratch:  # the model folder, unless one is given
            policy = tiny.build_tiny_vlm([p + r for p, r in train[:2000]], folder or scratch,
                                         seed=seed_value + 1000 * attempt, initializer_range=init_std)
        if recall_steps:
            recall_probe.run_recall_probe(recall_steps, seed_value=seed_value, eval_every=250, log=log,
                                          model=policy.model, vocabulary=torch.arange(100, 141))
        if not own_recall:
            break
        ends = own_words_recall(policy, own_recall, seed_value, log=log, until=own_recall_until,
                                abandon_unlearned_first=attempt < own_recall_restarts)
        if len(ends) == len(own_recall):
            break
        log(f"own-words recall: the first stage stayed at {ends[0][2]:.3f}; new initial weights")
    if clip_statistics:
        policy.tokenizer.image_processor.image_mean, policy.tokenizer.image_processor.image_std = CLIP_STATISTICS
    torch.manual_seed(seed_value)
    optimizer, schedule = warm_start.warmup_optimizer(policy, lr, steps, beta2, vision_lr_scale)  # the warm-up's
    results, start = [], time.time()
    for step in range(1, steps + 1):
        pool = easy if step <= first_steps else train
        loss = seed.supervised_step(policy, optimizer, [rng.choice(pool) for _ in range(batch_size)],
                                          layout="padded")
        schedule.step()
        if step % eval_every == 0 or step == steps:
            scores = [value for split, examples in held_out.items()
                      for value in (greedy_task_scores(policy, split) if probe == "task"
                                    else evaluate(policy, examples, answers, write))]
            results.append((step, *scores))
            names = ("greedy success", "first click right") if probe == "task" else ("accuracy", "p(right)")
            shown = " | ".join(f"{split} {names[0]} {scores[2 * i]:.3f} {names[1]} {scores[2 * i + 1]:.3f}"
                               for i, split in enumerate(held_out))
            log(f"{probe} step {step} | loss {loss:.3f} | {shown} | {time.time() - start:.0f}s")
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--probe", default="colour", choices=["colour", "cell", "task", "hop"], help="what to learn")
    p.add_argument("--steps", type=int, default=300, help="SFT steps")
    p.add_argument("--batch-size", type=int, default=32, help="examples per step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (30 steps up, then down to 10%%)")
    p.add_argument("--beta2", type=float, default=0.95, help="AdamW beta2 (the screenshot warm-up's)")
    p.add_argument("--shapes", type=int, default=1, help="shapes per screen (cell probe)")
    p.add_argument("--clip-statistics", action="store_true", help="CLIP's pixel normalisation instead of white -> 0")
    p.add_argument("--eval-every", type=int, default=50, help="evaluate every K steps")
    p.add_argument("--seed", type=int, default=0, help="data and initialisation seed")
    p.add_argument("--first-steps", type=int, default=0,
                   help="curriculum: this many steps on one-shape cell probes first")
    p.add_argument("--first-shapes", type=int, default=1, help="shapes per screen in the --first-steps stage")
    p.add_argument("--distractors", default="any", choices=["any", "colour", "shape"],
                   help="cell probe: how the other shapes differ from the named one (colour: only in colour)")
    p.add_argument("--screen-as-text", action="store_true",
                   help="cell probe: the screen written out as text, no image (a perfect reader)")
    p.add_argument("--init-std", type=float, default=0.02, help="the language model's initial weight std")
    p.add_argument("--recall-steps", type=int, default=0,
                   help="first train K steps on recall_probe.py's bare recall task (arbitrary tokens)")
    p.add_argument("--own-recall", nargs="*", default=[], metavar="ITEMS:STEPS",
                   help="stages of recall in the probe's own words before the probe, e.g. 2:1500 4:1500")
    p.add_argument("--own-recall-until", type=float, default=None, metavar="SHARE",
                   help="end each --own-recall stage once its held-out share reaches SHARE (STEPS is then its most)")
    p.add_argument("--own-recall-restarts", type=int, default=0, metavar="K",
                   help="new initial weights while the first --own-recall stage ends below --own-recall-until, "
                        "at most K times")
    p.add_argument("--name-first", action="store_true",
                   help="cell probe: the response names the look, then the number (<think> yellow cross7</think>...)")
    p.add_argument("--vision-lr-scale", type=float, default=1.0,
                   help="the vision tower's learning rate as a share of --lr (the language model's)")
    p.add_argument("--distinct", type=int, default=3900, help="colour and cell probes: distinct training examples")
    p.add_argument("--task-episodes", type=int, default=0,
                   help="task probe: expert episodes behind the demonstrations (0: max(64, --steps))")
    p.add_argument("--gap", type=int, default=0, help="hop probe: pairs of template tokens before the answer")
    p.add_argument("--freeze-tower", action="store_true", help="hop probe: the vision tower stays as initialised")
    args = p.parse_args()
    if args.probe == "hop":
        run_hop_probe(args.steps, args.shapes, args.vision_lr_scale, args.gap, args.freeze_tower, args.seed,
                      args.batch_size, args.eval_every)
        sys.exit()
    run_probe(args.probe, args.steps, args.batch_size, args.lr, args.beta2, args.shapes, args.clip_statistics,
              args.eval_every, args.seed, first_steps=args.first_steps, distractors=args.distractors,
              screen_as_text=args.screen_as_text, distinct=args.distinct, init_std=args.init_std,
              recall_steps=args.recall_steps,
              own_recall=[tuple(map(int, stage.split(":"))) for stage in args.own_recall],
              own_recall_until=args.own_recall_until, own_recall_restarts=args.own_recall_restarts,
              name_first=args.name_first, vision_lr_scale=args.vision_lr_scale, task_episodes=args.task_episodes,
              first_shapes=args.first_shapes)
