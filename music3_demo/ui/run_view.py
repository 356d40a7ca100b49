"""The output column of one run: live player, status line, finished song (player, waveform, downloads, report).

`RunView` builds those components and turns what a run produces into page updates, so the page's handler stays a
short loop over the job's items.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass

import gradio as gr
import numpy as np

from .. import contract as c
from ..events import AudioPiece
from ..events import Cancelled
from .core import Outcome, wav_bytes
from .history import PLAIN_PLAYER, add_entry
from .report import report_markdown

IDLE_TEXT = "Press **Generate**: the song starts playing here while it is being made."
WAITING_TEXT = "⏳ Waiting for your turn: the song starts as soon as the model is free."
STOPPED_TEXT = "⏹ Stopped."
# ~1 s stream segments: the player re-reads the playlist about once per longest segment, so a 4 s piece sent whole
# would leave it waiting for seconds between pieces.
STREAM_SEGMENT = c.SAMPLE_RATE
# Gradio's stream encoder keeps the song's last ~0.7 s until the stream is flushed at the end of the run, and the
# browser never fetches that final segment. Two short silences after the last piece push the real tail out in
# segments the player does load; only silence is left for the lost flush.
STREAM_PAD = wav_bytes(np.zeros((2, c.SAMPLE_RATE // 4), dtype=np.float32), c.SAMPLE_RATE)
STREAM_PAD_GAP_S = 0.15


@dataclass
class RunView:
    status: gr.Markdown
    live: gr.Audio
    live_enabled: bool  # streaming playback needs ffmpeg on the server
    result: gr.Group
    final_audio: gr.Audio
    waveform: gr.Image
    wav_button: gr.DownloadButton
    flac_button: gr.DownloadButton
    mp3_button: gr.DownloadButton
    report: gr.Markdown

    def outputs(self) -> list:
        return [self.status, self.live, self.result, self.final_audio, self.waveform, self.wav_button,
                self.flac_button, self.mp3_button, self.report]

    def start(self) -> dict:
        """A new run: the last result is hidden (it lives on in the history) and the old stream goes."""
        return {self.status: "", self.result: gr.update(visible=False), self.live: None}

    def play(self, items: Iterator, history: gr.State, entries: list[dict], limit: int) -> Iterator:
        """Page updates for one run's items (`core.run`'s): the stream, ticks, then the result with the song added
        to the history; a stop says so."""
        yield self.start()
        try:
            with closing(items):
                for item in items:
                    if isinstance(item, AudioPiece):
                        yield from self.piece(item)
                    elif isinstance(item, Outcome):
                        entries = add_entry(entries, item, limit)
                        yield from self.finished(item, also={history: entries})
                    else:
                        yield gr.skip()  # a tick: hands control back so a Stop can close this generator
        except Cancelled:
            yield {self.status: STOPPED_TEXT}

    def piece(self, piece: AudioPiece) -> Iterator[dict]:
        if not self.live_enabled:
            return
        for start in range(0, piece.samples.shape[-1], STREAM_SEGMENT):
            yield {self.live: wav_bytes(piece.samples[:, start:start + STREAM_SEGMENT], c.SAMPLE_RATE)}

    def finished(self, outcome: Outcome, also: dict | None = None) -> Iterator[dict]:
        """The song's tail for the live player, then the result panel (plus the caller's `also` updates)."""
        pad = {self.live: STREAM_PAD} if self.live_enabled else {}
        if pad:
            yield pad
            time.sleep(STREAM_PAD_GAP_S)  # lets the encoder emit the song's tail before the last chunk is taken
        report = outcome.report
        yield pad | (also or {}) | {
            self.status: (f"✅ Finished: a {report['duration_s']:.1f} s song in "
                          f"{report['timings'].get('total_s', 0):.1f} s ({report['realtime_factor']:.2f}× realtime). "
                          "It is also in **Your songs** below."),
            self.result: gr.update(visible=True),
            self.final_audio: outcome.saved.wav,
            self.waveform: outcome.saved.waveform,
            self.wav_button: outcome.saved.wav,
            self.flac_button: outcome.saved.flac,
            self.mp3_button: outcome.saved.mp3,
            self.report: report_markdown(report),
        }


def build_run_view(live_enabled: bool) -> RunView:
    status = gr.Markdown(IDLE_TEXT, elem_id="run-status")
    live = gr.Audio(label="Live (plays while the song is made)", streaming=True, autoplay=True, interactive=False,
                    elem_id="live-audio", visible=live_enabled)
    if not live_enabled:
        gr.Markdown("Live playback needs `ffmpeg` on the server; the song appears when it is finished.",
                    elem_classes="m3-muted")
    with gr.Group(visible=False, elem_id="result") as result:
        final_audio = gr.Audio(label="Finished song", type="filepath", interactive=False, buttons=[],
                               waveform_options=PLAIN_PLAYER, elem_id="result-audio")
        waveform = gr.Image(show_label=False, interactive=False, type="filepath", height=120, elem_id="waveform",
                            buttons=[])
        with gr.Row():
            wav_button = gr.DownloadButton("⬇ Download WAV", elem_id="download-wav", size="md")
            flac_button = gr.DownloadButton("⬇ Download FLAC", elem_id="download-flac", size="md")
            mp3_button = gr.DownloadButton("⬇ Download MP3", elem_id="download-mp3", size="md")
        report = gr.Markdown(elem_id="report")
    return RunView(status, live, live_enabled, result, final_audio, waveform, wav_button, flac_button, mp3_button,
                   report)
