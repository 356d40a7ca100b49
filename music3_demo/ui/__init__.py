"""The Gradio front end: the page (layout + wiring) and the API endpoints, over one backend (serve/backend.py)."""

from .core import AppContext
from .page import build_ui, launch_options

__all__ = ["AppContext", "build_ui", "launch_options"]
