"""
train.py: the SEED training script -- one flat loop, nanoGPT style.

    python train.py                                   # embedded default: tiny model, household env, CPU
    python train.py --algo grpo                       # the baseline: same loop, no analysis, lambda = 0
    python train.py --env alfworld --model Qwen/Qwen2.5-1.5B-Instruct   # real ALFWorld on a GPU
    torchrun --standalone --nproc_per_node=4 train.py --env alfworld --model ...   # data parallel, 4 GPUs
    python train.py --env vision                      # tiny Qwen2-VL on the embedded screenshot env, CPU
    python train.py --env miniwob --task click-button --model Qwen/Qwen2.5-VL-3B-Instruct   # real MiniWoB++

Stages (--stage): `all` (default) = warm-up of the tiny model when --model tiny, stage 1 (analyzer SFT on
hindsight skills), stage 2 (RL); `sft` = stage 1 only; `rl` = stage 2 only. Each RL update has the phases
eval, rollout, analyze, re-score, advantage, loss/backward, log, step, save.

Data parallel (torchrun): each rank rolls out, analyzes and re-scores its share of the update's tasks (a GRPO
group never leaves its rank), gradients and metrics are summed over ranks with every rank's loss normalised by
the whole update's token count, so the step equals the single-process step on the same rollouts; evaluation
is sharded over ranks; rank 0 alone builds the start model, writes logs and checkpoints. NCCL on GPUs, gloo
on CPU.

Reliability: checkpoints are atomic and --resume continues a killed run exactly (its logs trimmed to the
checkpoint); an env that raises or hangs past --env-timeout is rebuilt and its trajectory dropped; a non-finite
update is skipped with its cause; bad flags, checkpoints and data are one `error:` line (README, Reliability).

Departures from the paper: stage-1 skills come from skills.annotate (a rule-based hindsight annotator
reading the env's ground truth) or a user's JSONL instead of a strong LLM; the tiny model needs a
warm-up that a pretrained instruct model does not (warmup.py).
"""
import argparse
import contextlib
import datetime
import json
import math
import os
import random
import sys
import time

import torch

import seed
import warmup
from checkpoints import kill_point, latest_checkpoint, read_trainer_state, save_checkpoint, trim_log


