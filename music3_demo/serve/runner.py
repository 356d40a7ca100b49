"""One generation as a background job: the pipeline runs in a worker thread, the caller iterates its events.

The caller (a Gradio handler) must get control back often: Gradio can only close a generator between two `next()`
calls, and closing is how a Stop press or a vanished browser tab reaches us. So `Job.events()` yields `None` every
`tick` seconds when nothing happened, and closing it sets the cancel flag the pipeline checks every frame / step.
"""

from __future__ import annotations

import itertools
import pickle
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..continuation import SongState
from ..events import Cancelled, Event, Finished, Progress
from ..handoff import END, Handoff
from ..request import GenerationRequest
from .zerogpu import estimate_gpu_seconds, on_gpu
from .holder import ModelHolder
from .scheduler import Ticket
from .song_files import SongFiles

if TYPE_CHECKING:
    from .backend import SongBackend

_ids = itertools.count(1)


@dataclass(frozen=True)
class Phase:
    """Model loading / waiting for a device: text for the progress bar."""

    text: str


@dataclass(frozen=True)
class Waiting:
    """The song waits in line for a device: its place (1 = next) and when it should start (None: not known yet)."""

    position: int
    start_in_s: float | None

    @property
    def text(self) -> str:
        place = "next in line" if self.position == 1 else f"number {self.position} in line"
        if self.start_in_s is None:
            return f"waiting for your turn: {place}"
        start = f"{self.start_in_s:.0f} s" if self.start_in_s < 90 else f"{self.start_in_s / 60:.1f} min"
        return f"waiting for your turn: {place}, starts in about {start}"


@dataclass
class JobRecord:
    """What the server remembers about a job (the `status` endpoint shows the recent ones)."""

    id: int
    duration: float
    state: str = "queued"  # queued | running | finished | cancelled | failed
    submitted_at: float = field(default_factory=time.time)
    started_at: float | None = None  # the device was ours from here...
    ended_at: float | None = None  # ...to here
    device: str | None = None
    error: str | None = None
    position: int | None = None  # place in line while it waits for a device (1 = next)
    starts_in_s: float | None = None  # when it should start, as estimated at `position`'s last update
    shared_gpu_with: int | None = None  # the most other songs that ran on its device at the same time
    variation: int | None = None  # 1..N for one of N variations of a request
    session: str | None = None  # whose job it is: a client sees only its own (never shown)
    gpu_s: int | None = None  # Space mode: the GPU time promised to ZeroGPU for it
    song_id: str | None = None  # its song in the store, once handed over
    files: SongFiles | None = None  # which of its song's files exist yet (the WAV first, the others after)

    def as_dict(self) -> dict:
        fields = {key: value for key, value in self.__dict__.items() if key != "session"}
        fields["files"] = self.files.report() if self.files is not None else None
        return fields


def generation_events(
    holder: ModelHolder, request: GenerationRequest, cancel: threading.Event, record: JobRecord, tick: float = 0.2,
    continue_from: SongState | None = None, ticket: Ticket | None = None, wake: threading.Event | None = None,
) -> Iterator[Event | Phase | Waiting | None]:
    """Run one generation in a worker thread and yield its events in order (`None` on idle ticks; `Waiting` while
    `ticket` waits in line). `wake` is set whenever an event arrives (a consumer of several jobs polls them with
    `tick` 0 and sleeps on it).

    A generator so that it can run under `spaces.GPU` on ZeroGPU, which streams a generator's yields back from the
    GPU process; raises what the pipeline raised. Closing it sets `cancel`.
    """

    def work(put) -> None:
        def waiting(position: int, start_in_s: float | None) -> None:
            record.position, record.starts_in_s = position, start_in_s
            put(Waiting(position, start_in_s))

        try:
            with holder.acquire(on_phase=lambda text: put(Phase(text)), cancel=cancel, ticket=ticket,
                                on_wait=waiting) as lease:
                record.state, record.device = "running", lease.device
                record.position = record.starts_in_s = None
                record.started_at = time.time()

                def on_event(event: Event) -> None:
                    if isinstance(event, Progress) and event.stage == "semantic":
                        lease.joined()  # its first frames came: the engine holds its memory
                    put(event)

                try:
                    song = lease.pipeline.generate(request, on_event=on_event, cancel=cancel,
                                                   continue_from=continue_from)
                    holder.record_song(lease.device, lease.pipeline, song, request.num_steps)  # for later ETAs
                finally:
                    # Stamped before the place is handed on, so a device's songs never outnumber its slots.
                    record.ended_at = time.time()
                    record.shared_gpu_with = lease.ticket.peers
            record.state = "finished"
        except BaseException as error:  # the hand-off raises it again in the consumer's thread
            record.state = "cancelled" if cancel.is_set() else "failed"
            record.error = str(error) or type(error).__name__
            raise

    yield from handed_back(work, f"music3-job-{record.id}", cancel, tick, wake)


