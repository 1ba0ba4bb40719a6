"""Figures and widgets: `figures` builds static plotly figures from result Datasets; `explorer` is the
live loop explorer (ipywidgets + plotly FigureWidgets). Import the submodule you need; nothing heavy
is imported here.
"""
