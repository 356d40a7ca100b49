"""What `--precision auto` picks from the free memory and the GPU's architecture (figures faked: a pure function), the
memory estimate it decides from, and the README's table of it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from music3_demo import random_models
from music3_demo.checkpoint import model_figures, resolve
from music3_demo.precision import HEADROOM, Footprint, choose_precision

FULL = Footprint(random_models.figures(random_models.FULL))
GB = 10**9
README = Path(__file__).resolve().parents[1] / "README.md"

# Free GB -> (pick on a GPU without fp8, e.g. sm_80 A100 / sm_86 RTX 3090; pick on sm_89 and newer).
EXPECTED = {16: ("int8", "fp8"), 24: ("int8", "fp8"), 48: ("bf16", "bf16"), 80: ("bf16", "bf16")}


@pytest.mark.parametrize("free_gb", sorted(EXPECTED))
@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_auto_picks_bf16_where_the_longest_song_fits_else_the_best_quantized_mode(free_gb, capability):
    choice = choose_precision("auto", free_gb * GB, capability, FULL)
    assert choice.mode == EXPECTED[free_gb][capability >= (8, 9)]
    assert choice.requested == "auto"
    assert f"{free_gb:.1f} GB" in choice.reason  # the reason names the figures it decided from


def test_the_bf16_threshold_is_the_longest_songs_need_plus_headroom():
    need = FULL.need("bf16")
    assert 24 * GB < need * (1 + HEADROOM) < 48 * GB  # what makes the table above what it is
    assert choose_precision("auto", int(need * (1 + HEADROOM)) + 1, (9, 0), FULL).mode == "bf16"
    assert choose_precision("auto", int(need * (1 + HEADROOM)) - 1, (9, 0), FULL).mode == "fp8"


def test_a_quantized_pick_says_whether_the_longest_song_fits():
    assert "may run out of memory" in choose_precision("auto", 16 * GB, (8, 9), FULL).reason
    assert "may run out" not in choose_precision("auto", 24 * GB, (8, 9), FULL).reason
    assert "no fp8 before sm_89: this GPU is sm_86" in choose_precision("auto", 16 * GB, (8, 6), FULL).reason


def test_explicit_modes_are_kept_and_fp8_without_hardware_support_is_refused_with_the_way_out():
    for mode in ("bf16", "fp8", "int8"):
        choice = choose_precision(mode, 80 * GB, (9, 0), FULL)
        assert (choice.mode, choice.requested) == (mode, mode)
    with pytest.raises(ValueError, match="sm_89 or newer.*sm_86: use --precision int8"):
        choose_precision("fp8", 80 * GB, (8, 6), FULL)
    with pytest.raises(ValueError, match="choose one of auto, bf16, fp8, int8"):
        choose_precision("fp4", 80 * GB, (9, 0), FULL)


def test_off_the_gpu_auto_keeps_the_weights_unquantized():
    assert choose_precision("auto", None, None, None).mode == "bf16"
    assert choose_precision("int8", None, None, None).mode == "int8"  # the CPU path quantizes when asked


def test_the_estimate_halves_the_block_weights_and_sizes_the_kv_cache_to_the_song():
    figures = FULL.figures
    saved = FULL.song_bytes("bf16") - FULL.song_bytes("fp8")
    assert 0.45 * 2 * figures.quantizable < saved < 0.5 * 2 * figures.quantizable  # 1 byte + scales, not 2
    # 36 layers x (k, v) x 2 CFG rows x 8 heads x 128 x bf16 per position; capacity rounded up to 256 positions.
    assert FULL.kv_bytes(3000) == 36 * 2 * 2 * 8 * 128 * 2 * 3072
    assert FULL.song_bytes("fp8", 3400) < FULL.song_bytes("fp8", 7900) < FULL.song_bytes("fp8")


def test_figures_read_from_a_checkpoints_headers_equal_the_models_own(tiny_folder):
    figures = model_figures(resolve("tiny"))
    assert figures == random_models.figures(random_models.TINY)
    assert figures.quantizable > 0 and figures.trimmed > 0 and figures.flow > 0


def test_a_bf16_built_in_model_equals_the_float32_one_rounded():
    """random_models builds bf16 weights directly (no float32 model in memory): the same numbers as before."""
    direct = random_models.build_components(random_models.TINY, seed=3, dtype=torch.bfloat16)
    rounded = random_models.build_components(random_models.TINY, seed=3, dtype=torch.float32)
    for name in random_models.WEIGHT_COMPONENTS:
        expected = rounded[name].to(torch.bfloat16).state_dict()
        for key, value in direct[name].state_dict().items():
            assert torch.equal(value, expected[key]), f"{name}.{key}"


def test_the_readme_states_what_auto_picks():
    table = README.read_text(encoding="utf-8").split("<!-- precision-auto-table -->")[1]
    rows = dict(re.findall(r"^\| (\d+) GB \| (.+?) \|$", table, flags=re.M))
    assert {int(free): picks for free, picks in rows.items()} == {
        free: f"{without} | {with_fp8}" for free, (without, with_fp8) in EXPECTED.items()
    }


def test_a_quantized_load_of_the_tiny_model_runs_songs_and_every_surface_names_its_precision(tiny_folder):
    """The same loading path as a real checkpoint: LM and depth decoder read into host memory, quantized by
    semantic.quant onto the device (the CPU here), the reference engine reading the dequantized weights."""
    from music3_demo.events import Song
    from music3_demo.request import GenerationRequest
    from music3_demo.semantic.quant import QuantizedLinear
    from music3_demo.ui.assets import banner_html
    from music3_demo.serve.holder import ModelHolder
    from music3_demo.ui.report import report_markdown, song_report
    from music3_demo.serve.runner import JobRecord

    holder = ModelHolder("tiny", ["cpu"], "reference", warmup=False, precision="int8")
    holder.preload(background=False)
    status = holder.status()
    assert (status.precision, status.precision_reason) == ("int8", "int8 as asked (--precision int8).")
    assert "<code>int8</code> weights" in banner_html(status) and "int8 as asked" in banner_html(status)
    with holder.acquire() as lease:
        lm = lease.pipeline.components["language_model"]
        assert isinstance(lm.model.layers[0].mlp.down_proj, QuantizedLinear)
        assert lm.model.layers[0].mlp.down_proj.fmt == "int8"
        song: Song = lease.pipeline.generate(GenerationRequest("x", "[verse]\nla", duration=1.0, num_steps=1, seed=2))
    assert (song.precision, song.memory) == ("int8", None)  # no device memory to report on a CPU
    report = song_report(song, GenerationRequest("x", "[verse]\nla"), JobRecord(1, 1.0, device="cpu"), "tiny")
    assert report["precision"] == "int8" and "`int8` weights" in report_markdown(report)
    holder.release()


def test_unquantized_weights_on_a_cpu_are_named_float32_on_every_surface(tiny_folder):
    """A CPU runs unquantized weights in float32: the banner, the song and the CLI's note must not say bf16."""
    from music3_demo.pipeline import Music3Pipeline
    from music3_demo.ui.assets import banner_html
    from music3_demo.serve.holder import ModelHolder

    holder = ModelHolder("tiny", ["cpu"], "reference", warmup=False)
    holder.preload(background=False)
    status = holder.status()
    assert (status.precision, status.precision_reason) == ("float32", "No GPU: the weights stay unquantized (float32 "
                                                                      "on a CPU).")
    assert "<code>float32</code> weights" in banner_html(status) and "bf16" not in banner_html(status)
    holder.release()
    asked = Music3Pipeline.from_pretrained("tiny", device="cpu", engine="reference", precision="bf16").precision
    assert (asked.mode, asked.requested) == ("float32", "bf16")
    assert asked.reason == "bf16 was asked; on this device the unquantized weights run in float32."


def test_an_unknown_precision_is_refused_before_loading():
    from music3_demo import cli
    from music3_demo.pipeline import Music3Pipeline

    with pytest.raises(ValueError, match="choose one of auto, bf16, fp8, int8"):
        Music3Pipeline.from_pretrained("tiny", device="cpu", precision="fp16")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--model", "tiny", "--prompt", "x", "--precision", "fp16"])
    assert exit_info.value.code == 2
