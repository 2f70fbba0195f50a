"""training/locks.py: one live run per folder, and a fair share of the cores for each run on a machine.

A folder that a run writes into (train.py's --out-dir, an experiment's root, a warm-up being built in the
cache) is held with a lock file made atomically (O_CREAT | O_EXCL) that names the holder's PID, host and start
time. A second run on the same folder stops at once with one `error:` line naming that PID; a lock whose PID is
gone (a run killed with kill -9) is taken over with one line saying so; `wait=True` waits for the holder
instead (two runs building one warm-up: the second reuses what the first built). The holding process may take
its own lock again; it releases it when done, and at exit whatever happened.

Every held lock is also listed in a machine-wide folder (tempfile.gettempdir()/seed-runs), so a new run can see
how many others are alive and take its share of the cores (`share_of_cores`): on 2 cores two runs with 2 threads
each slowed about tenfold (docs/reliability.md). No departure from the paper.
"""
import atexit
import json
import os
import socket
import tempfile
import time

REGISTRY = os.path.join(tempfile.gettempdir(), "seed-runs")
LOCK_NAME = "run.lock"  # in an out dir or experiment root


class LockHeld(RuntimeError):
    """Another live process holds the folder's lock."""


def alive(pid):
    """True while a process with this PID runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def read_holder(path):
    """The lock file's {"pid", "host", "started", "what"}, or None when it is missing or unreadable."""
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def live_holder(path):
    """The holder of the lock file at `path` while it is alive (or on another host, where that cannot be
    known), else None."""
    holder = read_holder(path)
    here = holder is not None and holder.get("host") == socket.gethostname()
    if holder is None or (here and (holder["pid"] == os.getpid() or not alive(holder["pid"]))):
        return None
    return holder


class FolderLock:
    """The lock of one folder: `path` is the lock file. acquire() raises LockHeld with the message to show."""

    def __init__(self, path, what="a run"):
        self.path, self.what, self.held = path, what, False

    def acquire(self, wait=False, poll_seconds=5.0, say=print):
        folder = os.path.dirname(os.path.abspath(self.path))
        self.made_folder = not os.path.isdir(folder)
        waiting = False
        while True:
            try:
                os.makedirs(folder, exist_ok=True)
                handle = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileNotFoundError:  # the folder went with another holder's release: make it again
                continue
            except FileExistsError:
                holder = read_holder(self.path)
                if holder is None:  # being written this instant, or garbage left behind
                    if time.time() - os.path.getmtime(self.path) < 5:
                        time.sleep(0.2)
                        continue
                    say(f"{self.path}: an unreadable lock file, taken over")
                    os.remove(self.path)
                    continue
                same_host = holder.get("host") == socket.gethostname()
                if same_host and holder["pid"] == os.getpid():  # this process again (train.main in tests)
                    self.held = True
                    return self
                if same_host and not alive(holder["pid"]):
                    say(f"{os.path.dirname(self.path) or '.'}: took over the lock of PID {holder['pid']} "
                        f"({holder.get('what', 'a run')} started {holder.get('started', '?')}), which is gone")
                    os.remove(self.path)
                    continue
                if not wait:
                    where = "" if same_host else f" on host {holder.get('host')} (remove {self.path} if it is gone)"
                    raise LockHeld(f"{os.path.dirname(self.path) or '.'} is in use by PID {holder['pid']}{where} "
                                   f"({holder.get('what', 'a run')}, started {holder.get('started', '?')}): wait "
                                   "for it to finish or choose another folder")
                if not waiting:
                    say(f"{self.what}: waiting for PID {holder['pid']} ({holder.get('what', 'a run')}), which "
                        f"holds {os.path.dirname(self.path) or '.'}")
                    waiting = True
                time.sleep(poll_seconds)
                continue
            with os.fdopen(handle, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(), "what": self.what,
                           "started": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
            self.held = True
            _register(self)
            atexit.register(self.release)
            return self

    def release(self):
        if self.held:
            self.held = False
            for path in (self.path, _registry_entry(self)):
                try:
                    os.remove(path)
                except OSError:
                    pass
            if getattr(self, "made_folder", False):  # a failed start leaves no empty folder it made
                try:
                    os.rmdir(os.path.dirname(os.path.abspath(self.path)))
                except OSError:
                    pass

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _registry_entry(lock):
    return os.path.join(REGISTRY, f"{os.getpid()}-{abs(hash(os.path.abspath(lock.path)))}.json")


def _register(lock):
    try:
        os.makedirs(REGISTRY, exist_ok=True)
        with open(_registry_entry(lock), "w") as f:
            json.dump({"pid": os.getpid(), "lock": os.path.abspath(lock.path)}, f)
    except OSError:  # the registry only informs thread counts; a run never fails for it
        pass


def other_live_runs():
    """PIDs of other live processes on this machine that hold a lock (stale entries are cleaned up)."""
    pids = set()
    try:
        names = os.listdir(REGISTRY)
    except OSError:
        return pids
    for name in names:
        entry = read_holder(os.path.join(REGISTRY, name))
        if entry is None or entry["pid"] == os.getpid():
            continue
        if alive(entry["pid"]):
            pids.add(entry["pid"])
        else:
            try:
                os.remove(os.path.join(REGISTRY, name))
            except OSError:
                pass
    return pids


def share_of_cores(requested=0):
    """(threads, why): `requested` when above 0; else $OMP_NUM_THREADS when set (an experiment's split);
    else the cores this process may use divided among itself and the other live runs on the machine."""
    if requested > 0:
        return requested, "--threads"
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"]), "$OMP_NUM_THREADS"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    others = len(other_live_runs())
    threads = max(1, cores // (1 + others))
    return threads, f"{cores} cores" + (f" shared with {others} other run(s)" if others else "")
