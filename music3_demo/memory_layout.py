"""A memory plan's layout on one card: what the model holds there in given modes, and what that leaves for songs.

`layout` is a pure function of figures (the card's free bytes at load and compute capability, the model's
`ModelFigures`, the modes of the LM / depth decoder, the DiT and the KV cache, the engine, the desktop's share) -> a
frozen `MemoryPlan`: each component's bytes on the device and what sits there only while loading; the flow stage's
working set (a captured guided DiT call's pool per captured merge bucket, one vocoder call's activations per merged
chunk, or one tile's where whole chunks leave no room for a 6-minute song alone: VOCODER_TILE); the runtime (kernels
and libraries loaded later, cuBLAS workspaces, graph executables, the engine's per-slot buffers, a prefill chunk, the
allocator's slack); the desktop's headroom (HEADROOM_FIXED + HEADROOM_FRACTION of the free memory, at most
HEADROOM_MAX: a desktop card drives a display and a browser whose use grows; a big card loses little to it); the rest
is the KV pool, capped where MAX_SLOTS songs of the longest request fit. Slots: the most songs of FULL_SLOT_SONG_S (a
REFERENCE_PROMPT_TOKENS prompt) that the pool holds at once. Merged DiT / vocoder calls take MERGE_SHARE of that room
at most, or what the pool could not use. Nothing is sized from the model's maximum or from "whatever is free": the
engine's pool and slots, the flow executor's merged calls, the admission of songs and the cap on torch's allocator
(`allocator_bytes`) all come from here. Which modes a card runs is memory_plan.py's choice.

With `swap` the stages take turns on the device (stage_swap.py): the semantic stage's weights while a song's frames
are made, then the flow stage's for its audio, each stage's weights in pinned host memory while the other's are on
the device. The card then holds the larger of the two (the flow stage's with its working set) beside the KV pool and
the runtime, one song at a time (one slot, no merged calls; the DiT's graph, which reads its weights' addresses,
dropped when they leave and captured again in the next flow turn), and a song's first audio comes after its first
chunk's frames and one round trip of the weights (its frames go to the flow stage in turns: stage_swap.flow_turns).

Calibration (H200, random full-size weights, docs/PERFORMANCE.md): weights follow the parameter counts (bf16: LM
13.9 GB without the full head + 0.6 engine tables, depth 1.3, DiT + condition encoder 4.9, vocoder 0.2 fp32 =
20.9 GB, the 120-s song's measured weights); KV 294,912 B per position (the CFG pair); the activations were measured
with shapes only (the modules run on `meta`, live tensor bytes tracked): a guided DiT call 0.274 GB per song, a
vocoder chunk 1.571 GB. With ACTIVATION_MARGIN they reproduce the 120-s bf16 song's 24.2 GB allocated peak (20.9
weights + 1.1 KV + 2.2) within 0.1 GB. RUNTIME_BYTES is what the whole-card fp8 app's 34 GB idle (KV pool 16.5,
DiT 4.9, LM + depth 7.6; three private DiT graph pools then) leaves besides the CUDA context, rounded up.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from . import contract as c
from .model_figures import ModelFigures
from .precision import EQUALIZED, QUANTIZED, PrecisionChoice, depth_mode

GB = 1e9
GiB = 2**30
MAX_SLOTS = 8  # two rows per song, at most 16 rows per product (semantic/config.py)
PARKING = 16  # KV positions kept for idle slots (semantic/state.py)
REFERENCE_PROMPT_TOKENS = 1_000  # a description and a whole song's lyrics: the prompt the headline figures assume
# Where the reference prompt leaves songs shorter than this, the banner also says what a short prompt (a description
# and a verse) leaves: on the smallest cards the prompt's share of the KV pool is most of it.
SHORT_PROMPT_TOKENS, SHORT_NOTE_BELOW_S = 200, 60.0
FULL_SLOT_SONG_S = 120.0  # the song length every slot must hold
WARM_UP = (512, 256)  # prompt tokens, frames: what the warm-up reserves; a plan whose pool cannot hold it does not fit
# The desktop's share: fixed + fraction of free, at most the cap; at load only the fixed part (a brief peak).
HEADROOM_FIXED = GiB // 2
HEADROOM_FRACTION = 0.04
HEADROOM_MAX = 2 * GiB
# The least share, only where the stages take turns and the fixed one leaves no FULL_SLOT_SONG_S song (an 8 GB card:
# 7 GiB free, the desktop already holding the rest)
HEADROOM_FLOOR = GiB // 5
RUNTIME_BYTES = int(1.0 * GB)
OUTSIDE_TORCH_BYTES = 500_000_000  # of RUNTIME_BYTES, what lands outside torch's allocator after the plan (kernels)
SLOT_BYTES = 16_000_000  # the engine's per-song buffers: frame ring, codes, forced prefix
PREFILL_BYTES = 350_000_000  # a 512-token prefill chunk of both CFG rows (activations, k/v repeated for SDPA)
# + in a quantized mode: the prefill's products (kernels/matmul.py) hold no dense copy of a weight any more (a block
# of it in bf16 and the dequantize's temporaries took 0.05-0.13 GB); the figure stays as slack for the allocator's
# fragments where both stages are on the card (several songs, merged flow calls). Where they take turns (one song)
# the 10 GB card's process peaked 0.7 GB under its plan without it counted.
QUANTIZED_PREFILL_BYTES = 150_000_000
EQUALIZE_ROWS_BYTES = 1024 * 12_288 * 4  # semantic/equalize.ROWS rows of the widest block weight, float32
CHECK_BYTES = 100_000_000  # the self-check's scratch (its own small KV pool, the reference's activations)
ACTIVATION_MARGIN = 1.1
DIT_CALL_BYTES = int(0.274e9 * ACTIVATION_MARGIN)  # one song's guided DiT call on a full chunk (689 latents)
VOCODER_CHUNK_BYTES = int(1.571e9 * ACTIVATION_MARGIN)  # one chunk through the vocoder (float32)
CHUNK_LATENTS = 689  # a full chunk's latents (flow/stream.full_chunk_latents at the released checkpoint's rates)
# Where whole chunks leave no room for a 6-minute song alone, the vocoder decodes a chunk in tiles of VOCODER_TILE
# latents, each with VOCODER_HALO latents of context either side (the decoder sees 11 latents either way, so the
# samples are the whole chunk's), for a tile's activations (they scale with the length) at a quarter more work.
VOCODER_TILE, VOCODER_HALO = 128, 16
VOCODER_TILE_BYTES = VOCODER_CHUNK_BYTES * (VOCODER_TILE + 2 * VOCODER_HALO) // CHUNK_LATENTS
FLOW_SONG_BYTES = 50_000_000  # per running song: condition encoder activations, its frames window and latents
REFERENCE_WORKING_BYTES = int(3 * GB)  # the eager reference engine's activations (whole-prompt passes)
MERGE_SHARE = 0.10
BUCKETS = (1, 2, 4)  # songs per merged DiT / vocoder call (flow/executor.py)
# Bytes per weight of the quantized formats: the values, plus the float32 scales (per output row for fp8, per 128
# columns for int8, per 64 for int4; the DiT's fp8 scales are per output row). An int4 LM keeps its depth decoder
# at 8 bits (`precision.depth_mode`).
BYTES_PER_WEIGHT = {"fp8": 1 + 4 / 1024, "int8": 1 + 4 / 128, "int4": 0.5 + 4 / 64}
STAGES = ("semantic", "flow")
SEMANTIC_WEIGHTS = ("language_model", "depth_decoder", "audio_head", "engine_tables", "embeddings_and_head")
# (the rest: flow's)


def song_positions(prompt_tokens: int, frames: int) -> int:
    """KV positions one song takes (semantic/state.song_positions)."""
    return prompt_tokens + frames + 2


def duration_text(seconds: float) -> str:
    """200 -> "3 min 20 s"; 45 -> "45 s"; 360 -> "6 min"."""
    minutes, rest = divmod(int(seconds), 60)
    parts = ([f"{minutes} min"] if minutes else []) + ([f"{rest} s"] if rest or not minutes else [])
    return " ".join(parts)


@dataclass(frozen=True)
class MemoryPlan:
    """What one card holds and what that leaves for songs (bytes). `free_bytes` None: not a GPU (nothing to fit:
    no pool, no limit but the model's, the engine's own slot count)."""

    lm: PrecisionChoice
    dit: PrecisionChoice
    engine: str  # graph | reference
    stages: tuple[str, ...] = STAGES  # what this card runs (a stage split: one each)
    kv: str = "bf16"  # the graph engine's KV cache format: bf16 | int8 (the reference's cache is always bf16)
    free_bytes: int | None = None
    capability: tuple[int, int] | None = None
    weights: dict[str, int] = field(default_factory=dict)
    load_peak: int = 0
    flow_working: int = 0
    runtime: int = 0
    headroom: int = 0
    kv_bytes_per_position: int = 0  # what a song pays per position (the reference's growing cache: twice)
    kv_pool_bytes: int | None = None
    kv_pool_positions: int | None = None
    slots: int | None = None
    dit_bucket: int = 1  # the largest merged guided DiT call (songs)
    vocoder_bucket: int = 1  # the largest merged vocoder call (chunks)
    vocoder_tile: int | None = None  # latents per vocoder call (None: whole chunks)
    swap: bool = False  # the stages take turns on the device (stage_swap.py), one song at a time
    host_bytes: int = 0  # the pinned host memory the turns keep both stages' weights in
    fits: bool = True
    why: str = ""  # one sentence: why these modes (auto's test, or as asked)
    figures: ModelFigures | None = field(default=None, repr=False, compare=False)  # what it was computed from

    def engine_sizing(self) -> tuple[int | None, int | None, str, bool]:
        """(batch slots, KV pool positions, KV format, the graph engine's per-code tables in host memory) for its
        engine (Nones off the GPU: the engine's own defaults)."""
        if not self.on_gpu:
            return None, None, self.kv, False
        graph = self.engine == "graph"
        return self.slots, self.kv_pool_positions if graph else None, self.kv, graph and self.swap

    @property
    def merge_buckets(self) -> tuple[int, int] | None:
        """The largest merged DiT call (songs) and vocoder call (chunks); None off the GPU (nothing to fit)."""
        return (self.dit_bucket, self.vocoder_bucket) if self.on_gpu else None

    def for_engine(self, engine: str) -> MemoryPlan:
        """The same card and modes for another engine (the reference, when the fast engine fell back at load)."""
        if engine == self.engine:
            return self
        if not self.on_gpu or self.figures is None:
            return replace(self, engine=engine)
        plan = layout(self.figures, self.free_bytes, self.capability, self.lm.mode, self.dit.mode, engine,
                      self.stages, self.kv, self.headroom, self.swap, self.lm.first_layers)
        return replace(plan, lm=self.lm, dit=self.dit, why=self.why)

    on_gpu = property(lambda self: self.free_bytes is not None)

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    def stage_bytes(self, stage: str) -> int:
        """The weights of one stage ("semantic" | "flow") on this card."""
        return sum(value for name, value in self.weights.items() if (name in SEMANTIC_WEIGHTS) == (stage == "semantic"))

    @property
    def song_bytes(self) -> int:
        """What a song has on the device besides the KV pool: the weights there at once (the larger stage's, with
        the flow working set, when the stages take turns), the flow working set and the runtime."""
        if self.swap:
            return self.runtime + max(self.stage_bytes("semantic"), self.stage_bytes("flow") + self.flow_working)
        return self.weight_bytes + self.flow_working + self.runtime

    @property
    def allocator_bytes(self) -> int | None:
        """What torch's allocator may add to what it held when the free bytes were read (allocator.cap_allocator):
        the budget (or the load's peak, if higher) less what lies outside torch. None off the GPU."""
        if not self.on_gpu:
            return None
        return max(self.free_bytes - self.headroom, self.load_peak) - OUTSIDE_TORCH_BYTES

    def max_frames(self, prompt_tokens: int = REFERENCE_PROMPT_TOKENS, songs: int = 1) -> int | None:
        """The most frames a song of this prompt may make while `songs` such songs run at once (None: no limit but
        the model's, off the GPU or on a card that runs no semantic stage)."""
        if self.kv_pool_positions is None:
            return None
        per_song = (self.kv_pool_positions - PARKING) // max(1, songs)
        return max(0, min(c.MAX_AUDIO_FRAMES, per_song - prompt_tokens - 2))

    def longest_s(self, prompt_tokens: int = REFERENCE_PROMPT_TOKENS, songs: int = 1) -> float | None:
        frames = self.max_frames(prompt_tokens, songs)
        return None if frames is None else frames / c.FRAME_RATE

    @property
    def longest_alone_s(self) -> float | None:
        return self.longest_s()

    @property
    def longest_full_s(self) -> float | None:
        return self.longest_s(songs=self.slots or 1)

    def modes(self) -> str:
        first = self.lm.first_layers
        lm = f"{self.lm.mode} LM" + (
            f" (layers 0-{first - 1} {depth_mode(self.lm.mode, self.capability)})" if first else "")
        return (f"{lm}, {self.dit.mode} DiT" + (", int8 KV cache" if self.kv == "int8" else "")
                + (", the stages in turn" if self.swap else ""))

    def too_long(self, prompt_tokens: int, frames: int) -> str | None:
        """The refusal for a song of `frames` frames after a prompt of `prompt_tokens` that does not fit even alone
        (one sentence naming the longest that does), or None when it fits."""
        most = self.max_frames(prompt_tokens)
        if most is None or frames <= most:
            return None
        if most < c.FRAME_RATE * c.MIN_DURATION_S:
            return (f"On this GPU ({self.free_bytes / GB:.1f} GB free, {self.modes()}) this prompt leaves no room for "
                    "a song; shorten the lyrics or the description.")
        return (f"On this GPU ({self.free_bytes / GB:.1f} GB free, {self.modes()}) songs with this prompt can be at "
                f"most {duration_text(most / c.FRAME_RATE)} long; choose a shorter duration.")

    def summary(self) -> str:
        """The banner's short line: precision per stage, slots, longest song."""
        if not self.on_gpu:
            return f"{self.modes()}"
        parts = [self.modes()]
        if self.slots is not None:
            parts.append(f"{self.slots} song{'s' if self.slots > 1 else ''} at once")
            parts.append(f"songs up to {duration_text(self.longest_alone_s)} alone, "
                         f"{duration_text(self.longest_full_s)} with every slot busy" if self.slots > 1 else
                         f"songs up to {duration_text(self.longest_alone_s)}")
            if self.longest_alone_s < SHORT_NOTE_BELOW_S:  # (the figure assumes a whole song's lyrics)
                parts[-1] += (f" after a {REFERENCE_PROMPT_TOKENS:,}-token prompt, "
                              f"{duration_text(self.longest_s(SHORT_PROMPT_TOKENS))} after a short one")
        if self.swap:
            parts.append("the stages take turns on this GPU: first audio after the first chunk's frames and a turn")
        return " · ".join(parts)

    def as_dict(self) -> dict:
        """The plan's figures (GB, seconds) for `status`, the song report and the log."""
        def gb(value: int | None) -> float | None:
            return None if value is None else round(value / GB, 2)

        figures = {
            "lm_precision": self.lm.mode, "dit_precision": self.dit.mode, "kv_precision": self.kv,
            "engine": self.engine,
            "stages": list(self.stages), "stages_in_turn": self.swap, "why": self.why, "fits": self.fits,
            "free_gb": gb(self.free_bytes), "capability": list(self.capability) if self.capability else None,
        }
        if self.on_gpu:
            figures |= {
                "weights_gb": {name: gb(value) for name, value in self.weights.items()},
                "load_peak_gb": gb(self.load_peak),
                "flow_working_gb": gb(self.flow_working), "dit_bucket": self.dit_bucket,
                "vocoder_bucket": self.vocoder_bucket, "vocoder_tile_latents": self.vocoder_tile,
                "graphs_and_workspaces_gb": gb(self.runtime), "host_gb_for_turns": gb(self.host_bytes),
                "headroom_gb": gb(self.headroom), "allocator_gb": gb(self.allocator_bytes),
                "kv_pool_gb": gb(self.kv_pool_bytes),
                "kv_pool_positions": self.kv_pool_positions, "slots": self.slots,
                "reference_prompt_tokens": REFERENCE_PROMPT_TOKENS,
                "longest_song_alone_s": self.longest_alone_s, "longest_song_full_slots_s": self.longest_full_s,
            }
        return figures

    def log_block(self, device: str) -> str:
        """The plan as one block of lines for the log."""
        head = f"memory plan for {device}: {self.modes()} ({self.why})"
        if not self.on_gpu:
            return head + "; no GPU: nothing to fit"
        lines = [head] + [f"  {key}: {value}" for key, value in self.as_dict().items()
                          if key not in ("lm_precision", "dit_precision", "kv_precision", "why", "stages")]
        return "\n".join(lines)



def headroom_for(free_bytes: int) -> int:
    return int(min(HEADROOM_MAX, HEADROOM_FIXED + HEADROOM_FRACTION * free_bytes))


def _stored(count: int, mode: str, param_bytes: int) -> int:
    return int(count * BYTES_PER_WEIGHT[mode]) if mode in QUANTIZED else count * param_bytes


def _merges(dit_bucket: int, vocoder_bucket: int) -> int:
    """What merged calls of up to these many songs / chunks add to lone calls: a graph pool per captured DiT bucket
    (1, 2, 4 songs), and the vocoder's activations per extra chunk."""
    return ((sum(b for b in BUCKETS if b <= dit_bucket) - 1) * DIT_CALL_BYTES
            + (vocoder_bucket - 1) * VOCODER_CHUNK_BYTES)


def layout(figures: ModelFigures, free: int, capability, lm: str, dit: str, engine: str,
           stages: tuple[str, ...] = STAGES, kv: str = "bf16", headroom: int | None = None,
           swap: bool = False, first_layers: int = 0) -> MemoryPlan:
    """The plan for one set of modes on `free` bytes (`kv`: the graph engine's KV format; the reference's: bf16;
    `headroom`: the desktop's share, headroom_for(free) unless given; `swap`: the stages take turns;
    `first_layers`: an int4 LM's first decoder layers in the depth decoder's 8 bits)."""
    f, semantic, flow = figures, "semantic" in stages, "flow" in stages
    swap = swap and semantic and flow
    first_layers = first_layers if lm == "int4" else 0
    kv = kv if engine == "graph" and semantic else "bf16"
    weights: dict[str, int] = {}
    if semantic:
        first = f.lm_blocks // f.lm_layers * first_layers  # (every layer the same size)
        weights["language_model"] = (_stored(f.lm_blocks - first, lm, 2) + _stored(first, depth_mode(lm, capability), 2)
                                     + 2 * f.lm_other)
        weights["depth_decoder"] = _stored(f.depth_blocks, depth_mode(lm, capability), 2) + 2 * f.depth_other
        if engine == "graph":
            weights["audio_head"] = _stored(f.audio_head, lm, 2)
            if not swap:  # (in turn: in pinned host memory, read a row at a time: semantic/weights.TABLES)
                weights["engine_tables"] = f.engine_tables_bytes()
        else:  # the reference reads the full head and the token embeddings at every step
            weights["embeddings_and_head"] = 2 * f.trimmed
    if flow:
        weights["condition_encoder"] = 2 * f.condition_encoder
        weights["transformer"] = _stored(f.dit_blocks, dit, 2) + 2 * f.dit_other
        weights["vocoder"] = 4 * f.vocoder
    total = sum(weights.values())
    semantic_weights = sum(value for name, value in weights.items() if name in SEMANTIC_WEIGHTS)
    flow_weights = total - semantic_weights
    headroom = headroom_for(free) if headroom is None else headroom
    budget = free - headroom
    # A load for the graph engine takes lm_head and the token embeddings in host memory as they arrive and puts only
    # the head's audio rows (in the engine's tables) on the device (loading.load_model's lean_head): no table in
    # flight on the card.
    # Every weight streams onto the device as it is read, the 1-byte LM's quantized as it arrives; the fp8 DiT is
    # quantized onto the device block by block from its bf16 weights in host memory once the engine's self-check
    # has dropped what only loading needs (Music3Pipeline.ensure_stages): one block's bf16 weights at a time (0.13
    # GB at full size) beside what is loaded, within RUNTIME_BYTES, which the load does not use yet.
    deferred = weights["transformer"] if flow and dit == "fp8" else 0
    # An equalized LM (precision.EQUALIZED) holds one decoder layer's bf16 weights until the layer is whole
    # (semantic/equalize.LayerGatherer), and a float32 copy of up to 1,024 of its rows: 0.44 GB at full size.
    gathering = (2 * f.lm_blocks // f.lm_layers + EQUALIZE_ROWS_BYTES) if semantic and lm in EQUALIZED else 0
    checked = total - flow_weights * swap - deferred * (not swap) + CHECK_BYTES + gathering
    # (stages in turn: the semantic stage loads and checks alone, then leaves for the flow stage's weights)
    load_peak = max(checked, flow_weights if swap else total) + RUNTIME_BYTES
    runtime = RUNTIME_BYTES
    if semantic:
        runtime += PREFILL_BYTES + (QUANTIZED_PREFILL_BYTES if lm in QUANTIZED and not swap else 0)
        runtime += REFERENCE_WORKING_BYTES if engine == "reference" else 0
    per_position = f.kv_bytes_per_position(kv) * (2 if engine == "reference" else 1)  # (a growing cache copies)
    per_slot = SLOT_BYTES + (FLOW_SONG_BYTES if flow else 0)
    alone = ((song_positions(REFERENCE_PROMPT_TOKENS, c.MAX_AUDIO_FRAMES) + PARKING) * per_position + per_slot
             if semantic else 0)

    def room_beside(flow_set: int) -> int:
        """What the KV pool and the slots may have while a flow call's working set of `flow_set` bytes is there."""
        held = max(semantic_weights, flow_weights + flow_set) if swap else total + flow_set
        return budget - runtime - held

    whole_chunks = room_beside(DIT_CALL_BYTES + VOCODER_CHUNK_BYTES) >= alone
    tile = None if not flow or whole_chunks else VOCODER_TILE
    vocoder = VOCODER_CHUNK_BYTES if tile is None else VOCODER_TILE_BYTES
    base_flow = (DIT_CALL_BYTES + max(vocoder, DIT_CALL_BYTES)) if flow else 0
    room = room_beside(base_flow)
    plan = MemoryPlan(
        lm=PrecisionChoice(lm, lm, "", first_layers), dit=PrecisionChoice(dit, dit, ""), engine=engine, stages=stages,
        kv=kv, free_bytes=free, capability=capability, weights=weights, load_peak=load_peak,
        flow_working=base_flow, runtime=runtime, headroom=headroom, kv_bytes_per_position=per_position,
        vocoder_tile=tile, swap=swap, figures=figures,
        host_bytes=(total + (f.engine_tables_bytes() if engine == "graph" else 0)) if swap else 0,
    )
    longest = song_positions(c.MAX_PROMPT_TOKENS, c.MAX_AUDIO_FRAMES)
    one_slot = song_positions(REFERENCE_PROMPT_TOKENS, c.max_frames_for(FULL_SLOT_SONG_S))
    buckets = [b for b in BUCKETS if flow and not swap]  # the merge buckets this card may use
    slots, pool_positions, dit_bucket, vocoder_bucket = 1, 0, 1, 1
    for _ in range(2):  # merges take their share of the room, the slots follow from the rest (twice: a merge takes
        # at most as many songs as there are slots)
        spare = room - (MAX_SLOTS * longest + PARKING) * per_position - MAX_SLOTS * per_slot  # beyond the pool's cap
        allowance = max(MERGE_SHARE * room, spare) if semantic else room
        limit = slots if semantic else max(BUCKETS)
        dit_bucket = max([b for b in buckets if b <= limit and _merges(b, 1) <= allowance], default=1)
        vocoder_bucket = max([b for b in buckets if b <= limit and _merges(dit_bucket, b) <= allowance and not tile],
                             default=1)
        left = room - _merges(dit_bucket, vocoder_bucket)
        slots = max(1, min(1 if swap else MAX_SLOTS,
                           (left // per_position - PARKING) // (one_slot + per_slot // per_position)))
        pool = min(max(0, left - slots * per_slot) // per_position, slots * longest + PARKING)
        pool_positions = int(pool) // 256 * 256 if semantic else 0
    plan = replace(plan, dit_bucket=dit_bucket, vocoder_bucket=vocoder_bucket,
                   flow_working=base_flow + (_merges(dit_bucket, vocoder_bucket) + slots * FLOW_SONG_BYTES) * flow,
                   runtime=runtime + (slots * SLOT_BYTES if semantic else 0))
    if semantic:
        plan = replace(plan, slots=slots, kv_pool_positions=pool_positions,
                       kv_pool_bytes=pool_positions * per_position // (2 if engine == "reference" else 1))
    loads = load_peak <= free - HEADROOM_FIXED
    holds = not semantic or pool_positions >= song_positions(*WARM_UP) + PARKING
    return replace(plan, fits=loads and holds and room >= 0)

