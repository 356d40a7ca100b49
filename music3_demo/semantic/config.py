"""The graph engine's knobs in one place, checked when made: how frames are replayed and buffered on the device, and
which kernel variants a frame runs. The bench's variants (`graph-pdl`, `graph-s8`, ...) are these fields."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..precision import check_kv_format


STACKS = ("lm", "depth")  # the frame's two stacks of decoder blocks: the language model's, the depth decoder's


def chained_stacks(chain: bool | str | None) -> frozenset[str]:
    """The stacks whose block tails run chained for a `GraphConfig.chain` value already resolved (None: neither)."""
    if isinstance(chain, str):
        return frozenset((chain,))
    return frozenset(STACKS) if chain else frozenset()


def chain_setting(stacks: frozenset[str]) -> bool | str:
    """The `GraphConfig.chain` value that chains exactly `stacks` (`chained_stacks`'s inverse)."""
    return stacks == frozenset(STACKS) or (next(iter(stacks)) if stacks else False)


def resolve_chain(chain: bool | str | None, on_gpu: bool, quantized: frozenset[str]) -> frozenset[str]:
    """The stacks an engine chains: `chain`'s, or where it is None, on a GPU (without PDL) the stacks whose weights
    are bf16 (`quantized`: the others). The chained tail takes bf16 weights only: on 1-byte and int4 weights one
    launch per product is faster, the chained tails running one program an SM where the separate GEMVs run many
    (docs/PERFORMANCE.md: on an H100 every quantized format gained 6-16% frames/s unchained; bf16 lost 3%). A `chain`
    that names a quantized stack is refused."""
    if chain is None:
        return frozenset(STACKS) - quantized if on_gpu else frozenset()
    stacks = chained_stacks(chain)
    if stacks & quantized:
        raise ValueError(f"the chained block tails take bf16 weights only; {', '.join(sorted(stacks & quantized))} "
                         "has quantized weights (its products run one launch each)")
    return stacks


def resolve_hand_over(hand_over: bool | None, precision: str, handed_table: bool = False) -> frozenset[str]:
    """The stacks whose products launched alone take their input handed over: `hand_over`'s, or where it is None,
    both; but an LM whose weights are int8 (`precision`: the LM's format, `quant.precision_of`) where the tuning
    table's entries were swept with each product preparing its own input (`handed_table` False, `Tuning.handed_inputs`).
    With such a table (the H200's) the hand-over made int4 and fp8 frames 3-4% faster on an H100 and int8 ones
    1.7-2.0% slower, in either order in one process: the int8 LM's q|k|v and gate|up each took 1-3 us longer
    prenormed, in tiles chosen for their own input. Swept with handed inputs (the H100's table) int8 gains too."""
    if hand_over is None:
        return frozenset(STACKS) - ({"lm"} if precision == "int8" and not handed_table else set())
    return frozenset(STACKS) if hand_over else frozenset()


@dataclass(frozen=True)
class GraphConfig:
    replay_block: int = 8  # frames replayed between two looks at the end flag (and the yield granularity)
    in_flight: int = 3  # blocks queued ahead of the one being waited for: cancel and end latency <= 32 frames
    frame_ring: int = 64  # frame-hidden rows on the device: the blocks in flight plus the one being copied out
    attention_splits: int = 16  # decode attention splits the live context over this many programs per head
    # Programmatic dependent launch measured slower on the H200 every way it was tried on bf16 weights (the run
    # log); on quantized stacks, whose shorter products carry more fixed cost a launch, unmeasured: opt-in only,
    # kept for the bench's A/B and its no-bit-changes tests. Ignored where the device or Triton cannot do it.
    pdl: bool = False
    # Each block's products after attention (and the next block's q|k|v) in one persistent launch with grid barriers
    # (`kernels/tail.py`), a small gain at every prompt length in bf16; bf16 weights only. None: on a GPU without PDL,
    # the stacks on bf16 weights (`resolve_chain`); on the CPU interpreter (tests) True runs one launch per product of
    # the same kernel. "lm" or "depth" chains that stack's blocks only (the other's run one launch per product).
    chain: bool | str | None = None
    # Where the products run one launch each: each product's input arrives in its MMA dtype from the kernel before,
    # the RMSNorm products' already times the norm's gain with the rows' sums of squares beside it (`NormSums`), so a
    # quantized product's k-loop converts its weights only. None: every unchained stack, but an int8 LM's where the
    # tuning table was swept without it (`resolve_hand_over`); True / False: every unchained stack / none, False for
    # the bench's A/B (`graph-own-input`) and the test that the two agree.
    hand_over: bool | None = None
    # Songs advanced together by one replay (2 rows each; a product takes at most 16 rows, so 8 at most). Graphs are
    # captured per bucket of 1, 2, 4, 8 songs up to this; `engine.slots` is this number. The default is the maximum:
    # a batch of 8 is bit-identical to each song alone on the H200 (`tests/semantic/test_batch_gpu.py`). It is an
    # upper bound: a song joins only when the KV pool has its region (`can_admit`), so a smaller card runs fewer.
    slots: int = 8
    # Prompt tokens prefilled per round while other songs run: a long prompt joins in chunks, so the songs already
    # running wait about one block at a time, not for the whole prefill. A prompt is always cut at multiples of this
    # from its start (its K/V bits depend on the cuts), whichever songs share its rounds.
    prefill_chunk: int = 512
    # The KV pool's format (`kv_format.py`): the model's dtype, or int8 with a scale per head vector, half the bytes
    # per position (the card's memory plan picks it where the longer songs need it).
    kv_format: str = "bf16"
    # The per-code tables a frame reads a row of (semantic/weights.TABLES, 0.47 GB at full size) in pinned host memory
    # instead of the device's (the card's memory plan picks it where the stages take turns): a few us a frame.
    tables_on_host: bool = False

    def __post_init__(self) -> None:
        check_kv_format(self.kv_format)
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        if not 1 <= self.slots <= 8:
            raise ValueError("slots must be in 1..8 (two rows per song, at most 16 rows per product)")
        if self.replay_block < 1 or self.in_flight < 0 or self.attention_splits < 1:
            raise ValueError("replay_block and attention_splits must be at least 1, in_flight at least 0")
        if self.frame_ring < (self.in_flight + 2) * self.replay_block:
            raise ValueError("frame_ring must hold the blocks in flight plus the one being copied out")
        if self.chain not in (None, True, False) + STACKS:
            raise ValueError(f"chain must be True, False, None or one of {', '.join(STACKS)}")
        if self.chain and self.pdl:
            raise ValueError("the chained block tails take no PDL")

    def with_overrides(self, **fields) -> "GraphConfig":
        """This config with the fields given a value other than None (the engine's keyword arguments)."""
        return replace(self, **{name: value for name, value in fields.items() if value is not None})
