"""The input controls, their defaults, the section-tag buttons and the live prompt-token counter."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

import gradio as gr

from .. import contract as c
from ..prompt import build_prompt, lint_lyrics
from ..request import MAX_VARIATIONS
from .assets import DESCRIPTION_HELP, LYRICS_HELP, SECTION_TAGS
from ..serve.backend import SongBackend

DEFAULTS = {
    "duration": c.DEFAULT_DURATION_S,
    "guidance_scale": c.DEFAULT_GUIDANCE,
    "num_steps": c.DEFAULT_STEPS,
    "lm_cfg_scale": c.AR_CFG_SCALE,
    "top_k": c.AR_SAMPLING_TOP_K,
    "instrumental": False,
    "random_seed": True,
}

# Remembers where the caret was when the lyrics box lost focus, so a tag button inserts there, not at the end.
CARET_TRACKER_JS = """
<script>
document.addEventListener("focusout", (e) => {
  const t = e.target;
  if (t && t.tagName === "TEXTAREA" && t.closest("#lyrics")) { t.dataset.caret = String(t.selectionEnd); }
}, true);
</script>
"""


# Each slider's name as validate() words it: the page says "<name> must be between …" when a typed number is clamped.
FIELD_NAMES = {"duration": "Duration (seconds)", "guidance": "Guidance scale", "steps": "Steps",
               "lm-cfg": "LM CFG scale", "top-k": "Top-k"}
FIELD_NAMES_JS = f"<script>window.M3_FIELDS = {json.dumps(FIELD_NAMES)};</script>"


def insert_tag_js(tag: str) -> str:
    """Client-side: put `[tag]` on its own line at the caret (a blank line before it when text precedes)."""
    return f"""(lyrics) => {{
  const ta = document.querySelector("#lyrics textarea");
  const text = lyrics || "";
  const caret = ta && ta.dataset.caret !== undefined ? Math.min(+ta.dataset.caret, text.length) : text.length;
  let before = text.slice(0, caret), after = text.slice(caret);
  const lineStart = before.lastIndexOf("\\n") + 1;
  if (before.slice(lineStart).trim() !== "") {{ before += "\\n"; }}
  const lead = before.trim() === "" || before.endsWith("\\n\\n") ? "" : "\\n";
  const inserted = lead + {json.dumps(f"[{tag}]")} + "\\n";
  const result = before + inserted + after.replace(/^[ \\t]*\\n?/, "");
  const pos = before.length + inserted.length;
  if (ta) {{ ta.dataset.caret = String(pos); setTimeout(() => {{ ta.focus(); ta.setSelectionRange(pos, pos); }}, 60); }}
  return result;
}}"""


@dataclass
class Controls:
    description: gr.Textbox
    lyrics: gr.Textbox
    instrumental: gr.Checkbox
    duration: gr.Slider
    guidance_scale: gr.Slider
    num_steps: gr.Slider
    seed: gr.Number
    random_seed: gr.Checkbox
    dice: gr.Button
    variations: gr.Radio
    lm_cfg_scale: gr.Slider
    top_k: gr.Slider
    tag_buttons: list[gr.Button]
    token_counter: gr.Markdown
    reset: gr.Button

    def request_inputs(self) -> list[gr.components.Component]:
        """In the order of the API's parameters (make_request's)."""
        return [self.description, self.lyrics, self.duration, self.guidance_scale, self.num_steps, self.seed,
                self.lm_cfg_scale, self.top_k, self.instrumental]

    def settable(self) -> list[gr.components.Component]:
        """What "reuse these settings" fills in, in the order settings_values() returns."""
        return [self.description, self.lyrics, self.instrumental, self.duration, self.guidance_scale,
                self.num_steps, self.seed, self.random_seed, self.lm_cfg_scale, self.top_k]


def build_controls() -> Controls:
    description = gr.Textbox(label="Music description", info=DESCRIPTION_HELP, lines=3, max_lines=8,
                             placeholder="e.g. upbeat indie rock, 128 BPM, E major, raspy male vocals, jangly guitars",
                             elem_id="description")
    with gr.Group():
        lyrics = gr.Textbox(label="Lyrics", info=LYRICS_HELP, lines=10, max_lines=30, elem_id="lyrics",
                            placeholder="[verse]\nFirst line of the song\n…\n\n[chorus]\n…")
        with gr.Row(elem_classes="m3-tags"):
            tag_buttons = [gr.Button(f"[{tag}]", size="sm", min_width=60, elem_classes="m3-tag")
                           for tag in SECTION_TAGS]
    token_counter = gr.Markdown(elem_id="token-counter")
    instrumental = gr.Checkbox(label="Instrumental (no vocals: the lyrics are ignored)", value=False,
                               elem_id="instrumental")
    duration = gr.Slider(c.MIN_DURATION_S, c.MAX_DURATION_S, value=DEFAULTS["duration"], step=1,
                         label="Duration (seconds)", elem_id="duration")
    with gr.Row():
        guidance_scale = gr.Slider(*c.GUIDANCE_RANGE, value=DEFAULTS["guidance_scale"], step=0.1,
                                   label="Guidance scale", info="How strongly the audio follows the sound plan",
                                   elem_id="guidance")
        num_steps = gr.Slider(c.MIN_STEPS, c.MAX_STEPS, value=DEFAULTS["num_steps"], step=1, label="Steps",
                              info="Denoising steps: fewer is faster, more is cleaner", elem_id="steps")
    with gr.Row(elem_classes="m3-seed-row"):
        # No rounding here: 1.5 reaches validate(), which says a seed is a whole number (precision=0 would make it 2).
        seed = gr.Number(label="Seed", value=0, scale=3, minimum=None, elem_id="seed")
        with gr.Column(scale=2, min_width=180):
            random_seed = gr.Checkbox(label="New random seed each time", value=DEFAULTS["random_seed"],
                                      elem_id="random-seed")
            dice = gr.Button("🎲 Random seed now", size="sm", elem_id="dice")
    variations = gr.Radio(list(range(1, MAX_VARIATIONS + 1)), value=1, label="Variations",
                          info="Songs to make from this request at once, seeds seed, seed + 1, …: each gets its own "
                               "player", elem_id="variations")
    with gr.Accordion("Advanced", open=False, elem_id="advanced"):
        with gr.Row():
            lm_cfg_scale = gr.Slider(*c.LM_CFG_RANGE, value=DEFAULTS["lm_cfg_scale"], step=0.1, label="LM CFG scale",
                                     info="Classifier-free guidance of the language model", elem_id="lm-cfg")
            top_k = gr.Slider(*c.TOP_K_RANGE, value=DEFAULTS["top_k"], step=1, label="Top-k",
                              info="Codes the language model samples from", elem_id="top-k")
    reset = gr.Button("↺ Reset settings to defaults", size="sm", variant="secondary", elem_id="reset")
    return Controls(description, lyrics, instrumental, duration, guidance_scale, num_steps, seed, random_seed, dice,
                    variations, lm_cfg_scale, top_k, tag_buttons, token_counter, reset)


def new_seed() -> int:
    return secrets.randbelow(c.MAX_SEED + 1)


def reset_values() -> tuple:
    """Settings back to defaults; the description and lyrics (the user's writing) are kept."""
    return (DEFAULTS["instrumental"], DEFAULTS["duration"], DEFAULTS["guidance_scale"], DEFAULTS["num_steps"],
            DEFAULTS["random_seed"], DEFAULTS["lm_cfg_scale"], DEFAULTS["top_k"])


def reset_targets(controls: Controls) -> list[gr.components.Component]:
    return [controls.instrumental, controls.duration, controls.guidance_scale, controls.num_steps,
            controls.random_seed, controls.lm_cfg_scale, controls.top_k]


def settings_values(settings: dict) -> tuple:
    """A past request's settings for Controls.settable(); the seed is fixed so the song can be made again."""
    return (settings["description"], settings["lyrics"], settings["instrumental"], settings["duration"],
            settings["guidance_scale"], settings["num_steps"], settings["seed"], False, settings["lm_cfg_scale"],
            settings["top_k"])


def token_counter_markdown(backend: SongBackend, description: str, lyrics: str, instrumental: bool) -> str:
    """`Prompt: n / 5000 tokens`, exact with the model's tokenizer (≈ before it is fetched), plus lyric warnings."""
    lyrics_sent = c.INSTRUMENTAL_LYRICS if instrumental else (lyrics or "")
    count = backend.count_tokens(description or "", lyrics_sent)
    exact = count is not None
    if count is None:
        count = len(build_prompt(description or "", lyrics_sent).encode("utf-8")) // 3
    over = count > c.MAX_PROMPT_TOKENS
    mark = "" if exact else "≈ "
    line = f"Prompt: **{mark}{count:,} / {c.MAX_PROMPT_TOKENS:,} tokens**"
    if over:
        line = f'<span class="m3-over">⛔ {line} — shorten it by about {count - c.MAX_PROMPT_TOKENS:,}</span>'
    if not exact:
        line += " (estimate until the model's tokenizer is loaded)"
    warnings = [] if instrumental else lint_lyrics(lyrics or "")
    lines = [line] + [f"⚠️ {warning.message}" for warning in warnings[:5]]
    if len(warnings) > 5:
        lines.append(f"⚠️ … and {len(warnings) - 5} more lines like that.")
    return "\n\n".join(lines)
