"""The semantic bench's CPU-side parts: engine names it accepts, and the bytes a frame must read (its limit)."""

from __future__ import annotations

import pytest

from music3_demo.bench.semantic import _parts, bytes_model, graph_variant, main, quantized_copy


def test_bench_engine_names_map_to_graph_engine_options():
    assert graph_variant("graph") == {"pdl": False, "chain": None}  # the engine's default
    assert graph_variant("graph-pdl-s8") == {"pdl": True, "chain": None, "attention_splits": 8}
    assert graph_variant("graph-chain-s32") == {"pdl": False, "chain": True, "attention_splits": 32}
    assert graph_variant("graph-unchained") == {"pdl": False, "chain": False}
    assert graph_variant("graph-chain-lm") == {"pdl": False, "chain": "lm"}  # the depth decoder's tails unchained
    assert graph_variant("graph-chain-depth-s8") == {"pdl": False, "chain": "depth", "attention_splits": 8}
    assert graph_variant("graph-s8-kv8") == {"pdl": False, "chain": None, "attention_splits": 8, "kv_format": "int8"}
    assert graph_variant("graph-own-input") == {"pdl": False, "chain": None, "hand_over": False}
    assert graph_variant("graph-hand-over") == {"pdl": False, "chain": None, "hand_over": True}
    with pytest.raises(ValueError, match="unknown engine 'graph-pdl-chain'"):
        graph_variant("graph-pdl-chain")
    with pytest.raises(ValueError, match="unknown engine 'graph-fast'"):
        graph_variant("graph-fast")
    with pytest.raises(SystemExit):  # refused before anything touches a GPU
        main(["--engine", "reference,graph-x"])
    # `--compare-tuning`: an engine of the same weights on a second table, named with a suffix
    assert _parts("graph-s8:int8@compare") == (("graph-s8", "int8"), "@compare")
    assert _parts("graph") == (("graph", "bf16"), "") and _parts("graph@compare") == (("graph", "bf16"), "@compare")
    assert _parts("graph:int4+int8@compare") == (("graph", "int4+int8"), "@compare")
    with pytest.raises(SystemExit):
        main(["--precision", "int4+int4"])


def test_bench_int4_engines_name_their_depth_decoders_format():
    """`--precision int4+int8` / `int4+fp8`: an int4 LM with the depth decoder in that format's default scheme,
    whatever the GPU's own choice (`precision.depth_mode`), so one call times both beside each other; so does a
    1-byte mode with "-words" against column order, and "int4-firstN" (its first N LM layers at the depth
    decoder's 8 bits) against plain int4."""
    import torch

    from music3_demo import random_models

    components = random_models.build_components(random_models.TINY, seed=0)
    lm, depth = components["language_model"], components["rvq_depth_decoder"]
    schemes = {mode: quantized_copy(lm, depth, mode, torch.device("cpu"))[2].scheme
               for mode in ("int4", "int4+int8", "int4+fp8", "int4-first2+fp8")}
    assert schemes == {"int4": "int4/g16, depth int8/g16", "int4+int8": "int4/g16, depth int8/g16",
                       "int4+fp8": "int4/g16, depth fp8/channel",
                       "int4-first2+fp8": "int4/g16, depth fp8/channel, LM layers 0-1 fp8/channel"}
    # "-words": the 1-byte weights in byte MMA order, which no GPU takes by default
    lm_q, depth_q, report = quantized_copy(lm, depth, "int8-words", torch.device("cpu"))
    assert report.scheme == "int8/g16" and lm_q.model.layers[0].mlp.down_proj.ordered
    assert not quantized_copy(lm, depth, "int8", torch.device("cpu"))[0].model.layers[0].mlp.down_proj.ordered


def test_bench_bytes_model_counts_the_engines_weights_and_cache(one_block_models):
    from music3_demo.semantic.graph import GraphEngine

    lm, depth = one_block_models
    engine = GraphEngine(lm, depth, "cpu", attention_splits=2)
    engine.text_embeddings_to_host()  # as graph pipelines do: the model must not read the moved table
    model = bytes_model(engine)
    config = lm.config
    kv = config.num_hidden_layers * 2 * 2 * config.num_key_value_heads * engine.weights.head_dim * 4  # float32 here
    assert model.kv_per_position == kv
    int8 = GraphEngine(lm, depth, "cpu", attention_splits=2, kv_format="int8")
    assert bytes_model(int8).kv_per_position == kv // 4 // engine.weights.head_dim * (engine.weights.head_dim + 4)
    assert model.lm > sum(p.numel() for p in lm.model.layers.parameters()) * 4
    weights = engine.weights
    assert model.depth > (weights.num_codebooks - 1) * sum(b.qkv.numel() for b in weights.depth_blocks) * 4


def test_bench_engines_hold_their_longest_song_and_no_more(one_block_models):
    """Each bench engine's KV pool is fixed at the run's longest song (the timed one or the warm-up), not a share of
    the free memory: five engines sized from the free memory took an 80 GB card, so twelve did not fit."""
    from music3_demo.bench.semantic import WARMUP_FRAMES, bench_pool_positions
    from music3_demo.semantic.graph import GraphEngine
    from music3_demo.semantic.scheduler import PARKING, song_positions

    pool = bench_pool_positions([40, 24], 30)
    assert pool == song_positions(40, 30) + PARKING
    assert bench_pool_positions([40], 3) == song_positions(40, WARMUP_FRAMES) + PARKING
    lm, depth = one_block_models
    engine = GraphEngine(lm, depth, "cpu", attention_splits=2, kv_pool_positions=pool)
    engine.reserve(40, 30)
    assert engine._state.pool_positions == pool  # as given: a longer pool would take memory from the next engine
