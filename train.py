"""train.py: SEED training -- config at the top, then one flat loop, nanoGPT style.

    python train.py                              # the embedded default: tiny model, household env
    python train.py --algo grpo                  # the baseline: no analysis, lambda = 0
    python train.py --env alfworld --model Qwen/Qwen2.5-1.5B-Instruct   # real ALFWorld, one GPU
    torchrun --standalone --nproc_per_node=4 train.py --env alfworld --model ...   # data parallel

--stage all (default) = the tiny model's warm-up (warmup/) or a Hugging Face model's stage-1
analyzer SFT, then RL; sft = stage 1 only; rl = RL only. Each RL update runs the phases eval,
rollout, analyze, re-score, advantage, update, log, save. Checkpoints are atomic; --resume
continues a killed run exactly (training/checkpoints.py). A bad flag is one `error:` line.

Departures from the paper: stage-1 skills come from a rule-based annotator (warmup/annotator.py)
or a user's JSONL, not a strong LLM; the tiny model needs a warm-up; the tiny preset's lambda and
KL (0.1 each) are larger than the paper's (README, departures).
"""
import argparse
import json
import os
import random
import sys
import time

import torch

import envs
import seed
from models.policy import load_policy
from training import checkpoints, distributed, logs
from training.flags import check_config, check_context_window

# defaults that depend on the model: the tiny one learns from scratch on a CPU (README, departures),
# a Hugging Face one is pretrained and takes the paper's / OPID's values
PRESETS = {
    "tiny": dict(lr=1e-4, distill_coef=0.1, kl_coef=0.1, advantage_norm="batch", mini_batches=4,
                 eval_temperature=0.0, analysis_prompt_tokens=1024, analysis_max_new_tokens=96),
    "hf": dict(lr=1e-6, distill_coef=1e-3, kl_coef=0.0, advantage_norm="group", mini_batches=1,
               eval_temperature=0.4, analysis_prompt_tokens=28672, analysis_max_new_tokens=4096)}
