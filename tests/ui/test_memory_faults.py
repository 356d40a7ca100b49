"""An out-of-memory is a sentence in front of every user, never a CUDA message or a traceback: the CLI (exit 2), the
app's status, banner and API, with the fault raised at a real call site as torch raises it on a full GPU
(engine_faults.py), on the real tiny pipeline; after a song that ran out of memory the server keeps serving."""

from __future__ import annotations

import subprocess
import sys

import engine_faults
from app_server import running_app
from gradio_client import Client
from gradio_client.exceptions import AppError

from music3_demo.errors import is_cuda_message

SONG = dict(description="lofi", lyrics="[verse]\nla", duration=1.0, num_steps=2, api_name="/generate")


def test_cli_exits_2_with_the_load_sentence_when_the_gpu_is_full(tmp_path, tiny_folder):
    out = tmp_path / "song.wav"
    run = subprocess.run(
        [sys.executable, "-m", "music3_demo", "generate", "--model", "tiny", "--prompt", "lofi", "--instrumental",
         "--duration", "1", "--steps", "2", "--quiet", "--out", str(out)],
        capture_output=True, text=True, env=engine_faults.subprocess_env("oom-load", graph=False),
        cwd=engine_faults.ROOT, timeout=600,
    )
    assert run.returncode == 2, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: Not enough memory on cpu for loading the model in float32:"), run.stderr
    assert "Traceback" not in run.stderr and not is_cuda_message(run.stderr), run.stderr
    assert not out.exists()


def test_the_app_says_a_sentence_for_a_load_and_a_song_that_ran_out_of_memory_and_keeps_serving(
        monkeypatch, tmp_path, tiny_folder):
    """Songs 1 and 3 of the process run out of memory in the vocoder: the warm-up (the load fails), then, after the
    next request's retried load and warm-up, that request's song; the song after it is whole."""
    from music3_demo.ui.assets import banner_html
    from music3_demo.serve.holder import HolderStatus

    for key, value in engine_faults.subprocess_env("oom-songs", graph=False).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MUSIC3_TEST_GRAPH_ON_CPU", raising=False)
    with running_app(tmp_path, wait_for=("failed",)) as server:
        client = Client(server.url, verbose=False)
        status = client.predict(api_name="/status")
        assert status["error"].startswith("Not enough memory on cpu for warming up in float32"), status["error"]
        assert not is_cuda_message(status["error"])
        banner = banner_html(HolderStatus(**{k: v for k, v in status.items() if k in HolderStatus.__annotations__}))
        assert "for warming up in float32" in banner and not is_cuda_message(banner)
        try:
            client.predict(**SONG, seed=1)
            raise AssertionError("the song that ran out of memory came back")
        except AppError as error:
            assert str(error).startswith("This song ran out of memory on cpu"), str(error)
            assert not is_cuda_message(str(error))
        audio, report = client.predict(**SONG, seed=2)
        assert report["frames"] > 0 and report["seed"] == 2
        status = client.predict(api_name="/status")
        assert status["state"] == "ready" and status["error"] is None
        failed = [job for job in status.get("jobs", []) if job.get("state") == "failed"]
        assert all(not is_cuda_message(job["error"] or "") for job in failed)
        log = server.log()
        assert "CUDA out of memory" in log  # the details are the server log's
