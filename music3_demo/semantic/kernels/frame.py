"""Per-frame kernels around the matrix work: RMSNorm rows, CFG + top-k sampling, and the frame tail.

Sampling is exact top-k sampling by an exponential race: with E_i ~ Exp(1) drawn by torch's generator, the winner
of argmax_i (logit_i - log E_i) over the kept candidates has probability softmax(logits)_i — the reference
multinomial's distribution, not its stream. The k-th largest value is found by a binary search on the float's
ordered integer key (a count per round: 32 rounds, 16 for bf16 values, whose low 16 bits are zero), so ties at a
threshold are kept exactly like the reference's `values < threshold` masks (bf16 logits tie often), including its
second top-k over the guided logits. That second search only matters when ties made the first keep more than
top-k codes, and then runs as a few min/count rounds over the surplus (the bisection only past 16 surplus codes).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import interpreting, padded_lanes

NO_END = 2**31 - 1  # value of the end flag until the end token is sampled


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, eps, H: tl.constexpr, HP: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, HP)  # H columns on HP lanes, a power of two (those past H are masked)
    lanes = padded_lanes(cols, H, HP)
    x = tl.load(x_ptr + row * stride_x + cols, mask=lanes, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    y = (x * rstd).to(dtype).to(tl.float32) * tl.load(w_ptr + cols, mask=lanes, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(dtype), mask=lanes)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> torch.Tensor:
    """HF/diffusers RMSNorm of each row of x [R, H] (any row stride) into out [R, H]."""
    rows, hidden = x.shape
    _rmsnorm_kernel[(rows,)](x, weight, out, x.stride(0), out.stride(0), eps, H=hidden,
                             HP=triton.next_power_of_2(hidden), num_warps=4)
    return out


@triton.jit
def _ordered_key(values, valid, SHIFT: tl.constexpr):
    """float32 -> int32 with the same order (invalid lanes below all), less SHIFT low bits that are zero in every
    value (16 for values that came from bf16: the sign flip of negatives sets them, the shift drops them again).
    -0.0 gets +0.0's key: the reference's float compares treat them as equal."""
    bits = values.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 is the sign bit alone
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits) >> SHIFT
    return tl.where(valid, key, -2147483648)


@triton.jit
def _kth_largest(key, valid, tkey, tvalid, top_k, BITS: tl.constexpr, TAIL: tl.constexpr):
    """The k-th largest valid key (all valid ones count when top_k exceeds them), with TAIL of the lane past the
    block (`tkey`): the largest t with count(key >= t) >= top_k, by bisection between the smallest and the largest
    valid key (< 2^BITS apart)."""
    lo = tl.min(tl.where(valid, key, 2147483647), axis=0)
    hi = tl.max(key, axis=0)
    if TAIL:
        lo = tl.minimum(lo, tl.min(tl.where(tvalid, tkey, 2147483647), axis=0))
        hi = tl.maximum(hi, tl.max(tkey, axis=0))
    lo, hi = lo.to(tl.int64), hi.to(tl.int64)
    for _ in range(BITS):
        mid = (lo + hi + 1) >> 1
        above = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
        if TAIL:
            above += tl.sum((tkey >= mid.to(tl.int32)).to(tl.int32), axis=0)
        ok = above >= top_k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit
def _kth_largest_of_few_surplus(key, keep, tkey, tkeep, top_k, TAIL: tl.constexpr, SURPLUS: tl.constexpr = 16):
    """`_kth_largest` for a set that holds top_k keys plus a few (the conditional top-k's ties): with at most
    SURPLUS keys over top_k, drop whole groups of equal smallest keys while they fit in the surplus (each drop
    removes at least one key, so at most SURPLUS rounds of two reductions, against the bisection's 32). (Written
    out, not through helpers: Triton's interpreter, which the CPU tests run every frame, pays per call.)"""
    surplus = tl.sum(keep.to(tl.int32), axis=0) - top_k
    if TAIL:
        surplus += tl.sum(tkeep.to(tl.int32), axis=0)
    if surplus > SURPLUS:
        threshold = _kth_largest(key, keep, tkey, tkeep, top_k, 32, TAIL)
    else:
        threshold = tl.min(tl.where(keep, key, 2147483647), axis=0)
        if TAIL:
            threshold = tl.minimum(threshold, tl.min(tl.where(tkeep, tkey, 2147483647), axis=0))
        at = tl.sum((keep & (key == threshold)).to(tl.int32), axis=0)
        if TAIL:
            at += tl.sum((tkeep & (tkey == threshold)).to(tl.int32), axis=0)
        while (at <= surplus) & (at > 0):  # at == 0 only past the largest key (top_k < 1): stop there
            surplus -= at
            floor = threshold
            threshold = tl.min(tl.where(keep & (key > floor), key, 2147483647), axis=0)
            if TAIL:
                threshold = tl.minimum(threshold, tl.min(tl.where(tkeep & (tkey > floor), tkey, 2147483647), axis=0))
            at = tl.sum((keep & (key == threshold)).to(tl.int32), axis=0)
            if TAIL:
                at += tl.sum((tkeep & (tkey == threshold)).to(tl.int32), axis=0)
    return threshold


@triton.jit
def _exp_noise(seeds_ptr, noise_ptr, r, lanes, real, step, draw, PHILOX: tl.constexpr):
    """Exp(1) noise for the codes on `lanes`: with PHILOX a pure function of (draw r's seed, step, which draw of the
    step, code), so a song's draws depend on nothing else (not on the songs sharing its batch, nor on its slot);
    else read from the draw's row at `noise_ptr`."""
    if PHILOX:
        counter = lanes * 0
        bits, _, _, _ = tl.philox(tl.load(seeds_ptr + r), lanes, counter + step, counter + draw, counter)
        noise = -tl.log(tl.uint_to_uniform_float(bits))
    else:
        noise = tl.load(noise_ptr + lanes, mask=real, other=1.0)
    return noise


@triton.jit
def _row_slice(c, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, PARTS: tl.constexpr):
    """Program c's columns of a table row, CHUNKS chunks of CHUNK (as PARTS >= CHUNKS rows: a power of two), and the
    mask of the real chunks."""
    part = tl.arange(0, PARTS)
    return (c * CHUNKS + part)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :], (part < CHUNKS)[:, None]


@triton.jit
def _cfg_sample_kernel(
    logits_ptr, stride_lr, stride_lc, noise_ptr, stride_nr, scale_ptr, stride_scale, top_k_ptr, stride_top_k, V,
    codes_ptr, stride_cr, step_ptr, stride_step, stride_cs, forced_ptr, stride_fr, forced_steps_ptr, stride_fs,
    end_ptr, stride_end, end_index, seeds_ptr, draw,
    table_rows, table_ptr, stride_t, copy_ptr, stride_copy, stride_cp, table2_ptr, stride_t2, copy2_ptr, stride_copy2,
    stride_cp2,
    BLOCK_V: tl.constexpr, TAIL: tl.constexpr, COND_TOPK: tl.constexpr, FORCED: tl.constexpr, HAS_END: tl.constexpr,
    COPIES: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, PARTS: tl.constexpr, CHUNK2: tl.constexpr,
    CHUNKS2: tl.constexpr, PARTS2: tl.constexpr, SHIFT: tl.constexpr, PHILOX: tl.constexpr,
):
    """Program (sample r, copy slice c). Every copy slice repeats the (cheap) selection so no program waits for
    another; they all reach the same code. Each per-draw value (scale, top_k, step, forced steps, end flag, seed)
    is read at r times its stride (stride 0: one value shared by every draw). The codes lie on BLOCK_V lanes and,
    with TAIL, the last one (the LM's end token, past the 16,384 audio codes' power of two) on a lane of its own:
    every round of the selection then reduces over half the lanes the next power of two would take."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    step = tl.load(step_ptr + r * stride_step)
    offs = tl.arange(0, BLOCK_V)
    valid = offs < V
    base = logits_ptr + r * stride_lr
    scale = tl.load(scale_ptr + r * stride_scale)
    top_k = tl.load(top_k_ptr + r * stride_top_k)
    cond = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32)
    uncond = tl.load(base + stride_lc + offs, mask=valid, other=0.0).to(tl.float32)
    # The tail lane (its values; where TAIL is 0 the block's stand in, never read)
    toffs, tvalid, tcond, tuncond = offs, valid, cond, uncond
    if TAIL:
        toffs = BLOCK_V + tl.arange(0, 1)
        tvalid = toffs < V
        tcond = tl.load(base + toffs, mask=tvalid, other=0.0).to(tl.float32)
        tuncond = tl.load(base + stride_lc + toffs, mask=tvalid, other=0.0).to(tl.float32)
    keep, tkeep = valid, tvalid
    if COND_TOPK:
        # The reference keeps the conditional row's top-k (ties included) ...
        cond_key = _ordered_key(cond, valid, SHIFT)
        tcond_key = cond_key
        if TAIL:
            tcond_key = _ordered_key(tcond, tvalid, SHIFT)
        kth = _kth_largest(cond_key, valid, tcond_key, tvalid, top_k, 32 - SHIFT, TAIL)
        keep = valid & (cond_key >= kth)
        if TAIL:
            tkeep = tvalid & (tcond_key >= kth)
    # ... then (and for the depth codes, only) the top-k of the guided logits among those kept.
    guided = uncond + (cond - uncond) * scale
    key = _ordered_key(guided, keep, 0)
    tguided, tkey = guided, key
    if TAIL:
        tguided = tuncond + (tcond - tuncond) * scale
        tkey = _ordered_key(tguided, tkeep, 0)
    if COND_TOPK:
        threshold = _kth_largest_of_few_surplus(key, keep, tkey, tkeep, top_k, TAIL)
    else:
        threshold = _kth_largest(key, keep, tkey, tkeep, top_k, 32, TAIL)
    keep = keep & (key >= threshold)
    noise = _exp_noise(seeds_ptr, noise_ptr + r * stride_nr, r, offs, valid, step, draw, PHILOX)
    score = tl.where(keep, guided - tl.log(noise), float("-inf"))
    code = tl.argmax(score, axis=0).to(tl.int32)
    if TAIL:  # the tail's code wins only when strictly ahead: the first of equal scores wins, as over every lane
        tkeep = tkeep & (tkey >= threshold)
        tnoise = _exp_noise(seeds_ptr, noise_ptr + r * stride_nr, r, toffs, tvalid, step, draw, PHILOX)
        tscore = tl.where(tkeep, tguided - tl.log(tnoise), float("-inf"))
        code = tl.where(tl.max(tscore, axis=0) > tl.max(score, axis=0), BLOCK_V, code).to(tl.int32)
    codes = codes_ptr + r * stride_cr + step * stride_cs
    if FORCED:  # steps below forced_steps take the given code (the draw above is made either way)
        forced = tl.load(forced_ptr + r * stride_fr + step * stride_cs)
        code = tl.where(step < tl.load(forced_steps_ptr + r * stride_fs), forced, code)
    tl.store(codes, code)
    if HAS_END:
        tl.atomic_min(end_ptr + r * stride_end, tl.where(code == end_index, step, 2147483647))
    # What the next position needs of this code, precomputed per code (for both CFG rows of draw r): its input row,
    # and for the depth decoder also block 0's q|k|v of it.
    row = tl.minimum(code, table_rows - 1).to(tl.int64)
    # Both rows' loads go out before any store (a store could alias a later load, so it would wait for it).
    if COPIES >= 1:
        cols, real = _row_slice(c, CHUNK, CHUNKS, PARTS)
        vals = tl.load(table_ptr + row * stride_t + cols, mask=real)
    if COPIES >= 2:
        cols2, real2 = _row_slice(c, CHUNK2, CHUNKS2, PARTS2)
        vals2 = tl.load(table2_ptr + row * stride_t2 + cols2, mask=real2)
    if COPIES >= 1:
        dest = copy_ptr + r * stride_cp
        tl.store(dest + cols, vals, mask=real)
        tl.store(dest + stride_copy + cols, vals, mask=real)
    if COPIES >= 2:
        dest2 = copy2_ptr + r * stride_cp2
        tl.store(dest2 + cols2, vals2, mask=real2)
        tl.store(dest2 + stride_copy2 + cols2, vals2, mask=real2)


# Whether a code past a power of two takes a lane of its own (`sample_block`). Not in Triton's interpreter: its
# cost is per operation, not per lane, and the tail lane's operations made its sampler ~1.25x slower (the CPU tests
# run it every frame); the kernel tests set it to test the GPU's path, which draws the same codes.
TAIL_LANE = not interpreting()


def sample_block(vocab: int) -> int:
    """The sampler's lanes for `vocab` codes: a power of two, with one code past it on a lane of its own where that
    is all there is beyond one (the LM's 16,384 audio codes and its end token) and `TAIL_LANE` allows it."""
    below = triton.next_power_of_2(vocab) // 2
    return below if TAIL_LANE and vocab == below + 1 and below >= 2 else triton.next_power_of_2(vocab)


def sample_warps(vocab: int) -> int:
    """Warps of one sampling program: its rounds of whole-row reductions cross every warp."""
    return 16 if vocab > 4096 else 4


def cfg_sample(
    logits: torch.Tensor,
    noise: torch.Tensor | None,
    scale: torch.Tensor,
    top_k: torch.Tensor,
    codes: torch.Tensor,
    step: torch.Tensor,
    *,
    conditional_top_k: bool,
    step_stride: int = 0,
    forced: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    end: tuple[torch.Tensor, int] | None = None,
    copies: tuple[tuple[torch.Tensor, torch.Tensor], ...] = (),
    copy_programs: int = 8,
    seeds: tuple[torch.Tensor, int] | None = None,
) -> None:
    """Sample one code per CFG pair of logits ([2, V], or [R, 2, V] for R independent draws).

    guided = u + (c - u)·scale (scale: float32 [1] on device). The candidates are the top_k (int32 [1] on device, so
    one captured graph serves every top-k) of the guided logits,
    among the top_k of the conditional row with `conditional_top_k` (the LM's semantic code). noise: Exp(1) draws,
    [V] or [R, V]; or None with `seeds` = (int64 [R] on device, draw index): the noise of draw r is then a function
    of (seeds[r], its step, the draw index, the code) alone (counter-based Philox).
    The code goes to codes[r + step·step_stride] (step: int32 [1] on device); `forced` (same layout)
    overrides it (teacher forcing), at every step or, given as (codes, steps int32 [1] on device), at steps below
    `steps` (a forced prefix); `end` = (flag int32 [1], index) records the first step that sampled `index`;
    each of up to two `copies` (table [rows, W], dest [2, W]; tables with the same rows, codes past them read the
    last) writes table[code] to both dest rows, split over `copy_programs` programs.

    Several songs at once (the batched engine): with codes [R, steps] (2-D), draw r reads its own step[r], scale[r],
    top_k[r], forced [R, steps] codes and steps[r], end flag[r] (each a strided [R] view; a [1] tensor is shared)
    and writes codes[r, step[r]]; a copy's dest [2R, W] takes draw r's row in rows 2r and 2r + 1.
    """
    batched = logits.dim() == 3
    pairs = logits if batched else logits.unsqueeze(0)
    draws = pairs.shape[0]
    vocab = pairs.shape[2]
    if noise is None:
        if seeds is None or seeds[0].shape[0] < draws:
            raise ValueError("cfg_sample needs noise, or a seed per draw")
        noise2 = pairs  # never read
    else:
        noise2 = noise if noise.dim() == 2 else noise.unsqueeze(0)
        if noise2.stride(1) != 1 or noise2.shape[1] < vocab:
            raise ValueError("cfg_sample needs at least V unit-stride noise values per draw")
    if pairs.stride(2) != 1:
        raise ValueError("cfg_sample needs unit-stride logits")
    if len(copies) > 2 or len({table.shape[0] for table, _ in copies}) > 1:
        raise ValueError("cfg_sample copies from at most two tables with the same rows")
    programs = copy_programs if copies else 1
    chunking = []
    for table, dest in copies:
        width = table.shape[1]
        if (dest.shape not in ((2, width), (2 * draws, width)) or table.stride(1) != 1 or dest.stride(1) != 1
                or width % programs):
            raise ValueError(f"a copy needs dest [2, {width}] (or two rows per draw) and rows that split over "
                             f"{programs} programs")
        chunk = math.gcd(width // programs, 1024)  # a power of two: tl.arange's
        per_draw = 2 * dest.stride(0) if dest.shape[0] > 2 else 0
        chunking.append((table, table.stride(0), dest, dest.stride(0), per_draw, chunk, width // programs // chunk))
    while len(chunking) < 2:
        chunking.append((codes, 0, codes, 0, 0, 1, 1))
    (table, stride_t, dest, stride_d, per_draw, chunk, chunks), (table2, stride_t2, dest2, stride_d2, per_draw2,
                                                                  chunk2, chunks2) = chunking

    def per(t: torch.Tensor) -> int:  # a value per draw, or one shared
        return t.stride(0) if t.numel() > 1 else 0

    if codes.dim() == 2:  # [R, steps]: one history per draw
        stride_cr, stride_cs = codes.stride(0), codes.stride(1)
    else:
        stride_cr, stride_cs = 1, step_stride
    end_flag, end_index = end if end is not None else (codes, -1)
    if forced is not None and not isinstance(forced, tuple):
        forced = (forced, torch.full((1,), 2**31 - 1, dtype=torch.int32, device=forced.device))
    forced_codes, forced_steps = forced if forced is not None else (codes, step)
    seed_values, draw = seeds if seeds is not None else (step, 0)
    block = sample_block(vocab)
    _cfg_sample_kernel[(draws, programs)](
        pairs, pairs.stride(0), pairs.stride(1), noise2, noise2.stride(0) if draws > 1 else 0, scale, per(scale),
        top_k, per(top_k), vocab, codes, stride_cr, step, per(step), stride_cs,
        forced_codes, forced_codes.stride(0) if forced_codes.dim() == 2 else 0, forced_steps, per(forced_steps),
        end_flag, per(end_flag) if end is not None else 0, end_index, seed_values, draw,
        copies[0][0].shape[0] if copies else 1, table, stride_t, dest, stride_d, per_draw, table2, stride_t2, dest2,
        stride_d2, per_draw2,
        BLOCK_V=block, TAIL=int(vocab > block), COND_TOPK=conditional_top_k, FORCED=forced is not None,
        HAS_END=end is not None, COPIES=len(copies), CHUNK=chunk, CHUNKS=chunks, PARTS=triton.next_power_of_2(chunks),
        CHUNK2=chunk2, CHUNKS2=chunks2, PARTS2=triton.next_power_of_2(chunks2),
        SHIFT=16 if pairs.dtype == torch.bfloat16 else 0, PHILOX=noise is None,
        num_warps=sample_warps(vocab),
    )


@triton.jit
def _frame_tail_kernel(
    lm_hidden_ptr, depth_ptr, frames_ptr, stride_frame, stride_fs, ring, codes_ptr, stride_cr, step_ptr, stride_step,
    embed_ptr, stride_embed, audio_ptr, stride_audio, feedback_ptr, stride_fb,
    code_rows, audio_vocab, scale,
    H: tl.constexpr, NCB: tl.constexpr, BLOCK: tl.constexpr,
):
    """Columns [pid·BLOCK, +BLOCK) of song r's (program_id 1; CFG rows 2r, 2r + 1): the emitted frame step-1 =
    [lm_hidden[cond], depth hiddens[cond] 1..7] into ring row (step-1) % ring (not on step 0, which only steps past
    <|audio_start|>), and the next LM input, the feedback embedding (semantic_embed(code0) +
    Σ audio_emb(c_i + (i-1)·vocab)) · scale for both CFG rows."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    r = tl.program_id(1)
    step = tl.load(step_ptr + r * stride_step)
    codes = codes_ptr + r * stride_cr + step * NCB
    emit = (cols * 0 + step) >= 1
    row = frames_ptr + r * stride_fs + ((tl.maximum(step, 1) - 1) % ring).to(tl.int64) * stride_frame
    lm_hidden_ptr += 2 * r * H
    depth_ptr += 2 * r * (NCB - 1) * H
    feedback_ptr += 2 * r * stride_fb
    dtype = embed_ptr.dtype.element_ty  # the model's precision, as the reference rounds the feedback
    tl.store(row + cols, tl.load(lm_hidden_ptr + cols), mask=emit)
    extra = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(1, NCB):
        tl.store(row + i * H + cols, tl.load(depth_ptr + (i - 1) * H + cols), mask=emit)
        code = tl.load(codes + i).to(tl.int64) + (i - 1) * audio_vocab
        extra += tl.load(audio_ptr + code * stride_audio + cols).to(tl.float32)
    code0 = tl.minimum(tl.load(codes), code_rows - 1).to(tl.int64)  # the end token (16384) feeds nothing used
    first = tl.load(embed_ptr + code0 * stride_embed + cols).to(tl.float32)
    feedback = ((first + extra.to(dtype).to(tl.float32)).to(dtype).to(tl.float32) * scale).to(dtype)
    tl.store(feedback_ptr + cols, feedback)
    tl.store(feedback_ptr + stride_fb + cols, feedback)


def frame_tail(
    lm_hidden: torch.Tensor, depth_hidden: torch.Tensor, frames: torch.Tensor, codes: torch.Tensor,
    step: torch.Tensor, semantic_embed: torch.Tensor, audio_embed: torch.Tensor, feedback: torch.Tensor,
    audio_vocab: int, block: int = 512,
) -> None:
    """lm_hidden [2, H] (row 0 emitted), depth_hidden [2, NCB-1, H] contiguous (row 0 emitted), frames [R, NCB·H]
    (a ring: frame f lands in row f % R), codes int32 [steps, NCB], semantic_embed [16384, H] (the LM's embedding
    rows of the semantic codes), audio_embed [(NCB-1)·vocab, H], feedback [2, H].

    Several songs at once: lm_hidden [2S, H] and depth_hidden [2S, NCB-1, H] (contiguous), frames [S, ring, NCB·H],
    codes [S, steps, NCB], step [S] (strided) and feedback [2S, H]: song s's rows are 2s and 2s + 1."""
    hidden = lm_hidden.shape[1]
    ncb = codes.shape[-1]
    songs = lm_hidden.shape[0] // 2
    if not lm_hidden.is_contiguous() or not depth_hidden.is_contiguous() or codes.stride(-2) != ncb:
        raise ValueError("frame_tail needs contiguous hiddens and codes rows")
    block = min(block, hidden & -hidden)  # a power of two that divides the hidden size
    ring = frames.shape[-2]
    _frame_tail_kernel[(hidden // block, songs)](
        lm_hidden, depth_hidden, frames, frames.stride(-2), frames.stride(0) if frames.dim() == 3 else 0, ring,
        codes, codes.stride(0) if codes.dim() == 3 else 0, step, step.stride(0) if step.numel() > 1 else 0,
        semantic_embed, semantic_embed.stride(0), audio_embed, audio_embed.stride(0), feedback, feedback.stride(0),
        semantic_embed.shape[0], audio_vocab, ncb**-0.5,
        H=hidden, NCB=ncb, BLOCK=block, num_warps=4,
    )
