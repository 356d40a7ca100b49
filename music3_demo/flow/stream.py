"""Incremental flow stage: feed frame hiddens as they are made, get final audio pieces as soon as they are known.

Chunk k covers frames [100k, 100k + 200). It can be denoised once those frames exist; its waveform is final except
for the right crop (258 latents), which is only kept when the chunk turns out to be the last one. Holding that tail
back until the song's length is known is what lets pieces stream with no change to the result: the pieces
concatenated equal diffusers' batch decode exactly (same operations, same order, same noise draws).

The stream also remembers its state just before each chunk (`resume_point`): a continued song restarts there at the
song's last chunk (`resume`), so a continuation decodes exactly as the whole song would have.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .. import contract as c
from ..continuation import FlowResume
from ..events import check_cancel
from .call_queue import LATER, Order
from .executor import FlowExecutor
from .guidance import guided_velocity


@dataclass(frozen=True)
class FlowSettings:
    num_steps: int = c.DEFAULT_STEPS
    guidance_scale: float = c.DEFAULT_GUIDANCE
    # One batch-2 transformer pass per step instead of diffusers' two batch-1 passes (same maths, faster on GPU;
    # rounding may differ in the last bits, so the reference path keeps two passes).
    batched_cfg: bool = False


@dataclass
class Piece:
    samples: np.ndarray  # [2, n] float32 in [-1, 1]
    start_sample: int


@dataclass
class FirstChunk:
    """How a stream's first chunk (the one before its first audio) went, in time.perf_counter() seconds: its frames
    were there and its decode began, its condition and noise were queued (host side), its first DiT call was handed
    to the executor and taken by it, it was denoised, its audio was made; and how long its calls stood queued in
    the executor behind other songs' calls, in all."""

    began: float
    encoded: float | None = None
    first_call_submitted: float | None = None
    first_call_started: float | None = None
    denoised: float | None = None
    done: float | None = None
    executor_wait_s: float = 0.0

    def timings(self, since: float) -> dict[str, float]:
        """Its times as seconds after `since` (a song's start), for the song's timings."""
        times = {"chunk0_began_s": self.began, "chunk0_encoded_s": self.encoded,
                 "chunk0_first_submit_s": self.first_call_submitted, "chunk0_first_call_s": self.first_call_started,
                 "chunk0_denoised_s": self.denoised, "chunk0_done_s": self.done}
        return {name: at - since for name, at in times.items() if at is not None} | {
            "chunk0_executor_wait_s": self.executor_wait_s}


@dataclass
class FlowTimings:
    denoise_s: float = 0.0
    vocoder_s: float = 0.0
    chunks: int = 0
    chunk_seconds: list[float] = field(default_factory=list)
    shared_calls: int = 0  # guided DiT calls that ran merged with other songs' (FlowExecutor)
    first_chunk: FirstChunk | None = None


StepCallback = Callable[[int, int, int], None]  # (chunk_index, step_done, num_steps)


def full_chunk_latents(components: dict) -> int:
    """Latent length of a full 200-frame chunk (689 for the released checkpoint's rates)."""
    config = components["condition_encoder"].config
    return int(
        c.CHUNK_FRAMES
        * config.output_sampling_rate
        / config.input_sampling_rate
        * config.input_hop_length
        / config.output_hop_length
    )


def _cfg_enabled(guidance_scale: float) -> bool:
    # diffusers' ClassifierFreeGuidance skips the unconditional pass when the scale is ~1.
    return not np.isclose(guidance_scale, 1.0)


class ChunkDenoiser:
    """Flow-matches one chunk's latents with Euler steps and classifier-free guidance (zeros as unconditional).

    With an `executor` (the pipeline's), every DiT call goes through it: guided batch-2 calls may merge with other
    songs', anything else runs there alone; the executor owns the captured graphs. Without one (a lone stream in a
    test), calls run here, eagerly. `order` (set by the stream per chunk): where the calls stand in the executor's
    order (a first chunk's go ahead of other songs' later chunks); `first` records a first chunk's time there."""

    def __init__(self, transformer, scheduler, settings: FlowSettings, executor: FlowExecutor | None = None) -> None:
        self.transformer = transformer
        self.scheduler = copy.deepcopy(scheduler)  # set_timesteps/step keep state: one copy per stream
        self.settings = settings
        self.executor = executor
        self.shared_calls = 0
        self.order = LATER
        self.first: FirstChunk | None = None

    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        if self.executor is None:
            return self._velocity_here(latents, timestep, condition)
        if _cfg_enabled(self.settings.guidance_scale) and self.settings.batched_cfg:
            pending = self.executor.submit_velocity(latents, timestep, condition, self.settings.guidance_scale,
                                                    order=self.order)
        else:
            pending = self.executor.submit_call(self._velocity_here, latents, timestep, condition, order=self.order)
        velocity = pending.result()
        self.shared_calls += pending.partners > 0
        self.note(pending)
        return velocity

    def note(self, pending) -> None:
        """A finished executor call of the first chunk: when it started, how long it stood queued."""
        if self.first is not None:
            if self.first.first_call_started is None:
                self.first.first_call_started = pending.started
                self.first.first_call_submitted = pending.submitted
            self.first.executor_wait_s += pending.started - pending.submitted

    def _velocity_here(self, latents: torch.Tensor, timestep: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        run = self.transformer
        if not _cfg_enabled(self.settings.guidance_scale):
            return run(hidden_states=latents, timestep=timestep, encoder_hidden_states=condition, return_dict=False)[0]
        return guided_velocity(
            run, latents, timestep, condition, self.settings.guidance_scale, batched=self.settings.batched_cfg
        )

    def denoise(
        self,
        latents: torch.Tensor,
        condition: torch.Tensor,
        overlap: int,
        previous_latent: torch.Tensor | None,
        on_step: Callable[[int], None],
        cancel: threading.Event | None,
    ) -> torch.Tensor:
        steps = self.settings.num_steps
        noise_prompt = latents[..., :overlap].clone() if overlap > 0 else None
        self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / steps, steps), device=latents.device)
        for index, t in enumerate(self.scheduler.timesteps):
            check_cancel(cancel)
            if overlap > 0:
                time_value = t.to(latents.dtype)
                latents[..., :overlap] = (1.0 - (1.0 - c.FLOW_NOISE_PROMPT_EPS) * time_value) * noise_prompt + (
                    time_value * previous_latent[..., :overlap]
                )
            timestep = t.expand(latents.shape[0]).to(latents.dtype)
            velocity = self.velocity(latents, timestep, condition)
            latents = self.scheduler.step(velocity, t, latents, return_dict=False)[0]
            on_step(index + 1)
        return latents


