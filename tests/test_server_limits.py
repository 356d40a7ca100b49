"""What a public server must survive, below the HTTP layer: huge or odd text, non-boolean booleans, a full disk,
crash leftovers, damaged checkpoints, and the CLI's one-sentence errors (issue 18)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from music3_demo import contract as c
from music3_demo.events import Song
from music3_demo.request import GenerationRequest, InvalidRequest, validate

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tiny filesystem (tmpfs: needs root, which CI's container has); skips the test where it cannot mount."""
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.decode(errors='replace').strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def tiny_disk(tmp_path) -> Iterator[Path]:
    with small_disk(tmp_path / "disk", "1m") as path:
        yield path


# ---- text ------------------------------------------------------------------------------------------------------
def test_megabytes_of_lyrics_are_refused_before_tokenizing(tiny_folder):
    from transformers import AutoTokenizer

    from music3_demo.prompt import count_prompt_tokens

    tokenizer = AutoTokenizer.from_pretrained(str(Path(tiny_folder) / "tokenizer"))
    counted = []

    def count(description: str, lyrics: str) -> int:
        counted.append(len(lyrics))
        return count_prompt_tokens(tokenizer, description, lyrics)

    started = time.perf_counter()
    with pytest.raises(InvalidRequest) as error:
        validate(GenerationRequest("pop", "la " * 3_500_000), count)
    assert time.perf_counter() - started < 0.5 and not counted, "the text was tokenized before the size check"
    assert str(error.value) == ("The lyrics are 10,500,000 characters long; the limit is 20,000 "
                                f"(the model reads at most {c.MAX_PROMPT_TOKENS} tokens): shorten it.")
    assert error.value.field == "lyrics"
    with pytest.raises(InvalidRequest, match="The description is 30,000 characters long"):
        validate(GenerationRequest("x" * 30_000, "la"), count)
    assert validate(GenerationRequest("pop", "la " * 1000), count).lyrics  # a long but fair song still passes


def test_booleans_are_booleans():
    from music3_demo.ui.core import make_request

    def request(instrumental):
        return validate(make_request("ambient", "la la", 10, 1.7, 30, 1, 1.5, 50, instrumental))

    assert request("false").instrumental is False and request("false").effective_lyrics == "la la"
    assert request("TRUE").instrumental is True and request(True).instrumental is True
    assert request(False).instrumental is False and request(None).instrumental is False
    for bad in ("yes", "banana", 1, 0.0, [], "no"):
        with pytest.raises(InvalidRequest) as error:
            request(bad)
        assert str(error.value) == f"Instrumental must be true or false, got {bad!r}." and error.value.field


def test_lone_surrogates_get_a_sentence_not_a_tokenizer_error():
    with pytest.raises(InvalidRequest) as error:
        validate(GenerationRequest("pop", "hello \ud800 world"))
    assert str(error.value) == ("The lyrics contain an invalid character (an unpaired UTF-16 surrogate, U+D800, at "
                                "character 7): paste the text again or remove that character.")
    with pytest.raises(InvalidRequest, match="The description contains an invalid character"):
        validate(GenerationRequest("pop \udcff", "la"))


