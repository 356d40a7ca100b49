"""The whole graph engine on the tiny model under Triton's interpreter: teacher forcing against the reference, a song
through a wrapping frame ring, and engine selection errors."""

from __future__ import annotations

import kernel_cases  # noqa: F401 - first: checks Triton's interpreter is on
import pytest
import torch

from music3_demo.semantic import resolve_engine_name
from music3_demo.semantic.config import GraphConfig
from music3_demo.semantic.kernels import GemvConfig
from music3_demo.semantic.teacher_forcing import random_codes, reference_teacher_forced, relative_error


@pytest.mark.parametrize("variant", ["plain", "text_embeddings_on_host", "split_k", "chain", "chain_lm", "chain_depth",
                                     "int8_kv"])
def test_graph_engine_matches_the_reference_under_teacher_forcing(tiny_models, one_block_models, variant,
                                                                  monkeypatch):
    from music3_demo.semantic import frame_graph
    from music3_demo.semantic.graph import GraphEngine
    from music3_demo.semantic.kernels import linear

    # two blocks where the blocks' chaining is what is tested; one where it is not (half the interpreter's time)
    lm, depth = tiny_models if variant.startswith(("plain", "chain")) else one_block_models
    kv = "int8" if variant == "int8_kv" else "bf16"
    # int8_kv: the prompt prefilled in chunks of 4, each attending to the int8 K/V before it, as frames do
    config = GraphConfig(prefill_chunk=4 if variant == "int8_kv" else 512, kv_format=kv)
    chain = {"chain": True, "chain_lm": "lm", "chain_depth": "depth"}.get(variant, False)
    engine = GraphEngine(lm, depth, "cpu", attention_splits=2, chain=chain, config=config)
    # one stack chained: its tails run and the other's products launch one at a time
    assert engine.chain == {True: {"lm", "depth"}, False: set()}.get(chain, {chain})
    tails = []  # the o weight of every chained tail launched
    real_tail = frame_graph.block_tail
    monkeypatch.setattr(frame_graph, "block_tail", lambda *args, **kw: (tails.append(args[4]), real_tail(*args, **kw)))
    if variant == "split_k":  # every product split (K is 32, 48 or 64 here), through the engine's workspace
        monkeypatch.setattr(linear, "default_config",
                            lambda m, n, k, swiglu=False: GemvConfig(256, 16, split_k=2 if k % 32 == 0 else 3))
    if variant == "text_embeddings_on_host":
        table = lm.model.embed_tokens.weight.data_ptr()
        engine.text_embeddings_to_host()
        assert lm.model.embed_tokens.weight.data_ptr() == table  # moved (to the CPU it is on here), not copied
        assert engine.weights.semantic_embed.data_ptr() != table  # the per-frame rows stay put
    generator = torch.Generator().manual_seed(20)
    text_ids = torch.randint(0, 250, (2, 10), generator=generator)
    codes = random_codes(3, generator)
    logits, frames = engine.teacher_forced(text_ids, codes)
    ref_logits, ref_frames = reference_teacher_forced(lm, depth, text_ids, codes, kv)
    assert relative_error(logits, ref_logits).max() < 1e-5
    assert relative_error(frames, ref_frames).max() < 1e-5
    if kv == "int8":  # the format's rounding is visible: the reference without it differs by far more
        assert engine._state.kv.dtype == torch.int8
        plain_logits, _ = reference_teacher_forced(lm, depth, text_ids, codes)
        assert relative_error(logits, plain_logits).max() > 1e-4
    assert torch.equal(engine._state.codes[0, :3].long(), codes)
    stacks = {"lm": engine.weights.blocks, "depth": engine.weights.depth_blocks}
    chained = {stack for stack, blocks in stacks.items() if any(t is b.o for t in tails for b in blocks)}
    assert chained == engine.chain
    if variant == "split_k":
        assert engine._state.gemv_workspace.counters.numel() > 0 and not engine._state.gemv_workspace.counters.any()


def test_graph_engine_song_through_a_wrapping_frame_ring_equals_teacher_forcing(one_block_models):
    """A song's yielded frames (copied out of a 2-row ring that wraps) equal the frames teacher forcing makes
    from the song's own codes (copied out step by step)."""
    from music3_demo.semantic import SamplingSettings
    from music3_demo.semantic.config import GraphConfig
    from music3_demo.semantic.graph import GraphEngine

    ring = GraphConfig(replay_block=1, in_flight=0, frame_ring=2, attention_splits=2)
    engine = GraphEngine(*one_block_models, "cpu", config=ring)
    text_ids = torch.randint(0, 250, (2, 6), generator=torch.Generator().manual_seed(21))
    run = engine.frames(text_ids, 4, SamplingSettings(), torch.Generator().manual_seed(22))
    song = torch.cat(list(run))
    assert song.shape[0] == run.stats.frames == 4  # the tiny model's end row is not boosted: full length
    codes = run.codes().long()
    _, forced = engine.teacher_forced(text_ids, codes)
    assert torch.equal(song, forced)


