"""One memory plan per card: which modes it runs (each stage's precision, the KV cache's, whether the stages take
turns) and why. The figures of one set of modes are memory_layout.py's.

`auto` takes the first of (bf16 LM, bf16 DiT), (fp8 | int8 LM, bf16 DiT), (fp8 | int8 LM, fp8 DiT), each with a
bf16 then an int8 KV cache, whose plan holds a 6-minute song alone and two 2-minute songs at once
(REFERENCE_PROMPT_TOKENS each); fp8 needs sm_89+ (int8 is the LM's 1-byte mode before it; the DiT stays bf16 there).
Where none does, the first that does with less of the desktop's share; else the one holding the longest song. An
int4 LM only where no 8-bit one fits, its first layers at 8 bits (`precision.int4_first_layers`) where that holds
what auto asks with the desktop's whole share (never at the cost of the share). Where no such plan fits and holds a
2-minute song alone, the stages take turns on the device (memory_layout's `swap`), chosen the same way, if that
holds a 2-minute song (or streaming does not fit at all); where nothing fits, the plan that does not is returned (its
load then says so in one sentence).
"""

from __future__ import annotations

from dataclasses import replace

from . import contract as c
from .memory_layout import FULL_SLOT_SONG_S, GB, HEADROOM_FIXED, HEADROOM_FLOOR, STAGES, MemoryPlan, duration_text
from .memory_layout import headroom_for, layout
from .model_figures import ModelFigures
from .precision import PrecisionChoice, check_dit_precision, check_kv_precision, check_precision
from .precision import fp8_capable, int4_first_layers, refuse_unsupported, sm_name

USEFUL_ALONE_S = c.MAX_DURATION_S  # auto's test: the longest song alone ...
USEFUL_TOGETHER = (2, 120.0)  # ... and two 2-minute songs at once
# Where no plan holds a 6-minute song alone with the desktop's share, it gives way HEADROOM_STEP at a time
# (`_giving_way`) to the most that holds one, else to HEADROOM_FIXED (then the card holds the longest songs it can).
HEADROOM_STEP = 32 << 20
SWAP_MODES = ("auto", "on", "off")  # the stages in turn: where streaming does not fit | always | never


def check_swap(requested: str) -> str:
    if requested not in SWAP_MODES:
        raise ValueError(f"swap must be one of {', '.join(SWAP_MODES)}, got {requested!r}")
    return requested


def _with_share(plan: MemoryPlan, share: int) -> MemoryPlan:
    """`plan`'s modes on the same card with `share` bytes kept for the desktop."""
    return layout(plan.figures, plan.free_bytes, plan.capability, plan.lm.mode, plan.dit.mode, plan.engine,
                  plan.stages, plan.kv, share, plan.swap, plan.lm.first_layers)


def _giving_way(plan: MemoryPlan, enough=None, floor: int = HEADROOM_FIXED) -> MemoryPlan | None:
    """`plan`'s modes with the desktop's share cut, HEADROOM_STEP at a time down to `floor`, to the largest share at
    which `enough(plan)` (default: `_useful`, what auto asks of a card); None where even the floor's does not."""
    if plan.lm.first_layers:  # (8-bit first layers are worth song length, not the desktop's share)
        return None
    enough = enough or _useful
    headroom = plan.headroom - HEADROOM_STEP
    while headroom > floor - HEADROOM_STEP:
        smaller = _with_share(plan, max(floor, headroom))
        if enough(smaller):
            return smaller
        headroom -= HEADROOM_STEP
    return None


def _to_the_floor(plans: list[MemoryPlan], lm_auto: bool) -> MemoryPlan | None:
    """Where no plan in turn holds a FULL_SLOT_SONG_S song alone at the fixed share: the first of `plans` (auto's
    order, `_candidates`) that does with the share cut below it, down to HEADROOM_FLOOR (the largest such share),
    else the one holding the longest song at the floor; None where none fits even there."""
    candidates = _candidates(plans, lm_auto)
    for plan in candidates:
        smaller = _giving_way(_with_share(plan, HEADROOM_FIXED), _streams_enough, HEADROOM_FLOOR)
        if smaller is not None:
            return smaller
    floor = _longest([_with_share(plan, HEADROOM_FLOOR) for plan in candidates])
    return floor if floor.fits else None


