"""The graph engine's device state: every buffer its captured frame reads or writes, for the songs in the batch's
places and a KV pool of positions (allocated per size; the frame graphs captured over it die with it), and the
writes that set a place up for a song, start it and park it."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..precision import check_kv_format
from . import kv_format
from .kernels import AttentionScratch, GemvWorkspace, NormSums, TailScratch
from .kernels.frame import NO_END
from .weights import AUDIO_CODES, EngineWeights


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class DeviceState:
    """Every device buffer a captured frame reads or writes, for `places` songs at once (rows 2p and 2p + 1 are the
    CFG pair of the song in place p) and a KV pool of `pool_positions` positions per CFG row.

    Per place: its song's step and position (`counters[p]`), the values they stop at (`limits[p]`: a song whose
    steps are all launched, or an empty place, recomputes its last step in place instead of running past its KV
    region), its region of the pool (`base[p]`), sampling settings, Philox seed, end flag, codes, forced prefix and
    ring of `frame_ring` frame hiddens. `shared` (another state) lends its split-K workspace and grid-barrier
    scratch: a small throw-away state warms kernels up for a capture without touching the songs in the real one.
    `scope`: where the writes and copies of a place run (the engine's stream)."""

    def __init__(self, weights: EngineWeights, device: torch.device, places: int, pool_positions: int, steps: int,
                 frame_ring: int, attention_splits: int, tail_programs: int,
                 shared: "DeviceState | None" = None,
                 scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 kv_format: str = "bf16") -> None:
        w, dev, dt = weights, device, weights.dtype
        self.device, self.places, self.pool_positions, self.steps = device, places, pool_positions, steps
        self.dtype = dt  # the model's: what the prefill attends in (read_kv)
        self.scope = scope
        self.kv_format = check_kv_format(kv_format)
        self._sizes = (weights, device, frame_ring, attention_splits, tail_programs)
        rows = 2 * places
        hid, heads, kv_heads, hd = w.hidden, w.heads, w.kv_heads, w.head_dim
        # The KV pool [layer, k|v, CFG row, kv head, position, head_dim]: in the model's dtype, or int8 with one
        # float32 scale per head vector (`kv_scale` [layer, k|v, CFG row, kv head, position]; kv_format.py).
        int8 = self.kv_format == "int8"
        self.kv = torch.zeros(len(w.blocks), 2, 2, kv_heads, pool_positions, hd, device=dev,
                              dtype=torch.int8 if int8 else dt)
        self.kv_scale = (torch.zeros(len(w.blocks), 2, 2, kv_heads, pool_positions, device=dev, dtype=torch.float32)
                         if int8 else None)
        ids = torch.arange(pool_positions, device=dev).unsqueeze(0)
        cos, sin = w.rotary(torch.empty(1, device=dev, dtype=dt), ids)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        self.frames = torch.zeros(places, frame_ring, w.num_codebooks * hid, device=dev, dtype=dt)
        self.codes = torch.zeros(places, steps, w.num_codebooks, device=dev, dtype=torch.int32)
        # Steps below `forced_steps` take their codes from `forced` instead of the samplers (a song's own codes as a
        # prefix to continue it; every step for teacher forcing). Device values, so one graph serves every song.
        self.forced = torch.zeros_like(self.codes)
        self.forced_steps = torch.zeros(places, device=dev, dtype=torch.int32)
        self.record: torch.Tensor | None = None  # teacher forcing: LM audio logits per step
        # Per-frame scratch. Residual streams are float32: over 36 layers bf16 adds are the largest rounding error
        # (the fp32 reference is the oracle; the bf16 HF model is itself ~1.5e-2 away from it).
        # Each residual product also writes the stream rounded to the model dtype (`gemv`'s out_copy): the next
        # RMSNorm product reads that copy, since a float32 activation tile per pipeline stage slows it 10-15%. With
        # the products launched one at a time, the copy is already times the next norm's gain, in the next product's
        # MMA dtype (`NormSums`, `frame_graph.FrameGraph._input`).
        self.lm_h = torch.zeros(rows, hid, device=dev, dtype=torch.float32)  # LM residual stream (feedback lands here)
        self.lm_h16 = torch.zeros(rows, hid, device=dev, dtype=dt)
        self.lm_hidden = torch.zeros(rows, hid, device=dev, dtype=dt)  # final-normed LM state
        self.prompt_hidden = torch.zeros(places, 2, hid, device=dev, dtype=dt)  # lm_hidden after the prompt
        self.qkv = torch.zeros(rows, (heads + 2 * kv_heads) * hd, device=dev, dtype=dt)
        self.attn = torch.zeros(rows, heads * hd, device=dev, dtype=dt)
        self.act = torch.zeros(rows, w.intermediate, device=dev, dtype=dt)
        self.attention = AttentionScratch.allocate(rows, heads, kv_heads, hd, attention_splits, dev)
        self.logits = torch.zeros(rows, AUDIO_CODES, device=dev, dtype=dt)
        depth_hid = w.hidden
        # depth pass 1, per song: [cond p0, cond p1, uncond p0, uncond p1]; passes 2..7 one row per CFG row
        self.dx = torch.zeros(2 * rows, depth_hid, device=dev, dtype=torch.float32)
        self.dh = torch.zeros(rows, depth_hid, device=dev, dtype=torch.float32)
        self.dx16, self.dh16 = torch.zeros_like(self.dx, dtype=dt), torch.zeros_like(self.dh, dtype=dt)
        self.dqkv = torch.zeros(2 * rows, 3 * depth_hid, device=dev, dtype=dt)
        self.do = torch.zeros(2 * rows, depth_hid, device=dev, dtype=dt)
        self.dact = torch.zeros(2 * rows, w.depth_intermediate, device=dev, dtype=dt)
        self.dstates = torch.zeros(rows, w.num_codebooks - 1, depth_hid, device=dev, dtype=dt)
        self.dlogits = torch.zeros(rows, w.audio_vocab, device=dev, dtype=dt)
        self.dcache = torch.zeros(
            len(w.depth_blocks), 2, rows, w.depth_heads, w.num_codebooks, depth_hid // w.depth_heads, device=dev,
            dtype=dt,
        )
        self.counters = torch.zeros(places, 2, device=dev, dtype=torch.int32)  # [step, position of the next token]
        self.limits = torch.zeros(places, 2, device=dev, dtype=torch.int32)  # where the counters stop
        self.base = torch.zeros(places, device=dev, dtype=torch.int32)  # each song's first position in the pool
        self.end_at = torch.full((places,), NO_END, device=dev, dtype=torch.int32)
        self.seeds = torch.zeros(places, device=dev, dtype=torch.int64)
        self.scale = torch.ones(places, device=dev, dtype=torch.float32)
        self.top_k = torch.ones(places, device=dev, dtype=torch.int32)
        if shared is None:
            self.gemv_workspace = GemvWorkspace(dev)  # sized by the warm-up step that precedes every capture
            # chained block tails: grid barrier and RMSNorm partial sums, one program per SM at most
            self.tail_scratch = TailScratch(dev, tail_programs)
            # products one launch each: the RMSNorm hand-over from a residual product to the next (`NormSums`)
            self.norm_sums = NormSums.for_rows(max(hid, depth_hid), dev)
        else:
            self.gemv_workspace, self.tail_scratch = shared.gemv_workspace, shared.tail_scratch
            self.norm_sums = shared.norm_sums

    def scratch(self, places: int) -> "DeviceState":
        """A small throw-away state for `places` songs that shares this one's workspace and scratch (a capture's
        warm-up: it compiles every kernel and sizes the workspace without touching the songs here)."""
        weights, device, frame_ring, attention_splits, tail_programs = self._sizes
        return DeviceState(weights, device, places, 256, 16, frame_ring, attention_splits, tail_programs,
                           shared=self, scope=self.scope, kv_format=self.kv_format)

    # ------------------------------------------------------------------ the KV pool (in `scope`)
    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.kv_scale) if t is not None)

    def layer_caches(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer `layer`'s (k cache, v cache, k scales, v scales) as `decode_attention` takes them (scales None
        unless int8)."""
        scales = (None, None) if self.kv_scale is None else (self.kv_scale[layer, 0], self.kv_scale[layer, 1])
        return self.kv[layer, 0], self.kv[layer, 1], *scales

    def write_kv(self, layer: int, start: int, stop: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Positions [start, stop) of layer `layer` from k, v [2, KVH, stop - start, D] (quantized in int8)."""
        for index, values in ((0, k), (1, v)):
            if self.kv_scale is None:
                self.kv[layer, index, :, :, start:stop] = values
            else:
                self.kv[layer, index, :, :, start:stop], self.kv_scale[layer, index, :, :, start:stop] = (
                    kv_format.quantize(values))

    def read_kv(self, layer: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of positions [start, stop) of layer `layer` in the model's dtype (dequantized in int8)."""
        if self.kv_scale is None:
            return self.kv[layer, 0, :, :, start:stop], self.kv[layer, 1, :, :, start:stop]
        return tuple(kv_format.dequantize(self.kv[layer, index, :, :, start:stop],
                                          self.kv_scale[layer, index, :, :, start:stop], self.dtype)
                     for index in (0, 1))

    def copy_positions(self, start: int, to: int, length: int) -> None:
        """Every layer's K/V (and scales) of positions [start, start + length) to [to, to + length)."""
        self.kv[..., to : to + length, :] = self.kv[..., start : start + length, :]
        if self.kv_scale is not None:
            self.kv_scale[..., to : to + length] = self.kv_scale[..., start : start + length]

    # ------------------------------------------------------------------ a place's song (in `scope`)
    def set_song(self, place: int, seed: int, cfg_scale: float, top_k: int, forced: torch.Tensor) -> None:
        """The song's sampling settings, Philox seed and forced prefix ([P, 8] codes). Its base, counters and end
        flag stay parked until `start_song`: the place replays as an empty one meanwhile."""
        with self.scope():
            self.seeds[place].fill_(seed)
            self.scale[place].fill_(float(cfg_scale))
            self.top_k[place].fill_(top_k)
            self.forced[place, : forced.shape[0]].copy_(forced.to(self.device, torch.int32))
            self.forced_steps[place].fill_(forced.shape[0])

    def start_song(self, place: int, base: int, prompt_tokens: int, total: int) -> None:
        """The song, its prompt of `prompt_tokens` in place from pool position `base`, runs `total` decode steps
        from the next replay."""
        with self.scope():
            self.base[place].fill_(base)
            self.end_at[place].fill_(NO_END)
            self.lm_hidden[2 * place : 2 * place + 2].copy_(self.prompt_hidden[place])
            self.counters[place, 0].fill_(0)
            self.counters[place, 1].fill_(prompt_tokens)
            self.limits[place, 0].fill_(total)
            self.limits[place, 1].fill_(prompt_tokens + total)

    def park(self, place: int) -> None:
        """An empty place: it recomputes step 0 at position 0 of the pool's parking place (never given to a song),
        in its own rows, harming no song."""
        with self.scope():
            self.counters[place].zero_()
            self.limits[place].zero_()
            self.base[place].zero_()
            self.forced_steps[place].zero_()

    # Copies out run on the caller's current stream: the engine's copy-out stream (EngineStream.copy_out), ordered
    # after the block that wrote the rows rather than after every block queued since.
    def ring_rows(self, place: int, start: int, stop: int) -> torch.Tensor:
        """Frames [start, stop) of the song in `place`, copied out of its ring."""
        ring = self.frames[place]
        rows = torch.arange(start, stop, device=self.device) % ring.shape[0]
        return ring.index_select(0, rows)

    def song_codes(self, place: int, steps: int) -> torch.Tensor:
        return self.codes[place, :steps].clone()
