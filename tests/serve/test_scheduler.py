"""Many users on one device, in-process through the real holder on the tiny model (its reference engine has 4 slots):
songs join while there is room, wait in one first-come line otherwise (never an engine error), leave one by one, a
cancelled waiting song gives its place away, a full engine pool holds the line, variations start together, and a
waiting song hears its place and an estimated start (within the limit of songs at once too)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from music3_demo.events import Cancelled
from music3_demo.request import GenerationRequest
from music3_demo.semantic import SamplingSettings
from music3_demo.serve.holder import ModelHolder
from music3_demo.serve.speed import Speed


@pytest.fixture(scope="module")
def holder():
    holder = ModelHolder("tiny", ["cpu"], engine="reference", warmup=False)
    holder.preload(background=False)
    yield holder
    holder.release()


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class User:
    """A thread that takes its place in line and keeps its device until told to leave."""

    def __init__(self, holder: ModelHolder, name: str, ticket=None) -> None:
        self.holder, self.name, self.ticket = holder, name, ticket or holder.ticket(REQUEST)
        self.leave, self.cancel = threading.Event(), threading.Event()
        self.device: str | None = None
        self.started_at: float | None = None
        self.error: BaseException | None = None
        self.heard: list[tuple[int, float | None]] = []
        self.thread = threading.Thread(target=self._run, name=f"user-{name}", daemon=True)

    def _run(self) -> None:
        try:
            with self.holder.acquire(cancel=self.cancel, ticket=self.ticket,
                                     on_wait=lambda *place: self.heard.append(place)) as lease:
                self.device, self.started_at = lease.device, time.monotonic()
                lease.joined()
                self.leave.wait(60)
        except BaseException as error:  # noqa: BLE001 - the test reads it
            self.error = error

    def start(self) -> User:
        self.thread.start()
        return self

    def done(self) -> None:
        self.leave.set()
        self.thread.join(30)


REQUEST = GenerationRequest("calm piano", duration=2.0, num_steps=1, seed=1, instrumental=True)


def running(holder: ModelHolder) -> int:
    return holder.status().running["cpu"]


def line_up(holder: ModelHolder, names: list[str]) -> list[User]:
    """Users who must wait, started one after another so that their order in line is known."""
    users = []
    for name in names:
        before = holder.status().waiting
        users.append(User(holder, name).start())
        wait_until(lambda: holder.status().waiting == before + 1, f"{name} did not take a place in line")
    return users


def test_songs_share_the_device_up_to_its_slots_then_wait_first_come_first_served(holder):
    assert holder.status().slots == {"cpu": 4}  # the engine's slots: the tiny reference engine runs 4 at once
    first = [User(holder, f"u{i}").start() for i in range(4)]
    wait_until(lambda: running(holder) == 4, "four songs did not run at once")
    waiting = line_up(holder, ["w0", "w1", "w2"])
    assert [holder.scheduler.position(user.ticket) for user in waiting] == [1, 2, 3]
    assert all(user.started_at is None and user.error is None for user in waiting)

    first[2].done()  # one song leaves: the head of the line takes its place, nobody else
    wait_until(lambda: waiting[0].started_at is not None, "the head of the line did not start")
    time.sleep(0.3)
    assert waiting[1].started_at is None and [holder.scheduler.position(u.ticket) for u in waiting[1:]] == [1, 2]
    assert running(holder) == 4
    assert waiting[1].heard[0][0] == 2 and waiting[1].heard[-1][0] == 1  # it heard its place move up

    for user in first[:2] + first[3:] + waiting:
        user.done()
    # First come, first served: the order the scheduler placed them (set under its lock). The users' own clocks
    # would race: two places freed together wake two threads in either order.
    starts = [user.ticket.started for user in waiting]
    assert None not in starts and starts == sorted(starts)
    assert holder.status().running == {"cpu": 0} and holder.status().waiting == 0
    assert max(user.ticket.peers for user in first) == 3  # each saw the three others on the device


def test_a_stopped_waiting_song_leaves_the_line_and_the_others_keep_their_songs(holder):
    users = [User(holder, f"u{i}").start() for i in range(4)]
    wait_until(lambda: running(holder) == 4, "four songs did not run at once")
    stopped, behind = line_up(holder, ["stopped", "behind"])

    stopped.cancel.set()
    stopped.thread.join(5)
    assert isinstance(stopped.error, Cancelled) and stopped.started_at is None
    wait_until(lambda: holder.scheduler.position(behind.ticket) == 1, "the song behind did not move up")
    assert running(holder) == 4 and all(user.error is None and user.started_at for user in users)

    users[0].done()
    wait_until(lambda: behind.started_at is not None, "the song behind did not start when a place freed")
    for user in users[1:] + [behind]:
        user.done()
    assert holder.status().running == {"cpu": 0}


def test_a_full_engine_holds_the_line_instead_of_failing(holder):
    """Songs that the engine runs for someone else (its slots all taken outside the holder): can_admit says no, so a
    request waits in line (no EngineBusy) and starts as soon as the engine has room."""
    pipeline = next(held.pipeline for held in holder._held)
    ids = torch.tensor([[1, 2, 3, 4], [1, 0, 0, 4]])
    runs = [pipeline.engine.frames(ids, 40, SamplingSettings(), torch.Generator().manual_seed(seed))
            for seed in range(4)]
    for run in runs:
        next(run)  # each song holds an engine slot from its first block on
    assert not pipeline.engine.can_admit(10, 50)
    user = User(holder, "patient").start()
    time.sleep(0.5)
    assert user.started_at is None and user.error is None and holder.scheduler.position(user.ticket) == 1
    runs[0].close()  # one of them ends: room for one
    wait_until(lambda: user.started_at is not None, "the song did not start once the engine had room")
    for run in runs[1:]:
        run.close()
    user.done()
    assert user.error is None


def test_variations_start_together_and_the_line_holds_its_order(holder):
    alone = [User(holder, f"u{i}").start() for i in range(2)]
    wait_until(lambda: running(holder) == 2, "two songs did not start")
    group = holder.enqueue([holder.ticket(REQUEST, group=7) for _ in range(3)])  # one request, 3 variations
    later = User(holder, "later").start()  # asked after them: waits behind the third variation
    variations = [User(holder, f"v{i}", ticket).start() for i, ticket in enumerate(group)]
    wait_until(lambda: all(v.started_at for v in variations[:2]), "two variations did not start together")
    time.sleep(0.3)
    assert variations[2].started_at is None and holder.scheduler.position(variations[2].ticket) == 1
    assert holder.scheduler.position(later.ticket) == 2

    alone[0].done()
    wait_until(lambda: variations[2].started_at is not None, "the third variation did not start next")
    assert later.started_at is None
    for user in alone[1:] + variations + [later]:
        user.done()
    assert later.started_at is not None and later.started_at >= variations[2].started_at


def test_a_waiting_song_hears_when_it_should_start(holder, monkeypatch):
    # A measured speed (as the warm-up or a finished song leaves it): 10 s per song of REQUEST's size.
    frames = holder.ticket(REQUEST).frames
    monkeypatch.setitem(holder.speeds, "cpu", Speed(frames / 10.0, 0.0, 0.0, overlapped=False))
    users = [User(holder, f"u{i}").start() for i in range(4)]
    wait_until(lambda: running(holder) == 4, "four songs did not start")
    time.sleep(1.0)  # they have run about a second: about 9 s left each
    waiting = line_up(holder, [f"w{i}" for i in range(5)])
    wait_until(lambda: all(user.heard for user in waiting), "a waiting song heard nothing")
    # The four running songs free their places in under 9 s; the first four in line take them; the fifth gets the
    # first of those to free again, one song (10 s) later.
    place, start = waiting[0].heard[0]
    assert place == 1 and 5.0 < start < 9.5
    assert waiting[3].heard[0][0] == 4 and waiting[3].heard[0][1] == pytest.approx(start, abs=0.5)
    assert waiting[4].heard[0][0] == 5 and waiting[4].heard[0][1] == pytest.approx(start + 10.0, abs=0.5)
    for user in users + waiting:
        user.done()


def test_under_a_limit_of_songs_at_once_a_waiting_song_starts_when_the_running_one_ends(holder, monkeypatch):
    # `--concurrency 1`: one song at a time although the engine has 4 slots, so the 3 empty slots are no place.
    frames = holder.ticket(REQUEST).frames
    monkeypatch.setitem(holder.speeds, "cpu", Speed(frames / 10.0, 0.0, 0.0, overlapped=False))
    monkeypatch.setattr(holder.scheduler, "limit", 1)
    first = User(holder, "first").start()
    wait_until(lambda: running(holder) == 1, "the first song did not start")
    time.sleep(1.0)  # about 9 s of it left
    assert 7.0 < holder.start_in(holder.ticket(REQUEST)) < 9.5  # what the page tells at the click
    second = line_up(holder, ["second"])[0]
    wait_until(lambda: second.heard, "the waiting song heard nothing")
    place, start = second.heard[0]
    assert place == 1 and 7.0 < start < 9.5 and second.started_at is None
    first.done()
    wait_until(lambda: second.started_at is not None, "the waiting song did not start when the first ended")
    second.done()


def test_a_song_whose_caller_went_away_gives_back_its_place_in_line_but_not_on_the_device(holder):
    users = [User(holder, f"u{i}").start() for i in range(4)]
    wait_until(lambda: running(holder) == 4, "four songs did not start")
    gone, next_one = holder.enqueue([holder.ticket(REQUEST), holder.ticket(REQUEST)])
    holder.scheduler.withdraw(gone)  # its handler closed before its job's thread took the place
    assert holder.scheduler.position(next_one) == 1 and holder.status().waiting == 1
    late = User(holder, "late", gone).start()  # a job thread that starts afterwards does not take it again
    late.thread.join(5)
    assert isinstance(late.error, Cancelled) and holder.status().waiting == 1

    holder.scheduler.withdraw(users[0].ticket)  # a running song keeps its place until it has really stopped
    assert running(holder) == 4 and holder.scheduler.position(next_one) == 1
    holder.scheduler.withdraw(next_one)
    for user in users:
        user.done()
    assert holder.status().running == {"cpu": 0} and holder.status().waiting == 0


def test_a_loaded_model_is_out_of_the_collectors_full_passes():
    """Once a model is loaded, what is alive is frozen out of the garbage collector's view (its full passes would
    walk the whole model and the libraries, stalling the server's threads); a release gives it back."""
    import gc

    holder = ModelHolder("tiny", ["cpu"], engine="reference", warmup=False)
    gc.unfreeze()
    holder.preload(background=False)
    frozen = gc.get_freeze_count()
    holder.release()
    assert frozen > 10_000 and gc.get_freeze_count() == 0