def _longest(plans: list[MemoryPlan]) -> MemoryPlan:
    """The plan holding the longest song (one that fits first; fewer weight bytes at a tie)."""
    return max(plans, key=lambda plan: (plan.fits, plan.max_frames() or 0, -plan.weight_bytes))


def _useful(plan: MemoryPlan) -> bool:
    if not plan.fits:
        return False
    if plan.kv_pool_positions is None:
        return True
    together, seconds = USEFUL_TOGETHER
    return plan.longest_s() >= USEFUL_ALONE_S and plan.longest_s(songs=together) >= seconds


def _candidates(plans: list[MemoryPlan], lm_auto: bool) -> list[MemoryPlan]:
    """`plans` without the int4 LM's where auto has an 8-bit one that fits."""
    eight_bit = [plan for plan in plans if plan.lm.mode != "int4"]
    return eight_bit if lm_auto and any(plan.fits for plan in eight_bit) else plans


def _choose(plans: list[MemoryPlan], lm_auto: bool) -> tuple[MemoryPlan, bool]:
    """The first of `plans` (auto's order) that is `_useful`, else the first that is with less of the desktop's
    share, else the one holding the longest song at the fixed share; and whether it is useful. An int4 LM only where
    no 8-bit one fits at all: it costs accuracy (and on a fast card speed) for song length."""
    candidates = _candidates(plans, lm_auto)
    chosen = next((plan for plan in candidates if _useful(plan)), None)
    if chosen is None:  # the desktop's share gives way before auto settles for shorter songs
        chosen = next((smaller for plan in candidates for smaller in [_giving_way(plan)] if smaller is not None),
                      None)
    if chosen is not None:
        return chosen, True
    # no share holds that: the desktop keeps its fixed part, the songs have the rest
    return _longest([_with_share(plan, HEADROOM_FIXED) for plan in candidates]), False


def _streams_enough(plan: MemoryPlan) -> bool:
    """A plan whose stages run side by side and that holds a 2-minute song alone: auto takes turns only without."""
    return plan.fits and (plan.longest_s() or 0) >= FULL_SLOT_SONG_S


