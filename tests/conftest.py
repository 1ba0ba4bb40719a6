"""Suite-wide switch, tiers, workers and shared fixture: in CI a skipped test is a failure; one demo model per session.

`.ci/run` sets WORKBENCH_NO_SKIPS=1. CI installs every extra (`make test` installs `.[dev]`, the
SmolLM2 GGUF and Debian's chromium), so there a test that skips (an `importorskip` of an extra, a
missing browser, a module skipped at collection) means the install broke: the skip is reported as a
failure naming its reason. Without the variable (a checkout without the extras) skips stay skips.
Core dependencies (torch, numpy, xarray, h5netcdf, ...) are imported by the tests, never skipped on.

Tiers: `slow` (kernel starts, torchrun launches, CPU compiles, long training), `browser` (Chromium
through Playwright) and `gpu` (a CUDA device) are registered here; `make test` runs every tier,
`make test-fast` leaves out `slow` and `browser`.

Workers: `make test` runs under pytest-xdist (`-n auto --dist loadgroup`). Each worker runs torch on
one thread, and so do the kernels and subprocesses it starts (OMP/MKL_NUM_THREADS=1 in its
environment): two workers of two threads would oversubscribe two cores. Tests that share a module- or
session-scoped fixture of ours (a trained model, a CLI run, the smoke quickstart) are put in one
`xdist_group`, so that fixture is built once, on one worker, instead of once per worker; so are the
browser tests, which starve each other of the cores.

`demo_trained` trains the demo model once for the whole session, for every test that needs a model
that has learned something (so the suite pays for one such training, not three).
"""

import os

import pytest

TIERS = {
    "slow": "takes seconds to minutes: kernel starts, torchrun launches, CPU compiles, long training (make test-fast skips it)",
    "browser": "drives Debian's chromium through Playwright (make test-fast skips it)",
    "gpu": "needs a CUDA device (skipped without one, allowed in CI)",
}
WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # set in each pytest-xdist worker process

STRICT = os.environ.get("WORKBENCH_NO_SKIPS", "") == "1"
# skip reasons CI may meet because no CI machine can satisfy them (not a package CI installs)
CI_MAY_SKIP = ("needs a CUDA device",)


def pytest_configure(config):
    """Return None; registers the tiers, gives an xdist worker one thread, and under the switch keeps collecting."""
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")
    if not WORKER and config.getoption("dist", None) == "loadgroup":
        _check_loadgroup()
    if WORKER:  # before any test imports torch's thread pools; subprocesses and kernels inherit the variables
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = "1"
        import torch

        torch.set_num_threads(1)
    if STRICT:  # a module failed for a skip at collection still lets every other test run and report
        config.option.continue_on_collection_errors = True


def machine_line() -> str:
    """Return one line naming this machine's CPU, cores, bf16 flags and torch: what a suite time depends on."""
    import torch

    from workbench.models.precision import BF16_CPU_FLAGS, cpu_flags, read_cpuinfo

    model = next((line.partition(":")[2].strip() for line in read_cpuinfo().splitlines()
                  if line.startswith("model name")), "unknown CPU")
    flags = sorted(cpu_flags() & set(BF16_CPU_FLAGS))
    return (f"machine: {model}, {len(os.sched_getaffinity(0))} cores, bf16 flags: "
            f"{' '.join(flags) if flags else 'neither amx_bf16 nor avx512_bf16 (auto precision is fp32)'}, "
            f"torch {torch.__version__}")


def pytest_terminal_summary(terminalreporter):
    """Return None after writing the machine line under the results, so every recorded suite time has its CPU kind
    beside it (issue 26's targets differ by CPU kind; CI keeps only this output)."""
    terminalreporter.write_line(machine_line())


def _check_loadgroup() -> None:
    """Return None if this pytest / pytest-xdist pair honours --dist loadgroup's xdist_group; else stop the run."""
    import xdist
    from packaging.version import Version

    # xdist 3.8 names a group by rewriting item._nodeid, which pytest 9.2 no longer reads (nodeid comes from
    # item._id): groups would be ignored silently and every shared fixture built once per worker
    if Version(pytest.__version__) >= Version("9.2") and Version(xdist.__version__) <= Version("3.8.0"):
        raise pytest.UsageError(f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} ignores "
                                "--dist loadgroup's groups: install the pins of constraints.txt (pytest<9.2)")


