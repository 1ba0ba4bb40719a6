"""The `workbench` command."""

from __future__ import annotations

import argparse
import sys
import time

from . import __version__


def demo(steps: int = 200, seed: int = 0, max_loops: int = 8, progress: bool = True) -> dict[int, float]:
    """Return validation loss per loop count after training a tiny byte-level looped LM on the stdlib."""
    import torch

    from .evals import loop_sweep
    from .experiments import demo_trainer

    print(f"workbench {__version__}: training the demo model (byte-level 1+2x4+1, d=128) on 1.9 MB of "
          f"standard-library source for {steps} steps")
    t0 = time.perf_counter()
    trainer = demo_trainer(steps, seed, progress)
    cfg, metrics = trainer.cfg, trainer.metrics_dataset()
    print(f"trained in {time.perf_counter() - t0:.1f} s; final train loss {float(metrics.loss[-1]):.3f}")
    ds = loop_sweep(trainer.model, torch.cat(trainer.val_batches), list(range(1, max_loops + 1)), progress=False)
    losses = {int(r): float(v) for r, v in zip(ds.loop.values, ds.loss.values)}
    print(f"validation loss per loop count (trained at K={cfg.loops}; one trace pass):")
    for r, v in losses.items():
        mark = "  <- K" if r == cfg.loops else ""
        print(f"  r={r:2d}  loss={v:.3f}  bits/byte={v / 0.6931:.3f}{mark}")
    return losses


def _json_file(flag: str, path: str | None, what: str) -> dict:
    """Return the JSON object in the file a flag names ({} without one); ValueError naming flag and file otherwise."""
    import json
    from pathlib import Path

    from .config import strict_json

    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{flag}={path!r} is invalid: no such file (give a JSON file of {what} fields)")
    try:
        data = strict_json(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}={path!r} is invalid: the file is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag}={path!r} is invalid: the file must hold a JSON object of {what} fields, "
                         f"got {type(data).__name__} {json.dumps(data)[:80]}")
    return data


def train(args: argparse.Namespace) -> int:
    """Return 0 after training a LoopLM on a corpus into the run folder --out (the layout of `workbench.io`).

    The run goes through `experiments.train_run`, the same code as the train notebook and the pipeline,
    so `load_run`, the sweep notebooks and the explorer open it. Every flag and config field is checked
    before anything is written; an existing run folder is refused unless --resume or --overwrite.
    """
    from pathlib import Path

    from .config import check_int, fail
    from .experiments import train_run
    from .io import holds_run

    if not args.out.strip():
        fail("--out", args.out, "must name a run folder")
    out = Path(args.out)
    model_fields = _json_file("--config", args.config, "LoopConfig")
    train_fields = _json_file("--train-config", args.train_config, "TrainConfig")
    if args.steps is not None:
        train_fields["steps"] = check_int("--steps", args.steps, 1)
    if args.seed is not None:
        train_fields["seed"] = check_int("--seed", args.seed, 0)
    for key in ("bf16", "compile"):  # flags override the train config; unset, the config's (default "auto") stands
        if getattr(args, key) is not None:
            train_fields[key] = getattr(args, key)
    if args.resume and args.overwrite:
        fail("--overwrite", True, "cannot be combined with --resume: continue the run or replace it, not both")
    if args.resume and not holds_run(out):  # a typo in the folder would otherwise start a fresh run quietly
        why = "no such folder" if not out.exists() else "no config.json, tokenizer.json or checkpoint in it"
        fail("--out", args.out, f"holds no run to resume ({why}): check the path, or leave out --resume to start "
             "a run there")
    if not args.resume and not args.overwrite and holds_run(out):
        fail("--out", args.out, "already holds a run (config.json, tokenizer.json or checkpoints): add --resume to "
             "continue it or --overwrite to replace it; nothing was changed")
    if all(train_fields.get(k) is None or train_fields.get(k) is False for k in ("steps", "tokens", "flops", "chinchilla")):
        train_fields["steps"] = 200  # no budget given at all (a 0 is given, and TrainConfig rejects it)
    train_fields.setdefault("progress", not args.no_progress)
    train_fields.setdefault("eval_every", 50)
    run, ds = train_run(out, model_fields, train_fields, corpus=args.corpus, vocab_size=args.vocab_size,
                        seed=train_fields.get("seed", 0), progress=not args.no_progress, resume=args.resume,
                        overwrite=args.overwrite)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_rank() > 0):  # torchrun: rank 0 says it
        world = f" on {dist.get_world_size()} processes" if dist.is_available() and dist.is_initialized() else ""
        print(f"trained {run.model.cfg.notation} for {ds.sizes['step']} steps{world}; final loss "
              f"{float(ds.train_loss[-1]):.3f}; run folder {out} (config.json, tokenizer.json, checkpoints, "
              "metrics.nc, results.nc)")
    return 0


