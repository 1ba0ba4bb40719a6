"""Live plotly figures that stay drawn when the browser drops the kernel's messages (the explorer's figures).

A FigureWidget changes on screen through one-off messages (Plotly.update), and three ways were seen, on loaded
CI machines, to leave a view blank or stale:

1. a view drawn after an update never sees it: `FigureSync.keep_state` stores each figure's current data and
   layout as its widget state, which a view is first drawn from (FigureWidget does this only in its own
   `_repr_mimebundle_`, which a figure inside a Box never gets);
2. a message lost on the way: every plotly view reports each draw of its traces with the edit id it has
   reached (`_js2py_traceDeltas`; its layout reports never arrive: plotly 7's view sends them as
   `_js2py_widget_layoutDelta`, a name the kernel side does not know); a report behind the kernel's latest
   id, not caught up a second later, gets the figure sent whole (state and one Plotly.update);
3. a model that drops every message: plotly >= 6 builds FigureWidget on anywidget, and anywidget (0.9.21 to
   0.11.0, checked) gives a model 2 s to load its module (plotly's, 5 MB) and then, if it is not loaded, makes
   the model ignore every message from the kernel for good. On a loaded machine the first figures' load takes
   longer, and their views show the empty state the widget was opened with whatever is sent (a CI run: the
   first two plots without a trace, the later ones drawn). Such a view reports edit 0 while the kernel is past
   it: the figure is replaced by a fresh widget with the same data and layout (which imports the module again,
   but alone and after the first rush, so within the limit as a rule; at most MAX_REPLACEMENTS tries).
"""

from __future__ import annotations

import asyncio
import copy
import functools


class FigureSync:
    """Keep named FigureWidgets, each the only child of a panel Box, drawn in their browser views."""

    STALE_CHECK_S = 1.0  # a stale report waits this long for the update in flight to be reported
    MAX_REPLACEMENTS = 3  # per figure: a browser that kills every new model too is not chased for ever

    def __init__(self, figures: dict, panels: dict):
        self.figures = figures  # the caller's dict: a replacement takes the name's place in it
        self.panels = panels
        self.replacements = {name: 0 for name in figures}
        self.last_report = {name: 0 for name in figures}  # the trace edit each figure's view last reported
        self.pending: set[str] = set()  # figures whose stale report waits for its check
        for name, fig in figures.items():
            self._watch(name, fig)

    def _watch(self, name: str, fig) -> None:
        fig.observe(functools.partial(self._on_report, name), names="_js2py_traceDeltas")

    def keep_state(self) -> None:
        """Return None after storing each figure's current data and layout as its widget state (a new view's start)."""
        # the view ignores later changes to this state, so nothing is drawn twice
        for f in self.figures.values():
            f._widget_data, f._widget_layout = copy.deepcopy(f._data), copy.deepcopy(f._layout_obj._props)

    @staticmethod
    def send_whole(fig) -> None:
        """Return None after sending a figure's kept state and one Plotly.update setting every trace and the layout."""
        fig.send_state(["_widget_data", "_widget_layout"])  # an unchanged trait is not sent by itself
        traces = [t.to_plotly_json() for t in fig.data]
        props = sorted({k for t in traces for k in t if k not in ("type", "uid")})
        fig._send_update_msg({k: [t.get(k) for t in traces] for k in props},
                             fig.layout.to_plotly_json(), list(range(len(traces))))

    def replace(self, name: str):
        """Return the fresh FigureWidget that now holds figure `name`'s data and layout in its panel."""
        old = self.figures[name]
        new = type(old)(old)  # a copy of the data and layout; its widget state is them from the start
        self.figures[name] = new
        self.replacements[name] += 1
        self._watch(name, new)
        self.panels[name].children = (new,)
        old.close()
        return new

    def _on_report(self, name: str, change) -> None:
        fig, msg = change["owner"], change["new"]
        if not msg or "trace_edit_id" not in msg or fig is not self.figures.get(name):
            return  # the reset to None after plotly's handler, or a replaced widget's last words
        self.last_report[name] = reported = int(msg["trace_edit_id"])
        target = fig._last_trace_edit_id
        if reported >= target:
            return
        if reported == 0 and self.replacements[name] < self.MAX_REPLACEMENTS:
            self.replace(name)  # drawn from the state it was opened with: its model drops our messages
            return
        if name in self.pending:
            return

        def check():
            self.pending.discard(name)
            if self.last_report[name] < target and fig is self.figures.get(name):
                self.send_whole(fig)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return check()  # no kernel loop: nothing else can arrive meanwhile
        self.pending.add(name)
        loop.call_later(self.STALE_CHECK_S, check)
