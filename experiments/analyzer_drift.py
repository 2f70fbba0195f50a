"""
experiments/analyzer_drift.py: does RL move the analyzer, which of its tokens, and do parse failures follow?

    python experiments/analyzer_drift.py out/exp9/seed-3 out/exp9/grpo-3      # each run's saved checkpoints
    python experiments/analyzer_drift.py out/exp9/seed-* --tasks 16 --samples 8
    python experiments/analyzer_drift.py out/exp23/seed-* --tasks 96 --samples 0 --last-only   # fixing by kind

Issue 38's first question about the analyzer ("first find out why it drifts"). RL trains only the action tokens
of the weights that also write the skills, so the analysis distribution can move without any loss on it. For the
start model and every checkpoint of the given runs this script measures, on one fixed set of start-model episodes
(valid_seen tasks 0..--tasks-1, temperature 1, a fixed generator):

  parse fail (greedy / sampled)  the share of analyses that do not parse: greedy, and --samples per trajectory
                                 at temperature 1 (finer than the 8-task probe of evaluation/self_analysis.py);
  fixing (sampled)               of the failed episodes' sampled analyses that parse, the share naming the fix;
  KL analysis / KL action        exact per-token KL(start || checkpoint), nats, averaged over the positions of
                                 the start model's greedy analyses (teacher-forced) / of the episodes' sampled
                                 action tokens: how far each distribution moved from the start model;
  by mistake                     for the household env, the failed episodes' greedy analyses naming the fix,
                                 counted by the failure's first mistake (annotators.text_worlds.mistake_kind);
  syntax / words                 the mean change in log-prob of the start analyses' tokens under the checkpoint,
                                 split into JSON syntax tokens ({ } " : ,) and the rest.

and, over all checkpoints, the Pearson correlation of sampled parse failures with the analysis KL. The tokens
whose log-prob fell most are listed per run's last checkpoint. Not in the paper (it does not measure its analyzer).
Numbers move with the thread count in the last digits; the tiny model and the household env (the run's flags).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import envs  # noqa: E402
import seed  # noqa: E402
import skills  # noqa: E402
import train  # noqa: E402
from models.policy import load_policy  # noqa: E402
from models.scoring import forward_logits, response_mask  # noqa: E402
from training.checkpoints import intact_checkpoints, latest_config  # noqa: E402

SYNTAX = set('{}":, ')


def run_config(run):
    """The run's saved configuration as a namespace (the preset's defaults under what config.json holds)."""
    saved = latest_config(run)
    if saved is None:
        raise SystemExit(f"{run}: no readable config.json")
    cfg = train.get_config(["--model", saved["model"], "--env", saved["env"]], check=False)
    vars(cfg).update({k: v for k, v in saved.items() if hasattr(cfg, k)})
    return cfg


@torch.no_grad()
def token_kl(start, model, prompts, responses, pad_id):
    """Per-position KL(start || model) (B, R) and the log-prob change of the given tokens (B, R)."""
    start_logits, targets = forward_logits(start.model.eval(), prompts, responses, pad_id)  # (B, R, V)
    logits, _ = forward_logits(model.model.eval(), prompts, responses, pad_id)              # (B, R, V)
    start_logp, logp = start_logits.float().log_softmax(-1), logits.float().log_softmax(-1)
    kl = (start_logp.exp() * (start_logp - logp)).sum(-1)                                 # (B, R)
    change = (logp - start_logp).gather(-1, targets[..., None]).squeeze(-1)               # (B, R)
    mask = response_mask(responses)                                                         # (B, R)
    return kl * mask, change * mask, mask


def measure(policy, start, cfg, episodes, analyzer_prompts, start_analyses, samples, generator_seed=0):
    """One model's row of numbers (see the module docstring) and its per-token changes on the start analyses
    (analyzer_prompts: the episodes' analyzer prompts as token ids, the same for every model)."""
    greedy, _ = seed.analyze(policy, episodes, cfg.analysis_prompt_tokens, cfg.analysis_max_new_tokens, 0.0)
    torch.manual_seed(generator_seed)  # the same draws for every model's sampled analyses
    repeated = [t for t in episodes for _ in range(samples)]
    sampled = seed.analyze(policy, repeated, cfg.analysis_prompt_tokens, cfg.analysis_max_new_tokens,
                           1.0)[0] if repeated else []
    names_fix = envs.spec(cfg.env).names_fix
    check = envs.load(names_fix) if names_fix else None
    checks = [check(t, s) for t, s in zip(repeated, sampled) if not t.won and s is not None] if check else []
    checks = [c for c in checks if c is not None]
    by_kind = {}  # which failures the greedy analyses name the fix of (explored traded one kind for another)
    if names_fix == envs.TEXT_FIX:
        from annotators.text_worlds import mistake_kind
        for trajectory, skill in zip(episodes, greedy):
            if not trajectory.won:
                kind = mistake_kind(trajectory)
                named, count = by_kind.get(kind, (0, 0))
                by_kind[kind] = (named + bool(check(trajectory, skill)), count + 1)
    kl_analysis, change, mask = token_kl(start, policy, analyzer_prompts, start_analyses, policy.pad_id)
    action_prompts = [s.prompt_ids for t in episodes for s in t.steps]
    action_responses = [s.response_ids for t in episodes for s in t.steps]
    kl_action, _, action_mask = token_kl(start, policy, action_prompts, action_responses, policy.pad_id)
    pieces = [[policy.tokenizer.decode([token]) for token in row] for row in start_analyses]
    syntax = torch.tensor([[float(bool(p.strip()) and set(p) <= SYNTAX) for p in row] +
                           [0.0] * (mask.shape[1] - len(row)) for row in pieces]) * mask  # (B, R)
    mean = lambda values: sum(values) / max(1, len(values))
    row = {"parse_greedy": mean([s is None for s in greedy]), "parse_sampled": mean([s is None for s in sampled]),
           "fixing_sampled": mean(checks) if checks else None, "fixing_greedy_by_kind": by_kind,
           "kl_analysis": float(kl_analysis.sum() / mask.sum()),
           "kl_action": float(kl_action.sum() / action_mask.sum()),
           "change_syntax": float((change * syntax).sum() / syntax.sum().clamp(min=1)),
           "change_words": float((change * (mask - syntax)).sum() / (mask - syntax).sum().clamp(min=1))}
    by_token = {}
    for r, row_pieces in enumerate(pieces):
        for c, piece in enumerate(row_pieces):
            by_token.setdefault(piece, []).append(float(change[r, c]))
    return row, by_token


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run folders (each with config.json and checkpoints/)")
    parser.add_argument("--tasks", type=int, default=16, help="valid_seen episodes analyzed (default: 16)")
    parser.add_argument("--samples", type=int, default=8, help="sampled analyses per episode, 0 = greedy only "
                        "(default: 8)")
    parser.add_argument("--last-only", action="store_true", help="measure only each run's newest checkpoint "
                        "(and the start model)")
    parser.add_argument("--analysis-max-new-tokens", type=int, default=None,
                        help="analyzer output tokens (default: the first run's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = run_config(args.runs[0])
    cfg.analysis_max_new_tokens = args.analysis_max_new_tokens or cfg.analysis_max_new_tokens
    options = envs.env_options(cfg)
    start_path = train.start_model(cfg, options)
    start = load_policy(start_path, "cpu", "float32")
    template = envs.load(envs.spec(cfg.env).prompt)
    env_list = [envs.make_env(cfg.env, "valid_seen", i, **options) for i in range(args.tasks)]
    episodes = seed.rollout(start, env_list, list(range(args.tasks)), 1, cfg.max_steps, template,
                            cfg.max_new_tokens, cfg.temperature, cfg.history_window, cfg.invalid_penalty,
                            cfg.max_prompt_tokens, desc="start-model episodes",
                            generator=torch.Generator().manual_seed(1234))
    episodes = [t for t in episodes if t.gt is not None]
    prompts = [seed.encode_chat(start.tokenizer, skills.analyzer_prompt(t, cfg.analysis_prompt_tokens,
                                                                          start.count_tokens)) for t in episodes]
    start_analyses, _ = seed.sample(start, prompts, cfg.analysis_max_new_tokens, 0.0)
    print(f"{len(episodes)} start-model episodes ({sum(t.won for t in episodes)} won), {args.samples} sampled "
          f"analyses each, up to {cfg.analysis_max_new_tokens} tokens; start model {start_path}")
    print(f"{'model':<34} {'parse greedy':>12} {'parse sampled':>13} {'fixing':>7} {'KL analysis':>11} "
          f"{'KL action':>9} {'syntax':>7} {'words':>7}")
    points = []

    def show(name, row):
        fixing = "-" if row["fixing_sampled"] is None else f"{row['fixing_sampled']:.3f}"
        print(f"{name:<34} {row['parse_greedy']:>12.3f} {row['parse_sampled']:>13.3f} {fixing:>7} "
              f"{row['kl_analysis']:>11.4f} {row['kl_action']:>9.4f} {row['change_syntax']:>+7.3f} "
              f"{row['change_words']:>+7.3f}", flush=True)
        if row["fixing_greedy_by_kind"]:
            kinds = sorted(row["fixing_greedy_by_kind"].items())
            named, count = (sum(pair[i] for _, pair in kinds) for i in (0, 1))
            print(f"    greedy analyses naming the fix: {named}/{count}; by the failure's first mistake: " +
                  ", ".join(f"{kind} {named}/{count}" for kind, (named, count) in kinds))

    show("start", measure(start, start, cfg, episodes, prompts, start_analyses, args.samples)[0])
    if any(len(a) >= cfg.analysis_max_new_tokens for a in start_analyses):
        print(f"note: some start analyses reach the {cfg.analysis_max_new_tokens}-token limit")
    last_tokens = {}
    for run in args.runs:
        for folder in intact_checkpoints(run)[-1:] if args.last_only else intact_checkpoints(run):
            policy = load_policy(folder, "cpu", "float32")
            row, by_token = measure(policy, start, cfg, episodes, prompts, start_analyses, args.samples)
            show(f"{os.path.basename(run)} {os.path.basename(folder)}", row)
            points.append((row["kl_analysis"], row["parse_sampled"]))
            last_tokens[os.path.basename(run)] = by_token
    if len(points) > 2:
        kl, fail = torch.tensor(points).T
        correlation = float(torch.corrcoef(torch.stack([kl, fail]))[0, 1])
        print(f"parse failures (sampled) vs analysis KL over {len(points)} checkpoints: Pearson r = "
              f"{correlation:+.2f}")
    for run, by_token in last_tokens.items():
        fell = sorted(((sum(v) / len(v), piece, len(v)) for piece, v in by_token.items() if len(v) >= 3))[:6]
        print(f"{run}, last checkpoint, the start analyses' tokens whose log-prob fell most: " +
              ", ".join(f"{piece!r} {value:+.2f} (x{count})" for value, piece, count in fell))


if __name__ == "__main__":
    main()
