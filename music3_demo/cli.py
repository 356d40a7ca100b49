"""`python -m music3_demo generate …`: make one song from the command line, writing it as it is made."""

from __future__ import annotations

import argparse
import errno
import logging
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import soundfile as sf

from . import contract as c
from .audio import AudioFileWriter, output_format
from .checkpoint import CheckpointError, default_model
from .continuation import SongState, check_continuation, extension_request
from .errors import OutOfMemory, is_out_of_memory, public_message
from .events import AudioPiece, Event, Progress
from .memory_plan import SWAP_MODES
from .precision import DIT_PRECISIONS, KV_PRECISIONS, PRECISIONS
from .request import MAX_VARIATIONS, GenerationRequest, InvalidRequest, check_variations, validate
from .semantic import ENGINE_NAMES
from .versions import untested_warnings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m music3_demo", description="MiniMax Music 3 song generator")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="make one song and write it to a .wav, .flac or .mp3 file")
    gen.add_argument("--model", default=None, help=f"Hub repo id, local folder, 'tiny' or 'random-full' "
                     f"(default: $MUSIC3_MODEL or {c.HUB_REPO_ID})")
    gen.add_argument("--prompt", help="music description: genre, BPM, key, vocals, arrangement (with "
                     "--continue-from: the song's own unless given)")
    lyrics = gen.add_mutually_exclusive_group()
    lyrics.add_argument("--lyrics", default="", help="lyrics text; structure tags like [verse] on their own line")
    lyrics.add_argument("--lyrics-file", type=Path, help="read the lyrics from this UTF-8 file")
    gen.add_argument("--instrumental", action="store_true", help="no vocals: sends the [instrumental] tag")
    gen.add_argument("--duration", type=float, default=c.DEFAULT_DURATION_S,
                     help="seconds (1-360); with --continue-from, the seconds to add")
    gen.add_argument("--steps", type=int, help=f"flow-matching steps per chunk (1-100, default {c.DEFAULT_STEPS})")
    gen.add_argument("--guidance", type=float, help=f"flow-stage guidance scale (default {c.DEFAULT_GUIDANCE})")
    gen.add_argument("--lm-cfg", type=float, help=f"semantic-stage CFG scale (default {c.AR_CFG_SCALE})")
    gen.add_argument("--top-k", type=int, help=f"semantic-stage top-k (default {c.AR_SAMPLING_TOP_K})")
    gen.add_argument("--seed", type=int, default=None, help="0 to 2^32-1; random when omitted")
    gen.add_argument("--variations", type=int, default=1, metavar="N",
                     help=f"make N songs of this request (1-{MAX_VARIATIONS}, default 1) with seeds seed .. seed+N-1, "
                     "together: written as OUT-v1 .. OUT-vN (e.g. song-v1.wav)")
    gen.add_argument("--engine", choices=ENGINE_NAMES, default="auto", help="auto = graph on CUDA, else reference")
    gen.add_argument("--precision", choices=PRECISIONS, default="auto",
                     help="LM / depth-decoder weights: bf16 (exact), fp8 (sm_89+), int8; auto = what the GPU's "
                     "memory plan picks (bf16 where a 6-minute song fits, else fp8 or int8)")
    gen.add_argument("--dit-precision", choices=DIT_PRECISIONS, default="auto",
                     help="flow transformer (DiT) weights: bf16, fp8 (sm_89+); auto = fp8 only where the bf16 DiT "
                     "does not fit")
    gen.add_argument("--kv-precision", choices=KV_PRECISIONS, default="auto",
                     help="the graph engine's KV cache: bf16 (exact), int8 (half the memory per second of song); "
                     "auto = int8 only where a bf16 cache leaves the songs short")
    gen.add_argument("--swap", choices=SWAP_MODES, default="auto",
                     help="the two stages take turns on the GPU (their weights moved whole through pinned host "
                     "memory, in turns during the song); auto = only where both do not fit")
    gen.add_argument("--device", default=None, help="e.g. cuda:0 or cpu (default: cuda when available); "
                     "cuda:0+cuda:1 makes the frames on cuda:0 and the audio on cuda:1 (a stage split)")
    gen.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    gen.add_argument("--out", type=Path, default=Path("song.wav"), help="output .wav, .flac or .mp3 (320 kb/s)")
    gen.add_argument("--subtype", default=None,
                     help="sample format: PCM_16 (default), PCM_24, FLOAT (WAV only); not for .mp3")
    gen.add_argument("--state", type=Path, help="also save what --continue-from needs to extend this song (.npz)")
    gen.add_argument("--continue-from", type=Path, metavar="STATE",
                     help="extend the song whose --state file this is by --duration seconds; --lyrics are the added "
                     "part's words; the other settings default to the song's own")
    gen.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def _read_lyrics(args: argparse.Namespace) -> str:
    if args.lyrics_file is None:
        return _argument_text("--lyrics", args.lyrics)
    try:
        return args.lyrics_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequest(
            f"The lyrics file {args.lyrics_file} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at "
            f"offset {error.start}): save it as UTF-8.") from None
    except OSError as error:
        raise InvalidRequest(f"Cannot read the lyrics file {args.lyrics_file}: {error.strerror or error}.") from None


