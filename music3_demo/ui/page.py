"""The Gradio page: layout and the wiring between controls, the running job, results and history."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import gradio as gr

from . import assets
from .api import GPU_GROUP, add_api
from .controls import (
    CARET_TRACKER_JS,
    build_controls,
    insert_tag_js,
    new_seed,
    reset_targets,
    reset_values,
    settings_values,
    token_counter_markdown,
)
from .continue_view import add_continue_api, build_continue_panel
from .core import AppContext, check, make_request, run
from .history import render_history
from .run_view import STOPPED_TEXT, WAITING_TEXT, build_run_view

GENERATE_LABEL = "🎵 Generate"


def launch_options() -> dict:
    """What Gradio 6 takes at launch() rather than in Blocks(): theme, CSS, extra <head>."""
    return {"theme": gr.themes.Soft(primary_hue="indigo", secondary_hue="pink"), "css": assets.read_text("style.css"),
            "head": CARET_TRACKER_JS}


def build_ui(ctx: AppContext, concurrency: int = 1) -> gr.Blocks:
    holder = ctx.holder
    with gr.Blocks(title="MiniMax Music 3", delete_cache=(3600, int(ctx.store.ttl_s))) as demo:
        gr.Markdown(assets.read_text("header.md"), elem_id="header")
        banner = gr.HTML(assets.banner_html(holder.status()), elem_id="banner")
        banner_timer = gr.Timer(1.0)
        with gr.Row(equal_height=False):
            with gr.Column(scale=5, min_width=360):
                controls = build_controls()
            with gr.Column(scale=6, min_width=360):
                with gr.Row():
                    generate_button = gr.Button(GENERATE_LABEL, variant="primary", size="lg", scale=3,
                                                elem_id="generate")
                    stop_button = gr.Button("⏹ Stop", variant="stop", size="lg", scale=1, visible=False,
                                            elem_id="stop")
                view = build_run_view(ctx.live_audio)
                history = gr.State([])
                with gr.Accordion("Your songs (this session)", open=True, elem_id="history"):

                    @gr.render(inputs=[history])
                    def _history(entries: list[dict]) -> None:
                        render_history(entries, controls.settable(), settings_values)

                busy = ([generate_button, stop_button, view.status], lambda: (
                    gr.update(interactive=False, value="Generating…"), gr.update(visible=True), WAITING_TEXT))
                continue_event = build_continue_panel(ctx, history, view, GPU_GROUP, concurrency, busy)

        examples = assets.load_examples()
        gr.Examples(
            examples=[[e.description, e.lyrics, e.duration, e.instrumental] for e in examples],
            inputs=[controls.description, controls.lyrics, controls.duration, controls.instrumental],
            example_labels=[e.label for e in examples],
            label="Examples: click one to fill in the form",
            examples_per_page=12,
        )
        gr.Markdown(assets.footer_markdown(), elem_id="licence")
        add_api(ctx, concurrency)
        add_continue_api(ctx, GPU_GROUP, concurrency)

        # ---- model banner: polled while a load is pending, refreshed after every run ------------------------
        def refresh_banner() -> tuple:
            state = holder.status()
            return assets.banner_html(state), gr.Timer(active=state.state in ("loading", "idle"))

        banner_timer.tick(refresh_banner, None, [banner, banner_timer], queue=False, show_progress="hidden",
                          api_visibility="private")

        # ---- controls ---------------------------------------------------------------------------------------
        count_inputs = [controls.description, controls.lyrics, controls.instrumental]
        gr.on([controls.description.change, controls.lyrics.change, controls.instrumental.change, demo.load],
              partial(token_counter_markdown, holder), count_inputs, controls.token_counter,
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
        def prepare(*values) -> tuple:
            """Instant check before queueing (a bad input should not wait behind other people's songs)."""
            *request_values, random_seed = values
            request = make_request(*request_values)
            if random_seed:
                request = replace(request, seed=new_seed())
            check(holder, request)
            return (request.seed, gr.update(interactive=False, value="Generating…"), gr.update(visible=True),
                    WAITING_TEXT)

        def generate(description: str, lyrics: str, duration: float, guidance_scale: float, num_steps: float,
                     seed: float | None, lm_cfg_scale: float, top_k: float, instrumental: bool, entries: list[dict],
                     request: gr.Request, progress: gr.Progress = gr.Progress()):
            song_request = check(holder, make_request(description, lyrics, duration, guidance_scale, num_steps, seed,
                                                      lm_cfg_scale, top_k, instrumental))
            yield from view.play(run(ctx, song_request, request.session_hash, progress), history, entries,
                                 ctx.history_limit)

        def stop(request: gr.Request) -> tuple:
            ctx.registry.stop(request.session_hash)  # direct, so the worker stops even before Gradio's cancel lands
            return STOPPED_TEXT, gr.update(interactive=True, value=GENERATE_LABEL), gr.update(visible=False)

        def restore() -> tuple:
            return gr.update(interactive=True, value=GENERATE_LABEL), gr.update(visible=False)

        request_inputs = controls.request_inputs()
        run_event = generate_button.click(
            prepare, [*request_inputs, controls.random_seed],
            [controls.seed, generate_button, stop_button, view.status],
            queue=False, show_progress="hidden", api_visibility="private",
        ).success(
            generate, [*request_inputs, history], [*view.outputs(), history],
            concurrency_id=GPU_GROUP, concurrency_limit=concurrency, show_progress_on=[view.status],
            api_visibility="private",
        )
        for event in (run_event, continue_event):
            event.then(restore, None, [generate_button, stop_button], queue=False, api_visibility="private").then(
                refresh_banner, None, [banner, banner_timer], queue=False, api_visibility="private")
        stop_button.click(stop, None, [view.status, generate_button, stop_button], cancels=[run_event, continue_event],
                          queue=False, api_visibility="private")

        def tab_closed(request: gr.Request) -> None:
            ctx.registry.stop(request.session_hash)  # a closed tab must not keep a GPU busy for nobody

        demo.unload(tab_closed)
    return demo

