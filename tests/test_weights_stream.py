"""Loading tensor by tensor (weights_stream.py) gives exactly what the libraries' from_pretrained gives, the 1-byte
modes quantize as the weights arrive exactly as quantize_model_ does after a whole load, a checkpoint whose names do
not match falls back to the library, the fp8 DiT is the loaded DiT quantized, and a load the host has no room for is
refused in one sentence before anything is read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from music3_demo import cli, loading, memory, random_models, weights_stream
from music3_demo.checkpoint import load_components, resolve
from music3_demo.errors import HostOutOfMemory
from music3_demo.precision import PrecisionChoice

WEIGHTS = random_models.WEIGHT_COMPONENTS


def _library(folder, name, dtype):
    import diffusers
    import transformers

    library, class_name = json.loads((folder / "modular_model_index.json").read_text())[name][:2]
    cls = getattr({"diffusers": diffusers, "transformers": transformers}[library], class_name)
    return cls.from_pretrained(str(folder / name), dtype=torch.float32 if name == "vocoder" else dtype).eval()


def _same(a: torch.nn.Module, b: torch.nn.Module, name: str) -> None:
    left, right = a.state_dict(), b.state_dict()
    assert left.keys() == right.keys(), name
    for key, value in left.items():
        assert value.dtype == right[key].dtype and torch.equal(value, right[key]), f"{name}.{key}"
    buffers = dict(b.named_buffers())
    for key, value in a.named_buffers():  # computed ones too (rotary inverse frequencies)
        assert value.dtype == buffers[key].dtype and torch.equal(value, buffers[key]), f"{name}.{key}"
    assert not a.training


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_streamed_component_equals_the_librarys_from_pretrained(tiny_folder, dtype):
    streamed = load_components(tiny_folder, torch.device("cpu"), dtype)
    for name in WEIGHTS:
        _same(streamed[name], _library(tiny_folder, name, dtype), name)
    x = torch.randn(1, random_models.TINY.dit_channels, 30)  # the weight-normed vocoder's weights are recomputed
    assert torch.equal(streamed["vocoder"](x), _library(tiny_folder, "vocoder", dtype)(x))


@pytest.mark.parametrize("mode", ["fp8", "int8", "int4"])
def test_quantizing_as_the_weights_arrive_equals_quantizing_a_whole_model(tiny_folder, mode):
    from music3_demo.semantic.quant import QuantizedLinear, quantize_model_

    source = resolve("tiny")
    streamed = loading.load_model(source, torch.device("cpu"), torch.float32, PrecisionChoice(mode, mode, "test"))
    lm, depth = _library(tiny_folder, "language_model", torch.float32), _library(tiny_folder, "rvq_depth_decoder",
                                                                                torch.float32)
    whole = quantize_model_(lm, depth, mode, "cpu")
    assert whole.modules > 0
    _same(streamed["language_model"], lm, "language_model")
    _same(streamed["rvq_depth_decoder"], depth, "rvq_depth_decoder")
    swapped = [m for m in streamed["language_model"].modules() if isinstance(m, QuantizedLinear)]
    assert len(swapped) == sum(isinstance(m, QuantizedLinear) for m in lm.modules()) > 0


def test_int8_and_int4_loads_equalize_the_lms_columns_layer_by_layer_and_fp8_loads_do_not(tiny_folder):
    """The modes of precision.EQUALIZED: each streamed decoder layer is equalized once whole (its norms grown, its
    outlier columns shrunk) before its products are quantized; the depth decoder is never touched."""
    from music3_demo.precision import EQUALIZED

    assert EQUALIZED == ("int8", "int4")
    source = resolve("tiny")
    original = _library(tiny_folder, "language_model", torch.float32)
    for mode in ("fp8", "int8", "int4"):
        lm = loading.load_model(source, torch.device("cpu"), torch.float32,
                                PrecisionChoice(mode, mode, "test"))["language_model"]
        for got, loaded in zip(lm.model.layers, original.model.layers):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                grown = getattr(got, norm).weight / getattr(loaded, norm).weight
                if mode in EQUALIZED:
                    assert (grown >= 1 - 1e-6).all() and (grown > 1.01).any(), (mode, norm)
                else:
                    assert torch.equal(grown, torch.ones_like(grown)), (mode, norm)


def test_a_checkpoint_whose_names_do_not_match_loads_through_the_library(tiny_folder, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "model"
    shutil.copytree(tiny_folder, copy)
    path = copy / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(path))
    save_file(tensors | {"an_extra_tensor": torch.zeros(3)}, str(path), metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="music3_demo.loading"):
        streamed = load_components(copy, torch.device("cpu"), torch.float32)
    assert "the checkpoint has an_extra_tensor" in caplog.text
    _same(streamed["transformer"], _library(tiny_folder, "transformer", torch.float32), "transformer")


def test_the_host_need_counts_what_stays_on_the_cpu_and_the_largest_tensor_in_flight(tiny_folder):
    sizes = {name: weights_stream.tensor_sizes(tiny_folder / name) for name in WEIGHTS}
    numels = [(name, shape) for name in WEIGHTS for _, shape, _ in sizes[name]]
    largest = max(torch.Size(shape).numel() for _, shape in numels) * 4  # float32 files
    on_cpu = sum(torch.Size(shape).numel() * 4 for _, shape in numels)
    assert loading.host_need(tiny_folder, torch.device("cpu"), torch.float32) == on_cpu + 2 * largest
    # Onto a GPU nothing stays on the host: only the tensors in flight.
    assert loading.host_need(tiny_folder, torch.device("cuda", 0), torch.bfloat16) == 2 * largest


def test_a_load_the_host_has_no_room_for_is_refused_before_a_tensor_is_read(monkeypatch, tiny_folder, capsys,
                                                                           tmp_path):
    from music3_demo import checkpoint

    monkeypatch.setattr(memory, "host_available", lambda: 512 * 2**20)

    def read(*args):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(checkpoint, "file_tensors", read)
    with pytest.raises(HostOutOfMemory) as refused:
        loading.load_model(resolve("tiny"), torch.device("cpu"), torch.float32, PrecisionChoice("bf16", "auto", ""))
    assert str(refused.value).startswith("Loading tiny on the CPU in float32 needs about 0.1 GiB of host memory but "
                                         "0.5 GiB is available: use --model tiny")
    code = cli.main(["generate", "--model", "tiny", "--prompt", "lofi", "--instrumental", "--device", "cpu",
                     "--out", str(tmp_path / "never.wav")])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {refused.value}"


def test_the_host_check_uses_the_available_memory_and_lets_a_fitting_load_through(tiny_folder):
    assert memory.host_available() > 0
    memory.check_host_memory("tiny", 10 * 2**20, on_cpu=True)  # the real figure: tiny fits
    with pytest.raises(HostOutOfMemory, match=r"needs about 40.0 GiB of host memory but 16.0 GiB is available: "
                                              r"use --model tiny \(a small built-in test model\) or a machine with a "
                                              r"CUDA GPU"):
        memory.check_host_memory("the real model on the CPU in float32", 40 * 2**30, True, available=16 * 2**30)
    with pytest.raises(HostOutOfMemory, match="close other programs or use a machine with more memory"):
        memory.check_host_memory("the model onto cuda:0", 3 * 2**30, False, available=2 * 2**30)


def test_the_fp8_dit_streamed_and_quantized_at_load_is_the_loaded_dit_quantized(tiny_folder):
    """The fp8 DiT streams into host memory and quantize_dit puts it on the device block by block: the same modules
    and bytes as quantizing the library's whole DiT; onto a GPU its bf16 weights count in the host's need."""
    from music3_demo.flow.dit_fp8 import Fp8Linear, quantize_dit

    streamed = loading.load_model(resolve("tiny"), torch.device("cpu"), torch.float32,
                                  PrecisionChoice("float32", "bf16", "test"), dit="fp8")
    whole = _library(tiny_folder, "transformer", torch.float32)
    quantize_dit(whole, "cpu")
    _same(streamed["transformer"], whole, "transformer")
    assert sum(isinstance(m, Fp8Linear) for m in streamed["transformer"].modules()) > 0
    dit = sum(torch.Size(shape).numel() * 2 for _, shape, _ in weights_stream.tensor_sizes(tiny_folder / "transformer"))
    gpu, host = torch.device("cuda", 0), {"transformer": torch.device("cpu")}
    assert loading.host_need(tiny_folder, gpu, torch.bfloat16, host) == dit + loading.host_need(tiny_folder, gpu,
                                                                                               torch.bfloat16)


def test_a_plans_fp8_dit_waits_in_host_memory_until_it_is_placed():
    """from_pretrained loads the fp8 DiT's bf16 weights into host memory; the pipeline places it after the engine's
    self-check while this says it still waits (a bf16 plan's DiT, or one already on the device, never waits)."""
    from music3_demo import random_models
    from music3_demo.memory_layout import GB
    from music3_demo.memory_plan import plan_memory

    figures = random_models.figures(random_models.TINY)
    fp8 = plan_memory(figures, int(24 * GB), (9, 0), dit_precision="fp8")
    bf16 = plan_memory(figures, int(24 * GB), (9, 0), dit_precision="bf16")
    on_host = {"transformer": torch.nn.Linear(4, 4)}
    assert loading.fp8_dit_waiting(on_host, fp8)
    assert not loading.fp8_dit_waiting(on_host, bf16) and not loading.fp8_dit_waiting(on_host, None)
    on_meta = {"transformer": torch.nn.Linear(4, 4, device="meta")}  # (stands for one already on its GPU)
    assert not loading.fp8_dit_waiting(on_meta, fp8)


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_a_load_for_the_graph_engine_keeps_the_heads_audio_rows_and_the_embeddings_on_the_host(tiny_folder, mode):
    """lean_head: lm_head's text rows never stay on the device and the token embeddings go to host memory as they
    arrive; the reference computation on what is left (the self-check's oracle, a fallback engine) is the full
    model's on the audio rows, and the graph engine's prepared weights read the same rows (no second copy)."""
    from music3_demo.semantic.quant import AudioHead
    from music3_demo.semantic.teacher_forcing import random_codes, reference_teacher_forced
    from music3_demo.semantic.weights import HostEmbedding, prepare_weights

    source, choice = resolve("tiny"), PrecisionChoice(mode, mode, "test")
    full = loading.load_model(source, torch.device("cpu"), torch.float32, choice)
    lean = loading.load_model(source, torch.device("cpu"), torch.float32, choice, lean_head=True)
    lm, depth = lean["language_model"], lean["rvq_depth_decoder"]
    assert isinstance(lm.lm_head, AudioHead) and lm.lm_head.head is None
    assert lm.lm_head.audio.out_features == 16_385 and isinstance(lm.model.embed_tokens, HostEmbedding)
    assert "lm_head.weight" not in lm.state_dict()
    generator = torch.Generator().manual_seed(0)
    text_ids = torch.randint(0, 1000, (2, 12), generator=generator)
    codes = random_codes(4, generator, depth.config.num_codebooks, depth.config.audio_vocab_size)
    expected = reference_teacher_forced(full["language_model"], full["rvq_depth_decoder"], text_ids, codes)
    got = reference_teacher_forced(lm, depth, text_ids, codes)
    for value, reference in zip(got, expected):
        torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-5)
    weights = prepare_weights(lm, depth)
    head = weights.audio_head if mode == "bf16" else weights.audio_head.data
    module = lm.lm_head.audio.weight if mode == "bf16" else lm.lm_head.audio.qdata
    assert head.untyped_storage().data_ptr() == module.untyped_storage().data_ptr()


