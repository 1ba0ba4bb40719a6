"""Executing runs: the per-run lock, one notebook execution with its record, and the executors (local, Dask).

A run executes in ``runs/<pipeline>/<step>/.<key>.partial/`` (the notebook's working directory,
`out_dir="."`), under a per-run file lock, and is renamed to ``runs/<pipeline>/<step>/<key>/`` with a
run.json record when it ends, done or failed; a failed or interrupted run restarts in its old folder
(a training notebook resumes from its checkpoint). Runs of one step go in parallel through an executor
(local processes, or Dask: a scheduler's cluster or a LocalCluster of this machine, each run's torch
threads its worker's share of the cores); a failed run is recorded with its error and output notebook
and the others go on (on Dask too when a worker dies mid-run).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import shutil
import tempfile
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from ..io import RunDir, atomic_write_bytes, read_record
from ..locking import RunLock
from .keys import library_digest
from .spec import PipelineError, RunJob, _done

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# papermill's default is 60 s; a kernel starting beside runs that hold every core of a 2-core machine
# has taken longer than that (a fresh-clone CI run failed an allocation smoke sweep so), and a run that
# fails only to start is lost work
KERNEL_START_TIMEOUT = 300


def work_dir(run_dir: Path) -> Path:
    """Return the folder a run executes in before it is renamed to run_dir: .<key>.partial beside it."""
    # hidden (a leading dot), so a glob over a step's finished runs never picks it up
    return RunDir(run_dir).partial


def now() -> str:
    """Return the current UTC time as an ISO string to the second."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def socket_kernel_manager_class():
    """Return a kernel manager class whose kernel talks over Unix sockets of its own (TCP where there are none)."""
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import CaselessStrEnum

    class SocketKernelManager(AsyncKernelManager):
        # jupyter_client picks "free" TCP ports by binding and releasing them, so two kernels started at once
        # (parallel runs, another pipeline, a test beside it) can pick the same port and one dies at start
        # (its known race; a CI run lost a run to it). A socket path of our own cannot be taken by another;
        # it is kept short because a socket path has at most 107 bytes.
        transport = CaselessStrEnum(["tcp", "ipc"], default_value="ipc" if os.name == "posix" else "tcp")

        def _ip_default(self) -> str:
            if self.transport != "ipc":
                return super()._ip_default()
            tmp = tempfile.gettempdir()
            return os.path.join(tmp if len(tmp) < 64 else "/tmp", f"wb-kernel-{uuid.uuid4().hex[:16]}")

    return SocketKernelManager


def _kernel_manager_class():
    """Return a socket kernel manager class for one run: the kernel's stderr goes to kernel.log in its working
    directory; while a cell executes its shutdown gives the kernel time to save, once all are done it kills it at once
    (`cell_hooks` tells it which)."""

    from traitlets import Float

    class RunKernelManager(socket_kernel_manager_class()):
        # a kernel shut down while busy (Ctrl-C of a runner executing runs itself) gets SIGINT, SIGTERM half this
        # later, then SIGKILL: jupyter_client's 5 s sent SIGTERM 2.5 s after SIGINT, while the training was
        # still finishing its step and saving, and a second signal stops a training unsaved
        shutdown_wait_time = Float(2.0 * KERNEL_SAVE_SECONDS)
        executing = False  # a cell is executing (one class per run, so this is the run's own state)

        @classmethod
        def cell_hooks(cls) -> dict:
            """Return nbclient's cell hooks that keep `executing` up to date (papermill passes them on)."""
            def busy(**_):
                cls.executing = True

            def idle(**_):
                cls.executing = False
            return {"on_cell_execute": busy, "on_cell_executed": idle, "on_cell_error": idle}

        async def shutdown_kernel(self, now: bool = False, restart: bool = False) -> None:
            """Return None once the kernel is shut down; a kernel whose cells are all done is stopped at once."""
            # With every cell done (papermill has each cell's outputs, and the library's writers are atomic and
            # finished) there is nothing left to save, so the kernel's process group is killed rather than asked
            # to exit: a graceful exit of a kernel that imported torch spent 0.8 s of CPU tearing the interpreter
            # down (2026-12-07, Xeon: 0.21 s for a bare kernel), once per run, and ipykernel 7.4's exit can
            # also deadlock after its shutdown reply (1 idle shutdown in 5-15 took 10 s or 60 s)
            if not type(self).executing and not restart:
                now = True
            await super().shutdown_kernel(now=now, restart=restart)

        # the kernel's own log lines (and any C-level crash message) stay with the run, not on the terminal
        async def _async_launch_kernel(self, kernel_cmd, **kw):
            with open(RunDir(kw.get("cwd") or ".").kernel_log, "ab") as log:
                kw["stderr"] = log
                return await super()._async_launch_kernel(kernel_cmd, **kw)

    return RunKernelManager


