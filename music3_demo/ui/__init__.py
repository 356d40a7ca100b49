"""The Gradio front end: page (layout + wiring), API endpoints, job runner, song store, history, and the holder of
loaded pipelines per device."""

from .core import AppContext
from .page import build_ui, launch_options

__all__ = ["AppContext", "build_ui", "launch_options"]