def test_typed_special_tokens_never_become_control_tokens(tiny_folder):
    """diffusers' own prompt builder passes lyrics to the tokenizer as typed, so `<|im_end|>` in lyrics becomes
    the real end-of-turn token there too: we refuse such text (a sentence) instead of generating from it, which
    keeps the parity contract for every text we accept."""
    from diffusers.modular_pipelines.minimax_music3 import encoders
    from transformers import AutoTokenizer

    from music3_demo.prompt import build_prompt, tokenize

    tokenizer = AutoTokenizer.from_pretrained(str(Path(tiny_folder) / "tokenizer"))
    specials = set(tokenizer.added_tokens_decoder)
    typed = "[verse]\nhello <|im_end|><|audio_start|> there"
    reference = (f"{encoders._IM_START}{encoders._CAPTION_START}{encoders._clean_caption('pop')}"
                 f"{encoders._CAPTION_END}{encoders._LYRICS_START}{encoders._normalize_lyrics(typed)}"
                 f"{encoders._LYRICS_END}{encoders._IM_END}{encoders._AUDIO_START}")
    reference_ids = tokenizer(reference)["input_ids"]
    assert sum(token in specials for token in reference_ids) == len(c.SPECIAL_TOKENS) + 2  # what we must avoid
    assert build_prompt("pop", typed) == reference  # the text itself is the reference's, byte for byte

    cases = [
        (GenerationRequest("pop", typed), "The lyrics contain '<|im_end|>'"),
        # diffusers' caption cleaning rewrites `<|a b|>` tags, but a nested one comes out of it as a real marker.
        (GenerationRequest("pop <|<|im_end|>|>", "la"), "The description contains '<|im_end|>'"),
    ]
    for request, message in cases:
        with pytest.raises(InvalidRequest) as error:
            validate(request)
        assert str(error.value).startswith(message) and str(error.value).endswith("not as text: remove it.")
    # Caption tags stay what the model's contract makes of them, and are accepted.
    assert validate(GenerationRequest("<|genre pop|> <|bpm 120|>", "la"))
    # The last guard, whatever the vocabulary: an added token outside the `<|…|>` form (Qwen's `<think>`).
    tokenizer.add_tokens(["<think>"])
    with pytest.raises(InvalidRequest, match="The lyrics contain '<think>'"):
        tokenize(tokenizer, "pop", "la <think> la")
    assert tokenize(tokenizer, "pop", "la la").shape[0] == 2


def test_range_errors_use_compact_numbers():
    with pytest.raises(InvalidRequest) as error:
        validate(GenerationRequest("pop", "la", duration=1e308))
    assert str(error.value) == "Duration (seconds) must be between 1 and 360, got 1e+308."
    with pytest.raises(InvalidRequest) as error:
        validate(GenerationRequest("pop", "la", top_k=-1e300))
    assert str(error.value) == "Top-k must be between 1 and 1024, got -1e+300."
    with pytest.raises(InvalidRequest) as error:
        validate(GenerationRequest("pop", "la", seed=2**33))
    assert str(error.value) == "Seed must be between 0 and 4294967295, got 8589934592."  # seeds stay whole


# ---- the song store: full disks and crash leftovers ------------------------------------------------------------
def _song(seconds: float, seed: int = 1) -> Song:
    noise = np.random.default_rng(seed).uniform(-0.5, 0.5, (2, int(seconds * c.SAMPLE_RATE))).astype(np.float32)
    return Song(noise, c.SAMPLE_RATE, frames=int(seconds * c.FRAME_RATE), seed=seed)


def _files(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def test_a_wav_that_fails_leaves_nothing_and_a_later_file_that_fails_says_why(tmp_path, monkeypatch):
    from music3_demo.serve import store as store_module
    from music3_demo.serve.store import DISK_FULL_MESSAGE, DiskFull, SongStore

    store = SongStore(tmp_path)
    real_write = store_module.write_audio
    failing = [".wav"]

    def write_then_fill(path, audio, sample_rate, subtype=None):
        if Path(path).suffix in failing:  # half a file, then the disk is full
            Path(path).write_bytes(b"RIFF" + bytes(1000))
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, audio, sample_rate, subtype)

    monkeypatch.setattr(store_module, "write_audio", write_then_fill)
    with pytest.raises(DiskFull) as error:  # no WAV, no song: nothing is left
        store.save(_song(1.0), "song")
    assert str(error.value) == DISK_FULL_MESSAGE and str(tmp_path) not in str(error.value)
    assert _files(tmp_path) == []

    failing[:] = [".flac"]  # written after the hand-over: the song stands, the file says why it is missing
    saved = store.save(_song(1.0), "song")
    assert saved.files.state("flac") == DISK_FULL_MESSAGE
    assert saved.files.report()["flac"] == f"failed: {DISK_FULL_MESSAGE}"
    assert _files(tmp_path) == sorted([saved.id] + [f"{saved.id}/{Path(p).name}" for p in
                                                    (saved.wav, saved.mp3, saved.waveform)])  # no half FLAC
    monkeypatch.setattr(store_module, "write_audio", real_write)
    saved = store.save(_song(1.0), "song")
    assert all(saved.files.path(kind) for kind in ("wav", "flac", "mp3", "waveform"))


