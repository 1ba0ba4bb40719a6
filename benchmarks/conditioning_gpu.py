"""The conditioning injection comparison (seeds/004) on one GPU, self-contained: plain, scalar, channel-wise and
dense initial-state injection, three seeds each, in one call.

`conditioning --profile injection` takes about 30 minutes a run on 2 AMX CPU cores (80-110 on fp32 CPUs), so its
scalar and channel arms did not fit the sessions' CPU time. This script trains the same runs, as the pipeline
expands them (the seeds profile's plain arm and the injection profile's three arms, seeds 0-2, the same params and
run keys' inputs), with the train notebook's own call (`train_run(**train_notebook_args(**params))`), in fp32
("auto" with WORKBENCH_BF16=off, as the CPU runs), all at once on the one GPU, one process each. The runs' text
comes from the Python there, whose standard library differs from the CPU machines' (3.12 against 3.11), so these
runs are compared with each other only, never with CPU runs. It writes the pipeline's layout under
ROOT/conditioning_h200/train/<key>/, so
`workbench.experiments.conditioning_findings.conditioning_claims(ROOT, "conditioning_h200")` reads them.

A deadline keeps the call inside its limit: every 15 s it reads each run's latest checkpoint step and, when the
slowest run would end after the deadline, stops the lowest-priority run still going (dense, then channel, then
scalar; plain last), which frees the GPU for the rest. After each run ends, the done runs' run.json and results.nc
are packed into PACK (a .tar). Measured on an H200 (2026-12-04, docs/benchmarks.md): the processes share the GPU
by time slices, so the aggregate stays near 80 steps/s (12 runs at 6.7 steps/s each, 3 at 27): the 12 runs need
about 20 minutes of GPU, more than a session's device time. Alone a process runs at about 25 steps/s; 5-7 at once
keep most of that (130-160 steps/s in all), so 6 runs (`--arms plain,I(scalar)`) fit in about 6 minutes. Run from
the repository root:

    python benchmarks/conditioning_gpu.py ROOT COMMIT [--deadline SECONDS] [--pack FILE.tar]

The H+LG ranking (families `combinations` and `combination_interaction`, pre-registered) on a GPU: `--arms
H+LG,I+H,I+LG --interaction` trains those 9 runs (about 96 s of GPU each at ~80-150 steps/s in all: 8-10 minutes)
and then probes each finished run's cross-loop response into ROOT/interaction.nc, packed beside the runs; on a
CPU, `--steps 2` makes it a 34 s dry run of the whole path (three runs).
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

PIPELINE = "conditioning_h200"
# kept longest first when the deadline sheds runs; the dense arm is replicated on CPU. The combinations (families
# `combinations` and `combination_interaction`, --profile combination_seeds) and their H+LG baseline come after:
# they are a call of their own (`--arms H+LG,I+H,I+LG --interaction`), GPU runs being compared with GPU runs only
PRIORITY = ("plain", "I(scalar)", "I(channel)", "I(dense)", "H+LG", "I+H", "I+LG", "I+H+LG")
INJECTION_ARMS = PRIORITY[:4]


def jobs(root: Path, steps: int = 0) -> list:
    """Return the train runs of the seeds profile, the injection profile and combination_seeds, keyed as the pipeline keys
    them, under ROOT/conditioning_h200/, in PRIORITY order (then seed); `steps` > 0 shortens them (a dry run)."""
    from workbench.experiments.conditioning_findings import arm_of
    from workbench.experiments.runs import train_notebook_args
    from workbench.pipeline.keys import expand
    from workbench.pipeline.spec import load_spec

    out = []
    for profile in ("seeds", "injection", "combination_seeds"):
        pipe = dataclasses.replace(load_spec("conditioning", profile), name=PIPELINE)
        for job in expand(pipe, root):
            if job.step != "train":
                continue
            arm = arm_of(train_notebook_args(**job.params)["model"])
            if arm in PRIORITY:
                out.append((arm, dataclasses.replace(job, params={**job.params, **({"steps": steps} if steps else {})})))
    return sorted(out, key=lambda aj: (PRIORITY.index(aj[0]), aj[1].params["seed"]))


def one(root: Path, key: str, commit: str, steps: int = 0) -> None:
    """Train one run (by key) and write its run.json as the pipeline runner does."""
    from workbench.experiments.runs import train_notebook_args, train_run
    from workbench.pipeline.keys import library_digest

    (arm, job), = [aj for aj in jobs(root, steps) if aj[1].key == key]
    t0, started = time.time(), datetime.now(timezone.utc).isoformat(timespec="seconds")
    run, ds = train_run(job.dir, **train_notebook_args(**job.params), resume=False, overwrite=True)
    (job.dir / "run.json").write_text(json.dumps({
        "pipeline": PIPELINE, "step": "train", "key": key, "status": "done", "error": None, "params": job.params,
        "started": started, "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - t0, 3), "library": library_digest(), "git_commit": commit,
        "device": "cuda"}, indent=1))
    print(f"{arm} seed {job.params['seed']} ({key}): {time.time() - t0:.0f} s, final loss {float(ds.final_loss):.3f}, "
          f"precision {ds.attrs.get('precision')}", flush=True)


def step_of(run_dir: Path) -> int:
    """Return the latest checkpoint's step of a run folder (0 before the first)."""
    steps = [int(p.name.split("-")[1]) for p in run_dir.glob("ckpt-*") if p.is_dir() and p.name[5:].isdigit()]
    return max(steps, default=0)


