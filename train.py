"""train.py: SEED training -- config at the top, then one flat loop, nanoGPT style.

    python train.py                              # the embedded default: tiny model, household env
    python train.py --algo grpo                  # the baseline: no analysis, lambda = 0
    python train.py --env alfworld --model Qwen/Qwen2.5-1.5B-Instruct   # real ALFWorld, one GPU
    torchrun --standalone --nproc_per_node=4 train.py --env alfworld --model ...   # data parallel

--stage all (default) = the tiny model's warm-up (warmup/) or a Hugging Face model's stage 1, then
RL; sft = stage 1 only; rl = RL only. Each RL update runs the phases eval, rollout, analyze,
re-score, advantage, update, log, save; --resume continues a killed run exactly. A bad flag is one
`error:` line; `--help` lists the method's flags, then the plumbing.

Departures from the paper: stage-1 skills come from the env's rule-based annotator (envs.py names
it) or a user's JSONL, not a strong LLM; the tiny model needs a warm-up; the tiny preset's
coefficients and learning rate are larger than the paper's (README, departures).
"""
import argparse
import os
import random
import sys
import time

import torch

import envs
import seed
import skills
from annotators.jsonl import read_jsonl
from evaluation.evaluate import evaluate
from evaluation.self_analysis import probe_set, probe_set_path
from models.policy import load_policy, parameter_groups, save_policy
from training import checkpoints, distributed, locks, logs
from training.analyzer import analyzer_step, centered_teacher, teacher_terms
from training.checkpoints import atomic_folder
from training.flags import add_plumbing_flags, check_config, check_context_window

# the defaults that depend on the model, each written here once. The tiny model learns from scratch
# on a CPU (README, departures); a Hugging Face one takes the paper's objective (REFERENCE 1b: gated
# OPD loss, lambda 0.01, beta 5, KL 0.01, lr 1e-6; entropy 0.001, the reproduction's verl default)
# and OPID's analyzer budgets. An env may change tiny ones (envs.EnvSpec.tiny_preset).
PRESETS = {
    "tiny": dict(lr=1e-4, distill_mode="gated", distill_coef=0.01, kl_coef=0.1, entropy_coef=0.0,
                 advantage_norm="batch", mini_batches=4, eval_temperature=0.0,
                 analysis_prompt_tokens=1024, analysis_max_new_tokens=128, vision_lr_scale=1.0),
    "hf": dict(lr=1e-6, distill_mode="gated", distill_coef=0.01, kl_coef=0.01, entropy_coef=0.001,
               advantage_norm="group", mini_batches=1, eval_temperature=0.4,
               analysis_prompt_tokens=28672, analysis_max_new_tokens=4096, vision_lr_scale=1.0)}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default."""


def get_parser(model="tiny", env="household"):
    """train.py's flags, with the defaults of the (model, env) preset."""
    defaults = PRESETS["hf"] if model != "tiny" else \
        {**PRESETS["tiny"], **dict(envs.ENVS[env].tiny_preset if env in envs.ENVS else ())}
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    method, plumbing = p.add_argument_group("the method"), p.add_argument_group("plumbing")

    def add(flag, default, help, group=method, **kwargs):  # the type follows the default
        if "action" not in kwargs:
            number = isinstance(default, (int, float)) and not isinstance(default, bool)
            kwargs.setdefault("type", type(default) if number else str)
        group.add_argument(flag, default=default, help=help, **kwargs)

    add("--algo", "seed", "seed = GRPO + self-analysis distillation", choices=["seed", "grpo"])
    add("--env", "household", "environment (envs.py lists them)", choices=envs.ENV_NAMES)
    add("--model", "tiny", "'tiny' (built offline) or a Hugging Face model name or folder")
    add("--updates", 5, "RL policy updates (paper: 150)")
    add("--tasks-per-update", 8, "N tasks per update (paper: 16)")
    add("--group-size", 4, "G rollouts per task, the GRPO group (paper: 8)")
    add("--distill-mode", defaults["distill_mode"], "how delta enters: the paper's gated OPD loss, "
        "the advantage (OPID) or OPID's loss", choices=["gated", "advantage", "loss"])
    add("--distill-coef", defaults["distill_coef"], "lambda, the distillation weight (paper 0.01)")
    add("--gate-beta", 5.0, "sharpness of the gate of --distill-mode gated (paper 5)")
    add("--analyzer", "policy", "who writes the skills: the current policy (SEED) or the frozen "
        "start model (the paper's ablation without on-policy skills)", choices=["policy", "start"])
    add("--kl-coef", defaults["kl_coef"], "k3 KL to the start model (paper 0.01; a 2nd model)")
    add("--entropy-coef", defaults["entropy_coef"], "entropy bonus")
    add("--clip-low", 0.2, "PPO clip below 1")
    add("--clip-high", 0.2, "PPO clip above 1")
    add("--lr", defaults["lr"], "learning rate (paper: 1e-6)")
    add("--advantage-norm", defaults["advantage_norm"], "GRPO scale: group std (paper), batch std "
        "(all-failed groups stay ~0), none (Dr. GRPO)", choices=["group", "batch", "none"])
    max_steps = envs.ENVS[env].max_steps if env in envs.ENVS else 20
    add_plumbing_flags(lambda *a, **k: add(*a, group=plumbing, **k), defaults, max_steps)
    return p


