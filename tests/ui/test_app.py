"""The app through its public API: a real `python app.py --model tiny` server driven with gradio_client.

Its background writer waits SLOW_S after each song's hand-over before it writes the song's slower files (the
writer's test seam), so the hand-over tests see "after" as seconds after, not a race."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import soundfile as sf
from app_server import running_app
from gradio_client import Client
from gradio_client.exceptions import AppError, ValidationError
from gradio_client.utils import Status

from music3_demo import contract as c
from music3_demo.prompt import count_prompt_tokens
from music3_demo.request import GenerationRequest, InvalidRequest, validate
from music3_demo.serve.writer import SLOW_FILES_ENV

FRAME_S = 1 / c.FRAME_RATE
QUICK = {"description": "bright synth-pop, 120 BPM", "lyrics": "[verse]\nhello there\n\n[chorus]\nla la la",
         "num_steps": 4}
SLOW_S = 3.0
# The hand-over (WAV written, the report built, Gradio's post-processing, the download) takes a fraction of a second
# on a loaded 2-core box; waiting for even one of the delayed files takes SLOW_S or more.
HANDOVER_BOUND_S = 2.5
LATER = ("waveform", "state", "flac", "mp3")  # the files written after the hand-over


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with running_app(tmp_path_factory.mktemp("app"), env={SLOW_FILES_ENV: str(SLOW_S)}) as server:
        yield server


@pytest.fixture
def client(app) -> Client:
    return Client(app.url, verbose=False)


def generate(client: Client, **values) -> tuple[str, dict]:
    return client.predict(**(QUICK | values), api_name="/generate")


def on_disk(app, song_id: str) -> list[str]:
    """The song's files that exist (partial ones are hidden: never counted)."""
    return sorted(path.suffix for path in (app.output_dir / song_id).iterdir() if not path.name.startswith("."))


def files_when_written(client: Client, job_id: int, timeout: float = 120.0) -> dict:
    """The job's files as the status endpoint tells them, once none is on its way."""
    deadline = time.monotonic() + timeout
    while True:
        job = next(job for job in client.predict(api_name="/status")["jobs"] if job["id"] == job_id)
        if "pending" not in job["files"].values():
            return job["files"]
        assert time.monotonic() < deadline, f"the files never came: {job['files']}"
        time.sleep(0.2)


@pytest.mark.parametrize("duration", [3.4, 9.0])  # one flow chunk, and two overlapping chunks
def test_song_has_the_requested_duration_rate_and_channels(app, client, duration):
    wav, report = generate(client, duration=duration, seed=11)
    info = sf.info(wav)
    assert info.samplerate == c.SAMPLE_RATE == report["sample_rate"]
    assert info.channels == 2 == report["channels"]
    assert abs(info.frames / info.samplerate - duration) <= FRAME_S
    assert report["frames"] == c.max_frames_for(duration) and report["seed"] == 11
    assert report["engine"] == "reference" and report["realtime_factor"] > 0
    assert {"prompt_s", "semantic_s", "flow_s", "vocoder_s", "total_s"} <= set(report["timings"])
    names = files_when_written(client, report["job"])  # the FLAC and MP3 follow the WAV
    files = app.output_dir / report["files"]["song_id"]  # the report names the files, never a server path
    flac = sf.info(files / names["flac"])  # the FLAC download holds the same song
    assert (flac.frames, flac.samplerate, flac.channels) == (info.frames, info.samplerate, info.channels)
    mp3 = sf.info(files / names["mp3"])  # and the MP3, up to the encoder's frame padding
    assert mp3.format == "MP3" and (mp3.samplerate, mp3.channels) == (info.samplerate, info.channels)
    assert abs(mp3.duration - info.frames / info.samplerate) < 0.06
    assert report["notice"] and "noise" in report["notice"]  # a random model says so


