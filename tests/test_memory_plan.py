"""The memory plan with faked figures (a pure function): what goes where, slots, the longest song and auto's pick on
16 / 24 / 48 / 80 / 141 GB cards with and without fp8, the H200 figures it was calibrated on, the issue's targets,
and the README's table of it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from music3_demo import contract as c
from music3_demo import random_models
from music3_demo.loading import no_room_sentence
from music3_demo.memory_layout import (
    CHECK_BYTES,
    DIT_CALL_BYTES,
    GB,
    HEADROOM_FIXED,
    HEADROOM_FLOOR,
    HEADROOM_MAX,
    OUTSIDE_TORCH_BYTES,
    REFERENCE_PROMPT_TOKENS,
    RUNTIME_BYTES,
    VOCODER_CHUNK_BYTES,
    GiB,
    MemoryPlan,
    duration_text,
    headroom_for,
)
from music3_demo.memory_plan import plan_memory

FULL = random_models.figures(random_models.FULL)
README = Path(__file__).resolve().parents[1] / "README.md"
CARDS = (16, 24, 48, 80, 141)
SM86, SM89 = (8, 6), (8, 9)
# (free GB, fp8 GPU) -> (LM, DiT, slots, longest song at full slots, alone in s); None: nothing fits that card.
EXPECTED = {
    (16, False): ("int4", "bf16", 2, 200.24, 360.0), (16, True): ("fp8", "fp8", 2, 164.4, 360.0),
    (24, False): ("int8", "bf16", 4, 133.84, 360.0), (24, True): ("fp8", "bf16", 4, 138.96, 360.0),
    (48, False): ("bf16", "bf16", 8, 284.96, 360.0), (48, True): ("bf16", "bf16", 8, 284.96, 360.0),
    (80, False): ("bf16", "bf16", 8, 360.0, 360.0), (80, True): ("bf16", "bf16", 8, 360.0, 360.0),
    (141, False): ("bf16", "bf16", 8, 360.0, 360.0), (141, True): ("bf16", "bf16", 8, 360.0, 360.0),
}
CONTEXT = GiB // 2  # the CUDA context the process had before the plan read the free memory


def plan(free_gb: float, capability=SM89, **asked) -> MemoryPlan:
    return plan_memory(FULL, int(free_gb * GB), capability, **asked)


def process_bytes(p: MemoryPlan) -> int:
    """What the plan lets this process hold at its peak (the context it already had included)."""
    return CONTEXT + p.weight_bytes + p.flow_working + p.runtime + (p.kv_pool_bytes or 0)


@pytest.mark.parametrize(("free_gb", "fp8"), sorted(EXPECTED))
def test_auto_per_card(free_gb, fp8):
    p = plan(free_gb, SM89 if fp8 else SM86)
    expected = EXPECTED[(free_gb, fp8)]
    if expected is None:
        assert not p.fits
        return
    assert p.fits and (p.lm.mode, p.dit.mode, p.slots, p.longest_full_s, p.longest_alone_s) == expected
    # The pool holds what it promises: `slots` songs of the full-slot length, each in its own region.
    need = REFERENCE_PROMPT_TOKENS + c.max_frames_for(p.longest_full_s) + 2
    assert p.slots * need + 16 <= p.kv_pool_positions
    assert p.kv_pool_bytes == p.kv_pool_positions * {"bf16": 294_912, "int8": 152_064}[p.kv]
    assert p.kv == ("int8" if free_gb == 16 else "bf16")  # int8 only where a bf16 cache leaves the songs short
    # Everything the card holds stays within what it reported free, less the desktop's headroom.
    assert process_bytes(p) - CONTEXT + p.headroom <= free_gb * GB
    assert p.lm.requested == "auto" and f"{free_gb:.1f} GB free" in p.lm.reason


def test_what_goes_where_matches_the_h200_figures():
    bf16, fp8 = plan(141), plan(141, precision="fp8")
    w = bf16.weights
    # bf16: LM ~13.9 GB without the full head, depth 1.3, DiT (+ condition encoder) 4.9, vocoder 0.2 float32: 20.9
    assert round(w["language_model"] / GB, 1) == 13.9 and round(w["depth_decoder"] / GB, 1) == 1.3
    assert round((w["transformer"] + w["condition_encoder"]) / GB, 1) == 4.9 and round(w["vocoder"] / GB, 1) == 0.2
    assert round(bf16.weight_bytes / GB, 1) == 20.9
    # fp8: the quantized LM + depth decoder 7.6-7.7 GB (measured 7.6); KV 294,912 B a position for the CFG pair
    assert 7.6 <= (fp8.weights["language_model"] + fp8.weights["depth_decoder"]) / GB <= 7.7
    assert FULL.kv_bytes_per_position() == 294_912
    # The 120-s bf16 song (a ~700-token prompt) peaked at 24.2 GB allocated: 20.9 weights, 1.1 KV, the rest the flow
    # stage's lone calls (no merges, one song).
    kv = (700 + c.max_frames_for(120) + 2) * 294_912
    single = bf16.weight_bytes + kv + DIT_CALL_BYTES + VOCODER_CHUNK_BYTES
    assert round(kv / GB, 1) == 1.1 and abs(single / GB - 24.2) < 0.3
    # The whole-card fp8 app idled at 34 GB (the card's figure) with a 16.5 GB KV pool and the 1-, 2- and 4-song DiT
    # graphs' pools: the plan's weights, those pools, its runtime and the context add up to it within 0.5 GB.
    idle = fp8.weight_bytes + 16.5 * GB + (1 + 2 + 4) * DIT_CALL_BYTES + RUNTIME_BYTES + CONTEXT
    assert abs(idle / GB - 34.0) < 0.5
    # While loading, neither the full head nor the token embeddings reach the device (they arrive in host memory):
    # the load's peak is the weights, the self-check's scratch and the runtime.
    assert bf16.load_peak == bf16.weight_bytes + CHECK_BYTES + RUNTIME_BYTES


def test_the_issues_targets_on_a_24_gb_card():
    """23.5 GiB free before the app starts (its context then takes some): auto loads, holds a 6-minute song alone
    and two 2-minute songs at once, and the process stays within 22.5 GiB."""
    p = plan((23.5 * GiB - CONTEXT) / GB)
    assert p.fits and p.lm.mode == "fp8" and p.dit.mode == "bf16"
    assert p.longest_s(songs=1) == c.MAX_DURATION_S and p.longest_s(songs=2) >= 120
    assert process_bytes(p) <= 22.5 * GiB and CONTEXT + p.load_peak <= 22.5 * GiB


def test_a_16_gb_card_loads_with_1_byte_weights_an_int8_kv_cache_and_a_tiled_vocoder():
    """15 GiB free (a 16 GB card): fp8 LM and DiT, an int8 KV cache, the vocoder in tiles, two slots, a 6-minute
    song alone with a 1,000-token prompt, the process within 14.5 GiB. The 6-minute song's cache (1.56 GB in int8)
    fits beside 11 GB of weights and the planned workspaces only with the desktop's share cut from 1.16 GB to
    0.69 GB (the most that holds it); a bf16 cache, which holds no 6-minute song with any share, leaves the desktop
    its fixed 0.5 GiB and holds 3 min 14 s. Asked for, an int4 LM
    (4.6 GB, 7.6 in fp8) leaves room for a bf16 DiT and the 6-minute song with the whole share."""
    free = (15 * GiB - CONTEXT) / GB
    p = plan(free)
    assert p.fits and (p.lm.mode, p.dit.mode, p.kv, p.slots, p.vocoder_tile) == ("fp8", "fp8", "int8", 2, 128)
    assert process_bytes(p) <= 14.5 * GiB and CONTEXT + p.load_peak <= 14.5 * GiB
    assert p.longest_s() == c.MAX_DURATION_S and p.longest_s(songs=2) >= 120
    assert HEADROOM_FIXED <= p.headroom < headroom_for(p.free_bytes) and "desktop's share cut to 0.69 GB" in p.why
    bf16_kv = plan(free, kv_precision="bf16")
    assert (bf16_kv.kv, bf16_kv.slots, bf16_kv.headroom) == ("bf16", 1, HEADROOM_FIXED)
    assert 194 <= bf16_kv.longest_s() < 195
    four = plan(free, precision="int4")
    assert four.fits and (four.lm.mode, four.dit.mode, four.kv, four.slots) == ("int4", "bf16", "int8", 2)
    assert four.longest_s() == c.MAX_DURATION_S and process_bytes(four) <= 14.5 * GiB
    assert four.headroom == headroom_for(four.free_bytes)
    # without fp8 the DiT stays bf16 (2.4 GB more) and no 8-bit LM fits: auto takes int4 there, with an int8 cache
    # (its first 4 layers at int8: precision.int4_first_layers)
    older = plan(16, SM86)
    assert older.fits and (older.lm.mode, older.dit.mode, older.kv, older.slots) == ("int4", "bf16", "int8", 2)
    assert older.lm.first_layers == 4
    assert older.why.startswith("no 8-bit language model fits") and older.longest_s() == c.MAX_DURATION_S


def test_the_desktops_share_gives_way_to_a_6_minute_song_by_the_least_that_holds_it():
    """Where no plan holds a 6-minute song alone and two 2-minute songs at once, the desktop's share shrinks, 32
    MiB at a time and never below HEADROOM_FIXED, to the largest at which one does; where one does with the whole
    share (24 GB) the share stays whole, and where none does even with the fixed part (12 GB) the desktop keeps the
    fixed part and the songs have the rest."""
    from music3_demo.memory_layout import layout
    from music3_demo.memory_plan import HEADROOM_STEP, _useful

    p = plan((15 * GiB - CONTEXT) / GB)
    assert _useful(p) and p.headroom > HEADROOM_FIXED
    wider = layout(FULL, p.free_bytes, p.capability, p.lm.mode, p.dit.mode, p.engine, p.stages, p.kv,
                    p.headroom + HEADROOM_STEP)
    assert not _useful(wider)  # one step more for the desktop and the 6-minute song no longer fits
    # its allocator cap is the smaller share's: torch may take what the desktop gave up, no more
    assert p.allocator_bytes == p.free_bytes - p.headroom - OUTSIDE_TORCH_BYTES
    for free_gb in (24, 48):
        assert plan(free_gb).headroom == headroom_for(int(free_gb * GB))
    twelve = plan(11 * GiB / GB)
    assert twelve.headroom == HEADROOM_FIXED and twelve.longest_alone_s < c.MAX_DURATION_S
    assert twelve.why.endswith("this one holds the longest, with the desktop's share cut to 0.54 GB")
    whole = layout(FULL, twelve.free_bytes, twelve.capability, twelve.lm.mode, twelve.dit.mode, twelve.engine,
                    twelve.stages, twelve.kv)
    assert whole.longest_alone_s < twelve.longest_alone_s  # what the desktop gave up went to the songs


def test_the_kv_cache_is_int8_only_where_asked_or_where_bf16_leaves_the_songs_short():
    assert FULL.kv_bytes_per_position("int8") == 36 * 2 * 2 * 8 * (128 + 4)  # values + a float32 scale a head
    for free in (24, 48, 141):
        assert plan(free).kv == "bf16"
    asked = plan(141, kv_precision="int8")
    assert asked.kv == "int8" and asked.why == "the first that holds a 6-minute song alone and two 2-minute songs " \
        "at once" and "int8 KV cache" in asked.lm.reason
    assert plan(48, kv_precision="int8").slots == 8 and plan(48, kv_precision="int8").longest_full_s == 360.0
    assert plan(16, kv_precision="bf16").kv == "bf16"
    # the reference engine's cache is transformers' own, in the model's dtype: never int8
    assert plan(16, engine="reference").kv == "bf16" and plan(141, engine="reference", kv_precision="int8").kv == \
        "bf16"
    assert plan(16).for_engine("reference").kv == "bf16"
    assert plan(16).engine_sizing()[2] == "int8" and plan_memory(FULL, None, None).kv == "bf16"
    assert plan(16).as_dict()["kv_precision"] == "int8" and "int8 KV cache" in plan(16).summary()
    with pytest.raises(ValueError, match="choose one of auto, bf16, int8"):
        plan(141, kv_precision="fp8")


def test_the_vocoder_tiles_only_where_whole_chunks_leave_no_room_for_a_6_minute_song():
    tiled, whole = plan(16), plan(24)
    assert tiled.vocoder_tile == 128 and whole.vocoder_tile is None and tiled.vocoder_bucket == 1
    # one tile's activations (128 latents and 16 of context each side) instead of a 689-latent chunk's
    assert whole.flow_working - tiled.flow_working >= VOCODER_CHUNK_BYTES * 0.7
    assert plan(20, SM86).vocoder_tile == 128 and plan(20, SM86).fits  # int8 + bf16 DiT fit a 20 GB card so
    assert all(plan(free).vocoder_tile is None for free in (24, 48, 80, 141))
    assert plan(16, stages=("flow",)).vocoder_tile is None  # a flow stage's own card holds whole chunks


def test_the_h200_runs_eight_slots_and_merges_every_bucket():
    p = plan(141)
    assert (p.slots, p.dit_bucket, p.vocoder_bucket) == (8, 4, 4)
    assert p.longest_full_s == c.MAX_DURATION_S  # the pool is capped there: 8 songs of the longest request
    assert p.kv_pool_positions == (8 * (c.MAX_PROMPT_TOKENS + c.MAX_AUDIO_FRAMES + 2) + 16) // 256 * 256


def test_merged_calls_only_where_their_working_set_fits():
    small, big = plan(24), plan(48)
    assert (small.dit_bucket, small.vocoder_bucket) == (1, 1)  # a 24 GB card merges nothing
    assert big.dit_bucket == 4 and big.vocoder_bucket == 1  # 48 GB: DiT merges, not the 1.7-GB-a-chunk vocoder
    assert big.flow_working > small.flow_working
    for free in CARDS:
        p = plan(free)
        if p.fits:
            assert p.dit_bucket <= p.slots and p.vocoder_bucket <= p.slots


def test_an_equalized_lm_loads_with_one_layers_bf16_weights_on_the_card_beside_it():
    """int8 and int4 LMs are equalized layer by layer at load (semantic/equalize.LayerGatherer): while the layers
    arrive the card holds one decoder layer's bf16 weights and a float32 copy of 1,024 rows (0.44 GB), counted
    beside the self-check's scratch (no table is in flight on the card: both arrive in host memory)."""
    from music3_demo.memory_layout import EQUALIZE_ROWS_BYTES

    int8, fp8 = plan(141, precision="int8"), plan(141, precision="fp8")
    layer = 2 * FULL.lm_blocks // FULL.lm_layers
    assert round((layer + EQUALIZE_ROWS_BYTES) / GB, 2) == 0.44
    assert int8.load_peak - fp8.load_peak == int8.weight_bytes - fp8.weight_bytes + layer + EQUALIZE_ROWS_BYTES
    assert int8.load_peak == int8.weight_bytes + CHECK_BYTES + layer + EQUALIZE_ROWS_BYTES + RUNTIME_BYTES


