"""Process-wide cache of loaded pipelines: one load per device, the songs sharing each device, visible status.

Every request borrows a pipeline through `ModelHolder.acquire()`, which waits for the request's turn in the line
(scheduler.py: first come, first served; as many songs at once on a device as its pipeline has slots, and only while
the engine's memory holds them), loads the model there the first time (concurrent first requests wait for that one
load) and keeps the song's place on the device for the whole generation. A failed load is remembered with its
message (the page shows it) and retried by the next request, so a fixed network or a finished licence click-through
needs no restart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..checkpoint import CheckpointError, ModelSource, default_device, resolve
from ..devices import on_device, split_devices
from ..errors import OutOfMemory, public_message
from ..loading import NoRoom
from ..memory import MemoryWatch, freeze_loaded_objects, note_process_start, thaw_loaded_objects
from ..request import InvalidRequest
from ..semantic import EngineUnavailable
from .zerogpu import WorkerClock
from .scheduler import Scheduler, Ticket
from .speed import Speed

if TYPE_CHECKING:  # the pipeline (diffusers, transformers) is imported on first load, not when the page is built
    from ..memory_layout import MemoryPlan
    from ..pipeline import Music3Pipeline

# How a failed load tells users what to do, whatever the cause.
FIX_HINT = (
    "To run without the Hub, start the app with --model /path/to/MiniMax-Music3 (a local copy in the Hub layout, "
    "with modular_model_index.json) or --model tiny (a built-in test model whose output is noise)."
)

PhaseCallback = Callable[[str], None]
# A load reports these phases in order, each as the first word of its text (the page shows "step k of 3").
LOAD_PHASES = ("fetching", "loading", "warming")


@dataclass(frozen=True)
class HolderStatus:
    """What the page shows about the model: one line of state plus the error or noise notice when there is one."""

    model: str
    state: str  # "idle" (lazy, not loaded yet) | "loading" | "ready" | "failed"
    phase: str  # what the current load is doing, or what happened last
    devices: tuple[str, ...]
    busy: tuple[str, ...]  # devices running a generation now
    slots: dict[str, int]  # songs each device may run at once (1 until it is loaded)
    running: dict[str, int]  # songs each device runs now
    waiting: int  # songs in line for a device
    engine: str | None
    engine_note: str | None  # why the fast engine is not used (it failed its self-check or could not start)
    engine_check_s: float | None  # the fast engine's self-check at load, when one ran
    precision: str | None  # the LM / depth-decoder weights: bf16 | fp8 | int8
    precision_reason: str | None  # why (auto's sentence, or "as asked")
    memory: dict | None  # GPU -> the card's memory now (memory.DeviceMemory), for loaded CUDA devices (both of a split)
    memory_plan: dict | None  # device -> its card's memory plan (memory_layout.MemoryPlan.as_dict), loaded devices
    plan_summary: str | None  # the first loaded device's plan in short: precision per stage, slots, longest song
    error: str | None
    notice: str | None  # set when the loaded model is a built-in random one
    loading_for_s: float | None
    loads: int

    def as_dict(self) -> dict:
        return dict(self.__dict__, devices=list(self.devices), busy=list(self.busy), slots=dict(self.slots),
                    running=dict(self.running))


class _HeldDevice:
    """One device: its pipeline (once loaded) and a lock for loading it (its batch places: `songs_at_once`)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.pipeline = None
        self.load_lock = threading.Lock()

    @property
    def songs_at_once(self) -> int:
        return max(1, getattr(self.pipeline, "slots", 1)) if self.pipeline is not None else 1


@dataclass
class Lease:
    pipeline: Music3Pipeline
    device: str
    ticket: Ticket
    holder: ModelHolder

    def joined(self) -> None:
        """The song's first frames came: the engine holds its memory (the device's room check counts it)."""
        if not self.ticket.joined:
            self.holder.scheduler.joined(self.ticket)


