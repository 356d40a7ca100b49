"""The browser's history of finished songs: one compact row each, to play in the page's player or reuse the settings.

Entries are plain dicts, newest first, kept in the browser's localStorage (gr.BrowserState, encrypted with a secret
kept beside the songs, so a reload, a closed tab or a restarted server does not lose them). They point at the song's
files in the SongStore; once the cleaner has removed those after the TTL, the row says so instead of offering them.
A row only offers files inside the store's folder: the list comes back from the browser.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import gradio as gr

from .core import Outcome

STORAGE_KEY = "music3-history"
REQUIRED = {"id", "title", "created", "duration_s", "seed", "wav", "flac", "mp3", "settings", "instrumental"}
SECRET_FILE = ".history-secret"


def browser_secret(root: Path) -> str:
    """The key the history is encrypted with in the browser; kept with the songs, so it lives as long as they do."""
    path = root / SECRET_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        secret = secrets.token_urlsafe(24)
        path.write_text(secret)
        return secret


def add_entry(history: list[dict] | None, outcome: Outcome, limit: int) -> list[dict]:
    """The song's row, added once its files are written (or failed: a file that is not there is left out)."""
    report, files = outcome.report, outcome.saved.files
    settings = report["settings"]
    entry = {
        "id": outcome.saved.id,
        "title": _title(settings["description"]),
        "created": outcome.saved.created,
        "duration_s": report["duration_s"],
        "seed": report["seed"],
        "wav": outcome.saved.wav,
        "flac": files.path("flac"),
        "mp3": files.path("mp3"),
        "waveform": files.path("waveform"),
        "settings": settings,
        "instrumental": settings["instrumental"],
    }
    return ([entry] + list(history or []))[:limit]


def files_alive(entry: dict, root: Path) -> bool:
    """Whether the entry's files still exist in the store (and are the store's: never serve another path)."""
    for key in ("wav", "flac", "mp3", "waveform"):
        if key != "wav" and not entry.get(key):
            continue  # a file that was never written (or, for the picture, an entry from before it was kept)
        path = Path(str(entry.get(key, ""))).resolve()
        if not path.is_relative_to(root.resolve()) or not path.is_file():
            return False
    return True


def _title(description: str, limit: int = 80) -> str:
    first = description.strip().splitlines()[0].strip() if description.strip() else "song"
    return first if len(first) <= limit else first[: limit - 1].rstrip() + "…"


def escape_markdown(text: str) -> str:
    """User text shown inside Markdown must not turn into emphasis, links or HTML."""
    return re.sub(r"([\\`*_{}\[\]()#+!<>|~-])", r"\\\1", text)


def _summary(entry: dict, alive: bool) -> str:
    minutes, seconds = divmod(entry["duration_s"], 60)
    made = time.strftime("%d %b %H:%M", time.localtime(entry["created"]))
    kind = "instrumental" if entry["instrumental"] else "song"
    title = escape_markdown(str(entry["title"]))
    line = f"**{title}**  \n{int(minutes)}:{seconds:04.1f} {kind} · seed `{entry['seed']}` · made {made}"
    return line if alive else line + " · *the files have expired on the server*"


def render_history(
    entries: list[dict] | None,
    root: Path,
    settable: list[gr.components.Component],
    values_for: Callable[[dict], tuple],
    player: list[gr.components.Component],
    play: Callable[[dict], tuple],
) -> None:
    """Body of a @gr.render: one compact row per song with "play" (in the page's one player) and "reuse"."""
    if not entries:
        gr.Markdown("Songs you make appear here, newest first, and stay after a reload. The files are kept on the "
                    "server for a limited time: download the ones you keep.", elem_classes="m3-muted")
        return
    for entry in entries:
        if not isinstance(entry, dict) or not REQUIRED <= entry.keys():
            continue  # written by an older version of the page
        alive = files_alive(entry, root)
        with gr.Row(equal_height=True, elem_classes="m3-history-item"):
            gr.Markdown(_summary(entry, alive), elem_classes="m3-history-title")
            if alive:
                listen = gr.Button("▶ Play", size="sm", scale=0, min_width=80, elem_classes="m3-play",
                                   key=f"play-{entry['id']}")
                listen.click(lambda entry=entry: play(entry), outputs=player, queue=False, api_visibility="private")
            reuse = gr.Button("↺ Reuse these settings", size="sm", scale=0, min_width=190,
                              elem_classes="m3-reuse", key=f"reuse-{entry['id']}")
        reuse.click(lambda settings=entry["settings"]: values_for(settings), outputs=settable, queue=False,
                    api_visibility="private")