def get_config(argv=None, check=True):
    early = argparse.ArgumentParser(add_help=False)  # the model and env decide some defaults
    early.add_argument("--model", default="tiny")
    early.add_argument("--env", default="household")
    known, _ = early.parse_known_args(argv)
    p = get_parser(known.model, known.env)
    cfg = p.parse_args(argv)
    if check:
        check_config(cfg, p.error, vars(p.parse_args(["--model", cfg.model, "--env", cfg.env])))
    return cfg


def stage1(cfg, options, folder):
    """The paper's stage 1 for a Hugging Face model: --sft-tasks train tasks x --sft-rollouts of
    its own rollouts annotated by the env's annotator (or --sft-data's records), format-checked,
    then --sft-epochs of hindsight-skill SFT; saved into `folder`."""
    policy = load_policy(cfg.model, cfg.device, cfg.dtype, cfg.gradient_checkpointing)
    if cfg.sft_data:  # a strong LLM's annotations, checked like the annotator's
        records = read_jsonl(cfg.sft_data)
        examples = [(r["prompt"], r["completion"]) for r in records
                    if skills.parse_skill(r["completion"])]
        counts = {"collected": len(records), "kept": len(examples),
                  "dropped": len(records) - len(examples)}
    else:
        width, spec = cfg.tasks_per_update, envs.spec(cfg.env)  # tasks rolled out together
        env_list = [envs.make_env(cfg.env, "train", i, **options)
                    for i in range(width * cfg.sft_rollouts)]
        task_seeds = random.Random(f"stage 1, {cfg.seed}").sample(range(10 ** 6), cfg.sft_tasks)
        trajectories = []
        for first in range(0, cfg.sft_tasks, width):
            trajectories += seed.rollout(
                policy, env_list, task_seeds[first:first + width], cfg.sft_rollouts, cfg.max_steps,
                envs.load(spec.prompt), cfg.max_new_tokens, cfg.temperature, cfg.history_window,
                cfg.invalid_penalty, cfg.max_prompt_tokens, desc="stage-1 rollouts",
                env_timeout=cfg.env_timeout)
        examples, counts = skills.hindsight_examples(
            trajectories, envs.load(spec.annotator), cfg.analysis_prompt_tokens,
            policy.count_tokens, cfg.seed)
    print(f"stage 1: {counts['collected']} trajectories collected, {counts['kept']} kept, "
          f"{counts['dropped']} dropped by the format check (or unfinished)")
    if not examples:
        raise ValueError(f"stage 1: no example passed the format check (of {counts['collected']})")
    loss = seed.stage1_sft(policy, examples, cfg.sft_epochs, cfg.sft_batch_size, cfg.sft_lr,
                           cfg.max_batch_tokens, cfg.seed)
    print(f"stage 1: {cfg.sft_epochs} epoch(s) on {len(examples)} examples, final loss {loss:.3f}")
    with atomic_folder(folder) as temporary:  # complete or absent
        save_policy(policy, temporary)


