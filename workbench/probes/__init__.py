"""Probes of what a loop does (SPEC §3): each takes `(model, tokens, ...)` and returns an `xarray.Dataset`.

- `geometry`: angle, relative update, normalised variance and norm per loop and per block occurrence;
- `interaction`: computational interaction C(i -> j) between block occurrences (a LoopLM, or a
  Loopable that names them);
- `lost_gradient`: what truncated BPTT throws away, for every k from one backward pass;
- `lens`: per-loop next-token loss, accuracy, entropy and KL to the final loop;
- `halting`: adaptive exit at inference, its compute saved and loss paid;
- `loop_view`: one prompt's top-k, lens loss, KL to the previous loop, drift and PCA path per loop
  (what the explorer and the tour draw).

`model` is a `LoopLM` or any looped model wrapped in a `Loopable` (see `workbench.probes.protocol`);
`from_transformers(model)` wraps a looped transformers model (Inkling2LoopForCausalLM) by calling
its own submodules, its carried state the hidden and block states it passes between loops.
A LoopLM is probed through its one pass (`LoopLM.run`): block occurrences are read or replaced by
hooks at their names (`prelude.i`, `core.t.j`, `coda.i`, `state.t`), never by re-driving the blocks.
Datasets carry flat provenance attrs (config_json, git_commit, workbench_version, seed, created).
"""

from .geometry import geometry
from .gradients import LoopGradients, loop_gradients, lost_gradient
from .halting import halting
from .interaction import interaction
from .lens import lens
from .protocol import Loopable, as_loopable, from_transformers
from .view import loop_view

__all__ = ["geometry", "interaction", "lost_gradient", "loop_gradients", "LoopGradients", "lens", "halting",
           "Loopable", "as_loopable", "from_transformers", "loop_view"]