def pack(root: Path, dest: Path, done: list) -> None:
    """Write the done runs' run.json and results.nc (and the logs) into the tar `dest`, atomically."""
    tmp = dest.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        for job in done:
            for name in ("run.json", "results.nc"):
                tar.add(job.dir / name, arcname=f"{PIPELINE}/train/{job.key}/{name}")
        for log in sorted((root / "logs").glob("*.log")):
            tar.add(log, arcname=f"logs/{log.name}")
    tmp.replace(dest)


def main() -> None:
    """Run every job at once under a deadline, shedding the lowest-priority ones when the slowest would miss it."""
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("commit")
    ap.add_argument("--one")
    ap.add_argument("--deadline", type=float, default=520.0)
    ap.add_argument("--pack", type=Path)
    ap.add_argument("--steps", type=int, default=0, help="a dry run's training steps (0: the profile's)")
    ap.add_argument("--arms", default=",".join(INJECTION_ARMS),
                    help=f"comma-separated arms to train, of {list(PRIORITY)} (default: the injection comparison's four)")
    ap.add_argument("--interaction", action="store_true",
                    help="after the runs, probe each finished run's cross-loop response (interaction_by_run) into "
                         "ROOT/interaction.nc, packed beside the runs")
    a = ap.parse_args()
    if a.one:
        return one(a.root, a.one, a.commit, a.steps)
    t0 = time.time()
    arms = a.arms.split(",")
    unknown = [x for x in arms if x not in PRIORITY]
    if unknown:
        raise SystemExit(f"--arms: {unknown} are not among {list(PRIORITY)}")
    todo = [(arm, job) for arm, job in jobs(a.root, a.steps) if arm in arms]
    (a.root / "logs").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "WORKBENCH_BF16": "off", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = {}
    for arm, job in todo:
        log = open(a.root / "logs" / f"{arm.replace('(', '_').replace(')', '')}_s{job.params['seed']}.log", "w")
        procs[job.key] = (arm, job, subprocess.Popen([sys.executable, __file__, str(a.root), a.commit, "--one", job.key,
                                                      "--steps", str(a.steps)],
                                                     stdout=log, stderr=subprocess.STDOUT, env=env))
    steps_total = int(todo[0][1].params["steps"])
    names = [f"{arm} s{job.params['seed']}" for arm, job in todo]
    print(f"{len(procs)} runs started: {names}", flush=True)
    done, stopped, seen, history, last_stop = [], [], {}, {}, 0.0
    while any(p.poll() is None for _, _, p in procs.values()):
        time.sleep(15)
        now = time.time() - t0
        for key, (arm, job, p) in procs.items():
            if p.poll() is not None and key not in seen:
                seen[key] = p.returncode
                ok = p.returncode == 0 and (job.dir / "results.nc").exists() and key not in stopped
                print(f"{now:5.0f} s: {arm} s{job.params['seed']} ended rc={p.returncode}", flush=True)
                if ok:
                    done.append(job)
                    if a.pack:
                        pack(a.root, a.pack, done)
        going = [(arm, job, p) for arm, job, p in procs.values() if p.poll() is None]
        at = {job.key: step_of(job.dir) for _, job, _ in going}
        for key, st in at.items():
            history.setdefault(key, []).append((now, st))
        print(f"{now:5.0f} s: steps {sorted(at.values())}", flush=True)
        # the rate over the last 60 s, measured only after the last stop (the rest speed up when one stops: the
        # processes share the GPU by time slices), so a stop is judged on the rate it left
        recent = {k: [(t, st) for t, st in history[k] if t >= max(now - 60, last_stop + 15) and st > 0] for k in at}
        if not going or any(len(r) < 3 or r[-1][1] == r[0][1] for r in recent.values()):
            continue
        worst = max(now + (steps_total - r[-1][1]) * (r[-1][0] - r[0][0]) / (r[-1][1] - r[0][1]) + 40
                    for r in recent.values())  # + 40 s for the evaluation to 3K
        if worst > a.deadline:
            arm, job, p = max(going, key=lambda g: (PRIORITY.index(g[0]), g[1].params["seed"]))
            print(f"{now:5.0f} s: slowest run would end at {worst:.0f} s > {a.deadline:.0f} s: stopping {arm} "
                  f"s{job.params['seed']}", flush=True)
            p.terminate()
            stopped.append(job.key)
            last_stop = now
    print(f"done: {len(done)} runs in {time.time() - t0:.0f} s; stopped {len(stopped)}", flush=True)
    if a.interaction and done:  # the checkpoints stay on the device: the probe must run where they are
        from workbench.experiments.conditioning_findings import interaction_by_run

        inter = interaction_by_run([job.dir for job in done])
        inter.to_netcdf(a.root / "interaction.nc", engine="h5netcdf")
        if a.pack:
            with tarfile.open(a.pack, "a") as tar:
                tar.add(a.root / "interaction.nc", arcname=f"{PIPELINE}/interaction.nc")
        print(f"interaction: {dict(zip(inter.run.values.tolist(), inter.cross_loop.values.round(4).tolist()))} "
              f"({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
