"""Shared fixtures: the built-in tiny checkpoint (written once per machine into the cache) and a CPU pipeline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


# The CPU suite's longest files, in the order they start. `pytest -n 2 --dist loadfile` hands whole files to its two
# workers in the order of the collection (pytest_collection_modifyitems puts these first; xdist's own reordering, by
# number of tests per file, is turned off in pytest_configure): a long file handed out last runs on alone after the
# other worker has finished, so the longest start first. The arch-compile test comes first and runs two compiling
# processes; beside it the other worker runs the interpreter-bound files, which have no timing bounds, then the app
# servers and the browser; every other file follows in collection order (none takes more than ~10 s).
LONGEST_FIRST = (
    "tests/semantic/test_arch_compile.py",
    "tests/semantic/test_batch.py",
    "tests/semantic/test_precompile.py",
    "tests/test_continuation.py",
    "tests/semantic/test_graph_engine.py",
    "tests/flow/test_streaming.py",
    "tests/test_pipeline.py",
    "tests/semantic/test_quant.py",
    "tests/flow/test_flow_batch.py",
    "tests/ui/test_app.py",
    "tests/ui/test_page_truth.py",
    "tests/ui/test_engine_fallback.py",
    "tests/ui/test_server_api.py",
    "tests/ui/test_ui_browser.py",
    "tests/ui/test_memory_faults.py",
    "tests/ui/test_memory_admission.py",
    "tests/test_no_triton.py",
    "tests/ui/test_continue_app.py",
    "tests/ui/test_many_users.py",
    "tests/test_cli.py",
    "tests/test_server_limits.py",
)


def _gpu_run(config: pytest.Config) -> bool:
    return "gpu" in config.option.markexpr.replace("not gpu", "")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: hand files out in collection order (above)
        config.option.loadscopereorder = False
    # CPU runs test the Triton kernels under Triton's interpreter, which must be chosen before anything imports
    # triton (diffusers does at import time); GPU runs (`-m gpu`) compile them for the device.
    if not _gpu_run(config):
        os.environ["TRITON_INTERPRET"] = "1"
        # The CPU tests run tiny models whose every op is too small to share between threads: one thread each (the
        # app servers they start inherit it) instead of torch's pool per process fighting over the machine's cores.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        _skip_dead_overflow_checks()
        _patch_triton_language_once_per_launch()


def _skip_dead_overflow_checks() -> None:
    """Triton's interpreter runs with `sanitize_overflow` on and `debug` off: every integer add, sub and mul of a
    kernel is then redone in int64 and compared with the type's limits for a `device_assert` that, without debug,
    asserts nothing (semantic.device_assert returns first), as a compiled kernel drops it. About a third of an
    interpreted engine step went to that dead check; with it off the kernels compute the same. (Should the
    interpreter's options ever turn debug on, the checks stay.)"""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    if not builder.options.debug:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def _patch_triton_language_once_per_launch() -> None:
    """Triton 3.9's interpreter patches `triton.language` for interpretation (an `inspect.getmembers` walk over its
    modules) at each kernel launch, which restores it afterwards, and again at every call of a `@triton.jit` helper
    inside the kernel, which changes nothing then: the launch has patched the same modules. Those repeated walks are
    about a quarter of an interpreted engine step. Here a helper's call skips the walk when the running launch (on
    this thread) has patched every language module the helper sees; anything else goes through Triton's own code.
    Only for the pinned Triton, whose interpreter this was read from."""
    import inspect
    import threading

    import triton

    if triton.__version__ != "3.9.0":
        return
    from triton.runtime import interpreter

    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    state = threading.local()

    def languages(fn) -> set:
        return {v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (triton.language,
                                                                                    triton.language.core)}

    def patched_once(fn):
        if getattr(state, "launching", False):  # the launch's own patching (restored when it returns)
            state.launching, state.patched = False, languages(fn)
            return patch_lang(fn)
        patched = getattr(state, "patched", None)
        if patched is not None and languages(fn) <= patched:
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)  # (a helper's patching is never restored by Triton: it holds for this launch)
        if patched is not None:
            patched |= languages(fn)  # triton.language's own helpers (tl.sum, ...) see triton.language.core
        return scope

    def launch_once(self, *args, **kwargs):
        outer = getattr(state, "patched", None)
        state.launching = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.launching, state.patched = False, outer

    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patched_once, launch_once


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # GPU tests live beside the CPU tests of their module, in files named test_*_gpu.py (tests/test_repo.py checks
    # that). A GPU run (`pytest -m gpu tests`) imports only those: the CPU files need Triton's interpreter, and the
    # GPU image lacks the app's extras.
    if _gpu_run(config) and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return not collection_path.stem.endswith("_gpu") or None
    return None


@pytest.fixture(scope="session")
def tiny_folder():
    from music3_demo import random_models

    return random_models.tiny_checkpoint()


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_folder):
    from music3_demo.pipeline import Music3Pipeline

    return Music3Pipeline.from_pretrained("tiny", device="cpu", engine="reference")


@pytest.fixture(scope="module")
def one_block_models():
    """The tiny model's LM and depth decoder (float32, CPU) cut to one block each: every engine kernel still runs,
    at about half the interpreter's time per step of the tiny model's two blocks (tests of the engine's host-side
    logic; the chained tails between blocks are tested on `tiny_models`)."""
    import dataclasses

    from music3_demo import random_models

    sizes = dataclasses.replace(random_models.TINY, lm_layers=1, depth_layers=1)
    components = random_models.build_components(sizes, seed=0)
    return components["language_model"], components["rvq_depth_decoder"]
