"""The per-frame kernels (`kernels/frame.py`): RMSNorm, on-device CFG + top-k sampling against the reference sampler's
kept set, and the frame tail (emit + feedback embedding), under Triton's interpreter."""

from __future__ import annotations

from kernel_cases import DTYPES, assert_close, hf_rmsnorm, rand  # first: checks Triton's interpreter is on

import pytest
import torch

from music3_demo import contract as c
from music3_demo.semantic.kernels import cfg_sample, frame_tail, rmsnorm
from music3_demo.semantic.reference import embed_audio_frame
from music3_demo.semantic.teacher_forcing import random_codes
from music3_demo.semantic.sampling import guide, reference_semantic_logits


@pytest.fixture(autouse=True)
def tail_lane(monkeypatch):
    """The GPU's sampler layout (a code past a power of two on a lane of its own), which the interpreter's engine
    does not take (`frame.TAIL_LANE`)."""
    from music3_demo.semantic.kernels import frame

    monkeypatch.setattr(frame, "TAIL_LANE", True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 48])  # 48: rows padded to 64 lanes, masked
def test_rmsnorm_rows_with_strides(dtype, hidden):
    x = rand(4, hidden, dtype=dtype, seed=12)
    w = rand(hidden, dtype=dtype, seed=13) + 1
    out = torch.zeros(2, 3, hidden, dtype=dtype)
    rmsnorm(x[1::2], w, out[:, 1], 1e-6)
    assert_close(out[:, 1], hf_rmsnorm(x[1::2], w), dtype)
    assert not out[:, 0].any() and not out[:, 2].any()


def race(logits: torch.Tensor, draws: list[int], scale: float, top_k: int, conditional: bool) -> torch.Tensor:
    """One sampler program per listed code j whose Exp(1) noise is ~0 at j (a huge race bonus): it returns j exactly
    when j is a candidate, else the best candidate. Each interpreted program is slow, so the tests race the codes at
    the kept set's boundary (the lowest kept and highest dropped by the reference's ranking), the best code and the
    block's last lane, rather than every code."""
    vocab = logits.shape[-1]
    noise = torch.ones(len(draws), vocab)
    noise[torch.arange(len(draws)), torch.tensor(draws)] = 1e-30
    codes = torch.full((len(draws),), -1, dtype=torch.int32)
    cfg_sample(logits.expand(len(draws), 2, vocab), noise, torch.tensor([scale]),
               torch.tensor([top_k], dtype=torch.int32), codes, torch.zeros(1, dtype=torch.int32),
               conditional_top_k=conditional)
    return codes.long()