def _argument_text(flag: str, text: str) -> str:
    # Python hands over undecodable argument bytes as lone surrogates (surrogateescape).
    if any("\udc80" <= char <= "\udcff" for char in text):
        raise InvalidRequest(f"{flag} is not valid UTF-8 text: check the terminal's encoding, or use --lyrics-file.")
    return text


def _device(name: str | None):
    """The --device as a torch.device (or "cuda:A+cuda:B", a stage split, checked part by part), or one sentence on
    why it cannot be used here."""
    import torch

    if name is None:
        return None
    if "+" in name:
        from .devices import split_devices

        parts = [_device(part.strip()) for part in name.split("+", 1)]
        try:
            split_devices(*parts)
        except ValueError as error:
            raise InvalidRequest(f"--device {name}: {error}") from None
        return name
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise InvalidRequest(f"Unknown device {name!r}: use cpu, cuda or cuda:N.") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidRequest(f"--device {name}: PyTorch sees no CUDA GPU on this machine; use --device cpu.")
        if device.index is not None and device.index >= count:
            raise InvalidRequest(
                f"--device {name}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}.")
    elif device.type != "cpu":
        raise InvalidRequest(f"--device {name}: only cpu and cuda devices are supported.")
    return device


def _writing(out: Path, operation, *args, **kwargs):
    """Run one file operation on the output; its failure becomes the sentence of _write_error."""
    try:
        return operation(*args, **kwargs)
    except (OSError, sf.SoundFileError) as error:
        raise _write_error(out, error) from None


def _write_error(out: Path, error: BaseException) -> InvalidRequest:
    """One sentence for a song that could not be written (nothing is left at `out`)."""
    try:
        full = shutil.disk_usage(out.parent if out.parent.exists() else Path.cwd()).free < 1_000_000
    except OSError:
        full = False
    if full or (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)):
        return InvalidRequest(f"The disk holding {out} is full: the song was not saved; free some space.")
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error).strip()
    return InvalidRequest(f"Cannot write {out}: {reason or type(error).__name__}; choose another --out.")


def _progress_printer(quiet: bool):
    last = [0.0]

    def show(event: Event) -> None:
        if quiet or not isinstance(event, Progress):
            return
        now = time.monotonic()
        if now - last[0] < 0.5 and event.done < event.total:
            return
        last[0] = now
        rate = f" {event.rate:.1f}/s" if event.rate else ""
        eta = f" eta {event.eta:.0f}s" if event.eta is not None else ""
        print(f"[{event.stage}] {event.done}/{event.total}{rate}{eta}", file=sys.stderr, flush=True)

    return show


def _request(args: argparse.Namespace) -> tuple[GenerationRequest, SongState | None]:
    """The request (and with --continue-from the song to extend); unset numbers take the song's or the defaults."""
    knobs = {"num_steps": args.steps, "guidance_scale": args.guidance, "lm_cfg_scale": args.lm_cfg,
             "top_k": args.top_k}
    given = {key: value for key, value in knobs.items() if value is not None}
    if args.continue_from is None:
        if args.prompt is None:
            raise InvalidRequest("Describe the music with --prompt (or extend a saved song with --continue-from).")
        return GenerationRequest(description=_argument_text("--prompt", args.prompt), lyrics=_read_lyrics(args),
                                 duration=args.duration,
                                 seed=args.seed, instrumental=args.instrumental, **given), None
    state = SongState.load(args.continue_from)
    request = extension_request(state, args.duration, _read_lyrics(args), args.seed, args.prompt)
    request = replace(request, instrumental=request.instrumental or args.instrumental, **given)
    check_continuation(validate(request), state)
    return request, state