def plan_memory(
    figures: ModelFigures | None,
    free_bytes: int | None,
    capability: tuple[int, int] | None,
    precision: str = "auto",
    dit_precision: str = "auto",
    engine: str = "graph",
    stages: tuple[str, ...] = STAGES,
    kv_precision: str = "auto",
    swap: str = "auto",
) -> MemoryPlan:
    """The plan for one card. `free_bytes` / `capability` None: not a GPU (auto keeps the weights as they are;
    an fp8 DiT asked for runs unquantized, and the plan says so). `figures` None on a GPU: the checkpoint does not
    say (its load then names the fault); the plan keeps the asked modes and sizes nothing. auto tries the LM in bf16,
    then in 1 byte, each with a bf16 then an fp8 DiT (a bf16 LM keeps a bf16 DiT); an int4 LM only where no 8-bit
    plan fits at all (it is smaller, less accurate, and on a fast card slower: its unpacking is instruction-bound).
    Each of those weights is tried with a bf16 KV cache, then an int8 one (the graph engine's: half the bytes per
    position for a rounding of ~0.2% of each head vector, smaller than any weight format's effect: PERFORMANCE.md).
    `swap`: the stages take turns on the device "on" always (off a GPU too: the turns then move nothing but run
    the same way), "off" never, "auto" where no plan that streams fits and holds a 2-minute song alone."""
    check_precision(precision)
    check_dit_precision(dit_precision)
    check_kv_precision(kv_precision)
    check_swap(swap)
    lm_auto, dit_auto, kv_auto = precision == "auto", dit_precision == "auto", kv_precision == "auto"
    kv_asked = "bf16" if kv_auto or engine != "graph" else kv_precision
    both = "semantic" in stages and "flow" in stages
    if free_bytes is not None:
        refuse_unsupported(precision, dit_precision, capability)
    if free_bytes is None or figures is None:  # not a GPU, or a checkpoint that gives no figures: nothing to size
        lm = PrecisionChoice("bf16" if lm_auto else precision, precision, (
            f"{precision} as asked (--precision {precision})." if not lm_auto else
            "No GPU: the weights stay unquantized (float32 on a CPU)." if free_bytes is None else
            "bf16: the checkpoint gives no figures to plan with."))
        dit_mode = dit_precision if free_bytes is not None and not dit_auto else "bf16"
        dit = PrecisionChoice(dit_mode, dit_precision, (
            "The fp8 DiT needs a CUDA GPU of sm_89 or newer: on this device the DiT runs unquantized."
            if dit_precision == "fp8" and free_bytes is None else f"The DiT runs in {dit_mode}."))
        return MemoryPlan(lm, dit, engine, stages, kv_asked, free_bytes, capability, why=lm.reason,
                          swap=swap == "on" and both)
    one_byte = "fp8" if fp8_capable(capability) else "int8"
    lms = ["bf16", one_byte, "int4"] if lm_auto else [precision]
    dits = (["bf16", "fp8"] if fp8_capable(capability) else ["bf16"]) if dit_auto else [dit_precision]
    # bf16 LM with an fp8 DiT only when asked: auto quantizes the LM before the DiT.
    pairs = [(lm, dit) for lm in lms for dit in dits if not (lm_auto and dit_auto and lm == "bf16" and dit != "bf16")]
    kvs = ["bf16", "int8"] if kv_auto and engine == "graph" and "semantic" in stages else [kv_asked]

    # An int4 LM with its first layers at 8 bits (precision.int4_first_layers) before one without, for each DiT
    firsts = {"int4": sorted({int4_first_layers(figures.lm_layers), 0}, reverse=True)}

    def plans(turns: bool) -> list[MemoryPlan]:
        return [layout(figures, free_bytes, capability, lm, dit, engine, stages, kv, swap=turns, first_layers=first)
                for lm, dit in pairs for first in firsts.get(lm, [0]) for kv in kvs]

    chosen, useful = (None, False) if swap == "on" and both else _choose(plans(False), lm_auto)
    why = ("the first that holds a 6-minute song alone and two 2-minute songs at once" if useful else
           "none holds a 6-minute song alone and two 2-minute songs at once: this one holds the longest")
    if both and swap != "off" and (chosen is None or not _streams_enough(chosen)):
        in_turn, useful = _choose(plans(True), lm_auto)
        if not _streams_enough(in_turn):
            in_turn = _to_the_floor(plans(True), lm_auto) or in_turn
        # (streaming kept unless the turns hold a 2-minute song, or the stages cannot both be there at all)
        if chosen is None or _streams_enough(in_turn) or (in_turn.fits and not chosen.fits):
            asked = "as asked (--swap on)" if swap == "on" else (
                "no plan with both stages on the device at once holds a 2-minute song alone")
            chosen, why = in_turn, f"{asked}; the stages take turns, " + (
                "the first such plan that holds a 6-minute song" if useful else "this one holding the longest song")
    if lm_auto and chosen.fits and chosen.lm.mode == "int4":  # (auto reached int4: no 8-bit plan fits)
        why = f"no 8-bit language model fits; {why}"
    if not (lm_auto or dit_auto or kv_auto):
        why = "as asked" + ("; the stages take turns" if chosen.swap else "")
    if chosen.headroom < headroom_for(free_bytes):
        why += f", with the desktop's share cut to {chosen.headroom / GB:.2f} GB"
    reason = (f"{chosen.modes()} on {free_bytes / GB:.1f} GB free ({sm_name(capability)}): {why}"
              + (f"; songs up to {duration_text(chosen.longest_alone_s)} alone" if chosen.slots else "") + ".")
    lm_reason = reason if lm_auto else f"{chosen.lm.mode} as asked (--precision {precision}); {reason}"
    dit_reason = reason if dit_auto else f"{chosen.dit.mode} as asked (--dit-precision {dit_precision}); {reason}"
    return replace(chosen, lm=PrecisionChoice(chosen.lm.mode, precision, lm_reason, chosen.lm.first_layers),
                   dit=PrecisionChoice(chosen.dit.mode, dit_precision, dit_reason), why=why)
