"""The Gradio page: layout and the wiring between controls, the running job, results and history.

Generate runs in two events. `prepare` (instant, outside the queue) checks the request with validate() and either
shows the refusal next to the button or hands the validated request to the `ticket` state and names it in `run_id`;
then a line of JS clicks the hidden `start-run` button, whose queued event is `generate`. A refusal is a normal
return, not a gr.Error: Gradio shows no errors of events outside the queue (and a State's change does not fire from
them either, hence the hidden buttons). Stop sets the running job's cancel flag and lets the handler end normally
("Stopped", never an error badge); only a song still waiting in the queue is cancelled through Gradio, by the hidden
`cancel-queued` button.
"""

from __future__ import annotations

import html
import secrets
import time
from collections.abc import Iterator
from contextlib import closing
from functools import partial

import gradio as gr

from ..events import AudioPiece, Cancelled
from ..request import GenerationRequest, check_variations, variation_requests
from . import assets
from .admission import refusal_message
from .api import GPU_GROUP, add_api
from .controls import (
    CARET_TRACKER_JS,
    FIELD_NAMES_JS,
    build_controls,
    insert_tag_js,
    new_seed,
    reset_targets,
    reset_values,
    settings_values,
    token_counter_markdown,
)
from .continue_view import add_continue_api, build_continue_panel, wire_continue_panel
from .core import AppContext, Failed, Outcome, check, make_request, run_songs, whole
from .history import STORAGE_KEY, add_entry, browser_secret, render_history
from .sessions import keep_sessions_bounded
from .progress import StageTracker, _seconds
from .run_view import STOPPED_TEXT, FilesToCome, build_run_view, finished_text

GENERATE_LABEL = "🎵 Generate"
def launch_options() -> dict:
    """What Gradio 6 takes at launch() rather than in Blocks(): theme, CSS, extra <head>."""
    return {"theme": gr.themes.Soft(primary_hue="indigo", secondary_hue="pink"), "css": assets.read_text("style.css"),
            "head": CARET_TRACKER_JS + FIELD_NAMES_JS + f"<script>{assets.read_text('page.js')}</script>"}


def refusal_html(sentence: str) -> str:
    return f'<div class="m3-refusal" role="alert">⚠️ {html.escape(sentence)}</div>'


