"""The graph engine's batch on the tiny model under Triton's interpreter (issue 16): a song's codes and frames are
the same alone and batched (joining mid-song, beside a variation that copies its prompt's K/V, beside a song that
is cancelled, with the depth decoder's first pass split as for 8 songs), and a full KV pool admits no one. Few,
short songs: every step of every song runs every kernel in the interpreter."""

from __future__ import annotations

import kernel_cases  # noqa: F401 - first: checks Triton's interpreter is on
import pytest
import torch

from music3_demo.semantic import SamplingSettings

# (prompt tokens, prompt seed, frames, settings, seed): different prompt lengths, settings and seeds; the variation
# has the first song's prompt.
FIRST = (6, 1, 4, SamplingSettings(), 11)
OTHER = (9, 2, 2, SamplingSettings(cfg_scale=2.0, top_k=7), 12)
VARIATION = (6, 1, 2, SamplingSettings(top_k=5), 13)


def _engine(models, slots: int, pool: int | None = None):
    from music3_demo.semantic.config import GraphConfig
    from music3_demo.semantic.graph import GraphEngine

    config = GraphConfig(replay_block=1, in_flight=0, frame_ring=2, attention_splits=2, slots=slots)
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
def models():
    """The tiny model cut to one LM block and one depth block: every kernel still runs, at half the interpreter's
    time per step."""
    import dataclasses

    from music3_demo import random_models

    sizes = dataclasses.replace(random_models.TINY, lm_layers=1, depth_layers=1)
    components = random_models.build_components(sizes, seed=0)
    return components["language_model"], components["rvq_depth_decoder"]


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


def test_variation_and_cancelled_song_beside_a_song(models, alone, monkeypatch):
    """Three songs in a bucket of 4 with the depth decoder's first pass split in two (as 8 songs run it): the
    variation copies the first song's prompt K/V instead of a prefill, the third song is cancelled (closed) after
    its first frame."""
    from music3_demo.semantic import graph, state, step

    monkeypatch.setattr(step, "FUSED_FIRST_PASS_ROWS", 4)  # one song's 4 rows fuse; 2 songs or more split
    engine = _engine(models, slots=4)
    prefills = []

    def counted(*args):
        prefills.append(args[3])  # the slot
        return state.prefill(*args)

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
    assert prefills == [0, 2]  # the variation (slot 1) copied the first song's prompt instead of a prefill
    assert first.stats.peers == 2


def test_a_full_kv_pool_admits_no_song_until_one_leaves(models):
    from music3_demo.semantic.state import PARKING, song_positions

    need = song_positions(FIRST[0], FIRST[2])
    engine = _engine(models, slots=2, pool=need + 3 + PARKING)
    assert engine.can_admit(FIRST[0], FIRST[2])
    first = _start(engine, FIRST)
    next(first)
    assert not engine.can_admit(FIRST[0], FIRST[2])  # a slot is free, the pool is not
    assert not engine.can_admit(1, 1)  # (4 positions: 3 are left)
    first.close()
    assert engine.can_admit(FIRST[0], FIRST[2])
