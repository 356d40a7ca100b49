"""Caption cleaning, lyric normalisation and prompt assembly are byte-identical to diffusers' own functions."""

from __future__ import annotations

import pytest
import torch
from diffusers.modular_pipelines.minimax_music3 import encoders

from music3_demo import contract as c
from music3_demo.prompt import build_prompt, clean_caption, cfg_pair, lint_lyrics, normalize_lyrics, tokenize

CAPTIONS = [
    "upbeat synth-pop, 120 BPM, female vocals",
    "  leading and trailing spaces  ",
    "# Heading\nA dreamy ballad",
    "### Genre: jazz\n- saxophone lead\n- brushed drums",
    "* bullet one\n+ bullet two\n- bullet three",
    "**bold** and *italic* words",
    "***triple*** stars and ** unmatched",
    "nested **bold *with italic* inside**",
    "<|genre pop|> with <|mood happy|> tags",
    "<|instrumental|> only one word tag",
    "<| spaced  tag value |>",
    "line one\n\n\nline three after blanks",
    "---\nrule above\n***\n___\nrules",
    "• bullet dot item\n• another",
    "    four-space indented code-like line",
    "tab\tseparated\tvalues",
    "中文描述：流行，女声，钢琴伴奏",
    "日本語のシティポップ、ミディアムテンポ",
    "한국어 발라드, 피아노와 현악기",
    "emoji 🎸🥁 rock anthem",
    "Key: C# minor; BPM ~ 95; 4/4",
    "*",
    "**",
    "a * b * c",
    "trailing stars**",
    "line with trailing spaces   \nnext",
    "\r\nwindows\r\nline endings\r\n",
    "#notaheading because no space",
    "####### seven hashes",
    "   ## indented heading",
    "mixed <|bpm 120|> **Bold** - not a bullet",
    "- - double dash bullet",
    "1. numbered list\n2. second",
    "[verse] tags in a caption stay",
    "quotes \"double\" and 'single'",
    "backslash \\ and pipes | here",
    "<|unterminated tag",
    "multiple\n\n\n\n\nnewlines",
    "ends with newline\n",
    "x" * 300,
    "Ünïcödé àccents and ß",
    "- **bold bullet** with *it*",
]

LYRICS = [
    "[verse]\nhello world\n[chorus]\nla la la",
    "[Verse 1]\nUPPER case tags",
    "[verse] text on the tag line is dropped",
    "[intro][verse] two leading tags",
    "  [verse]  indented tag line",
    "line with [inline] tag in the middle",
    "word ^ caret ^ split",
    "^ leading caret",
    "blank lines\n\n\nbetween",
    "",
    "no tags at all, just words",
    "[CHORUS]\n[Bridge]\n[Outro]",
    "中文歌词\n[副歌]\n我爱你",
    "[verse]\n日本語の歌詞\n[chorus]\nラララ",
    "[instrumental]",
    "trailing ] bracket",
    "[unclosed tag\nnext line",
    "[verse]\ttab after tag",
    "] [ weird brackets",
    "[a] [b] [c] spaced tags",
    "line\r\nwith crlf",
    "[Pre-Chorus]\nrising up",
    "x" * 500,
    "[verse]\n" + "\n".join(f"line {i}" for i in range(40)),
    "emoji 🎤 line\n[drop]",
    "[Verse]  \n  spaces around  ",
    "a ^ b ^ c ^ d",
    "[]\nempty tag",
    "[verse]]double close",
    "[[double open]",
    "Ünïcödé [Vërse]",
    "end with newline\n",
    "\n\nstarts with newlines",
    "[verse] [chorus] text",
    "mixed [Tag] inside and [Another]",
    "^",
    "[verse]\n^\n[chorus]",
    "lowercase [tag] and UPPER [TAG]",
    "[verse 2] with number",
    "one line",
    "[hook]\nyeah yeah ^ oh oh",
]


def test_corpus_is_varied_enough():
    assert len(set(CAPTIONS)) >= 40 and len(set(LYRICS)) >= 40


@pytest.mark.parametrize("caption", CAPTIONS)
def test_clean_caption_matches_diffusers(caption):
    assert clean_caption(caption) == encoders._clean_caption(caption)


@pytest.mark.parametrize("lyrics", LYRICS)
def test_normalize_lyrics_matches_diffusers(lyrics):
    assert normalize_lyrics(lyrics) == encoders._normalize_lyrics(lyrics)


def _diffusers_text_ids(tokenizer, caption: str, lyrics: str) -> torch.Tensor:
    """Run diffusers' own tokenize block on a pipeline state."""
    from diffusers.modular_pipelines import MiniMaxMusic3ModularPipeline, PipelineState

    pipe = MiniMaxMusic3ModularPipeline()
    pipe.update_components(tokenizer=tokenizer)
    state = PipelineState()
    state.set("prompt", caption)
    state.set("lyrics", lyrics)
    _, state = encoders.MiniMaxMusic3TokenizeStep()(pipe, state)
    return state.get("text_ids")


@pytest.mark.parametrize("index", range(0, 42, 3))
def test_tokenized_cfg_pair_matches_diffusers(tiny_pipeline, index):
    caption, lyrics = CAPTIONS[index], LYRICS[index] or "[verse]"
    if not caption.strip():
        caption = "pop"
    ours = tokenize(tiny_pipeline.tokenizer, caption, lyrics)
    theirs = _diffusers_text_ids(tiny_pipeline.tokenizer, caption, lyrics)
    assert torch.equal(ours, theirs.cpu())


def test_cfg_pair_masks_all_but_first_and_last_two():
    ids = torch.arange(10).unsqueeze(0)
    pair = cfg_pair(ids)
    assert pair.shape == (2, 10)
    assert torch.equal(pair[0], ids[0])
    assert pair[1].tolist() == [0] + [c.AUDIO_CFG_TOKEN_ID] * 7 + [8, 9]


def test_prompt_template_order():
    text = build_prompt("pop", "[verse]\nhi")
    assert text == (
        "<|im_start|><|caption_start|>pop<|caption_end|><|lyrics_start|>[start]\n[verse]\nhi"
        "<|lyrics_end|><|im_end|><|audio_start|>"
    )


def test_lint_flags_text_after_a_leading_tag():
    warnings = lint_lyrics("[verse] dropped words\nkept line\n[chorus]\n  [bridge][outro] also dropped")
    assert [w.line_number for w in warnings] == [1, 4]
    assert warnings[0].dropped == "dropped words"
    assert "drops 'dropped words'" in warnings[0].message and "own line" in warnings[0].message
    assert lint_lyrics("[verse]\nfine\n[chorus]\nfine too") == []