def test_a_large_random_weight_is_drawn_in_blocks_into_the_models_dtype(monkeypatch):
    """The built-in random models draw a weight over DRAW_BLOCK elements a block at a time, each block rounded into
    the model's dtype as it is drawn: a full-size table is never whole in float32 beside its bf16 copy (on a 12 GB
    card that transient was 2.6 GiB). The draws do not depend on the dtype: bf16 is the float32 model rounded."""
    from torch import nn

    monkeypatch.setattr(random_models, "DRAW_BLOCK", 1_000)
    model = nn.Sequential(nn.Embedding(300, 64), nn.Linear(64, 8, bias=True))  # 19,200 elements: 20 blocks
    drawn = {dtype: dict(random_models.random_tensors(model, torch.Generator().manual_seed(3), torch.device("cpu"),
                                                      dtype)) for dtype in (torch.float32, torch.bfloat16)}
    for name, value in drawn[torch.bfloat16].items():
        assert value.dtype == torch.bfloat16, name
        assert torch.equal(value, drawn[torch.float32][name].to(torch.bfloat16)), name
    table = drawn[torch.float32]["0.weight"]  # (std 64 ** -0.5: its name is not an embedding's)
    assert 0.11 < table.std().item() < 0.14 and not torch.equal(table[:15], table[15:30])  # every block its own draws