def _strict(rep) -> None:
    """Turn a skipped report into a failure naming the skip's reason, unless the reason is allowed in CI."""
    reason = str(rep.longrepr[2]) if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    if any(ok in reason for ok in CI_MAY_SKIP):
        return
    rep.outcome = "failed"
    rep.longrepr = (f"skipped with WORKBENCH_NO_SKIPS=1, where every dependency is installed (.ci/run): {reason}\n"
                    "fix the install (make test installs .[dev]) or unset WORKBENCH_NO_SKIPS outside CI")


def _shared_fixtures(item) -> list[str]:
    """Return the names of the module- or session-scoped fixtures of this suite (not pytest's own) the item uses."""
    info = getattr(item, "_fixtureinfo", None)
    keys = []
    for name, defs in (info.name2fixturedefs.items() if info else ()):
        fixture = defs[-1]
        if fixture.scope in ("module", "session") and fixture.baseid:  # baseid "": a plugin's (tmp_path_factory)
            keys.append(f"{fixture.baseid}::{name}" if fixture.scope == "module" else name)
    return keys


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Return None; tests sharing one of our module/session fixtures get one xdist_group (joined transitively)."""
    parent: dict[str, str] = {}

    def root(k: str) -> str:
        while parent.setdefault(k, k) != k:
            k = parent[k]
        return k

    # the browser tests run one after another on one worker: the explorer's live plots stayed empty for
    # 3 minutes while the report's test ran the smoke quickstart through Dask beside it (2026-12-01)
    shared = {item.nodeid: _shared_fixtures(item) + (["browser"] if item.get_closest_marker("browser") else [])
              for item in items}
    for keys in shared.values():
        for k in keys[1:]:
            parent[root(k)] = root(keys[0])
    for item in items:
        keys = shared[item.nodeid]
        if keys and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(root(keys[0])))
    if WORKER:  # slow units first, so the long ones start while short ones fill the other worker's time
        def unit(item) -> str:
            mark = item.get_closest_marker("xdist_group")
            return mark.args[0] if mark and mark.args else item.nodeid

        slow = {unit(i) for i in items if i.get_closest_marker("slow") or i.get_closest_marker("browser")}
        order = {u: n for n, u in enumerate(dict.fromkeys(unit(i) for i in items))}  # a unit stays together
        items.sort(key=lambda i: (unit(i) not in slow, order[unit(i)]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Return None; under the switch, a test's skip (in setup or call) is reported as a failure."""
    outcome = yield
    rep = outcome.get_result()
    if STRICT and rep.skipped and not hasattr(rep, "wasxfail"):
        _strict(rep)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """Return None; under the switch, a module skipped at collection is reported as an error."""
    outcome = yield  # a module-level importorskip skips the whole module here, at collection
    rep = outcome.get_result()
    if STRICT and rep.skipped:
        _strict(rep)


@pytest.fixture(scope="session")
def demo_trained():
    """The `workbench demo` / explorer tiny model (demo_trainer) after 25 steps, trained once per session.

    Shared by every test that needs a model that has learned something (the demo command, the
    explorer's tiny model, the Trainer's learning test): 25 steps take its validation loss at K to
    about 2.6 nats, below the 3.09 nats of the byte unigram entropy of its validation text.
    """
    from helpers import DEMO_STEPS
    from workbench.experiments import demo_trainer

    return demo_trainer(DEMO_STEPS, seed=0, progress=False)


@pytest.fixture(scope="session")
def smoke_quickstart(tmp_path_factory):
    """(runs folder, PipelineResult) of the quickstart's smoke profile, run once per session through Dask.

    Read by the smoke test of the pipelines (test_notebooks) and the browser test of the report
    (test_explorer_browser), which treat the folder as read-only: four kernel starts paid once.
    """
    distributed = pytest.importorskip("distributed")
    from workbench import pipeline

    runs = tmp_path_factory.mktemp("smoke-quickstart") / "runs"
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as c:
        result = pipeline.run("quickstart", profile="smoke", executor="dask", scheduler=c.scheduler_address,
                              runs_dir=runs, log=None)
    return runs, result