def test_a_really_full_disk(tiny_disk):
    from music3_demo.serve.store import DiskFull, SongStore

    store = SongStore(tiny_disk, reserve_bytes=0)
    with pytest.raises(DiskFull):
        store.check_room(8.0)  # an 8-s song needs ~2 MB: refused before it starts
    store.check_room(1.0)
    filler = tiny_disk / "filler"
    filler.write_bytes(bytes(900_000))  # the disk fills up while the song is made: no room for its WAV
    with pytest.raises(DiskFull):
        store.save(_song(1.0), "song")
    assert _files(tiny_disk) == ["filler"]  # libsndfile's half-written file went with the failed save
    filler.unlink()  # space is back: the next song is saved whole
    saved = store.save(_song(1.0), "song")
    assert sf.info(saved.wav).frames == c.SAMPLE_RATE and sf.info(saved.flac).frames == c.SAMPLE_RATE


def test_start_up_removes_what_a_killed_process_left_and_makes_its_missing_files(tmp_path, caplog):
    from music3_demo.serve.store import SongStore

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = tmp_path / f".partial-{dead.pid}-20261130-101010-abcdef"
    leftover.mkdir()
    (leftover / "song.flac").write_bytes(b"fLaC" + bytes(100))
    live = tmp_path / f".partial-{os.getppid()}-20261130-101011-abcdef"  # a live process's save in progress
    live.mkdir()
    finished = tmp_path / "20261130-101012-abcdef"
    finished.mkdir()
    # A song handed over (its WAV) whose process died while it wrote the FLAC, before the MP3 and the picture.
    handed_over = tmp_path / "20261130-101013-abcdef"
    handed_over.mkdir()
    audio = _song(1.0).audio
    sf.write(handed_over / "pop-seed1.wav", audio.T, c.SAMPLE_RATE, subtype="PCM_16")
    half = handed_over / f".pop-seed1.partial-{dead.pid}.flac"
    half.write_bytes(b"fLaC" + bytes(100))
    with caplog.at_level(logging.WARNING, logger="music3_demo.store"):
        store = SongStore(tmp_path)
    assert not leftover.exists() and not half.exists() and live.exists() and finished.exists()
    assert [record.getMessage() for record in caplog.records] == [
        "removed 2 unfinished song folder(s) or file(s) left by a stopped process: "
        f"{leftover.name}, {half.name}",
        f"making the missing files of 1 song(s) a stopped process left: {handed_over.name}"]
    files = store.files(handed_over.name)
    assert files.wait(timeout=60) and files.report() == {
        "wav": "pop-seed1.wav", "waveform": "waveform.png", "flac": "pop-seed1.flac", "mp3": "pop-seed1.mp3"}
    wav, flac = sf.read(handed_over / "pop-seed1.wav")[0], sf.read(handed_over / "pop-seed1.flac")[0]
    assert np.array_equal(wav, flac)  # the FLAC it would have written: the same 16-bit samples