def test_graph_engine_needs_cuda(tiny_models, monkeypatch):
    from music3_demo.pipeline import Music3Pipeline
    from music3_demo.semantic.graph import GraphEngine

    with pytest.raises(ValueError, match="graph engine needs a CUDA GPU"):
        resolve_engine_name("graph", torch.device("cpu"))
    assert resolve_engine_name("auto", torch.device("cpu")) == "reference"
    assert resolve_engine_name("auto", torch.device("cuda")) == "graph"
    with pytest.raises(ValueError, match="Unknown engine 'fast'"):
        resolve_engine_name("fast", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        Music3Pipeline.from_pretrained("tiny", device="cpu", engine="graph")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        GraphEngine(*tiny_models, "cpu")


def test_graph_config_refuses_an_unknown_stack_to_chain_and_chained_tails_with_pdl():
    assert GraphConfig(chain="depth").chain == "depth"
    with pytest.raises(ValueError, match="chain must be True, False, None or one of lm, depth"):
        GraphConfig(chain="both")
    with pytest.raises(ValueError, match="take no PDL"):
        GraphConfig(chain="lm", pdl=True)


@pytest.mark.parametrize("precision, chained", [("bf16", {"lm", "depth"}), ("int4", set()), ("int8", set())])
def test_a_gpu_engine_chains_the_block_tails_of_bf16_stacks_only(precision, chained):
    """Where `GraphConfig.chain` is None a GPU engine chains the stacks on bf16 weights and runs quantized ones one
    launch per product (measured faster); the meta engine that precompile and the compile test record is that
    engine. The chained tail takes bf16 weights only: asked to chain a quantized stack, the engine refuses."""
    from music3_demo.semantic.arch_record import meta_engine
    from music3_demo.semantic.kernels.tuning import Target, tuning_for_target

    tuning = tuning_for_target(Target("NVIDIA H200", 90, 132))
    assert meta_engine(tuning, precision, "tiny").chain == chained
    if precision == "bf16":
        assert meta_engine(tuning, precision, "tiny", chain=True).chain == {"lm", "depth"}
    else:
        with pytest.raises(ValueError, match="bf16 weights only"):
            meta_engine(tuning, precision, "tiny", chain=True)
    from music3_demo.semantic.config import resolve_chain

    assert resolve_chain(None, True, frozenset({"lm"})) == {"depth"}  # (an int4 LM beside a bf16 depth decoder)
    assert resolve_chain("depth", True, frozenset({"lm"})) == {"depth"}
    with pytest.raises(ValueError, match="lm has quantized weights"):
        resolve_chain("lm", False, frozenset({"lm"}))
    assert resolve_chain(None, False, frozenset()) == frozenset()  # (the interpreter: one launch per product)


@pytest.mark.parametrize("gpu, precision, handed", [
    ("NVIDIA H200", "int4", {"lm", "depth"}), ("NVIDIA H200", "fp8", {"lm", "depth"}),
    ("NVIDIA H200", "int8", {"depth"}), ("NVIDIA H100 80GB HBM3", "int8", {"lm", "depth"}),
    ("NVIDIA H100 80GB HBM3", "int4", {"lm", "depth"})])
def test_products_launched_alone_take_their_input_handed_over_but_an_int8_lms_on_a_table_swept_without(
        gpu, precision, handed):
    """Where `GraphConfig.hand_over` is None every stack hands its products their inputs, but an int8 LM where the
    tuning table was swept with each product preparing its own input (the H200's: measured slower there, faster on
    int4 and fp8); the H100's table was swept with the inputs handed over. True and False ask for every stack and
    none, as the bench's A/B does."""
    from music3_demo.semantic.arch_record import meta_engine
    from music3_demo.semantic.config import resolve_hand_over
    from music3_demo.semantic.kernels.tuning import Target, tuning_for_target

    tuning = tuning_for_target(Target(gpu, 90, 132))
    assert tuning.handed_inputs == (gpu != "NVIDIA H200")
    assert meta_engine(tuning, precision, "tiny").hand_over == handed
    assert resolve_hand_over(True, "int8") == {"lm", "depth"} and resolve_hand_over(False, "int4") == frozenset()


def test_the_precompile_records_an_int4_lm_with_its_first_layers_at_8_bits_as_the_plan_loads_it():
    """The meta engine the precompile records for a plan's int4 LM with 8-bit first layers (`first_layers`) holds
    them in the depth decoder's format for the target (fp8 on sm_90), as the card's load quantizes them."""
    from music3_demo.semantic.arch_record import meta_engine
    from music3_demo.semantic.kernels.tuning import Target, tuning_for_target

    tuning = tuning_for_target(Target("NVIDIA H200", 90, 132))
    engine = meta_engine(tuning, "int4", "tiny", first_layers=1)
    assert [block.o.kind for block in engine.weights.blocks] == ["fp8"] + ["int4"] * (len(engine.weights.blocks) - 1)
    assert {block.o.kind for block in meta_engine(tuning, "int4", "tiny").weights.blocks} == {"int4"}
