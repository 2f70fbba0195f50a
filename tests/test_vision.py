"""
tests/test_vision.py: screenshots end to end -- the VLM path (models/vision.py: a tiny Qwen2-VL whose image
prompts sample and re-score exactly, a SEED update with the teacher on the same pixels, the warm-up's SFT step
with images) and the real MiniWoB++ adapter (adapters/miniwob.py) in headless Chromium, skipped with a reason
when the package or the browser is missing (.ci/run installs both).

    python -m pytest -q tests/test_vision.py
"""
import copy
import importlib.util
import math
import os
import random
import re
import subprocess
import sys
import types

import pytest
import torch
from transformers import AutoModelForImageTextToText

import envs
import seed
import skills
from adapters import miniwob as miniwob_adapter
from envs import make_env
from experiments import recall_probe, vision_probes
from models import vision
from models.policy import Policy, parameter_groups
from models.tiny import build_tiny_vlm
from simulators.vision import PROMPT as VISION_PROMPT
from skills import analyzer_prompt, with_skill
from test_seed import max_diff
from warmup import warm_start


# =============================================================================
# models/vision.py: the VLM path (a tiny Qwen2-VL on the screenshot env)
# =============================================================================

@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    """A random tiny Qwen2-VL with a tokenizer trained on vision-env prompts (weights are never trained here)."""
    env, corpus = make_env("vision", "train", 0), []
    for task_seed in range(40):
        obs, info = env.reset(task_seed)
        corpus.append(skills.render_prompt(VISION_PROMPT, info["task"], [], obs["text"], info["admissible"])
                      + "<think>find it</think><action>click 3</action>")
    corpus += [skills.analyzer_prompt(seed.Trajectory(task="Click the red shape."))]
    return build_tiny_vlm(corpus, str(tmp_path_factory.mktemp("tiny_vlm")), seed=0)


def vision_prompts(policy, n, skill=None):
    env, prompts = make_env("vision", "train", 0), []
    for task_seed in range(n):
        obs, info = env.reset(task_seed)
        history = [("The screenshot shows a grid.", "click 2")] * (task_seed % 3)  # different prompt lengths
        text = vision.user_message(skills.render_prompt(VISION_PROMPT, info["task"], history, obs["text"], info["admissible"]), obs)
        prompts.append(vision.same_image(text, with_skill(text, skill)) if skill else text)
    return prompts