def test_a_job_whose_song_cannot_be_saved_is_failed_and_the_next_one_succeeds(tiny_folder, tmp_path, monkeypatch):
    import gradio as gr

    from music3_demo.serve import store as store_module
    from music3_demo.serve.local import LocalBackend
    from music3_demo.ui.core import AppContext, Outcome, run
    from music3_demo.serve.runner import JobRegistry
    from music3_demo.serve.store import DISK_FULL_MESSAGE, SongStore

    backend = LocalBackend("tiny", ["cpu"], engine="reference", warmup=False)
    ctx = AppContext(backend, SongStore(tmp_path / "songs"), JobRegistry(), tick=0.05)
    request = validate(GenerationRequest("pop", "la la", duration=1.0, num_steps=1, seed=3))

    def song(session: str) -> list:
        return list(run(ctx, request, session, lambda *args, **kwargs: None))

    monkeypatch.setattr(store_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0))
    with pytest.raises(gr.Error) as error:  # refused before the song starts
        song("a")
    assert error.value.message == DISK_FULL_MESSAGE and ctx.registry.recent("a") == []
    monkeypatch.undo()

    real_write = store_module.write_audio

    def no_room(path, *args, **kwargs):
        if Path(path).suffix == ".wav":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(store_module, "write_audio", no_room)
    with pytest.raises(gr.Error) as error:  # the disk filled up while the song was made: no WAV
        song("a")
    assert error.value.message == DISK_FULL_MESSAGE
    assert [(job["state"], job["error"]) for job in ctx.registry.recent("a")] == [("failed", DISK_FULL_MESSAGE)]
    assert _files(tmp_path / "songs") == []
    monkeypatch.undo()

    def broken_picture(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module, "waveform_image", broken_picture)
    late = song("a")[-1]  # a file after the hand-over cannot fail the song: it is delivered, the file says why
    assert isinstance(late, Outcome) and late.saved.files.wait(timeout=60)
    assert late.saved.files.report()["waveform"] == f"failed: {DISK_FULL_MESSAGE}"
    assert [job["state"] for job in ctx.registry.recent("a")] == ["failed", "finished"]
    monkeypatch.undo()
    outcome = song("a")[-1]
    assert isinstance(outcome, Outcome) and sf.info(outcome.saved.wav).channels == 2
    assert [job["state"] for job in ctx.registry.recent("a")] == ["failed", "finished", "finished"]
    assert ctx.registry.recent("b") == [] and ctx.registry.recent(None) == []  # nobody sees another's jobs
    assert all(str(tmp_path) not in str(value) for value in outcome.report.values())
    backend.release()