def handed_back(work: Callable[[Callable], None], name: str, cancel: threading.Event, tick: float,
                wake: threading.Event | None = None) -> Iterator[object | None]:
    """`work(put)` on a thread of its own (`name`): what it puts, here in order, and `None` every `tick` s while
    nothing came (`wake` is set whenever it puts one); raises what it raised. Closing this sets `cancel`."""
    events = Handoff(work, name, wake)
    try:
        while True:
            try:
                item = events.get(timeout=tick)
            except queue.Empty:
                yield None
                continue
            if item is END:
                break
            yield item
    finally:
        cancel.set()  # no-op after a normal end; stops the worker when the consumer went away


# Space mode (serve/zerogpu.py): the holder a ZeroGPU worker uses is its copy of this process's, found by key (a holder
# cannot be pickled; the worker, a fork, has the same registry).
_HOLDERS: dict[int, ModelHolder] = {}


def register_holder(holder: ModelHolder) -> int:
    _HOLDERS[id(holder)] = holder
    return id(holder)


@dataclass(frozen=True)
class RecordUpdate:
    """The job record as the GPU worker last saw it (the main process's own record is another copy)."""

    fields: dict


@dataclass(frozen=True)
class Raised:
    """An exception of the worker's song, carried as a value: ZeroGPU would turn a raised one into a generic error."""

    error: BaseException


def space_generation_events(
    holder_key: int, request: GenerationRequest, record: JobRecord, tick: float,
    continue_from: SongState | None,
) -> Iterator[Event | Phase | RecordUpdate | Raised | None]:
    """The GPU part of a job in Space mode, run in a ZeroGPU worker (under `spaces.GPU`): `relayed_events` on the
    worker's copy of the holder."""
    holder = _HOLDERS.get(holder_key)
    if holder is None:
        raise RuntimeError("the GPU worker has no model holder: register_holder() before the first GPU call")
    yield from relayed_events(holder, request, record, tick, continue_from)


def relayed_events(
    holder: ModelHolder, request: GenerationRequest, record: JobRecord, tick: float,
    continue_from: SongState | None, cancel: threading.Event | None = None,
) -> Iterator[Event | Phase | RecordUpdate | Raised | None]:
    """A job's song for another process to relay (a ZeroGPU worker's, a Ray replica's): its events with snapshots of
    the record whenever it changed, and its exception as a `Raised` value. Closing it (or setting `cancel`) cancels
    the song."""
    cancel = cancel or threading.Event()
    seen = record.as_dict()
    events = generation_events(holder, request, cancel, record, tick, continue_from)
    try:
        for item in events:
            if record.as_dict() != seen:
                seen = record.as_dict()
                yield RecordUpdate(seen)
            if isinstance(item, Finished) and item.song.state is not None:
                item.song.state = item.song.state.on_host()  # its flow tensors are on this worker's GPU
            yield item
    except Exception as error:  # noqa: BLE001 - every failure goes back as a value (see Raised)
        yield RecordUpdate(record.as_dict())
        yield Raised(_picklable(error))
        return
    finally:
        events.close()
    yield RecordUpdate(record.as_dict())


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - a library's exception that does not pickle: keep its sentence
        return RuntimeError(f"{type(error).__name__}: {error}")


def _space_duration(holder_key: int, request: GenerationRequest, record: JobRecord, tick: float,
                    continue_from: SongState | None) -> int:
    """Seconds to promise ZeroGPU (runs in the main process before the call; see gpu.estimate_gpu_seconds)."""
    holder = _HOLDERS[holder_key]
    clock = holder.workers
    prefix = continue_from.frames if continue_from is not None else 0
    seconds = estimate_gpu_seconds(request, holder.speed(), clock.new_worker_s() if clock.may_be_new() else 0.0,
                                   prefix)
    record.gpu_s = seconds
    return seconds


_gpu_space_events = on_gpu(space_generation_events, duration=_space_duration)