def test_vlm_prompt_carries_the_image_and_rescoring_matches_sampling(tiny_vlm):
    """Image prompts hold grid_t*grid_h*grid_w/4 image tokens; the sampler's log-probs equal a padded re-score of
    the same tokens, in a batch and row by row (left padding and M-RoPE positions are exact)."""
    texts = vision_prompts(tiny_vlm, 5)
    prompts = [seed.encode_chat(tiny_vlm.tokenizer, t) for t in texts]
    image_id = tiny_vlm.model.config.image_token_id
    assert all(p.count(image_id) == int(p.grid_thw.prod()) // 4 == 16 for p in prompts)
    assert len({len(p) for p in prompts}) > 1
    responses, logps = seed.sample(tiny_vlm, prompts, 10, 1.0, generator=torch.Generator().manual_seed(0))
    assert not any(set(r) & set(tiny_vlm.banned_ids) for r in responses)
    batch = seed.response_logprobs(tiny_vlm.model, prompts, responses, tiny_vlm.pad_id)
    sampled = torch.zeros_like(batch)
    for row, values in enumerate(logps):
        sampled[row, :len(values)] = torch.tensor(values)
    single = torch.cat([torch.nn.functional.pad(seed.response_logprobs(tiny_vlm.model, [p], [r], tiny_vlm.pad_id),
                                                (0, batch.shape[1] - max(1, len(r))))
                        for p, r in zip(prompts, responses)])
    assert max_diff(batch, sampled) < 1e-4 and max_diff(batch, single) < 1e-4, (max_diff(batch, sampled),
                                                                              max_diff(batch, single))
    # the pixels matter: the same text with another screenshot scores the same tokens differently
    other = [seed.encode_chat(tiny_vlm.tokenizer, vision.ImageText(str(t), texts[(i + 1) % 5].image))
             for i, t in enumerate(texts)]
    assert max_diff(seed.response_logprobs(tiny_vlm.model, other, responses, tiny_vlm.pad_id), batch) > 1e-4
    with pytest.raises(ValueError, match="packed layout does not carry images"):
        seed.response_logprobs(tiny_vlm.model, prompts, responses, tiny_vlm.pad_id, layout="packed")
    with pytest.raises(ValueError, match="no image processor"):
        seed.encode_chat(types.SimpleNamespace(), texts[0])


def seed_update(policy, env_list, task_seeds, env_name, max_steps, vision_lr_scale=1.0):
    """One SEED update by hand, as train.py does it: rollout, analyze, re-score (teacher on the same pixels),
    GRPO advantages, PPO-clip + distillation, the vision tower at lr * vision_lr_scale. Returns (trajectories,
    rows, teacher, metrics, skipped)."""
    trajectories = seed.rollout(policy, env_list, task_seeds, 2, max_steps, envs.load(envs.spec(env_name).prompt), max_new_tokens=12,
                                generator=torch.Generator().manual_seed(0))
    skill_list, _ = seed.analyze(policy, trajectories, max_new_tokens=8)
    skill_list = [s or "Click the cell of the target." for s in skill_list]  # a random model writes no JSON
    rows = seed.step_rows(trajectories, skill_list)
    assert all(t.image is seed_prompt.image for t, seed_prompt in
               zip(rows.teacher_prompts, [s.prompt for t in trajectories for s in t.steps]))
    old, teacher, ref, has_teacher = seed.rescore(policy, rows, need_old=False)
    advantages = seed.step_advantages(trajectories, rows, stats="trajectories")
    optimizer = torch.optim.AdamW(parameter_groups(policy.model, 1e-3, vision_lr_scale), lr=1e-3)
    metrics, skipped = seed.policy_update(policy, optimizer, rows.prompts, rows.responses, advantages, old,
                                          teacher, ref, has_teacher, dict(distill_coef=0.1))
    return trajectories, rows, teacher, metrics, skipped


def test_seed_update_with_the_tiny_vlm_on_the_vision_env(tiny_vlm, tmp_path):
    tiny_vlm.model.save_pretrained(tmp_path)
    policy = Policy(AutoModelForImageTextToText.from_pretrained(tmp_path), tiny_vlm.tokenizer)
    before = [p.detach().clone() for p in policy.model.parameters()]
    env_list = [make_env("vision", "train", i) for i in range(4)]
    trajectories, rows, teacher, metrics, skipped = seed_update(policy, env_list, [5, 6], "vision", 2)
    assert skipped is None and math.isfinite(metrics["grad_norm"]), (skipped, metrics)
    assert all(isinstance(s.observation, str) for t in trajectories for s in t.steps)  # analyzer reads text
    assert "Click" in analyzer_prompt(trajectories[0]) and "image" not in analyzer_prompt(trajectories[0])
    assert teacher.abs().sum() > 0 and metrics["delta_abs_mean"] > 0, metrics
    changed = sum(not torch.equal(a, b.detach()) for a, b in zip(before, policy.model.parameters()))
    assert changed > 10, changed  # the vision tower and the LM both moved


def test_the_tiny_vision_preset_freezes_the_vision_tower_in_rl(tiny_vlm, tmp_path):
    """--env vision with the tiny model: RL leaves the vision tower as the warm-up made it (--vision-lr-scale 0;
    with it training GRPO lost valid_seen success, docs/vision.md) and trains the language model."""
    import train
    scale = train.get_config(["--env", "vision"]).vision_lr_scale
    assert (scale, train.get_config([]).vision_lr_scale) == (0.0, 1.0)
    tiny_vlm.model.save_pretrained(tmp_path)
    policy = Policy(AutoModelForImageTextToText.from_pretrained(tmp_path), tiny_vlm.tokenizer)
    tower = [p.detach().clone() for p in policy.model.model.visual.parameters()]
    head = policy.model.lm_head.weight.detach().clone()
    _, _, _, metrics, skipped = seed_update(policy, [make_env("vision", "train", i) for i in range(4)], [5, 6],
                                            "vision", 2, vision_lr_scale=scale)
    assert skipped is None and metrics["grad_norm"] > 0, (skipped, metrics)
    assert all(torch.equal(a, b) for a, b in zip(tower, policy.model.model.visual.parameters()))
    assert not torch.equal(head, policy.model.lm_head.weight)


def test_screen_skill_probes_run_on_a_vision_model_folder(tiny_vlm, tmp_path):
    """experiment.py --probes on a VLM folder: the skill checks, the teacher's delta at wrong clicks and at won
    steps (all, cell digits, look words) and the skill lift on screens, each a (value or None, count) pair."""
    from experiments import experiment
    tiny_vlm.model.save_pretrained(tmp_path)
    tiny_vlm.tokenizer.save_pretrained(tmp_path)
    tiny_vlm.tokenizer.image_processor.save_pretrained(tmp_path)
    found = experiment.screen_skill_probes(str(tmp_path), episodes=3)
    assert "wrong click: summed delta, mean" in found and found["parsed"][1] == 3, found
    assert found["first click on the target: a skill names it"][1] == 3, found  # screen_skill_lift, 3 tasks
    assert all(value is None or math.isfinite(value) for value, _ in found.values()), found


def test_the_self_analysis_probe_records_and_reads_screen_episodes(tiny_vlm, tmp_path, capsys):
    """The probe set of --env vision: episodes whose prompts carry screenshots are saved (as text), read back and
    analyzed, and the probe's numbers come out (the random model's analyses never parse: 1.0, no crash)."""
    from evaluation import self_analysis
    import train
    cfg = train.get_config(["--env", "vision", "--max-steps", "2", "--max-new-tokens", "8",
                            "--analysis-max-new-tokens", "8"])
    template, path = envs.load(envs.spec("vision").prompt), str(tmp_path / "probe_set.json")
    recorded = self_analysis.probe_set(tiny_vlm, cfg, template, {"max_steps": 2}, path)
    again = self_analysis.probe_set(None, cfg, template, {"max_steps": 2}, path)  # read back, not recorded again
    assert [t.steps[0].observation for t in again] == [t.steps[0].observation for t in recorded]
    assert sum("warning:" in line for line in capsys.readouterr().out.splitlines()) == 1
    factory = lambda i: make_env("vision", "valid_seen", i, max_steps=2)
    found = self_analysis.self_analysis(tiny_vlm, cfg, again, template, factory, [0.0] * self_analysis.LIFT_TASKS)
    assert found["parse_fail"] == 1.0 and found["lift"] == 0.0, found


def test_supervised_step_with_images(tiny_vlm, tmp_path):
    """The warm-up's SFT step on (image prompt, completion), with the prompt language-modelling loss."""
    tiny_vlm.model.save_pretrained(tmp_path)
    policy = Policy(AutoModelForImageTextToText.from_pretrained(tmp_path), tiny_vlm.tokenizer)
    examples = [(text, "<think>find it</think><action>click 4</action>") for text in vision_prompts(policy, 4)]
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=3e-3)
    losses = [seed.supervised_step(policy, optimizer, examples, prompt_weight=0.3) for _ in range(4)]
    assert losses[-1] < losses[0], losses