class FlowStream:
    """Chunked flow decode fed incrementally. Not thread-safe: one producer calls push()/finish()."""

    def __init__(
        self,
        components: dict,
        settings: FlowSettings,
        generator: torch.Generator,
        device: torch.device,
        on_step: StepCallback | None = None,
        cancel: threading.Event | None = None,
        executor: FlowExecutor | None = None,
    ) -> None:
        """`executor`: the pipeline's (songs sharing a pipeline must all use it: it owns the shared modules' calls
        and the captured DiT steps); without one, every call runs eagerly on the caller's thread."""
        self.condition_encoder = components["condition_encoder"]
        self.transformer = components["transformer"]
        self.vocoder = components["vocoder"]
        self.executor = executor
        self.denoiser = ChunkDenoiser(self.transformer, components["scheduler"], settings, executor)
        self.settings = settings
        self.generator = generator
        self.device = device
        self.on_step = on_step or (lambda chunk, done, total: None)
        self.cancel = cancel
        self.timings = FlowTimings()
        # Frames from index `_first_kept` on: earlier ones belong only to chunks already decoded and are dropped, so
        # a long song neither keeps every frame hidden nor re-copies them for each chunk.
        self._frames: list[torch.Tensor] = []
        self._first_kept = 0
        self._num_frames = 0
        self._next_chunk = 0
        self._previous_latent: torch.Tensor | None = None
        self._previous_condition: torch.Tensor | None = None
        self._held_tail: np.ndarray | None = None
        self._emitted_samples = 0
        self._skip = 0  # frames still to drop from the front of what is pushed (before a resumed chunk)
        self.resume_point: FlowResume | None = None  # the state before the latest chunk (see `resume`)

    def resume(self, point: FlowResume) -> None:
        """Start at chunk `point.chunk` as if the chunks before it had been decoded here: pushed frames before its
        first one are dropped, its overlap blends toward the saved latents, and pieces start at `point.boundary`.
        The caller passes a generator in the saved state (or accepts other noise from there on)."""
        if self._num_frames or self._next_chunk:
            raise RuntimeError("resume() must come before the first frames")
        dtype = self.transformer.dtype
        self._next_chunk = point.chunk
        self._first_kept = self._num_frames = self._skip = point.first_frame
        if point.previous_latent is not None:
            self._previous_latent = point.previous_latent.to(self.device, dtype)
            self._previous_condition = point.previous_condition.to(self.device, dtype)
        self._emitted_samples = point.boundary

    def push(self, frames: torch.Tensor) -> list[Piece]:
        """Add [n, 8 * hidden] frame hiddens; return the pieces that became final."""
        frames = frames.reshape(-1, frames.shape[-1])
        if self._skip:
            dropped = min(self._skip, frames.shape[0])
            frames, self._skip = frames[dropped:], self._skip - dropped
        self._frames.append(frames)
        self._num_frames += frames.shape[0]
        pieces = []
        while self._next_chunk * c.CHUNK_HOP + c.CHUNK_FRAMES <= self._num_frames:
            pieces += self._decode_chunk(self._next_chunk * c.CHUNK_HOP, c.CHUNK_FRAMES, last=False)
        return pieces

    def finish(self) -> list[Piece]:
        """The song ended: decode what is left and release the last chunk's held-back tail."""
        if self._num_frames == 0:
            return []
        remaining = [s for s in c.chunk_starts(self._num_frames) if s >= self._next_chunk * c.CHUNK_HOP]
        if not remaining:
            return self._release_tail()
        self._held_tail = None  # the previous chunk was not the last: its tail is covered by the next chunk
        pieces = []
        for index, start in enumerate(remaining):
            length = min(c.CHUNK_FRAMES, self._num_frames - start)
            pieces += self._decode_chunk(start, length, last=index == len(remaining) - 1)
        return pieces

    def _frame_window(self, start: int, length: int) -> torch.Tensor:
        if len(self._frames) > 1:
            self._frames = [torch.cat(self._frames)]
        offset = start - self._first_kept
        window = self._frames[0][offset : offset + length].unsqueeze(0)
        next_start = start + c.CHUNK_HOP
        if next_start > self._first_kept:  # the next chunk starts 100 frames later: nothing before it is needed
            self._frames = [self._frames[0][next_start - self._first_kept :]]
            self._first_kept = next_start
        return window

    def _decode_chunk(self, start: int, length: int, last: bool) -> list[Piece]:
        chunk_index = self._next_chunk
        # References only: the previous latents are replaced, never written, by later chunks.
        self.resume_point = FlowResume(
            chunk_index, self._emitted_samples, self._previous_latent, self._previous_condition,
            self.generator.get_state(), self.generator.device.type,
        )
        began = time.perf_counter()
        # Before the first audio its calls go ahead of other songs' later chunks in the executor; a later chunk says
        # until when its listener has audio (the executor may hold it back meanwhile).
        first = FirstChunk(began) if self._emitted_samples == 0 else None
        self.denoiser.first = first
        self.denoiser.order = Order(first_chunk=began) if first is not None else Order(audio_until=self._audio_until())
        with torch.no_grad():
            latents = self._denoise_chunk(chunk_index, start, length)
            self._sync()
            denoised = time.perf_counter()
            waveform = self._vocode(latents.to(self.vocoder.dtype))[0].float().clamp(-1.0, 1.0).cpu().numpy()
        finished = time.perf_counter()
        if first is not None:
            first.denoised, first.done = denoised, finished
            self.timings.first_chunk = first
        self.timings.shared_calls = self.denoiser.shared_calls
        self.timings.denoise_s += denoised - began
        self.timings.vocoder_s += finished - denoised
        self.timings.chunk_seconds.append(finished - began)
        self.timings.chunks += 1
        self._next_chunk += 1

        left = 0 if chunk_index == 0 else c.CROP_LEFT_LATENT * c.LATENT_HOP_LENGTH
        if last:
            self._held_tail = None
            return [self._piece(waveform[:, left:])]
        right = waveform.shape[-1] - c.CROP_RIGHT_LATENT * c.LATENT_HOP_LENGTH
        self._held_tail = waveform[:, right:]
        return [self._piece(waveform[:, left:right])]

    def _denoise_chunk(self, chunk_index: int, start: int, length: int) -> torch.Tensor:
        frames = self._frame_window(start, length).to(self.device)
        condition = self.condition_encoder(frames.to(self.condition_encoder.dtype)).to(self.transformer.dtype)
        overlap = 0
        if self._previous_latent is not None:
            overlap = min(self._previous_latent.shape[-1], condition.shape[1])
            condition[:, :overlap] = self._previous_condition[:, :overlap]
        shape = (1, self.transformer.config.in_channels, condition.shape[1])
        latents = torch.randn(shape, generator=self.generator, device=self.generator.device, dtype=condition.dtype)
        latents = latents.to(self.device)
        if self.denoiser.first is not None:
            self.denoiser.first.encoded = time.perf_counter()
        latents = self.denoiser.denoise(
            latents,
            condition,
            overlap,
            self._previous_latent,
            lambda done: self.on_step(chunk_index, done, self.settings.num_steps),
            self.cancel,
        )
        if overlap > 0:
            latents[..., :overlap] = self._previous_latent[..., :overlap]
        overlap_start = max(0, latents.shape[-1] - 2 * c.OVERLAP_LATENT_LENGTH)
        overlap_end = max(overlap_start, latents.shape[-1] - c.OVERLAP_LATENT_LENGTH)
        self._previous_latent = latents[..., overlap_start:overlap_end]
        self._previous_condition = condition[:, overlap_start:overlap_end]
        return latents

    def _vocode(self, latents: torch.Tensor) -> torch.Tensor:
        if self.executor is None:
            return self.vocoder(latents)
        pending = self.executor.submit_vocode(latents, order=self.denoiser.order)
        waveform = pending.result()
        self.denoiser.note(pending)
        return waveform

    def _audio_until(self) -> float | None:
        """When a listener who began at this stream's first audio runs out of the audio made so far (None before the
        first audio, or for a continued song, whose listener's start this stream does not know)."""
        first = self.timings.first_chunk
        if first is None or first.done is None:
            return None
        return first.done + self._emitted_samples / c.SAMPLE_RATE

    def _release_tail(self) -> list[Piece]:
        tail, self._held_tail = self._held_tail, None
        return [] if tail is None or tail.shape[-1] == 0 else [self._piece(tail)]

    def _piece(self, samples: np.ndarray) -> Piece:
        piece = Piece(np.ascontiguousarray(samples), self._emitted_samples)
        self._emitted_samples += samples.shape[-1]
        return piece

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
