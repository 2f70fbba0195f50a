"""training/flags.py: train.py's plumbing flags (the method's are at the top of train.py), and every flag checked
before any work starts -- one `error:` line for a value or a combination that would fail later or be silently
ignored. docs/flags.md says how to print its flag table from here (a test keeps the two equal)."""
import math
import os
import re

import torch

import envs

HUB_NAME = re.compile(r"[\w-][\w.-]*/[\w-][\w.-]*|[\w-][\w.-]*")  # the Hub's "org/name" or "name"
AT_LEAST_ONE = ("updates", "tasks_per_update", "group_size", "max_new_tokens", "max_batch_tokens", "eval_every",
                "save_every", "keep_checkpoints", "eval_tasks", "analysis_max_new_tokens", "max_prompt_tokens",
                "max_steps", "mini_batches")
AT_LEAST = {"warmup_analyzer_share": 0, "threads": 0, "history_window": 0, "sft_tasks": 1, "sft_rollouts": 1, "sft_epochs": 0, "sft_batch_size": 1, "warmup_steps": 0, "analysis_prompt_tokens": 1,
            "analysis_temperature": 0, "eval_temperature": 0, "weight_decay": 0, "kl_coef": 0, "entropy_coef": 0,
            "invalid_penalty": 0, "clip_low": 0, "clip_high": 0, "env_timeout": 0, "distill_coef": 0,
            "train_tasks": 0, "teacher_anchor": 0, "teacher_rl": 0, "explore_samples": 1}
ABOVE_ZERO = {"temperature": "the update re-scores the samples at this temperature", "grad_clip": "",
              "gate_beta": "", "sft_lr": "", "lr": ""}