def get_config(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    # what to run
    add("--stage", default="all", choices=["all", "sft", "rl"], help="all = warm-up (tiny) + stage 1 + stage 2")
    add("--algo", default="seed", choices=["seed", "grpo"], help="seed = GRPO + self-analysis distillation")
    add("--env", default="household",
        help="household (embedded), alfworld (real engine), webshop ($WEBSHOP_URL, else the offline mini shop), "
             "vision (embedded screenshots, VLM policy) or miniwob (real MiniWoB++ in headless Chromium)")
    add("--task", default="click-test", help="--env miniwob: the MiniWoB task, e.g. click-button, enter-text")
    add("--miniwob-elements", action="store_true",
        help="--env miniwob: list the page's elements in the observation text and as admissible clicks")
    add("--data-dir", default=None, help="ALFWorld data folder (default $ALFWORLD_DATA, else synthetic games)")
    add("--model", default="tiny", help="'tiny' (built offline) or a Hugging Face model name or folder")
    add("--out-dir", default="out", help="checkpoints, metrics.jsonl, eval.jsonl and config.json go here")
    add("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
    add("--seed", type=int, default=0, help="seeds task sampling, generation and initialisation")
    add("--device", default=None, help="cpu or cuda (default: cuda if available)")
    add("--dtype", default=None, help="float32 or bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    add("--gradient-checkpointing", action="store_true", help="trade compute for activation memory")
    # rollouts
    add("--updates", type=int, default=10, help="number of RL policy updates (paper: 150)")
    add("--tasks-per-update", type=int, default=8, help="N tasks per update (paper: 16)")
    add("--group-size", type=int, default=4, help="G rollouts per task, the GRPO group (paper: 8)")
    add("--max-steps", type=int, default=None, help="env steps per episode (default: env's own, ALFWorld 30)")
    add("--history-window", type=int, default=3, help="past (observation, action) pairs in the prompt (paper: 5)")
    add("--temperature", type=float, default=1.0, help="sampling temperature of rollouts and of re-scoring")
    add("--max-new-tokens", type=int, default=48, help="response token limit per step (paper: 512)")
    add("--max-prompt-tokens", type=int, default=2048, help="prompt token limit (longer prompts keep their end)")
    add("--invalid-penalty", type=float, default=0.1, help="score penalty for a response without <action>")
    add("--env-timeout", type=float, default=120.0,
        help="seconds an env reset/step may take; past it (or on an exception) the env is rebuilt and that "
             "trajectory dropped from its group, logged (0 = no limit)")
    # self-analysis
    add("--analysis-temperature", type=float, default=0.0, help="analyzer sampling temperature, 0 = greedy")
    add("--analysis-max-new-tokens", type=int, default=96, help="analyzer output token limit")
    add("--analysis-prompt-tokens", type=int, default=1024, help="analyzer prompt token budget")
    # loss
    add("--distill-coef", type=float, default=None,
        help="lambda: weight of delta (default: paper/OPID 1e-3 for HF models, 0.1 for tiny)")
    add("--distill-mode", default="advantage", choices=["advantage", "loss", "gated"], help="how delta enters")
    add("--gate-beta", type=float, default=5.0, help="sharpness of the gate in --distill-mode gated")
    add("--kl-coef", type=float, default=None,
        help="k3 KL to the initial policy (paper 0.01; needs a 2nd model; default 0.1 for tiny, 0 for HF models)")
    add("--entropy-coef", type=float, default=0.0, help="entropy bonus (paper 0.001)")
    add("--clip-low", type=float, default=0.2, help="PPO clip below 1")
    add("--clip-high", type=float, default=0.2, help="PPO clip above 1")
    add("--dual-clip", type=float, default=3.0, help="dual-clip bound for negative advantages")
    add("--agg", default="token-mean", choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"],
        help="loss aggregation")
    # optimisation
    add("--lr", type=float, default=None, help="learning rate (default: 1e-6 for HF models, 1e-4 for tiny)")
    add("--advantage-norm", default=None, choices=["group", "batch", "none"],
        help="GRPO advantage scale: group std (paper), batch std (default for tiny: all-failed groups stay ~0), "
             "none (Dr. GRPO); default group for HF models")
    add("--mini-batches", type=int, default=None,
        help="optimizer steps per update, each on a random part of the rows (verl's PPO mini-batches; "
             "default 4 for tiny, 1 for HF models)")
    add("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    add("--grad-clip", type=float, default=1.0, help="max gradient norm")
    add("--layout", default="padded", choices=["padded", "packed"], help="batch layout for scoring/training")
    add("--max-batch-tokens", type=int, default=16384, help="micro-batch size in tokens (gradient accumulation)")
    # stage 1 and warm-up
    add("--sft-data", default=None, help="stage-1 JSONL of {prompt, completion} (default: annotate expert runs)")
    add("--sft-steps", type=int, default=100, help="stage-1 optimizer steps")
    add("--sft-batch-size", type=int, default=16, help="stage-1 examples per step")
    add("--sft-lr", type=float, default=1e-5, help="stage-1 learning rate (HF models)")
    add("--warmup-steps", type=int, default=1000, help="tiny-model warm-up optimizer steps (cached per config)")
    add("--warmup-seed", type=int, default=0, help="seed of the tiny warm-up (runs with different --seed share it)")
    add("--cache-dir", default="cache", help="where the warm-started tiny model is cached")
    # evaluation, logging, checkpoints
    add("--eval-every", type=int, default=5, help="evaluate every K updates (and at start and end)")
    add("--eval-tasks", type=int, default=48, help="tasks per evaluation split")
    add("--eval-temperature", type=float, default=0.0, help="evaluation sampling temperature, 0 = greedy")
    add("--save-every", type=int, default=5, help="checkpoint every K updates (and at the end)")
    add("--keep-checkpoints", type=int, default=2, help="how many recent checkpoints to keep")
    cfg = p.parse_args(argv)
    for name in ["updates", "tasks_per_update", "group_size", "max_new_tokens", "max_batch_tokens", "eval_every",
                 "save_every", "keep_checkpoints", "eval_tasks", "analysis_max_new_tokens", "max_prompt_tokens"]:
        if getattr(cfg, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.group_size < 2:  # both algos: a group of one has GRPO advantage 0, so nothing would be learned
        p.error("--group-size must be at least 2: GRPO needs a group to compare rollouts")
    world = int(os.environ.get("WORLD_SIZE", 1))  # set by torchrun
    if cfg.tasks_per_update % world:
        p.error(f"--tasks-per-update {cfg.tasks_per_update} must divide by the {world} torchrun processes")
    if cfg.max_steps is not None and cfg.max_steps < 1:
        p.error(f"--max-steps must be at least 1, got {cfg.max_steps}")
    check_config(cfg, p.error)
    if cfg.lr is None:
        cfg.lr = 1e-4 if cfg.model == "tiny" else 1e-6
    if cfg.advantage_norm is None:
        cfg.advantage_norm = "batch" if cfg.model == "tiny" else "group"
    if cfg.mini_batches is None:
        cfg.mini_batches = 4 if cfg.model == "tiny" else 1
    if cfg.mini_batches < 1:
        p.error(f"--mini-batches must be at least 1, got {cfg.mini_batches}")
    if cfg.distill_coef is None:  # tiny: 1e-3 x delta (mean |delta| 0.02) is invisible next to O(1) advantages;
        # measured, 0.1 is still too small to change the result and 1.0 collapses the policy (README experiment)
        cfg.distill_coef = 0.1 if cfg.model == "tiny" else 1e-3
    if cfg.kl_coef is None:  # tiny: without it, unlearning the warm-up's habit also unlearns pick_and_place
        # (README experiment: greedy valid_seen 0.250 -> 0.26-0.27 at 0, 0.32-0.33 at 0.1, 3 seeds each)
        cfg.kl_coef = 0.1 if cfg.model == "tiny" else 0.0
    return cfg


def check_config(cfg, error):
    """Reject values and combinations that would fail later or be silently ignored: error(message) once."""
    for name, value in vars(cfg).items():
        if isinstance(value, float) and not math.isfinite(value):
            error(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    at_least = {"history_window": 0, "sft_steps": 0, "sft_batch_size": 1, "warmup_steps": 0,
                "analysis_prompt_tokens": 1, "analysis_temperature": 0, "eval_temperature": 0, "weight_decay": 0,
                "kl_coef": 0, "entropy_coef": 0, "invalid_penalty": 0, "clip_low": 0, "clip_high": 0,
                "env_timeout": 0, "distill_coef": 0}
    above = {"temperature": "the update re-scores the samples at this temperature", "grad_clip": "",
             "gate_beta": "", "sft_lr": "", "lr": ""}
    for name, low in at_least.items():
        if getattr(cfg, name) is not None and getattr(cfg, name) < low:
            error(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(cfg, name)}")
    for name, why in above.items():
        if getattr(cfg, name) is not None and getattr(cfg, name) <= 0:
            error(f"--{name.replace('_', '-')} must be above 0, got {getattr(cfg, name)}" + (f" ({why})" if why else ""))
    if cfg.clip_low >= 1:
        error(f"--clip-low must be below 1 (the ratio is clipped to 1 - clip-low), got {cfg.clip_low}")
    if cfg.dual_clip <= 1:
        error(f"--dual-clip must be above 1, got {cfg.dual_clip}")
    if cfg.dtype is not None and cfg.dtype not in ("float32", "bfloat16", "float16"):
        error(f"--dtype must be float32, bfloat16 or float16, got {cfg.dtype!r}")
    if cfg.device is not None:
        try:
            device = torch.device(cfg.device)
        except RuntimeError:
            error(f"--device must be cpu, cuda or cuda:N, got {cfg.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            error(f"--device {cfg.device}: this torch sees no CUDA device")
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


# ----------------------------------------------------------------------------- evaluation

def evaluate(policy, cfg, split, envs, rank=0, world=1, env_factory=None):
    """Greedy (by default) single rollouts on the first --eval-tasks tasks of a split; success overall
    (micro over episodes, macro over task types) and per task type; episodes whose env failed are left out
    (counted in 'dropped'). Under torchrun each rank plays every world-th task (envs holds that rank's envs)
    and the episodes are gathered on every rank."""
    trajectories = seed.rollout(policy, envs, list(range(rank, cfg.eval_tasks, world)), 1, cfg.max_steps,
                                cfg.max_new_tokens, cfg.eval_temperature, cfg.history_window, cfg.invalid_penalty,
                                cfg.max_prompt_tokens, env_name=cfg.env, desc=f"eval {split}",
                                generator=torch.Generator(policy.device).manual_seed(cfg.seed),
                                env_factory=env_factory, env_timeout=cfg.env_timeout)
    dropped = report_dropped(trajectories, f"eval {split}")
    episodes = [(t["task_type"], float(t["won"]), len(t["steps"]), sum(not s["valid"] for s in t["steps"]))
                for t in trajectories if not t.get("dropped")]
    if world > 1:
        shares = [None] * world
        torch.distributed.all_gather_object(shares, (episodes, dropped))
        episodes = [episode for share, _ in shares for episode in share]
        dropped = sum(count for _, count in shares)
    per_type = {}
    for task_type, won, _, _ in episodes:
        per_type.setdefault(task_type, []).append(won)
    by_type = {k: sum(v) / len(v) for k, v in sorted(per_type.items())}
    steps, n = sum(e[2] for e in episodes), max(1, len(episodes))  # n: every env failing gives zeros, not a crash
    result = {"split": split, "micro": sum(e[1] for e in episodes) / n,
              "macro": sum(by_type.values()) / max(1, len(by_type)), "per_type": by_type,
              "steps": steps / n, "invalid_share": sum(e[3] for e in episodes) / max(1, steps), "dropped": dropped}
    if cfg.env == "household":  # how far the warm-up's skip habit is unlearned (warmup.habit_probe)
        decisions = warmup.habit_decisions(split, cfg.eval_tasks, cfg.history_window, cfg.max_steps or 20)
        result["habit_unlearned"] = warmup.habit_probe(policy, decisions, cfg.temperature)
    return result


def report_dropped(trajectories, where):
    """Print why each dropped trajectory (an env that raised or hung) was dropped; return how many."""
    reasons = [t["dropped"] for t in trajectories if t.get("dropped")]
    for reason in reasons:
        print(f"{where}: dropped a trajectory, env rebuilt: {reason}")
    return len(reasons)


def print_eval_table(rows):
    types = sorted({k for r in rows for k in r["per_type"]})
    print(f"{'when':>10} {'split':>13} {'micro':>6} {'macro':>6} {'invalid':>7} {'habit':>6} "
          + " ".join(f"{t[:12]:>12}" for t in types))
    for r in rows:
        print(f"{r['when']:>10} {r['split']:>13} {r['micro']:6.3f} {r['macro']:6.3f} {r.get('invalid_share', 0):7.3f} "
              f"{r.get('habit_unlearned', float('nan')):6.3f} "
              + " ".join(f"{r['per_type'].get(t, float('nan')):12.3f}" for t in types))


def check_context_window(cfg, policy):
    """The longest prompt plus response must fit the model's position table."""
    window = getattr(policy.model.config, "max_position_embeddings", None)
    for prompt, new in (("max_prompt_tokens", "max_new_tokens"), ("analysis_prompt_tokens", "analysis_max_new_tokens")):
        if window and getattr(cfg, prompt) + getattr(cfg, new) > window:
            raise ValueError(f"--{prompt.replace('_', '-')} {getattr(cfg, prompt)} + --{new.replace('_', '-')} "
                             f"{getattr(cfg, new)} exceed the model's context window of {window} tokens")


# ----------------------------------------------------------------------------- data parallel (torchrun)

def init_ddp(cfg):
    """(rank, world size) of this process under torchrun, after joining the process group and picking the
    device (cuda:LOCAL_RANK, NCCL, else gloo); (0, 1) when started as a plain `python train.py`."""
    if "RANK" not in os.environ:
        return 0, 1
    local_rank = int(os.environ["LOCAL_RANK"])
    if cfg.device is None or cfg.device == "cuda":
        cfg.device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    if cfg.device.startswith("cuda"):
        torch.cuda.set_device(cfg.device)
    # the others wait at a barrier while rank 0 builds the start model (warm-up, stage 1): allow hours
    torch.distributed.init_process_group("nccl" if cfg.device.startswith("cuda") else "gloo",
                                         timeout=datetime.timedelta(hours=3))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


@contextlib.contextmanager
def rank_zero_first(world, rank):
    """Rank 0 runs the block first (it writes the shared files: synthetic games, the warm-up, the stage-1
    model); the other ranks wait, then run it and find the files ready."""
    if world > 1 and rank > 0:
        torch.distributed.barrier()
    try:
        yield
    finally:
        if world > 1 and rank == 0:
            torch.distributed.barrier()


def sum_over_ranks(counts, world, device):
    """A dict of numbers summed over all ranks (itself when world is 1); device: the policy's (NCCL needs CUDA)."""
    if world == 1:
        return counts
    values = torch.tensor(list(counts.values()), dtype=torch.float64, device=device)
    torch.distributed.all_reduce(values)
    return dict(zip(counts, values.tolist()))


# ----------------------------------------------------------------------------- main

def start_model(cfg, env_options):
    """Folder of the policy RL starts from, made on first use: the tiny model's cached warm-up (whose
    mixture includes stage 1), or an HF model after stage-1 analyzer SFT (saved in <out-dir>/sft), or the
    HF model itself for --stage rl, --algo grpo or --sft-steps 0."""
    if cfg.model == "tiny":
        return warmup.warm_start(cfg, env_options)
    if cfg.stage == "rl" or cfg.algo == "grpo" or cfg.sft_steps == 0:
        return cfg.model
    path = os.path.join(cfg.out_dir, "sft")
    if not os.path.exists(os.path.join(path, "config.json")):
        policy = seed.load_policy(cfg.model, cfg.device, cfg.dtype, cfg.gradient_checkpointing)
        warmup.stage1_sft(cfg, policy, env_options)
        policy.model.save_pretrained(path + ".tmp")
        policy.tokenizer.save_pretrained(path + ".tmp")
        os.replace(path + ".tmp", path)  # complete or absent
    return path


def main(cfg):
    import envs
    rank, world = init_ddp(cfg)
    master = rank == 0  # logs, checkpoints and prints come from rank 0 only
    os.makedirs(cfg.out_dir, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    with rank_zero_first(world, rank):
        env_options = warmup.env_options(cfg)  # resolves ALFWorld data (synthetic games if none) and max steps
        default_max_steps = env_options.pop("default_max_steps")  # always removed: make_env does not take it
        cfg.max_steps = cfg.max_steps or default_max_steps
        if master:
            print("config:", json.dumps(vars(cfg), indent=1))  # printed and saved with every default resolved
            with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
                json.dump(vars(cfg), f, indent=1)
        # ---- policy: resume, or warm-up (tiny) / load (HF), then stage 1
        checkpoint = latest_checkpoint(cfg.out_dir) if cfg.resume else None
        # (a resumed run with a KL term needs the start model too: the KL's reference)
        start_path = start_model(cfg, env_options) if not checkpoint or cfg.kl_coef > 0 else None
    if cfg.resume and checkpoint is None and master:
        print(f"--resume: no checkpoint in {cfg.out_dir}/checkpoints, starting fresh")
    if checkpoint:
        if master:
            print(f"resuming from {checkpoint}")
        state = read_trainer_state(checkpoint)
        if state["update"] > cfg.updates:
            raise ValueError(f"{checkpoint} is at update {state['update']}, past --updates {cfg.updates}")
        try:
            policy = seed.load_policy(checkpoint, cfg.device, cfg.dtype, cfg.gradient_checkpointing)
        except Exception as error:  # torn or foreign weights: say which folder, not a loader's traceback
            raise ValueError(f"checkpoint {checkpoint}: the model does not load ({type(error).__name__}: "
                             f"{(str(error).splitlines() or [''])[0][:200]})") from error
    else:
        if cfg.stage == "sft":
            if master:
                print(f"stage 1 done: the model is in {start_path}")
            if world > 1:
                torch.distributed.destroy_process_group()
            return
        policy = seed.load_policy(start_path, cfg.device, cfg.dtype, cfg.gradient_checkpointing)
    check_context_window(cfg, policy)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    reference = None
    if cfg.kl_coef > 0:  # frozen copy of the policy RL started from, for the k3 KL term; a resumed run too
        # (not its checkpoint, which would reset the KL to 0)
        reference = seed.load_policy(start_path, cfg.device, cfg.dtype).model.eval()
    # seeded again here: building the warm-up (a cache miss) draws from the RNG and reading it from the cache
    # does not, and a run must not depend on which happened
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed + rank)  # torchrun: each rank its own stream (nanoGPT's seed offset)
    start = 0
    if checkpoint:
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        start = state["update"]

    share = cfg.tasks_per_update // world  # tasks per rank; the GRPO group of a task stays on its rank
    n_envs = share * cfg.group_size
    # factories rebuild an env that raised or hung (seed.rollout); reset(seed) makes a rebuilt env play the same
    train_factory = lambda i: envs.make_env(cfg.env, "train", cfg.seed + rank * n_envs + i, **env_options)
    eval_factories = {split: lambda i, split=split: envs.make_env(cfg.env, split, rank + i * world, **env_options)
                      for split in ("valid_seen", "valid_unseen")}
    train_envs = [train_factory(i) for i in range(n_envs)]
    eval_envs = {split: [factory(i) for i in range(len(range(rank, cfg.eval_tasks, world)))]
                 for split, factory in eval_factories.items()}
    loss_kwargs = dict(distill_coef=cfg.distill_coef if cfg.algo == "seed" else 0.0, distill_mode=cfg.distill_mode,
                       gate_beta=cfg.gate_beta, kl_coef=cfg.kl_coef, entropy_coef=cfg.entropy_coef,
                       clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, agg=cfg.agg)
    metrics_path, eval_path = (os.path.join(cfg.out_dir, name) for name in ("metrics.jsonl", "eval.jsonl"))
    eval_rows = []
    if master:  # lines past the checkpoint (a killed run's last update, a torn line) go; a fresh run starts new logs
        trim_log(metrics_path, lambda r: r.get("update", 0) <= start, f"past update {start}, where this run starts")
        eval_rows = trim_log(eval_path, lambda r: r.get("update", 0) < start, f"from update {start} on (redone)")

    for update in range(start, cfg.updates + 1):
        # ---- eval: at update 0, every --eval-every updates and at the end (as a run never killed)
        if update == 0 or update % cfg.eval_every == 0 or update == cfg.updates:
            for split, split_envs in eval_envs.items():
                result = evaluate(policy, cfg, split, split_envs, rank, world, eval_factories[split])
                result.update(when=f"update {update}", update=update)
                eval_rows.append(result)
                if master:
                    seed.save_metrics_line(eval_path, result)
            if master:
                print_eval_table(eval_rows[-2:])
        if update == cfg.updates:
            break
        t0 = time.time()
        times = {}

        # ---- rollout: N tasks x G rollouts with the ordinary prompt, pre-update weights (torchrun: this rank's
        # N / world tasks, sampled from a generator of (seed, update, rank), so a resumed run samples the same)
        task_seeds = random.Random(cfg.seed * 1_000_003 + update).sample(range(10 ** 6), cfg.tasks_per_update)
        generator = (torch.Generator(policy.device).manual_seed((cfg.seed * 1_000_003 + update) * 1009 + rank)
                     if world > 1 else None)  # one process: the global RNG, as ever
        trajectories = seed.rollout(policy, train_envs, task_seeds[rank * share:(rank + 1) * share], cfg.group_size,
                                    cfg.max_steps, cfg.max_new_tokens, cfg.temperature, cfg.history_window,
                                    cfg.invalid_penalty, cfg.max_prompt_tokens, env_name=cfg.env,
                                    generator=generator, env_factory=train_factory, env_timeout=cfg.env_timeout)
        dropped = report_dropped(trajectories, f"update {update + 1}")
        trajectories = [t for t in trajectories if not t.get("dropped")]  # a shorter group; GRPO takes any size
        kill_point("rollout", update + 1)
        times["rollout"] = time.time() - t0

        # ---- analyze: the same weights write one hindsight skill per trajectory (SEED only)
        t1 = time.time()
        skill_list = None
        if cfg.algo == "seed":
            skill_list, _ = seed.analyze(policy, trajectories, cfg.analysis_prompt_tokens,
                                         cfg.analysis_max_new_tokens, cfg.analysis_temperature)
        kill_point("analyze", update + 1)
        times["analyze"] = time.time() - t1

        # ---- re-score: old / teacher / reference log-probs of the same sampled tokens
        t2 = time.time()
        rows = seed.step_rows(trajectories, skill_list)
        # (no student pass: log pi_old is the update's own forward for one mini-batch, else the log-probs that
        # sampling recorded; see seed.ppo_update)
        _, teacher_logp, ref_logp, has_teacher = seed.rescore(policy, rows, cfg.temperature, cfg.layout,
                                                                     cfg.max_batch_tokens, reference, need_old=False)
        times["rescore"] = time.time() - t2

        # ---- advantage: GRPO per task group, broadcast to every step (delta is added inside the loss)
        advantages = seed.trajectory_advantages(trajectories, cfg.advantage_norm)[rows["trajectory"]]  # (B,)

        # ---- loss/backward + step
        t3 = time.time()
        mini_batches = cfg.mini_batches
        if world > 1:  # every rank takes the same number of optimizer steps, each all-reducing its gradients
            fewest = torch.tensor(min(mini_batches, len(rows["prompts"])), device=policy.device)
            torch.distributed.all_reduce(fewest, torch.distributed.ReduceOp.MIN)
            mini_batches = int(fewest)
        metrics, skipped = seed.ppo_update(policy, optimizer, rows, advantages,
                                           teacher_logp if cfg.algo == "seed" else None, ref_logp, has_teacher,
                                           mini_batches, loss_kwargs=loss_kwargs, temperature=cfg.temperature,
                                           layout=cfg.layout, max_batch_tokens=cfg.max_batch_tokens,
                                           grad_clip=cfg.grad_clip, distributed=world > 1)
        kill_point("update", update + 1)
        times["update"] = time.time() - t3

        # ---- log (torchrun: counts summed over ranks; the loss metrics were summed in policy_update)
        steps = [s for t in trajectories for s in t["steps"]]
        counts = sum_over_ranks({"won": sum(t["won"] for t in trajectories), "trajectories": len(trajectories),
                                 "reward": sum(t["reward"] for t in trajectories), "steps": len(steps),
                                 "rows": len(rows["prompts"]), "invalid": sum(not s["valid"] for s in steps),
                                 "truncated": sum(s.get("truncated", False) for s in steps), "dropped": dropped,
                                 "parse_fail": sum(s is None for s in skill_list or [])}, world, policy.device)
        episodes = max(1, counts["trajectories"])  # every trajectory dropped: zeros, and the update says SKIPPED
        record = {"update": update + 1, "success": counts["won"] / episodes, "reward": counts["reward"] / episodes,
                  "steps": counts["steps"] / episodes, "rows": int(counts["rows"]), "skipped": skipped,
                  "dropped": int(counts["dropped"]), "invalid_steps": int(counts["invalid"]),
                  "invalid_share": counts["invalid"] / max(1, counts["rows"]),
                  "truncated_rows": int(counts["truncated"]),
                  "parse_failures": int(counts["parse_fail"]) if skill_list is not None else None,
                  "parse_fail": counts["parse_fail"] / episodes if skill_list is not None else None,
                  "time": time.time() - t0, **{f"time_{k}": v for k, v in times.items()}, **metrics}
        if not master:
            continue
        seed.save_metrics_line(metrics_path, record)
        kill_point("log", update + 1)
        parse = "-" if record["parse_fail"] is None else f"{record['parse_fail']:.2f}"
        print(f"update {update + 1}/{cfg.updates} | success {record['success']:.2f} | reward {record['reward']:.2f} "
              f"| delta_abs {metrics.get('delta_abs_mean', 0):.4f} | parse_fail {parse} | kl {metrics.get('kl', 0):.4f} "
              f"| pg_loss {metrics.get('pg_loss', 0):+.4f} | {record['time']:.1f}s"
              + (f" | SKIPPED: {skipped}" if skipped else ""))

        # ---- save
        if (update + 1) % cfg.save_every == 0 or update + 1 == cfg.updates:
            save_checkpoint(cfg, policy, optimizer, update + 1)

    if world > 1:
        torch.distributed.destroy_process_group()
    if not master:
        return None
    summary = {"eval": eval_rows, "out_dir": cfg.out_dir}
    with open(os.path.join(cfg.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("final evaluation (success rate):")
    print_eval_table([r for r in eval_rows if r["update"] in (eval_rows[0]["update"], eval_rows[-1]["update"])])
    print_self_analysis(metrics_path)
    return summary


def print_self_analysis(metrics_path):
    """One line on the self-analysis over the run (SEED): parse failures and delta per sampled token."""
    if not os.path.exists(metrics_path):
        return
    with open(metrics_path) as f:
        records = [r for r in map(json.loads, f) if r.get("parse_fail") is not None]
    if not records:
        return
    mean = lambda key: sum(r.get(key, 0.0) for r in records) / len(records)
    print(f"self-analysis over updates {records[0]['update']}-{records[-1]['update']}: parse failures "
          f"{records[0]['parse_fail']:.2f} -> {records[-1]['parse_fail']:.2f} (mean {mean('parse_fail'):.2f}); "
          f"delta per sampled token: mean |delta| {mean('delta_abs_mean'):.4f}, mean {mean('delta_mean'):+.4f}, "
          f"share > 0 {mean('delta_pos_share'):.2f}; tokens with a teacher {mean('teacher_token_share'):.2f}")


if __name__ == "__main__":
    config = get_config()
    try:
        main(config)
    except KeyboardInterrupt:
        sys.exit("interrupted: the last checkpoint in --out-dir is intact; continue with --resume")
    except (ValueError, OSError, RuntimeError, ImportError) as error:
        if os.environ.get("SEED_DEBUG"):
            raise
        sys.exit(f"error: {error}\n(set SEED_DEBUG=1 for the traceback)")
