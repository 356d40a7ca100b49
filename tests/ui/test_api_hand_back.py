"""The API's generators give control back at most every HAND_BACK_S while a song runs: every hand-back is a skip()
that Gradio answers on the event loop by rebuilding the output components' configs, so one per tick per song stood
the whole server still with 8 songs running. Results still come the moment they exist."""

from __future__ import annotations

import math
from types import SimpleNamespace

import gradio as gr
import numpy as np

from music3_demo.events import AudioPiece
from music3_demo.ui.api import HAND_BACK_S, api_results, variation_results
from music3_demo.ui.core import Failed, Outcome

TICK_S = 0.25  # about core.run's tick (0.2 s; a quarter keeps the fake clock's sums exact)
PER_HAND_BACK = math.ceil(HAND_BACK_S / TICK_S)  # items between two hand-backs


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def outcome(name: str) -> Outcome:
    return Outcome(song=None, saved=SimpleNamespace(wav=f"{name}.wav"), report={"song": name})


def ticking(clock: Clock, items: list):
    for item in items:
        clock.now += TICK_S
        yield item


def test_one_song_hands_back_once_a_second_and_returns_its_result_at_once():
    clock = Clock()
    piece = AudioPiece(np.zeros((2, 4), np.float32), 0)
    running = [None, piece] * 20  # 10 s of a song at one item per tick
    yields = list(api_results(ticking(clock, running + [outcome("a")]), clock))
    skips = [y for y in yields if y == (gr.skip(), gr.skip())]
    assert yields[-1] == ("a.wav", {"song": "a"})
    assert len(skips) == len(running) // PER_HAND_BACK  # 20 in 10 s, not one per item (40)


def test_variations_arrive_each_as_it_ends_with_hand_backs_throttled_between():
    clock = Clock()
    items = [(0, None)] * 12 + [(1, outcome("first"))] + [(0, Failed("no room"))] + [(0, None)] * 12 + \
            [(2, outcome("second"))]
    yields = list(variation_results(ticking(clock, items), clock))
    results = [y for y in yields if y != (gr.skip(), gr.skip())]
    assert [wav for wav, _ in results] == ["first.wav", "second.wav"]
    assert results[1][1]["failed_variations"] == [{"variation": 1, "error": "no room"}]
    ticks = sum(1 for _, item in items if item is None)
    assert len(yields) - len(results) == ticks // PER_HAND_BACK  # 12, not one per tick (24)