def test_the_headroom_is_a_fixed_part_plus_a_fraction_capped():
    assert headroom_for(0) == HEADROOM_FIXED
    assert HEADROOM_FIXED < headroom_for(24 * GB) < headroom_for(30 * GB) <= HEADROOM_MAX == headroom_for(141 * GB)


@pytest.mark.parametrize("free_gb", CARDS)
def test_torch_is_held_to_what_the_plan_sizes_beside_what_lands_outside_it(free_gb):
    """The allocator's cap (allocator.cap_allocator) is the budget less what lands outside torch after the plan; what
    the plan places inside torch (weights, KV pool, flow working set, the runtime's part inside torch) fits under it,
    and so does the load's peak."""
    p = plan(free_gb)
    inside = p.weight_bytes + (p.kv_pool_bytes or 0) + p.flow_working + p.runtime - OUTSIDE_TORCH_BYTES
    assert inside <= p.allocator_bytes == p.free_bytes - p.headroom - OUTSIDE_TORCH_BYTES
    assert p.load_peak - OUTSIDE_TORCH_BYTES <= p.allocator_bytes
    assert 0 < OUTSIDE_TORCH_BYTES < RUNTIME_BYTES
    assert plan_memory(FULL, None, None).allocator_bytes is None  # no GPU: nothing to hold