def test_a_weight_placed_elsewhere_stays_there_while_the_computed_buffers_come_to_the_device():
    """fill's last step moves only the buffers a module computed at init: a load for the graph engine keeps the
    token embeddings in host memory, and `model.to(device)` there put the 1.4 GB table back on a 12 GB card. (The
    CPU's stand-in for another device: `meta`.)"""
    from torch import nn

    model = nn.Linear(4, 2)
    model.register_buffer("computed", torch.arange(3.0))
    weights_stream.buffers_to(model, "meta")
    assert model.weight.device.type == "cpu" and model.computed.device.type == "meta"


def test_tables_a_place_function_takes_in_host_memory_never_reach_the_device():
    """fill's `on_host`: the named tensors reach the place function in host memory, the rest on the device (the CPU's
    stand-in for a GPU: `meta`); a lean-head load names lm_head and the token embeddings, so the load's peak on the
    card holds neither 1.4-GB table (it used to take each whole onto the card before cutting or moving it)."""
    from torch import nn

    model = weights_stream.skeleton(lambda: nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 4)))
    arrived = {}

    def place(name, tensor):  # takes every tensor (a module left on meta would count as not loaded)
        arrived[name] = tensor.device.type
        owner, attribute = name.split(".")
        setattr(model[int(owner)], attribute, nn.Parameter(torch.zeros(tensor.shape), requires_grad=False))
        return True

    tensors = random_models.random_tensors(model, torch.Generator().manual_seed(0), torch.device("cpu"))
    weights_stream.fill(model, tensors, "meta", torch.float32, place, on_host=frozenset({"0.weight"}))
    assert arrived == {"0.weight": "cpu", "1.weight": "meta", "1.bias": "meta"}
    assert loading.LEAN_ON_HOST == {"lm_head.weight", "model.embed_tokens.weight"}


