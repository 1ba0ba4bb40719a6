"""One writer per run folder: `RunLock`, an exclusive flock on the folder's `.<name>.lock` (named by `io.RunDir`).

Every writer of a run holds it: a training (`experiments.train_run` and the Trainer's checkpointer), a pipeline
run (its runner), `workbench clean` and an `--overwrite`. A second writer is refused with `RunBusyError` naming
the holder (or, for a pipeline runner, waits for it), so two of them never interleave their files in one folder.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path

from .io import RunDir


class RunBusyError(OSError):
    """Another process holds the run folder's writer lock (it is training or executing there)."""


class RunLock:
    """The writer lock of a run folder: an exclusive `flock` on `.<name>.lock` beside it.

    Every writer of a run (a training, a pipeline run, `clean`, an `--overwrite`) holds it, so two of them
    never interleave their files in one folder. The kernel releases a flock when its process dies, so the
    lock is never stale; the file keeps the holder's PID, start time and what it does, which a refused
    writer names. Re-entrant within a process (train_run holds it, then the Trainer it makes).
    """

    _held: dict[str, list] = {}  # lock path -> [open file, depth] of this process

    def __init__(self, run_dir: str | os.PathLike, what: str, wait: bool = False):
        self.run_dir = Path(run_dir)
        self.path = RunDir(Path(os.path.abspath(run_dir))).lock
        self.what, self.wait = what, wait
        self.holding = False

    def acquire(self) -> RunLock:
        """Return self after taking the lock (waiting for it if `wait`); RunBusyError naming the holder otherwise."""
        import fcntl

        if self.holding:
            return self
        key = str(self.path)
        if key in RunLock._held:
            RunLock._held[key][1] += 1
            self.holding = True
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            raise RunBusyError(f"{str(self.run_dir)!r} is being written by another process "
                               f"({holder or 'it has not said which'}): wait for it to end or stop it; "
                               "nothing was changed") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}, since {_dt.datetime.now().isoformat(timespec='seconds')}, {self.what}")
        f.flush()
        RunLock._held[key] = [f, 1]
        self.holding = True
        return self

    def release(self) -> None:
        """Give the lock back (the file stays: removing it would race with a process about to lock it)."""
        if not self.holding:
            return
        import fcntl

        self.holding = False
        entry = RunLock._held[str(self.path)]
        entry[1] -= 1
        if entry[1] == 0:
            del RunLock._held[str(self.path)]
            fcntl.flock(entry[0], fcntl.LOCK_UN)
            entry[0].close()

    @staticmethod
    def busy(run_dir: str | os.PathLike) -> bool:
        """Return True when some process (this one included) holds the run folder's writer lock now."""
        import fcntl

        try:
            fd = os.open(RunDir(Path(os.path.abspath(run_dir))).lock, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a new open file: conflicts even with this process's lock
        except OSError:
            return True
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
