"""The graph engine's batch on the tiny model under Triton's interpreter: a song's codes and frames are the same
alone and batched (asking at the same moment as another, joining mid-song, beside a variation that copies its
prompt's K/V, beside a song that is cancelled, with the depth decoder's first pass split as for 8 songs), its prompt
is cut into the same prefill chunks whoever joins with it, a full KV pool admits no one, and a round that runs out
of memory frees its songs' places and regions. Few, short songs: every step of every song runs every kernel in the
interpreter. The scheduler's decisions alone: test_batch_scheduler.py."""

from __future__ import annotations

import threading
import time

import kernel_cases  # noqa: F401 - first: checks Triton's interpreter is on
import pytest
import torch

from music3_demo.semantic import SamplingSettings

# (prompt tokens, prompt seed, frames, settings, seed): different prompt lengths, settings and seeds; the variation
# has the first song's prompt.
FIRST = (6, 1, 4, SamplingSettings(), 11)
OTHER = (9, 2, 2, SamplingSettings(cfg_scale=2.0, top_k=7), 12)
VARIATION = (6, 1, 2, SamplingSettings(top_k=5), 13)


def _engine(models, slots: int, pool: int | None = None, kv_format: str = "bf16", in_flight: int = 0):
    from music3_demo.semantic.config import GraphConfig
    from music3_demo.semantic.graph import GraphEngine

    # prompts of 6 and 9 tokens join in chunks of 4 (as long prompts join a running batch)
    config = GraphConfig(replay_block=1, in_flight=in_flight, frame_ring=in_flight + 2, attention_splits=2,
                         slots=slots, prefill_chunk=4, kv_format=kv_format)
    return GraphEngine(*models, "cpu", config=config, kv_pool_positions=pool)


def _start(engine, song):
    tokens, prompt_seed, frames, settings, seed = song
    text_ids = torch.randint(0, 250, (2, tokens), generator=torch.Generator().manual_seed(prompt_seed))
    return engine.frames(text_ids, frames, settings, torch.Generator().manual_seed(seed))


def _same(run, blocks: list, alone) -> None:
    frames, codes = alone
    assert torch.equal(torch.cat(blocks), frames)
    assert torch.equal(run.codes(), codes)


@pytest.fixture(scope="module")
def models(one_block_models):
    return one_block_models


