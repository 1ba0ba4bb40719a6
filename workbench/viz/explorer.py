"""The live loop explorer: scrub the loop count and watch predictions, hidden state and drift move.

`LoopExplorer(model, tokenizer, text=..., max_loops=...)` shows a loop slider (1..max_loops, the
training horizon K named beside it), a prompt box and a token selector over four plotly
`FigureWidget`s: the top-k next tokens at the chosen loop, per-loop curves (logit-lens loss, angular
distance, relative update, KL to the previous loop) with a cursor, the hidden-state trajectory across
loops in a PCA fitted on all loops, and a token-by-loop heatmap of update norms. Its "generate"
button (`generate()`) continues the prompt with the key/value cache at the slider's r and under the
KL exit rule, each new token shaded by the loops it used (it runs the model; a slider move never does).

Why it is fast: the numbers come from the probe `workbench.probes.loop_view` (ONE `model.trace` per
prompt or model, reduced to a small Dataset); a slider move only re-slices that Dataset into the
figures inside `batch_update()` and never runs the model. Scripts and tests drive it with
`set_loop`, `set_token`, `set_text` and `set_model` and read `view` (the Dataset) and `figures`
(the FigureWidgets by name).

The explorer draws; it does not find or train models (`workbench.experiments.open_model` does). A
run or checkpoint folder typed in its model box is opened with `workbench.io.open_run`. Besides a
LoopLM it shows any `workbench.probes.Loopable` and a looped transformers model given directly
(wrapped by `workbench.probes.from_transformers`): the same slider, figures and view; only the
"generate" button needs a LoopLM (its key/value cache) and is disabled otherwise. Bad input
(an empty prompt, a folder that cannot be read or does not fit its config or the tokenizer) is shown
as a message in the widget, never as a traceback; a prompt longer than the model's context is cut
to its last `max_seq_len` tokens, with a note saying so.
"""

from __future__ import annotations

import html
import os

import numpy as np
import torch

from ..data.corpus import ByteTokenizer
from ..io import open_run
from ..models.looped import LoopLM
from ..config import check_int
from ..probes.protocol import Loopable, from_transformers
from ..probes.view import loop_view
from .figure_sync import FigureSync
from .figures import integer_ticks

DEFAULT_TEXT = ('def greet(name):\n    """Return a greeting for name."""\n'
                '    return "Hello, " + name + "!"\n')
METRICS = (  # (variable of the loop_view Dataset, subplot title); the curves figure keeps this order
    ("loss", "logit-lens loss (nats)"),
    ("angular_distance", "angular distance a(x(t-1), x(t)) (π rad)"),
    ("relative_update", "relative update |x(t)-x(t-1)|/|x(t-1)|"),
    ("kl_prev", "KL(p_t ‖ p_t-1) (nats)"),
)
FIGURES = ("predictions", "curves", "trajectory", "heatmap")


class ExplorerInputError(ValueError):
    """Input the explorer cannot show (bad prompt, checkpoint or tokenizer); its text goes in the widget."""


def plotly_text(text: str) -> str:
    """Return text safe inside a Plotly title or label: `&`, `<` and `>` as the entities Plotly decodes.

    Plotly's text is a small HTML subset that decodes only a few entities (`&amp;`, `&lt;`, `&gt;`,
    numeric ones); `html.escape`'s `&quot;` and `&#x27;` would show literally, so quotes stay as they are.
    """
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def short_label(label: str, width: int = 14) -> str:
    """Return a token label for an axis tick: runs of 4+ visible spaces as ␣×n, cut to `width` with an ellipsis."""
    import re

    label = re.sub(r"␣{4,}", lambda m: f"␣×{len(m.group(0))}", label)
    return label if len(label) <= width else label[:width - 1] + "…"


def token_label(tokenizer, token_id: int) -> str:
    """Return a one-line, visible label for a token: escapes for control characters, ␣ for spaces."""
    if isinstance(tokenizer, ByteTokenizer) and token_id >= 0x80:
        return f"<0x{token_id:02X}>"  # a lone byte of a multi-byte character decodes to nothing readable
    text = tokenizer.decode([token_id])
    return repr(text)[1:-1].replace(" ", "␣") or "∅"