def test_a_vlm_checkpoint_loads_with_its_image_processor(tiny_vlm, tmp_path):
    """training/checkpoints.save_checkpoint keeps the tiny processor (white -> 0) beside the weights, so a vision
    checkpoint loads as a policy (--resume, experiments/vision_picture.py) with the statistics it trained under."""
    from models.policy import load_policy
    from training.checkpoints import save_checkpoint
    cfg = types.SimpleNamespace(out_dir=str(tmp_path), keep_checkpoints=2)
    folder = save_checkpoint(cfg, tiny_vlm, torch.optim.AdamW(tiny_vlm.model.parameters()), 1)
    loaded = load_policy(folder, device="cpu", dtype="float32")
    means = [list(p.tokenizer.image_processor.image_mean) for p in (loaded, tiny_vlm)]
    assert means == [[1.0] * 3] * 2, means


def test_tiny_vlm_learns_to_see_colour_within_200_steps(tmp_path):
    """experiments/vision_probes.py's colour probe (name the colour of the only shape, 6 answers) under the tiny
    processor's normalisation, white -> 0. With CLIP's statistics (white -> 2 in every pixel) the from-scratch
    vision tower collapsed onto that common mode and this probe stayed at chance (docs/vision.md)."""
    results = vision_probes.run_probe("colour", steps=200, batch_size=16, eval_every=200, folder=str(tmp_path))
    _, accuracy, p_right = results[-1]
    print(f"\ncolour probe after 200 steps: accuracy {accuracy:.2f}, p(right) {p_right:.2f} (chance 0.17)")
    assert accuracy >= 0.9, results


