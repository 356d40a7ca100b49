"""`python -m music3_demo generate` end to end on the built-in tiny model, in a real subprocess."""

from __future__ import annotations

import soundfile as sf
from cli_runs import run_cli, run_main


def test_generate_wav_and_report(tmp_path, tiny_folder):
    out = tmp_path / "song.wav"
    result = run_cli("generate", "--model", "tiny", "--prompt", "lofi hip hop, 80 BPM", "--lyrics",
                     "[verse]\nla la", "--duration", "2", "--steps", "2", "--seed", "7", "--out", str(out))
    assert result.returncode == 0, result.stderr
    info = sf.info(str(out))
    assert (info.samplerate, info.channels, info.subtype) == (44100, 2, "PCM_16")
    assert info.frames == int(50 * 3.4453125) * 512
    lines = result.stdout.strip().splitlines()
    assert lines[0] == str(out)
    assert "frames=50" in lines[1] and "seed=7" in lines[1] and "engine=reference" in lines[1]
    assert "semantic_s=" in lines[1] and "flow_s=" in lines[1] and "vocoder_s=" in lines[1]
    assert "random weights" in result.stderr  # the built-in model says its output is noise
    assert "[semantic] 50/50" in result.stderr


def test_flac_float_and_lyrics_file(tmp_path, tiny_folder):
    lyrics = tmp_path / "lyrics.txt"
    lyrics.write_text("[chorus]\n你好 世界\n", encoding="utf-8")
    flac = tmp_path / "song.flac"
    result = run_main("generate", "--model", "tiny", "--prompt", "c-pop", "--lyrics-file", str(lyrics),
                     "--duration", "1", "--steps", "1", "--seed", "1", "--out", str(flac), "--quiet")
    assert result.returncode == 0, result.stderr
    assert sf.info(str(flac)).format == "FLAC"
    wav = tmp_path / "float.wav"
    result = run_main("generate", "--model", "tiny", "--prompt", "ambient", "--instrumental", "--duration", "1",
                     "--steps", "1", "--seed", "1", "--out", str(wav), "--subtype", "FLOAT", "--quiet")
    assert result.returncode == 0, result.stderr
    data, rate = sf.read(str(wav), dtype="float32")
    assert sf.info(str(wav)).subtype == "FLOAT" and data.shape[1] == 2 and abs(data).max() > 0
    mp3 = tmp_path / "song.mp3"  # written progressively too, as pieces arrive
    result = run_main("generate", "--model", "tiny", "--prompt", "ambient", "--instrumental", "--duration", "1",
                     "--steps", "1", "--seed", "1", "--out", str(mp3), "--quiet")
    assert result.returncode == 0, result.stderr
    info = sf.info(str(mp3))
    assert info.format == "MP3" and info.channels == 2 and info.samplerate == 44100
    assert abs(info.duration - len(data) / rate) < 0.06  # the encoder's frame padding at most


def test_bad_input_exits_nonzero_with_the_sentence(tmp_path):
    cases = [
        (["--prompt", "pop", "--lyrics", "hi", "--duration", "500"], "Duration (seconds) must be between 1 and 360"),
        (["--prompt", "", "--lyrics", "hi"], "description is empty"),
        (["--prompt", "pop"], "switch on Instrumental"),
        (["--prompt", "pop", "--lyrics", "hi", "--steps", "0"], "Steps must be between 1 and 100"),
        (["--prompt", "pop", "--lyrics", "hi", "--out", str(tmp_path / "x.ogg")], "must end in .wav, .flac or .mp3"),
        (["--prompt", "pop", "--lyrics", "hi", "--out", str(tmp_path / "x.flac"), "--subtype", "FLOAT"],
         "FLAC cannot store FLOAT samples"),
        (["--prompt", "pop", "--lyrics", "hi", "--out", str(tmp_path / "x.wav"), "--subtype", "PCM_8"],
         "Unknown WAV sample format PCM_8"),
        (["--prompt", "pop", "--lyrics", "hi", "--out", str(tmp_path / "x.mp3"), "--subtype", "PCM_24"],
         "leave --subtype out for .mp3"),
        (["--prompt", "pop", "--lyrics-file", str(tmp_path / "none.txt")], "Cannot read the lyrics file"),
        (["--prompt", "pop", "--lyrics", "hi", "--model", str(tmp_path / "missing")], "does not exist"),
        (["--prompt", "pop", "--lyrics", "hi", "--engine", "graph", "--device", "cpu", "--model", "tiny"],
         "graph engine needs a CUDA GPU"),
        (["--prompt", "pop", "--lyrics", "hi", "--device", "cpu+cpu"], "A stage split needs two different GPUs"),
        (["--prompt", "pop", "--lyrics", "hi", "--device", "cuda:0+cuda:1"], "PyTorch sees no CUDA GPU"),
    ]
    for index, (args, message) in enumerate(cases):
        argv = ["generate", *args] + ([] if "--out" in args else ["--out", str(tmp_path / "o.wav")])
        result = run_cli(*argv) if index == 0 else run_main(*argv)  # the first as a shell sees it
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_variations_write_one_file_each_with_consecutive_seeds(tmp_path, tiny_folder):
    out = tmp_path / "song.wav"
    result = run_main("generate", "--model", "tiny", "--prompt", "lofi hip hop", "--instrumental", "--duration", "1",
                     "--steps", "1", "--seed", "7", "--variations", "2", "--out", str(out), "--quiet")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0::2] == [str(tmp_path / "song-v1.wav"), str(tmp_path / "song-v2.wav")]
    assert "seed=7" in lines[1] and "seed=8" in lines[3]
    assert not out.exists() and all(sf.info(str(tmp_path / f"song-v{i}.wav")).channels == 2 for i in (1, 2))
    refused = run_main("generate", "--model", "tiny", "--prompt", "lofi", "--instrumental", "--variations", "5",
                      "--out", str(tmp_path / "no.wav"))
    assert refused.returncode == 2 and "Variations must be between 1 and 4, got 5." in refused.stderr
    assert not list(tmp_path.glob("no*"))