def _train_cmd(args: argparse.Namespace) -> int:
    """Return the exit status of `workbench train`: one line per error (a traceback only with --debug)."""
    from .train import Diverged

    try:
        return train(args)
    except KeyboardInterrupt:  # the Trainer saved a checkpoint and said where before this arrives
        if args.debug:
            raise
        print(f"workbench train: interrupted; `workbench train --out {args.out} --resume ...` continues the run",
              file=sys.stderr)
        return 130
    except Diverged as e:  # the run is marked failed; its last finite checkpoint stays
        if args.debug:
            raise
        print(f"workbench train: {e}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, OSError) as e:  # bad input, an existing run, an unreadable file
        if args.debug:
            raise
        msg = " ".join(str(e).split())
        print(f"workbench train: {msg} (run with --debug for the traceback)", file=sys.stderr)
        return 2
    finally:  # under torchrun: leave the process group cleanly (NCCL warns at exit otherwise)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def export(args: argparse.Namespace) -> int:
    """Return 0 after writing the run folder RUN as a Hugging Face model folder DIR (`models.hf_looped.export`).

    DIR holds config.json (the LoopConfig and the loop count in use), model.safetensors,
    generation_config.json and the tokenizer files; after `import workbench.models.hf_looped` it opens
    with AutoModelForCausalLM and AutoTokenizer. RUN and DIR are checked before anything is written.
    """
    from pathlib import Path

    from .config import check_int, fail
    from .io import find_run, open_run

    loops = None if args.loops is None else check_int("--loops", args.loops, 1, allowed="must be an integer >= 1 "
                                                      "(the number of passes through the core)")
    try:
        run_dir, _ = find_run(args.run)
    except FileNotFoundError as e:
        raise ValueError(f"RUN={args.run!r} is not a run folder: {e}") from None
    from .models import hf_looped

    out = Path(args.dir).expanduser()
    if out.is_dir() and (out.resolve() == run_dir.resolve() or _holds_training_run(out)):
        fail("DIR", args.dir, "holds a training run: give another folder (an export never replaces a run)")
    hf_looped.check_export_target(out, args.overwrite)
    model, tokenizer = open_run(args.run, device="cpu")
    hf_looped.export(model, tokenizer, out, loops=loops, overwrite=args.overwrite)
    r = model.cfg.loops if loops is None else loops
    print(f"exported {model.cfg.notation} (loops={r}) from {run_dir} to {out}: config.json, model.safetensors, "
          "tokenizer files; open it after `import workbench.models.hf_looped` with "
          f"AutoModelForCausalLM.from_pretrained({str(out)!r}) (any loop count: model(ids, loops=r))")
    return 0


def _holds_training_run(folder) -> bool:
    """Return True if the folder holds a training run's files (an export holds config.json and tokenizer.json too)."""
    import json

    from .io import LATEST, RUN_CONFIG, RunDir

    if (folder / LATEST).exists() or RunDir(folder).checkpoints():
        return True
    try:
        data = json.loads((folder / RUN_CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"model", "train"} <= set(data)


def _export_cmd(args: argparse.Namespace) -> int:
    """Return the exit status of `workbench export`: one line per error (a traceback only with --debug)."""
    try:
        return export(args)
    except (ValueError, TypeError, OSError, ImportError) as e:  # bad input, a missing extra, an unreadable file
        if args.debug:
            raise
        msg = " ".join(str(e).split())
        print(f"workbench export: {msg} (run with --debug for the traceback)", file=sys.stderr)
        return 2


class Terminated(KeyboardInterrupt):
    """SIGTERM reached `workbench run`: handled as Ctrl-C is, with exit status 143."""


def _forward_sigterm(signum, frame) -> None:
    """Stop every process this runner started, each kernel saving first (pipeline.stop_started), then the runner.

    A kernel runs in a session of its own, so a SIGTERM to the runner alone never reached it: the pool's
    workers went on, finished their notebooks and took queued ones. A run cut short restarts in its folder
    next time.
    """
    from .pipeline.execute import stop_started

    stop_started()
    raise Terminated()


def _pipeline_cmd(args: argparse.Namespace) -> int:
    """Return the exit status of a pipeline command: run, status, report or clean."""
    import signal

    from . import pipeline

    try:
        if args.cmd == "run":
            before = signal.signal(signal.SIGTERM, _forward_sigterm)
            try:
                result = pipeline.run(args.spec, profile=args.profile, jobs=args.jobs, executor=args.executor,
                                      scheduler=args.scheduler, runs_dir=args.runs, progress=not args.quiet,
                                      threads=args.threads)
            finally:  # main() called in a process that goes on (a notebook, a test) keeps its own handler
                signal.signal(signal.SIGTERM, before)
            return 0 if result.ok else 1
        if args.cmd == "status":
            rows = pipeline.status(args.spec, profile=args.profile, runs_dir=args.runs)
            for r in rows:
                secs = f"{r['seconds']:8.1f} s" if r["seconds"] is not None else " " * 10
                err = f"  {r['error'].splitlines()[0]}" if r["error"] else ""
                print(f"{r['step']:<16} {r['key']}  {r['state']:<8}{secs}{err}")
            counts = {s: sum(r["state"] == s for r in rows) for s in ("done", "failed", "partial", "pending", "stale")}
            print(", ".join(f"{n} {s}" for s, n in counts.items())
                  + ("  (stale: made by older workbench code; `workbench run` makes current ones)"
                     if counts["stale"] else ""))
            return 0 if counts["done"] == len(rows) - counts["stale"] else 1
        if args.cmd == "report":
            print(pipeline.report(args.spec, profile=args.profile, runs_dir=args.runs))
            return 0
        removed = pipeline.clean(args.spec, runs_dir=args.runs, failed_only=args.failed)
        print(f"removed {len(removed)} folder(s)" + "".join(f"\n  {p}" for p in removed))
        return 0
    except pipeline.PipelineError as e:
        print(f"workbench {args.cmd}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C (the kernels got it too) or SIGTERM (forwarded): one line
        if args.cmd != "run":
            raise
        try:
            rows = [r for r in pipeline.status(args.spec, profile=args.profile, runs_dir=args.runs)
                    if r["state"] != "stale"]
            done = sum(r["state"] == "done" for r in rows)
            counts = f"{done} of {len(rows)} runs complete, {len(rows) - done} will resume or start"
        except Exception:  # the counts are a courtesy; the interruption is what must be said
            counts = "the finished runs are kept, the others will resume or start"
        what = "terminated" if isinstance(e, Terminated) else "interrupted"
        print(f"workbench run: {what}; {counts} when `workbench run {args.spec}` is given again",
              file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130


def main(argv: list[str] | None = None) -> int:
    """Run the `workbench` command line and return its exit status."""
    parser = argparse.ArgumentParser(prog="workbench", description="Looped-LM workbench")
    parser.add_argument("--version", action="version", version=f"workbench {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="train a tiny looped LM on the standard library and print per-loop losses")
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and batches")
    p.add_argument("--max-loops", type=int, default=8, help="evaluate r = 1..max-loops")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    t = sub.add_parser("train", help="train a looped LM on a corpus (checkpoints, metrics, resume)")
    t.add_argument("--out", required=True, help="run folder: config.json, tokenizer.json, checkpoints, metrics.nc")
    t.add_argument("--corpus", default="stdlib", help="stdlib, shakespeare, path:DIR_OR_FILE or hf:NAME")
    t.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    t.add_argument("--config", help="JSON file of LoopConfig fields (vocab_size defaults to the tokenizer's)")
    t.add_argument("--train-config", help="JSON file of TrainConfig fields")
    t.add_argument("--steps", type=int, help="training steps (overrides the train config)")
    t.add_argument("--seed", type=int, help="seed (overrides the train config)")
    t.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    t.add_argument("--bf16", choices=("auto", "on", "off"),
                   help="bf16 autocast: auto (default) where the device does bf16 fast (CUDA; a CPU with AMX or "
                        "AVX512-BF16), on, or off (fp32)")
    t.add_argument("--compile", choices=("auto", "on", "off"),
                   help="torch.compile the blocks: auto (default) when the run is long enough to repay the "
                        "first compile (about a minute on a CPU), on, or off")
    t.add_argument("--overwrite", action="store_true", help="replace the run already in --out (default: refuse)")
    t.add_argument("--no-progress", action="store_true", help="hide progress bars")
    t.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    x = sub.add_parser("export", help="write a run as a Hugging Face model folder (AutoModelForCausalLM, any "
                                      "loop count)")
    x.add_argument("run", metavar="RUN", help="run folder (or a checkpoint folder in one) to export")
    x.add_argument("dir", metavar="DIR", help="folder to write (absent or empty; see --overwrite)")
    x.add_argument("--loops", type=int,
                   help="config.loops: the loop count forward and generate use unless given loops= (default: the "
                        "training K)")
    x.add_argument("--overwrite", action="store_true", help="replace a model exported to DIR before (default: refuse)")
    x.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    for name, text in (("run", "run a pipeline's notebooks (skips runs that already completed)"),
                       ("status", "show each run of a pipeline: done, failed, partial, pending or stale"),
                       ("report", "(re)write runs/<pipeline>/report.html"),
                       ("clean", "delete a pipeline's runs")):
        c = sub.add_parser(name, help=text)
        c.add_argument("spec", help="pipeline name (pipelines/<name>.yaml) or path to a YAML spec")
        c.add_argument("--runs", default="runs", help="folder holding runs/<pipeline>/... (default ./runs)")
        if name != "clean":
            c.add_argument("--profile", help="a profile of the spec, e.g. smoke")
        if name == "run":
            c.add_argument("--jobs", type=int, default=1,
                           help="runs executed at once (local executor; with --executor dask and no "
                                "--scheduler: the local cluster's workers, default one per core)")
            c.add_argument("--executor", default="local", choices=("local", "dask"), help="where runs execute")
            c.add_argument("--scheduler",
                           help="Dask scheduler address for --executor dask (default: start a LocalCluster "
                                "sized to this machine); each run gets its worker's share of the cores as "
                                "torch threads")
            c.add_argument("--threads", type=int, default=0,
                           help="torch threads per run (default 0: the machine's cores over the runs executing "
                                "at once, so a step's lone run gets them all; on Dask each worker's share); "
                                "set it when other work shares the cores")
            c.add_argument("--quiet", action="store_true",
                           help="no live progress (which run executes, its step, tokens/s, time left); "
                                "the line per finished run and the summary stay")
        if name == "clean":
            c.add_argument("--failed", action="store_true", help="only failed and partial runs")
    args = parser.parse_args(argv)
    if args.cmd in ("run", "status", "report", "clean"):
        return _pipeline_cmd(args)
    if args.cmd == "train":
        return _train_cmd(args)
    if args.cmd == "export":
        return _export_cmd(args)
    if args.cmd == "demo":
        if args.steps < 1:
            parser.error(f"--steps={args.steps} is invalid: must be >= 1")
        if args.max_loops < 1:
            parser.error(f"--max-loops={args.max_loops} is invalid: must be >= 1")
        demo(args.steps, args.seed, args.max_loops, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
