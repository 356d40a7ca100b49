"""The programmatic endpoints: `generate` (DESIGN.md's contract) and `status` (model state, busy devices, jobs).

They hang off hidden components so that the API's inputs are loosely typed (numbers as plain numbers) and
`validate()` alone decides what is acceptable, with its own sentence; the page's sliders are a separate, private
event. Both generation events share the `gpu` concurrency group, so the page and the API queue together.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing

import gradio as gr

from .. import contract as c
from ..events import AudioPiece
from ..events import Cancelled
from .core import AppContext, Outcome, check, make_request, run

GPU_GROUP = "gpu"
RANDOM_SEED = -1  # the API's default seed: a client that names no seed gets a random one


def api_results(items: Iterator) -> Iterator[tuple]:
    """An endpoint's yields for one run's items (`core.run`'s): skips while it runs, then (the WAV, the report)."""
    try:
        with closing(items):
            for item in items:
                if isinstance(item, Outcome):
                    yield item.saved.wav, item.report
                    return
                if item is None or isinstance(item, AudioPiece):
                    # Handing control back lets a client's cancel close this generator promptly.
                    yield gr.skip(), gr.skip()
    except Cancelled:
        raise gr.Error("The song was stopped before it was finished.", title="Stopped") from None


def add_api(ctx: AppContext, concurrency: int) -> None:
    def generate(
        description: str,
        lyrics: str,
        duration: float,
        guidance_scale: float,
        num_steps: float,
        seed: float | None,
        lm_cfg_scale: float,
        top_k: float,
        instrumental: bool,
        progress: gr.Progress = gr.Progress(),
    ) -> Iterator[tuple]:
        """Make one song; returns (the WAV file, a report dict with seed, engine, frames and stage timings)."""
        seed = None if seed == RANDOM_SEED else seed
        request = check(ctx.holder, make_request(description, lyrics, duration, guidance_scale, num_steps, seed,
                                                 lm_cfg_scale, top_k, instrumental))
        yield from api_results(run(ctx, request, None, progress))

    def status() -> dict:
        """Model state (loading / ready / failed with why), devices in use, and the recent jobs with their times."""
        return ctx.holder.status().as_dict() | {"jobs": ctx.registry.recent()}

    with gr.Column(visible=False):
        inputs = [
            gr.Textbox(label="description"),
            gr.Textbox(label="lyrics"),
            gr.Number(label="duration", value=c.DEFAULT_DURATION_S),
            gr.Number(label="guidance_scale", value=c.DEFAULT_GUIDANCE),
            gr.Number(label="num_steps", value=c.DEFAULT_STEPS),
            gr.Number(label="seed", value=RANDOM_SEED,
                      info="-1 (the default) picks a random seed; the report says which"),
            gr.Number(label="lm_cfg_scale", value=c.AR_CFG_SCALE),
            gr.Number(label="top_k", value=c.AR_SAMPLING_TOP_K),
            gr.Checkbox(label="instrumental", value=False),
        ]
        audio = gr.Audio(label="audio", type="filepath")
        report = gr.JSON(label="report")
        status_json = gr.JSON(label="status")
        generate_trigger = gr.Button("generate")
        status_trigger = gr.Button("status")
    generate_trigger.click(generate, inputs, [audio, report], api_name="generate", concurrency_id=GPU_GROUP,
                           concurrency_limit=concurrency)
    status_trigger.click(status, None, status_json, api_name="status", queue=False)