def add_plumbing_flags(add, defaults, max_steps):
    """The flags around the method (stage, I/O, sizes, budgets, stage 1, the warm-up, evaluation): add(flag,
    default, help, **argparse options) is train.py's; defaults: the preset's; max_steps: the env's limit."""
    add("--stage", "all", "all = warm-up or stage 1, then RL", choices=["all", "sft", "rl"])
    add("--task", "click-test", "--env miniwob: the MiniWoB task, e.g. click-button")
    add("--miniwob-elements", False, "--env miniwob: list the page's elements", action="store_true")
    add("--data-dir", None, "--env alfworld: its data (else $ALFWORLD_DATA, else synthetic games)")
    add("--search-url", None, "--env search: a retrieval server's /retrieve (else $SEARCH_URL, else the embedded BM25)")
    add("--out-dir", "out", "checkpoints, metrics.jsonl, eval.jsonl and config.json")
    add("--resume", False, "continue from the latest checkpoint in --out-dir", action="store_true")
    add("--overwrite", False, "start over in an --out-dir that holds a run", action="store_true")
    add("--seed", 0, "seeds task sampling, generation and initialisation")
    add("--device", None, "cpu or cuda (None: cuda if available)")
    add("--dtype", None, "float32 or bfloat16 (None: bf16 on CUDA, fp32 on CPU)")
    add("--gradient-checkpointing", False, "trade compute for memory", action="store_true")
    add("--threads", 0, "torch threads (0: this machine's cores, shared with the other live runs)")
    # rollouts
    add("--train-tasks", 0, "draw tasks from train tasks 0..K-1 (0: fresh ones every update)")
    add("--max-steps", max_steps, "env steps per episode (the env's own limit)")
    add("--history-window", 3, "past (observation, action) pairs shown (paper: 5)")
    add("--temperature", 1.0, "sampling and re-scoring temperature")
    add("--max-new-tokens", 48, "response tokens per step (paper: 512)")
    add("--max-prompt-tokens", 2048, "prompt tokens (longer prompts keep their end)")
    add("--invalid-penalty", 0.1, "score penalty for a response without <action>")
    add("--env-timeout", 120.0, "seconds an env call may take (0 = no limit)")
    # self-analysis
    add("--analysis-temperature", 0.0, "analyzer temperature, 0 = greedy")
    add("--analysis-max-new-tokens", defaults["analysis_max_new_tokens"], "analyzer output tokens (OPID: 4096)")
    add("--analysis-prompt-tokens", defaults["analysis_prompt_tokens"], "analyzer prompt budget (OPID: all of it)")
    add("--teacher-skill", "own", "what each teacher context holds: its trajectory's own skill, another "
        "task's (the ablation: does what the skill says matter?) or the env annotator's, written from the "
        "ground truth (the bound: a perfect analyzer)", choices=["own", "shuffled", "annotator"])
    add("--analyzer-training", "none", "beyond the paper: one SFT step per update on chosen analyses "
        "(training/analyzer.py)", choices=["none", "confirmed", "explored", "confirmed-and-explored",
                                           "explored-where-wrong", "explored-balanced", "lift", "anchor"])
    add("--explore-samples", 2, "sampled analyses per failed trajectory for the explored kinds of "
        "--analyzer-training (the start model names a habit failure's fix in about 1 sample of 9)")
    add("--teacher-anchor", 0.0, "beyond the paper: weight of a k3 KL to the start model on the sampled tokens "
        "with the skill in context, so RL keeps the teacher's response to skills (training/analyzer.py)")
    add("--teacher-anchor-target", "start", "what --teacher-anchor holds the teacher to: the start model's teacher, or "
        "the current student plus the start model's skill effect (training/analyzer.py)", choices=["start", "effect"])
    add("--teacher-rl", 0.0, "beyond the paper: weight of the policy gradient on the same sampled tokens with each "
        "row's skill in context, so RL trains the teacher's context too (training/analyzer.py)")
    add("--distill-center", False, "beyond the paper: shift the teacher's log-probs so delta averages 0 over each "
        "update's teacher tokens; only the skill's relative verdict is distilled (training/analyzer.py)",
        action="store_true")
    # the update
    add("--dual-clip", 3.0, "dual-clip bound for negative advantages")
    add("--agg", "token-mean", "loss aggregation", choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
    add("--mini-batches", defaults["mini_batches"], "optimizer steps per update, on random parts of the rows")
    add("--grpo-stats", "steps", "GRPO group mean/std over every step row (verl-agent) or over the episodes' "
        "scores (the rule before)", choices=["steps", "trajectories"])
    add("--vision-lr-scale", defaults["vision_lr_scale"], "a VLM's vision tower trains at --lr times this")
    add("--weight-decay", 0.0, "AdamW weight decay")
    add("--grad-clip", 1.0, "max gradient norm")
    add("--layout", "padded", "batch layout for scoring", choices=["padded", "packed"])
    add("--max-batch-tokens", 16384, "micro-batch size in tokens")
    # stage 1 (a Hugging Face model) and the tiny model's warm-up
    add("--sft-data", None, "stage-1 JSONL of {prompt, completion} (None: annotate the policy's rollouts)")
    add("--sft-tasks", 180, "stage 1: train tasks rolled out (paper: 180)")
    add("--sft-rollouts", 8, "stage 1: rollouts per task (paper: 8)")
    add("--sft-epochs", 3, "stage 1: epochs over the kept examples (paper: 3; 0 skips stage 1)")
    add("--sft-batch-size", 16, "stage-1 examples per step (and the tiny warm-up's)")
    add("--sft-lr", 1e-5, "stage-1 learning rate")
    add("--warmup-steps", 1000, "tiny-model warm-up steps (cached per config)")
    add("--warmup-seed", 0, "seed of the tiny warm-up (shared by runs)")
    add("--warmup-analyzer-share", 0.3, "share of analyzer examples in the tiny warm-up's mixture (0: none, "
        "the paper's ablation without hindsight-skill SFT)")
    add("--cache-dir", "cache", "where the warm-started tiny model is cached")
    add("--build-warm-start", False, "build the tiny warm-up (or reuse --cache-dir's), not the one shipped in "
        "warm_starts/", action="store_true")
    # evaluation, logging, checkpoints
    add("--eval-every", 5, "evaluate every K updates (and at start and end)")
    add("--eval-tasks", 48, "tasks per evaluation split")
    add("--eval-temperature", defaults["eval_temperature"], "evaluation temperature, 0 = greedy (OPID: 0.4)")
    add("--save-every", 5, "checkpoint every K updates (and at the end)")
    add("--keep-checkpoints", 2, "how many recent checkpoints to keep")


def flags_markdown(tiny_parser, hf_parser):
    """docs/flags.md's table of every train.py flag from the parsers themselves, so no default is written
    twice: (group, flag, the tiny preset's default, a Hugging Face model's where it differs, help)."""
    show = lambda value: "off" if value is False else "on" if value is True else f"`{value}`"
    hf_defaults = {action.dest: action.default for action in hf_parser._actions}
    lines = ["| flag | default (tiny) | Hugging Face model | what it does |", "|---|---|---|---|"]
    for group in tiny_parser._action_groups[2:]:  # after argparse's own positional / options groups
        lines.append(f"| **{group.title}** | | | |")
        for action in group._group_actions:
            hf = hf_defaults[action.dest]
            choices = f" ({' / '.join(action.choices)})" if action.choices else ""
            lines.append(f"| `{action.option_strings[0]}` | {show(action.default)} | "
                         f"{show(hf) if hf != action.default else ''} | {action.help}{choices} |")
    return "\n".join(lines)


def flag(name):
    return "--" + name.replace("_", "-")


def check_config(cfg, error, defaults):
    """Call error(message) (argparse's: prints it and exits) for the first bad flag value or combination;
    defaults: every flag's default for this model and env."""
    for name in AT_LEAST_ONE:
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            error(f"{flag(name)} must be at least 1, got {getattr(cfg, name)}")
    if cfg.group_size < 2:  # both algos: a group of one has GRPO advantage 0, so nothing would be learned
        error("--group-size must be at least 2: GRPO needs a group to compare rollouts")
    world = int(os.environ.get("WORLD_SIZE", 1))  # set by torchrun
    if cfg.tasks_per_update % world:
        error(f"--tasks-per-update {cfg.tasks_per_update} must divide by the {world} torchrun processes")
    if 0 < cfg.train_tasks < cfg.tasks_per_update:  # an update samples its tasks without repeats
        error(f"--train-tasks {cfg.train_tasks} must be 0 or at least --tasks-per-update ({cfg.tasks_per_update})")
    for name, value in vars(cfg).items():
        if isinstance(value, float) and not math.isfinite(value):
            error(f"{flag(name)} must be a finite number, got {value}")
    for name, low in AT_LEAST.items():
        if getattr(cfg, name) is not None and getattr(cfg, name) < low:
            error(f"{flag(name)} must be at least {low}, got {getattr(cfg, name)}")
    for name, why in ABOVE_ZERO.items():
        if getattr(cfg, name) is not None and getattr(cfg, name) <= 0:
            error(f"{flag(name)} must be above 0, got {getattr(cfg, name)}" + (f" ({why})" if why else ""))
    if cfg.clip_low >= 1:
        error(f"--clip-low must be below 1 (the ratio is clipped to 1 - clip-low), got {cfg.clip_low}")
    if cfg.dual_clip <= 1:
        error(f"--dual-clip must be above 1, got {cfg.dual_clip}")
    if cfg.dtype is not None and cfg.dtype not in ("float32", "bfloat16", "float16"):
        error(f"--dtype must be float32, bfloat16 or float16, got {cfg.dtype!r}")
    if not 0 <= cfg.seed < 2 ** 31:
        error(f"--seed must be between 0 and {2 ** 31 - 1}, got {cfg.seed}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.device is not None:
        try:
            device = torch.device(cfg.device).type
        except RuntimeError:
            error(f"--device must be cpu, cuda or cuda:N, got {cfg.device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            error(f"--device {cfg.device}: this torch sees no CUDA device")
    if cfg.dtype == "float16" and device == "cpu":
        error("--dtype float16 does not train on the CPU (its updates overflow to NaN); use float32 or "
              "bfloat16")
    envs.check_own_flags(cfg, defaults, error)
    path_like = cfg.model.startswith((".", "/", "~")) or not HUB_NAME.fullmatch(cfg.model)
    if cfg.model != "tiny" and not os.path.isdir(os.path.expanduser(cfg.model)) and path_like:
        error(f"--model {cfg.model}: no such folder (and not a Hugging Face name like Qwen/Qwen2.5-1.5B-"
              "Instruct)")
    for name in ("cache_dir", "out_dir"):
        if os.path.exists(getattr(cfg, name)) and not os.path.isdir(getattr(cfg, name)):
            error(f"{flag(name)} {getattr(cfg, name)} is a file, not a folder")
    rows = cfg.max_prompt_tokens + cfg.max_new_tokens
    if cfg.max_batch_tokens < rows:
        print(f"warning: --max-batch-tokens {cfg.max_batch_tokens} is below one full row (--max-prompt-tokens "
              f"+ --max-new-tokens = {rows}): long rows run one per micro-batch, slowly")
    check_out_dir(cfg, error)
    if cfg.analyzer_training != "none" and cfg.algo == "grpo":
        error("--analyzer-training trains SEED's analyzer, which --algo grpo never uses")
    if cfg.teacher_anchor > 0 and cfg.algo == "grpo":
        error("--teacher-anchor anchors SEED's teacher, which --algo grpo has none of")
    if cfg.teacher_rl > 0 and cfg.algo == "grpo":
        error("--teacher-rl trains SEED's teacher context, which --algo grpo has none of")
    if cfg.distill_center and cfg.algo == "grpo":
        error("--distill-center shifts SEED's teacher, which --algo grpo has none of")
    if cfg.teacher_anchor_target != "start" and cfg.teacher_anchor == 0:
        error("--teacher-anchor-target chooses what --teacher-anchor holds the teacher to; set --teacher-anchor > 0")
    if cfg.teacher_skill != "own" and cfg.algo == "grpo":
        error(f"--teacher-skill {cfg.teacher_skill} changes SEED's teacher, which --algo grpo has none of")
    if cfg.stage == "sft" and cfg.algo == "grpo":
        error("--stage sft trains the analyzer, which --algo grpo never uses")
    if cfg.stage == "sft" and cfg.resume:
        error("--resume continues stage-2 (RL) checkpoints; --stage sft has nothing to resume")
    if cfg.sft_data is not None:
        if cfg.model == "tiny":
            error("--sft-data is for stage 1 of a Hugging Face model; the tiny model's warm-up makes its own data")
        if cfg.stage == "rl" or cfg.algo == "grpo":
            error(f"--sft-data is unused with --stage {cfg.stage} --algo {cfg.algo} (no stage 1 runs)")
        if not os.path.isfile(cfg.sft_data):
            error(f"--sft-data {cfg.sft_data}: no such file")


def check_context_window(cfg, policy):
    """The longest prompt plus response must fit the model's position table; an env whose image is what to read
    needs a model that sees images."""
    if envs.spec(cfg.env).screens and not policy.sees_images:
        raise ValueError(f"--env {cfg.env} shows screenshots: use a Qwen2-VL / Qwen2.5-VL model or --model tiny")
    window = getattr(policy.model.config, "max_position_embeddings", None)
    for prompt, new in (("max_prompt_tokens", "max_new_tokens"), ("analysis_prompt_tokens", "analysis_max_new_tokens")):
        if window and getattr(cfg, prompt) + getattr(cfg, new) > window:
            raise ValueError(f"{flag(prompt)} {getattr(cfg, prompt)} + {flag(new)} {getattr(cfg, new)} exceed the "
                             f"model's context window of {window} tokens")


# what makes a run what it is: --resume refuses to change these (--overwrite starts another run instead)
RUN_IDENTITY = ("model", "env", "algo", "group_size", "tasks_per_update", "seed")
RUN_LOGS = ("config.json", "metrics.jsonl", "eval.jsonl", "summary.json", "checkpoints")


def check_out_dir(cfg, error):
    """An --out-dir belongs to one live run (its lock names the PID); a folder with a run in it (its config,
    logs or checkpoints) needs --resume or --overwrite; --resume needs a checkpoint, and may not change what
    the run is (RUN_IDENTITY): the flags it changes are printed."""
    from training.checkpoints import intact_checkpoints, latest_config
    from training.locks import LOCK_NAME, live_holder
    holder = live_holder(os.path.join(cfg.out_dir, LOCK_NAME))
    if holder:
        error(f"--out-dir {cfg.out_dir} is in use by PID {holder['pid']} ({holder.get('what')}, started "
              f"{holder.get('started')}): wait for it to finish or choose another --out-dir")
    found = intact_checkpoints(cfg.out_dir) if os.path.isdir(cfg.out_dir) else []
    pointer = os.path.join(cfg.out_dir, "checkpoints", "latest")
    if cfg.resume and cfg.overwrite:
        error("--resume continues the run in --out-dir and --overwrite starts it over: choose one")
    if cfg.resume and not found and not os.path.exists(pointer):
        error(f"--resume: {cfg.out_dir} holds no checkpoint to continue (start without --resume)")
    held = [name for name in RUN_LOGS if os.path.exists(os.path.join(cfg.out_dir, name))]
    stage1_only = held == ["config.json"] and (latest_config(cfg.out_dir) or {}).get("stage") == "sft"
    if held and not stage1_only and not cfg.resume and not cfg.overwrite and cfg.stage != "sft":
        error(f"--out-dir {cfg.out_dir} holds another run ({', '.join(held)}); continue it with --resume, "
              "start over with --overwrite, or choose another --out-dir")
    saved = latest_config(cfg.out_dir, checkpoint=True) if cfg.resume else None
    if saved and cfg.threads == 0 and saved.get("threads"):  # resume as it ran: float sums follow the threads
        cfg.threads = saved["threads"]
    if saved:
        changed = {k: v for k, v in vars(cfg).items() if k in saved and saved[k] != v
                   and k not in ("resume", "overwrite")}
        refused = [k for k in RUN_IDENTITY if k in changed]
        if refused:
            error("--resume: " + ", ".join(f"{flag(k)} {changed[k]} (the run has {saved[k]})" for k in refused)
                  + " would make it another run; start one with --overwrite or another --out-dir")
        if changed:
            print("resume: changed since the run began: "
                  + ", ".join(f"{flag(k)} {v} (was {saved[k]})" for k, v in changed.items()))