def test_explicit_modes_are_kept_and_fp8_without_hardware_is_one_sentence():
    p = plan(141, precision="int8", dit_precision="fp8")
    assert (p.lm.mode, p.dit.mode) == ("int8", "fp8") and "as asked (--dit-precision fp8)" in p.dit.reason
    assert p.weights["transformer"] < plan(141).weights["transformer"] * 0.55  # one byte a block weight, not two
    with pytest.raises(ValueError, match=r"--dit-precision fp8 needs .* sm_89 or newer.*sm_86: use --dit-precision "
                                         "bf16"):
        plan(141, SM86, dit_precision="fp8")
    with pytest.raises(ValueError, match="sm_86: use --precision int8"):
        plan(141, SM86, precision="fp8")
    with pytest.raises(ValueError, match="choose one of auto, bf16, fp8"):
        plan(141, dit_precision="int8")


def test_on_a_cpu_nothing_is_sized_and_an_fp8_dit_says_what_runs_instead():
    p = plan_memory(FULL, None, None, dit_precision="fp8")
    assert (p.lm.mode, p.dit.mode, p.slots, p.kv_pool_positions, p.max_frames()) == ("bf16", "bf16", None, None,
                                                                                      None)
    assert "needs a CUDA GPU" in p.dit.reason and "runs unquantized" in p.dit.reason
    assert plan_memory(FULL, None, None, precision="int8").lm.mode == "int8"  # the CPU quantizes when asked
    assert p.too_long(4000, c.MAX_AUDIO_FRAMES) is None


