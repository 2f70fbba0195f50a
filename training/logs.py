"""training/logs.py: what a run writes and prints -- metrics.jsonl / eval.jsonl lines, the evaluation table,
the update lines, warnings and the self-analysis summary.

Every log line is flushed to disk as it is written (a crash loses at most the line being written), and on a
(re)start trim_log drops what a killed run wrote past its last checkpoint. No departure from the paper.
"""
import json
import os

from training.distributed import sum_over_ranks


def save_metrics_line(path, record):
    """Append one JSON line and flush it to disk (a crash loses at most the line being written)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(path):
    """The JSON objects of a JSONL log, one per complete line; unparseable lines (a torn last line) skipped."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return [r for r in records if isinstance(r, dict)]


def trim_log(path, keep, why):
    """Rewrite a JSONL log (atomically) with the records keep(record) accepts, and return them. On a
    (re)start this drops what a killed run wrote after its last checkpoint (said, with `why`) and a torn
    last line. An unparseable line in the middle (a damaged file) loses nothing: it moves to
    <path>.corrupt, named in the message, and every parseable record stays."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.readlines()
    kept, records, dropped, damaged = [], [], 0, []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            torn = number == len(lines) and not line.endswith("\n")  # a kill mid-write
            dropped += torn
            damaged += [] if torn or not line.strip() else [line if line.endswith("\n") else line + "\n"]
        elif keep(record):
            kept.append(line if line.endswith("\n") else line + "\n")
            records.append(record)
        else:
            dropped += 1
    if damaged:
        with open(path + ".corrupt", "a") as f:
            f.writelines(damaged)
        print(f"{path}: {len(damaged)} unparseable line(s) moved to {path}.corrupt; every other record kept")
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
    if dropped:
        print(f"{path}: dropped {dropped} line(s) {why}")
    return records


def episode_outcomes(trajectories):
    """(task type, won, steps, invalid steps) of each episode whose env did not fail."""
    return [(t.task_type, float(t.won), len(t.steps), sum(not s.valid for s in t.steps))
            for t in trajectories if not t.dropped]


def success_table(episodes, split, dropped=0):
    """An evaluation's record: success micro (over episodes) and macro (mean over task types), per type,
    mean steps and the share of invalid steps. No episode at all gives zeros, not a crash."""
    per_type = {}
    for task_type, won, _, _ in episodes:
        per_type.setdefault(task_type, []).append(won)
    by_type = {k: sum(v) / len(v) for k, v in sorted(per_type.items())}
    steps, n = sum(e[2] for e in episodes), max(1, len(episodes))
    return {"split": split, "micro": sum(e[1] for e in episodes) / n,
            "macro": sum(by_type.values()) / max(1, len(by_type)), "per_type": by_type,
            "steps": steps / n, "invalid_share": sum(e[3] for e in episodes) / max(1, steps), "dropped": dropped}


def update_record(update, trajectories, rows, skill_list, dropped, skipped, metrics, times, seconds,
                  world=1, device="cpu"):
    """metrics.jsonl's record of one update: training success, reward, steps, rows, dropped and invalid
    steps, analyzer parse failures (None without analysis), phase times and the loss metrics. Under
    torchrun the counts are summed over ranks (the loss metrics were summed in the update already)."""
    steps = [s for t in trajectories for s in t.steps]
    counts = sum_over_ranks({"won": sum(t.won for t in trajectories), "trajectories": len(trajectories),
                             "reward": sum(t.reward for t in trajectories), "steps": len(steps),
                             "rows": len(rows.prompts), "invalid": sum(not s.valid for s in steps),
                             "truncated": sum(s.truncated for s in steps), "dropped": dropped,
                             "parse_fail": sum(s is None for s in skill_list or [])}, world, device)
    episodes = max(1, counts["trajectories"])  # every trajectory dropped: zeros, and the update says SKIPPED
    analyzed = skill_list is not None
    return {"update": update, "success": counts["won"] / episodes, "reward": counts["reward"] / episodes,
            "steps": counts["steps"] / episodes, "rows": int(counts["rows"]), "skipped": skipped,
            "dropped": int(counts["dropped"]), "invalid_steps": int(counts["invalid"]),
            "invalid_share": counts["invalid"] / max(1, counts["rows"]),
            "truncated_rows": int(counts["truncated"]),
            "parse_failures": int(counts["parse_fail"]) if analyzed else None,
            "parse_fail": counts["parse_fail"] / episodes if analyzed else None,
            "time": seconds, **{f"time_{k}": v for k, v in times.items()}, **metrics}


def report_dropped(trajectories, where):
    """Print why each dropped trajectory (an env that raised or hung) was dropped; return how many."""
    reasons = [t.dropped for t in trajectories if t.dropped]
    for reason in reasons:
        print(f"{where}: dropped a trajectory, env rebuilt: {reason}")
    return len(reasons)


def print_eval_table(rows):
    """The evaluation table: success micro / macro, the invalid share, the env's probe columns (rows' "probes",
    e.g. the household habit) and success per task type; only the columns the rows have."""
    types = sorted({k for r in rows for k in r["per_type"]})
    probes = list(dict.fromkeys(k for r in rows for k in r.get("probes", {})))
    temperature = rows[0].get("temperature", 0.0) if rows else 0.0
    print("evaluation, one episode per task, " + ("greedy" if temperature == 0 else
                                                   f"sampled at temperature {temperature:g}") + ":")
    print(f"{'when':>10} {'split':>13} {'micro':>6} {'macro':>6} {'invalid':>7} "
          + "".join(f"{p[:12]:>{max(6, len(p[:12]))}} " for p in probes) + " ".join(f"{t[:12]:>12}" for t in types))
    cell = lambda value, width: f"{value:{width}.3f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"
    for r in rows:
        values = r.get("probes", {})
        print(f"{r['when']:>10} {r['split']:>13} {r['micro']:6.3f} {r['macro']:6.3f} {r.get('invalid_share', 0):7.3f} "
              + "".join(cell(values.get(p), max(6, len(p[:12]))) + " " for p in probes)
              + " ".join(f"{r['per_type'].get(t, float('nan')):12.3f}" for t in types))


def print_update_line(record, updates):
    """One line per update: training success and reward, mean |delta|, analyzer parse failures, KL, loss."""
    parse = "-" if record["parse_fail"] is None else f"{record['parse_fail']:.2f}"
    print(f"update {record['update']}/{updates} | success {record['success']:.2f} | reward {record['reward']:.2f} "
          f"| delta_abs {record.get('delta_abs_mean', 0):.4f} | parse_fail {parse} | kl {record.get('kl', 0):.4f} "
          f"| pg_loss {record.get('pg_loss', 0):+.4f} | {record['time']:.1f}s"
          + (f" | SKIPPED: {record['skipped']}" if record["skipped"] else ""))


_WARNED = set()


def warn_once(record, mini_batches, max_prompt_tokens):
    """Say once per run what a flag silently did to an update: fewer rows than --mini-batches (so fewer
    optimizer steps), or every prompt cut to --max-prompt-tokens (so no row had a teacher)."""
    rows = record["rows"]
    if rows and mini_batches > rows and "mini_batches" not in _WARNED:
        _WARNED.add("mini_batches")
        print(f"warning: update {record['update']} has {rows} rows, fewer than --mini-batches {mini_batches}: "
              f"it took {rows} optimizer steps")
    if rows and record["truncated_rows"] == rows and "truncated" not in _WARNED:
        _WARNED.add("truncated")
        print(f"warning: every prompt of update {record['update']} was longer than --max-prompt-tokens "
              f"{max_prompt_tokens} and lost its start (task line included): no row gets a teacher")


def print_self_analysis(metrics_path):
    """One line on the self-analysis over the run (SEED): parse failures and delta per sampled token; and
    the command that shows delta on every token of one episode (the delta picture)."""
    if not os.path.exists(metrics_path):
        return
    records = [r for r in read_records(metrics_path) if r.get("parse_fail") is not None]
    if not records:
        return
    mean = lambda key: sum(r.get(key, 0.0) for r in records) / len(records)
    print(f"self-analysis over updates {records[0]['update']}-{records[-1]['update']}: parse failures "
          f"{records[0]['parse_fail']:.2f} -> {records[-1]['parse_fail']:.2f} (mean {mean('parse_fail'):.2f}); "
          f"delta per sampled token: mean |delta| {mean('delta_abs_mean'):.4f}, mean {mean('delta_mean'):+.4f}, "
          f"share > 0 {mean('delta_pos_share'):.2f}; tokens with a teacher {mean('teacher_token_share'):.2f}")
    print(f"the delta picture of one episode: python experiments/experiment.py --picture "
          f"{os.path.dirname(metrics_path) or '.'}")


def print_config(cfg, defaults, threads=None):
    """The run's `config:` line: only the flags that differ from the preset's defaults (config.json holds
    every value), and the torch threads when they are not all this machine's cores (threads: (n, why))."""
    changed = [f"--{k.replace('_', '-')} {v}" for k, v in vars(cfg).items() if getattr(defaults, k, None) != v]
    shared = threads and ("shared" in threads[1] or threads[1] in ("--threads", "$OMP_NUM_THREADS"))
    print("config: " + (" ".join(changed) or "the defaults")
          + (f" | {threads[0]} torch thread(s): {threads[1]}" if shared else ""))


