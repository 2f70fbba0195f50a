"""
checkpoints.py: what lets a training run survive a crash -- atomic checkpoints, their loading, and the logs
trimmed back to the checkpoint a run resumes from.

A checkpoint is an ordinary Hugging Face folder (model + tokenizer) plus trainer.pt (optimizer state, update
number, torch / Python / CUDA RNG state) and config.json, written into a temporary folder and renamed into
place; `checkpoints/latest` names the newest and is replaced atomically too, so a kill at any moment leaves
the previous checkpoint intact. trainer.pt is read with weights_only=True. No departure from the paper (it
does not describe checkpointing). Used by train.py (`--resume`); not run on its own.
"""
import json
import os
import random
import shutil
import signal

import torch


def kill_point(phase, update):
    """Test hook: SEED_KILL_AT=<phase>:<update> makes the process SIGKILL itself here (the kill-and-resume test)."""
    if os.environ.get("SEED_KILL_AT") == f"{phase}:{update}":
        os.kill(os.getpid(), signal.SIGKILL)



def save_checkpoint(cfg, policy, optimizer, update):
    """Atomic: everything goes into a temporary folder that is renamed into place, then the `latest`
    pointer is replaced with os.replace. A crash leaves the previous checkpoint intact."""
    root = os.path.join(cfg.out_dir, "checkpoints")
    final = os.path.join(root, f"update_{update:06d}")
    temporary = final + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    policy.model.save_pretrained(temporary)
    policy.tokenizer.save_pretrained(temporary)
    kill_point("save", update)
    state = {"update": update, "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
             "python_rng": random.getstate()}
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    torch.save(state, os.path.join(temporary, "trainer.pt"))
    with open(os.path.join(temporary, "config.json.train"), "w") as f:
        json.dump(vars(cfg), f, indent=1)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(temporary, final)
    kill_point("save-pointer", update)
    pointer = os.path.join(root, "latest")
    with open(pointer + ".tmp", "w") as f:
        f.write(os.path.basename(final))
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer + ".tmp", pointer)
    kept = sorted(d for d in os.listdir(root) if d.startswith("update_") and not d.endswith(".tmp"))
    for old in kept[:-cfg.keep_checkpoints]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def latest_checkpoint(out_dir):
    """The folder checkpoints/latest names, None when there is no pointer; a pointer to a missing or incomplete
    folder (never left by save_checkpoint, so damaged by hand or disk) is an error that says what to do."""
    pointer = os.path.join(out_dir, "checkpoints", "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    path = os.path.join(out_dir, "checkpoints", name)
    if not name or not os.path.isfile(os.path.join(path, "trainer.pt")):
        others = sorted(d for d in os.listdir(os.path.dirname(pointer)) if d.startswith("update_") and d != name
                        and os.path.isfile(os.path.join(os.path.dirname(pointer), d, "trainer.pt")))
        raise ValueError(f"checkpoint {path!r} named by {pointer} is missing or has no trainer.pt; write the name of "
                         f"an intact folder into that file ({', '.join(others) or 'there is none'}) or delete it "
                         "to start fresh")
    return path


def read_trainer_state(checkpoint):
    """trainer.pt of a checkpoint (weights_only=True: tensors and plain data, no code), or one clear error."""
    path = os.path.join(checkpoint, "trainer.pt")
    try:
        state = torch.load(path, weights_only=True)
        problem = None if isinstance(state, dict) else f"it holds a {type(state).__name__}, not a dict"
    except Exception as error:  # a torn zip, garbage bytes, a foreign pickle: the file is unusable either way
        state, problem = None, f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
    missing = sorted({"update", "optimizer", "torch_rng", "python_rng"} - set(state or {}))
    if problem or missing:
        raise ValueError(f"checkpoint {path} is corrupt ({problem or 'no ' + ', '.join(missing)}); point "
                         "checkpoints/latest at an earlier update_* folder, or start without --resume")
    return state


def trim_log(path, keep, why):
    """Rewrite a JSONL log with only its complete records that keep(record) accepts (atomically), say how many
    lines went and why, and return the records. On (re)start this drops what a killed run wrote after its last
    checkpoint, and a torn last line."""
    if not os.path.exists(path):
        return []
    lines, records, total = [], [], 0
    with open(path) as f:
        for total, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and keep(record):
                lines.append(line if line.endswith("\n") else line + "\n")
                records.append(record)
    with open(path + ".tmp", "w") as f:
        f.writelines(lines)
    os.replace(path + ".tmp", path)
    if total > len(lines):
        print(f"{path}: dropped {total - len(lines)} line(s) {why}")
    return records