@contextlib.contextmanager
def _claimed(job: RunJob) -> Iterator[tuple[Path, Path, dict | None]]:
    """Yield (final folder, working folder, the skipped record if the run is already done, else None) under its lock."""
    final = Path(job.dir)
    # another runner executing the same run makes us wait, then skip; a training writing there, too
    with RunLock(final, f"pipeline {job.pipeline}, step {job.step}", wait=True):
        rec = read_record(final)
        done = {**rec, "skipped": True} if _done(rec) else None
        yield final, work_dir(final), done


def execute_run(job: RunJob) -> dict:
    """Return the run's record after executing its notebook (or the existing record if it already completed).

    Never raises for a failing notebook: the error and the output notebook are recorded instead.
    """
    from unittest import mock  # here, not at the top: it imports asyncio, which a re-run that executes nothing skips

    import papermill
    from papermill.exceptions import PapermillExecutionError

    # Ctrl-C that lands inside nbclient's event loop (a run executed in this process) can leave its kernel-alive
    # poll created but never awaited; Python then warns about it at exit, two lines after the runner's one-line
    # "interrupted" message (a CI run failed on it). Nothing was lost: the kernel saved and the run resumes.
    warnings.filterwarnings("ignore", message=r"coroutine 'NotebookClient\._async_poll_kernel_alive' was never awaited",
                            category=RuntimeWarning)
    with _claimed(job) as (final, work, done):
        if done is not None:
            return done
        if final.exists():  # a failed attempt: restart in its folder so checkpoints are reused
            if work.exists():
                shutil.rmtree(work)
            os.replace(final, work)
            RunDir(work).record.unlink(missing_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        RunDir(work).progress.unlink(missing_ok=True)  # an earlier attempt's: live progress must show this one
        # the kernel inherits the thread count (parallel runs share the cores); patch.dict puts the caller's
        # environment back after a run executed in this process (one job at a time)
        threads = {var: str(job.threads) for var in THREAD_VARS} if job.threads else {}
        started, t0 = now(), time.perf_counter()
        error = None
        manager = _kernel_manager_class()
        with mock.patch.dict(os.environ, threads):
            try:
                papermill.execute_notebook(str(job.notebook), str(RunDir(work).notebook),
                                           parameters={**job.params, "out_dir": "."}, cwd=str(work),
                                           kernel_name="python3", progress_bar=False, log_output=False,
                                           start_timeout=KERNEL_START_TIMEOUT,
                                           kernel_manager_class=manager, **manager.cell_hooks())
            except PapermillExecutionError as e:
                error = f"{e.ename}: {e.evalue} (cell {e.exec_count})"
            except Exception as e:  # kernel died, notebook unreadable, ...: still a recorded failure
                error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        return _close_run(work, final, _record(job, error, started, time.perf_counter() - t0))


def _record(job: RunJob, error: str | None, started: str, seconds: float) -> dict:
    """Return the run.json record of a run that ended (done when error is None, else failed)."""
    from .. import __version__
    from ..io import git_commit

    return {"pipeline": job.pipeline, "step": job.step, "key": job.key,
            "status": "failed" if error else "done", "error": error,
            "notebook": str(job.notebook), "params": job.params, "upstream": job.upstream,
            "started": started, "finished": now(), "seconds": round(seconds, 3),
            "workbench_version": __version__, "library": job.library or library_digest(),
            "git_commit": git_commit()}


def _close_run(work: Path, final: Path, record: dict) -> dict:
    """Return the record after writing it into the run's working folder and renaming that into place."""
    atomic_write_bytes(RunDir(work).record, json.dumps(record, indent=1, default=str).encode())
    os.replace(work, final)
    # the kernel's training held the working folder's own lock (..<key>.partial.lock); only a runner holding
    # the final folder's lock, as this one does, ever makes that folder, so its lock file can go
    RunDir(work).lock.unlink(missing_ok=True)
    return record


def record_failed(job: RunJob, error: str) -> dict:
    """Return the failed record written for a run that ended without recording itself (whatever ran it died).

    Takes the run's lock (a dead process holds none), keeps what the run left (checkpoints, a partial
    notebook) and renames its working folder into place with run.json saying why, so `status` shows it
    failed and the next `workbench run` restarts it there. A run that completed meanwhile is left alone.
    """
    with _claimed(job) as (final, work, done):
        if done is not None:
            return done
        if final.exists():
            if work.exists():  # an older failed attempt beside the newer partial one: the newer one stays
                shutil.rmtree(final)
            else:
                os.replace(final, work)
        work.mkdir(parents=True, exist_ok=True)
        RunDir(work).record.unlink(missing_ok=True)
        return _close_run(work, final, _record(job, error, now(), 0.0))


# ---- executors -------------------------------------------------------------------------------------------
def _check_threads(threads: object, default: str) -> int:
    """Return `threads` once it is an integer >= 0 (0: `default`, which the error message names)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise PipelineError(f"threads={threads!r} is invalid: must be an integer >= 1, or 0 ({default})")
    return threads


def _check_jobs(jobs: object) -> int:
    """Return `jobs` once it is an integer >= 1."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise PipelineError(f"jobs={jobs!r} is invalid: must be an integer >= 1")
    return jobs


def _pool_context():
    """Return the local executor's process context: a fork server that imported the runner's modules once, where
    the platform has one (POSIX), else spawn.

    Spawned, every worker of every step imported papermill afresh, 2.3 s on an fp32 EPYC (nbformat's jsonschema
    1.5 s of it), before its first run; a fork server imports it once per runner and forks ready workers. Its
    children are forked from a process that started with no threads, so forking is safe (forking the runner
    itself, with torch's and zmq's threads, is not).
    """
    import multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["workbench.pipeline.execute", "papermill"])  # once the server started: ignored
    return ctx