def received(job: Job, item: object) -> object | None:
    """One item of a song relayed from another process (`relayed_events`), on the job's side: a record snapshot is
    applied to the job's record (None comes back), a carried exception is raised as itself, anything else returned;
    `Cancelled` once the job is stopped."""
    if job.cancel.is_set():
        raise Cancelled()
    if isinstance(item, RecordUpdate):
        # (its song's files are this process's: the other process's copy never has them)
        vars(job.record).update({k: v for k, v in item.fields.items() if k not in ("song_id", "files")})
        return None
    if isinstance(item, Raised):
        raise item.error
    return item


def relay_space_events(
    job: Job, gpu_events: Callable[..., Iterator], tick: float
) -> Iterator[Event | Phase | None]:
    """The main process's side of a Space-mode job: runs `gpu_events` (the GPU call) and passes its events on,
    applies the record snapshots, raises the worker's exception as itself, notes the finished song in this
    process's holder, and closes the call when the job is stopped (which stops the worker's song)."""
    key = register_holder(job.backend)
    call = gpu_events(key, job.request, job.record, tick, job.continue_from)
    try:
        for item in call:
            if (item := received(job, item)) is None:
                continue
            if isinstance(item, Finished) and job.record.device is not None:
                job.backend.record_finished(job.record.device, item.song, job.request.num_steps)
            yield item
    finally:
        call.close()
        job.cancel.set()
        if job.record.state in ("queued", "running"):
            job.record.state, job.record.ended_at = "cancelled", job.record.ended_at or time.time()


class Job:
    """One request's generation, its cancel flag and its record."""

    def __init__(self, backend: SongBackend, request: GenerationRequest, registry: JobRegistry | None = None,
                 session: str | None = None, continue_from: SongState | None = None,
                 ticket: Ticket | None = None, variation: int | None = None) -> None:
        """`ticket`: its place, when the caller put it in line already (variations, together); else it takes one
        when its events start."""
        self.backend = backend
        self.request = request
        self.continue_from = continue_from  # the song this job extends (continuation.py), if any
        frames = request.max_frames + (continue_from.frames if continue_from is not None else 0)
        self.ticket = ticket or backend.ticket(request, frames)
        self.cancel = threading.Event()
        self.stop_requested = False
        self.ended = "stopped before it finished (a Stop press, a cancel or a closed connection)"  # for the log
        self.record = JobRecord(next(_ids), request.duration, session=session, variation=variation)
        if registry is not None:
            registry.remember(self.record)

    def events(self, tick: float = 0.2, wake: threading.Event | None = None
               ) -> Iterator[Event | Phase | Waiting | None]:
        """The job's events (`backend.SongBackend.song_events`)."""
        return self.backend.song_events(self, tick, wake)

    def stop(self) -> None:
        # Told apart from `cancel`, which the event stream also sets when it ends normally (to stop a worker whose
        # consumer went away): only this says the user asked to stop.
        self.stop_requested = True
        self.cancel.set()


class JobRegistry:
    """The running job of each browser session (for Stop) and the recent job records (for the status endpoint)."""

    def __init__(self, keep: int = 64) -> None:
        self._active: dict[str, list[Job]] = {}  # a session's running jobs (N for N variations)
        self._recent: deque[JobRecord] = deque(maxlen=keep)
        self._published: tuple[JobRecord, ...] = ()  # what `recent` reads: replaced whole, never waited for
        self._lock = threading.Lock()

    def remember(self, record: JobRecord) -> None:
        with self._lock:
            self._recent.append(record)
            self._published = tuple(self._recent)

    def start(self, session: str | None, job: Job) -> None:
        if session:
            with self._lock:
                self._active.setdefault(session, []).append(job)

    def finish(self, session: str | None, job: Job) -> None:
        with self._lock:
            jobs = self._active.get(session, []) if session else []
            if job in jobs:
                jobs.remove(job)
            if session in self._active and not jobs:
                del self._active[session]

    def stop(self, session: str | None) -> bool:
        """Set the cancel flags of the session's running jobs (only theirs); False when it has none."""
        with self._lock:
            jobs = list(self._active.get(session, [])) if session else []
        for job in jobs:
            job.stop()
        return bool(jobs)

    def stopped(self, session: str | None) -> bool:
        """Whether the session's running jobs have been told to stop (its handler then shows "Stopped")."""
        with self._lock:
            jobs = list(self._active.get(session, [])) if session else []
        return any(job.stop_requested for job in jobs)

    def recent(self, session: str | None) -> list[dict]:
        """The recent jobs of one session (a browser tab or an API client); none for an unknown caller. Reads the
        published records (the job threads update them in place), so it never waits for a lock."""
        return [record.as_dict() for record in self._published if session and record.session == session]
