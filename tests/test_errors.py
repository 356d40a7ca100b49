"""Out of memory is one sentence, never a CUDA message: the sentences from plain figures, and a song that runs out of
memory at a real call site of the real tiny pipeline (semantic engine, DiT, vocoder, the flow executor) fails with
its sentence, leaves no thread behind, and the next song is the same song as without the fault; one in the
engine's self-check ends the load with its sentence (no fallback to the reference engine)."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from music3_demo import errors
from music3_demo.errors import DeviceOutOfMemory, is_cuda_message, is_out_of_memory, public_message
from music3_demo.request import GenerationRequest

GIB = 2**30
CUDA_OOM = ("CUDA out of memory. Tried to allocate 1.01 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
            "120.19 MiB is free.")
SONG = GenerationRequest("lofi hip hop, 80 BPM", "[verse]\nla la", duration=1.0, num_steps=2, seed=5)


def test_the_load_sentence_says_what_was_free_what_the_mode_needs_and_what_to_do():
    sentence = errors.load_sentence("cuda:0", "fp8", int(23.5 * GIB), int(24.6 * GIB),
                                    [("--precision int8", int(24.4 * GIB))], shorter=True)
    assert sentence == (
        "Not enough GPU memory on cuda:0 for loading the model in fp8: 23.5 GiB was free and fp8 needs about "
        "24.6 GiB; close other programs that use the GPU, start with --precision int8 (about 24.4 GiB) or make "
        "shorter songs.")
    # The modes that fit come first; with none to offer, the advice still names what to do.
    fits = errors.load_sentence("cuda:1", "bf16", 20 * GIB, 30 * GIB,
                                [("--precision fp8", 22 * GIB), ("--precision int8", 19 * GIB)], "warming up")
    assert "for warming up in bf16" in fits and "start with --precision int8 (about 19.0 GiB)" in fits
    assert "--precision fp8" not in fits
    assert errors.load_sentence("cuda:0", "bf16", None, None).endswith(
        "the free memory is unknown; close other programs that use the GPU.")


def test_the_load_sentence_takes_what_the_memory_plan_needs_and_the_cheaper_modes_from_their_plans():
    from music3_demo import random_models
    from music3_demo.loading import load_out_of_memory, plan_need
    from music3_demo.memory_plan import plan_memory

    figures, free = random_models.figures(random_models.FULL), int(30e9)
    plans = {modes: plan_memory(figures, free, (9, 0), *modes) for modes in
             [("bf16", "bf16"), ("fp8", "bf16"), ("fp8", "fp8"), ("bf16", "fp8"), ("int4", "bf16")]}
    needs = {modes: errors.gib(plan_need(plan)) for modes, plan in plans.items()}
    assert str(load_out_of_memory(torch.device("cuda", 0), plans["bf16", "bf16"], "warming up")) == (
        f"Not enough GPU memory on cuda:0 for warming up in bf16: 27.9 GiB was free and bf16 needs about "
        f"{needs['bf16', 'bf16']}; close other programs that use the GPU, start with --precision fp8 (about "
        f"{needs['fp8', 'bf16']}) or start with --precision fp8 --dit-precision fp8 (about {needs['fp8', 'fp8']}).")
    mixed = load_out_of_memory(torch.device("cuda", 0), plans["fp8", "bf16"])
    assert str(mixed).startswith("Not enough GPU memory on cuda:0 for loading the model in fp8 LM, bf16 DiT: ")
    # from a 1-byte LM: the fp8 DiT first (the LM keeps its accuracy), then the int4 LM
    assert str(mixed).endswith(f"start with --dit-precision fp8 (about {needs['fp8', 'fp8']}) or start with "
                               f"--precision int4 (about {needs['int4', 'bf16']}).")
    assert mixed.figures["need_bytes"] == plan_need(plans["fp8", "bf16"]) and mixed.during == "load"
    on_an_a100 = plan_memory(figures, free, (8, 0), "bf16", "bf16")  # no fp8 there: int8, and the DiT stays
    assert str(load_out_of_memory(torch.device("cuda", 0), on_an_a100)).endswith(
        f"close other programs that use the GPU, start with --precision int8 (about "
        f"{errors.gib(plan_need(plan_memory(figures, free, (8, 0), 'int8', 'bf16')))}) or start with --precision "
        f"int4 (about {errors.gib(plan_need(plan_memory(figures, free, (8, 0), 'int4', 'bf16')))}).")


def test_the_song_and_host_sentences():
    assert errors.song_sentence("cuda:0", "fp8", int(0.4 * GIB), int(22.1 * GIB)) == (
        "This song ran out of GPU memory on cuda:0 (0.4 GiB is free, this app holds 22.1 GiB, weights in fp8): "
        "try a shorter song or fewer songs at once, or close other programs that use the GPU.")
    assert errors.host_sentence("MiniMaxAI/MiniMax-Music3 on the CPU (float32)", 44 * GIB, 15 * GIB, True) == (
        "Loading MiniMaxAI/MiniMax-Music3 on the CPU (float32) needs about 44.0 GiB of host memory but 15.0 GiB is "
        "available: use --model tiny (a small built-in test model) or a machine with a CUDA GPU.")


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError(CUDA_OOM),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("Triton Error [CUDA]: out of memory"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to "
                 "allocate 44000000000 bytes."),
])
def test_every_form_of_out_of_memory_is_recognised_and_shown_as_a_sentence(error):
    assert is_out_of_memory(error)
    shown = public_message(error)
    assert not is_cuda_message(shown) and shown.startswith("The GPU ran out of memory: try a shorter song")


def test_other_cuda_messages_never_pass_and_ordinary_ones_do():
    illegal = RuntimeError("CUDA error: an illegal memory access was encountered\nCompile with `TORCH_USE_CUDA_DSA`")
    assert not is_out_of_memory(illegal)
    assert public_message(illegal) == "The GPU reported an error (the server log has the details); please try again."
    assert public_message(ValueError("top_k must be in 1..1024, got 0")) == "top_k must be in 1..1024, got 0"
    ours = DeviceOutOfMemory(errors.song_sentence("cuda:0", "bf16", GIB, 20 * GIB), "song", free_bytes=GIB)
    assert public_message(ours) == str(ours) and not is_cuda_message(str(ours))
    again = pickle.loads(pickle.dumps(ours))  # a ZeroGPU worker hands it back as a value
    assert type(again) is DeviceOutOfMemory and str(again) == str(ours)
    assert (again.during, again.figures) == ("song", {"free_bytes": GIB})


def _once(module: torch.nn.Module, monkeypatch) -> list[int]:
    """The module's next forward raises torch's out-of-memory error (once); returns the calls seen."""
    calls = []
    forward = module.forward

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError(CUDA_OOM)
        return forward(*args, **kwargs)

    monkeypatch.setattr(module, "forward", failing)
    return calls


@pytest.fixture(scope="module")
def clean_song(tiny_pipeline):
    return tiny_pipeline.generate(SONG)


@pytest.mark.parametrize("site", ["language_model.model", "transformer", "vocoder", "executor"])
def test_a_song_that_runs_out_of_memory_fails_with_a_sentence_and_the_next_song_is_whole(
        tiny_pipeline, clean_song, monkeypatch, site):
    if site == "executor":  # every DiT and vocoder call of the pipeline's songs passes here
        executor = tiny_pipeline.flow_executor
        calls = []
        execute = executor._execute

        def failing(group, bucket):
            calls.append(1)
            if len(calls) == 1:
                for pending in group:
                    pending._fail(torch.OutOfMemoryError(CUDA_OOM))
                return None
            return execute(group, bucket)

        monkeypatch.setattr(executor, "_execute", failing)
    else:
        component, _, part = site.partition(".")
        module = tiny_pipeline.components[component]
        calls = _once(getattr(module, part) if part else module, monkeypatch)
    with pytest.raises(DeviceOutOfMemory) as failed:
        tiny_pipeline.generate(SONG)
    assert calls and failed.value.during == "song"
    sentence = str(failed.value)
    assert sentence.startswith("This song ran out of memory on cpu") and not is_cuda_message(sentence)
    assert failed.value.__cause__ is None  # the CUDA text travels to the log only
    assert not [t for t in threading.enumerate() if t.name == "music3-flow"]  # its flow worker has ended
    again = tiny_pipeline.generate(SONG)
    assert again.frames == clean_song.frames and torch.equal(torch.from_numpy(again.audio),
                                                             torch.from_numpy(clean_song.audio))


def test_an_out_of_memory_in_the_engines_self_check_ends_the_load_with_its_sentence_not_a_fallback(
        tiny_folder, monkeypatch):
    """The reference engine would not fit either: auto does not fall back, the load fails with the load sentence."""
    from music3_demo.pipeline import Music3Pipeline
    from music3_demo.semantic import select

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError(CUDA_OOM)

    monkeypatch.setattr(select, "self_check", full)
    with pytest.raises(DeviceOutOfMemory) as failed:
        Music3Pipeline.from_pretrained("tiny", device="cpu", engine="auto", allow_interpreter=True)
    assert failed.value.during == "load", failed.value
    assert str(failed.value).startswith("Not enough memory on cpu for loading the model in float32: ")
    assert not is_cuda_message(str(failed.value))
