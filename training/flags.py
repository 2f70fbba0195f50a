"""training/flags.py: train.py's flags checked before any work starts -- one `error:` line for a value or a
combination that would fail later or be silently ignored."""
import math
import os
import re

import torch

HUB_NAME = re.compile(r"[\w-][\w.-]*/[\w-][\w.-]*|[\w-][\w.-]*")  # the Hub's "org/name" or "name"
AT_LEAST_ONE = ("updates", "tasks_per_update", "group_size", "max_new_tokens", "max_batch_tokens", "eval_every",
                "save_every", "keep_checkpoints", "eval_tasks", "analysis_max_new_tokens", "max_prompt_tokens",
                "max_steps", "mini_batches")
AT_LEAST = {"history_window": 0, "sft_steps": 0, "sft_batch_size": 1, "warmup_steps": 0, "analysis_prompt_tokens": 1,
            "analysis_temperature": 0, "eval_temperature": 0, "weight_decay": 0, "kl_coef": 0, "entropy_coef": 0,
            "invalid_penalty": 0, "clip_low": 0, "clip_high": 0, "env_timeout": 0, "distill_coef": 0,
            "train_tasks": 0}
ABOVE_ZERO = {"temperature": "the update re-scores the samples at this temperature", "grad_clip": "",
              "gate_beta": "", "sft_lr": "", "lr": ""}


def flag(name):
    return "--" + name.replace("_", "-")


def check_config(cfg, error):
    """Call error(message) (argparse's: prints it and exits) for the first bad flag value or combination."""
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
    if cfg.task != "click-test" and cfg.env != "miniwob":
        error(f"--task is for --env miniwob; --env {cfg.env} does not read it")
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
    if cfg.data_dir is not None and cfg.env != "alfworld":
        error(f"--data-dir is for --env alfworld; --env {cfg.env} does not read it")
    if cfg.miniwob_elements and cfg.env != "miniwob":
        error(f"--miniwob-elements is for --env miniwob; --env {cfg.env} does not read it")


def check_context_window(cfg, policy):
    """The longest prompt plus response must fit the model's position table."""
    window = getattr(policy.model.config, "max_position_embeddings", None)
    for prompt, new in (("max_prompt_tokens", "max_new_tokens"), ("analysis_prompt_tokens", "analysis_max_new_tokens")):
        if window and getattr(cfg, prompt) + getattr(cfg, new) > window:
            raise ValueError(f"{flag(prompt)} {getattr(cfg, prompt)} + {flag(new)} {getattr(cfg, new)} exceed the "
                             f"model's context window of {window} tokens")


def check_out_dir(cfg, error):
    """--resume needs a checkpoint in --out-dir; a fresh run must not overwrite another run's checkpoints
    there unless told so (--overwrite)."""
    from training.checkpoints import intact_checkpoints
    found = intact_checkpoints(cfg.out_dir) if os.path.isdir(cfg.out_dir) else []
    pointer = os.path.join(cfg.out_dir, "checkpoints", "latest")
    if cfg.resume and not found and not os.path.exists(pointer):
        error(f"--resume: {cfg.out_dir} holds no checkpoint to continue (start without --resume)")
    if found and not cfg.resume and not cfg.overwrite and cfg.stage != "sft":
        error(f"--out-dir {cfg.out_dir} holds another run's checkpoints ({os.path.basename(found[-1])}); "
              "continue it with --resume, start over with --overwrite, or choose another --out-dir")
