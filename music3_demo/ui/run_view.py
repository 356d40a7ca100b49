"""The output column of one run: status line, progress, one player (live while the song is made, then the finished
song with its waveform, downloads and report).

`RunView` builds those components and turns what a run produces into page updates, so the page's handler stays a
short loop over the job's items. The live player shows only once the first piece exists; when the song is finished
it gives way to the finished player, which page.js starts where the live one was. The finished song's WAV comes
first; its waveform picture and FLAC / MP3 downloads fill in as the store's writer makes them (`files`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import gradio as gr
import numpy as np

from .. import contract as c
from ..events import AudioPiece
from ..request import MAX_VARIATIONS
from .core import Outcome, wav_bytes
from ..serve.song_files import PENDING
from .history import escape_markdown
from .report import report_markdown

IDLE_TEXT = "Press **Generate**: the song starts playing here while it is being made."
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
class VariationCard:
    """One more variation of the request (the first plays in the run's own player): a line saying how it goes, then
    its own player and downloads once it is finished."""

    box: gr.Group
    title: gr.Markdown
    audio: gr.Audio
    downloads: gr.Row
    wav_button: gr.DownloadButton
    flac_button: gr.DownloadButton
    mp3_button: gr.DownloadButton

    def outputs(self) -> list:
        return [self.box, self.title, self.audio, self.downloads, self.wav_button, self.flac_button, self.mp3_button]

    def hidden(self) -> dict:
        return {self.box: gr.update(visible=False), self.audio: gr.update(visible=False),
                self.downloads: gr.update(visible=False)}

    def line(self, number: int, seed: int, text: str) -> dict:
        """While it is made: how it goes (its place in line, its stage)."""
        return {self.title: f"**Variation {number}** · seed `{seed}` · ⏳ {escape_markdown(text)}"}

    def finished(self, number: int, outcome: Outcome) -> dict:
        report, saved = outcome.report, outcome.saved
        return {self.title: (f"**Variation {number}** · seed `{report['seed']}` · ✅ {report['duration_s']:.1f} s, "
                             f"made in {report['timings'].get('total_s', 0):.1f} s"),
                self.audio: gr.update(value=saved.wav, visible=True), self.downloads: gr.update(visible=True),
                self.wav_button: saved.wav} | self.files(outcome)

    def files(self, outcome: Outcome) -> dict:
        """Its downloads as far as they are written."""
        files = outcome.saved.files
        return {self.flac_button: download(files.path("flac")), self.mp3_button: download(files.path("mp3"))}

    def failed(self, number: int, seed: int, message: str) -> dict:
        return {self.title: f"**Variation {number}** · seed `{seed}` · ⚠️ {escape_markdown(message)}"}


@dataclass
class RunView:
    status: gr.Markdown
    progress: gr.HTML  # our own progress block, updated by the handler (total elapsed, ETA)
    queue: gr.HTML  # where Gradio shows the place in its queue while the song waits (hidden once it runs)
    live: gr.Audio
    live_box: gr.Column  # kept in the page while hidden, so the stream's player survives between runs
    live_enabled: bool  # streaming playback needs ffmpeg on the server
    result: gr.Group
    final_audio: gr.Audio
    waveform: gr.Image
    wav_button: gr.DownloadButton
    flac_button: gr.DownloadButton
    mp3_button: gr.DownloadButton
    report: gr.Markdown
    cards: list[VariationCard]  # variations 2..MAX_VARIATIONS

    def outputs(self) -> list:
        return [self.status, self.progress, self.queue, self.live, self.live_box, self.result, self.final_audio,
                self.waveform, self.wav_button, self.flac_button, self.mp3_button, self.report,
                *(component for card in self.cards for component in card.outputs())]

    def start(self) -> dict:
        """A new run: the last result is hidden (it lives on in the history) and so is the old stream's player. The
        status line keeps what the click said until the song's place in line is known (the run then updates it)."""
        # The live player is not touched here: a value (even None) opens an empty stream, which the player then
        # polls for segments until the first piece (or forever, when the song is stopped before one).
        return {self.queue: gr.update(visible=False), self.result: gr.update(visible=False),
                self.live_box: gr.update(visible="hidden")} | {key: value for card in self.cards
                                                               for key, value in card.hidden().items()}

    def show_song(self, wav: str, flac: str | None, mp3: str | None, waveform: str | None, report: str = "") -> dict:
        """The one player shows this song (the one just made, or one picked from the history); a file that is not
        written (yet) leaves its download greyed out."""
        return {self.result: gr.update(visible=True), self.final_audio: wav, self.waveform: waveform,
                self.wav_button: wav, self.flac_button: download(flac), self.mp3_button: download(mp3),
                self.report: report}

    def files(self, outcome: Outcome) -> dict:
        """The finished song's picture and downloads as far as they are written."""
        files = outcome.saved.files
        return {self.waveform: files.path("waveform"), self.flac_button: download(files.path("flac")),
                self.mp3_button: download(files.path("mp3"))}

    def song_outputs(self) -> list:
        """What play_entry() fills in, in its order."""
        return [self.status, self.progress, self.live_box, self.result, self.final_audio, self.waveform,
                self.wav_button, self.flac_button, self.mp3_button, self.report]

    def play_entry(self, entry: dict) -> tuple:
        """A song from the history, in the one player (a running song's live player stays where it is)."""
        song = self.show_song(entry["wav"], entry["flac"], entry["mp3"], entry.get("waveform"),
                              f"Seed `{entry['seed']}` · {entry['duration_s']:.1f} s")
        status = f"▶ From your songs: “{escape_markdown(str(entry['title']))}”."
        return (status, gr.skip(), gr.skip(), *(song[component] for component in self.song_outputs()[3:]))

    def piece(self, piece: AudioPiece) -> Iterator[dict]:
        if not self.live_enabled:
            return
        for start in range(0, piece.samples.shape[-1], STREAM_SEGMENT):
            # The live player shows from the first piece on (before it there is nothing to play).
            yield {self.live: wav_bytes(piece.samples[:, start:start + STREAM_SEGMENT], c.SAMPLE_RATE),
                   self.live_box: gr.update(visible=True)}

    def finished(self, outcome: Outcome, also: dict | None = None) -> Iterator[dict]:
        """The song's tail for the live player, then the result panel (plus the caller's `also` updates)."""
        pad = {self.live: STREAM_PAD} if self.live_enabled else {}
        if pad:
            yield pad
            time.sleep(STREAM_PAD_GAP_S)  # lets the encoder emit the song's tail before the last chunk is taken
        report, files = outcome.report, outcome.saved.files
        yield pad | (also or {}) | {
            self.status: finished_text(report, files.settled),
            self.progress: "",
            self.live_box: gr.update(visible="hidden"),  # one player: the finished one takes over (page.js)
        } | self.show_song(outcome.saved.wav, files.path("flac"), files.path("mp3"), files.path("waveform"),
                           report_markdown(report))


class FilesToCome:
    """A run's finished songs whose other files (picture, FLAC, MP3, state) are still being written: which of them
    have more to show since last asked, and which are done (then the song joins the history)."""

    def __init__(self) -> None:
        self._songs: dict[int, tuple[Outcome, tuple]] = {}  # index -> (its outcome, the files shown so far)

    def add(self, index: int, outcome: Outcome) -> None:
        self._songs[index] = (outcome, ("wav",))

    def __bool__(self) -> bool:
        return bool(self._songs)

    def wait(self, timeout: float) -> None:
        """Until the first song's files are all written, at most `timeout` (the caller then asks `arrived`)."""
        if self._songs:
            next(iter(self._songs.values()))[0].saved.files.wait(timeout=timeout)

    def take_all(self) -> list[Outcome]:
        """The songs still waiting for files, no longer followed (a stopped run adds them to the history as they
        are)."""
        outcomes = [outcome for outcome, _ in self._songs.values()]
        self._songs.clear()
        return outcomes

    def arrived(self) -> Iterator[tuple[int, Outcome, bool]]:
        """(index, outcome, done) for each song with a file written (or failed) since the last call."""
        for index, (outcome, shown) in list(self._songs.items()):
            files = outcome.saved.files
            done = files.settled  # read first: a file written after it is shown at the next call
            now = tuple(kind for kind in files.paths if files.state(kind) != PENDING)
            if now != shown or done:
                if done:
                    del self._songs[index]
                else:
                    self._songs[index] = (outcome, now)
                yield index, outcome, done


def finished_text(report: dict, saved: bool) -> str:
    """The status line of a finished song: said before its other files are written, then once they are."""
    text = (f"✅ Finished: a {report['duration_s']:.1f} s song in {report['timings'].get('total_s', 0):.1f} s "
            f"({report['realtime_factor']:.2f}× realtime). ")
    return text + ("It is also in **Your songs** below." if saved else
                   "The FLAC and MP3 follow in a moment; then the song joins **Your songs** below.")


def download(path: str | None) -> dict:
    """A download button for a file, greyed out while there is none."""
    return gr.update(value=path, interactive=path is not None)


def build_run_view(live_enabled: bool) -> RunView:
    queue = gr.HTML("", elem_id="run-queue", visible=False)
    status = gr.Markdown(IDLE_TEXT, elem_id="run-status")
    progress = gr.HTML("", elem_id="run-progress")
    with gr.Column(visible="hidden", elem_id="live-box") as live_box:
        live = gr.Audio(label="Live: plays while the song is made", streaming=True, autoplay=True,
                        interactive=False, elem_id="live-audio", visible=live_enabled)
    if not live_enabled:
        gr.Markdown("Live playback needs `ffmpeg` on the server; the song appears when it is finished.",
                    elem_classes="m3-muted")
    with gr.Group(visible=False, elem_id="result") as result:
        # The browser's own player (exact lengths, compact); the waveform picture is the song's overview.
        final_audio = gr.Audio(label="Your song", type="filepath", interactive=False, buttons=[],
                               waveform_options=gr.WaveformOptions(show_recording_waveform=False),
                               elem_id="result-audio")
        waveform = gr.Image(show_label=False, interactive=False, type="filepath", height=100, elem_id="waveform",
                            buttons=[])
        with gr.Row():
            wav_button = gr.DownloadButton("⬇ Download WAV", elem_id="download-wav", size="md")
            flac_button = gr.DownloadButton("⬇ Download FLAC", elem_id="download-flac", size="md")
            mp3_button = gr.DownloadButton("⬇ Download MP3", elem_id="download-mp3", size="md")
        report = gr.Markdown(elem_id="report")
    cards = [_variation_card(number) for number in range(2, MAX_VARIATIONS + 1)]
    return RunView(status, progress, queue, live, live_box, live_enabled, result, final_audio, waveform, wav_button,
                   flac_button, mp3_button, report, cards)


def _variation_card(number: int) -> VariationCard:
    with gr.Group(visible=False, elem_id=f"variation-{number}", elem_classes="m3-variation") as box:
        title = gr.Markdown(elem_classes="m3-variation-title")
        # The browser's own player, as the first song's (a compact row each, exact lengths).
        audio = gr.Audio(label=f"Variation {number}", type="filepath", interactive=False, buttons=[], visible=False,
                         waveform_options=gr.WaveformOptions(show_recording_waveform=False),
                         elem_id=f"variation-{number}-audio")
        with gr.Row(visible=False) as downloads:
            wav = gr.DownloadButton("⬇ WAV", size="sm", elem_classes="m3-variation-download")
            flac = gr.DownloadButton("⬇ FLAC", size="sm", elem_classes="m3-variation-download")
            mp3 = gr.DownloadButton("⬇ MP3", size="sm", elem_classes="m3-variation-download")
    return VariationCard(box, title, audio, downloads, wav, flac, mp3)