def test_the_wav_is_handed_over_before_the_slow_files_which_follow(app):
    client = Client(app.url, verbose=False)
    wav, report = client.predict(**QUICK, duration=2.0, seed=1, api_name="/generate")
    received = time.time()
    song_id = report["song_id"]
    # In the client's hands while the other files are still on their way (the old order wrote all five first),
    # and its report says so.
    assert on_disk(app, song_id) == [".wav"], "the slower files were written before the WAV was handed over"
    assert sf.info(wav).frames == sf.info(app.output_dir / song_id / report["files"]["wav"]).frames
    assert {kind: report["files"].get(kind) for kind in LATER} == {kind: "pending" for kind in LATER}
    assert received - report["ended_at"] < HANDOVER_BOUND_S, "the WAV waited for the slower files"
    assert report["ended_at"] <= report["handed_over_at"] <= received

    # They follow: the job's entry in `status` names them once written, and the `files` endpoint hands them over.
    names = files_when_written(client, report["job"])
    assert names == {"wav": report["files"]["wav"], "waveform": "waveform.png", "state": "continue.npz",
                     "flac": report["files"]["wav"].replace(".wav", ".flac"),
                     "mp3": report["files"]["wav"].replace(".wav", ".mp3")}
    assert on_disk(app, song_id) == [".flac", ".mp3", ".npz", ".png", ".wav"]
    flac, mp3, picture, where = client.predict(song_id=song_id, api_name="/files")
    assert where == {"song_id": song_id} | names
    assert sf.info(flac).frames == sf.info(wav).frames and sf.info(mp3).format == "MP3"
    assert Path(picture).read_bytes()[:4] == b"\x89PNG"


def test_variations_are_each_handed_over_as_they_end(app):
    client = Client(app.url, verbose=False)
    job = client.submit(**QUICK, duration=1.0, seed=5, variations=2, api_name="/generate")
    arrived: list[float] = []  # when each song was in the client's hands (its WAV downloaded)
    deadline = time.monotonic() + 300
    while True:
        done = job.done()
        songs = [output for output in job.outputs() if isinstance(output[0], str)]
        arrived += [time.time()] * (len(songs) - len(arrived))
        if done:
            break
        assert time.monotonic() < deadline, "the variations never came"
        time.sleep(0.02)
    assert len(songs) == 2
    for (wav, report), at in zip(songs, arrived):
        assert {kind: report["files"].get(kind) for kind in LATER} == {kind: "pending" for kind in LATER}
        assert at - report["ended_at"] < HANDOVER_BOUND_S, "a variation waited for files"
        assert sf.info(wav).channels == 2
    for _, report in songs:
        assert "pending" not in files_when_written(client, report["job"]).values()


def test_same_seed_same_song(client):
    first, _ = generate(client, duration=2.0, seed=5)
    second, _ = generate(client, duration=2.0, seed=5)
    assert (sf.read(first)[0] == sf.read(second)[0]).all()


def test_three_concurrent_clients_share_the_device(app):
    running_samples: list[int] = []
    done = threading.Event()

    def watch() -> None:  # the server's own view: the songs on its one device, never more than its slots
        watcher = Client(app.url, verbose=False)
        while not done.is_set():
            running_samples.append(watcher.predict(api_name="/status")["running"]["cpu"])
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(generate, Client(app.url, verbose=False), duration=2.0, seed=seed)
                       for seed in (1, 2, 3)]
            results = [future.result(timeout=300) for future in futures]
    finally:
        done.set()
        watcher.join()
    reports = sorted((report for _, report in results), key=lambda report: report["started_at"])
    assert len({report["job"] for report in reports}) == 3
    for wav, _report in results:
        assert abs(sf.info(wav).frames / c.SAMPLE_RATE - 2.0) <= FRAME_S
    # The tiny model's engine has 4 slots: the three songs ran side by side, and each report says so.
    assert max(report["started_at"] for report in reports) < min(report["ended_at"] for report in reports)
    assert [report["shared_gpu_with"] for report in reports] == [2, 2, 2]
    assert running_samples and max(running_samples) <= 3 and 3 in running_samples


