"""Per-session history of finished songs: play, download, reuse the settings.

Entries live in the session's gr.State (plain dicts), newest first, and point at the song's files in the SongStore;
once the cleaner has removed those files after the TTL, the entry says so instead of offering a dead player.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import gradio as gr

from .core import Outcome

# The browser's own compact player: a list of songs needs no waveform per row (and it is a real <audio> element).
PLAIN_PLAYER = gr.WaveformOptions(show_recording_waveform=False)


def add_entry(history: list[dict] | None, outcome: Outcome, limit: int) -> list[dict]:
    report = outcome.report
    settings = report["settings"]
    entry = {
        "id": outcome.saved.id,
        "title": _title(settings["description"]),
        "created": outcome.saved.created,
        "duration_s": report["duration_s"],
        "seed": report["seed"],
        "wav": outcome.saved.wav,
        "flac": outcome.saved.flac,
        "mp3": outcome.saved.mp3,
        "settings": settings,
        "instrumental": settings["instrumental"],
    }
    return ([entry] + list(history or []))[:limit]


def _title(description: str, limit: int = 80) -> str:
    first = description.strip().splitlines()[0].strip() if description.strip() else "song"
    return first if len(first) <= limit else first[: limit - 1].rstrip() + "…"


def _escape(text: str) -> str:
    """User text shown inside Markdown must not turn into emphasis, links or HTML."""
    return re.sub(r"([\\`*_{}\[\]()#+!<>|~-])", r"\\\1", text)


def _summary(entry: dict) -> str:
    minutes, seconds = divmod(entry["duration_s"], 60)
    made = time.strftime("%H:%M", time.localtime(entry["created"]))
    kind = "instrumental" if entry["instrumental"] else "song"
    return (f"**{_escape(entry['title'])}**  \n{int(minutes)}:{seconds:04.1f} {kind} · seed `{entry['seed']}` "
            f"· made at {made}")


def render_history(
    entries: list[dict] | None, settable: list[gr.components.Component], values_for: Callable[[dict], tuple]
) -> None:
    """Body of a @gr.render: one row per song, with its player, downloads and a "reuse these settings" button."""
    if not entries:
        gr.Markdown("Songs you make appear here, newest first. They are kept on the server for a limited time.",
                    elem_classes="m3-muted")
        return
    for entry in entries:
        with gr.Group(elem_classes="m3-history-item"):
            with gr.Row(equal_height=True):
                gr.Markdown(_summary(entry), elem_classes="m3-history-title")
                reuse = gr.Button("↺ Reuse these settings", size="sm", scale=0, min_width=190,
                                  elem_classes="m3-reuse", key=f"reuse-{entry['id']}")
            if Path(entry["wav"]).exists():
                with gr.Row(equal_height=True):
                    gr.Audio(entry["wav"], show_label=False, interactive=False, buttons=[], scale=4,
                             waveform_options=PLAIN_PLAYER, key=f"audio-{entry['id']}",
                             elem_classes="m3-history-audio")
                    with gr.Column(scale=1, min_width=120):
                        gr.DownloadButton("⬇ WAV", entry["wav"], size="sm", key=f"wav-{entry['id']}")
                        gr.DownloadButton("⬇ FLAC", entry["flac"], size="sm", key=f"flac-{entry['id']}")
                        gr.DownloadButton("⬇ MP3", entry["mp3"], size="sm", key=f"mp3-{entry['id']}")
            else:
                gr.Markdown("The files of this song have expired on the server.", elem_classes="m3-muted")
        reuse.click(lambda settings=entry["settings"]: values_for(settings), outputs=settable, queue=False,
                    api_visibility="private")