def test_a_random_table_drawn_into_host_memory_is_the_one_drawn_on_the_device(monkeypatch):
    """random_tensors' `on_host`: the same numbers from the same generator, block by block into host memory."""
    from torch import nn

    monkeypatch.setattr(random_models, "DRAW_BLOCK", 1_000)
    model = nn.Sequential(nn.Embedding(300, 64), nn.Linear(64, 8))
    on_device = dict(random_models.random_tensors(model, torch.Generator().manual_seed(5), torch.device("cpu"),
                                                  torch.bfloat16))
    on_host = dict(random_models.random_tensors(model, torch.Generator().manual_seed(5), torch.device("cpu"),
                                                torch.bfloat16, on_host=frozenset({"0.weight", "1.bias"})))
    for name, value in on_device.items():
        assert on_host[name].dtype == torch.bfloat16 and torch.equal(on_host[name], value), name


def test_a_per_code_table_is_built_block_by_block_into_its_own_rows():
    """The engine's per-code tables (made a block of codes at a time on the weights' device) are written into one
    table as each block is made: never the table twice, nor every block beside it (on a small card the tables go to
    pinned host memory, 0.15 GB of it as a second copy at load before). A wrong row count is refused."""
    import gc
    import weakref

    from music3_demo.semantic.weights import _table

    made = []

    def blocks():
        for i in range(6):
            gc.collect()
            assert sum(ref() is not None for ref in made) <= 1, f"{len(made)} blocks made, earlier ones still held"
            block = torch.full((5, 3), float(i))
            made.append(weakref.ref(block))
            yield block

    table = _table(blocks(), 30, on_host=False)
    assert table.shape == (30, 3) and torch.equal(table[:, 0], torch.arange(6.0).repeat_interleave(5))
    with pytest.raises(ValueError, match="29 rows"):
        _table(iter([torch.zeros(29, 3)]), 30, on_host=False)


def test_a_plans_int4_choice_with_8_bit_first_layers_loads_them_at_8_bits():
    """The plan's int4 LM with its first layers at the depth decoder's 8 bits (`PrecisionChoice.first_layers`,
    memory_plan): the streamed load quantizes those layers so, the rest at int4, and the report names them."""
    from music3_demo.semantic.quant import QuantizedLinear

    lm = loading.load_model(resolve("tiny"), torch.device("cpu"), torch.float32,
                            PrecisionChoice("int4", "auto", "test", first_layers=1))["language_model"]
    kinds = [{m.fmt for m in layer.modules() if isinstance(m, QuantizedLinear)} for layer in lm.model.layers]
    assert kinds == [{"int8"}] + [{"int4"}] * (len(kinds) - 1) and len(kinds) >= 2