def test_a_song_too_long_for_the_card_is_one_sentence_naming_the_longest_that_fits():
    p = plan(19, precision="fp8", dit_precision="bf16", kv_precision="bf16")
    most = p.max_frames(200)
    assert 0 < most < c.MAX_AUDIO_FRAMES and p.too_long(200, most) is None
    sentence = p.too_long(200, most + 1)
    assert sentence == (f"On this GPU (19.0 GB free, fp8 LM, bf16 DiT) songs with this prompt can be at most "
                        f"{duration_text(most / c.FRAME_RATE)} long; choose a shorter duration.")
    assert p.max_frames(4000) < most  # a longer prompt leaves a shorter song
    short = plan(17.2, precision="fp8", dit_precision="bf16", kv_precision="bf16", swap="off")
    assert "leaves no room for a song" in short.too_long(4000, 25)
    assert plan(17.2, precision="fp8", dit_precision="bf16", kv_precision="bf16").swap  # (auto: the stages in turn)
    assert duration_text(200) == "3 min 20 s" and duration_text(45) == "45 s" and duration_text(360) == "6 min"


def test_a_card_too_small_is_refused_with_the_free_and_needed_memory():
    p = plan(10.5, swap="off")  # (with the stages in turn it fits: the next test)
    assert not p.fits and (p.lm.mode, p.dit.mode) == ("int4", "fp8")  # the smallest modes were tried last
    sentence = no_room_sentence(p, "cuda:0")
    assert sentence.startswith("The model does not fit on cuda:0 in int4 LM, fp8 DiT: 10.5 GB are free and it "
                               "needs about ")
    assert "close other programs" in sentence


