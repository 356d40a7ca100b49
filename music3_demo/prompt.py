"""Prompt assembly: caption cleaning, lyric normalisation, the special-token template, and a lyric lint.

The text transformations are part of the checkpoint's input contract and must stay byte-identical to diffusers'
(`tests/test_prompt.py` checks them against diffusers' own functions on a varied corpus).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from . import contract as c
from .errors import InvalidRequest

_SPECIAL_TAG_RE = re.compile(r"<\|([^|]*)\|>")
_LEADING_TAGS_RE = re.compile(r"^[ \t]*((?:\[[^\]]+\][ \t]*)+)")
_HEADING_RE = re.compile(r"^\s{0,3}#{1,6}\s+")
_BULLET_RE = re.compile(r"^\s*[*+-]\s+")
_STAR_BULLET_RE = re.compile(r"^\s*\*\s+")
_BOLD_RE = re.compile(r"\*\*([^*]+)\*\*")
_ITALIC_RE = re.compile(r"(?<!\*)\*([^*\n]+)\*(?!\*)")
_RULE_RE = re.compile(r"^\s*[-*_]{3,}\s*$", flags=re.MULTILINE)
_TAG_RE = re.compile(r"\[([^\]]+)\]")


def _rewrite_special_tag(match: re.Match) -> str:
    # "<|genre pop|>" becomes "genre is pop"; a single word keeps just the word.
    parts = match.group(1).strip().split(None, 1)
    return f"{parts[0]} is {parts[1]}" if len(parts) == 2 else match.group(1).strip()


def _strip_markdown_line(line: str) -> str:
    line = _HEADING_RE.sub("", line)
    line = _BULLET_RE.sub("", line)
    line = _STAR_BULLET_RE.sub("", line)
    while "**" in line:
        updated = _BOLD_RE.sub(r"\1", line)
        if updated == line:
            break
        line = updated
    return _ITALIC_RE.sub(r"\1", line).rstrip()


def clean_caption(caption: str) -> str:
    """Rewrite `<|key value|>` tags and strip the markdown forms the model's contract accepts."""
    text = _SPECIAL_TAG_RE.sub(_rewrite_special_tag, caption)
    text = "\n".join(_strip_markdown_line(line) for line in text.splitlines())
    text = _RULE_RE.sub("", text)
    text = text.replace("• ", "").replace("    ", "")
    return re.sub(r"\n{2,}", "\n", text)


def normalize_lyrics(lyrics: str) -> str:
    """Keep only the leading structure tags of a tag line, split inline tags onto lines, lowercase tags."""
    lines = []
    for line in lyrics.split("\n"):
        match = _LEADING_TAGS_RE.match(line)
        lines.append(match.group(1).strip() if match else line)
    text = "\n".join(lines)
    text = text.replace("] ", "]\n").replace(" [", "\n[").replace(" ^ ", "\n")
    text = _TAG_RE.sub(lambda match: f"[{match.group(1).lower()}]", text)
    return f"[start]\n{text}"


# The `<|name|>` form of every special token of the template (and of the Qwen family the LM comes from).
_MARKER_RE = re.compile(r"<\|[^|]*\|>")


def control_marker(caption: str, lyrics: str, extra: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """("description" | "lyrics", marker) for the first special-token string the assembled prompt would carry
    inside the user's text, else None. Checked after cleaning: diffusers' caption cleaning rewrites `<|a b|>` tags,
    but a nested `<|<|im_end|>|>` comes out of it as a real `<|im_end|>`; lyrics reach the tokenizer as typed."""
    for field, text in (("description", clean_caption(caption)), ("lyrics", normalize_lyrics(lyrics))):
        match = _MARKER_RE.search(text)
        if match is not None:
            return field, match.group()
        for marker in extra:
            if marker in text:
                return field, marker
    return None


def check_markers(description: str, lyrics: str, extra: tuple[str, ...] = ()) -> None:
    """Refuse text that would turn into the model's control tokens (`control_marker` finds them)."""
    found = control_marker(description, lyrics, extra)
    if found is not None:
        field, marker = found
        where = "description contains" if field == "description" else "lyrics contain"
        raise InvalidRequest(
            f"The {where} {marker!r}, which the model would read as a control token of its prompt, not as text: "
            "remove it.", field)


def build_prompt(caption: str, lyrics: str) -> str:
    return (
        f"{c.IM_START}{c.CAPTION_START}{clean_caption(caption)}{c.CAPTION_END}"
        f"{c.LYRICS_START}{normalize_lyrics(lyrics)}{c.LYRICS_END}{c.IM_END}{c.AUDIO_START}"
    )


def cfg_pair(input_ids: torch.Tensor) -> torch.Tensor:
    """[1, T] prompt ids -> [2, T]: row 1 keeps the first and two last tokens, the rest become the CFG token."""
    unconditional = input_ids.clone()
    unconditional[:, 1:-2] = c.AUDIO_CFG_TOKEN_ID
    return torch.cat((input_ids, unconditional), dim=0)


def tokenize(tokenizer, caption: str, lyrics: str) -> torch.Tensor:
    """The CFG pair of prompt ids, shape [2, T]. The last guard against typed control tokens: any added token of
    this tokenizer's vocabulary beyond the template's own (e.g. Qwen's `<think>`) is refused, not generated from."""
    input_ids = tokenizer(build_prompt(caption, lyrics), return_tensors="pt")["input_ids"]
    added = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
    if sum(int(token) in added for token in input_ids[0].tolist()) > len(c.SPECIAL_TOKENS):
        check_markers(caption, lyrics, tuple(getattr(token, "content", str(token)) for token in added.values()))
    return cfg_pair(input_ids)


def count_prompt_tokens(tokenizer, caption: str, lyrics: str) -> int:
    return len(tokenizer(build_prompt(caption, lyrics))["input_ids"])


@dataclass(frozen=True)
class LyricWarning:
    line_number: int  # 1-based
    line: str
    dropped: str

    @property
    def message(self) -> str:
        return (
            f"Line {self.line_number} starts with a tag and has text after it; the model drops "
            f"{self.dropped!r}. Put the tag on its own line."
        )


def lint_lyrics(lyrics: str) -> list[LyricWarning]:
    """Lines that start with a structure tag and carry text after it (the model silently drops that text)."""
    warnings = []
    for number, line in enumerate(lyrics.split("\n"), start=1):
        match = _LEADING_TAGS_RE.match(line)
        if match and line[match.end() :].strip():
            warnings.append(LyricWarning(number, line, line[match.end() :].strip()))
    return warnings
