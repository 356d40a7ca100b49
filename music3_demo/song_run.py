"""One song's run over a pipeline's built stages: the prompt, the semantic engine's frames, the flow worker beside
them (or after them), the song's timings and its `Song`. pipeline.py builds the stages and hands each song here.

The phases, in order: `prompt` (tokens, and the plan's refusal of a song too long for the card), `flow_stage` (the
generators, the flow stream resumed for a continuation, its worker thread), `semantic` (the engine's frame blocks,
each fed to the flow worker at once when the stages overlap, else held), `finish_flow` (the held frames, the last
chunks, every piece delivered) and `song` (the one place a `Song` is built). With the stages in turn, each stage's
weights come onto the device before its phase (`_turn`), and the frames held so far go to the flow stage in turns
during the song (`_flow_turn`, at stage_swap.flow_turns), so its audio streams from its first chunk on.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch

from . import contract as c
from .continuation import SongState, check_continuation
from .events import AudioPiece, Event, Finished, Progress, Song, check_cancel
from .first_audio import first_audio_path
from .flow.stream import FlowSettings, FlowStream, Piece
from .flow.worker import FirstChunks, FlowWorker, StreamPool, progress_from_step
from .memory import PeakSampler
from .memory_layout import MemoryPlan
from .precision import PrecisionChoice
from .prompt import tokenize
from .request import GenerationRequest, InvalidRequest
from .semantic import EngineRecord, SamplingSettings
from .stage_swap import StageTurns, flow_turns

# The flow stage's generator on the fast engines is seeded apart from the semantic one, so overlap cannot change
# results run to run.
FLOW_SEED_OFFSET = 0x9E3779B9


class Overlap(NamedTuple):
    overlap: bool  # the flow stage denoises chunks while the semantic engine still makes frames
    separate_flow_rng: bool  # the flow stage draws from a generator of its own (on the flow device)


def overlap_rule(asked: bool | None, engine_separate_rng: bool, turns: bool = False) -> Overlap:
    """Whether a song's flow stage runs beside the semantic engine: as `asked`, else when the engine draws from a
    generator of its own (the fast engines). Overlapping needs the flow stage's own generator too, so that how the
    two stages interleave cannot change a song, and so do the stages in turn (`turns`: no overlap, but the frames
    go to the flow stage during the song); without it every stage shares one CPU generator, diffusers' draws."""
    overlap = engine_separate_rng if asked is None else asked
    return Overlap(overlap, engine_separate_rng or overlap or turns)


@dataclass(frozen=True)
class Stages:
    """What a song runs on: the pipeline's built stages and the facts every song's report carries."""

    components: dict
    device: torch.device
    flow_device: torch.device
    engine: object  # a semantic engine: frames(text_ids, max_frames, sampling, generator, cancel, prefix=)
    engine_record: EngineRecord
    flow_executor: object  # every song's DiT and vocoder calls go through it
    overlap: Overlap
    first_chunks: FirstChunks  # songs waiting for their first audio: the others' frames wait meanwhile
    flow_streams: StreamPool  # the flow workers' streams, reused song after song
    memory_plan: MemoryPlan | None
    memory_plan_dict: dict | None
    precision: PrecisionChoice
    model_notice: str | None
    turns: StageTurns | None = None  # the stages take turns on the device: which has it (stage_swap.py)

    @property
    def split(self) -> bool:
        """Whether the flow stage runs on a GPU of its own (a stage split)."""
        return self.flow_device != self.device


def sampling_for(request: GenerationRequest) -> SamplingSettings:
    return SamplingSettings(request.lm_cfg_scale, request.top_k)


def generators(stages: Stages, seed: int) -> tuple[torch.Generator, torch.Generator]:
    """(semantic, flow) generators for a new song of `seed`."""
    if not stages.overlap.separate_flow_rng:
        # diffusers' convention: one CPU generator shared by every stage (device-independent results).
        shared = torch.Generator("cpu").manual_seed(seed)
        return shared, shared
    semantic = torch.Generator(stages.device).manual_seed(seed)
    flow = torch.Generator(stages.flow_device).manual_seed((seed + FLOW_SEED_OFFSET) % 2**64)
    return semantic, flow


