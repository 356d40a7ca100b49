"""Several songs on one engine at once: the reference engine's concurrent callers, the slot limit, a run's
codes and statistics. The graph engine's batch is tested in test_batch.py."""

from __future__ import annotations

import threading

import pytest
import torch

from music3_demo.semantic import EngineBusy, SamplingSettings

SETTINGS = (SamplingSettings(), SamplingSettings(cfg_scale=2.0, top_k=7), SamplingSettings(top_k=3))


def _prompt(tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 250, (2, tokens), generator=torch.Generator().manual_seed(seed))


def _song(engine, index: int, frames: int = 4):
    run = engine.frames(_prompt(5 + 3 * index, index), frames, SETTINGS[index], torch.Generator().manual_seed(index))
    return torch.cat(list(run)), run


def test_reference_engine_concurrent_callers_make_the_songs_they_make_alone(tiny_models):
    from music3_demo.semantic.reference import ReferenceEngine

    engine = ReferenceEngine(*tiny_models, slots=3)
    alone = [_song(engine, index) for index in range(3)]
    assert all(run.stats.peers == 0 for _, run in alone)
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def sing(index: int) -> None:
        try:
            start.wait()
            results[index] = _song(engine, index)
        except BaseException as error:  # noqa: BLE001 - checked on the test's thread
            errors.append(error)

    threads = [threading.Thread(target=sing, args=(index,)) for index in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for index, (frames, run) in enumerate(alone):
        together, together_run = results[index]
        assert torch.equal(together, frames)
        assert torch.equal(together_run.codes(), run.codes())
        assert together_run.codes().shape == (5, 8) and together_run.stats.frames == 4
    assert max(results[index][1].stats.peers for index in range(3)) >= 1  # they did overlap


def test_a_song_beyond_the_engines_slots_is_refused_and_a_closed_run_frees_its_slot(tiny_models):
    from music3_demo.semantic.reference import ReferenceEngine

    engine = ReferenceEngine(*tiny_models, slots=1)
    assert engine.slots == 1 and engine.can_admit(10, 10)
    first = engine.frames(_prompt(5, 0), 6, SETTINGS[0], torch.Generator().manual_seed(0))
    next(first)  # the song has started: it holds the slot
    assert not engine.can_admit(10, 10)
    with pytest.raises(EngineBusy, match="already runs 1 song at once"):
        list(engine.frames(_prompt(5, 1), 2, SETTINGS[0], torch.Generator()))
    with pytest.raises(RuntimeError, match="has not finished"):
        first.codes()
    first.close()
    assert engine.can_admit(10, 10)
    assert _song(engine, 1)[1].stats.peers == 0