def variation_paths(out: Path, count: int) -> list[Path]:
    """Where N variations go: `--out` itself for one song, else song-v1.wav .. song-vN.wav beside it."""
    return [out] if count == 1 else [out.with_name(f"{out.stem}-v{index}{out.suffix}") for index in
                                     range(1, count + 1)]


def generate(args: argparse.Namespace) -> int:
    request, state = _request(args)
    validate(request)  # the cheap checks before a long model load
    count = check_variations(args.variations)
    if count > 1 and (state is not None or args.state is not None):
        raise InvalidRequest("--variations makes new songs: it cannot be combined with --continue-from or --state.")
    output_format(args.out, args.subtype)
    device = _device(args.device)
    outs = variation_paths(args.out, count)
    writers = []
    try:
        for out in outs:  # opened first, so an unwritable --out is refused before a long model load
            writers.append(_writing(out, AudioFileWriter, out, c.SAMPLE_RATE, subtype=args.subtype))
        from .pipeline import Music3Pipeline  # heavy imports only once the request is sane

        pipeline = Music3Pipeline.from_pretrained(args.model or default_model(), device=device,
                                                  engine=args.engine, revision=args.revision,
                                                  precision=args.precision, dit_precision=args.dit_precision,
                                                  kv_precision=args.kv_precision, swap=args.swap)
        print(f"note: precision {pipeline.precision.mode}: {pipeline.precision.reason}", file=sys.stderr)
        if pipeline.memory_plan is not None and pipeline.memory_plan.on_gpu:
            print(f"note: memory plan: {pipeline.memory_plan.summary()}", file=sys.stderr)
        if pipeline.source.notice:
            print(f"note: {pipeline.source.notice}", file=sys.stderr)
        if pipeline.engine_record.fallback_reason:
            print(f"note: {pipeline.engine_record.fallback_reason}", file=sys.stderr)
        show = _progress_printer(args.quiet)

        def on_event(index: int, event: Event) -> None:
            if index == 0:
                show(event)
            if isinstance(event, AudioPiece):
                _writing(outs[index], writers[index].write, event.samples)

        if count == 1:
            songs = [pipeline.generate(request, on_event=lambda event: on_event(0, event), continue_from=state)]
        else:
            songs = pipeline.generate_variations(request, count, on_event=on_event)
        for out, writer in zip(outs, writers):
            _writing(out, writer.close)
    except BaseException:
        for writer in writers:
            writer.discard()  # nothing half-made is left at --out: a failed or interrupted song leaves no file
        raise
    if args.state is not None:
        songs[0].state.save(args.state)
    for out, song in zip(outs, songs):
        stages = " ".join(f"{key}={value:.2f}" for key, value in song.timings.items())
        print(f"{out}")
        # This process's own peak on the GPU (memory.py), not the card's use with other programs on it.
        memory = f" device_peak_gb={song.memory['device_peak_gb']}" if song.memory else ""
        print(f"duration={song.duration:.2f}s frames={song.frames} seed={song.seed} engine={song.engine} "
              f"precision={song.precision} {stages}{memory}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # The CLI prints the engine's fallback sentence itself, as a note; without a handler Python's last-resort handler
    # would print the engine logger's warning of it a second time.
    logging.getLogger("music3_demo.engine").addHandler(logging.NullHandler())
    logging.getLogger("music3_demo.memory").addHandler(logging.NullHandler())  # (its sentence is the error line)
    for line in untested_warnings():
        print(f"warning: {line}", file=sys.stderr)
    try:
        return generate(args)
    except (InvalidRequest, CheckpointError, ValueError, OutOfMemory) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        print(f"error: {public_message(error)}", file=sys.stderr)  # one raised where no sentence was made for it
        return 2
    except KeyboardInterrupt:
        print("cancelled", file=sys.stderr)
        return 130