def test_cancelled_job_stops_within_a_second_and_the_next_one_succeeds(app, client):
    job = client.submit(**(QUICK | {"duration": 120.0, "seed": 3}), api_name="/generate")
    deadline = time.monotonic() + 120
    while not app.status()["busy"]:  # wait until it really generates (not just queued)
        assert time.monotonic() < deadline, "the long job never started"
        time.sleep(0.1)
    time.sleep(1.0)
    cancelled_at = time.time()
    job.cancel()
    while app.status()["busy"]:
        assert time.time() - cancelled_at < 5, "the device is still busy after the cancel"
        time.sleep(0.05)
    record = [r for r in client.predict(api_name="/status")["jobs"] if r["duration"] == 120.0][-1]  # its own jobs
    assert record["state"] == "cancelled"
    assert record["ended_at"] - cancelled_at < 1.0, "generation went on for more than a second after the cancel"
    assert job.status().code == Status.CANCELLED
    wav, report = generate(client, duration=2.0, seed=4)
    assert abs(sf.info(wav).frames / c.SAMPLE_RATE - 2.0) <= FRAME_S and report["started_at"] > cancelled_at


BAD_INPUTS = {
    "empty description": {"description": "  "},
    "no lyrics": {"lyrics": ""},
    "too short": {"duration": 0.5},
    "too long": {"duration": 400},
    "zero steps": {"num_steps": 0},
    "fractional steps": {"num_steps": 2.5},
    "low guidance": {"guidance_scale": 0.5},
    "high lm cfg": {"lm_cfg_scale": 11},
    "zero top-k": {"top_k": 0},
    "negative seed": {"seed": -5},
    "huge seed": {"seed": 2**33},
    "prompt too long": {"lyrics": "[verse]\n" + "la la la, " * 700},
}


@pytest.mark.parametrize("change", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_returns_validates_sentence(client, tiny_folder, change):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(Path(tiny_folder) / "tokenizer"))
    values = {"duration": 2.0, "seed": 1, "guidance_scale": 1.7, "lm_cfg_scale": 1.5, "top_k": 50} | QUICK | change
    with pytest.raises(InvalidRequest) as expected:
        validate(GenerationRequest(**values), lambda text, words: count_prompt_tokens(tokenizer, text, words))
    with pytest.raises(ValidationError) as got:  # refused on arrival, the sentence under the parameter's name
        generate(client, **values)
    assert f"- {expected.value.field or 'lyrics'}: {expected.value}" in str(got.value)


def test_server_keeps_serving_after_bad_inputs(client):
    with pytest.raises(ValidationError):
        generate(client, description="")
    wav, _ = generate(client, duration=1.0, seed=2)
    assert sf.info(wav).channels == 2


def test_unloadable_model_still_opens_the_page_and_says_why(tmp_path):
    missing = tmp_path / "no-such-model"
    with running_app(tmp_path, "--model", str(missing), wait_for=("failed",)) as server:
        page = Client(server.url, verbose=False)
        status = page.predict(api_name="/status")
        assert status["state"] == "failed"
        assert str(missing) in status["error"] and "--model tiny" in status["error"]
        with pytest.raises(AppError) as error:
            generate(page, duration=1.0)
        assert str(missing) in str(error.value) and "--model tiny" in str(error.value)


