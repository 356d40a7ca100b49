"""GPU: the graph engine against the reference computation (teacher forcing, full-size random weights, bf16), the
on-device sampler's distribution (chi-square, also through a replayed graph with a registered generator), graph
reuse across songs, the end-token stop, cancel."""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch

from music3_demo import random_models
from music3_demo.bench.semantic import random_prompt
from music3_demo.semantic import Cancelled, SamplingSettings
from music3_demo.semantic.config import GraphConfig
from music3_demo.semantic.graph import GraphEngine
from music3_demo.semantic.weights import AUDIO_CODES
from music3_demo.semantic.kernels import cfg_sample
from music3_demo.semantic.teacher_forcing import random_codes, reference_teacher_forced, relative_error
from music3_demo.semantic.sampling import guide, reference_semantic_logits

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
END = AUDIO_CODES - 1  # the end token's index in the engine's audio logits


def _models(sizes: random_models.ModelSizes, seed: int = 0):
    components = random_models.build_components(sizes, seed=seed, device=DEVICE, dtype=torch.bfloat16)
    return components["language_model"], components["rvq_depth_decoder"]


@pytest.fixture(scope="module")
def full():
    lm, depth = _models(random_models.FULL)
    engine = GraphEngine(lm, depth, DEVICE)
    yield lm, depth, engine
    engine.release()


def _float32_copies(lm, depth, room):
    """float32 copies of both models for a reference (`room`: the `float32_room` check, which may skip)."""
    room(sum(p.numel() for model in (lm, depth) for p in model.parameters()))
    return copy.deepcopy(lm).float(), copy.deepcopy(depth).float()


def _song(engine: GraphEngine, text_ids: torch.Tensor, frames: int, seed: int, top_k: int = 50) -> torch.Tensor:
    generator = torch.Generator(DEVICE).manual_seed(seed)
    blocks = list(engine.frames(text_ids, frames, SamplingSettings(top_k=top_k), generator))
    return torch.cat(blocks) if blocks else torch.empty(0, device=DEVICE)


def test_teacher_forced_logits_and_hiddens_match_reference(full, float32_room):
    """Same codes fed to both. The oracle is the reference computation in float32 on the same (bf16) weights; the
    bf16 reference's own distance from it is printed beside ours: over 36 random layers bf16 rounding alone moves
    the logits by ~1.5e-2, so both bf16 implementations are compared with the exact computation."""
    assert full[2].chain  # the default GPU engine chains its block tails: this is the path under test
    lm, depth, engine = full
    text_ids = random_prompt(300, seed=3, device=DEVICE)
    codes = random_codes(201, torch.Generator().manual_seed(4))
    logits, frames = engine.teacher_forced(text_ids, codes)
    bf16 = reference_teacher_forced(lm, depth, text_ids, codes)
    exact = reference_teacher_forced(*_float32_copies(lm, depth, float32_room), text_ids, codes)
    torch.cuda.empty_cache()
    hidden = lm.config.hidden_size
    errors = {}
    for name, (got_logits, got_frames) in {"graph": (logits, frames), "bf16 reference": bf16}.items():
        errors[name] = (
            relative_error(got_logits, exact[0]),
            relative_error(got_frames[:, :hidden], exact[1][:, :hidden]),
            relative_error(got_frames[:, hidden:], exact[1][:, hidden:]),
        )
        print(f"\n{name} vs float32 reference over {len(got_frames)} frames, max / mean: "
              + ", ".join(f"{part} {e.max():.2e} / {e.mean():.2e}"
                          for part, e in zip(("logits", "LM hidden", "depth hiddens"), errors[name])))
    versus_bf16 = relative_error(logits, bf16[0])
    print(f"graph vs bf16 reference logits: max {versus_bf16.max():.2e} / mean {versus_bf16.mean():.2e}")
    assert frames.shape[0] == 200 and torch.isfinite(frames).all()
    assert all(e.max() < 2e-2 for e in errors["graph"])


