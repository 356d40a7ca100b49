"""The fast engine proves itself at load or is not used, and the user is told why.

On CPU the graph engine runs under Triton's interpreter with the tiny model (allowed for tests only), so every failure
is forced here: a kernel that cannot be launched (Triton's out-of-shared-memory error), an engine that disagrees with
the reference about the model (a failing self-check), a launch from the wrong device. Each must leave a working
reference engine behind with the reason in the Python API, the CLI's stderr, the app's status, banner and report,
or, with `graph` asked for explicitly, stop with that sentence.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run the CPU tests through pytest: conftest.py sets TRITON_INTERPRET"

import engine_faults  # noqa: E402
from app_server import running_app  # noqa: E402
from gradio_client import Client  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402

from music3_demo import devices, random_models  # noqa: E402
from music3_demo.request import GenerationRequest  # noqa: E402
from music3_demo.semantic import EngineUnavailable, SamplingSettings, make_engine, select  # noqa: E402

SHORT = GenerationRequest("lofi hip hop, 80 BPM", "[verse]\nla la", duration=1.0, num_steps=2, seed=3)
NO_SHARED_MEMORY = "OutOfResources: out of resource: shared memory"


def _tiny_models():
    components = random_models.build_components(random_models.TINY, seed=0)
    return components["language_model"], components["rvq_depth_decoder"]


def test_a_launch_from_another_device_is_refused_with_a_sentence(monkeypatch):
    """A thread whose current device is not the engine's would run Triton kernels in the wrong context (an
    illegal memory access on cuda:1). The engine checks before it launches anything for a song."""
    lm, depth = _tiny_models()
    from music3_demo.semantic.graph import GraphEngine

    engine = GraphEngine(lm, depth, "cpu", attention_splits=2)
    monkeypatch.setattr(devices, "launch_device", lambda device_type: torch.device("cuda", 1))
    codes = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(devices.DeviceMismatch, match=r"on cpu but cuda:1 is the current device.*on_device\('cpu'\)"):
        engine.teacher_forced(torch.zeros(2, 4, dtype=torch.long), codes)
    with pytest.raises(devices.DeviceMismatch):
        list(engine.frames(torch.zeros(2, 4, dtype=torch.long), 1, SamplingSettings(), torch.Generator()))
    # make_engine turns it into a fallback with the reason, like any other failure of the fast engine.
    engine, record = make_engine(lm, depth, "cpu", "auto", allow_interpreter=True)
    assert record.name == "reference" and engine.name == "reference"
    assert "could not start on cpu (DeviceMismatch:" in record.fallback_reason


def test_the_cards_plan_reaches_the_graph_engine(monkeypatch):
    """make_engine builds the graph engine with what the card's plan gives it (`sizing`): its slots, KV format and,
    where the stages take turns, its per-code tables in host memory. The engine made here records what it was given
    and fails to start, so the reference serves."""
    from music3_demo.semantic import graph

    given = {}

    class Recording(graph.GraphEngine):
        def __init__(self, *args, **kwargs):
            given.update(kwargs)
            raise RuntimeError("recorded")

    monkeypatch.setattr(graph, "GraphEngine", Recording)
    lm, depth = _tiny_models()
    engine, record = make_engine(lm, depth, "cpu", "auto", allow_interpreter=True,
                                 sizing=lambda name: (2, None, "int8", True))
    assert (given["slots"], given["kv_format"], given["tables_on_host"]) == (2, "int8", True)
    assert record.name == "reference" and "(RuntimeError: recorded)" in record.fallback_reason


def test_the_engine_enters_its_own_device_from_any_thread(monkeypatch):
    """CUDA semantics stood in for on CPU: a thread is on the engine's device only inside on_device(), as a new
    thread on a GPU is on device 0 until it enters its own. Called from fresh threads (the app's runners, the
    holder's preload), the engine must get past its device check to its first kernel launch (forced to fail here,
    so the test stays fast), and launching without entering the device is refused."""
    from triton.runtime.errors import OutOfResources

    from music3_demo.semantic.graph import GraphEngine

    monkeypatch.setattr(devices, "launch_device",
                        lambda device_type: devices.entered_device() or torch.device("cuda", 0))
    engine_faults.compile_error(monkeypatch.setattr)
    engine = GraphEngine(*_tiny_models(), "cpu", attention_splits=2)
    text_ids, codes = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)
    calls = {
        "teacher_forced": lambda: engine.teacher_forced(text_ids, codes),
        "frames": lambda: list(engine.frames(text_ids, 1, SamplingSettings(), torch.Generator())),
    }
    for name, call in calls.items():
        raised = []

        def run(call=call) -> None:
            try:
                call()
            except BaseException as error:  # noqa: BLE001 - checked on the test's thread
                raised.append(error)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        assert len(raised) == 1 and isinstance(raised[0], OutOfResources), (name, raised)
    with pytest.raises(devices.DeviceMismatch, match="on cpu but cuda:0 is the current device"):
        devices.check_launch_device(torch.device("cpu"), "This test")
    with devices.on_device("cpu"):
        devices.check_launch_device(torch.device("cpu"), "This test")


def test_a_kernel_that_cannot_launch_falls_back_to_the_reference_engine(monkeypatch):
    engine_faults.compile_error(monkeypatch.setattr)
    from music3_demo.pipeline import Music3Pipeline

    pipeline = Music3Pipeline.from_pretrained("tiny", device="cpu", engine="auto", allow_interpreter=True)
    record = pipeline.engine_record
    assert pipeline.engine_name == "reference" and record.requested == "auto"
    assert record.fallback_reason == (
        f"The fast graph engine could not start on cpu ({NO_SHARED_MEMORY}, Required: 262144, Hardware limit: "
        "232448. Reducing block sizes or `num_stages` may help). Songs are made by the slower reference engine "
        "instead."
    )
    assert pipeline.components["language_model"].lm_head is not None  # nothing trimmed: the reference needs it
    song = pipeline.generate(SHORT)
    assert song.engine == "reference" and song.engine_note == record.fallback_reason
    assert song.timings["engine_check_s"] == record.check_s and record.check_s >= 0
    assert song.frames == SHORT.max_frames and abs(song.audio).max() > 0

    with pytest.raises(EngineUnavailable, match=r"could not start on cpu .*Start with --engine auto"):
        Music3Pipeline.from_pretrained("tiny", device="cpu", engine="graph", allow_interpreter=True)


def test_a_failed_self_check_falls_back_and_the_holder_banner_and_report_say_why(monkeypatch):
    """The engine runs, but its logits disagree with the reference on the loaded weights: no song may come from it.
    (The one test here that runs the interpreted engine: two teacher-forced steps.)"""
    engine_faults.wrong_model(monkeypatch.setattr)
    monkeypatch.setattr(select, "SELF_CHECK_STEPS", 2)
    monkeypatch.setenv("MUSIC3_TEST_GRAPH_ON_CPU", "1")
    from music3_demo.serve.holder import ModelHolder
    from music3_demo.ui.assets import banner_html
    from music3_demo.ui.report import report_markdown, song_report
    from music3_demo.serve.runner import JobRecord

    holder = ModelHolder("tiny", ["cpu"], engine="auto", warmup=False)
    holder.preload(background=False)
    status = holder.status()
    assert status.state == "ready" and status.engine == "reference"
    note = status.engine_note
    assert note.startswith("The fast graph engine failed its self-check on cpu: its language-model logits differ "
                           "from the reference computation by a relative error of 2 (at most 0.1 passes).")
    assert status.engine_check_s > 0 and status.as_dict()["engine_note"] == note
    assert 'id="engine-banner"' in banner_html(status) and "failed its self-check on cpu" in banner_html(status)
    with holder.acquire() as lease:
        errors = lease.pipeline.engine_record.check_errors
        assert errors["logits"] == pytest.approx(2.0, rel=1e-4)  # the fault is found where it is
        assert errors["lm_hidden"] < 1e-5 and errors["depth_hiddens"] < 1e-5
        song = lease.pipeline.generate(SHORT)
    report = song_report(song, SHORT, JobRecord(1, SHORT.duration), holder.model)
    assert report["engine"] == "reference" and report["engine_note"] == note
    assert note in report_markdown(report)
    holder.release()


def _cli(*args: str, fault: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "music3_demo", "generate", "--model", "tiny", "--prompt", "lofi", "--lyrics",
         "[verse]\nla", "--duration", "1", "--steps", "2", "--seed", "1", "--quiet", *args],
        capture_output=True, text=True, env=engine_faults.subprocess_env(fault), cwd=engine_faults.ROOT, timeout=600,
    )


def test_cli_says_why_it_falls_back_and_exits_2_when_graph_was_asked_for(tmp_path, tiny_folder):
    auto = _cli("--out", str(tmp_path / "a.wav"), fault="compile")
    assert auto.returncode == 0, auto.stderr
    assert f"note: The fast graph engine could not start on cpu ({NO_SHARED_MEMORY}" in auto.stderr
    assert auto.stderr.count("could not start on cpu") == 1, auto.stderr  # said once, not also by the log
    assert "engine=reference" in auto.stdout and "engine_check_s=" in auto.stdout
    assert (tmp_path / "a.wav").stat().st_size > 0

    graph = _cli("--engine", "graph", "--out", str(tmp_path / "g.wav"), fault="compile")
    assert graph.returncode == 2
    assert graph.stderr.strip().splitlines()[-1].startswith(
        f"error: The fast graph engine could not start on cpu ({NO_SHARED_MEMORY}")
    assert "Start with --engine auto (or reference)" in graph.stderr and "Traceback" not in graph.stderr
    assert not (tmp_path / "g.wav").exists()


def _fault_env(monkeypatch, fault: str) -> None:
    for key, value in engine_faults.subprocess_env(fault).items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)


def test_app_serves_songs_with_the_reference_engine_and_says_why(monkeypatch, tmp_path, tiny_folder):
    _fault_env(monkeypatch, "compile")
    with running_app(tmp_path, ready_timeout=900) as server:
        client = Client(server.url, verbose=False)
        status = client.predict(api_name="/status")
        assert status["engine"] == "reference"
        assert status["engine_note"].startswith(f"The fast graph engine could not start on cpu ({NO_SHARED_MEMORY}")
        _, report = client.predict(description="lofi", lyrics="[verse]\nla", duration=1.0, num_steps=2, seed=4,
                                   api_name="/generate")
        assert report["engine"] == "reference" and report["engine_note"] == status["engine_note"]
        assert "engine_check_s" in report["timings"]
        assert status["engine_note"] in server.log()  # the server log says it too


def test_app_refuses_to_load_when_graph_was_asked_for_and_cannot_start(monkeypatch, tmp_path, tiny_folder):
    _fault_env(monkeypatch, "compile")
    with running_app(tmp_path, "--engine", "graph", wait_for=("failed",), ready_timeout=900) as server:
        client = Client(server.url, verbose=False)
        status = client.predict(api_name="/status")
        assert status["state"] == "failed" and status["engine"] is None
        assert status["error"].startswith(f"The fast graph engine could not start on cpu ({NO_SHARED_MEMORY}")
        assert "--engine auto" in status["error"]
        with pytest.raises(AppError, match="could not start on cpu"):
            client.predict(description="lofi", lyrics="[verse]\nla", duration=1.0, num_steps=2, api_name="/generate")
