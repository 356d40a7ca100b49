"""The precision modes on every surface: the figures the memory plan starts from (read from a checkpoint's headers),
a quantized load of the tiny model, the names of unquantized weights on a CPU, and unknown modes refused before a
load. What auto picks per card is tests/test_memory_plan.py's."""

from __future__ import annotations

import pytest
import torch

from music3_demo import random_models
from music3_demo.checkpoint import model_figures, resolve

def test_figures_read_from_a_checkpoints_headers_equal_the_models_own(tiny_folder):
    figures = model_figures(resolve("tiny"))
    assert figures == random_models.figures(random_models.TINY)
    assert min(figures.lm_blocks, figures.depth_blocks, figures.dit_blocks, figures.trimmed, figures.vocoder) > 0


def test_a_bf16_built_in_model_equals_the_float32_one_rounded():
    """random_models builds bf16 weights directly (no float32 model in memory): the same numbers as before."""
    direct = random_models.build_components(random_models.TINY, seed=3, dtype=torch.bfloat16)
    rounded = random_models.build_components(random_models.TINY, seed=3, dtype=torch.float32)
    for name in random_models.WEIGHT_COMPONENTS:
        expected = rounded[name].to(torch.bfloat16).state_dict()
        for key, value in direct[name].state_dict().items():
            assert torch.equal(value, expected[key]), f"{name}.{key}"


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
    with pytest.raises(ValueError, match="Unknown DiT precision 'int8': choose one of auto, bf16, fp8"):
        Music3Pipeline.from_pretrained("tiny", device="cpu", dit_precision="int8")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--model", "tiny", "--prompt", "x", "--precision", "fp16"])
    assert exit_info.value.code == 2