def build_ui(ctx: AppContext, concurrency: int | None = None) -> gr.Blocks:
    """`concurrency`: Gradio's limit on songs handled at once (None: every admitted song's handler runs and waits in
    the backend's line, which shows its place; ZeroGPU sets one per device)."""
    backend = ctx.backend
    # No delete_cache: the song store is the app's Gradio cache and its cleaner owns every file's lifetime.
    with gr.Blocks(title="MiniMax Music 3") as demo:
        gr.Markdown(assets.read_text("header.md"), elem_id="header")
        banner = gr.HTML(assets.banner_html(backend.status()), elem_id="banner")
        banner_timer = gr.Timer(1.0)
        with gr.Row(equal_height=False):
            with gr.Column(scale=5, min_width=360, elem_id="form"):
                controls = build_controls()
            with gr.Column(scale=6, min_width=360):
                with gr.Column(elem_id="action-bar"):
                    with gr.Row():
                        generate_button = gr.Button(GENERATE_LABEL, variant="primary", size="lg", scale=3,
                                                    elem_id="generate")
                        stop_button = gr.Button("⏹ Stop", variant="stop", size="lg", scale=1, visible=False,
                                                elem_id="stop")
                    refusal = gr.HTML("", elem_id="refusal")
                view = build_run_view(ctx.live_audio)
                history = gr.BrowserState([], storage_key=STORAGE_KEY, secret=browser_secret(ctx.store.root))
                with gr.Accordion("Your songs", open=True, elem_id="history"):

                    # Only on change: the browser's stored value arrives as a change on every page load, so the
                    # default load trigger would render the list twice and a click between the two could be lost.
                    @gr.render(inputs=[history], triggers=[history.change])
                    def _history(entries: list[dict]) -> None:
                        render_history(entries, ctx.store.root, controls.settable(), settings_values,
                                       view.song_outputs(), view.play_entry)

                continue_panel = build_continue_panel()

        examples = assets.load_examples()
        gr.Examples(
            examples=[[e.description, e.lyrics, e.duration, e.instrumental] for e in examples],
            inputs=[controls.description, controls.lyrics, controls.duration, controls.instrumental],
            example_labels=[e.label for e in examples],
            label="Examples: click one to fill in the form",
            examples_per_page=12,
            elem_id="examples",
        )
        gr.Markdown(assets.footer_markdown(), elem_id="licence")
        add_api(ctx, concurrency)
        add_continue_api(ctx, GPU_GROUP, concurrency)
        ticket = gr.State(None)  # the validated request of the latest accepted click
        run_id = gr.Textbox(visible="hidden", elem_id="run-id")  # set when a click was accepted, else ""
        start_run = gr.Button("start", visible="hidden", elem_id="start-run")
        cancel_id = gr.Textbox(visible="hidden", elem_id="cancel-id")  # set when Stop finds the song still queued
        cancel_queued = gr.Button("cancel", visible="hidden", elem_id="cancel-queued")

        # ---- model banner: polled while a load is pending, refreshed on page load and after every run ----------
        def refresh_banner() -> tuple:
            state = backend.status()
            return assets.banner_html(state), gr.Timer(active=state.state in ("loading", "idle"))

        banner_timer.tick(refresh_banner, None, [banner, banner_timer], queue=False, show_progress="hidden",
                          api_visibility="private")
        demo.load(refresh_banner, None, [banner, banner_timer], queue=False, show_progress="hidden",
                  api_visibility="private")
        # Gradio 6.31 draws a Column built with visible="hidden" as shown until an update hides it: without this the
        # page opens with an empty live player. (Hidden, not removed: the stream's player must stay in the page.)
        async def page_opened() -> dict:  # a coroutine: on the server's loop, which then sweeps idle sessions
            keep_sessions_bounded(demo)
            return gr.update(visible="hidden")

        demo.load(page_opened, None, view.live_box, queue=False, show_progress="hidden", api_visibility="private")

        # ---- controls ---------------------------------------------------------------------------------------
        count_inputs = [controls.description, controls.lyrics, controls.instrumental]
        gr.on([controls.description.change, controls.lyrics.change, controls.instrumental.change, demo.load],
              partial(token_counter_markdown, backend), count_inputs, controls.token_counter,
              queue=False, show_progress="hidden", trigger_mode="always_last", api_visibility="private")
        controls.instrumental.change(
            lambda on: [gr.update(interactive=not on)] * (1 + len(controls.tag_buttons)), controls.instrumental,
            [controls.lyrics, *controls.tag_buttons], queue=False, show_progress="hidden", api_visibility="private")
        for button, tag in zip(controls.tag_buttons, assets.SECTION_TAGS, strict=True):
            button.click(None, controls.lyrics, controls.lyrics, js=insert_tag_js(tag), api_visibility="private")
        controls.dice.click(lambda: (new_seed(), False), None, [controls.seed, controls.random_seed], queue=False,
                            api_visibility="private")
        controls.reset.click(reset_values, None, reset_targets(controls), queue=False, api_visibility="private")

        # ---- generate / stop --------------------------------------------------------------------------------
        def prepare(description: str, lyrics: str, duration: float, guidance_scale: float, num_steps: float,
                    seed: float | None, lm_cfg_scale: float, top_k: float, instrumental: bool,
                    random_seed: bool, variations: int) -> tuple:
            """Instant check before queueing: a bad input gets its sentence at once, not after other people's songs."""
            if random_seed:
                seed = new_seed()
            try:
                request = check(backend, make_request(description, lyrics, duration, guidance_scale, num_steps, seed,
                                                     lm_cfg_scale, top_k, instrumental))
            except gr.Error as error:
                return (gr.skip(),) * 5 + (refusal_html(error.message), gr.skip(), "")
            busy = refusal_message(ctx, demo, (description, lyrics, duration, guidance_scale, num_steps, request.seed,
                                               lm_cfg_scale, top_k, instrumental), variations)
            if busy is not None:  # the queue of songs or the disk is full: the same sentence the API gets
                return (gr.skip(),) * 5 + (refusal_html(busy[1]), gr.skip(), "")
            count = check_variations(whole(variations))
            return (request.seed, gr.update(interactive=False, value="Generating…"), gr.update(visible=True),
                    waiting_text(request, count), gr.update(visible=True, value=""), "",
                    {"at": time.time(), "request": request.as_dict(), "variations": count}, secrets.token_hex(8))

        def waiting_text(request: GenerationRequest, count: int) -> str:
            """What the user is told before the song starts: the songs ahead in line and when theirs should start,
            from the speeds the backend measured (the progress line then follows its place as it moves)."""
            ahead = backend.scheduler.waiting()
            start = backend.start_in(backend.ticket(request))
            own = backend.estimate_s(request.max_frames, request.num_steps)
            songs = "your song" if count == 1 else f"your {count} variations"
            if not ahead and start == 0:
                text = f"⏳ Starting {songs}"
            else:
                text = "⏳ Waiting for your turn"
                text += f": {ahead} song{'s' if ahead > 1 else ''} ahead" if ahead else ""
                text += f", starting in about {_seconds(start)}" if start is not None else ""
            return text + (f"; each should take about {_seconds(own)} once it starts." if own is not None else ".")

        def generate(ticket_value: dict | None, entries: list[dict], request: gr.Request):
            if not ticket_value:
                return
            song_request = check(backend, GenerationRequest(**ticket_value["request"]))
            requests = variation_requests(song_request, ticket_value.get("variations", 1))
            yield from play(requests, ticket_value["at"], entries, request.session_hash)

        def play(song_requests: GenerationRequest | list[GenerationRequest], clicked_at: float, entries: list[dict],
                 session: str | None, continue_from=None):
            """Page updates for one run (a new song, its variations, or `continue_from`'s extension): the first
            song streams with the page's own progress, then shows as the result; each further variation gets its own
            card, with its own player once it is finished; every song joins the history as it finishes; a stop says
            so."""
            requests = song_requests if isinstance(song_requests, list) else [song_requests]
            added = continue_from.seconds if continue_from is not None else 0.0
            speed = backend.speed()
            trackers = [StageTracker(r.duration + added, r.num_steps, speed=speed) for r in requests]
            running = set(range(len(requests)))
            status_shown = [None]  # the status line this run last set (None: still the click's sentence)

            def progress_updates() -> dict:
                """The progress block follows the first song still running; each other running one, its card. The
                status line says while the first song waits for a device (its place, its expected start)."""
                lead = trackers[min(running)] if running else trackers[0]
                updates = {view.progress: lead.page_html(time.time() - clicked_at)}
                status = trackers[0].status_text() if 0 in running else None
                if status is not None and status != status_shown[0]:
                    updates[view.status] = status_shown[0] = status
                for index in running - {0}:
                    updates |= view.cards[index - 1].line(index + 1, requests[index].seed,
                                                          trackers[index].description(semantic_eta=False))
                return updates

            to_come = FilesToCome()  # finished songs whose downloads and picture are still being written

            def filled_in() -> Iterator[dict]:
                """Updates for the files written since the last look; a song joins the history once all are."""
                nonlocal entries
                for index, outcome, done in to_come.arrived():
                    update = view.files(outcome) if index == 0 else view.cards[index - 1].files(outcome)
                    if done:
                        entries = add_entry(entries, outcome, ctx.history_limit)
                        update[history] = entries
                        if index == 0 and len(requests) == 1:
                            update[view.status] = finished_text(outcome.report, True)
                    yield update

            yield view.start() | progress_updates() | {card.box: gr.update(visible=True)
                                                       for card in view.cards[: len(requests) - 1]}
            try:
                with closing(run_songs(ctx, requests, session, _no_progress, trackers, continue_from)) as items:
                    for index, item in items:
                        if ctx.registry.stopped(session):
                            # Ends the handler now (closing the run sets the cancel flag again): the worker may
                            # still be loading the model and notices only after that, but the page is free. Songs
                            # already made join the history now, with the files written so far.
                            made = to_come.take_all()
                            for outcome in made:
                                entries = add_entry(entries, outcome, ctx.history_limit)
                            yield {view.status: STOPPED_TEXT, view.progress: ""} | ({history: entries} if made else {})
                            return
                        if isinstance(item, (Outcome, Failed)):
                            running.discard(index)
                        if isinstance(item, Outcome):  # its WAV: the other files fill in as they are written
                            to_come.add(index, item)
                            if index == 0:
                                yield from view.finished(item)
                            else:
                                yield view.cards[index - 1].finished(index + 1, item)
                        elif isinstance(item, Failed) and index == 0:
                            yield {view.status: f"⚠️ Variation 1 (seed `{requests[0].seed}`): {item.message}"}
                        elif isinstance(item, Failed):
                            yield view.cards[index - 1].failed(index + 1, requests[index].seed, item.message)
                        else:
                            pieces = list(view.piece(item)) if isinstance(item, AudioPiece) and index == 0 else []
                            for update in pieces[:-1]:
                                yield update
                            yield (pieces[-1] if pieces else {}) | progress_updates()
                        yield from filled_in()
                if to_come:
                    # Every song is made: nothing is left to stop (a Stop now would cancel this handler, and with
                    # it the history rows still to come), so the button goes while the last files are written.
                    yield {stop_button: gr.update(visible=False)}
                while to_come:
                    to_come.wait(timeout=ctx.tick)
                    yield from filled_in()
                if len(requests) > 1:
                    yield {view.progress: "", view.status: f"✅ {len(requests)} variations made: each has its own "
                                                           "player here and a row in **Your songs** below."}
            except Cancelled:
                yield {view.status: STOPPED_TEXT, view.progress: ""}

        def stop(request: gr.Request) -> tuple:
            # Direct, so the worker stops at its next frame; the handler then ends normally with "Stopped".
            running = ctx.registry.stop(request.session_hash)
            return (STOPPED_TEXT, "", gr.update(visible=False), gr.update(interactive=True, value=GENERATE_LABEL),
                    gr.update(visible=False), "" if running else secrets.token_hex(8))

        def restore() -> tuple:
            return gr.update(interactive=True, value=GENERATE_LABEL), gr.update(visible=False)

        generate_button.click(
            prepare, [*controls.request_inputs(), controls.random_seed, controls.variations],
            [controls.seed, generate_button, stop_button, view.status, view.queue, refusal, ticket, run_id],
            queue=False, show_progress="hidden", api_visibility="private",
        ).then(None, run_id, None, js=click_if_set("start-run"), api_visibility="private")
        # "always_last": Stop gives Generate back before the stopped run's handler has ended; a run asked for in
        # between starts once it has (Gradio's default, "once", drops a trigger of an event still pending).
        run_event = start_run.click(
            generate, [ticket, history], [*view.outputs(), history, stop_button],
            concurrency_id=GPU_GROUP, concurrency_limit=concurrency, show_progress="minimal",
            show_progress_on=[view.queue], trigger_mode="always_last", api_visibility="private",
        )
        busy = ([generate_button, stop_button, view.status],
                lambda: (gr.update(interactive=False, value="Generating…"), gr.update(visible=True), ""))
        continue_event = wire_continue_panel(ctx, continue_panel, history, [*view.outputs(), stop_button], busy,
                                             play, GPU_GROUP, concurrency)
        for event in (run_event, continue_event):
            event.then(restore, None, [generate_button, stop_button], queue=False, api_visibility="private").then(
                refresh_banner, None, [banner, banner_timer], queue=False, api_visibility="private")
        stop_button.click(stop, None, [view.status, view.progress, view.queue, generate_button, stop_button, cancel_id],
                          queue=False, api_visibility="private",
                          ).then(None, cancel_id, None, js=click_if_set("cancel-queued"), api_visibility="private")
        cancel_queued.click(None, None, None, cancels=[run_event, continue_event], queue=False,
                            api_visibility="private")

        def tab_closed(request: gr.Request) -> None:
            ctx.registry.stop(request.session_hash)  # a closed tab must not keep a GPU busy for nobody

        demo.unload(tab_closed)
    return demo


def click_if_set(button_id: str) -> str:
    """JS for a follow-up event: click the hidden button when the previous step named a run (or a cancel)."""
    return f"(id) => {{ if (id) document.getElementById({button_id!r}).click(); }}"


def _no_progress(*args, **kwargs) -> None:
    """The page draws its own progress block from the tracker (Gradio's bar resets its timer on every update)."""