def test_the_reference_engine_keeps_the_full_head_and_pays_twice_per_position():
    graph, reference = plan(48), plan(48, engine="reference")
    assert "engine_tables" in graph.weights and "embeddings_and_head" in reference.weights
    assert reference.kv_bytes_per_position == 2 * graph.kv_bytes_per_position
    assert reference.engine_sizing() == (reference.slots, None, "bf16", False)
    assert graph.engine_sizing()[3] is False and plan(9.0).engine_sizing()[3] is True  # (tables: in turn, host)
    assert graph.engine_sizing()[1] == graph.kv_pool_positions
    again = graph.for_engine("reference")
    assert again.lm == graph.lm and again.slots == reference.slots


def test_a_stage_splits_cards_each_hold_their_stage():
    semantic = plan(24, stages=("semantic",))
    flow = plan(24, stages=("flow",))
    assert set(semantic.weights) == {"language_model", "depth_decoder", "audio_head", "engine_tables"}
    assert set(flow.weights) == {"condition_encoder", "transformer", "vocoder"} and flow.slots is None
    # the flow stage's room went to the pool (the same modes)
    semantic_fp8, whole_fp8 = plan(24, stages=("semantic",), precision="fp8"), plan(24, precision="fp8")
    assert semantic_fp8.kv_pool_positions > whole_fp8.kv_pool_positions