def test_a_prompt_prefilled_in_chunks_is_the_prompt_prefilled_at_once(models):
    """Chunks after the first read the K/V before them back from the song's region of the pool (float32: equal to
    rounding)."""
    from music3_demo.semantic.prefill import prefill

    engine = _engine(models, slots=2)
    engine.allocate(64)
    state, weights, lm = engine._state, engine.weights, engine.language_model
    text_ids = torch.randint(0, 250, (2, 10), generator=torch.Generator().manual_seed(3))
    prefill(state, weights, lm, text_ids, 0, 16)
    for begin in range(0, 10, 4):
        prefill(state, weights, lm, text_ids, 1, 40, begin, min(10, begin + 4))
    torch.testing.assert_close(state.kv[..., 40:50, :], state.kv[..., 16:26, :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.prompt_hidden[1], state.prompt_hidden[0], rtol=1e-5, atol=1e-5)
    assert state.kv[..., 26:40, :].abs().sum() == 0  # nothing outside the regions


def test_an_int8_pool_holds_prompts_in_its_format_and_a_variation_copies_them_bit_for_bit(models):
    """int8: the chunked prefill's K/V equal the whole prompt's up to a rounding step of the format, a variation's
    copy is exact (values and scales), and nothing outside the regions is written."""
    from music3_demo.semantic import kv_format
    from music3_demo.semantic.prefill import copy_prompt, prefill

    engine = _engine(models, slots=3, kv_format="int8")
    engine.allocate(96)
    state, weights, lm = engine._state, engine.weights, engine.language_model
    assert state.kv.dtype == torch.int8 and state.kv_bytes < 0.6 * state.kv.numel() * weights.dtype.itemsize
    text_ids = torch.randint(0, 250, (2, 10), generator=torch.Generator().manual_seed(3))
    prefill(state, weights, lm, text_ids, 0, 16)
    for begin in range(0, 10, 4):
        prefill(state, weights, lm, text_ids, 1, 40, begin, min(10, begin + 4))
    whole = kv_format.dequantize(state.kv[..., 16:26, :], state.kv_scale[..., 16:26], torch.float32)
    chunked = kv_format.dequantize(state.kv[..., 40:50, :], state.kv_scale[..., 40:50], torch.float32)
    step = state.kv_scale[..., 16:26].unsqueeze(-1)
    assert ((whole - chunked).abs() <= 1.01 * step).all()
    torch.testing.assert_close(state.prompt_hidden[1], state.prompt_hidden[0], rtol=1e-3, atol=1e-3)
    copy_prompt(state, 0, 16, 2, 60, 10)
    assert torch.equal(state.kv[..., 60:70, :], state.kv[..., 16:26, :])
    assert torch.equal(state.kv_scale[..., 60:70], state.kv_scale[..., 16:26])
    assert state.kv[..., 26:40, :].abs().sum() == 0 and state.kv_scale[..., 26:40].abs().sum() == 0


@pytest.fixture(scope="module")
def alone(models):
    """Each song alone on a fresh engine: its frames and codes."""
    engine = _engine(models, slots=2)
    songs = {}
    for song in (FIRST, OTHER, VARIATION):
        run = _start(engine, song)
        songs[song] = (torch.cat(list(run)), run.codes())
        assert run.stats.peers == 0 and run.stats.frames == song[2]
    return songs


def test_a_song_joining_mid_song_changes_neither(models, alone):
    engine = _engine(models, slots=2)
    first = _start(engine, FIRST)
    first_blocks = [next(first)]  # the first song has made a frame alone
    other = _start(engine, OTHER)
    other_blocks = list(other)  # this caller drives the batch now: both songs advance in each replay
    first_blocks += list(first)
    _same(first, first_blocks, alone[FIRST])
    _same(other, other_blocks, alone[OTHER])
    assert first.stats.peers == other.stats.peers == 1


def test_frames_asked_for_at_once_hold_the_batch_back_until_heard_and_change_nothing(models, alone):
    """A song asks for its first 2 frames at once (a first chunk, scaled down): once their steps are queued, no
    block is queued ahead of them while its caller turns them into audio, until it says it has heard it; its
    frames and codes are those it makes alone (the old engine had a fourth step queued here)."""
    engine = _engine(models, slots=2, in_flight=2)
    tokens, prompt_seed, frames, settings, seed = FIRST
    text_ids = torch.randint(0, 250, (2, tokens), generator=torch.Generator().manual_seed(prompt_seed))
    run = engine.frames(text_ids, frames, settings, torch.Generator().manual_seed(seed), urgent_frames=2)
    blocks = []
    while sum(block.shape[0] for block in blocks) < 2:
        blocks.append(next(run))
    (song,) = engine.scheduler.active.values()
    assert song.launched == 3 and not engine.scheduler.in_flight  # steps 0-2: frames 0 and 1
    run.heard()
    assert engine.scheduler.lookahead() == 2
    blocks += list(run)
    _same(run, blocks, alone[FIRST])


def _at_once(engine, runs: list) -> list[list]:
    """Iterate the runs on a thread each, all in the waiting line before any round starts (the drive lock held until
    then): one round admits them all, in this order. Returns each run's blocks."""
    results: list = [None] * len(runs)

    def sing(index: int) -> None:
        try:
            results[index] = list(runs[index])
        except BaseException as error:  # noqa: BLE001 - raised on the test's thread
            results[index] = error

    threads = [threading.Thread(target=sing, args=(index,)) for index in range(len(runs))]
    with engine._drive:
        for count, thread in enumerate(threads, 1):
            thread.start()
            while len(engine.scheduler.waiting) < count and thread.is_alive():  # in line before the next one starts
                time.sleep(0.01)
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _cuts(engine, monkeypatch) -> list[tuple[int, int, int]]:
    """(place, begin, end) of every prefill chunk the engine runs from now on."""
    cuts = []
    fill = engine._prefill
    monkeypatch.setattr(engine, "_prefill", lambda place, *args: cuts.append((place, *args[-2:])) or fill(place, *args))
    return cuts


def _chunks(length: int, chunk: int = 4) -> list[tuple[int, int]]:
    """Where a prompt of `length` tokens is cut alone."""
    return [(begin, min(begin + chunk, length)) for begin in range(0, length, chunk)]


def test_songs_asking_at_once_make_what_they_make_alone(models, alone, monkeypatch):
    """The shorter prompt first (6 tokens: chunks 4 + 2), then the longer one (9): the longer is still cut 4 + 4 + 1
    as alone, not after the 2 tokens its neighbour left of a round (the K/V of a prompt cut elsewhere differ in the
    last bits, and on the H200 a 1200-token song batched with 7 others made other codes late in the song)."""
    engine = _engine(models, slots=2)
    cuts = _cuts(engine, monkeypatch)
    first, other = _start(engine, FIRST), _start(engine, OTHER)
    first_blocks, other_blocks = _at_once(engine, [first, other])
    _same(first, first_blocks, alone[FIRST])
    _same(other, other_blocks, alone[OTHER])
    assert [cut[1:] for cut in cuts if cut[0] == 1] == _chunks(OTHER[0])  # 4 + 4 + 1
    assert first.stats.peers == other.stats.peers == 1


def test_variation_and_cancelled_song_beside_a_song(models, alone, monkeypatch):
    """Three songs in a bucket of 4 with the depth decoder's first pass split in two (as 8 songs run it): the
    variation copies the first song's prompt K/V instead of a prefill, the third song is cancelled (closed) after
    its first frame."""
    from music3_demo.semantic import frame_graph, graph, prefill

    monkeypatch.setattr(frame_graph, "FUSED_FIRST_PASS_ROWS", 4)  # one song's 4 rows fuse; 2 songs or more split
    engine = _engine(models, slots=4)
    prefills = []

    def counted(*args):
        prefills.append(args[4])  # the place
        return prefill.prefill(*args)

    monkeypatch.setattr(graph, "prefill", counted)
    first, variation, cancelled = (_start(engine, song) for song in (FIRST, VARIATION, OTHER))
    first_blocks = [next(first)]
    variation_blocks = [next(variation)]
    next(cancelled)  # admitted while both others run: a bucket of 3 (of 4)
    cancelled.close()
    variation_blocks += list(variation)
    first_blocks += list(first)
    _same(first, first_blocks, alone[FIRST])
    _same(variation, variation_blocks, alone[VARIATION])
    assert prefills == [0, 0, 2, 2, 2]  # chunks of 4 tokens; the variation (place 1) copied the first song's prompt
    assert first.stats.peers == 2


def test_a_full_kv_pool_admits_no_song_until_one_leaves(models):
    from music3_demo.semantic.scheduler import PARKING, song_positions

    need = song_positions(FIRST[0], FIRST[2])
    engine = _engine(models, slots=2, pool=need + 3 + PARKING)
    assert engine.can_admit(FIRST[0], FIRST[2])
    first = _start(engine, FIRST)
    next(first)
    assert not engine.can_admit(FIRST[0], FIRST[2])  # a place is free, the pool is not
    assert not engine.can_admit(1, 1)  # (4 positions: 3 are left)
    first.close()
    assert engine.can_admit(FIRST[0], FIRST[2])


def test_a_song_that_runs_out_of_memory_in_its_prefill_frees_its_slot_and_region(models, alone, monkeypatch):
    """An out-of-memory in a round (here the song's prefill, as torch raises it on a full GPU) ends the song; its
    slot and its region of the KV pool are free again and the next song is the same song as alone."""
    from music3_demo.semantic import graph
    from music3_demo.semantic.scheduler import PARKING

    engine = _engine(models, slots=2)
    prefill, calls = graph.prefill, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
        return prefill(*args, **kwargs)

    monkeypatch.setattr(graph, "prefill", failing)
    with pytest.raises(torch.OutOfMemoryError):
        list(_start(engine, VARIATION))
    scheduler = engine.scheduler
    assert not scheduler.busy and engine.occupancy.free() == 2  # no song holds a place
    regions = scheduler.regions
    assert regions.find(regions.positions - PARKING) == PARKING  # the whole pool is free
    assert engine.can_admit(VARIATION[0], VARIATION[2])
    run = _start(engine, VARIATION)  # (the shortest song: every step runs in the interpreter)
    _same(run, list(run), alone[VARIATION])
