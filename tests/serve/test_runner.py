"""The job runner in-process (no server): a generation's events come back on the caller's thread in order, and a
failure raised in the job's thread is raised in the caller's, with the job record saying so."""

from __future__ import annotations

import threading

import pytest

from music3_demo.events import Finished, Progress
from music3_demo.request import GenerationRequest, InvalidRequest
from music3_demo.serve.holder import ModelHolder
from music3_demo.serve.runner import JobRecord, generation_events


@pytest.fixture(scope="module")
def holder():
    holder = ModelHolder("tiny", ["cpu"], engine="reference", warmup=False)
    yield holder
    holder.release()


def test_events_arrive_in_order_on_the_callers_thread(holder):
    request = GenerationRequest("calm piano", duration=1.0, num_steps=1, seed=3, instrumental=True)
    record = JobRecord(1, request.duration)
    events = [event for event in generation_events(holder, request, threading.Event(), record) if event is not None]
    assert isinstance(events[-1], Finished) and events[-1].song.seed == 3
    assert "prompt" in [event.stage for event in events if isinstance(event, Progress)]
    assert record.state == "finished" and record.started_at <= record.ended_at


def test_a_failure_in_the_job_is_raised_in_the_caller_and_recorded(holder):
    request = GenerationRequest("calm piano", duration=-1.0, seed=3)
    record = JobRecord(2, request.duration)
    cancel = threading.Event()
    with pytest.raises(InvalidRequest) as error:
        list(generation_events(holder, request, cancel, record))
    assert record.state == "failed" and record.error == str(error.value)
    assert cancel.is_set()  # the runner's end sets the flag, whatever the outcome