def resumed_flow_generator(stages: Stages, state: SongState, seed: int) -> torch.Generator:
    """The flow generator as it was before the song's last chunk, so the continuation decodes as the whole song
    would have. A state from another kind of device (a GPU song continued on a CPU) cannot be restored there: the
    re-rendered chunks then take fresh noise (the audio before them is kept either way)."""
    kind = stages.flow_device if stages.overlap.separate_flow_rng else torch.device("cpu")
    restored = state.flow.generator(kind)
    if restored is not None:
        return restored
    return torch.Generator(kind).manual_seed((seed + FLOW_SEED_OFFSET) % 2**64)


class SongRun:
    """One request's run: its tokens, generators, flow stream and worker, pieces, timings and frame count."""

    def __init__(self, stages: Stages, request: GenerationRequest, on_event: Callable[[Event], None] | None,
                 cancel, continue_from: SongState | None) -> None:
        """`request`: validated, with its seed; `continue_from`: the song this run extends (continuation.py)."""
        self.stages = stages
        self.request = request
        self.emit = on_event or (lambda event: None)
        self.cancel = cancel
        self.continue_from = continue_from
        self.max_frames = request.max_frames if continue_from is None else check_continuation(request, continue_from)
        self.started = time.perf_counter()
        self.timings: dict[str, float] = {}
        self.pieces: list[np.ndarray] = []
        self.frames = 0
        self.blocks = None  # the engine's frame run, once the semantic phase has begun
        self.semantic_generator: torch.Generator | None = None
        self.flow: FlowStream | None = None
        self.worker: FlowWorker | None = None
        self._paused = self._held_s = 0.0  # time the semantic stage stood still for chunks 0 (not semantic work)

    @torch.no_grad()
    def run(self, memory: PeakSampler, flow_memory: PeakSampler | None, setup_s: float | None) -> Song:
        """Every phase in order; the song's `Finished` is its last event. `memory` / `flow_memory`: the samplers of
        the song's devices (stopped here, their figures in the song); `setup_s`: what building the stages took, when
        this song built them."""
        text_ids = self.prompt()
        self.flow_stage()
        if self.continue_from is not None and self.continue_from.head.shape[-1]:
            self._deliver(Piece(self.continue_from.head, 0))  # final already: heard while the rest is made
        try:
            self._turn("semantic")
            held = self.semantic(text_ids)
            codes = self.blocks.codes()[: self.frames + 1].to("cpu", torch.int32).numpy()
            if self.stages.turns is not None:
                self.blocks.close()  # the engine is idle before its weights leave the device
            self._turn("flow")
            self.finish_flow(held)
        finally:
            if self.blocks is not None:
                self.blocks.close()  # a cancelled or failed song leaves the engine now (its slot is free for another)
            self.worker.close()
            self.stages.flow_streams.give_back(self.stages.flow_device, self.worker.stream)
        self.emit(Progress("vocoder", self.flow.timings.chunks, self.flow.timings.chunks))
        song = self.song(codes, memory, flow_memory, setup_s)
        self.emit(Finished(song))
        return song

    def _turn(self, stage: str) -> None:
        """With the stages in turn: `stage`'s weights onto the device (the other's to host memory), its cost added
        to the song's timings."""
        if self.stages.turns is not None:
            self.emit(Progress("turn", 0, 1))
            key = f"turn_to_{stage}_s"
            self.timings[key] = self.timings.get(key, 0.0) + self.stages.turns.take(stage)
            self.timings["stage_turns"] = self.timings.get("stage_turns", 0) + 1

    def _flow_turn(self, held: list[torch.Tensor]) -> None:
        """With the stages in turn, during the frames: the frames held so far to the flow stage (its weights in,
        the semantic stage's out), every chunk they complete delivered, then the semantic stage back for the next
        frames (the engine's graphs captured again over its weights' new addresses)."""
        began = time.perf_counter()
        self._turn("flow")
        for block in held:
            self.worker.submit(block)
        held.clear()
        self.worker.drain()
        self._publish(wait=False, until_drained=True)
        self._turn("semantic")
        self._paused += time.perf_counter() - began

    def prompt(self) -> torch.Tensor:
        """The prompt's token ids on the semantic device; a song longer than the card's plan holds even alone is
        refused with one sentence naming the longest that fits."""
        self.emit(Progress("prompt", 0, 1))
        request, plan = self.request, self.stages.memory_plan
        tokenizer = self.stages.components["tokenizer"]
        text_ids = tokenize(tokenizer, request.description, request.effective_lyrics).to(self.stages.device)
        if plan is not None and (refusal := plan.too_long(text_ids.shape[1], self.max_frames)):
            raise InvalidRequest(refusal, field="duration")
        self.timings["prompt_s"] = time.perf_counter() - self.started
        self.emit(Progress("prompt", 1, 1))
        return text_ids

    def flow_stage(self) -> None:
        """The song's flow stream (resumed at a continued song's last chunk) and the worker thread that runs it."""
        stages, request = self.stages, self.request
        self.semantic_generator, flow_generator = generators(stages, request.seed)  # one, shared, without overlap
        if self.continue_from is not None:
            flow_generator = resumed_flow_generator(stages, self.continue_from, request.seed)
        settings = FlowSettings(request.num_steps, request.guidance_scale,
                                batched_cfg=stages.overlap.separate_flow_rng)
        self.flow = FlowStream(stages.components, settings, flow_generator, stages.flow_device, cancel=self.cancel,
                               executor=stages.flow_executor)
        if self.continue_from is not None:
            self.flow.resume(self.continue_from.flow)
        self.worker = FlowWorker(self.flow, stages.flow_device, stages.flow_streams.take(stages.flow_device))

    def semantic(self, text_ids: torch.Tensor) -> list[torch.Tensor]:
        """The engine's frames, block by block: fed to the flow worker as they come when the stages overlap, else
        held: with the stages in turn, handed over at each of the song's flow turns; what is held after the last
        block is returned for the flow stage to take."""
        stages, request = self.stages, self.request
        prefix = None if self.continue_from is None else torch.from_numpy(self.continue_from.codes).long()
        held: list[torch.Tensor] = []
        semantic_started = time.perf_counter()
        # Until its first chunk's frames exist, other songs' later chunks wait (their listeners have audio ahead):
        # the batch makes these frames at its full speed (a song continued here has audio playing already). Once
        # they are queued, the engine queues no frames ahead of them until that chunk is heard (`urgent_frames`).
        first_audio_here = stages.overlap.overlap and not stages.split and self.continue_from is None
        turns_at = flow_turns(self.max_frames) if stages.turns is not None else []  # (the stages in turn)
        self.blocks = stages.engine.frames(text_ids, self.max_frames, sampling_for(request), self.semantic_generator,
                                           self.cancel, prefix=prefix,
                                           urgent_frames=c.CHUNK_FRAMES if first_audio_here else 0)
        gathering = contextlib.ExitStack()
        if first_audio_here:
            gathering.enter_context(stages.flow_executor.gathering())
        with gathering:
            for block in self.blocks:
                self.timings.setdefault("first_frames_s", time.perf_counter() - self.started)
                self.frames += block.shape[0]
                if self.frames >= c.CHUNK_FRAMES:
                    gathering.close()
                rate = self.frames / max(time.perf_counter() - semantic_started, 1e-9)
                self.emit(Progress("semantic", self.frames, self.max_frames, rate,
                                   (self.max_frames - self.frames) / rate))
                if stages.overlap.overlap:
                    self._beside(block)
                    continue
                held.append(block)
                if turns_at and self.frames >= turns_at[0] and self.frames < self.max_frames:
                    turns_at = [at for at in turns_at if at > self.frames]
                    self._flow_turn(held)
        self.timings["semantic_s"] = time.perf_counter() - semantic_started - self._paused - self._held_s
        self.timings["held_for_first_chunks_s"] = self._held_s
        if self.frames == 0:
            raise InvalidRequest("The model ended the song before its first frame; try another seed.")
        if self.continue_from is not None and self.frames <= self.continue_from.frames:
            raise InvalidRequest("The model ended the song where it already ended; try another seed.")
        return held

    def _beside(self, block: torch.Tensor) -> None:
        """Feed one block to the flow worker while the engine goes on. Time to first audio matters more than the last
        half second of a song: while any song's chunk 0 is denoised, the songs already playing stop enqueueing frames
        (this one waits for its audio, they at `first_chunks.wait`) instead of sharing the GPU with it (with a GPU of
        its own, the flow stage shares nothing). Songs still before their own first audio go on: they would wait in
        turn."""
        split, first_chunks = self.stages.split, self.stages.first_chunks
        self.worker.submit(block)
        waited = time.perf_counter()
        if not self.pieces and self.frames >= c.CHUNK_FRAMES and not split:
            self.timings.setdefault("chunk0_frames_s", waited - self.started)
            with first_chunks.denoising():
                self._publish(wait=False, until_audio=True)
            self.blocks.heard()
            self._paused += time.perf_counter() - waited
        else:
            self._publish(wait=False)
            if self.pieces and not split:
                self._held_s += first_chunks.wait(self.cancel)

    def finish_flow(self, held: list[torch.Tensor]) -> None:
        """The frames held back (no overlap), the last chunks, and every piece left delivered. The held blocks go to
        the worker one by one, as they were made: each chunk's piece is delivered when that chunk is done, not after
        the song's last (one push of all the frames decodes every chunk before it returns)."""
        check_cancel(self.cancel)
        for block in held:
            self.worker.submit(block)
        self.worker.finish()
        self._publish(wait=True)
        check_cancel(self.cancel)

    def _deliver(self, piece: Piece) -> None:
        self.timings.setdefault("first_audio_s", time.perf_counter() - self.started)
        self.pieces.append(piece.samples)
        self.emit(AudioPiece(piece.samples, piece.start_sample))

    def _publish(self, wait: bool, until_audio: bool = False, until_drained: bool = False) -> None:
        """The flow worker's progress and pieces so far, as events (`wait`: until it has ended)."""
        expected_chunks = len(c.chunk_starts(self.max_frames))
        for item in self.worker.results(wait, until_audio, until_drained):
            if isinstance(item, tuple):
                self.emit(progress_from_step(item, expected_chunks))
                continue
            for piece in item:
                self._deliver(piece)

    def song(self, codes: np.ndarray, memory: PeakSampler, flow_memory: PeakSampler | None,
             setup_s: float | None) -> Song:
        """The finished song: its audio, its state for a continuation, its timings and its report's facts."""
        stages, flow, timings = self.stages, self.flow, self.timings
        timings["flow_s"] = flow.timings.denoise_s
        timings["vocoder_s"] = flow.timings.vocoder_s
        timings["flow_shared_calls"] = flow.timings.shared_calls  # DiT calls merged with other songs' (0 alone)
        timings |= first_audio_path(self.blocks.stats, flow.timings.first_chunk, self.started)
        timings["total_s"] = time.perf_counter() - self.started
        audio = np.concatenate(self.pieces, axis=-1)
        timings["realtime_factor"] = (audio.shape[-1] / c.SAMPLE_RATE) / timings["total_s"]
        if stages.engine_record.check_s is not None:
            timings["engine_check_s"] = stages.engine_record.check_s  # paid once at load, not by this song
        if setup_s is not None:
            timings["setup_s"] = setup_s  # this song built the engine first (a lazy pipeline in a new process)
        memory.stop()
        figures = memory.as_dict()
        if flow_memory is not None:
            flow_memory.stop()
            figures = {**(figures or {}), "flow_device": str(stages.flow_device), "flow": flow_memory.as_dict()}
        resume = flow.resume_point
        stats = self.blocks.stats
        return Song(
            audio=audio,
            sample_rate=c.SAMPLE_RATE,
            frames=self.frames,
            seed=self.request.seed,
            timings=timings,
            engine=stages.engine_record.name,
            model_notice=stages.model_notice,
            engine_note=stages.engine_record.fallback_reason,
            # in host memory: a kept Song holds nothing on the device (its views would keep whole chunks there)
            state=SongState(self.request, codes, resume, audio[:, : resume.boundary]).on_host(),
            precision=stages.precision.mode,
            precision_reason=stages.precision.reason,
            memory=figures,
            peers=stats.peers if stats is not None else None,
            memory_plan=stages.memory_plan_dict,
        )