def auto_table() -> str:
    """The README's table, generated from the plan."""
    rows = ["| free GPU memory | sm_80 / sm_86 (A100, RTX 30xx) | sm_89 and newer (RTX 40xx/50xx, L40, H100/H200) |",
            "|---|---|---|"]
    for free in CARDS:
        cells = []
        for capability in (SM86, SM89):
            p = plan(free, capability)
            cells.append("does not fit" if not p.fits else
                         f"{p.modes()} · {p.slots} slot{'s' * (p.slots > 1)} · {duration_text(p.longest_full_s)}")
        rows.append(f"| {free} GB | {' | '.join(cells)} |")
    return "\n".join(rows)


def test_the_readme_states_what_auto_picks():
    """Set MUSIC3_WRITE_README=1 to write the table after changing the plan."""
    text = README.read_text(encoding="utf-8")
    before, table, after = text.split("<!-- precision-auto-table -->")
    if os.environ.get("MUSIC3_WRITE_README"):
        README.write_text(f"{before}<!-- precision-auto-table -->\n{auto_table()}\n<!-- precision-auto-table -->"
                          f"{after}", encoding="utf-8")
        return
    assert table.strip() == auto_table()
    assert re.search(r"longest song at full slots", before.split("## Precision and memory")[1])


def test_the_fp8_dit_arrives_after_the_self_check_so_the_load_peak_is_the_larger_phase_not_their_sum():
    """The fp8 DiT waits in host memory until the engine's self-check has dropped the full head and the token
    embeddings (Music3Pipeline.ensure_stages): on a 16 GB card that is what lets the load fit at all."""
    p = plan(15.0, dit_precision="fp8", precision="fp8", swap="off")
    semantic_phase = p.weight_bytes - p.weights["transformer"] + CHECK_BYTES + RUNTIME_BYTES
    assert p.load_peak == max(semantic_phase, p.weight_bytes + RUNTIME_BYTES)
    assert p.load_peak < p.weight_bytes + CHECK_BYTES + RUNTIME_BYTES  # the phases never sit on the card together
    bf16 = plan(15.0, dit_precision="bf16", precision="fp8", swap="off")  # a bf16 DiT streams in with the rest
    assert bf16.load_peak == bf16.weight_bytes + CHECK_BYTES + RUNTIME_BYTES


def test_auto_takes_an_int4_lm_only_where_no_8_bit_one_fits():
    """auto's last resort is an int4 LM (its depth decoder at 8 bits: 0.5625 and 1.03 bytes per weight on sm_86,
    its int8; fp8's 1.004 where the GPU converts fp8): a 16 GB sm_86 card, where int8 does not fit, runs it (with a
    bf16 cache two slots and a 5 min 38 s song; auto's int8 cache gives two slots, 6 minutes and its first 4 layers
    at int8); a 20 GB one
    keeps int8, as a 16 GB sm_89 card keeps fp8 (two slots, 6 minutes alone with an int8 cache), though int4 would
    hold more there: it costs accuracy (and on a fast card speed). `--precision int4` asks for it anywhere."""
    from music3_demo.memory_layout import BYTES_PER_WEIGHT
    from music3_demo.precision import depth_mode
    from music3_demo.semantic.quant import DEFAULT_SCHEMES

    assert BYTES_PER_WEIGHT["int4"] == 0.5 + 4 / DEFAULT_SCHEMES["int4"].group
    assert [depth_mode("int4", cap) for cap in (SM86, SM89, (9, 0), None)] == ["int8", "fp8", "fp8", "int8"]
    assert [depth_mode(mode, SM89) for mode in ("bf16", "fp8", "int8")] == ["bf16", "fp8", "int8"]
    fp8_depth = plan(16, SM89, precision="int4").weights["depth_decoder"]
    assert fp8_depth == plan(16, SM89, precision="fp8").weights["depth_decoder"]
    assert fp8_depth < plan(16, SM86, precision="int4").weights["depth_decoder"]
    assert not plan(16, SM86, precision="int8", swap="off").fits
    p = plan(16, SM86, kv_precision="bf16")
    assert p.fits and (p.lm.mode, p.dit.mode, p.slots) == ("int4", "bf16", 2) and 338 <= p.longest_alone_s < 339
    assert (plan(16, SM86).kv, plan(16, SM86).slots, plan(16, SM86).longest_alone_s) == ("int8", 2, 360.0)
    int8 = plan(24, SM86)
    assert int8.lm.mode == "int8"
    assert p.weights["language_model"] < 0.55 * int8.weights["language_model"]
    assert p.weights["depth_decoder"] == int8.weights["depth_decoder"]
    assert plan(20, SM86).lm.mode == "int8" and plan(16).lm.mode == "fp8"
    assert plan(16, precision="int4").kv_pool_positions > plan(16).kv_pool_positions
    small = plan(12)
    assert small.fits and (small.lm.mode, small.dit.mode) == ("int4", "fp8")
    asked = plan(141, precision="int4")
    assert (asked.lm.mode, asked.lm.requested, asked.slots) == ("int4", "int4", 8) and "as asked" in asked.lm.reason