def test_vision_tower_trains_at_its_share_of_the_learning_rate(tiny_vlm, tiny):
    """warm_start.warmup_optimizer: the Qwen2-VL's vision tower at lr * vision_lr_scale, everything else at lr,
    every parameter in exactly one group, through the schedule; a text model keeps one group."""
    optimizer, schedule = warm_start.warmup_optimizer(tiny_vlm, 1e-3, 100, 0.95, warm_start.VISION_LR_SCALE)
    for _ in range(40):
        schedule.step()
    language, tower = optimizer.param_groups
    assert {id(p) for p in tower["params"]} == {id(p) for p in tiny_vlm.model.model.visual.parameters()}
    assert len(language["params"]) + len(tower["params"]) == len(list(tiny_vlm.model.parameters()))
    assert tower["lr"] == pytest.approx(language["lr"] * 0.1) and language["lr"] == pytest.approx(1e-3 * 0.6)
    text_optimizer, _ = warm_start.warmup_optimizer(tiny[0], 1e-3, 100, 0.95, 0.1)
    assert len(text_optimizer.param_groups) == 1


# the words of the clicked item's look that each family's instruction names (the rest only the pixels show)
NAMED_WORDS = {"click-color": (0,), "click-sequence": (0,), "click-shape": (1,), "click-all": (1,),
               "click-color-shape": (0, 1), "odd-one-out": (0, 1)}
# a screenshot warm-up response: the think's named words and cell, then the click
VISION_RESPONSE = re.compile(r"<think> ([a-z ]+?)([0-9]+)</think><action>click ([0-9]+)</action>")


def test_vision_demonstrations_name_the_target_right_before_its_cell():
    """The screenshot warm-up's expert responses: "<think> red circle7</think><action>click 7</action>", the
    look of the item in the clicked cell (the episode's ground truth), its first digit the token after the look;
    where the instruction names only the colour ("Click the red shape.") or only the shape, only that word."""
    env, rng, families = make_env("vision", "train", 0), random.Random(0), set()
    for task_seed in range(40):
        trajectory, examples, _ = warm_start.expert_episode(env, task_seed, 0.2, rng, 3, "vision")
        for _, response in examples:
            found = VISION_RESPONSE.fullmatch(response)
            assert found and found[2] == found[3], response
            look = trajectory.gt["items"][int(found[3])]
            assert found[1].split() == [look[i] for i in NAMED_WORDS[trajectory.task_type]], (response, look)
            named_in_task = all(f" {word}" in trajectory.task for word in found[1].split())
            assert named_in_task or trajectory.task_type == "odd-one-out", (response, trajectory.task)
            families.add(trajectory.task_type)
    assert families == set(NAMED_WORDS), families


def drill_family(task):
    """The family of a vision task line (simulators/vision.py's six instruction forms)."""
    words = task.rstrip(".").split()
    if "differs" in words:
        return "odd-one-out"
    if "then" in words:
        return "click-sequence"
    if words[1] == "every":
        return "click-all"
    if len(words) == 3:  # "Click the triangle."
        return "click-shape"
    return "click-color" if words[3] == "shape" else "click-color-shape"


