"""Kernel start: the runner's kernel client against jupyter_client's own, side by side in one process.

jupyter_client's `wait_for_ready` ends by draining IOPub until it has been silent for 0.2 s; the runner's client
(`workbench.pipeline.execute`) returns once the kernel answered and IOPub delivers. Each round executes a two-cell
notebook through papermill with either client, interleaved, and prints the median wall time per notebook run.

Usage: python benchmarks/bench_kernel_start.py [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import papermill
from traitlets import default

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workbench.pipeline.execute import socket_kernel_manager_class  # noqa: E402


def stock_manager_class():
    """Return the runner's socket kernel manager class with jupyter_client's own async client."""
    from jupyter_client.asynchronous import AsyncKernelClient

    class StockClientManager(socket_kernel_manager_class()):
        @default("client_factory")
        def _stock_client(self):
            return AsyncKernelClient

    return StockClientManager


def main(rounds: int = 8) -> None:
    """Print the median wall time of a tiny notebook run with each client, and their ratio."""
    tmp = Path(tempfile.mkdtemp())
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("x = 6"), nbformat.v4.new_code_cell("print(x * 7)")]
    nbformat.write(nb, tmp / "tiny.ipynb")
    managers = {"jupyter_client's client": stock_manager_class(), "the runner's client": socket_kernel_manager_class()}
    times = {name: [] for name in managers}
    for r in range(rounds + 1):
        for name, manager in managers.items():
            t0 = time.perf_counter()
            papermill.execute_notebook(str(tmp / "tiny.ipynb"), str(tmp / "out.ipynb"), kernel_name="python3",
                                       progress_bar=False, log_output=False, kernel_manager_class=manager)
            if r:  # the first round warms the file cache
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, m in med.items():
        lo, hi = min(times[name]), max(times[name])
        print(f"{name:>24}: median {m:.3f} s per notebook run ({rounds} runs: {lo:.3f}-{hi:.3f} s)")
    a, b = med.values()
    print(f"the runner's client takes {b / a:.2f}x the time, {a - b:.3f} s less per kernel start")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
