"""Failures forced into the fast engine's set-up, for the fallback tests on CPU (the graph engine runs there under
Triton's interpreter): in-process through pytest's monkeypatch, or in a real subprocess (the app, the CLI) through
tests/ui/faults/sitecustomize.py, which applies the fault named in $MUSIC3_TEST_FAULT at interpreter start-up."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

FAULT_ENV = "MUSIC3_TEST_FAULT"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

SetAttr = Callable[[object, str, object], None]


def compile_error(set_attr: SetAttr) -> None:
    """Every GEMV launch fails as Triton fails a kernel that needs more shared memory than the GPU has."""
    from triton.runtime.errors import OutOfResources

    from music3_demo.semantic.kernels import linear

    class Unlaunchable:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(262144, 232448, "shared memory")

            return launch

    set_attr(linear, "_gemv_kernel", Unlaunchable())


def wrong_model(set_attr: SetAttr) -> None:
    """The engine disagrees with the reference about the model (issue 13's failure mode): its own copy of lm_head's
    audio rows is negated, so its logits are off by a relative error of 2 while its hidden states stay right."""
    from music3_demo.semantic.graph import GraphEngine

    build = GraphEngine.__init__

    def perturbed(self, *args, **kwargs) -> None:
        build(self, *args, **kwargs)
        self.weights.audio_head.neg_()

    set_attr(GraphEngine, "__init__", perturbed)


FAULTS = {"compile": compile_error, "wrong-model": wrong_model}


def subprocess_env(fault: str | None) -> dict[str, str]:
    """Environment for a child process that picks the graph engine on CPU (interpreter) with `fault` applied."""
    from music3_demo.semantic import GRAPH_ON_CPU_ENV

    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1", TRITON_INTERPRET="1")
    env[GRAPH_ON_CPU_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "faults"), str(HERE), str(ROOT)])
    if fault:
        env[FAULT_ENV] = fault
    return env


def apply_from_env() -> None:
    fault = os.environ.get(FAULT_ENV)
    if fault:
        FAULTS[fault](setattr)