# the tiny VLM on --env vision drifted at 1e-4, and at 3e-5 GRPO lost 0.035 valid_seen in 640 episodes with its
# vision tower training, gained 0.011 with it frozen (3 seeds each; docs/vision.md)
PRESETS["tiny-vision"] = {**PRESETS["tiny"], "lr": 3e-5, "vision_lr_scale": 0.0}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default."""


def get_config(argv=None, check=True):
    early = argparse.ArgumentParser(add_help=False)  # the model and env decide some defaults
    early.add_argument("--model", default="tiny")
    early.add_argument("--env", default="household")
    known, _ = early.parse_known_args(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)

    def add(flag, default, help, **kwargs):  # the type follows the default (None: str)
        if "action" not in kwargs:
            number = isinstance(default, (int, float)) and not isinstance(default, bool)
            kwargs.setdefault("type", type(default) if number else str)
        p.add_argument(flag, default=default, help=help, **kwargs)

    # what to run
    add("--stage", "all", "all = warm-up or stage 1, then RL", choices=["all", "sft", "rl"])
    add("--algo", "seed", "seed = GRPO + self-analysis distillation", choices=["seed", "grpo"])
    add("--env", "household", "environment (envs.py lists them)", choices=envs.ENV_NAMES)
    add("--task", "click-test", "--env miniwob: the MiniWoB task, e.g. click-button")
    add("--miniwob-elements", False, "--env miniwob: list the page's elements", action="store_true")
    add("--data-dir", None, "ALFWorld data (else $ALFWORLD_DATA, else synthetic games)")
    add("--model", "tiny", "'tiny' (built offline) or a Hugging Face model name or folder")
    add("--out-dir", "out", "checkpoints, metrics.jsonl, eval.jsonl and config.json")
    add("--resume", False, "continue from the latest checkpoint in --out-dir", action="store_true")
    add("--overwrite", False, "start over in an --out-dir that holds a run", action="store_true")
    add("--seed", 0, "seeds task sampling, generation and initialisation")
    add("--device", None, "cpu or cuda (None: cuda if available)")
    add("--dtype", None, "float32 or bfloat16 (None: bf16 on CUDA, fp32 on CPU)")
    add("--gradient-checkpointing", False, "trade compute for memory", action="store_true")
    # rollouts
    add("--updates", 5, "RL policy updates (paper: 150)")
    add("--tasks-per-update", 8, "N tasks per update (paper: 16)")
    add("--group-size", 4, "G rollouts per task, the GRPO group (paper: 8)")
    add("--train-tasks", 0, "draw tasks from train tasks 0..K-1 (0: fresh ones every update)")
    add("--max-steps", envs.DEFAULT_MAX_STEPS.get(known.env, 20), "env steps per episode")
    add("--history-window", 3, "past (observation, action) pairs shown (paper: 5)")
    add("--temperature", 1.0, "sampling and re-scoring temperature")
    add("--max-new-tokens", 48, "response tokens per step (paper: 512)")
    add("--max-prompt-tokens", 2048, "prompt tokens (longer prompts keep their end)")
    add("--invalid-penalty", 0.1, "score penalty for a response without <action>")
    add("--env-timeout", 120.0, "seconds an env call may take (0 = no limit)")
    # self-analysis
    add("--analysis-temperature", 0.0, "analyzer temperature, 0 = greedy")
    add("--analysis-max-new-tokens", 0, "analyzer output tokens (OPID: up to 4096)")
    add("--analysis-prompt-tokens", 0, "analyzer prompt budget (OPID: the whole trajectory)")
    # loss
    add("--distill-coef", 0.0, "lambda, the weight of delta (paper/OPID: 1e-3)")
    add("--distill-mode", "advantage", "how delta enters", choices=["advantage", "loss", "gated"])
    add("--gate-beta", 5.0, "sharpness of the gate in --distill-mode gated")
    add("--kl-coef", 0.0, "k3 KL to the start model (paper 0.01; needs a 2nd model)")
    add("--entropy-coef", 0.0, "entropy bonus (paper 0.001)")
    add("--clip-low", 0.2, "PPO clip below 1")
    add("--clip-high", 0.2, "PPO clip above 1")
    add("--dual-clip", 3.0, "dual-clip bound for negative advantages")
    add("--agg", "token-mean", "loss aggregation",
        choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
    # optimisation
    add("--lr", 0.0, "learning rate (paper: 1e-6)")
    add("--advantage-norm", "group", "GRPO scale: group std (paper), batch std (all-failed groups "
        "stay ~0), none (Dr. GRPO)", choices=["group", "batch", "none"])
    add("--mini-batches", 1, "optimizer steps per update, on random parts of the rows")
    add("--grpo-stats", "steps", "GRPO group mean/std over every step row (verl-agent) or over "
        "the episodes' scores (the rule before)", choices=["steps", "trajectories"])
    add("--vision-lr-scale", 1.0, "a VLM's vision tower trains at --lr times this")
    add("--weight-decay", 0.0, "AdamW weight decay")
    add("--grad-clip", 1.0, "max gradient norm")
    add("--layout", "padded", "batch layout for scoring", choices=["padded", "packed"])
    add("--max-batch-tokens", 16384, "micro-batch size in tokens")
    # stage 1 and warm-up
    add("--sft-data", None, "stage-1 JSONL of {prompt, completion} (None: annotate)")
    add("--sft-steps", 100, "stage-1 optimizer steps")
    add("--sft-batch-size", 16, "stage-1 examples per step")
    add("--sft-lr", 1e-5, "stage-1 learning rate (HF models)")
    add("--warmup-steps", 1000, "tiny-model warm-up steps (cached per config)")
    add("--warmup-seed", 0, "seed of the tiny warm-up (shared by runs)")
    add("--cache-dir", "cache", "where the warm-started tiny model is cached")
    add("--build-warm-start", False, "build the tiny warm-up (or reuse --cache-dir's), not the one "
        "shipped in warm_starts/", action="store_true")
    # evaluation, logging, checkpoints
    add("--eval-every", 5, "evaluate every K updates (and at start and end)")
    add("--eval-tasks", 48, "tasks per evaluation split")
    add("--eval-temperature", 0.0, "evaluation temperature, 0 = greedy (OPID: 0.4)")
    add("--save-every", 5, "checkpoint every K updates (and at the end)")
    add("--keep-checkpoints", 2, "how many recent checkpoints to keep")
    p.set_defaults(**PRESETS["hf" if known.model != "tiny" else "tiny-vision" if known.env == "vision" else "tiny"])
    cfg = p.parse_args(argv)
    if check:
        check_config(cfg, p.error)
    return cfg


def evaluate(policy, cfg, split, env_list, rank=0, world=1, env_factory=None):
    """One rollout (greedy by default) on each of the first --eval-tasks tasks of a split -> success
    micro (over episodes), macro (over task types) and per type (training/logs.py); under torchrun
    each rank plays every world-th task and the episodes are gathered."""
    tasks = list(range(rank, cfg.eval_tasks, world))
    generator = torch.Generator(policy.device).manual_seed(cfg.seed)  # not the training RNG
    trajectories = seed.rollout(policy, env_list, tasks, 1, cfg.max_steps, cfg.max_new_tokens,
                                cfg.eval_temperature, cfg.history_window, cfg.invalid_penalty,
                                cfg.max_prompt_tokens, env_name=cfg.env, desc=f"eval {split}",
                                generator=generator, env_factory=env_factory,
                                env_timeout=cfg.env_timeout)
    dropped = logs.report_dropped(trajectories, f"eval {split}")
    shares = distributed.gather((logs.episode_outcomes(trajectories), dropped), world)
    result = logs.success_table([e for share, _ in shares for e in share], split,
                                dropped=sum(count for _, count in shares))
    result["temperature"] = cfg.eval_temperature
    if cfg.env == "household":  # how far the warm-up's planted skip habit is unlearned
        from warmup import warm_start
        decisions = warm_start.habit_decisions(split, cfg.eval_tasks, cfg.history_window,
                                               cfg.max_steps)
        result["habit_unlearned"] = warm_start.habit_probe(policy, decisions, cfg.temperature)
    return result


def main(cfg):
    rank, world = distributed.init(cfg)
    master = rank == 0  # logs, checkpoints and prints come from rank 0 only
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if master:  # what differs from the defaults of the model's preset (config.json: everything)
        defaults = vars(get_config(["--model", cfg.model, "--env", cfg.env], check=False))
        changed = [f"--{k.replace('_', '-')} {v}" for k, v in vars(cfg).items()
                   if defaults.get(k) != v]
        print("config:", " ".join(changed) or "the defaults")
    with distributed.rank_zero_first(world, rank):  # rank 0 writes synthetic games, the start model
        options = envs.env_options(cfg.env, cfg.max_steps, cfg.data_dir, cfg.out_dir, cfg.seed,
                                   cfg.task, cfg.miniwob_elements)
        checkpoint = checkpoints.latest_checkpoint(cfg.out_dir) if cfg.resume else None
        from warmup.warm_start import parameter_groups, start_model  # start_model: KL reference too
        start_path = start_model(cfg, options) if not checkpoint or cfg.kl_coef > 0 else None
    if cfg.stage == "sft":
        if master:
            checkpoints.start_run_folder(cfg, resumed=False)
            print(f"stage 1 done: the model is in {start_path}")
        return distributed.finish(world)
    policy, state = checkpoints.load_checkpoint_policy(checkpoint, cfg) if checkpoint else \
        (load_policy(start_path, cfg.device, cfg.dtype, cfg.gradient_checkpointing), None)
    check_context_window(cfg, policy)
    if master:  # the start worked: only now is the out dir written (--overwrite: the old run goes)
        checkpoints.start_run_folder(cfg, resumed=checkpoint is not None)
    optimizer = torch.optim.AdamW(parameter_groups(policy.model, cfg.lr, cfg.vision_lr_scale),
                                  lr=cfg.lr, weight_decay=cfg.weight_decay)
    reference = None  # the frozen start model, for the k3 KL term
    if cfg.kl_coef > 0:
        reference = load_policy(start_path, cfg.device, cfg.dtype).model.eval()
    # seeded again: building the warm-up draws from the RNG, reading it from the cache does not
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed + rank)  # torchrun: each rank its own stream (nanoGPT's seed offset)
    start = checkpoints.restore_trainer_state(state, optimizer) if state else 0

    share = cfg.tasks_per_update // world  # tasks per rank; a task's GRPO group stays on its rank
    n_envs = share * cfg.group_size
    # factories rebuild an env that raised or hung; reset(seed) makes it play the same task again
    train_factory = lambda i: envs.make_env(cfg.env, "train", cfg.seed + rank * n_envs + i,
                                            **options)
    eval_factories = {split: lambda i, split=split: envs.make_env(cfg.env, split, rank + i * world,
                                                                  **options)
                      for split in ("valid_seen", "valid_unseen")}
    train_envs = [train_factory(i) for i in range(n_envs)]
    eval_envs = {split: [factory(i) for i in range(len(range(rank, cfg.eval_tasks, world)))]
                 for split, factory in eval_factories.items()}
    loss_kwargs = dict(distill_coef=cfg.distill_coef if cfg.algo == "seed" else 0.0,
                       distill_mode=cfg.distill_mode, gate_beta=cfg.gate_beta, kl_coef=cfg.kl_coef,
                       entropy_coef=cfg.entropy_coef, clip_low=cfg.clip_low,
                       clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, agg=cfg.agg)
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    eval_path = os.path.join(cfg.out_dir, "eval.jsonl")
    eval_rows = []
    if master:  # lines past the checkpoint (a killed run's last update, a torn line) go
        logs.trim_log(metrics_path, lambda r: r.get("update", 0) <= start,
                      f"past update {start}, where this run starts")
        eval_rows = logs.trim_log(eval_path, lambda r: r.get("update", 0) < start,
                                  f"from update {start} on (redone)")

    for update in range(start, cfg.updates + 1):
        # ---- eval: at update 0, every --eval-every updates and at the end
        if update == 0 or update % cfg.eval_every == 0 or update == cfg.updates:
            for split, split_envs in eval_envs.items():
                result = evaluate(policy, cfg, split, split_envs, rank, world,
                                  eval_factories[split])
                eval_rows.append({**result, "when": f"update {update}", "update": update})
                if master:
                    logs.save_metrics_line(eval_path, eval_rows[-1])
            if master:
                logs.print_eval_table(eval_rows[-2:])
        if update == cfg.updates:
            break
        t0 = time.time()
        times = {}

        # ---- rollout: N tasks x G rollouts with the ordinary prompt and the pre-update weights;
        # the tasks come from a generator of (seed, update), so a resumed run samples the same ones
        stream = cfg.seed * 1_000_003 + update
        task_seeds = random.Random(stream).sample(range(cfg.train_tasks or 10 ** 6), cfg.tasks_per_update)
        generator = distributed.rank_generator(stream, rank, world, policy.device)
        trajectories = seed.rollout(policy, train_envs, task_seeds[rank * share:(rank + 1) * share],
                                    cfg.group_size, cfg.max_steps, cfg.max_new_tokens,
                                    cfg.temperature, cfg.history_window, cfg.invalid_penalty,
                                    cfg.max_prompt_tokens, env_name=cfg.env, generator=generator,
                                    env_factory=train_factory, env_timeout=cfg.env_timeout)
        dropped = logs.report_dropped(trajectories, f"update {update + 1}")
        trajectories = [t for t in trajectories if not t.get("dropped")]  # a shorter group is fine
        times["rollout"] = time.time() - t0

        # ---- analyze: the same weights write one hindsight skill per trajectory (SEED only)
        t1 = time.time()
        skill_list = None
        if cfg.algo == "seed":
            skill_list, _ = seed.analyze(policy, trajectories, cfg.analysis_prompt_tokens,
                                         cfg.analysis_max_new_tokens, cfg.analysis_temperature)
        times["analyze"] = time.time() - t1

        # ---- re-score: teacher (and reference) log-probs of the same sampled tokens; no student
        # pass: log pi_old is the update's own forward or what sampling recorded (seed.ppo_update)
        t2 = time.time()
        rows = seed.step_rows(trajectories, skill_list)
        _, teacher_logp, ref_logp, has_teacher = seed.rescore(policy, rows, cfg.temperature,
                                                              cfg.layout, cfg.max_batch_tokens,
                                                              reference, need_old=False)
        times["rescore"] = time.time() - t2

        # ---- advantage: GRPO per task group for every step row (delta joins inside the loss)
        advantages = seed.step_advantages(trajectories, rows, cfg.advantage_norm,
                                          cfg.grpo_stats)  # (B,) one per step row

        # ---- update: PPO-clip + SEED in --mini-batches optimizer steps
        t3 = time.time()
        rows_here = len(rows["prompts"])  # torchrun: every rank takes the same number of steps
        mini_batches = distributed.fewest(cfg.mini_batches, rows_here, world, policy.device)
        teacher_logp = teacher_logp if cfg.algo == "seed" else None
        metrics, skipped = seed.ppo_update(
            policy, optimizer, rows, advantages, teacher_logp, ref_logp, has_teacher, mini_batches,
            loss_kwargs=loss_kwargs, temperature=cfg.temperature, layout=cfg.layout,
            max_batch_tokens=cfg.max_batch_tokens, grad_clip=cfg.grad_clip,
            sync=distributed.GradientSync() if world > 1 else None)
        times["update"] = time.time() - t3

        # ---- log: success, reward, delta and analyzer parse failures (torchrun: summed over ranks)
        record = logs.update_record(update + 1, trajectories, rows, skill_list, dropped, skipped,
                                    metrics, times, time.time() - t0, world, policy.device)
        if not master:
            continue
        logs.save_metrics_line(metrics_path, record)
        logs.print_update_line(record, cfg.updates)
        logs.warn_once(record, cfg.mini_batches, cfg.max_prompt_tokens)

        # ---- save
        if (update + 1) % cfg.save_every == 0 or update + 1 == cfg.updates:
            checkpoints.save_checkpoint(cfg, policy, optimizer, update + 1)

    distributed.finish(world)
    if not master:
        return None
    summary = {"eval": eval_rows, "out_dir": cfg.out_dir}
    with open(os.path.join(cfg.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("final evaluation (success rate):")
    first_and_last = (eval_rows[0]["update"], eval_rows[-1]["update"])
    logs.print_eval_table([r for r in eval_rows if r["update"] in first_and_last])
    logs.print_self_analysis(metrics_path)
    return summary


if __name__ == "__main__":
    config = get_config()
    try:
        main(config)
    except KeyboardInterrupt:
        sys.exit(checkpoints.interrupted(config))
    except (ValueError, OSError, RuntimeError, ImportError) as error:
        if os.environ.get("SEED_DEBUG"):
            raise
        sys.exit(f"error: {error}\n(set SEED_DEBUG=1 for the traceback)")