def test_task_drills_answer_every_family_from_the_screen_alone():
    """warm_start.task_drills: each step of an expert episode on a train task as a short prompt (the task line and
    that step's screenshot, clicked targets gone) answered like the demonstrations: the clicked cell on that
    screen holds an item the task asks for, and the think names the words of its look the task names."""
    from simulators.vision import read_screen
    families = set()
    for prompt, response in warm_start.task_drills(150, seed_value=2):
        found = VISION_RESPONSE.fullmatch(response)
        assert found and found[2] == found[3], response
        screen = {cell + 1: look for cell, look in read_screen(prompt.image).items()}
        family, look = drill_family(str(prompt)), screen[int(found[3])]
        assert found[1].split() == [look[i] for i in NAMED_WORDS[family]], (str(prompt), response, look)
        if family == "odd-one-out":
            assert list(screen.values()).count(look) == 1, (screen, look)
        else:  # the named words are the task's
            assert all(f" {word}" in prompt for word in found[1].split()), (str(prompt), response)
        if family == "click-sequence":  # its first colour while that item is on the screen, then the second
            first, second = str(prompt).split()[2], str(prompt).split()[6]
            assert found[1] == (first if any(c == first for c, _ in screen.values()) else second), (prompt, response)
        families.add(family)
    assert families == set(NAMED_WORDS), families


def test_hop_probe_answers_one_token_per_cell():
    """vision_probes.run_hop_probe runs and scores 256 held-out screens (its learning is docs/vision.md's table)."""
    results = vision_probes.run_hop_probe(steps=2, eval_every=2, batch_size=4, vision_lr_scale=0.1, gap=1)
    assert [step for step, _ in results] == [2] and 0 <= results[0][1] <= 1, results


@pytest.mark.parametrize("distractors", ["any", "colour", "shape"])
def test_cell_probe_examples_name_one_item_and_answer_its_cell(distractors):
    """vision_probes.cell_example: 4 items of different looks, differing only in colour or only in shape when
    asked; the screen-as-text variant lists the same items (shuffled) and the answer is the named item's cell."""
    for seed_value in range(20):
        prompt, cell = vision_probes.cell_example(random.Random(seed_value), 4, distractors, screen_as_text=True)
        listed, instruction = prompt.split(". Click the ")
        words = [item.split(" ") for item in listed.removeprefix("On the screen: ").split(", ")]
        items = {f"cell {w[1]}": f"{w[2]} {w[3]}" for w in words}  # "cell 12 red circle": "cell 12" -> "red circle"
        assert len(items) == 4 and len(set(items.values())) == 4, prompt
        assert items[f"cell {cell}"] == instruction.rstrip("."), prompt
        colours, shapes = {look.split()[0] for look in items.values()}, {look.split()[1] for look in items.values()}
        assert distractors != "colour" or len(shapes) == 1, prompt
        assert distractors != "shape" or len(colours) == 1, prompt
        image_prompt, image_cell = vision_probes.cell_example(random.Random(seed_value), 4, distractors)
        assert image_cell == cell and str(image_prompt) == "Click the " + instruction  # same draw, with pixels
        assert image_prompt.image.shape == (112, 112, 3)


def test_own_words_recall_asks_every_look_once_and_masks_its_number(tiny_vlm):
    """vision_probes.own_words_recall_batch: " 13 yellow circle" per item, then each look again followed by its
    number; the loss mask is 1 on exactly the asked numbers' tokens. first_answer_accuracy scores the first of
    them: 1 for a model that predicts every next token (here: one whose logits are the right answers)."""
    tokenizer = tiny_vlm.tokenizer
    tokens, mask = vision_probes.own_words_recall_batch(tokenizer, random.Random(0), 8, 3)
    for row, row_mask in zip(tokens.tolist(), mask.tolist()):
        text = tokenizer.decode([t for t in row if t != tokenizer.pad_token_id])
        words = text.split()
        written = {(words[i + 1], words[i + 2]): words[i] for i in range(0, 9, 3)}  # look -> number
        asked = [((words[i], words[i + 1]), words[i + 2]) for i in range(9, 18, 3)]
        assert len(written) == 3 and sorted(look for look, _ in asked) == sorted(written), text
        assert all(written[look] == number for look, number in asked), text
        masked = tokenizer.decode([t for t, m in zip(row, row_mask) if m]).split()
        assert masked == [number for _, number in asked], (text, masked)

    class Fixed(torch.nn.Module):  # logits that put all mass on given next tokens, whatever it reads
        def __init__(self, following):
            super().__init__()
            self.following = following                                                      # (N, T-1)

        def forward(self, input_ids):
            return type("Out", (), {"logits": torch.nn.functional.one_hot(self.following, len(tokenizer)).float()})

    assert vision_probes.first_answer_accuracy(Fixed(tokens[:, 1:]), tokens, mask) == 1.0
    first_wrong = tokens[:, 1:].clone()  # right everywhere but on the first asked number
    for row, row_mask in zip(first_wrong, mask[:, 1:].tolist()):
        row[row_mask.index(1) + 1] = tokenizer.pad_token_id  # its second token (the first is the space)
    assert vision_probes.first_answer_accuracy(Fixed(first_wrong), tokens, mask) == 0.0


