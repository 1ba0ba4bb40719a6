"""Live progress: what `workbench run` shows while runs execute (LiveProgress), and a finished run's training line.

A run is executing while its lock is held, and its Trainer rewrites progress.json in its working folder
every second, so progress shows alike for runs in this process, in worker processes and on Dask workers
sharing the file system.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from ..io import RunDir, read_progress
from ..locking import RunLock
from .execute import work_dir
from .spec import RunJob


def _clock(seconds: float) -> str:
    """Return seconds as m:ss, or h:mm:ss from an hour on."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def progress_text(job: RunJob, progress: dict | None, elapsed: float) -> str:
    """Return one line saying what a running run is doing: its pipeline step, key and time so far, and from its
    progress.json (the Trainer writes one) the training step of the total, tokens/s, time left and loss."""
    head = f"[{job.step}] {job.key} {_clock(elapsed)}"
    p = progress or {}
    phase = p.get("phase")
    if phase is None or not isinstance(p.get("total"), int):
        return f"{head} running"
    step, total = p.get("step", 0), p["total"]
    how = f"{p.get('precision', '?')}, compile {p.get('compile', '?')}"
    if phase == "compiling":
        return f"{head} compiling the blocks, then {total} steps ({how})"
    parts = [f"{head} step {step}/{total}"]
    if phase in ("evaluating", "done", "failed"):
        parts.append(phase)
    if p.get("tokens_per_s"):
        parts.append(f"{p['tokens_per_s']:,.0f} tok/s")
    if p.get("eta_s") is not None and phase == "training":
        parts.append(f"ETA {_clock(p['eta_s'])}")
    if p.get("loss") is not None:
        parts.append(f"loss {p['loss']:.3f}")
    return " · ".join(parts) + f" ({how})"


def trained_text(run_dir: Path | None) -> str:
    """Return " (N steps at T tok/s, precision, compile on/off)" for a run folder with a progress.json, else ""."""
    p = read_progress(run_dir) if run_dir is not None else None
    if p is None or not isinstance(p.get("total"), int):
        return ""
    rate = f" at {p['tokens_per_s']:,.0f} tok/s" if p.get("tokens_per_s") else ""
    return f" ({p.get('step')} steps{rate}, {p.get('precision', '?')}, compile {p.get('compile', '?')})"


class LiveProgress:
    """What `workbench run` shows while runs execute: which run, its training step of the total, tokens/s
    and time left (read from the run's progress.json, which the Trainer rewrites every second).

    On a terminal one status line is redrawn every `every` seconds (default 0.5); elsewhere (a log, a
    pipe) plain lines: one when a run is first seen executing or changes phase, then one per running
    run every `every` seconds (default 5). A run is executing while its lock is held, so this works
    for runs in this process, in worker processes and on Dask workers sharing the file system.
    """

    def __init__(self, stream=None, every: float | None = None):
        self.stream = stream if stream is not None else sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every if every is not None else (0.5 if self.tty else 5.0)
        self.jobs: dict[str, RunJob] = {}
        self._seen: dict[str, tuple[float, str | None]] = {}  # key -> (first seen, last phase printed)
        self._printed = 0.0
        self._status = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="workbench-progress", daemon=True)

    def start(self) -> "LiveProgress":
        """Return self after starting the watcher thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the watcher thread and clear the status line."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            self._clear()
            self._status = ""

    def watch(self, jobs: Iterable[RunJob]) -> None:
        """Add runs that may execute from now on."""
        with self._lock:
            self.jobs.update((j.key, j) for j in jobs)

    def finished(self, key: str) -> None:
        """Stop watching a run (its end line is printed by the caller through `say`)."""
        with self._lock:
            self.jobs.pop(key, None)
            self._seen.pop(key, None)

    def say(self, text: str) -> None:
        """Print a line of the pipeline's own output, below (and never through) the status line."""
        with self._lock:
            self._clear()
            print(text, file=self.stream, flush=True)
            self._draw()

    def _clear(self) -> None:
        """Erase the status line (on a terminal, when one is shown)."""
        if self.tty and self._status:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def _draw(self) -> None:
        """Redraw the status line, cut to the terminal's width (on a terminal, when there is one)."""
        if self.tty and self._status:
            width = shutil.get_terminal_size((120, 24)).columns - 1
            self.stream.write("\r" + self._status[:width] + "\x1b[K")
            self.stream.flush()

    def _loop(self) -> None:
        """Tick until stopped (the watcher thread's body)."""
        while not self._stop.wait(min(0.5, self.every)):
            try:
                self.tick()
            except Exception:  # showing progress must never break a pipeline
                pass

    def tick(self) -> None:
        """Look at the watched runs once and print or redraw what they are doing."""
        now = time.monotonic()
        with self._lock:
            jobs = list(self.jobs.values())
        lines = []
        fresh = False
        for job in jobs:
            run = RunDir(job.dir)
            if not RunLock.busy(run.path) or run.record.exists():
                continue
            first, phase_shown = self._seen.get(job.key, (now, None))
            prog = read_progress(work_dir(job.dir))  # execute_run removed any left by an earlier attempt
            phase = (prog or {}).get("phase", "running")
            fresh |= phase != phase_shown
            self._seen[job.key] = (first, phase)
            lines.append(progress_text(job, prog, now - first))
        with self._lock:
            if self.tty:
                self._status = " | ".join(lines)
                if self._status:
                    self._draw()
                else:
                    self._clear()
            elif lines and (fresh or now - self._printed >= self.every):
                self._printed = now
                for line in lines:
                    print(line, file=self.stream, flush=True)