class ModelHolder:
    def __init__(
        self, model: str, devices: list[str] | None = None, engine: str = "auto", warmup: bool = True,
        precision: str = "auto", lazy: bool = False, max_running: int | None = None, **modes: str,
    ) -> None:
        """`precision` and `modes` (`dit_precision`, `kv_precision`, `swap`): the LM's, the DiT's, the KV cache's,
        whether the stages take turns (Music3Pipeline.from_pretrained; auto: each card's memory plan). `lazy`: pipelines
        build their engines at their first song, in the process that runs it (Space mode: zerogpu.py); the holder
        then learns the engine from the songs. `max_running`: songs at once over all devices (None: their slots)."""
        self.model = model
        self.engine = engine
        self.warmup = warmup
        self.precision, self.modes = precision, modes
        self.lazy = lazy
        self.workers = WorkerClock()  # Space mode: what the GPU workers' set-up costs
        self._song_engine: dict[str, tuple[str, str | None]] = {}  # device -> (engine, note) of its last song
        self.devices = devices or default_devices()
        self._held = [_HeldDevice(device) for device in self.devices]
        self._by_device = {held.device: held for held in self._held}
        self.scheduler = Scheduler(self.devices, lambda d: self._by_device[d].songs_at_once, self._admits,
                                   limit=max_running, loaded=lambda d: self._by_device[d].pipeline is not None)
        self._source: ModelSource | None = None
        self._source_lock = threading.Lock()
        self._tokenizer = None
        self._phase = "not loaded yet: the model loads on the first song"
        self._error: str | None = None
        self._loading: dict[str, float] = {}  # device -> when its load began
        self.loads = 0  # completed loads (one per device in a healthy process: the status endpoint shows it)
        self._preloading = False  # preload() was asked for and has not ended: the page says "loading" at once
        self.speeds: dict[str, Speed] = {}  # device -> measured at warm-up, refined by every finished song
        self._memory = MemoryWatch()  # the loaded CUDA devices' memory (both GPUs of a split), for status()

    # ---- status -------------------------------------------------------------------------------------------------
    def status(self) -> HolderStatus:
        loaded = [held.pipeline for held in self._held if held.pipeline is not None]
        loading = dict(self._loading)
        if loading or (self._preloading and not loaded and self._error is None):
            state = "loading"
        elif loaded:
            state = "ready"
        elif self._error is not None:
            state = "failed"
        else:
            state = "idle"
        running = self.scheduler.running()
        first = loaded[0] if loaded else None
        seen = next(iter(self._song_engine.values()), (None, None))
        # Sampled on the watch's thread: a status never makes a CUDA call (it could wait behind the songs' work).
        memory = {gpu: figures.as_dict() for gpu, figures in self._memory.latest().items()}
        return HolderStatus(
            model=self.model,
            state=state,
            phase=self._phase,
            devices=tuple(self.devices),
            busy=tuple(device for device, songs in running.items() if songs),
            slots={held.device: held.songs_at_once for held in self._held},
            running=running,
            waiting=self.scheduler.waiting(),
            # A lazy pipeline (Space mode) has no engine in this process: its songs say which one ran.
            engine=(first.engine_name or seen[0]) if first else None,
            # A note from any device (each checks its own engine); the check time of the first that ran one.
            engine_note=next((p.engine_record.fallback_reason for p in loaded
                              if p.engine_record and p.engine_record.fallback_reason), seen[1]),
            engine_check_s=next((p.engine_record.check_s for p in loaded
                                 if p.engine_record and p.engine_record.check_s is not None), None),
            precision=first.precision.mode if first else None,
            precision_reason=first.precision.reason if first else None,
            memory=memory or None,
            memory_plan={held.device: held.pipeline.memory_plan_dict for held in self._held
                         if held.pipeline is not None and held.pipeline.memory_plan is not None} or None,
            plan_summary=next((p.memory_plan.summary() for p in loaded if p.memory_plan is not None), None),
            error=self._error if not loaded else None,
            notice=self._source.notice if self._source is not None else None,
            loading_for_s=time.monotonic() - min(loading.values()) if loading else None,
            loads=self.loads,
        )

    def _watch_memory(self) -> None:
        """The memory watch follows the loaded pipelines' GPUs (none for a lazy pipeline: this process has none)."""
        self._memory.watch([str(gpu) for held in self._held if held.pipeline is not None and not self.lazy
                            for gpu in split_devices(held.device) if gpu is not None])

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    @property
    def tokenizer(self):
        """The model's tokenizer, None until fetched (the Ray backend's front counts tokens with a replica's)."""
        return self._tokenizer

    def count_tokens(self, description: str, lyrics: str) -> int | None:
        """Exact prompt length with the model's own tokenizer; None until the tokenizer has been fetched."""
        if self._tokenizer is None:
            return None
        from ..prompt import count_prompt_tokens

        return count_prompt_tokens(self._tokenizer, description, lyrics)

    # ---- loading ------------------------------------------------------------------------------------------------
    def preload(self, background: bool = True) -> threading.Thread | None:
        """Load on every device now (in a thread, so the page opens while it loads)."""

        def load_all() -> None:
            try:
                for held in self._held:
                    self._ensure_loaded(held, None)
            except Exception:  # noqa: BLE001 - remembered in status and raised again to the next request
                return
            finally:
                self._preloading = False

        self._preloading = True
        self._phase = "starting"
        if not background:
            load_all()
            return None
        thread = threading.Thread(target=load_all, name="music3-preload", daemon=True)
        thread.start()
        return thread

    def _set_phase(self, phase: str, on_phase: PhaseCallback | None) -> None:
        self._phase = phase
        if on_phase is not None:
            on_phase(phase)

    def _resolve(self, on_phase: PhaseCallback | None) -> ModelSource:
        with self._source_lock:
            if self._source is None:
                self._set_phase(f"{LOAD_PHASES[0]} {self.model} (downloads once, then comes from the local cache)",
                                on_phase)
                self._source = resolve(self.model)
                if self._source.folder is not None:
                    self._tokenizer = _load_tokenizer(self._source)
            return self._source

    def _ensure_loaded(self, held: _HeldDevice, on_phase: PhaseCallback | None):
        if held.pipeline is not None:
            return held.pipeline
        with held.load_lock:  # concurrent first requests: one loads, the others wait here and reuse it
            if held.pipeline is not None:
                return held.pipeline
            from ..pipeline import Music3Pipeline

            self._loading[held.device] = started = time.monotonic()
            self._error, pipeline = None, None
            try:
                source = self._resolve(on_phase)
                self._set_phase(f"{LOAD_PHASES[1]} {self.model} onto {held.device}", on_phase)
                target = str(source.folder) if source.folder is not None else source.name
                note_process_start()  # before on_device makes this process's first CUDA context (memory.py)
                # this thread (preload, a request's runner) may have another current (a split: its engine's GPU)
                with on_device(split_devices(held.device)[0]):
                    # overlap: the flow stage on its own thread (and stream) while frames are made, so songs stream
                    # on the CPU too. With the reference engine that means per-stage generators: the app's songs are
                    # deterministic per seed but not diffusers' waveform (the CLI and Python API keep that contract).
                    pipeline = Music3Pipeline.from_pretrained(target, device=held.device, engine=self.engine,
                                                              overlap=True, precision=self.precision,
                                                              lazy=self.lazy, **self.modes)
                    if self._tokenizer is None:
                        self._tokenizer = pipeline.tokenizer
                    if self.warmup:
                        # The first song on a fresh pipeline pays one-off costs (kernel selection, graph capture,
                        # allocator growth); a one-second song here keeps them away from the first user.
                        self._set_phase(f"{LOAD_PHASES[2]} up on {held.device}", on_phase)
                        self.record_song(held.device, pipeline, pipeline.warm(), steps=1)
            except Exception as error:
                if pipeline is not None:  # loaded, then its warm-up failed: its memory goes now, not at a collection
                    pipeline.release()
                self._error = load_error_message(self.model, error)
                self._phase = "failed to load"
                raise CheckpointError(self._error) from error
            finally:
                elapsed = time.monotonic() - started
                self._loading.pop(held.device, None)
            held.pipeline = pipeline
            freeze_loaded_objects()  # the collector's full passes no longer walk the loaded model (status answers)
            self.loads += 1
            self._watch_memory()
            self.scheduler.refresh()  # its slots are known now: songs waiting for room may join
            self._set_phase(f"ready on {', '.join(self.devices)} (loaded in {elapsed:.1f} s)", on_phase)
            return pipeline

    # ---- speed ------------------------------------------------------------------------------------------------
    def record_song(self, device: str, pipeline: Music3Pipeline, song, steps: int) -> None:
        """Fold a finished song's timings into the device's measured speed."""
        measured = Speed.from_song(song.frames, steps, song.timings,
                                   overlapped=pipeline.device.type == "cuda" and pipeline.overlap)
        if measured is not None:
            known = self.speeds.get(device)
            self.speeds[device] = measured if known is None else known.blend(measured)

    def record_finished(self, device: str, song, steps: int) -> None:
        """A song made elsewhere (a Space's GPU worker) on `device`'s pipeline: its speed, engine and set-up."""
        pipeline = next((held.pipeline for held in self._held if held.device == device), None)
        if pipeline is not None:
            self.record_song(device, pipeline, song, steps)
        self._song_engine[device] = (song.engine, song.engine_note)
        self.workers.note_song(song.timings)

    def speed(self) -> Speed | None:
        """The slowest device's measured speed (None before any song)."""
        return min(self.speeds.values(), key=lambda speed: speed.frames_per_s, default=None)

    def estimate_s(self, frames: int, steps: int) -> float | None:
        """Expected seconds for a song once it has a device (the slowest device's speed); None before a warm-up."""
        times = [speed.seconds_for(frames, steps) for speed in self.speeds.values()]
        return max(times) if times else None

    def expected_s(self, ticket: Ticket) -> float | None:
        return self.estimate_s(ticket.frames, ticket.steps)

    # ---- use ----------------------------------------------------------------------------------------------------
    def ticket(self, request=None, max_frames: int | None = None, group: int | None = None) -> Ticket:
        """A place for `request` (a GenerationRequest; None: a bare one for tools and tests), not yet in line."""
        if request is None:
            return Ticket(group=group)
        text = (request.description, request.effective_lyrics)
        return Ticket(frames=max_frames if max_frames is not None else request.max_frames,
                      steps=request.num_steps, prompt_tokens=self.count_tokens(*text), text=text, group=group)

    def enqueue(self, tickets: list[Ticket]) -> list[Ticket]:
        """Take places in the line now, together (variations of one request): their order is their submission's."""
        return self.scheduler.enqueue(tickets)

    def start_in(self, ticket: Ticket) -> float | None:
        """Seconds until `ticket` should start (one not in line: as if it joined the line now); None: unknown."""
        return self.scheduler.start_in(ticket, self.expected_s)

    def plans(self) -> list[MemoryPlan | None]:
        """The loaded pipelines' memory plans (None for a pipeline without one)."""
        return [held.pipeline.memory_plan for held in self._held if held.pipeline is not None]

    def too_long(self, prompt_tokens: int | None, frames: int) -> str | None:
        """The sentence for a song that no loaded device's memory plan holds even alone (naming the longest that
        fits), or None: it fits one, or no device is loaded yet (its placement checks again)."""
        return too_long_on(self.plans(), prompt_tokens, frames)

    def _admits(self, device: str, tickets: list[Ticket]) -> bool:
        """Whether the device's engine has memory for these songs beside those it holds (always, before it is loaded
        or without a pool); InvalidRequest for a new song no device can ever hold: it must not wait for ever."""
        pipeline = self._by_device[device].pipeline
        can_admit = getattr(getattr(pipeline, "engine", None), "can_admit", None)
        if can_admit is None:
            return True
        for ticket in tickets:
            if ticket.prompt_tokens is None and ticket.text is not None:  # made before the tokenizer was there
                ticket.prompt_tokens = pipeline.count_tokens(*ticket.text)
        if all(held.pipeline is not None for held in self._held):
            refusal = self.too_long(tickets[-1].prompt_tokens, tickets[-1].frames)
            if refusal is not None:
                raise InvalidRequest(refusal, field="duration")
        return bool(can_admit(sum(t.prompt_tokens or 0 for t in tickets), sum(t.frames for t in tickets)))

    @contextmanager
    def acquire(
        self, on_phase: PhaseCallback | None = None, cancel: threading.Event | None = None,
        ticket: Ticket | None = None, on_wait: Callable[[int, float | None], None] | None = None,
    ) -> Iterator[Lease]:
        """Wait for `ticket`'s turn (a bare one when None), then lend its device's pipeline (loading it if needed)
        for one generation. `on_wait(position, start_in_s)` hears the place in line while it waits."""
        ticket = ticket or Ticket()
        announced = []

        def told(position: int, start_in_s: float | None) -> None:
            if on_phase is not None and not announced:
                on_phase("waiting for a free device")
                announced.append(True)
            if on_wait is not None:
                on_wait(position, start_in_s)

        try:
            device = self.scheduler.wait(ticket, cancel, told, self.expected_s)
            yield Lease(self._ensure_loaded(self._by_device[device], on_phase), device, ticket, self)
        finally:
            self.scheduler.leave(ticket)

    def release(self) -> None:
        """Free every loaded pipeline (shutdown); later requests load again."""
        for held in self._held:
            with held.load_lock:
                if held.pipeline is not None:
                    held.pipeline.release()
                    held.pipeline = None
        thaw_loaded_objects()
        self._watch_memory()
        self._phase = "released"