def _pool_worker_start(environ: dict) -> None:
    """Return None once a pool worker ignores Ctrl-C and holds the runner's environment as it is now.

    The runner stops its workers itself (stop_started): reacting to Ctrl-C themselves, they took the next queued
    run (and leaving the pool waited for it whole), or papermill shut their kernel down before its training had
    saved. A fork server's children inherit the server's environment, from when it started; a spawned worker
    got the runner's at the time, and so does this one, so every kernel sees what the runner sees.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(environ)


class LocalExecutor:
    """Runs jobs in local processes (`jobs` at once; in this process when jobs == 1 or a step has one run).

    Each run's kernel gets `threads` torch threads; with 0, the machine's cores over the runs executing
    at once (so a step's lone run gets them all, which oversubscribes cores other work is using).
    """

    def __init__(self, jobs: int = 1, threads: int = 0):
        self.jobs = _check_jobs(jobs)
        self.threads = _check_threads(threads, "the machine's cores over the runs executing at once")

    def map(self, fn: Callable[[RunJob], dict], items: list[RunJob]) -> Iterator[dict]:
        """Return an iterator over fn(item) results in completion order."""
        alone = self.jobs == 1 or len(items) <= 1  # executed here, one at a time, with the caller's threads
        for it in items:
            it.threads = self.threads or (0 if alone else max(1, machine_cores() // min(self.jobs, len(items))))
        if alone:
            yield from map(fn, items)
            return
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(min(self.jobs, len(items)), mp_context=_pool_context(),
                                 initializer=_pool_worker_start, initargs=(dict(os.environ),)) as pool:
            futures = [pool.submit(fn, it) for it in items]
            try:
                for f in as_completed(futures):
                    yield f.result()
            except BaseException:  # Ctrl-C (or the caller stopped reading): start nothing more; kernels save
                for f in futures:  # what no worker holds yet; stop_started stops the workers and their kernels
                    f.cancel()
                stop_started()
                # the with-block's shutdown then joins the pool's manager thread. An earlier shutdown(wait=False)
                # here let go of it, and Python's exit raced the still-running thread for its wake-up pipe: a
                # traceback under Ctrl-C's one line (concurrent.futures' _python_exit; seen once at -n 2)
                raise

    def close(self) -> None:
        """Return None; nothing to release."""


# Seconds a runner that is stopping waits for its kernels to save their checkpoints and exit (a training saves
# after its current step: well under a minute for every laptop profile, SmolLM2's retrofit included).
KERNEL_SAVE_SECONDS = 60


def stop_started(timeout: float = KERNEL_SAVE_SECONDS) -> None:
    """Return None after stopping every process this one started, each kernel first saving what it can.

    Signalling workers and kernels at once lost checkpoints: a worker died at once, and ipykernel's parent
    poller then ended its kernel (os._exit) while the kernel's training was still writing the checkpoint its
    SIGTERM asked for. So the workers (pool or Dask processes: this process's session) are paused first (a
    paused parent is still a parent), the kernels (each leads a session of its own) get SIGTERM and `timeout`
    seconds to save and exit, and only then are the workers resumed into their own SIGTERM.
    """
    import psutil

    me = os.getsid(0)
    procs = psutil.Process().children(recursive=True)
    kernels = [p for p in procs if _leads_own_session(p, me)]
    inside = {c.pid for k in kernels for c in _children(k)}  # a kernel's own children are its to stop
    workers = [p for p in procs if p not in kernels and p.pid not in inside]
    for p in workers:
        _signal(p, "suspend")
    for p in kernels:
        _signal(p, "terminate")
    deadline = time.monotonic() + timeout
    while (alive := [p for p in kernels if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in alive:  # a kernel stuck in a native call: it cannot save; do not hang the runner on it
        _signal(p, "kill")
    for p in workers:
        _signal(p, "terminate")
        _signal(p, "resume")  # the pending SIGTERM is delivered as it continues


def _leads_own_session(p, session: int) -> bool:
    """Return whether process p leads a session other than `session` (how a kernel is started)."""
    try:
        return os.getsid(p.pid) == p.pid != session
    except (ProcessLookupError, PermissionError):
        return False


def _running(p) -> bool:
    """Return whether p still runs: a kernel that exited stays a zombie until its paused worker reaps it."""
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _children(p) -> list:
    """Return p's descendants, or [] when p is gone."""
    import psutil

    try:
        return p.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _signal(p, how: str) -> None:
    """Return None after calling p.<how>() (suspend, resume, terminate, kill); a process already gone is skipped."""
    import psutil

    try:
        getattr(p, how)()
    except psutil.NoSuchProcess:
        pass


def _quiet_on_ctrl_c(start: Callable):
    """Return start() called with SIGINT ignored, so the processes it spawns ignore a terminal's Ctrl-C.

    A local Dask cluster's workers died at Ctrl-C and their kernels went with them (ipykernel's parent poller)
    before the trainings saved; the runner stops them in order instead (stop_started).
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return start()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return start()
    finally:
        signal.signal(signal.SIGINT, before)


def _quiet_distributed_logs() -> None:
    """Return None after raising every `distributed` logger of this process to CRITICAL (a teardown it started)."""
    import logging

    # the children dask configured apart (distributed.client) do not inherit the parent's level
    for name in {"distributed", *(n for n in logging.root.manager.loggerDict if n.startswith("distributed."))}:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def machine_cores() -> int:
    """Return the CPU cores this process may use (its affinity mask, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity masks here (macOS)
        return max(1, os.cpu_count() or 1)


def _attempt_marker(run_dir: Path) -> Path:
    """Return the file naming the Dask attempt executing a run (.<key>.attempt beside its folder)."""
    return RunDir(run_dir).attempt


def _dask_execute(job: RunJob, shares: dict[str, int], attempt: str, threads: int = 0) -> dict:
    """Return execute_run(job) on a Dask worker, its kernel given this worker's share of the host's cores.

    `shares` maps hosts to torch threads per run, so a worker the nanny restarted (a new address)
    still gets its host's share; a worker on a host that joined later takes that host's cores over its
    own task slots; `threads` > 0 overrides it. A run that this same attempt
    already started on a worker that then died (the scheduler hands its task to another worker) is
    recorded failed, not rerun: what killed the worker (memory, a crash) would likely kill the next too.
    """
    from distributed import get_worker

    worker = get_worker()
    share = shares.get(worker.host) or max(1, machine_cores() // max(1, worker.state.nthreads))
    job.threads = threads or share
    marker = _attempt_marker(Path(job.dir))
    if marker.is_file() and marker.read_text() == attempt:
        return record_failed(job, "WorkerDied: the Dask worker executing this run died before it ended "
                                  "(killed, out of memory or lost); `workbench run` again restarts it")
    atomic_write_bytes(marker, attempt.encode())
    try:
        return execute_run(job)
    finally:
        marker.unlink(missing_ok=True)


class DaskExecutor:
    """Runs jobs on a Dask `distributed` cluster (workers must share the runs folder's file system).

    With a scheduler address it connects to that cluster; without one it starts a LocalCluster sized to
    this machine: `jobs` workers when jobs > 1, else one per core, each running one run at a time.
    Every run's kernel gets torch threads from its worker's share of the host's cores (the host's
    cores over the task slots of all workers on that host; `threads` > 0 fixes it). Without it a
    kernel would take what its worker's environment says: 1 under a Dask nanny, which sets
    OMP_NUM_THREADS=1 in its workers (a 32-core host with 2 workers would run 2 threads), all the cores
    without one (2 workers on 2 cores would run 4 threads). A worker that dies mid-run leaves that run failed
    (`record_failed`) and the others go on.
    """

    def __init__(self, scheduler: str | None = None, jobs: int = 1, threads: int = 0):
        try:
            from distributed import Client, LocalCluster
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise PipelineError("executor='dask' needs dask.distributed: pip install 'looped-workbench[cluster]'") from e
        _check_jobs(jobs)
        _check_threads(threads, "each worker's share of its host's cores")
        if scheduler is not None and (not isinstance(scheduler, str) or not scheduler.strip()):
            raise PipelineError(f"scheduler={scheduler!r} is invalid: must be a Dask scheduler address such as "
                                "tcp://127.0.0.1:8786, or None to start a local cluster")
        self.cluster = None
        if scheduler is None:
            n = jobs if jobs > 1 else machine_cores()
            self.cluster = _quiet_on_ctrl_c(lambda: LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                                                  dashboard_address=None))
            scheduler = self.cluster.scheduler_address
        try:
            # not the process's default: a Client that failed to connect stayed dask's global scheduler until
            # garbage-collected, and a later xarray or dask computation in the same process tried to reach it
            self.client = Client(scheduler, timeout="30s", set_as_default=False)
        except (OSError, ValueError, TypeError) as e:  # unreachable (after the timeout) or not an address at all
            if self.cluster is not None:
                self.cluster.close()
            raise PipelineError(f"scheduler={scheduler!r}: cannot connect to a Dask scheduler there "
                                f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); give an address such as "
                                "tcp://127.0.0.1:8786, or leave --scheduler out to start a local cluster") from None
        self.threads = threads
        self.shares = self._shares()

    def _shares(self) -> dict[str, int]:
        """Return {host: torch threads per run}: the host's cores over the task slots of its workers."""
        if self.cluster is not None:
            self.client.wait_for_workers(len(self.cluster.workers), timeout="60s")
        workers = self.client.scheduler_info(n_workers=-1)["workers"]
        cores = self.client.run(machine_cores)  # each worker's own view of its host
        slots: dict[str, int] = {}
        for w in workers.values():
            slots[w["host"]] = slots.get(w["host"], 0) + int(w["nthreads"])
        return {w["host"]: max(1, cores.get(addr, 1) // max(1, slots[w["host"]])) for addr, w in workers.items()}

    def map(self, fn: Callable[[RunJob], dict], items: list[RunJob]) -> Iterator[dict]:
        """Return an iterator over the runs' records in completion order (a run whose worker died: failed)."""
        import uuid

        from distributed import as_completed

        attempt = uuid.uuid4().hex  # tells a task the scheduler retried after its worker died from a new one
        futures = {}
        for it in items:
            task = (_dask_execute, it, self.shares, attempt, self.threads) if fn is execute_run else (fn, it)
            futures[self.client.submit(*task, pure=False, key=f"{it.step}-{it.key}-{time.time_ns()}")] = it
        try:
            for f in as_completed(futures, loop=self.client.loop):  # this client's loop: not dask's default
                try:
                    yield f.result()
                except Exception as e:  # the scheduler gave up on it (a worker died too often, lost data)
                    yield record_failed(futures[f], f"{type(e).__name__}: {e} (on the Dask cluster)")
        except BaseException:  # Ctrl-C: the local cluster's workers ignored it; their kernels save, then all stop
            if self.cluster is not None:
                # the cluster's scheduler and nannies live in this process and log what the teardown does to
                # them ("Restarting worker" in a CI run; "Batched Comm Closed" with a traceback here, at INFO,
                # after LocalCluster's own silencing had ended): beside the runner's one line that is noise
                _quiet_distributed_logs()
                # a nanny restarts a worker that exits while it runs: tell them the workers stopping next are
                # meant to stop
                for nanny in self.cluster.workers.values():  # processes=True: each worker has a nanny
                    nanny.close_gracefully(reason="workbench run interrupted")
                stop_started()
            raise

    def close(self) -> None:
        """Return None after closing the client connection (and the local cluster this executor started)."""
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()


def make_executor(kind: str = "local", jobs: int = 1, scheduler: str | None = None, threads: int = 0):
    """Return an executor: "local" (processes, `jobs` at once) or "dask" (a scheduler address, or a LocalCluster
    sized to this machine when None); `threads` is the torch threads per run (0: the cores over the runs at once
    locally, each worker's share on Dask)."""
    if kind == "local":
        return LocalExecutor(jobs, threads)
    if kind == "dask":
        return DaskExecutor(scheduler or None, jobs, threads)
    raise PipelineError(f"executor={kind!r} is invalid: must be 'local' or 'dask'")