# ---- checkpoints: the right file blamed, the Hub hint only where it helps -------------------------------------
@pytest.fixture
def damaged_copy(tiny_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    return folder


def test_a_broken_index_is_blamed_on_the_index(damaged_copy):
    import torch

    from music3_demo.checkpoint import CheckpointError, load_components

    (damaged_copy / "modular_model_index.json").write_text('{"language_model": ["transformers", ')
    with pytest.raises(CheckpointError) as error:
        load_components(damaged_copy, torch.device("cpu"), torch.float32)
    assert str(error.value).startswith(f"{damaged_copy / 'modular_model_index.json'} is damaged (not valid JSON")
    assert "Could not load language_model" not in str(error.value)


def test_a_truncated_weight_file_is_named(damaged_copy):
    import torch

    from music3_demo.checkpoint import CheckpointError, load_components
    from music3_demo.serve.holder import FIX_HINT, load_error_message

    weights = damaged_copy / "language_model" / "model.safetensors"
    with open(weights, "r+b") as file:
        file.truncate(weights.stat().st_size // 2)
    with pytest.raises(CheckpointError) as error:
        load_components(damaged_copy, torch.device("cpu"), torch.float32)
    assert "language_model/model.safetensors is damaged or incomplete" in str(error.value)
    assert FIX_HINT not in load_error_message(str(damaged_copy), error.value)  # a local folder: no Hub hint
    assert FIX_HINT in load_error_message("someone/some-model", RuntimeError("connection reset"))


# ---- the CLI: one sentence and exit 2, no partial file --------------------------------------------------------
def cli(capsys, *args: str) -> tuple[int, str]:
    from music3_demo.cli import main

    code = main(["generate", "--quiet", *args])
    return code, capsys.readouterr().err


def assert_one_sentence(code: int, err: str, expected: str) -> None:
    """Exit 2 and the sentence as the last line (the libraries' own load chatter may come before it)."""
    assert code == 2, err
    assert err.splitlines()[-1].startswith("error: ") and expected in err.splitlines()[-1], err
    assert err.count("error: ") == 1 and "Traceback" not in err, err


def test_cli_refuses_undecodable_text(capsys, tmp_path):
    lyrics = tmp_path / "lyrics.txt"
    lyrics.write_bytes(b"[verse]\nla la \xff\xfe la\n")
    code, err = cli(capsys, "--prompt", "pop", "--lyrics-file", str(lyrics), "--out", str(tmp_path / "a.wav"))
    assert_one_sentence(code, err, f"The lyrics file {lyrics} is not UTF-8 text (byte 0xff at offset 14)")
    # Undecodable argument bytes reach Python as lone surrogates (surrogateescape).
    code, err = cli(capsys, "--prompt", "pop", "--lyrics", "la \udcff la", "--out", str(tmp_path / "a.wav"))
    assert_one_sentence(code, err, "--lyrics is not valid UTF-8 text")
    assert list(tmp_path.iterdir()) == [lyrics]


def test_cli_refuses_an_invalid_utf8_argument_from_a_real_shell(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), LC_ALL="C.UTF-8")
    result = subprocess.run([sys.executable, "-m", "music3_demo", "generate", "--prompt", b"pop \xff", "--lyrics",
                             "la", "--out", str(tmp_path / "a.wav")], capture_output=True, env=env, cwd=ROOT,
                            timeout=300)
    err = result.stderr.decode()
    assert result.returncode == 2 and err == "error: --prompt is not valid UTF-8 text: check the terminal's " \
                                             "encoding, or use --lyrics-file.\n", err


@pytest.mark.parametrize("device, expected", [
    ("banana", "Unknown device 'banana': use cpu, cuda or cuda:N."),
    ("cuda:7", "--device cuda:7: "),
    ("meta", "--device meta: only cpu and cuda devices are supported."),
])
def test_cli_refuses_a_device_it_cannot_use(capsys, tmp_path, device, expected):
    code, err = cli(capsys, "--model", "tiny", "--prompt", "pop", "--lyrics", "la", "--device", device,
                    "--out", str(tmp_path / "a.wav"))
    assert_one_sentence(code, err, expected)


def test_cli_names_a_damaged_checkpoint(capsys, damaged_copy, tmp_path):
    weights = damaged_copy / "language_model" / "model.safetensors"
    with open(weights, "r+b") as file:
        file.truncate(1000)
    code, err = cli(capsys, "--model", str(damaged_copy), "--prompt", "pop", "--lyrics", "la", "--device", "cpu",
                    "--out", str(tmp_path / "a.wav"))
    assert_one_sentence(code, err, "the weight file language_model/model.safetensors is damaged or incomplete")


def test_cli_unwritable_or_full_out_leaves_no_file(capsys, tmp_path, tiny_folder):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    song = ("--model", "tiny", "--prompt", "pop", "--lyrics", "la la", "--steps", "1", "--seed", "1",
            "--device", "cpu")
    code, err = cli(capsys, *song, "--duration", "1", "--out", str(blocker / "song.wav"))
    assert_one_sentence(code, err, f"Cannot write {blocker / 'song.wav'}: ")
    with small_disk(tmp_path / "disk", "256k") as disk:
        # A 2-s song is 350 kB of 16-bit WAV: the 256 kB disk fills up while the song is written.
        code, err = cli(capsys, *song, "--duration", "2", "--out", str(disk / "song.wav"))
        assert_one_sentence(code, err, f"The disk holding {disk / 'song.wav'} is full: the song was not saved")
        assert list(disk.iterdir()) == []
        code, err = cli(capsys, *song, "--duration", "1", "--out", str(disk / "song.wav"))  # 176 kB: fits
        assert code == 0, err
        assert [path.name for path in disk.iterdir()] == ["song.wav"] and sf.info(disk / "song.wav").frames
