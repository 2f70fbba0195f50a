"""evaluation/evaluate.py: one evaluation of a split, as train.py runs it at update 0, every --eval-every updates
and at the end: success micro / macro / per task type, the env's own probe, and on valid_seen the self-analysis
probe. No departure from the paper's protocol for success (one episode per task; greedy for the tiny model,
temperature 0.4 for a Hugging Face one). Run: python train.py (its tables)."""
import time

import torch

import envs
import seed
from evaluation.self_analysis import LIFT_TASKS, self_analysis
from training import distributed, logs


def evaluate(policy, cfg, split, env_list, template, rank=0, world=1, env_factory=None, probe_set=None):
    """One rollout (greedy by default) on each of the first --eval-tasks tasks of a split -> success micro (over
    episodes), macro (over task types) and per type (training/logs.py), and in "probes" the env's own probe
    (envs.EnvSpec.probe) and, given the probe_set on valid_seen, self_analysis's numbers; under torchrun each
    rank plays every world-th task (the probes run on rank 0). "time" (seconds) and "time_probe" (the
    self-analysis probe's share of them) say what the probe costs."""
    started, probe_seconds = time.time(), 0.0
    tasks = list(range(rank, cfg.eval_tasks, world))
    generator = torch.Generator(policy.device).manual_seed(cfg.seed)  # not the training RNG
    trajectories = seed.rollout(policy, env_list, tasks, 1, cfg.max_steps, template, cfg.max_new_tokens,
                                cfg.eval_temperature, cfg.history_window, cfg.invalid_penalty,
                                cfg.max_prompt_tokens, desc=f"eval {split}", generator=generator,
                                env_factory=env_factory, env_timeout=cfg.env_timeout)
    dropped = logs.report_dropped(trajectories, f"eval {split}")
    shares = distributed.gather((logs.episode_outcomes(trajectories), dropped), world)
    result = logs.success_table([e for share, _ in shares for e in share], split,
                                dropped=sum(count for _, count in shares))
    probe = envs.spec(cfg.env).probe
    result["probes"] = envs.load(probe)(policy, cfg, split) if probe else {}
    if probe_set and split == "valid_seen" and rank == 0 and world == 1 and cfg.eval_tasks >= LIFT_TASKS:
        without = [float(t.won) for t in trajectories[:LIFT_TASKS]]  # tasks 0.., played just now
        probe_started = time.time()
        result["probes"].update(self_analysis(policy, cfg, probe_set, template, env_factory, without))
        probe_seconds = time.time() - probe_started
    return {**result, "temperature": cfg.eval_temperature, "time": time.time() - started, "time_probe": probe_seconds}
