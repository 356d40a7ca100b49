"""Failures forced into the fast engine's set-up, for the fallback tests on CPU (the graph engine runs there under
Triton's interpreter), and out-of-memory errors raised at real call sites (as torch raises them on a full GPU): in
process through pytest's monkeypatch, or in a real subprocess (the app, the CLI) through
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
    """The engine disagrees with the reference about the model (what the self-check exists for): its own copy of
    lm_head's audio rows is negated, so its logits are off by a relative error of 2 while its hidden states stay
    right (a negated copy: the engine reads the module's own rows otherwise, which the reference reads too)."""
    from dataclasses import replace

    from music3_demo.semantic.graph import GraphEngine

    build = GraphEngine.__init__

    def perturbed(self, *args, **kwargs) -> None:
        build(self, *args, **kwargs)
        self.weights = replace(self.weights, audio_head=-self.weights.audio_head)

    set_attr(GraphEngine, "__init__", perturbed)


# What torch raises when the caching allocator cannot get a block (the text a user must never see).
CUDA_OOM_TEXT = ("CUDA out of memory. Tried to allocate 1.01 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
                 "120.19 MiB is free. Including non-PyTorch memory, this process has 23.31 GiB memory in use.")


def raise_oom(*args, **kwargs):
    import torch

    raise torch.OutOfMemoryError(CUDA_OOM_TEXT)


def oom_at_load(set_attr: SetAttr) -> None:
    """Building the flow stage (on a GPU: the DiT's fast path and its captured graphs) runs out of memory."""
    import music3_demo.flow as flow

    set_attr(flow, "prepare", raise_oom)


def oom_in_songs(set_attr: SetAttr, songs: tuple[int, ...] = (1, 3)) -> None:
    """The vocoder runs out of memory inside the process's songs number `songs` (counted by Music3Pipeline.generate
    calls, 1 = the app's warm-up): the app's first load fails in its warm-up, the retried load warms up, then its
    first user's song fails and the next one is whole."""
    import threading

    from diffusers import MiniMaxMusic3Vocoder

    from music3_demo.pipeline import Music3Pipeline

    generate, vocode = Music3Pipeline.generate, MiniMaxMusic3Vocoder.forward
    count, lock, failed = [0], threading.Lock(), set()

    def counted(self, *args, **kwargs):
        with lock:
            count[0] += 1
        return generate(self, *args, **kwargs)

    def forward(self, *args, **kwargs):
        if count[0] in songs and count[0] not in failed:  # once per song (songs run one at a time here)
            failed.add(count[0])
            raise_oom()
        return vocode(self, *args, **kwargs)

    set_attr(Music3Pipeline, "generate", counted)
    set_attr(MiniMaxMusic3Vocoder, "forward", forward)


FAULTS = {"compile": compile_error, "wrong-model": wrong_model, "oom-load": oom_at_load, "oom-songs": oom_in_songs}


def subprocess_env(fault: str | None, graph: bool = True) -> dict[str, str]:
    """Environment for a child process with `fault` applied; `graph`: it picks the graph engine on CPU
    (interpreter), else the reference engine (auto's choice on a CPU)."""
    from music3_demo.semantic import GRAPH_ON_CPU_ENV

    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1", TRITON_INTERPRET="1")
    if graph:
        env[GRAPH_ON_CPU_ENV] = "1"
    else:
        env.pop(GRAPH_ON_CPU_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "faults"), str(HERE), str(ROOT)])
    if fault:
        env[FAULT_ENV] = fault
    return env


def apply_from_env() -> None:
    fault = os.environ.get(FAULT_ENV)
    if fault:
        FAULTS[fault](setattr)