def default_devices() -> list[str]:
    if torch.cuda.is_available():
        return [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    return [str(default_device())]


def too_long_on(plans: list[MemoryPlan | None], prompt_tokens: int | None, frames: int) -> str | None:
    """The refusal for a song that none of these plans holds even alone (the sentence of the one that holds the
    longest), or None: one holds it, or there is no plan (nothing loaded, or a pipeline without one)."""
    if prompt_tokens is None or not plans or None in plans or any(not p.too_long(prompt_tokens, frames)
                                                                  for p in plans):
        return None
    return max(plans, key=lambda plan: plan.max_frames(prompt_tokens)).too_long(prompt_tokens, frames)


def load_error_message(model: str, error: Exception) -> str:
    """One paragraph: what failed (the checkpoint code's own sentence when it has one) and how to get going. The
    "run without the Hub" hint only where the Hub is the problem: not for a local folder or a built-in model,
    whose faults the sentence itself names."""
    why = public_message(error)  # never a raw CUDA message (errors.py)
    if isinstance(error, (EngineUnavailable, NoRoom, OutOfMemory)):  # their sentences name what to change
        return why
    if not isinstance(error, CheckpointError):
        why = f"Could not load {model}: {why}"
    local = model in ("tiny", "random-full") or Path(model).expanduser().exists() or model.startswith((".", "/", "~"))
    return why if "--model" in why or local else f"{why} {FIX_HINT}"  # checkpoint.py's messages name their fix


def _load_tokenizer(source: ModelSource):
    """Fetch just the tokenizer (fast) so the prompt counter is exact while the weights still load."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(source.folder / "tokenizer"))
    except Exception:  # noqa: BLE001 - the counter falls back to the pipeline's tokenizer once loaded
        return None