def test_the_int8_kv_cache_engine_matches_the_reference_with_that_cache_and_changes_the_model_little(
        full, float32_room):
    """The int8 KV cache at full size: the engine against the float32 reference that rounds its cache the same way
    (the kernels' own error: within 2x the bf16 engine's bound above), and that reference against the plain
    float32 one (the format's own effect, printed; `bench formats --schemes kv/int8` has its sampling figures)."""
    lm, depth, _ = full
    engine = GraphEngine(lm, depth, DEVICE, kv_format="int8")
    try:
        text_ids = random_prompt(300, seed=3, device=DEVICE)
        codes = random_codes(201, torch.Generator().manual_seed(4))
        logits, frames = engine.teacher_forced(text_ids, codes)
        assert engine._state.kv.dtype == torch.int8
    finally:
        engine.release()
    lm32, depth32 = _float32_copies(lm, depth, float32_room)
    rounded = reference_teacher_forced(lm32, depth32, text_ids, codes, "int8")
    plain = reference_teacher_forced(lm32, depth32, text_ids, codes)
    del lm32, depth32
    torch.cuda.empty_cache()
    hidden = lm.config.hidden_size
    kernels = (relative_error(logits, rounded[0]), relative_error(frames[:, :hidden], rounded[1][:, :hidden]),
               relative_error(frames[:, hidden:], rounded[1][:, hidden:]))
    effect = relative_error(rounded[0], plain[0])
    print("\nint8-KV engine vs float32 reference with the int8 cache, max / mean: "
          + ", ".join(f"{part} {e.max():.2e} / {e.mean():.2e}"
                      for part, e in zip(("logits", "LM hidden", "depth hiddens"), kernels))
          + f"; the format's own effect on the logits: max {effect.max():.2e} / mean {effect.mean():.2e}")
    assert frames.shape[0] == 200 and torch.isfinite(frames).all()
    assert all(e.max() < 4e-2 for e in kernels)


def test_programmatic_dependent_launch_changes_no_bit(full):
    """PDL only lets each kernel become resident early (prefetching weights) and wait for the previous one: every
    value must be bit-identical to the plain launches over many replays, or a kernel read something too early."""
    lm, depth, _ = full
    pdl = GraphEngine(lm, depth, DEVICE, pdl=True)
    plain = GraphEngine(lm, depth, DEVICE, chain=False)  # PDL runs the products as separate launches too
    if not pdl.pdl or pdl.chain:
        pytest.fail("this GPU/Triton cannot launch with PDL; the GPU suite runs on an H200")
    text_ids = random_prompt(200, seed=7, device=DEVICE)
    codes = random_codes(120, torch.Generator().manual_seed(8))
    try:
        plain_logits, plain_frames = plain.teacher_forced(text_ids, codes)
        pdl_logits, pdl_frames = pdl.teacher_forced(text_ids, codes)
    finally:
        pdl.release()
        plain.release()
    assert torch.equal(plain_frames, pdl_frames)
    assert torch.equal(plain_logits, pdl_logits)


def _reference_probs(logits: torch.Tensor, scale: float, top_k: int, conditional: bool) -> torch.Tensor:
    """The reference engine's sampling distribution for one CFG pair (sampling.py's ops, then its top-k softmax)."""
    logits = logits.float()
    if conditional:
        guided = reference_semantic_logits(logits, torch.zeros(logits.shape[1], dtype=torch.bool), scale, top_k)
    else:
        guided = guide(logits[:1], logits[1:2], scale)
    threshold = torch.topk(guided, top_k, dim=-1).values[..., -1:]
    return torch.softmax(guided.masked_fill(guided < threshold, float("-inf")), dim=-1)[0]