def test_an_int4_lm_keeps_its_first_layers_at_8_bits_where_the_card_holds_them_with_the_desktops_whole_share():
    """`precision.int4_first_layers` (a ninth: 4 of the full model's 36 layers, none of the small models'): the plan
    stores them in the depth decoder's 8 bits where that plan does what auto asks without cutting the desktop's
    share (a 10 GB card, a 16 GB sm_86 one, `--precision int4` on a 12 GB one), else plain int4 (the 8 GB card's
    2-minute song needs the share cut); the banner names them."""
    from music3_demo.memory_layout import BYTES_PER_WEIGHT
    from music3_demo.precision import int4_first_layers

    assert [int4_first_layers(n) for n in (36, 18, 8, 4, 2)] == [4, 2, 0, 0, 0]
    ten = plan(9 * GiB / GB)
    plain = plan_memory(FULL, int(9 * GiB), SM89, precision="int4", swap="on")
    layers = FULL.lm_blocks // FULL.lm_layers * 4
    assert (ten.lm.mode, ten.lm.first_layers, ten.swap, ten.longest_alone_s) == ("int4", 4, True, 360.0)
    assert ten.headroom == headroom_for(ten.free_bytes) and "int4 LM (layers 0-3 fp8), fp8 DiT" in ten.lm.reason
    assert ten.weights["language_model"] - int(FULL.lm_blocks * BYTES_PER_WEIGHT["int4"]) - 2 * FULL.lm_other in (
        int(layers * BYTES_PER_WEIGHT["fp8"]) - int(layers * BYTES_PER_WEIGHT["int4"]) + d for d in (-1, 0, 1))
    assert plain.lm.first_layers == 4  # (asked for, int4 takes them too where they fit)
    eight = plan((7 * GiB - CONTEXT) / GB)
    assert (eight.lm.mode, eight.lm.first_layers) == ("int4", 0) and eight.headroom < HEADROOM_FIXED
    assert "layers 0-" not in eight.lm.reason
    assert "int4 LM (layers 0-3 int8)" in plan(16, SM86).modes()
    assert plan(16).lm.first_layers == 0  # (an fp8 LM)
    assert plan_memory(FULL, None, None, precision="int4").lm.first_layers == 0  # (off a GPU: nothing planned)