def test_own_words_recall_stages_end_once_learned(tiny_vlm):
    """own_words_recall runs every stage for its steps, or, with `until`, only until its held-out share reaches
    it (here at once: a share is never below -1). It trains a copy: the fixture's weights stay random."""
    policy = copy.deepcopy(tiny_vlm)
    quiet = dict(batch_size=2, log=lambda line: None, check_every=1)
    full = vision_probes.own_words_recall(policy, [(2, 3), (3, 2)], **quiet)
    assert [(items, steps) for items, steps, _ in full] == [(2, 3), (3, 2)]
    assert all(0.0 <= share <= 1.0 for _, _, share in full)
    early = vision_probes.own_words_recall(policy, [(2, 3), (3, 2)], until=-1.0, **quiet)
    assert [(items, steps) for items, steps, _ in early] == [(2, 1), (3, 1)]


def test_own_words_recall_restarts_from_new_weights_while_the_first_stage_is_unlearned():
    """run_probe with --own-recall-restarts 1 and a share no stage can reach: the first stage runs twice, from
    different initial weights, then the later stages once, then the probe."""
    lines = []
    results = vision_probes.run_probe("cell", steps=1, batch_size=2, shapes=2, screen_as_text=True, distinct=40,
                                      log=lines.append, own_recall=[(2, 1), (3, 1)], own_recall_until=2.0,
                                      own_recall_restarts=1)
    stages = [line.split(",")[1].strip() for line in lines if line.startswith("own-words recall,")]
    assert stages == ["2 items", "2 items", "3 items"], lines
    assert sum("new initial weights" in line for line in lines) == 1, lines
    assert len(results) == 1 and 0.0 <= results[0][1] <= 1.0


def test_recall_probe_asks_every_key_once_and_answers_its_value():
    """recall_probe.recall_batch: pairs written value first, then each key asked once, followed by the value it
    was written with; keys within a sequence are distinct, keys and values use disjoint token ids."""
    tokens = recall_probe.recall_batch(64, 4, torch.Generator().manual_seed(0))
    assert tokens.shape == (64, 16)
    for row in tokens.tolist():
        written = {row[i + 1]: row[i] for i in range(0, 8, 2)}  # key -> value
        asked = [(row[i], row[i + 1]) for i in range(8, 16, 2)]  # (key, answer)
        assert len(written) == 4 and sorted(k for k, _ in asked) == sorted(written), row
        assert all(written[key] == answer for key, answer in asked), row
        assert max(written) <= recall_probe.KEYS < min(written.values()), row


def test_recall_probe_two_word_keys_with_filler_keep_the_layout():
    """--key-tokens 2 --filler 1: each pair is (filler, value, word 1, word 2), each query (filler, word 1, word 2,
    value); word j comes from its own WORD_CHOICES ids, so two keys may share a word but never both."""
    tokens = recall_probe.recall_batch(64, 4, torch.Generator().manual_seed(0), key_tokens=2, filler=1)
    assert tokens.shape == (64, 32)
    choices = recall_probe.WORD_CHOICES
    for row in tokens.tolist():
        items = [row[i:i + 4] for i in range(0, 32, 4)]
        assert all(item[0] == 0 for item in items), row
        written = {tuple(item[2:]): item[1] for item in items[:4]}  # key -> value
        asked = [(tuple(item[1:3]), item[3]) for item in items[4:]]  # (key, answer)
        assert len(written) == 4 and all(written[key] == answer for key, answer in asked), row
        assert all(1 <= a <= choices < b <= 2 * choices for a, b in written), row