def resume_logs(out_dir, first_update):
    """On a (re)start, drop the log lines past the checkpoint a run starts from (a killed run's last
    update, a torn line); returns the evaluations kept, which the final table shows again."""
    trim_log(os.path.join(out_dir, "metrics.jsonl"), lambda r: r.get("update", 0) <= first_update,
             f"past update {first_update}, where this run starts")
    return trim_log(os.path.join(out_dir, "eval.jsonl"), lambda r: r.get("update", 0) < first_update,
                    f"from update {first_update} on (redone)")


def finish_run(out_dir, eval_rows):
    """summary.json, the final table (first and last evaluation) and the self-analysis summary."""
    summary = {"eval": eval_rows, "out_dir": out_dir}
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("final evaluation (success rate):")
    first_and_last = (eval_rows[0]["update"], eval_rows[-1]["update"])
    print_eval_table([r for r in eval_rows if r["update"] in first_and_last])
    print_self_analysis(os.path.join(out_dir, "metrics.jsonl"))
    probed = [r["probes"] for r in eval_rows if "lift" in r.get("probes", {})]
    if probed:  # evaluation/self_analysis.py: the analyzer over training, on its fixed probe set
        show = lambda key: " -> ".join("-" if p.get(key) is None else f"{p[key]:.3f}" for p in (probed[0], probed[-1]))
        print(f"self-analysis probe, first to last evaluation: parse failures {show('parse_fail')}; fixing skills "
              f"{show('fixing')}; skill lift {show('lift')} (with minus without a skill: {show('raw_lift')})")
    return summary
