"""FlowExecutor: the one owner of a pipeline's DiT and vocoder calls; guided DiT calls of different songs that are
queued at the same moment run as one call.

Why one owner. Songs run on their own threads and CUDA streams (`worker.py`), but the modules they call hold shared
state: the captured DiT graphs' static input and output buffers (`dit_graph.py`), the DiT's cached rotary tables
(computed on whichever stream asked first) and the vocoder's weight-norm hooks (`torch.nn.utils.weight_norm`
recomputes `weight` and assigns it to the module at every call, so a song on another stream can read a weight still
being written, or already freed). Two songs at once would read each other's inputs. Here every such call runs on the
executor's thread, in order, on its one stream (high priority, like the flow workers'); songs hand their inputs over
with an event and get results back with one.

Order and merges: `call_queue.py` (a song's first chunk ahead of later chunks, the earliest-begun first; later chunks
held while a song gathers its first chunk's frames; which queued calls of one shape merge into one call, from the
buckets measured here by `calibrate()`). It keeps at most `IN_FLIGHT` calls queued on the GPU, so requests
accumulate while the GPU is busy instead of being launched one by one far ahead of it (the host enqueues a step in
well under a millisecond, the GPU takes ~14 ms), while a lone song still always has its next call queued behind the
running one. Full chunks replay a captured graph per bucket (1, 2 or 4 songs; 3 ready songs fill a bucket of 4 whose
spare row computes on stale inputs and is ignored); other lengths and the CPU run eagerly with exactly the rows
queued. Vocoder calls of equal length merge the same way; on a card whose memory plan has no room for a whole chunk's
vocoder activations, each chunk is decoded in tiles instead (`vocoder_tile`: the same samples, see `tiled_vocode`).

Results. A merged call's row for a song equals its lone call up to the products' rounding: the row count can change
the matrix kernels' choice and tiling, so in bf16 a song's velocity may differ from its lone call by bf16 roundings
(the GPU test bounds a call at 1e-2 relative, the bound that graph vs eager already uses, and the song's audio at
`AUDIO_TOLERANCE` there); in float32 on the CPU the rows agree to ~1e-6. With nothing merged a song's numbers are
exactly its lone numbers, whoever else runs. The executor draws no random numbers: each song's noise comes from its
own generator in its own FlowStream, so a song's random stream never depends on its partners.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from typing import Any, Callable, Iterator

import torch

from ..devices import on_device
from ..memory_layout import VOCODER_HALO
from .call_queue import BUCKETS, LATER, CallQueue, Order
from .dit_graph import VelocityGraphs
from .guidance import guided_velocity

IN_FLIGHT = 2  # calls queued on the GPU at once: the running one and the next
IDLE_EXIT_S = 10.0  # an idle executor's thread ends (a later call starts another): no thread outlives its use


class Pending:
    """One submitted call. `result()` returns its output ordered after the call on the submitting thread's stream
    (CUDA), or raises what the call raised. `partners`: how many other songs' calls ran in the same call."""

    def __init__(self, kind: str, key: tuple | None, payload: tuple, device: torch.device,
                 order: Order = LATER) -> None:
        self.kind, self.key, self.payload, self.order = kind, key, payload, order
        self.urgent = order.urgent
        self.consumer = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.ready = None
        if self.consumer is not None:
            self.ready = torch.cuda.Event()
            self.ready.record(self.consumer)
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.partners = 0
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._finished: torch.cuda.Event | None = None

    def result(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError("The flow executor did not answer in time.")
        if self._error is not None:
            raise self._error
        if self._finished is not None:
            self.consumer.wait_event(self._finished)
        return self._value

    def _finish(self, value: Any, finished: torch.cuda.Event | None) -> None:
        self._value, self._finished = value, finished
        self.payload = ()  # the inputs' memory may be reused once the call is queued (record_stream keeps it safe)
        self._done.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self.payload = ()
        self._done.set()


class FlowExecutor:
    THREAD_NAME = "music3-flow-executor"

    def __init__(self, transformer, vocoder, device: torch.device, graphs: VelocityGraphs | None = None,
                 mode: str = "auto", largest: tuple[int, int] = (max(BUCKETS), max(BUCKETS)),
                 vocoder_tile: int | None = None) -> None:
        """`largest`: the most songs one merged DiT call and the most chunks one vocoder call may take (the card's
        memory plan: each merged song or chunk adds its activations; calibrate() measures no larger call).
        `vocoder_tile`: latents per vocoder call, where the plan has no room for a whole chunk's (None: whole)."""
        self.transformer = transformer
        self.vocoder_tile = vocoder_tile
        self.buckets = {"graph": _upto(largest[0]), "eager": _upto(largest[0]), "vocode": _upto(largest[1])}
        self.vocoder = vocoder
        self._normed = _weight_normed(vocoder)
        self.device = device
        self.graphs = graphs
        # High priority like the flow workers' streams: a chunk's calls go before the semantic stage's frames.
        self._stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self._queue = CallQueue(self.buckets)
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._in_flight: collections.deque = collections.deque()
        self.stats: collections.Counter = collections.Counter()  # calls, and "<kind>_x<n>": calls of n songs
        self.calibration: dict | None = None
        self.set_mode(mode)

    # -- policy -------------------------------------------------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        """`auto`: merge where `calibrate()` measured it faster (nothing before); `always`: every bucket (tests,
        timing); `off`: never (each call exactly its lone numbers)."""
        self._queue.set_mode(mode, self.calibration)
        self.mode = mode

    @property
    def plans(self) -> dict:
        """The merge plan per kind of call (`call_queue.MergePlan`; first chunks have their own)."""
        return self._queue.plans

    # -- what songs call (from their own threads) ---------------------------------------------------------------
    def submit_velocity(self, latents: torch.Tensor, timestep: torch.Tensor, condition: torch.Tensor,
                        scale: float, order: Order = LATER) -> Pending:
        """One song's guided DiT call (batch-2 CFG): `latents` [1, C, L], `timestep` [1], `condition` [1, L, D].
        `order`: where it stands (a first chunk's calls are taken before the others')."""
        graphed = self.graphs is not None and self.graphs.supports(latents)
        key = ("velocity", "graph" if graphed else "eager", tuple(latents.shape[1:]), tuple(condition.shape[1:]),
               latents.dtype)
        return self._submit(Pending("velocity", key, (latents, timestep, condition, float(scale)), self.device,
                                    order))

    def submit_vocode(self, latents: torch.Tensor, order: Order = LATER) -> Pending:
        """One chunk's vocoder call: `latents` [1, C, L] in the vocoder's dtype -> waveform [1, 2, samples]."""
        return self._submit(Pending("vocode", ("vocode", "vocode", tuple(latents.shape[1:]), latents.dtype),
                                    (latents,), self.device, order))

    def submit_call(self, fn: Callable, *args, order: Order = LATER) -> Pending:
        """Any other call on the shared modules (diffusers' two-pass guidance, unguided steps): run alone, in
        order with the rest."""
        return self._submit(Pending("call", None, (fn, *args), self.device, order))

    def velocity(self, latents, timestep, condition, scale: float, order: Order = LATER) -> torch.Tensor:
        return self.submit_velocity(latents, timestep, condition, scale, order).result()

    def vocode(self, latents: torch.Tensor, order: Order = LATER) -> torch.Tensor:
        return self.submit_vocode(latents, order).result()

    def call(self, fn: Callable, *args, order: Order = LATER) -> Any:
        return self.submit_call(fn, *args, order=order).result()

    @contextlib.contextmanager
    def gathering(self) -> Iterator[None]:
        """Held by a song's caller while its first chunk's frames are being made: other songs' later chunks wait
        meanwhile (while their listeners have HOLD_UNTIL_S of audio left)."""
        with self._cv:
            self._queue.gathering += 1
        try:
            yield
        finally:
            with self._cv:
                self._queue.gathering -= 1
                self._cv.notify_all()

    def queued(self) -> int:
        """Calls waiting to run (not counting the one running)."""
        with self._cv:
            return len(self._queue.calls)

    def calibrate(self, length: int, repeats: int = 5) -> dict:
        """CUDA: time the graphed guided call for 1, 2 and 4 songs of `length` latents and the vocoder for 1, 2 and
        4 chunks, as far as `largest` allows (captures the graphs), then, in `auto` mode, merge only into buckets
        that beat as many lone calls by MERGE_GAIN. Runs on the executor's thread, between songs' calls. Returns
        the seconds per call and the buckets kept."""
        if self.graphs is None:
            raise RuntimeError("calibrate() measures captured graphs: CUDA with the fast flow path only")
        self.calibration = self.call(self._measure, length, repeats)
        self.set_mode(self.mode)
        return self.calibration | {"dit_buckets": self.plans["graph"].buckets,
                                   "vocoder_buckets": self.plans["vocode"].buckets}

    def close(self) -> None:
        """Fail what is queued, stop the thread (after the running call) and wait for the stream to be idle."""
        with self._cv:
            self._closed = True
            queued, self._queue.calls = self._queue.calls, []
            thread = self._thread
            self._cv.notify_all()
        for pending in queued:
            pending._fail(RuntimeError("The flow stage was shut down (the pipeline was released)."))
        if thread is not None:
            thread.join()
        if self._stream is not None:
            self._stream.synchronize()

    # -- the executor's thread ----------------------------------------------------------------------------------
    def _submit(self, pending: Pending) -> Pending:
        if self._stream is not None:  # the caller's allocator must not reuse the inputs before this stream reads them
            for value in pending.payload:
                if isinstance(value, torch.Tensor):
                    value.record_stream(self._stream)
        with self._cv:
            if self._closed:
                raise RuntimeError("The flow stage was shut down (the pipeline was released).")
            self._queue.calls.append(pending)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.THREAD_NAME, daemon=True)
                self._thread.start()
            self._cv.notify()
        return pending

    def _run(self) -> None:
        context = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with on_device(self.device), context, torch.no_grad():
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._queue.calls or self._closed, timeout=IDLE_EXIT_S)
                    if not self._queue.calls:
                        self._thread = None  # idle or closed; a later submit starts a new thread
                        return
                # Wait for the GPU to get through all but the last call launched: songs' requests gather meanwhile.
                while len(self._in_flight) >= IN_FLIGHT:
                    self._in_flight.popleft().synchronize()
                with self._cv:
                    group, bucket = self._queue.take()  # ([], 0) if close() emptied it meanwhile
                    if not group and self._queue.calls:  # all held for a gathering song: until one is due or it ends
                        self._cv.wait(self._queue.held_for())
                if group:
                    self._execute(group, bucket)

    def _execute(self, group: list[Pending], bucket: int) -> None:
        started = time.perf_counter()
        for pending in group:
            pending.started, pending.partners = started, len(group) - 1
        try:
            if self._stream is not None:
                for pending in group:
                    self._stream.wait_event(pending.ready)
            kind = group[0].kind
            if kind == "velocity":
                outputs = self._velocity(group, bucket)
            elif kind == "vocode":
                outputs = self._vocode(group)
            else:
                fn, *args = group[0].payload
                outputs = [fn(*args)]
            finished = None
            if self._stream is not None:
                for pending, output in zip(group, outputs):
                    _record_stream(output, pending.consumer)
                finished = torch.cuda.Event(blocking=True)  # the throttle's wait sleeps rather than spins a core
                finished.record(self._stream)
                self._in_flight.append(finished)
        except BaseException as error:  # noqa: BLE001 - raised again on each song's own thread
            for pending in group:
                pending._fail(error)
            return
        self.stats["calls"] += 1
        self.stats[f"{kind}_x{len(group)}"] += 1
        for pending, output in zip(group, outputs):
            pending._finish(output, finished)

    def _velocity(self, group: list[Pending], bucket: int) -> list[torch.Tensor]:
        latents, timestep, condition, scale = group[0].payload
        if group[0].key[1] == "graph":
            graph = self.graphs.get(latents, condition, rows=bucket)
            for row, pending in enumerate(group):
                graph.load(row, *pending.payload)
            out = graph.replay()
            return [out[row : row + 1].clone() for row in range(len(group))]
        if len(group) == 1:
            return [guided_velocity(self.transformer, latents, timestep, condition, scale, batched=True)]
        columns = list(zip(*(pending.payload for pending in group)))
        out = guided_velocity(self.transformer, torch.cat(columns[0]), torch.cat(columns[1]), torch.cat(columns[2]),
                              list(columns[3]), batched=True)
        return list(out.split(1))

    def _vocode(self, group: list[Pending]) -> list[torch.Tensor]:
        latents = torch.cat([pending.payload[0] for pending in group]) if len(group) > 1 else group[0].payload[0]
        return list(self._run_vocoder(latents).split(1))

    def _run_vocoder(self, latents: torch.Tensor) -> torch.Tensor:
        try:
            if self.vocoder_tile is None:
                return self.vocoder(latents)
            return tiled_vocode(self.vocoder, latents, self.vocoder_tile)
        finally:  # each call's weight-norm hooks compute the weights again: the last call's need not stay
            for module, name in self._normed:
                module.__dict__.pop(name, None)

    def _measure(self, length: int, repeats: int) -> dict:
        config = self.transformer.config
        generator = torch.Generator(self.device).manual_seed(0)

        def randn(*shape, dtype):
            return torch.randn(*shape, generator=generator, device=self.device, dtype=dtype)

        dit, vocoder = {}, {}
        for bucket in self.buckets["graph"]:
            latents = randn(bucket, config.in_channels, length, dtype=self.transformer.dtype)
            condition = randn(bucket, length, config.condition_dim, dtype=self.transformer.dtype)
            graph = self.graphs.get(latents[:1], condition[:1], rows=bucket)
            for row in range(bucket):
                graph.load(row, latents[row : row + 1], latents.new_full((1,), 0.5), condition[row : row + 1], 1.7)
            dit[bucket] = _seconds_per_call(graph.replay, repeats)
        for bucket in self.buckets["vocode"]:
            chunk = randn(bucket, self.vocoder.config.latent_channels, length, dtype=self.vocoder.dtype)
            vocoder[bucket] = _seconds_per_call(lambda: self._run_vocoder(chunk), repeats)
        return {"dit_call_s": dit, "vocoder_call_s": vocoder}


def tiled_vocode(vocoder, latents: torch.Tensor, tile: int, halo: int = VOCODER_HALO) -> torch.Tensor:
    """`vocoder(latents)` in tiles of `tile` latents, each decoded with `halo` latents of context either side and
    cropped to its own samples, so only one tile's activations are alive at a time. The decoder's convolutions see
    11 latents either way, so with the default halo every sample is computed from the same inputs as in one call
    (they differ by the convolutions' rounding only)."""
    length = latents.shape[-1]
    if length <= tile + 2 * halo:
        return vocoder(latents)
    hop = math.prod(vocoder.config.upsampling_ratios)  # samples per latent
    pieces = []
    for start in range(0, length, tile):
        end = min(length, start + tile)
        low, high = max(0, start - halo), min(length, end + halo)
        pieces.append(vocoder(latents[..., low:high])[..., (start - low) * hop : (end - low) * hop])
    return torch.cat(pieces, dim=-1)


def _weight_normed(vocoder) -> list[tuple[torch.nn.Module, str]]:
    """(module, weight name) of each `torch.nn.utils.weight_norm` hook in the vocoder (diffusers builds its
    convolutions with it). The hook computes the normalised weight before every call and leaves it on the module as
    a plain attribute: a second copy of the vocoder's weights (0.22 GB at full size) that no memory plan counts and
    no walk of parameters and buffers sees, so it stayed on the card when the stages took turns. The executor drops
    it after each of its calls (the next call computes it again, as it always did: the same samples)."""
    from torch.nn.utils.weight_norm import WeightNorm

    modules = vocoder.modules() if vocoder is not None else ()  # (an executor for DiT calls only: none)
    return [(module, hook.name) for module in modules for hook in module._forward_pre_hooks.values()
            if isinstance(hook, WeightNorm)]


def _upto(largest: int) -> tuple[int, ...]:
    return tuple(bucket for bucket in BUCKETS if bucket <= largest)


def _seconds_per_call(fn: Callable[[], Any], repeats: int) -> float:
    """GPU time of `fn` on the current stream: one call to warm up, then the mean of `repeats`."""
    fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000 / repeats


def _record_stream(value: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(value, torch.Tensor) and value.is_cuda:
        value.record_stream(stream)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _record_stream(item, stream)
