""""Continue this song": extend one of the session's songs by some seconds, with optional words for the added part.

A panel under the history (pick the song, the seconds, the new lyrics) and the `continue` API endpoint. The song's
saved state (`continuation.SongState`, kept with its files under the same TTL) is the forced prefix; the run streams
into the page's run view (the song so far plays at once) and lands in the history as a new song.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import gradio as gr

from .. import contract as c
from ..continuation import check_continuation, extension_request
from ..request import InvalidRequest
from .api import RANDOM_SEED, api_results
from .core import INVALID_TITLE, AppContext, check, run

DEFAULT_SECONDS = 30.0
LYRICS_HELP = ("Words for the added part, with section tags if you like; they follow the song's own lyrics in the "
               "prompt. Leave empty to let the song go on with its lyrics as they are.")


def prepare(ctx: AppContext, song_id: object, seconds: object, lyrics: object,
            seed: object = None) -> tuple:
    """(the request, the song's state) for extending a stored song, or gr.Error with one sentence."""
    if not isinstance(song_id, str) or not song_id:
        raise gr.Error("Pick one of your songs to continue first.", title=INVALID_TITLE)
    try:
        state = ctx.store.load_state(song_id)
        request = check(ctx.backend, extension_request(state, seconds, lyrics if isinstance(lyrics, str) else "",
                                                      seed))
        check_continuation(request, state)
    except (InvalidRequest, ValueError) as error:
        raise gr.Error(str(error), title=INVALID_TITLE) from None
    return request, state


def song_choices(entries: list[dict] | None) -> dict:
    """The dropdown's songs: the session's history, newest first (selected)."""
    choices = [(f"{entry['title']} · {entry['duration_s']:.0f} s · seed {entry['seed']}", entry["id"])
               for entry in entries or []]
    return gr.update(choices=choices, value=choices[0][1] if choices else None)


@dataclass
class ContinuePanel:
    song: gr.Dropdown
    seconds: gr.Slider
    lyrics: gr.Textbox
    button: gr.Button


def build_continue_panel() -> ContinuePanel:
    """The panel's components, placed where it is called (under the history)."""
    with gr.Accordion("➕ Continue a song", open=False, elem_id="continue"):
        song = gr.Dropdown(label="Song", choices=[], elem_id="continue-song")
        seconds = gr.Slider(c.MIN_DURATION_S, c.MAX_DURATION_S - c.MIN_DURATION_S, value=DEFAULT_SECONDS, step=1,
                            label="Seconds to add", elem_id="continue-seconds")
        lyrics = gr.Textbox(label="Lyrics of the added part (optional)", info=LYRICS_HELP, lines=4, max_lines=20,
                            elem_id="continue-lyrics")
        button = gr.Button("➕ Continue this song", variant="secondary", elem_id="continue-button")
    return ContinuePanel(song, seconds, lyrics, button)


def wire_continue_panel(ctx: AppContext, panel: ContinuePanel, history: gr.State, outputs: list,
                        busy: tuple[list, Callable[[], tuple]], play: Callable[..., Iterator], concurrency_id: str,
                        concurrency: int) -> object:
    """The panel follows the history and streams its run through the page's `play(request, clicked_at, entries,
    session, continue_from)` into `outputs`. `busy` is the page's (outputs, function) that marks a run as started
    (Generate disabled, Stop shown). Returns the run's event, for Stop."""
    history.change(song_choices, history, panel.song, queue=False, show_progress="hidden", api_visibility="private")

    def check_first(song_id: str, added: float, words: str) -> tuple:
        prepare(ctx, song_id, added, words)  # a refusal before queueing, not after a wait
        return busy[1]()

    def extend(song_id: str, added: float, words: str, entries: list[dict], request: gr.Request) -> Iterator:
        clicked_at = time.time()
        song_request, state = prepare(ctx, song_id, added, words)
        yield from play(song_request, clicked_at, entries, request.session_hash, state)

    inputs = [panel.song, panel.seconds, panel.lyrics]
    return panel.button.click(check_first, inputs, busy[0], queue=False, show_progress="hidden",
                              api_visibility="private").success(
        extend, [*inputs, history], [*outputs, history], concurrency_id=concurrency_id,
        concurrency_limit=concurrency, show_progress="minimal", trigger_mode="always_last",  # as the page's run
        api_visibility="private")


def add_continue_api(ctx: AppContext, concurrency_id: str, concurrency: int) -> None:
    """`continue(song_id, seconds, lyrics, seed)` -> (the WAV file, the report): `song_id` is a report's."""

    def extend(song_id: str, seconds: float, lyrics: str, seed: float | None,
               progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:
        """Extend a song made on this server (its report's song_id, while its files live) by `seconds`; `lyrics`
        are the added part's words (optional); seed -1 picks a random one."""
        request, state = prepare(ctx, song_id, seconds, lyrics, None if seed in (None, RANDOM_SEED) else seed)
        yield from api_results(run(ctx, request, None, progress, continue_from=state))

    with gr.Column(visible=False):
        inputs = [gr.Textbox(label="song_id"), gr.Number(label="seconds", value=DEFAULT_SECONDS),
                  gr.Textbox(label="lyrics"), gr.Number(label="seed", value=RANDOM_SEED)]
        outputs = [gr.Audio(label="audio", type="filepath"), gr.JSON(label="report")]
        trigger = gr.Button("continue")
    trigger.click(extend, inputs, outputs, api_name="continue", concurrency_id=concurrency_id,
                  concurrency_limit=concurrency)

