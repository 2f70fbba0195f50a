"""
training/checkpoints.py: what lets a training run survive a crash -- atomic checkpoints and their loading.

A checkpoint is an ordinary Hugging Face folder (model + tokenizer) plus trainer.pt (optimizer state, update
number, torch / Python / CUDA RNG state) and config.json, written into a temporary folder and renamed into
place; `checkpoints/latest` names the newest and is replaced atomically too, so a kill at any moment leaves
the previous checkpoint intact. trainer.pt is read with weights_only=True. Used by train.py (`--resume`).
"""
import contextlib
import errno
import json
import os
import random
import shutil

import torch

from models.policy import load_policy, save_policy


@contextlib.contextmanager
def atomic_folder(path):
    """Yield path + ".tmp" to write into; on success it is renamed to path (replacing an older one), on an
    error or an interrupt it is removed: the folder is complete or absent, never half-written."""
    temporary = path + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    try:
        yield temporary
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)
    os.replace(temporary, path)


def save_checkpoint(cfg, policy, optimizer, update):
    """Atomic: everything goes into a temporary folder that is renamed into place, then the `latest`
    pointer is replaced with os.replace. A crash, or a full disk, leaves the previous checkpoint intact."""
    root = os.path.join(cfg.out_dir, "checkpoints")
    final = os.path.join(root, f"update_{update:06d}")
    try:
        with atomic_folder(final) as temporary:
            save_policy(policy, temporary)
            state = {"update": update, "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                     "python_rng": random.getstate()}
            if torch.cuda.is_available():
                state["cuda_rng"] = torch.cuda.get_rng_state_all()
            torch.save(state, os.path.join(temporary, "trainer.pt"))
            with open(os.path.join(temporary, "config.json.train"), "w") as f:
                json.dump(vars(cfg), f, indent=1)
    except (OSError, RuntimeError) as error:  # torch.save on a full disk says "unexpected pos ..."
        raise ValueError(write_failure(root, f"checkpoint {final}", error)) from error
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


def write_failure(root, what, error):
    """The message for a write that failed: a full disk or quota named as such (the ENOSPC / EDQUOT errno, or
    less than 64 MB left), and what is still intact."""
    try:
        free = shutil.disk_usage(root if os.path.isdir(root) else os.path.dirname(root) or ".").free
    except OSError:
        free = None
    full = getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < 64 << 20)
    cause = ("the disk (or quota) is full" + (f" ({free >> 20} MB free)" if free is not None else "")
             if full else f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}")
    intact = intact_checkpoints(os.path.dirname(root))
    kept = f"the last complete checkpoint, {intact[-1]}, is intact" if intact else "no earlier checkpoint exists"
    return f"could not write {what} under {root}: {cause}; {kept}"


def intact_checkpoints(out_dir):
    """update_* folders of out_dir/checkpoints that have a trainer.pt (save_checkpoint renames a folder into
    place only when complete), oldest first, as paths."""
    root = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    names = sorted(d for d in os.listdir(root) if d.startswith("update_") and not d.endswith(".tmp")
                   and os.path.isfile(os.path.join(root, d, "trainer.pt")))
    return [os.path.join(root, d) for d in names]


def latest_checkpoint(out_dir):
    """The folder checkpoints/latest names; when the pointer is missing, or names a missing or incomplete
    folder, the newest intact update_* folder, saying which it took; None when there is none at all."""
    pointer = os.path.join(out_dir, "checkpoints", "latest")
    name = None
    if os.path.exists(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        if name and os.path.isfile(os.path.join(out_dir, "checkpoints", name, "trainer.pt")):
            return os.path.join(out_dir, "checkpoints", name)
    intact = intact_checkpoints(out_dir)
    if intact:
        problem = "there is no checkpoints/latest" if name is None else \
            f"checkpoints/latest names {name!r}, which is missing or incomplete"
        print(f"{out_dir}: {problem}; taking the newest intact checkpoint, {intact[-1]}")
        return intact[-1]
    if name is not None:
        raise ValueError(f"{pointer} names {name!r}, which is missing or incomplete, and no other intact "
                         "checkpoint exists; delete the pointer to start fresh")
    return None


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


def latest_config(out_dir, checkpoint=False):
    """The config of the run in out_dir: its newest intact checkpoint's (checkpoint=True), else config.json;
    None when there is none or it does not parse."""
    paths = [os.path.join(c, "config.json.train") for c in intact_checkpoints(out_dir)[-1:]] if checkpoint \
        else [os.path.join(out_dir, "config.json")]
    for path in paths:
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None
    return None


def load_checkpoint_policy(checkpoint, cfg):
    """(policy, trainer state) of a checkpoint folder, trainer.pt read once; one clear error otherwise."""
    print(f"resuming from {checkpoint}")
    state = read_trainer_state(checkpoint)
    if state["update"] > cfg.updates:
        raise ValueError(f"{checkpoint} is at update {state['update']}, past --updates {cfg.updates}")
    try:
        return load_policy(checkpoint, cfg.device, cfg.dtype, cfg.gradient_checkpointing), state
    except Exception as error:  # torn or foreign weights: say which folder, not a loader's traceback
        raise ValueError(f"checkpoint {checkpoint}: the model does not load ({type(error).__name__}: "
                         f"{(str(error).splitlines() or [''])[0][:200]})") from error


def restore_trainer_state(state, optimizer):
    """Optimizer state and the torch / Python / CUDA RNG state of a checkpoint's trainer state; returns its
    update number."""
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["update"]


def start_run_folder(cfg, resumed):
    """A fresh run with --overwrite deletes the earlier run's checkpoints and logs; every run then writes
    its config.json (called once the start model has loaded, so a failed start writes nothing)."""
    if cfg.overwrite and not resumed:
        shutil.rmtree(os.path.join(cfg.out_dir, "checkpoints"), ignore_errors=True)
        for name in ("metrics.jsonl", "eval.jsonl", "summary.json"):
            if os.path.exists(os.path.join(cfg.out_dir, name)):
                os.remove(os.path.join(cfg.out_dir, name))
    os.makedirs(cfg.out_dir, exist_ok=True)
    with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
        json.dump(vars(cfg), f, indent=1)


def resumable(cfg):
    """The latest checkpoint in --out-dir made with this run's env and model (what --resume would continue),
    else None. Says nothing and raises nothing: it is asked while the run is being interrupted."""
    for path in reversed(intact_checkpoints(cfg.out_dir)):
        try:
            with open(os.path.join(path, "config.json.train")) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            continue
        if saved.get("env") == cfg.env and saved.get("model") == cfg.model:
            return path
    return None


def interrupted(cfg):
    """What to tell a user who pressed Ctrl-C: the checkpoint of this run that --resume continues, or that
    there is none yet (a warm-up or stage 1 starts again next time; only complete ones are cached)."""
    saved = resumable(cfg)
    if saved:
        return f"interrupted: {saved} is intact; continue with --resume"
    return ("interrupted before this run's first checkpoint: nothing to resume (a warm-up or stage 1 starts "
            "again; only complete ones are cached)")