def test_recall_probe_runs_and_scores_the_first_query():
    """Two steps of the probe end to end: an accuracy in [0, 1] at each evaluation."""
    results = recall_probe.run_recall_probe(steps=2, eval_every=1, log=lambda line: None)
    assert [step for step, _ in results] == [1, 2] and all(0 <= accuracy <= 1 for _, accuracy in results)


def test_recall_probe_trains_a_given_model_in_its_own_tokens():
    """The warm-up-stage form (vision_probes --recall-steps): a given model, the probe's tokens mapped to that
    model's ids, a plain first step then the filler; the model's weights move and its answers are scored."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    before = model.model.embed_tokens.weight.detach().clone()
    results = recall_probe.run_recall_probe(steps=2, eval_every=2, log=lambda line: None, filler=1, plain_steps=1,
                                            model=model, vocabulary=torch.arange(100, 141))
    moved = (model.model.embed_tokens.weight - before).abs().amax(-1)              # (160,)
    # read input rows take Adam steps (about lr); the others only weight decay (about lr x 0.01 x weight)
    assert moved[100:141].min() > 100 * torch.cat([moved[:100], moved[141:]]).max(), moved
    assert len(results) == 1 and 0 <= results[0][1] <= 1


# =============================================================================
# adapters/miniwob.py: the real MiniWoB++ in headless Chromium
# =============================================================================

def miniwob_missing():
    try:
        miniwob_adapter._import_miniwob()
    except (ImportError, RuntimeError) as error:
        return str(error)
    return None


needs_miniwob = pytest.mark.skipif(miniwob_missing() is not None,
                                   reason=f"MiniWoB++ unavailable: {miniwob_missing()} (.ci/run installs it)")


def test_miniwob_missing_package_or_browser_gives_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "miniwob", None)
    with pytest.raises(ImportError, match="pip install miniwob==1.1.0"):
        make_env("miniwob", "train", 0)
    monkeypatch.delitem(sys.modules, "miniwob")
    if importlib.util.find_spec("miniwob") is not None:
        monkeypatch.setenv("MINIWOB_CHROME_BINARY", "/nonexistent/chromium")
        with pytest.raises(RuntimeError, match="apt-get install chromium chromium-driver"):
            make_env("miniwob", "train", 0)


@needs_miniwob
def test_miniwob_scripted_episodes_reach_positive_reward():
    """The adapter's text actions (element clicks, typing) solve three real tasks; the clock is raised."""
    for task in ("click-button", "enter-text", "click-checkboxes"):
        env = make_env("miniwob", "valid_seen", 0, task=task, elements=True)
        obs, info = env.reset(7)
        assert obs["image"].shape == (210, 160, 3) and obs["image"].dtype.name == "uint8" and info["task"]
        assert "Elements: [" in obs["text"] and info["admissible"][0].startswith("click element")
        assert env.env.unwrapped.instance.driver.execute_script("return core.EPISODE_MAX_TIME;") == 600000
        done = False
        while not done:
            obs, reward, done, info = env.step(env.expert_action())
        assert reward > 0 and info["won"] and info["score"] > 0, (task, info)


@needs_miniwob
def test_miniwob_garbage_actions_and_a_dead_browser_do_not_crash():
    env = make_env("miniwob", "train", 0, task="click-test")
    obs, info = env.reset(0)
    assert info["admissible"] == []  # screenshot only: free-form actions
    for junk in ("", "click element 9999", "click 999 5", "type element 12345 x", "press nokey", "\x00<>{}"):
        obs, reward, done, info = env.step(junk)
        assert obs["text"] == "Nothing happens." and not info["valid"] and not done
    obs, reward, done, info = env.step("click 3 4")  # a real click on empty page space: valid, no reward
    assert info["valid"] and reward == 0.0
    driver = env.env.unwrapped.instance.driver.service.process
    children = subprocess.run(["pgrep", "-P", str(driver.pid)], capture_output=True, text=True).stdout.split()
    for pid in children:  # the browser processes this test's env started
        os.kill(int(pid), 9)
    driver.kill()
    obs, reward, done, info = env.step(env.expert_action())
    assert done and info["browser_restarted"] and reward == 0.0
    obs, info = env.reset(1)
    done = False
    while not done:
        obs, reward, done, info = env.step(env.expert_action())
    assert info["won"], info