def default_device() -> torch.device:
    """Return CUDA when present, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def as_shown(model) -> LoopLM | Loopable:
    """Return the model as the explorer shows it: a LoopLM or Loopable as given, a looped transformers model wrapped.

    Raises ExplorerInputError naming what it got when it is none of these (`from_transformers` names
    a transformers class it has no adapter for).
    """
    if isinstance(model, (LoopLM, Loopable)):
        return model
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        try:
            return from_transformers(model)
        except ValueError as e:
            raise ExplorerInputError(str(e)) from None
    raise ExplorerInputError(f"model must be a LoopLM, a Loopable, a looped transformers model or a run folder "
                             f"path, got {type(model).__name__}")


def model_facts(model: LoopLM | Loopable) -> dict:
    """Return what the explorer says and checks about a model: name, vocab, context, K (None where unknown)."""
    if isinstance(model, LoopLM):
        c = model.cfg
        return {"name": f"{c.notation} · d={c.d_model}", "vocab": c.vocab_size, "context": c.max_seq_len,
                "K": c.loops}
    return {"name": model.name or "a Loopable", "vocab": model.vocab_size, "context": model.context,
            "K": int(model.training_loops)}


def check_fit(model: LoopLM | Loopable, tokenizer) -> None:
    """Raise ExplorerInputError unless the tokenizer's ids all lie in the model's vocabulary."""
    if not isinstance(model, (LoopLM, Loopable)):
        raise ExplorerInputError(f"model must be a LoopLM, a Loopable or a run folder path, got {type(model).__name__}")
    if tokenizer is None or not hasattr(tokenizer, "encode") or not hasattr(tokenizer, "decode"):
        raise ExplorerInputError("a tokenizer with encode() and decode() is needed for a model given directly")
    n = getattr(tokenizer, "vocab_size", None)
    facts = model_facts(model)
    if n is not None and facts["vocab"] is not None and n > facts["vocab"]:
        raise ExplorerInputError(f"the tokenizer has {n} ids but the model's vocab_size is {facts['vocab']}: "
                                 f"they belong to different configs ({facts['name']})")


def open_path(path, tokenizer=None, device=None) -> tuple[LoopLM, object]:
    """Return (model, tokenizer) of a run or checkpoint folder (`io.open_run`), its errors as ExplorerInputError."""
    try:
        model, tokenizer = open_run(path, device=device, tokenizer=tokenizer)
    except (FileNotFoundError, ValueError) as e:  # open_run names the path and what is wrong with it
        raise ExplorerInputError(str(e)) from None
    check_fit(model, tokenizer)
    return model, tokenizer


# ---- the widget ----------------------------------------------------------------------------------------
def loops_html(pieces, max_loops: int) -> str:
    """Return HTML spans of generated pieces [(text, loops)], each shaded by its loops (light: 1, dark: max_loops)."""
    out = []
    for text, n in pieces:
        a = 0.1 + 0.8 * (n - 1) / max(max_loops - 1, 1)
        ink = "#fff" if a > 0.55 else "#000"
        out.append(f'<span title="{n} loop{"s" * (n != 1)}" style="background:rgba(31,119,180,{a:.2f});color:{ink};'
                   f'white-space:pre-wrap;font-family:monospace">{html.escape(text)}</span>')
    return "".join(out)


def _integer_ticks(R: int) -> dict:
    return integer_ticks([0, R] if R > 12 else [1, R])


def _shape_line(x: float, xref: str, yref: str, dash: str, color: str) -> dict:
    return dict(type="line", x0=x, x1=x, y0=0, y1=1, xref=xref, yref=yref,
                line=dict(color=color, width=1.5, dash=dash))


class LoopExplorer:
    """A loop slider, prompt box and token selector over four live FigureWidgets of one cached trace.

    `model` is a LoopLM, a Loopable or a looped transformers model (each with `tokenizer`; a
    transformers model is wrapped by `probes.from_transformers`) or a run / checkpoint folder
    (opened by `io.open_run`, with the run's tokenizer; the folder then shows in the model box).
    `source` says where a model given directly came from (e.g. `experiments.open_model`'s third
    value); the model box and the line above it show it. Display it in a notebook as the last expression of a cell (or
    `display(explorer.widget)`). `view` is the `loop_view` Dataset on screen, `labels` its tokens' labels.
    """

    def __init__(self, model, tokenizer=None, text: str = DEFAULT_TEXT, max_loops: int | None = None, *,
                 top_k: int = 10, dims: int = 3, device=None, source: str | None = None):
        import ipywidgets as W

        if max_loops is not None:
            max_loops = check_int("max_loops", max_loops, 1)
        self.top_k = check_int("top_k", top_k, 1)
        self.dims = check_int("dims", dims, 2, 3)
        self.device = torch.device(device) if device is not None else default_device()
        self._max_loops_arg = max_loops
        self.model: LoopLM | Loopable | None = None
        self.tokenizer = None
        self.view = None  # the loop_view Dataset of the prompt shown
        self.labels: list[str] = []  # a visible label per prompt position
        self.text = ""
        self.loop = 1
        self.token = 0
        self.traces = 0  # model passes run so far: a slider move must not add one
        self.message = ""
        self._syncing = False

        self.prompt = W.Textarea(value=text, description="prompt", continuous_update=False,
                                 layout=W.Layout(width="98%", height="80px"))
        self.slider = W.IntSlider(value=1, min=1, max=max_loops or 16, description="loops",
                                  continuous_update=True, layout=W.Layout(width="55%"))
        # the slider's K mark: CSS drawn on this slider's track only (ipywidgets sliders have no ticks)
        self._uid = f"wb{id(self):x}"
        self.slider.add_class(f"wb-explorer-slider-{self._uid}")
        self.slider.add_class("wb-explorer-slider")
        self.k_mark = W.HTML()
        self.position = W.HTML()  # where the loop stands against K: the slider's horizon mark
        self.token_select = W.Dropdown(description="token", layout=W.Layout(width="40%"))
        self._source_arg = None if source is None else str(source)
        self.path = W.Text(placeholder="checkpoint or run folder", description="model",
                           layout=W.Layout(width="60%"))
        self.load_button = W.Button(description="load", tooltip="load the checkpoint and trace the prompt")
        self.status = W.HTML()
        self.source = W.HTML()
        # the generate view: a continuation at the slider's r and under the KL exit rule (runs only on click)
        self.gen_button = W.Button(description="generate", tooltip="continue the prompt at the slider's loop count "
                                   "and with the KL exit rule (up to max_loops)")
        self.generated = W.HTML()
        self.figures = self._build_figures()
        # stable hooks for the browser test and custom CSS, on a plain box around each figure: a class set on
        # the plotly widget itself was missing from its element in one loaded CI run (its view draws late)
        panels = {name: W.Box([fig]).add_class(f"wb-explorer-{name}") for name, fig in self.figures.items()}
        self.sync = FigureSync(self.figures, panels)  # keeps the views drawn when the browser drops messages
        # while the explorer itself sets a control (_syncing), its observer must not act on it
        self.prompt.observe(self._guard(lambda ch: self._syncing or self.set_text(ch["new"])), "value")
        self.slider.observe(self._guard(lambda ch: self._syncing or self.set_loop(ch["new"])), "value")
        self.token_select.observe(self._guard(lambda ch: self._syncing or ch["new"] is None
                                              or self.set_token(ch["new"])), "value")
        self.load_button.on_click(self._guard(lambda _: self.set_model(self.path.value)))
        self.gen_button.on_click(self._guard(lambda _: self.generate()))
        self.widget = W.VBox([
            self.source,
            W.HBox([self.path, self.load_button]),
            self.prompt,
            W.HBox([self.slider, self.position]),
            self.k_mark,
            self.token_select,
            self.status,
            W.HBox([self.gen_button, self.generated]),
            # rows wrap on a narrow page rather than clip the figures
            W.HBox([panels["predictions"], panels["curves"]], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([panels["trajectory"], panels["heatmap"]], layout=W.Layout(flex_flow="row wrap")),
        ])
        self.widget.add_class("wb-explorer")
        self.text = text
        # a model or path that cannot be opened raises here, where it was given, instead of leaving a widget
        # without a model that says so only on screen; a prompt it cannot trace (empty) is a message, as later
        try:
            self.set_model(model, tokenizer)
        except ExplorerInputError as e:
            if self.model is None:
                raise
            self._say(str(e), "error")

    # ---- display --------------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kw):
        return self.widget._repr_mimebundle_(**kw)

    # ---- messages -------------------------------------------------------------------------------
    def _say(self, text: str, kind: str = "info") -> None:
        colors = {"error": "#b00020", "warning": "#8a5300", "info": "#555"}
        self.message = text
        self.status.value = (f'<div class="wb-explorer-message wb-{kind}" style="color:{colors[kind]};'
                             f'white-space:pre-wrap">{html.escape(text)}</div>') if text else ""

    def _guard(self, fn):
        """Return fn wrapped so bad input shows as a message in the widget instead of a traceback."""
        def run(*args):
            try:
                return fn(*args)
            except ExplorerInputError as e:
                self._say(str(e), "error")
            except Exception as e:  # a widget callback's traceback would land in a log nobody reads
                self._say(f"{type(e).__name__}: {e}", "error")
        return run

    # ---- inputs ---------------------------------------------------------------------------------
    @property
    def max_loops(self) -> int:
        """Return the slider's range end R (default 4 K for the model shown)."""
        if self._max_loops_arg is not None:
            return self._max_loops_arg
        return 4 * model_facts(self.model)["K"] if self.model is not None else 16

    def set_model(self, model, tokenizer=None) -> None:
        """Show another model (LoopLM, Loopable, looped transformers model, checkpoint path): traces the prompt once.

        Raises ExplorerInputError when it cannot be used (the widget callbacks show it as a message);
        the model shown before stays.
        """
        if isinstance(model, (str, os.PathLike)):
            folder = os.fspath(model)
            model, tokenizer = open_path(model, tokenizer, self.device)
            where = folder
        else:
            model = as_shown(model)
            check_fit(model, tokenizer)
            # a Loopable's weights stay where they are: it holds closures over a model, not one module
            model = model.to(self.device) if isinstance(model, LoopLM) else model
            folder, where = None, self._source_arg if self.model is None else None
        old = (self.model, self.tokenizer, self.source.value, self.path.value, self.path.placeholder)
        self.model, self.tokenizer = model, tokenizer
        f = model_facts(model)
        device = self.device if isinstance(model, LoopLM) else (model.device() or "cpu")
        self.source.value = html.escape(f"{where + ' · ' if where else ''}{f['name']} · vocab={f['vocab']} · "
                                        f"context {f['context']} · trained at K={f['K']} · {device}")
        self.gen_button.disabled = not isinstance(model, LoopLM)
        # the model box names the model shown: its folder, else where it came from (type a folder to change it)
        self.path.value = folder or ""
        self.path.placeholder = (f"{where or 'a model given in code'} (type a run folder and press load to "
                                 f"change it)") if folder is None else "checkpoint or run folder"
        try:
            self._retrace(self.text)
        except Exception:
            # keep the model whose view is on screen; with none yet, keep the new one so a prompt can follow
            if self.view is not None:
                self.model, self.tokenizer, self.source.value, self.path.value, self.path.placeholder = old
            raise

    def set_text(self, text: str) -> None:
        """Trace a new prompt once (to max_loops) and redraw every figure from the cache."""
        self._retrace(text)

    def _encode(self, text: str) -> tuple[np.ndarray, str]:
        if not isinstance(text, str) or not text:
            raise ExplorerInputError("the prompt is empty: type some text to see the next-token predictions")
        ids = list(self.tokenizer.encode(text))
        if not ids:
            raise ExplorerInputError("the prompt is empty after tokenization: type some text")
        note = ""
        facts = model_facts(self.model)
        ctx = facts["context"]
        if ctx is not None and len(ids) > ctx:
            note = (f"the prompt is {len(ids)} tokens but the model's context is {ctx}: "
                    f"showing its last {ctx} tokens")
            ids = ids[-ctx:]
        V = facts["vocab"]
        if (V is not None and max(ids) >= V) or min(ids) < 0:
            raise ExplorerInputError(f"the tokenizer produced ids up to {max(ids)} but the model's vocab_size is {V}")
        return np.asarray(ids, dtype=np.int64), note

    def _retrace(self, text: str) -> None:
        if self.model is None:
            raise ExplorerInputError("no model loaded")
        ids, note = self._encode(text)
        R = self.max_loops
        labels = [token_label(self.tokenizer, int(i)) for i in ids]
        view = loop_view(self.model, ids, R, top_k=self.top_k, dims=self.dims, horizon=R)
        self.traces += 1
        self.view, self.labels, self.text = view, labels, text
        notes = [note] if note else []
        if isinstance(self.model, LoopLM) and self.model.horizon_dependent:
            notes.append(f"this model's loops depend on the total loop count (timestep conditioning): "
                         f"every loop shown is a loop of one {R}-loop run, not a run of that many loops")
        if len(ids) == 1:
            notes.append("a one-token prompt has no next token in it: the loss curve is empty")
        self._say("\n".join(notes), "warning" if note else "info")
        # the last position whose next token is in the prompt, so the true next token shows from the start
        self.token = max(len(ids) - 2, 0)
        self.loop = min(self.loop, R)
        self._sync_controls()
        self._draw_view()

    def generate(self, new_tokens: int = 24, threshold: float = 0.01) -> None:
        """Show the prompt's greedy continuation at the slider's r and under the KL exit rule, tokens coloured by loops."""
        from ..models.generate import ExitRule, continuation

        if self.model is None:
            raise ExplorerInputError("no model loaded")
        if not isinstance(self.model, LoopLM):
            raise ExplorerInputError("generate needs a LoopLM (it decodes with its key/value cache); "
                                     "this model is shown through the probes only")
        ids, _ = self._encode(self.text)
        R = self.max_loops
        n = min(check_int("new_tokens", new_tokens, 1), self.model.cfg.max_seq_len - len(ids))
        if n < 1:
            raise ExplorerInputError("the prompt fills the model's context: no room to generate")
        rows = []
        for label, kw in ((f"r = {self.loop}", dict(loops=self.loop)),
                          (f"KL exit < {threshold:g} (r ≤ {R})", dict(loops=R, exit=ExitRule("kl", threshold)))):
            _, pieces = continuation(self.model, self.tokenizer, ids.tolist(), n, **kw)
            rows.append(f"<div><b>{html.escape(label)}</b>: {loops_html(pieces, R)}</div>")
        self.generated.value = f'<div class="wb-explorer-generated">{"".join(rows)}</div>'

    def set_loop(self, r: int) -> None:
        """Show loop r (1..max_loops) in every figure by re-slicing the cached view; never runs the model."""
        r = check_int("loop", r, 1, self.max_loops)
        self.loop = r
        if self.slider.value != r and not self._syncing:
            self._syncing = True
            try:
                self.slider.value = r
            finally:
                self._syncing = False
        self._draw_loop()

    def set_token(self, i: int) -> None:
        """Follow position i of the prompt (0-based) in the predictions, trajectory and heatmap."""
        T = self.view.sizes["token"] if self.view is not None else 1
        i = check_int("token", i, 0, T - 1)
        self.token = i
        if self.token_select.value != i and not self._syncing:
            self._syncing = True
            try:
                self.token_select.value = i
            finally:
                self._syncing = False
        self._draw_token()

    def _sync_controls(self) -> None:
        v = self.view
        self._syncing = True
        try:
            self.slider.max = v.sizes["loop"]
            self.slider.value = self.loop
            self.k_mark.value = self._k_mark_css(int(v.attrs["training_loops"]), v.sizes["loop"])
            self.token_select.options = [(f"{i}: {lab}", i) for i, lab in enumerate(self.labels)]
            self.token_select.value = self.token
            if self.prompt.value != self.text:
                self.prompt.value = self.text
        finally:
            self._syncing = False

    def _k_mark_css(self, K: int, R: int) -> str:
        """Return a <style> that draws a tick and "K" on this explorer's slider track at loop K (none if K > R)."""
        if R <= 1 or not 1 <= K <= R:
            return ""
        at = 100 * (K - 1) / (R - 1)
        sel = f".wb-explorer-slider-{self._uid} .noUi-target"
        return (f"<style>{sel}::after {{ content: ''; position: absolute; left: calc({at:.3f}% - 1px); top: -5px; "
                f"bottom: -5px; width: 2px; background: #2ca02c; z-index: 3; pointer-events: none; }}"
                f"{sel}::before {{ content: 'K={K}'; position: absolute; left: {at:.3f}%; top: calc(100% + 5px); "
                f"transform: translateX(-50%); font-size: 10px; line-height: 1; color: #2ca02c; z-index: 3; "
                f"pointer-events: none; white-space: nowrap; }}</style>")

    # ---- figures ----------------------------------------------------------------------------------
    def _build_figures(self) -> dict:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        base = dict(template="plotly_white", margin=dict(l=50, r=20, t=50, b=40))
        pred = go.FigureWidget(go.Bar(orientation="h", x=[], y=[], text=[], textposition="auto",
                                      hovertemplate="%{y}: p=%{x:.4f}<extra></extra>"))
        # automargin: a long token label widens the margin instead of being cut at the left edge
        pred.update_layout(height=380, width=380, xaxis=dict(title="probability", range=[0, 1]),
                           yaxis=dict(autorange="reversed", type="category", automargin=True),
                           title=dict(font=dict(size=13)), **base)

        sub = make_subplots(rows=2, cols=2, subplot_titles=[t for _, t in METRICS],
                            horizontal_spacing=0.12, vertical_spacing=0.18)
        curves = go.FigureWidget(sub)
        for i, (name, title) in enumerate(METRICS):
            row, col = divmod(i, 2)
            curves.add_trace(go.Scatter(x=[], y=[], mode="lines", name="mean over tokens", legendgroup="mean",
                                        showlegend=i == 0, line=dict(color="#1f77b4")), row=row + 1, col=col + 1)
            curves.add_trace(go.Scatter(x=[], y=[], mode="lines", name="selected token", legendgroup="tok",
                                        showlegend=i == 0, line=dict(color="#ff7f0e", dash="dot")),
                             row=row + 1, col=col + 1)
            curves.add_trace(go.Scatter(x=[], y=[], mode="markers", name="chosen loop", legendgroup="cur",
                                        showlegend=i == 0, marker=dict(color="#d62728", size=10)),
                             row=row + 1, col=col + 1)
        n = len(METRICS)
        refs = [("x" if i == 0 else f"x{i + 1}", "y domain" if i == 0 else f"y{i + 1} domain") for i in range(n)]
        # shapes[0:n] mark K (dashed); shapes[n:2n] are the cursor at the chosen loop
        curves.update_layout(shapes=[_shape_line(1, x, y, "dash", "#888") for x, y in refs]
                             + [_shape_line(1, x, y, "solid", "#d62728") for x, y in refs])
        curves.update_layout(height=400, width=660, legend=dict(orientation="h", y=-0.16), **base)
        curves.update_xaxes(tickformat="d")
        curves.update_xaxes(title=dict(text="loop t", standoff=4), row=2)
        curves.update_annotations(font_size=11)

        if self.dims == 3:
            S = go.Scatter3d
            marker_small, marker_big = dict(size=2, color="#999", opacity=0.5), dict(size=7, color="#d62728")
        else:
            S = go.Scatter
            marker_small, marker_big = dict(size=5, color="#999", opacity=0.5), dict(size=14, color="#d62728")
        xyz = dict(x=[], y=[]) if self.dims == 2 else dict(x=[], y=[], z=[])
        traj = go.FigureWidget([
            S(**xyz, mode="markers", marker=marker_small, name="all tokens at this loop", text=[],
              hovertemplate="%{text}<extra></extra>"),
            S(**xyz, mode="lines+markers", name="selected token, loops 0..R", text=[],
              marker=dict(size=4 if self.dims == 3 else 7, color=[], colorscale="Viridis", showscale=True,
                          colorbar=dict(title=dict(text="loop", side="top"), thickness=10, len=0.5, x=1.0, y=0.5,
                                        tickformat="d")),
              line=dict(color="#888", width=2), hovertemplate="%{text}<extra></extra>"),
            S(**xyz, mode="markers", name="loop K", marker=dict(size=(6 if self.dims == 3 else 12), color="#2ca02c",
                                                              symbol="diamond"), hoverinfo="skip"),
            S(**xyz, mode="markers", name="chosen loop", marker=marker_big, hoverinfo="skip"),
        ])
        # uirevision keeps a rotated camera or a zoom across slider moves
        traj.update_layout(height=440, width=500, uirevision="keep", legend=dict(orientation="h", y=-0.05),
                           title=dict(font=dict(size=13)), **base)

        heat = go.FigureWidget(go.Heatmap(z=[[]], x=[], y=[], colorscale="Magma",
                                          colorbar=dict(title=dict(text="log10 update", side="right"), thickness=14),
                                          hovertemplate="position %{y}, loop %{x}<br>log10 update %{z:.2f}"
                                                        "<extra></extra>"))
        heat.update_layout(height=440, width=520, xaxis=dict(title="loop", tickformat="d"),
                           yaxis=dict(title="token (position: text)", autorange="reversed", automargin=True),
                           title=dict(text="relative update per token and loop", font=dict(size=13)),
                           shapes=[_shape_line(1, "x", "y domain", "solid", "#00e5ff"),
                                   dict(type="line", x0=0, x1=1, y0=0, y1=0, xref="x domain", yref="y",
                                        line=dict(color="#00e5ff", width=1, dash="dot"))],
                           **base)
        return {"predictions": pred, "curves": curves, "trajectory": traj, "heatmap": heat}

    def _draw_view(self) -> None:
        """Put a new view's loop-independent data (curves, heatmap, axis ranges) in the figures."""
        v, labels = self.view, self.labels
        R, K = v.sizes["loop"], int(v.attrs["training_loops"])
        loops = v.loop.values
        c = self.figures["curves"]
        with c.batch_update():
            for i, (name, _) in enumerate(METRICS):
                c.data[3 * i].x, c.data[3 * i].y = loops, v[name].values
                c.data[3 * i + 1].x = loops
                c.layout.shapes[i].x0 = c.layout.shapes[i].x1 = K
            c.update_xaxes(range=[0.5, R + 0.5], **_integer_ticks(R))
            c.layout.title = dict(text=f"per-loop drift (dashed: trained at K={K})", font=dict(size=13))
        h = self.figures["heatmap"]
        with h.batch_update():
            z = np.log10(np.maximum(v.token_relative_update.values.T, 1e-12))
            h.data[0].z, h.data[0].x, h.data[0].y = z, loops, v.token.values
            h.data[0].text = np.broadcast_to(np.array([plotly_text(lab) for lab in labels], dtype=object)[:, None],
                                             z.shape)
            h.data[0].hovertemplate = ("position %{y} %{text}, loop %{x}<br>log10 update %{z:.2f}"
                                       "<extra></extra>")
            # rows named by their token text (every n-th row on a long prompt, so the labels stay legible)
            step = max(1, int(np.ceil(len(labels) / 40)))
            rows = list(range(0, len(labels), step))
            h.layout.yaxis.tickmode = "array"
            h.layout.yaxis.tickvals = rows
            h.layout.yaxis.ticktext = [plotly_text(f"{i}: {short_label(labels[i])}") for i in rows]
            h.layout.xaxis.update(**_integer_ticks(R))
        t = self.figures["trajectory"]
        with t.batch_update():
            share = ", ".join(f"{100 * s:.0f}%" for s in v.explained_variance.values)
            t.layout.title.text = f"hidden state, PCA over all loops and tokens (variance {share})"
            t.data[0].text = labels
        # its own update: a batch restyles every trace it touches, and a property one trace lacks goes
        # to the others as null, which plotly.js reads as "reset" (a colour bar on trace 0, a lost colour)
        t.data[1].marker.colorbar.update(**_integer_ticks(R))
        self._draw_token()

    def _trajectory_ranges(self) -> list[list[float]]:
        """Return axis ranges that hold the selected token's whole path and the middle 96% of all states.

        A few states far out (an attention-sink token, h0 of the first position) would otherwise
        stretch the axes so that every other path fills a corner; the ones outside are clipped.
        """
        v = self.view
        pts = v.pca.values.reshape(-1, self.dims)
        path = v.pca.values[:, self.token]
        lo = np.minimum(np.percentile(pts, 2, axis=0), path.min(0))
        hi = np.maximum(np.percentile(pts, 98, axis=0), path.max(0))
        pad = 0.06 * np.maximum(hi - lo, 1e-6)
        return [[float(a - p), float(b + p)] for a, b, p in zip(lo, hi, pad)]

    def _set_trajectory_axes(self, t) -> None:
        ranges = self._trajectory_ranges()
        if self.dims == 3:
            t.layout.scene = dict(xaxis=dict(range=ranges[0], title="PC1"), yaxis=dict(range=ranges[1], title="PC2"),
                                  zaxis=dict(range=ranges[2], title="PC3"), aspectmode="cube")
        else:
            t.layout.xaxis = dict(range=ranges[0], title="PC1")
            t.layout.yaxis = dict(range=ranges[1], title="PC2")

    def _draw_token(self) -> None:
        """Put the selected token's data (its curves, trajectory, heatmap row) in the figures, then the loop."""
        if self.view is None:
            return
        v, i = self.view, self.token
        c = self.figures["curves"]
        with c.batch_update():
            for m, (name, _) in enumerate(METRICS):
                c.data[3 * m + 1].y = v["token_" + name].values[:, i]
        t = self.figures["trajectory"]
        R, K = v.sizes["loop"], int(v.attrs["training_loops"])
        path = v.pca.values[:, i]  # states 0..R
        with t.batch_update():  # trace 1's own properties (see _draw_view: one batch per set of properties)
            self._set_trajectory_axes(t)
            self._set_xyz(t.data[1], path)
            t.data[1].marker.color = np.arange(R + 1)
            t.data[1].text = [f"{self.labels[i]} · loop {r}" for r in range(R + 1)]
        with t.batch_update():
            self._set_xyz(t.data[2], path[K:K + 1] if K <= R else path[:0])
        h = self.figures["heatmap"]
        with h.batch_update():
            h.layout.shapes[1].y0 = h.layout.shapes[1].y1 = i
        self._draw_loop()

    def _set_xyz(self, trace, pts: np.ndarray) -> None:
        trace.x, trace.y = pts[:, 0], pts[:, 1]
        if self.dims == 3:
            trace.z = pts[:, 2]

    def _draw_loop(self) -> None:
        """Re-slice the view Dataset at the chosen loop and token: the only work a slider move does."""
        v = self.view
        if v is None:
            return
        r, i, K = self.loop, self.token, int(v.attrs["training_loops"])
        j = r - 1  # loop r is index r - 1 of dim loop; state r is index r of dim state
        past = (f"extrapolating {r - K} loop{'s' * (r - K != 1)} past K" if r > K else
                "at the training horizon" if r == K else f"{K - r} loop{'s' * (K - r != 1)} short of K")
        self.position.value = (f'<span class="wb-explorer-position">loop <b>{r}</b> of {v.sizes["loop"]} · '
                               f'trained at K = {K} · {past}</span>')
        p = self.figures["predictions"]
        ids, probs = v.top_id.values[j, i], v.top_p.values[j, i]
        names = [plotly_text(f"{rank + 1}. {short_label(token_label(self.tokenizer, int(t)))}")
                 for rank, t in enumerate(ids)]
        nxt = int(v.target_id.values[i])
        with p.batch_update():
            p.data[0].x, p.data[0].y = probs, names
            p.data[0].text = [f"{100 * q:.1f}%" for q in probs]
            p.data[0].marker.color = ["#d62728" if int(t) == nxt else "#1f77b4" for t in ids]
            truth = (f"true next {token_label(self.tokenizer, nxt)}: p={v.target_p.values[j, i]:.3f}, "
                     f"rank {int(v.target_rank.values[j, i])}" if nxt >= 0 else
                     "end of prompt: the next token is unknown")
            p.layout.title.text = (f"after “{plotly_text(short_label(self.labels[i], 24))}” (position {i}) at loop "
                                   f"{r}<br><span style='font-size:11px'>{plotly_text(truth)}</span>")
        c = self.figures["curves"]
        n = len(METRICS)
        with c.batch_update():
            for m, (name, _) in enumerate(METRICS):
                c.data[3 * m + 2].x, c.data[3 * m + 2].y = [r], [float(v[name].values[j])]
                c.layout.shapes[n + m].x0 = c.layout.shapes[n + m].x1 = r
        t = self.figures["trajectory"]
        pca = v.pca.values
        with t.batch_update():
            self._set_xyz(t.data[0], pca[r])
            self._set_xyz(t.data[3], pca[r, i:i + 1])
        h = self.figures["heatmap"]
        with h.batch_update():
            h.layout.shapes[0].x0 = h.layout.shapes[0].x1 = r
        self.sync.keep_state()