def test_concurrent_first_requests_load_the_model_once():
    from music3_demo.serve.holder import ModelHolder

    holder = ModelHolder("tiny", ["cpu"], engine="reference", warmup=False)
    holder.preload()  # start-up load in the background, racing the first requests below
    seen = []

    def first_request() -> None:
        with holder.acquire() as lease:
            seen.append(lease.pipeline)

    threads = [threading.Thread(target=first_request) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(seen) == 3 and len({id(pipeline) for pipeline in seen}) == 1
    assert holder.loads == 1 and holder.status().state == "ready" and holder.status().busy == ()
    holder.release()


def test_finished_songs_expire_after_the_ttl(tmp_path):
    import os

    import numpy as np

    from music3_demo.events import Song
    from music3_demo.serve.store import SongStore

    store = SongStore(tmp_path, ttl_s=3600)
    song = Song(np.zeros((2, 4410), dtype=np.float32), c.SAMPLE_RATE, frames=2, seed=1)
    old, new = store.save(song, "old song"), store.save(song, "new song")
    two_hours_ago = time.time() - 7200
    os.utime(Path(old.wav).parent, (two_hours_ago, two_hours_ago))
    assert store.sweep() == 1
    assert not Path(old.wav).exists() and all(Path(path).exists() for path in (new.wav, new.flac, new.mp3))


def test_progress_line_follows_overlapping_stages():
    """On a GPU the flow stage runs while frames are still being made: the line shows both, the bar the frames."""
    from music3_demo.events import Progress
    from music3_demo.ui.progress import StageTracker
    from music3_demo.serve.runner import Phase

    sent = []
    tracker = StageTracker(duration_s=20.0, steps=30, min_interval=0.0)  # 500 frames, 4 chunks
    tracker.update(Phase("loading tiny onto cuda:0"))
    tracker.report(lambda *args, **kwargs: sent.append((args, kwargs)))
    assert sent[-1][0][0] == (2, 3) and sent[-1][1]["desc"].startswith("Loading model: loading tiny")
    tracker.update(Progress("semantic", 300, 500, rate=150.0, eta=1.33))
    tracker.update(Progress("flow", 45, 120))
    tracker.report(lambda *args, **kwargs: sent.append((args, kwargs)))
    (fraction,), kwargs = sent[-1]
    assert fraction == (300, 500) and kwargs["unit"] == "frames"
    assert "Semantic 300/500 frames · 150.0 frames/s · ETA 1 s" in kwargs["desc"]
    assert "Flow chunk 2/4" in kwargs["desc"]
    tracker.update(Progress("semantic", 500, 500, rate=150.0, eta=0.0))
    tracker.report(lambda *args, **kwargs: sent.append((args, kwargs)))
    assert sent[-1][0][0] == (45, 120) and sent[-1][1]["unit"] == "steps"


def test_status_line_says_while_the_song_waits_for_a_device():
    """What the click said stands until the line tells; then the place and start; cleared once the song has a device."""
    from music3_demo.ui.progress import StageTracker
    from music3_demo.serve.runner import Phase, Waiting

    tracker = StageTracker(duration_s=3.0, steps=8)
    assert tracker.status_text() is None
    tracker.update(Phase("waiting for a free device"))
    tracker.update(Waiting(2, 150.0))
    assert tracker.status_text() == "⏳ Waiting for your turn: number 2 in line, starts in about 2.5 min."
    tracker.update(Waiting(1, None))
    assert tracker.status_text() == "⏳ Waiting for your turn: next in line."
    tracker.update(Phase("loading tiny onto cpu"))
    assert tracker.status_text() == ""


def test_queue_is_bounded(tmp_path):
    with running_app(tmp_path, "--max-queue", "1", "--concurrency", "1") as server:
        clients = [Client(server.url, verbose=False) for _ in range(3)]
        running = clients[0].submit(**(QUICK | {"duration": 120.0}), api_name="/generate")
        while not server.status()["busy"]:
            time.sleep(0.1)
        waiting = clients[1].submit(**(QUICK | {"duration": 1.0}), api_name="/generate")
        time.sleep(1.0)
        refused = clients[2].submit(**(QUICK | {"duration": 1.0}), api_name="/generate")
        with pytest.raises(ValidationError, match=r"The server is busy: its queue of songs is full \(1 waiting\)"):
            refused.result(timeout=60)
        # The one that fitted waits its turn, and its progress says where it stands...
        deadline = time.monotonic() + 30  # its progress arrives on its own stream: wait for it, do not read it once
        while not ((data := waiting.status().progress_data) and "waiting for your turn: next in line" in data[0].desc):
            assert time.monotonic() < deadline, f"the waiting song was not told its place: {data}"
            time.sleep(0.1)
        running.cancel()
        assert abs(sf.info(waiting.result(timeout=120)[0]).frames / c.SAMPLE_RATE - 1.0) <= FRAME_S  # ...and runs
