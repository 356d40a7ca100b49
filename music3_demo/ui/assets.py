"""Texts and files around the controls: header, examples, CSS, the model banner and the licence footer."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path

from .. import contract as c
from ..serve.holder import HolderStatus

ASSETS = Path(__file__).resolve().parents[2] / "assets"

DESCRIPTION_HELP = (
    "Genre and mood, tempo (BPM), key, vocals (voice, style, language), instruments and arrangement. "
    "Example: “dreamy synth-pop, 100 BPM, A minor, breathy female vocals, analog pads, build to a big chorus”."
)
LYRICS_HELP = (
    "One section tag per line ([verse], [chorus] …), the sung lines below it. "
    "Text after a tag on the same line is dropped by the model."
)
SECTION_TAGS = ("intro", "verse", "pre-chorus", "chorus", "bridge", "interlude", "outro")


@dataclass(frozen=True)
class Example:
    label: str
    description: str
    lyrics: str
    duration: float
    instrumental: bool


def read_text(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


def load_examples() -> list[Example]:
    return [Example(**item) for item in json.loads(read_text("examples.json"))]


def banner_html(status: HolderStatus) -> str:
    """The model line at the top of the page: state, and the error or noise notice in a coloured box."""
    model = html.escape(status.model)
    devices = html.escape(", ".join(status.devices))
    if status.state == "loading":
        took = f" · {status.loading_for_s:.0f} s" if status.loading_for_s else ""
        line = f"⏳ Loading <b>{model}</b>: {html.escape(status.phase)}{took}"
    elif status.state == "ready":
        engine = html.escape(status.engine or "built by the first song")
        precision = f" · <code>{html.escape(status.precision)}</code> weights" if status.precision else ""
        line = f"✅ <b>{model}</b> · engine <code>{engine}</code>{precision} on {devices}"
    elif status.state == "failed":
        line = f"❌ <b>{model}</b> is not loaded"
    else:
        line = f"💤 <b>{model}</b> loads with the first song on {devices} (that song takes longer)"
    parts = [f'<div class="m3-status m3-{status.state}" id="model-status" data-state="{status.state}">{line}</div>']
    if status.state == "ready" and status.plan_summary:  # the card's memory plan in short
        parts.append(f'<div class="m3-note" id="plan-note">{html.escape(status.plan_summary)}</div>')
    if status.state == "ready" and status.precision_reason:
        parts.append(f'<div class="m3-note" id="precision-note">Precision: {html.escape(status.precision_reason)}'
                     "</div>")
    if status.error:
        parts.append(f'<div class="m3-banner m3-error" role="alert">{html.escape(status.error)}</div>')
    if status.engine_note:
        parts.append(f'<div class="m3-banner m3-engine" role="status" id="engine-banner">⚠️ '
                     f'{html.escape(status.engine_note)}</div>')
    if status.notice:
        parts.append(
            f'<div class="m3-banner m3-noise" role="alert" id="noise-banner">🔊 {html.escape(status.notice)} '
            "Load the real weights (<code>--model MiniMaxAI/MiniMax-Music3</code> or a local copy) for music.</div>"
        )
    return "\n".join(parts)


def footer_markdown() -> str:
    hub = f"https://huggingface.co/{c.HUB_REPO_ID}"
    return (
        f"**Model:** [{c.HUB_REPO_ID}]({hub}) by MiniMax, released under the **{c.MODEL_LICENSE}** — read and accept "
        f"it on the [model page]({hub}) before using the weights or what they make. "
        "**Code:** the model classes come from 🤗 [diffusers](https://github.com/huggingface/diffusers) and "
        "[transformers](https://github.com/huggingface/transformers); this demo's code is Apache-2.0. "
        f"Songs are 44.1 kHz stereo, up to {c.MAX_DURATION_S / 60:g} minutes; files are deleted from the server "
        "after a while, so download the ones you keep."
    )