@needs_miniwob
def test_seed_update_with_the_tiny_vlm_on_miniwob(tiny_vlm, tmp_path):
    tiny_vlm.model.save_pretrained(tmp_path)
    policy = Policy(AutoModelForImageTextToText.from_pretrained(tmp_path), tiny_vlm.tokenizer)
    env_list = [make_env("miniwob", "train", i, task="click-test") for i in range(2)]
    trajectories, rows, teacher, metrics, skipped = seed_update(policy, env_list, [3], "miniwob", 2)
    assert skipped is None and math.isfinite(metrics["grad_norm"]), (skipped, metrics)
    assert rows.prompts[0].grid_thw.tolist() == [1, 16, 12]  # 210x160 -> 224x168: 8x6 merged tokens


def test_evaluate_models_plays_the_env_named_after_the_dashes(tiny_vlm, monkeypatch):
    """experiment.py --evaluate DIR -- --env vision: a finished vision model is evaluated on screens, not on the
    household default (docs/vision.md's 1,440-task reading)."""
    import envs
    from experiments import experiment
    import models.policy
    made, make = [], envs.make_env
    monkeypatch.setattr(envs, "make_env", lambda name, *args, **kwargs: made.append(name) or make(name, *args,
                                                                                                   **kwargs))
    monkeypatch.setattr(models.policy, "load_policy", lambda *args, **kwargs: tiny_vlm)
    rows = experiment.evaluate_models(["a tiny VLM"], temperature=0.0, tasks=2, extra=["--env", "vision"])
    assert made == ["vision"] * 4, made
    assert rows[0]["tasks"] == 2 and all(0.0 <= rows[0][split] <= 1.0 for split in ("valid_seen", "valid_unseen"))


def test_stage1_on_a_vlm_saves_a_policy_that_loads_back_with_its_image_processor(tiny_vlm, tmp_path, capsys):
    """train.py --stage sft on a (local) Qwen2-VL folder: the paper's stage 1 on the vision env (2 tasks x 2 of its
    own rollouts, annotated, format-checked, one epoch), saved through models.policy.save_policy; load_policy reads
    the folder back with the same image processor settings and the same weights."""
    from models.policy import load_policy, save_policy
    from test_seed import run_train
    folder = tmp_path / "vlm"
    save_policy(tiny_vlm, str(folder))
    run_train("--env", "vision", "--model", folder, "--stage", "sft", "--sft-tasks", 2, "--sft-rollouts", 2,
              "--tasks-per-update", 2, "--sft-epochs", 1, "--max-steps", 2, "--max-new-tokens", 6,
              "--analysis-prompt-tokens", 1024, "--analysis-max-new-tokens", 16, "--sft-lr", 1e-3,
              "--out-dir", tmp_path / "out")
    output = capsys.readouterr().out
    assert "stage 1: 4 trajectories collected, 4 kept, 0 dropped" in output, output[-2000:]
    trained = load_policy(str(tmp_path / "out" / "sft"), "cpu", "float32")
    before, after = tiny_vlm.tokenizer.image_processor, trained.tokenizer.image_processor
    assert type(after) is type(before) and after.image_mean == before.image_mean, (before, after)
    assert after.to_dict() == before.to_dict(), (after.to_dict(), before.to_dict())
    moved = max((a - b).abs().max().item() for a, b in zip(tiny_vlm.model.parameters(), trained.model.parameters()))
    assert trained.sees_images and moved > 0, f"stage 1 left the VLM unchanged ({moved})"
    prompt = seed.encode_chat(trained.tokenizer, vision_prompts(trained, 1)[0])  # the pixels still encode
    assert prompt.pixel_values is not None