def boundary(ranked: torch.Tensor, kept: torch.Tensor, each_side: int = 6) -> list[int]:
    """The `each_side` lowest-ranked kept codes, the highest-ranked dropped ones, the best code and the last lane."""
    order = torch.argsort(ranked, descending=True, stable=True)
    kept_order = [int(i) for i in order if kept[i]]
    dropped_order = [int(i) for i in order if not kept[i]]
    chosen = kept_order[-each_side:] + dropped_order[:each_side] + [int(order[0]), ranked.shape[0] - 1]
    return sorted(set(chosen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the 16-round search on 16-bit keys
@pytest.mark.parametrize("top_k", [7, 5])  # 7: the conditional top-k holds 9 tied codes; 5: exactly 5 (no 2nd search)
# 50: lanes past the vocabulary in the kernel's block are masked; 65: the last code on a lane of its own (the LM's
# end token past its 16,384 audio codes: `sample_block`)
@pytest.mark.parametrize("vocab", [64, 50, 65])
def test_cfg_sample_keeps_exactly_the_reference_top_k_set_and_races_within_it(vocab, top_k, dtype):
    scale = 1.5
    logits = rand(2, vocab, seed=14).round(decimals=1)  # coarse values: ties at the thresholds happen
    logits[0, 10:14] = logits[0].max() + 1  # 4 tied conditional logits straddle the top-7 threshold...
    logits[0, 20:25] = logits[0].max() + 2
    logits[1, 10:14] = torch.tensor([0.0, 3.0, -3.0, 1.0])  # ...and their guided values differ
    logits = logits.to(dtype)
    exact = logits.float()  # the reference's arithmetic (float32), on the values the kernel reads
    for conditional in (True, False):
        if conditional:
            ranked = reference_semantic_logits(exact, torch.zeros(vocab, dtype=torch.bool), scale, top_k)[0]
            assert (ranked > float("-inf")).sum() == {7: 9, 5: 5}[top_k]
        else:
            ranked = guide(exact[0], exact[1], scale)
        kept = ranked >= torch.topk(ranked, top_k).values[-1]  # reference_sample_top_k's `values < threshold`
        guided = guide(exact[0], exact[1], scale)
        draws = boundary(ranked, kept)
        codes = race(logits, draws, scale, top_k, conditional)
        best_kept = int(torch.where(kept, guided, float("-inf")).argmax())
        drawn = torch.tensor(draws)
        assert torch.equal(codes, torch.where(kept[drawn], drawn, torch.full_like(drawn, best_kept)))


@pytest.mark.parametrize("top_k", [3, 45])  # 47 codes over the top-k: the bisection; 5: dropped one by one
@pytest.mark.parametrize("vocab", [50, 65])
def test_cfg_sample_when_every_conditional_logit_ties(top_k, vocab):
    scale = 1.5
    logits = torch.stack([torch.zeros(vocab), torch.randperm(vocab, generator=torch.Generator().manual_seed(3)) / 8.0])
    logits = logits.to(torch.bfloat16)  # the conditional top-k keeps all 50; the guided logits all differ
    guided = guide(logits[0].float(), logits[1].float(), scale)
    kept = guided >= torch.topk(guided, top_k).values[-1]
    draws = boundary(guided, kept)
    codes = race(logits, draws, scale, top_k, conditional=True)
    best = int(guided.argmax())
    assert int(kept.sum()) == top_k
    drawn = torch.tensor(draws)
    assert torch.equal(codes, torch.where(kept[drawn], drawn, torch.full_like(drawn, best)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cfg_sample_treats_minus_zero_as_zero_at_the_conditional_threshold(dtype):
    vocab, top_k, scale = 8, 3, 1.5
    cond = torch.tensor([3.0, 2.0, 0.0, -0.0, -1.0, -2.0, -3.0, -4.0])  # the 3rd largest is 0.0, tied with -0.0
    logits = torch.stack([cond, torch.zeros(vocab)]).to(dtype)
    ranked = reference_semantic_logits(logits.float(), torch.zeros(vocab, dtype=torch.bool), scale, top_k)[0]
    kept = ranked > float("-inf")
    assert kept.tolist() == [True] * 4 + [False] * 4  # the reference's `values < threshold` keeps -0.0
    noise = torch.ones(vocab, vocab)
    noise.fill_diagonal_(1e-30)  # draw j wins at j whenever j is a candidate
    codes = torch.full((vocab,), -1, dtype=torch.int32)
    cfg_sample(logits.expand(vocab, 2, vocab), noise, torch.tensor([scale]), torch.tensor([top_k], dtype=torch.int32),
               codes, torch.zeros(1, dtype=torch.int32), conditional_top_k=True)
    assert torch.equal(codes.long(), torch.where(kept, torch.arange(vocab), torch.zeros(vocab, dtype=torch.long)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("conditional", [True, False])
@pytest.mark.parametrize("vocab", [50, 65])
def test_cfg_sample_with_top_k_beyond_the_vocabulary_keeps_every_code(conditional, dtype, vocab):
    logits = rand(2, vocab, seed=15).to(dtype)
    ranked = guide(logits[0].float(), logits[1].float(), 1.5)
    draws = boundary(ranked, torch.ones(vocab, dtype=torch.bool), each_side=10)  # the ten lowest-ranked codes
    codes = race(logits, draws, 1.5, vocab + 10, conditional)
    assert codes.tolist() == draws


def test_cfg_sample_forced_codes_end_flag_and_row_copy():
    vocab, hidden, steps = 32, 16, 4
    logits = rand(2, vocab, seed=15)
    history = torch.zeros(steps, 8, dtype=torch.int32)
    forced = torch.zeros_like(history)
    forced[2, 0] = vocab - 1  # the "end token" (last index) at step 2
    step = torch.tensor([2], dtype=torch.int32)
    end_flag = torch.tensor([2**31 - 1], dtype=torch.int32)
    table = rand(vocab - 1, hidden, seed=16)
    dest = torch.zeros(4, hidden)
    # A second table of another width and dtype (the depth decoder's block-0 q|k|v): 24 columns over 2 programs
    # are 3 chunks of 4 each.
    table2 = rand(vocab - 1, 24, seed=17).half()
    dest2 = torch.zeros(2, 24, dtype=torch.float16)
    five = torch.tensor([5], dtype=torch.int32)  # top-k lives on the device, like the scale
    cfg_sample(logits, torch.ones(vocab), torch.tensor([1.5]), five, history[:, 0], step, conditional_top_k=True,
               step_stride=8, forced=forced[:, 0], end=(end_flag, vocab - 1),
               copies=((table, dest[1::2]), (table2, dest2)), copy_programs=2)
    assert history[2, 0] == vocab - 1 and int(end_flag) == 2
    assert torch.equal(dest[1], table[-1]) and torch.equal(dest[3], table[-1]) and not dest[0::2].any()
    assert torch.equal(dest2, table2[-1].expand(2, 24))
    with pytest.raises(ValueError, match="at most two tables with the same rows"):
        cfg_sample(logits, torch.ones(vocab), torch.tensor([1.5]), five, history[:, 0], step, conditional_top_k=True,
                   copies=((table, dest[1::2]), (table2[:-1], dest2)))
    with pytest.raises(ValueError, match="split over 3 programs"):
        cfg_sample(logits, torch.ones(vocab), torch.tensor([1.5]), five, history[:, 0], step, conditional_top_k=True,
                   copies=((table, dest[1::2]),), copy_programs=3)
    step.fill_(3)
    forced[3, 0] = 4
    cfg_sample(logits, torch.ones(vocab), torch.tensor([1.5]), five, history[:, 0], step, conditional_top_k=True,
               step_stride=8, forced=forced[:, 0], end=(end_flag, vocab - 1))
    assert history[3, 0] == 4 and int(end_flag) == 2  # the first end step is kept


def test_frame_tail_emits_the_frame_and_the_reference_feedback(tiny_models):
    lm, depth = tiny_models
    hidden = lm.config.hidden_size
    lm_hidden = rand(2, hidden, seed=17)
    depth_hidden = rand(2, 7, hidden, seed=18)
    codes = random_codes(6, torch.Generator().manual_seed(19)).to(torch.int32)
    frames = torch.zeros(3, 8 * hidden)  # a ring of 3 rows: frame f lands in row f % 3
    feedback = torch.empty(2, hidden)
    semantic_rows = lm.model.embed_tokens.weight.data[c.AUDIO_CODE_OFFSET : c.AUDIO_CODE_OFFSET + 16384]
    audio = depth.audio_embeddings.weight.data
    emitted = torch.cat((lm_hidden[0], depth_hidden[0].flatten()))
    for step, row in ((0, None), (2, 1), (5, 1)):
        frames.zero_()
        frame_tail(lm_hidden, depth_hidden, frames, codes, torch.tensor([step], dtype=torch.int32), semantic_rows,
                   audio, feedback, 1024, block=16)
        expected = embed_audio_frame(lm, depth, codes[step].long().unsqueeze(0).repeat(2, 1))[:, 0]
        assert_close(feedback, expected, torch.float32)
        written = [i for i in range(3) if frames[i].any()]  # step 0 emits nothing; step s writes frame s-1
        assert written == ([] if row is None else [row])
        if row is not None:
            assert torch.equal(frames[row], emitted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("conditional", [True, False])
def test_cfg_sample_with_the_last_code_on_a_lane_of_its_own_draws_what_the_whole_block_draws(
        conditional, dtype, monkeypatch):
    """`sample_block`: 65 codes on 64 lanes and a tail lane (the LM's 16,385 on 16,384 and one) draw, seed for
    seed, the codes that 128 lanes draw, the last code among them (far ahead in some draws, level with code 0 in
    the selection of the others)."""
    from music3_demo.semantic.kernels import frame

    vocab, draws = 65, 24
    assert frame.sample_block(vocab) == 64 and frame.sample_block(64) == 64 and frame.sample_block(50) == 64
    logits = rand(draws, 2, vocab, seed=16).round(decimals=1)
    logits[: draws // 2, :, vocab - 1] += 8.0  # the last code far ahead in half the draws ...
    logits[draws // 2:, :, vocab - 1] = logits[draws // 2:, :, 0]  # ... level with code 0 in the others
    logits = logits.to(dtype)
    seeds = torch.arange(draws, dtype=torch.int64) * 7919

    def sample() -> torch.Tensor:
        codes = torch.full((draws,), -1, dtype=torch.int32)
        cfg_sample(logits, None, torch.tensor([1.5]), torch.tensor([5], dtype=torch.int32), codes,
                   torch.zeros(1, dtype=torch.int32), conditional_top_k=conditional, seeds=(seeds, 3))
        return codes

    with_tail = sample()
    monkeypatch.setattr(frame, "TAIL_LANE", False)  # (what the interpreter's engine takes)
    assert frame.sample_block(vocab) == 128
    assert torch.equal(with_tail, sample())
    assert (with_tail == vocab - 1).sum() >= draws // 4 and (with_tail != vocab - 1).any()