def start_model(cfg, options):
    """Folder of the policy RL starts from: the tiny model's cached warm-up (warmup/), a Hugging
    Face model after stage 1 (<out-dir>/sft, made once), or the model itself when stage 1 is off
    (--stage rl, --algo grpo, --sft-epochs 0)."""
    if cfg.model == "tiny":  # the warm-up stands in for what an instruct model brings, and stage 1
        from warmup.warm_start import warm_start
        return warm_start(cfg, options)
    folder, wanted = os.path.join(cfg.out_dir, "sft"), cfg.stage != "rl" and cfg.algo == "seed"
    if not os.path.exists(folder) and wanted and cfg.sft_epochs > 0:
        stage1(cfg, options, folder)
    return folder if os.path.exists(folder) else cfg.model


def main(cfg):
    rank, world = distributed.init(cfg)
    master = rank == 0  # logs, checkpoints and prints come from rank 0 only
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    lock = locks.FolderLock(os.path.join(cfg.out_dir, locks.LOCK_NAME), "train.py")
    if master:  # one live run per out dir (training/locks.py: a second run stops, naming this PID)
        lock.acquire()
    threads = locks.share_of_cores(cfg.threads) if world == 1 else (torch.get_num_threads(), "")
    torch.set_num_threads(threads[0])  # two runs on 2 cores with 2 threads each ran 10x slower
    if master:  # only what differs from the defaults of the preset (config.json: everything)
        logs.print_config(cfg, get_config(["--model", cfg.model, "--env", cfg.env], check=False),
                          threads)
    cfg.threads = threads[0]  # config.json and checkpoints record it: a resumed run takes the same
    with distributed.rank_zero_first(world, rank):  # rank 0 writes synthetic games, start model
        options = envs.env_options(cfg)
        checkpoint = checkpoints.latest_checkpoint(cfg.out_dir) if cfg.resume else None
        start_path = start_model(cfg, options)  # cached after its first build
    if cfg.stage == "sft":
        if master:
            checkpoints.start_run_folder(cfg, resumed=False)
            print(f"stage 1 done: the model is in {start_path}")
        lock.release()
        return distributed.finish(world)
    policy, state = checkpoints.load_checkpoint_policy(checkpoint, cfg) if checkpoint else \
        (load_policy(start_path, cfg.device, cfg.dtype, cfg.gradient_checkpointing), None)
    check_context_window(cfg, policy)
    if master:  # the start worked: only now is the out dir written (--overwrite: the old run goes)
        checkpoints.start_run_folder(cfg, resumed=checkpoint is not None)
    optimizer = torch.optim.AdamW(parameter_groups(policy.model, cfg.lr, cfg.vision_lr_scale),
                                  lr=cfg.lr, weight_decay=cfg.weight_decay)
    # the frozen start model: the KL's reference, --analyzer start's analyzer, the probe set's actor
    start = load_policy(start_path, cfg.device, cfg.dtype)
    reference = start.model.eval() if cfg.kl_coef > 0 else None
    analyzer = start if cfg.analyzer == "start" else policy  # SEED: the improved policy analyzes
    # seeded again: building the warm-up draws from the RNG, reading it from the cache does not
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed + rank)  # torchrun: each rank its own stream (nanoGPT's seed offset)
    first_update = checkpoints.restore_trainer_state(state, optimizer) if state else 0

    share = cfg.tasks_per_update // world  # tasks per rank; a task's GRPO group stays on its rank
    n_envs, template = share * cfg.group_size, envs.load(envs.spec(cfg.env).prompt)
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
    eval_rows = logs.resume_logs(cfg.out_dir, first_update) if master else []
    probes = probe_set(start, cfg, template, options, probe_set_path(start_path, cfg)) \
        if master and world == 1 else None  # the self-analysis probe's fixed trajectories

    for update in range(first_update, cfg.updates + 1):
        # ---- eval: at update 0, every --eval-every updates and at the end
        if update == 0 or update % cfg.eval_every == 0 or update == cfg.updates:
            for split, split_envs in eval_envs.items():
                result = evaluate(policy, cfg, split, split_envs, template, rank, world,
                                  eval_factories[split], probes)
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
        task_seeds = random.Random(stream).sample(range(cfg.train_tasks or 10 ** 6),
                                                  cfg.tasks_per_update)
        generator = distributed.rank_generator(stream, rank, world, policy.device)
        trajectories = seed.rollout(policy, train_envs, task_seeds[rank * share:(rank + 1) * share],
                                    cfg.group_size, cfg.max_steps, template, cfg.max_new_tokens,
                                    cfg.temperature, cfg.history_window, cfg.invalid_penalty,
                                    cfg.max_prompt_tokens, generator=generator,
                                    env_factory=train_factory, env_timeout=cfg.env_timeout)
        dropped = logs.report_dropped(trajectories, f"update {update + 1}")
        trajectories = [t for t in trajectories if not t.dropped]  # a shorter group is fine
        times["rollout"] = time.time() - t0

        # ---- analyze: the same weights write one hindsight skill per trajectory (SEED only)
        t1 = time.time()
        skill_list = None
        if cfg.algo == "seed":
            skill_list, texts = seed.analyze(analyzer, trajectories, cfg.analysis_prompt_tokens,
                                             cfg.analysis_max_new_tokens, cfg.analysis_temperature)
        if cfg.teacher_skill == "shuffled":  # the ablation: each teacher gets another task's skill
            skill_list = skill_list[cfg.group_size:] + skill_list[:cfg.group_size]
        elif cfg.teacher_skill == "annotator":  # the bound: the skill a perfect analyzer would write
            annotate = envs.load(envs.spec(cfg.env).annotator)
            skill_list = [annotate(t, t.gt)[1] if t.gt else None for t in trajectories]
        times["analyze"] = time.time() - t1

        # ---- re-score: teacher (and reference) log-probs of the same sampled tokens; no student
        # pass: log pi_old is the update's own forward or what sampling recorded (seed.ppo_update)
        t2 = time.time()
        rows = seed.step_rows(trajectories, skill_list)
        _, teacher_logp, ref_logp, has_teacher = seed.rescore(
            policy, rows, cfg.temperature, cfg.layout, cfg.max_batch_tokens, reference,
            need_old=False)
        if cfg.distill_center:  # beyond the paper, off: only the skill's relative verdict is distilled
            teacher_logp = centered_teacher(rows, teacher_logp, has_teacher)  # (B, R)
        times["rescore"] = time.time() - t2

        # ---- advantage: GRPO per task group for every step row (delta joins inside the loss)
        advantages = seed.step_advantages(trajectories, rows, cfg.advantage_norm,
                                          cfg.grpo_stats)  # (B,)

        # ---- update: PPO-clip + SEED in --mini-batches optimizer steps
        t3 = time.time()
        mini_batches = distributed.fewest(cfg.mini_batches, len(rows.prompts), world, policy.device)
        extra = teacher_terms(cfg, policy, start, rows, advantages, mini_batches, stream, ref_logp)  # off: None
        metrics, skipped = seed.ppo_update(
            policy, optimizer, rows, advantages, teacher_logp if cfg.algo == "seed" else None,
            ref_logp, has_teacher, mini_batches, loss_kwargs=loss_kwargs,
            temperature=cfg.temperature, layout=cfg.layout, max_batch_tokens=cfg.max_batch_tokens,
            grad_clip=cfg.grad_clip, sync=distributed.GradientSync() if world > 1 else None,
            extra_loss=extra)
        if cfg.analyzer_training != "none" and skill_list is not None:  # beyond the paper; off
            metrics.update(analyzer_step(cfg.analyzer_training, policy, start, optimizer, cfg,
                                         trajectories, skill_list, texts, rows, teacher_logp,
                                         has_teacher, stream))
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
    summary = logs.finish_run(cfg.out_dir, eval_rows) if master else None
    lock.release()
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