def test_where_both_stages_do_not_fit_they_take_turns_and_streaming_stays_where_it_holds_two_minutes():
    """The stages in turn (stage_swap.py): the card holds the larger stage (the flow stage with its working set)
    beside the KV pool and the runtime, one song at a time, the weights of both in pinned host memory."""
    from music3_demo.memory_layout import CHECK_BYTES, EQUALIZE_ROWS_BYTES

    streams = plan(11 * GiB / GB)  # 11 GiB free: streaming holds more than 2 minutes, so it stays
    assert streams.fits and not streams.swap and streams.longest_alone_s >= 120
    turns = plan(10 * GiB / GB)  # nothing with both stages on the card holds a 2-minute song (a 12 GB card's
    # 11 GiB less the CUDA context: streaming there holds 1 min 52 s)
    assert plan((11 * GiB - CONTEXT) / GB, swap="off").longest_alone_s == 112.88
    # ... so it takes turns with 8-bit weights, which hold 5 min 58 s there (int4's 6 minutes would cost accuracy)
    twelve = plan((11 * GiB - CONTEXT) / GB)
    assert twelve.swap and (twelve.lm.mode, twelve.dit.mode, twelve.kv) == ("fp8", "fp8", "int8"), twelve.why
    assert 358 <= twelve.longest_alone_s < 359
    assert turns.fits and turns.swap and (turns.lm.mode, turns.dit.mode, turns.kv) == ("fp8", "fp8", "int8")
    assert turns.slots == 1 and (turns.dit_bucket, turns.vocoder_bucket) == (1, 1) and 225 < turns.longest_alone_s < 226
    semantic, flow = turns.stage_bytes("semantic"), turns.stage_bytes("flow")
    # the per-code tables wait in pinned host memory, read a row at a time (semantic/weights.TABLES); the weights of
    # both stages take turns through it
    assert "engine_tables" not in turns.weights and turns.engine_sizing()[3] is True
    assert semantic + flow == turns.weight_bytes == turns.host_bytes - FULL.engine_tables_bytes()
    assert turns.song_bytes == turns.runtime + max(semantic, flow + turns.flow_working)
    assert turns.song_bytes + turns.kv_pool_bytes + turns.headroom <= turns.free_bytes
    assert "the stages take turns" in turns.why and "the stages in turn" in turns.modes()
    assert "first audio after the first chunk's frames and a turn" in turns.summary()
    assert plan(10 * GiB / GB, swap="off").swap is False  # never, when asked
    asked = plan(141, swap="on")  # always, when asked: the modes a whole card takes
    assert asked.swap and asked.lm.mode == "bf16" and "as asked (--swap on)" in asked.why
    # An 8 GB card (7 GiB free less the context) loads in turn (the int4 semantic stage, the self-check's scratch
    # and the equalizer's layer beside it: 6.22 GB), and holds a 2-minute song after a 1,000-token prompt with the
    # desktop's share cut below its fixed 0.5 GiB, to the most that holds one (HEADROOM_FLOOR at least: what the
    # card's test leaves it); a 10 GB card's 9 GiB holds 6 minutes with the share it would have anyway
    eight = plan((7 * GiB - CONTEXT) / GB)
    layer = 2 * FULL.lm_blocks // FULL.lm_layers
    assert eight.fits and eight.swap and (eight.lm.mode, eight.dit.mode, eight.kv) == ("int4", "fp8", "int8")
    assert eight.load_peak == eight.stage_bytes("semantic") + CHECK_BYTES + layer + EQUALIZE_ROWS_BYTES + RUNTIME_BYTES
    assert eight.load_peak < eight.free_bytes - HEADROOM_FIXED and 120 <= eight.longest_alone_s < 125
    assert HEADROOM_FLOOR <= eight.headroom < HEADROOM_FIXED and "share cut to 0.27 GB" in eight.why
    assert CONTEXT + eight.song_bytes + eight.kv_pool_bytes <= 6.8 * GiB
    assert plan(7 * GiB / GB).headroom == HEADROOM_FIXED  # (where the fixed share holds 2 minutes, it stays)
    smaller = plan((6.9 * GiB - CONTEXT) / GB)  # no share holds 2 minutes: the floor's, the longest it can
    assert smaller.headroom == HEADROOM_FLOOR and 100 < smaller.longest_alone_s < 120
    ten = plan(9 * GiB / GB)
    assert ten.fits and ten.swap and ten.longest_alone_s == 360 and ten.dit.mode == "fp8"


def test_where_a_whole_songs_lyrics_leave_little_the_banner_also_says_what_a_short_prompt_leaves():
    """On the smallest card that loads an fp8 LM (asked for: 9.4 GiB free, the stages in turn), a 1,000-token prompt
    leaves no song; the banner says so and what a 200-token prompt leaves, which is what the refusal for one also
    says."""
    small = plan((9.4 * GiB - CONTEXT) / GB, precision="fp8")
    assert small.fits and small.swap and small.longest_alone_s < 1
    assert "songs up to 0 s after a 1,000-token prompt, 32 s after a short one" in small.summary()
    assert "at most 32 s long" in small.too_long(200, 3000)
    assert "short one" not in plan(24.0).summary()  # (a card whose songs are long says one figure)
