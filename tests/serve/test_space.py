"""Space mode (ZeroGPU) on a CPU: the GPU time promised per request, and a job's GPU part run the way ZeroGPU runs it,
in a forked process whose arguments and yields are pickled across (ZeroGPU itself cannot run here: its workers need
its device service and a GPU; `spaces.GPU` outside ZeroGPU returns the function unchanged)."""

from __future__ import annotations

import multiprocessing
import pickle
import time

import pytest

from music3_demo import contract as c
from music3_demo.events import AudioPiece, Cancelled, Finished
from music3_demo.request import GenerationRequest, InvalidRequest
from music3_demo.serve import zerogpu as gpu
from music3_demo.serve.zerogpu import MAX_GPU_S, WorkerClock, estimate_gpu_seconds
from music3_demo.serve.holder import ModelHolder
from music3_demo.serve.runner import Job, JobRegistry, _space_duration, register_holder, relay_space_events, \
    space_generation_events
from music3_demo.serve.speed import Speed

H200 = Speed(frames_per_s=100.0, flow_s_per_frame_step=0.42 / 30 / 200, vocoder_s_per_frame=0.036 / 200,
             overlapped=True)


def test_the_promise_grows_with_the_song_the_steps_and_a_continued_songs_prefix():
    short, long = GenerationRequest("x", duration=10), GenerationRequest("x", duration=240)
    assert 0 < estimate_gpu_seconds(short) < estimate_gpu_seconds(long) <= MAX_GPU_S
    assert estimate_gpu_seconds(GenerationRequest("x", duration=60, num_steps=100)) > estimate_gpu_seconds(
        GenerationRequest("x", duration=60, num_steps=10))
    assert estimate_gpu_seconds(short, prefix_frames=3000) > estimate_gpu_seconds(short)


def test_measured_speed_replaces_the_pessimistic_rates_and_a_new_worker_adds_its_set_up():
    request = GenerationRequest("x", duration=120)
    frames = c.max_frames_for(120)
    measured = estimate_gpu_seconds(request, H200)
    assert measured == pytest.approx(gpu.MARGIN_S + H200.seconds_for(frames, request.num_steps), abs=1)
    assert measured < estimate_gpu_seconds(request)  # 60 frames/s before any song: 50 s of decoding alone
    assert estimate_gpu_seconds(request, H200, new_worker_s=45.0) == measured + 45


def test_a_worker_is_new_until_a_song_ended_recently_and_its_set_up_is_the_measured_one(monkeypatch):
    clock = WorkerClock()
    assert clock.may_be_new() and clock.new_worker_s() == gpu.NEW_WORKER_S  # nothing measured yet
    now = [1000.0]
    monkeypatch.setattr(gpu.time, "monotonic", lambda: now[0])
    clock.note_song({"total_s": 30.0, "setup_s": 4.0})
    assert not clock.may_be_new()
    assert clock.new_worker_s() == 4.0 + gpu.WEIGHTS_TO_WORKER_S
    now[0] += gpu.WARM_WORKER_S + 1
    assert clock.may_be_new()
    clock.note_song({"total_s": 30.0})  # a warm worker's song: no set-up, the measured one stays
    assert clock.setup_s == 4.0


def test_the_promise_uses_the_holders_measured_speed_and_is_kept_on_the_job_record():
    holder = ModelHolder("tiny", ["cpu"], "reference", warmup=False, lazy=True)
    holder.speeds["cpu"] = H200
    request = GenerationRequest("x", duration=60)
    job = Job(holder, request)
    seconds = _space_duration(register_holder(holder), request, job.record, 0.2, None)
    assert seconds == estimate_gpu_seconds(request, H200, gpu.NEW_WORKER_S) == job.record.gpu_s
    holder.workers.note_song({"setup_s": 3.0})
    assert _space_duration(register_holder(holder), request, job.record, 0.2, None) == estimate_gpu_seconds(
        request, H200)


def forked_gpu_call(key, request, record, tick, continue_from):
    """What spaces.GPU does with a generator function on ZeroGPU, reduced to its transport: the arguments pickled,
    the function run in a forked process, every yield pickled back, and closing this side stopping the worker's."""
    key, request, record, tick, continue_from = pickle.loads(pickle.dumps((key, request, record, tick,
                                                                           continue_from)))
    context = multiprocessing.get_context("fork")
    results, stop = context.Queue(), context.Event()

    def worker() -> None:
        events = space_generation_events(key, request, record, tick, continue_from)
        for item in events:
            results.put(pickle.dumps(item))
            if stop.is_set():
                events.close()
                break
        results.put(None)

    process = context.Process(target=worker, daemon=True)
    process.start()
    forked_gpu_call.processes.append(process)
    try:
        while (item := results.get(timeout=120)) is not None:
            yield pickle.loads(item)
    except GeneratorExit:
        stop.set()
        raise
    finally:
        process.join(60)


forked_gpu_call.processes = []


@pytest.fixture(scope="module")
def space_holder(tiny_folder):
    holder = ModelHolder("tiny", ["cpu"], "reference", warmup=False, lazy=True)
    holder.preload(background=False)  # the weights placed at start-up, as on ZeroGPU
    yield holder
    holder.release()


def test_a_space_song_builds_its_engine_in_the_worker_and_reports_back_to_the_main_process(space_holder):
    pipeline = space_holder._held[0].pipeline
    assert pipeline.stages_pid is None and space_holder.status().state == "ready"  # nothing built at start-up
    request = GenerationRequest("lofi", "[verse]\nla la", duration=1.0, num_steps=2, seed=5)
    for attempt in range(2):  # each call forks a new worker, which builds (captures) its engine again
        job = Job(space_holder, request, JobRegistry())
        events = list(relay_space_events(job, forked_gpu_call, tick=0.2))
        song = next(event.song for event in events if isinstance(event, Finished))
        assert "setup_s" in song.timings  # built in the worker, by this song
        assert sum(event.samples.shape[-1] for event in events if isinstance(event, AudioPiece)) == song.audio.shape[-1]
        assert (job.record.state, job.record.device) == ("finished", "cpu") and job.record.ended_at is not None
    assert pipeline.stages_pid is None  # the main process never built it
    assert "cpu" in space_holder.speeds and space_holder.workers.setup_s == song.timings["setup_s"]
    status = space_holder.status()
    assert (status.engine, status.precision) == ("reference", "float32")  # a CPU runs unquantized weights so
    assert all(process.exitcode == 0 for process in forked_gpu_call.processes)


def test_a_workers_error_arrives_as_itself_and_a_stop_ends_the_workers_song(space_holder):
    job = Job(space_holder, GenerationRequest("", "[verse]\nla", duration=1.0), JobRegistry())
    with pytest.raises(InvalidRequest, match="description"):  # not ZeroGPU's generic "worker error"
        list(relay_space_events(job, forked_gpu_call, tick=0.2))
    assert job.record.state == "failed"

    job = Job(space_holder, GenerationRequest("lofi", "[verse]\nla", duration=30.0, num_steps=2), JobRegistry())
    events = relay_space_events(job, forked_gpu_call, tick=0.05)
    next(events)
    job.stop()
    started = time.monotonic()
    with pytest.raises(Cancelled):
        list(events)
    forked_gpu_call.processes[-1].join(30)
    assert forked_gpu_call.processes[-1].exitcode == 0 and time.monotonic() - started < 30
    assert job.record.state == "cancelled"