def _chi_square_p(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples.long().cpu(), minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    assert counts[expected == 0].sum() == 0, "sampled a code outside the kept top-k"
    big = expected >= 5
    observed = torch.cat((counts[big], counts[~big].sum().view(1)))
    wanted = torch.cat((expected[big], expected[~big].sum().view(1)))
    keep = wanted > 0
    stat = ((observed[keep] - wanted[keep]) ** 2 / wanted[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


@pytest.mark.parametrize("conditional", [True, False], ids=["semantic", "depth"])
def test_sampler_matches_reference_distribution(conditional):
    vocab = AUDIO_CODES if conditional else 1024
    generator = torch.Generator().manual_seed(11)
    logits = (torch.randn(2, vocab, generator=generator) * 1.5).to(torch.bfloat16)
    scale, top_k = 1.5, 50
    probs = _reference_probs(logits, scale, top_k, conditional)
    logits = logits.to(DEVICE)
    scale_t = torch.tensor([scale], device=DEVICE)
    top_k_t = torch.tensor([top_k], device=DEVICE, dtype=torch.int32)
    rng = torch.Generator(DEVICE).manual_seed(5)

    # Many independent draws in one launch.
    draws = 40_000
    noise = torch.empty(draws, vocab, device=DEVICE).exponential_(generator=rng)
    codes = torch.empty(draws, device=DEVICE, dtype=torch.int32)
    zero = torch.zeros(1, device=DEVICE, dtype=torch.int32)
    cfg_sample(logits.expand(draws, 2, vocab), noise, scale_t, top_k_t, codes, zero, conditional_top_k=conditional)
    p_batch = _chi_square_p(codes, probs)

    # The engine's way: one draw per replay of a captured graph whose generator is registered with it.
    steps = 3000
    noise1 = torch.empty(vocab, device=DEVICE)
    history = torch.zeros(steps, device=DEVICE, dtype=torch.int32)
    step = torch.zeros(1, device=DEVICE, dtype=torch.int32)

    def frame() -> None:
        noise1.exponential_(generator=rng)
        cfg_sample(logits, noise1, scale_t, top_k_t, history, step, conditional_top_k=conditional, step_stride=1)
        step.add_(1)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        frame()  # compile outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(rng)
    with torch.cuda.graph(graph, stream=stream):
        frame()

    def replay_all(seed: int) -> torch.Tensor:
        rng.manual_seed(seed)
        with torch.cuda.stream(stream):
            step.zero_()
            for _ in range(steps):
                graph.replay()
        stream.synchronize()
        return history.clone()

    first, again = replay_all(7), replay_all(7)
    p_graph = _chi_square_p(first, probs)
    print(f"\n{'semantic' if conditional else 'depth'} sampler: chi-square p = {p_batch:.3f} (batched), "
          f"{p_graph:.3f} (graph replays)")
    assert torch.equal(first, again), "reseeding the registered generator must replay the same draws"
    assert p_batch > 1e-3 and p_graph > 1e-3


def test_two_songs_reuse_the_graphs_and_repeat_with_a_seed(full):
    _, _, engine = full
    text_ids = random_prompt(120, seed=5, device=DEVICE)
    first = _song(engine, text_ids, 60, seed=21)
    captures = engine.capture_count
    again = _song(engine, text_ids, 60, seed=21)
    other = _song(engine, text_ids, 60, seed=22)
    _song(engine, text_ids, 16, seed=21, top_k=20)  # top-k is a device value: the same graph serves it
    assert engine.capture_count == captures, "later songs (another seed or top-k) must not recapture"
    assert first.shape[0] > 0 and first.shape[1] == 8 * 4096
    assert torch.equal(first, again)
    assert not torch.equal(first[:8], other[:8])


def test_cancel_stops_within_a_few_frames_and_the_engine_recovers(full):
    _, _, engine = full
    text_ids = random_prompt(64, seed=6, device=DEVICE)
    cancel = threading.Event()
    songs = engine.frames(text_ids, 3000, SamplingSettings(), torch.Generator(DEVICE).manual_seed(1), cancel)
    got = next(songs).shape[0]
    cancel.set()
    with pytest.raises(Cancelled):
        for block in songs:
            got += block.shape[0]
    assert got <= (GraphConfig().in_flight + 2) * GraphConfig().replay_block
    assert _song(engine, text_ids, 10, seed=2).shape[0] <= 10


MID = dataclasses.replace(
    random_models.FULL, hidden=1024, lm_layers=4, lm_heads=8, lm_kv_heads=2, lm_intermediate=3072, depth_layers=2,
    depth_heads=4, depth_intermediate=1536, dit_layers=2, dit_ff=1024,
)


def test_end_token_stops_the_song_with_the_right_frame_count():
    """With the end row of lm_head scaled up, songs end early. The yielded count must equal the frames before the
    first step that sampled the end token (read from the engine's code history), never more, although the GPU ran
    further steps before the host saw the flag."""
    checked_early = 0
    for gain in (3.0, 6.0, 12.0):
        lm, depth = _models(dataclasses.replace(MID, end_token_gain=gain), seed=2)
        engine = GraphEngine(lm, depth, DEVICE)
        text_ids = random_prompt(48, seed=9, device=DEVICE)
        for seed in range(6):
            max_frames = 120
            run = engine.frames(text_ids, max_frames, SamplingSettings(), torch.Generator(DEVICE).manual_seed(seed))
            blocks = list(run)
            frames = torch.cat(blocks) if blocks else torch.empty(0, device=DEVICE)
            stats = run.stats
            history = run.codes()[:, 0].cpu()
            ends = (history == END).nonzero().flatten()
            expected = max(int(ends[0]) - 1, 0) if len(ends) else max_frames
            assert frames.shape[0] == expected == stats.frames
            if 1 <= expected < max_frames:
                checked_early += 1
                # The same seed with fewer frames allowed gives exactly that prefix.
                prefix = _song(engine, text_ids, expected, seed)
                assert torch.equal(prefix, frames[:expected])
        engine.release()
        if checked_early >= 2:
            break
    assert checked_early >= 2, "no song ended early with frames: raise the end-token gain range"
