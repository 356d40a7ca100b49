"""Music3Pipeline: request -> prompt -> semantic frames -> flow chunks -> audio pieces, events out, cancel in."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import replace
from typing import Callable, Iterator

import torch

from . import contract as c
from . import flow as flow_stage
from .allocator import release_cached, trim_cache
from .checkpoint import FLOW_COMPONENTS, CheckpointError, ModelSource, default_device, default_dtype, resolve
from .continuation import SongState
from .devices import normalize, on_device, split_devices
from .events import Cancelled, Event, Song
from .flow.worker import FLOW_PRIORITY, FirstChunks, StreamPool
from .loading import (
    as_loaded,
    fp8_dit_waiting,
    getting_ready,
    hold_to_plans,
    lift_allocator_caps,
    load_model,
    modes_text,
    place_fp8_dit,
    plan_for,
)
from .memory import PeakSampler, note_process_start, song_guard
from .memory_map import start_recording, write_if_asked
from .memory_layout import WARM_UP, MemoryPlan
from .memory_plan import check_swap
from .precision import PrecisionChoice, check_dit_precision, check_kv_precision, check_precision
from .prompt import count_prompt_tokens
from .request import GenerationRequest, InvalidRequest, validate
from .semantic import make_engine, resolve_engine_name
from .semantic.precompile import start as start_precompile
from .song_run import Overlap, SongRun, Stages, overlap_rule
from .stage_swap import StageTurns, StageWeights
from .variations import make_together, stream_song

__all__ = ["Music3Pipeline", "Cancelled", "CheckpointError", "InvalidRequest", "SongState"]


class Music3Pipeline:
    def __init__(
        self,
        components: dict,
        source: ModelSource,
        device: torch.device,
        engine: str = "auto",
        overlap: bool | None = None,
        allow_interpreter: bool | None = None,
        precision: PrecisionChoice | None = None,
        lazy: bool = False,
        flow_device: torch.device | str | None = None,
        memory_plan: MemoryPlan | None = None,
        flow_memory_plan: MemoryPlan | None = None,
    ) -> None:
        """`overlap`: run the flow stage while semantic frames are still being made (default: when the engine draws
        from its own generator). With the reference engine it switches to separate per-stage generators, so results
        then differ from diffusers' single-generator draws (still deterministic for a seed). `allow_interpreter`:
        tests only, see `semantic.graph_on_cpu_allowed`. `precision`: what `components` were loaded as and why
        (from_pretrained's choice; unquantized weights when not given). `lazy`: build the engine (self-check, graph
        capture) and the flow stage's fast path at the first song, in the process that runs it (Space mode).
        `flow_device`: where the flow stage (condition encoder, DiT, vocoder; `components` already there) runs, when
        not on `device`: a stage split over two GPUs, so one song's frames and its audio are made side by side.
        `memory_plan`: the card's plan (memory_plan.py; from_pretrained's): the engine's slots and KV pool, the flow
        stage's largest merged calls and the longest song come from it (None: the engines' own defaults, no limit);
        `flow_memory_plan`: the flow card's, in a stage split. A plan's fp8 DiT that `components` still hold in bf16
        (loading.load_model's `defer_fp8_dit`) is quantized onto the flow device when the stages are built, after the
        engine's self-check: the load's peak is then the larger of the two, not their sum. A plan whose stages take
        turns (`MemoryPlan.swap`: `components`' flow parts still in host memory) has them on the device after the
        semantic stage's weights have left it (stage_swap.py); its songs are made one at a time, the stages taking
        turns during each (no overlap; the graphs captured again after each turn: their weights' addresses change)."""
        self.components = components
        self.source = source
        self.device = normalize(device)
        self.flow_device = normalize(flow_device) if flow_device is not None else self.device
        self.precision = precision or PrecisionChoice("bf16", "bf16", "The weights as they were given.")
        self.memory_plan = memory_plan
        self.flow_memory_plan = flow_memory_plan
        self.requested_engine = engine
        self._overlap = overlap
        self._allow_interpreter = allow_interpreter
        # The engine that runs (`auto` falls back to the reference when the fast engine fails its self-check) and
        # why: the record's sentence and check time travel with every song. None until the stages are built.
        self.engine = self.engine_record = self.engine_name = self.velocity_graphs = self.flow_executor = None
        self.flow_calibration: dict | None = None  # the flow executor's measured merged calls (`warm` on CUDA)
        self.overlap = self.separate_flow_rng = bool(overlap)  # what the stages will do, until they are built
        self.stages_pid: int | None = None  # the process whose CUDA context holds the engine's graphs and buffers
        self.setup_s: float | None = None  # what building the stages took (self-check and captures included)
        self._stages_lock = threading.Lock()
        self._fp8_dit_on_host = fp8_dit_waiting(components, memory_plan)
        self.swapping = bool(memory_plan is not None and memory_plan.swap)  # the stages take turns on the device
        self.turns: StageTurns | None = None  # which stage's weights are on the device (built with the stages)
        self._one_song = threading.Lock()  # with the stages in turn: the song that has them
        self.first_chunks = FirstChunks()  # songs waiting for their first audio: the others' frames wait meanwhile
        self.flow_streams = StreamPool(FLOW_PRIORITY)  # flow workers' streams, reused (their cache too)
        self.caller_streams = StreamPool()  # each song's caller runs on one of these, never on the default stream
        if not lazy:
            self.ensure_stages()

    def ensure_stages(self) -> bool:
        """Build the semantic engine and the flow stage's fast path unless this process already has them; True
        when they were built now. CUDA graphs, streams and buffers belong to the process that made them: a ZeroGPU
        worker is a fork of a parent that never touched the GPU, so each new worker builds its own here, at its
        first song (a lazy pipeline), and a worker that is reused keeps them."""
        with self._stages_lock:
            if self.stages_pid == os.getpid():
                return False
            if self.stages_pid is not None and self.components["language_model"].lm_head is None:
                raise RuntimeError(
                    f"This pipeline's engine was built in process {self.stages_pid} and trimmed the model there; "
                    "build pipelines that are shared with forked workers with lazy=True."
                )
            started = time.perf_counter()
            self.engine, self.engine_record = make_engine(
                self.components["language_model"], self.components["rvq_depth_decoder"], self.device,
                self.requested_engine, allow_interpreter=self._allow_interpreter, sizing=self._engine_sizing,
            )
            self.engine_name = self.engine_record.name
            semantic = self._semantic_leaves() if self.swapping else None
            if self._fp8_dit_on_host:  # the self-check's scratch has left the card
                self.release_caches()
                place_fp8_dit(self.components, self.flow_device)
                self._fp8_dit_on_host = False
            if self.swapping:
                for name in FLOW_COMPONENTS:  # (the fp8 DiT is there already)
                    self.components[name].to(self.flow_device)
            asked = False if self.swapping else self._overlap  # (in turn: the frames first, then the audio)
            self.overlap, self.separate_flow_rng = overlap_rule(asked, self.engine.separate_flow_rng, self.swapping)
            # Every song's DiT and vocoder calls go through the one executor (several songs may share this
            # pipeline); it holds the captured DiT graphs on CUDA, and its thread belongs to this process too.
            flow_plan = self.flow_memory_plan or self.memory_plan  # (merged calls only where they fit)
            with on_device(self.flow_device):  # its graphs are captured on the flow stage's own GPU
                self.flow_executor = flow_stage.prepare(self.components, self.flow_device, fast=self.separate_flow_rng,
                                                        buckets=flow_plan.merge_buckets if flow_plan else None,
                                                        vocoder_tile=flow_plan.vocoder_tile if flow_plan else None)
            self.velocity_graphs = self.flow_executor.graphs
            if semantic is not None:  # the flow stage has the device now; songs take it in turn
                parts = [self.components[name] for name in FLOW_COMPONENTS]
                # Its captured DiT steps read the weights' addresses: dropped before they leave (with their graph
                # pool), captured again at the first full chunk of the next flow turn.
                graphs = self.velocity_graphs
                self.turns = StageTurns([semantic, StageWeights(
                    "flow", self.flow_device, parts, on_leave=graphs.release if graphs is not None else lambda: None)])
            # What the self-check and the trim (full lm_head dropped, embeddings to the host) left in the cache.
            self.release_caches()
            self.stages_pid = os.getpid()
            self.setup_s = time.perf_counter() - started
            return True

    def _semantic_leaves(self) -> StageWeights:
        """The semantic stage's weights (the modules', and the engine's prepared ones) to host memory, its graphs
        dropped first: the flow stage's come onto the device in their place."""
        engine = self.engine
        semantic = StageWeights("semantic", self.device, [self.components["language_model"],
                                                          self.components["rvq_depth_decoder"],
                                                          getattr(engine, "weights", None)],
                                on_leave=getattr(engine, "drop_graphs", lambda: None))
        semantic.leave()
        return semantic

    def _engine_sizing(self, name: str) -> tuple[int | None, int | None, str, bool]:
        """(batch slots, KV pool positions, KV format, tables in host memory) for the engine `name` from the card's
        plan (Nones: the engine's own); another engine than the one planned for (the reference, after a failed
        self-check) is planned again."""
        if self.memory_plan is None:
            return None, None, "bf16", False
        self.memory_plan = self.memory_plan.for_engine(name)
        return self.memory_plan.engine_sizing()

    @property
    def memory_plan_dict(self) -> dict | None:
        """The plan's figures for `status` and the song report (both cards of a stage split)."""
        flow = self.flow_memory_plan
        return None if self.memory_plan is None else self.memory_plan.as_dict() | (
            {"flow_card": flow.as_dict() | {"device": str(self.flow_device)}} if flow is not None else {})

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        device: str | torch.device | None = None,
        engine: str = "auto",
        dtype: torch.dtype | None = None,
        revision: str | None = None,
        token: str | None = None,
        overlap: bool | None = None,
        allow_interpreter: bool | None = None,
        precision: str = "auto",
        lazy: bool = False,
        flow_device: str | torch.device | None = None,
        dit_precision: str = "auto",
        kv_precision: str = "auto",
        swap: str = "auto",
    ) -> "Music3Pipeline":
        """`precision`: the LM / depth decoder's, auto | bf16 | fp8 | int8 | int4; `dit_precision`: the DiT's, auto
        | bf16 | fp8 (sm_89+); `kv_precision`: the graph engine's KV cache, auto | bf16 | int8; `swap`: the stages
        take turns on the device, auto | on | off; auto: what the card's memory plan picks (memory_plan.py).
        `lazy`, `flow_device`: see __init__ (a `device` written "cuda:0+cuda:1" means device cuda:0, flow_device
        cuda:1). An out-of-memory while loading, self-checking or capturing leaves as one sentence
        (loading.getting_ready)."""
        note_process_start()  # the card's use by the others, before this process's CUDA context (memory.py)
        start_recording()  # allocation stacks or segment events for memory maps, where asked for (memory_map.py)
        device, flow_device = split_devices(device, flow_device)
        device = device if device is not None else normalize(default_device())
        resolve_engine_name(engine, device, allow_interpreter)  # fail before a long load
        check_precision(precision)
        check_dit_precision(dit_precision)
        check_kv_precision(kv_precision)
        check_swap(swap)
        dtype = dtype or default_dtype(device)
        source = resolve(model, revision=revision, token=token)
        with on_device(device):
            planned = resolve_engine_name(engine, device, allow_interpreter)
            plan, flow_plan = plan_for(precision, dit_precision, device, source, planned, flow_device, kv_precision,
                                       swap)
            plan = replace(plan, lm=as_loaded(plan.lm, dtype), dit=as_loaded(plan.dit, dtype))
            hold_to_plans(((device, plan), (flow_device, flow_plan)))  # torch's allocator within each plan
            # The engine's kernels compile in worker processes while the weights load (a lazy pipeline builds its
            # engine in another process, whose CUDA context this one must not make first).
            compiling = None if lazy else start_precompile(device, plan)
            try:
                with getting_ready(device, plan, flow_device=flow_device):
                    # (with the stages in turn the flow stage waits in host memory until the semantic one has left)
                    components = load_model(source, device, dtype, plan.lm, dit=plan.dit.mode, defer_fp8_dit=True,
                                            flow_device=torch.device("cpu") if plan.swap else flow_device,
                                            lean_head=planned == "graph")
                    if compiling is not None:
                        compiling.wait()
                    return cls(components, source, device, engine, overlap, allow_interpreter=allow_interpreter,
                               precision=plan.lm, lazy=lazy, flow_device=flow_device, memory_plan=plan,
                               flow_memory_plan=flow_plan)
            except BaseException:
                if compiling is not None:
                    compiling.stop()
                lift_allocator_caps(device, flow_device)
                raise

    @property
    def split(self) -> bool:
        """Whether the flow stage runs on a GPU of its own (a stage split)."""
        return self.flow_device != self.device

    @property
    def slots(self) -> int:
        """Songs this pipeline makes at once, each `generate()` on its own thread: the semantic engine's batch slots
        (1 for an engine without them). The flow stage takes them all: its shared state (the captured DiT graphs, the
        rotary tables, the vocoder's weight-norm hooks) is used only by the pipeline's one `flow_executor`. With the
        stages in turn: one."""
        return 1 if self.swapping else max(1, int(getattr(self.engine, "slots", 1)))

    @property
    def tokenizer(self):
        return self.components["tokenizer"]

    def count_tokens(self, description: str, lyrics: str) -> int:
        return count_prompt_tokens(self.tokenizer, description, lyrics)

    def validate(self, request: GenerationRequest) -> GenerationRequest:
        return validate(request, self.count_tokens).with_seed()

    def release(self) -> None:
        """Drop engine state (graphs, KV caches) and the weights; the object is unusable afterwards."""
        if self.stages_pid == os.getpid() and self.flow_executor is not None:  # (another process's are not ours)
            release = getattr(self.engine, "release", None)
            if release is not None:
                release()
            self.flow_executor.close()
            if self.velocity_graphs is not None:
                self.velocity_graphs.release()
            if self.turns is not None:
                self.turns.release()
        self.components.clear()
        # (and what holds weights: a pipeline still referenced, by a failed warm-up's traceback say, frees them)
        self.engine = self.flow_executor = self.velocity_graphs = self.turns = None
        self.release_caches()
        lift_allocator_caps(self.device, self.flow_device)

    def release_caches(self) -> None:
        """Give the allocator's unused blocks back on this pipeline's GPUs (both of a stage split)."""
        for device in {self.device, self.flow_device}:
            release_cached(device)

    def trim_caches(self) -> None:
        """After a song: the allocator's cache beyond `allocator.TRIM_KEEP_BYTES` back to the card, on this pipeline's
        GPUs (`allocator.trim_cache`)."""
        for device in {self.device, self.flow_device}:
            trim_cache(device)

    def warm(self) -> Song:
        """Pay the one-off costs (kernel selection, semantic and flow graph capture, allocator growth) with a
        throw-away song, so the first real song does not. On CUDA the song is long enough for one full flow chunk,
        whose guided DiT step is then captured here rather than inside a user's song; then the flow executor
        measures its merged DiT and vocoder calls and merges songs' calls only where that is faster. An
        out-of-memory here is the load's sentence (the warm-up is part of getting ready)."""
        with getting_ready(self.device, self.memory_plan, "warming up", self.precision.mode, self.flow_device):
            self.ensure_stages()
            seconds = (c.CHUNK_FRAMES + 5) / c.FRAME_RATE if self.velocity_graphs is not None else 1.0
            if self.turns is not None:  # (the engine's captures read its weights)
                self.turns.take("semantic")
            reserve = getattr(self.engine, "reserve", None)
            if reserve is not None:  # the graph engine: its KV pool and every batch size's graph, before any user
                reserve(*WARM_UP)  # (the pool's size is the plan's; this is only its least size)
            song = self.generate(GenerationRequest("warm-up", duration=seconds, num_steps=1, seed=0,
                                                   instrumental=True))
            if self.velocity_graphs is not None:
                self.flow_calibration = self.flow_executor.calibrate(flow_stage.full_chunk_latents(self.components))
            # The calibration's merged calls leave gigabytes cached on the executor's stream: given back now, the
            # first songs' streams find room under the allocator's cap instead of the cap making one of them give
            # the cache back (a wait for the whole device) in the middle of a first chunk.
            self.release_caches()
            write_if_asked(self.device, "ready")
            return song

    def generate_variations(
        self,
        request: GenerationRequest,
        count: int,
        on_event: Callable[[int, Event], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> list[Song]:
        """`count` (1-4) songs of one request with seeds seed, seed + 1, ... (a random first seed when it has none),
        made together: up to `slots` at once, each `generate()` on its own thread, so they share the engine's prefill
        and batch. Returns them in seed order. `on_event(index, event)` hears every song's events, on the caller's
        thread. The first error (a `Cancelled` when `cancel` is set) stops the others and is raised."""
        return make_together(self, request, count, on_event, cancel)

    def stream(
        self,
        request: GenerationRequest,
        cancel: threading.Event | None = None,
        continue_from: SongState | None = None,
    ) -> Iterator[Event]:
        """`generate()` as an iterator of its events, on the caller's thread (the song runs on a thread of its own):
        progress, audio pieces, and last `Finished(song)`; the song's error is raised here after the events before
        it. Closing the iterator (or `cancel`) stops the song."""
        return stream_song(self, request, cancel, continue_from)

    def generate(
        self,
        request: GenerationRequest,
        on_event: Callable[[Event], None] | None = None,
        cancel: threading.Event | None = None,
        continue_from: SongState | None = None,
    ) -> Song:
        """Make a song, or with `continue_from` (a finished song's `Song.state`, or `SongState.load(path)`) extend
        that song by `request.duration` seconds (`continuation.extension_request` builds such a request): its codes
        are the forced prefix, the flow stage restarts at its last chunk, and its audio before that chunk comes back
        unchanged as the first piece."""
        # Callers run on any thread (the app's runners start with device 0 current). An out-of-memory ends this
        # song with a sentence; its engine slot, flow worker and the allocator's cache are freed on the way out.
        modes = modes_text(self.memory_plan, self.precision.mode)
        with on_device(self.device), song_guard(self.device, modes, self.release_caches):
            built = self.ensure_stages()  # a lazy pipeline's first song (in this process) builds the engine
            one_song = self._one_song if self.turns is not None else contextlib.nullcontext()
            flow_sampler = PeakSampler(self.flow_device) if self.split else contextlib.nullcontext()
            caller_stream = self.caller_streams.lent(self.device)
            with one_song, PeakSampler(self.device) as memory, flow_sampler as flow_memory, caller_stream:
                run = SongRun(self._stages(), self.validate(request), on_event, cancel, continue_from)
                song = run.run(memory, flow_memory, self.setup_s if built else None)
            write_if_asked(self.device, "song")
            self.trim_caches()  # after the song's Finished: its hand-over does not wait for this
            return song

    def _stages(self) -> Stages:
        """The built stages as a song runs on them (ensure_stages first)."""
        return Stages(self.components, self.device, self.flow_device, self.engine, self.engine_record,
                      self.flow_executor, Overlap(self.overlap, self.separate_flow_rng), self.first_chunks,
                      self.flow_streams, self.memory_plan, self.memory_plan_dict, self.precision, self.source.notice,
                      self.turns)
