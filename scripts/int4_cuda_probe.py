"""Probe: the read pattern of a hand-written CUDA int4/g64 GEMV (2 rows) against the engine's Triton GEMV on the LM
block's four products, each checked against float32 on the same dequantized weights.

What it asks: whether the ~57% of the DRAM's peak that both the fp16 CUDA kernel and Triton reach comes from how the
weights are read. Two changes, separable by configuration, on the fp16 kernel (`int4_gemv3`, kept here as the
baseline):
- one stream a warp across all its tiles (`int4_gemv4`): the registers' double buffer runs on over tile ends (the
  next tile's first words are in flight while the warps' partial sums meet), where the baseline starts each tile
  from empty; the stream's position is kept by additions (no division, the cp.async ring's cost);
- SPAN scale groups a lane load: the stored words re-ordered so a lane's words of SPAN consecutive groups are
  adjacent (SPAN 1: 8 bytes, the stored order; 2: 16 bytes; 4: 32 bytes as two 16-byte loads), so a warp's request
  covers 32 * SPAN bytes of each of its 16 rows. Each group's product is still scaled once in float32.

Run on a GPU:  python scripts/int4_cuda_probe.py OUT.json
On a CPU (compile only, needs libnvrtc):  python scripts/int4_cuda_probe.py --compile-only [--arch 90]
For a profiler:  python scripts/int4_cuda_probe.py --once gate_up,down --best OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

# What both kernels share: the fp16 operands (four pairs a 32-bit word of nibbles, one mask-and-or a pair, no shift
# for the high nibbles), the MMA that reads them, the activations' staging and a tile's reduction.
HELPERS = r"""
__device__ __forceinline__ unsigned lop3_and_or(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("lop3.b32 %%0, %%1, %%2, %%3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));  // (a & b) | c
    return d;
}

// the four fp16 operand pairs of one word: nibbles (0, 4), (1, 5), (2, 6), (3, 7) as q = u - 8 (exact): the low
// nibble of each byte by 1024 + u minus 1032; the high one in place, 1024 + 16u, times 1/16 minus 72
__device__ __forceinline__ void f16_pairs(unsigned w, unsigned* q) {
    const unsigned hw = w >> 8;
    unsigned lo = lop3_and_or(w, 0x000F000Fu, 0x64006400u), hi = lop3_and_or(w, 0x00F000F0u, 0x64006400u);
    unsigned lo2 = lop3_and_or(hw, 0x000F000Fu, 0x64006400u), hi2 = lop3_and_or(hw, 0x00F000F0u, 0x64006400u);
    asm("sub.f16x2 %%0, %%1, %%2;" : "=r"(q[0]) : "r"(lo), "r"(0x64086408u));
    asm("fma.rn.f16x2 %%0, %%1, %%2, %%3;" : "=r"(q[1]) : "r"(hi), "r"(0x2C002C00u), "r"(0xD480D480u));
    asm("sub.f16x2 %%0, %%1, %%2;" : "=r"(q[2]) : "r"(lo2), "r"(0x64086408u));
    asm("fma.rn.f16x2 %%0, %%1, %%2, %%3;" : "=r"(q[3]) : "r"(hi2), "r"(0x2C002C00u), "r"(0xD480D480u));
}

__device__ __forceinline__ void mma(float* t, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                    unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%%0,%%1,%%2,%%3}, {%%4,%%5,%%6,%%7}, {%%8,%%9}, "
        "{%%0,%%1,%%2,%%3};"
        : "+f"(t[0]), "+f"(t[1]), "+f"(t[2]), "+f"(t[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// the two activation rows as fp16 in shared memory, permuted: element (G, p, c, m, v) is x[m, the column of value v
// of word 2c + p of scale group G], so a lane's B operands for one word are one 16-byte load
__device__ __forceinline__ void stage_x(const unsigned short* x, unsigned short* xs, int K, int tid) {
    for (int i = tid; i < 2 * K; i += WARPS * 32) {
        int v = i & 7, m = (i >> 3) & 1, cc = (i >> 4) & 3, p = (i >> 6) & 1, G = i >> 7;
        int word = 2 * cc + p;
        int col = G * 64 + 32 * (word >> 2) + 16 * (v >> 2) + 8 * ((v >> 1) & 1) + 2 * (word & 3) + (v & 1);
        float f = __uint_as_float((unsigned)x[m * K + col] << 16);
        unsigned short hv;
        asm("cvt.rn.f16.f32 %%0, %%1;" : "=h"(hv) : "f"(f));
        xs[i] = hv;  // fp16: the activations must stay under 65504
    }
}

// a 16-row tile's outputs: the warps' partial sums (`red`: WARPS x 16 rows x 2) meet after a barrier, added in warp
// order (deterministic), rounded to bf16
__device__ __forceinline__ void write_tile(float* red, const float* acc, unsigned short* y, int N, int r0, int tid,
                                           int warp, int g, int c) {
    if (c == 0) {
        red[(warp * 16 + g) * 2] = acc[0];
        red[(warp * 16 + g) * 2 + 1] = acc[1];
        red[(warp * 16 + g + 8) * 2] = acc[2];
        red[(warp * 16 + g + 8) * 2 + 1] = acc[3];
    }
    __syncthreads();
    if (tid < 32) {
        int r = tid >> 1, m = tid & 1;
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < WARPS; k++) sum += red[(k * 16 + r) * 2 + m];
        unsigned short o;
        asm("cvt.rn.bf16.f32 %%0, %%1;" : "=h"(o) : "f"(sum));
        y[m * N + r0 + r] = o;
    }
}
"""

# The baseline (the best kernel of the last probe): a 16-row tile per block, its warps splitting K, each warp's
# stream a tile's slice (it starts from empty at each tile); the activations rounded to fp16 in shared memory.
SOURCE3 = r"""
#define WARPS %(warps)d
#define D %(depth)d
#define MINB %(minb)d

""" + HELPERS + r"""
struct Chunk { uint2 a[D]; uint2 b[D]; float sa[D]; float sb[D]; };

__device__ __forceinline__ void load(Chunk& ch, const unsigned* w0, const unsigned* w8, const float* s0,
                                     const float* s8, int G, int c) {
#pragma unroll
    for (int d = 0; d < D; d++) {
        ch.a[d] = __ldg((const uint2*)(w0 + 8 * (G + d) + 2 * c));
        ch.b[d] = __ldg((const uint2*)(w8 + 8 * (G + d) + 2 * c));
        ch.sa[d] = __ldg(s0 + G + d);
        ch.sb[d] = __ldg(s8 + G + d);
    }
}

__device__ __forceinline__ void compute(const Chunk& ch, float* acc, const uint4* xs, int G, int c, int m) {
#pragma unroll
    for (int d = 0; d < D; d++) {
        float t[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int p = 0; p < 2; p++) {
            unsigned wa = p ? ch.a[d].y : ch.a[d].x;
            unsigned wb = p ? ch.b[d].y : ch.b[d].x;
            uint4 xv = xs[(((G + d) * 2 + p) * 4 + c) * 2 + m];
            unsigned qa[4], qb[4];
            f16_pairs(wa, qa);
            f16_pairs(wb, qb);
            mma(t, qa[0], qb[0], qa[1], qb[1], xv.x, xv.y);
            mma(t, qa[2], qb[2], qa[3], qb[3], xv.z, xv.w);
        }
        acc[0] += t[0] * ch.sa[d];
        acc[1] += t[1] * ch.sa[d];
        acc[2] += t[2] * ch.sb[d];
        acc[3] += t[3] * ch.sb[d];
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
int4_gemv3(const unsigned short* __restrict__ x, const unsigned* __restrict__ w, const float* __restrict__ s,
          unsigned short* __restrict__ y, int N, int K, int tiles) {
    extern __shared__ uint4 smem[];
    unsigned short* xs = (unsigned short*)smem;
    float* red = (float*)(xs + 2 * K);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
    stage_x(x, xs, K, tid);
    __syncthreads();
    const int groups = K >> 6, per_warp = groups / WARPS, words = K >> 3;
    const int gbeg = warp * per_warp, gend = gbeg + per_warp;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int r0 = tile * 16;
        const unsigned* w0 = w + (size_t)(r0 + g) * words;
        const unsigned* w8 = w0 + (size_t)8 * words;
        const float* s0 = s + (size_t)(r0 + g) * groups;
        const float* s8 = s0 + (size_t)8 * groups;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        Chunk A, B;
        load(A, w0, w8, s0, s8, gbeg, c);
        for (int G = gbeg; G < gend; G += 2 * D) {
            if (G + D < gend) load(B, w0, w8, s0, s8, G + D, c);
            compute(A, acc, smem, G, c, g & 1);
            if (G + 2 * D < gend) load(A, w0, w8, s0, s8, G + 2 * D, c);
            if (G + D < gend) compute(B, acc, smem, G + D, c, g & 1);
        }
        write_tile(red, acc, y, N, r0, tid, warp, g, c);
        __syncthreads();
    }
}
"""


SOURCE4 = r"""
#define WARPS %(warps)d
#define D %(depth)d
#define MINB %(minb)d
#define SPAN %(span)d
#define STEP (D * SPAN)  // scale groups a chunk

""" + HELPERS + r"""
// one chunk: D units of SPAN groups, rows g and g + 8; lane c's words 2c, 2c + 1 of each group of a unit, adjacent
struct Chunk { unsigned a[D][2 * SPAN]; unsigned b[D][2 * SPAN]; float sa[D][SPAN]; float sb[D][SPAN]; };

__device__ __forceinline__ void load_words(unsigned* dst, const unsigned* src) {
#if SPAN == 1
    uint2 v = __ldg((const uint2*)src);
    dst[0] = v.x; dst[1] = v.y;
#else
#pragma unroll
    for (int h = 0; h < SPAN / 2; h++) {
        uint4 v = __ldg((const uint4*)src + h);
        dst[4 * h] = v.x; dst[4 * h + 1] = v.y; dst[4 * h + 2] = v.z; dst[4 * h + 3] = v.w;
    }
#endif
}

__device__ __forceinline__ void load_scales(float* dst, const float* src) {
#if SPAN == 1
    dst[0] = __ldg(src);
#elif SPAN == 2
    float2 v = __ldg((const float2*)src);
    dst[0] = v.x; dst[1] = v.y;
#else
    float4 v = __ldg((const float4*)src);
    dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
#endif
}

// w0 / s0: row g's words and scales at this chunk's first group; the row g + 8 is `row8` words (`srow8` scales) on
__device__ __forceinline__ void load(Chunk& ch, const unsigned* w0, const float* s0, size_t row8, size_t srow8,
                                     int c) {
#pragma unroll
    for (int d = 0; d < D; d++) {
        load_words(ch.a[d], w0 + 8 * SPAN * d + 2 * SPAN * c);
        load_words(ch.b[d], w0 + row8 + 8 * SPAN * d + 2 * SPAN * c);
        load_scales(ch.sa[d], s0 + SPAN * d);
        load_scales(ch.sb[d], s0 + srow8 + SPAN * d);
    }
}

__device__ __forceinline__ void compute(const Chunk& ch, float* acc, const uint4* xs, int G, int c, int m) {
#pragma unroll
    for (int d = 0; d < D; d++) {
#pragma unroll
        for (int u = 0; u < SPAN; u++) {
            const int Gg = G + d * SPAN + u;
            float t[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int p = 0; p < 2; p++) {
                uint4 xv = xs[((Gg * 2 + p) * 4 + c) * 2 + m];
                unsigned qa[4], qb[4];
                f16_pairs(ch.a[d][2 * u + p], qa);
                f16_pairs(ch.b[d][2 * u + p], qb);
                mma(t, qa[0], qb[0], qa[1], qb[1], xv.x, xv.y);
                mma(t, qa[2], qb[2], qa[3], qb[3], xv.z, xv.w);
            }
            acc[0] += t[0] * ch.sa[d][u];
            acc[1] += t[1] * ch.sa[d][u];
            acc[2] += t[2] * ch.sb[d][u];
            acc[3] += t[3] * ch.sb[d][u];
        }
    }
}

// the stream's position: the next chunk to load (row g's words and scales, its first group)
struct Cursor { const unsigned* w; const float* s; int G; };

__device__ __forceinline__ void advance(Cursor& k, int gbeg, int gend, size_t tile_words, size_t tile_scales) {
    k.G += STEP;
    k.w += 8 * STEP;
    k.s += STEP;
    if (k.G == gend) {
        k.w += tile_words - 8 * (gend - gbeg);
        k.s += tile_scales - (gend - gbeg);
        k.G = gbeg;
    }
}

// after computing a chunk at group G: at a tile's end the warps' sums meet (in warp order) and the tile is written
__device__ __forceinline__ void finish(float* acc, int& G, int& tl, int gbeg, int gend, float* red,
                                       unsigned short* y, int N, int tid, int warp, int g, int c) {
    G += STEP;
    if (G != gend) return;
    G = gbeg;
    write_tile(red + (tl & 1) * WARPS * 32, acc, y, N, (blockIdx.x + tl * gridDim.x) * 16, tid, warp, g, c);
    acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    tl++;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
int4_gemv4(const unsigned short* __restrict__ x, const unsigned* __restrict__ w, const float* __restrict__ s,
           unsigned short* __restrict__ y, int N, int K, int tiles) {
    extern __shared__ uint4 smem[];
    unsigned short* xs = (unsigned short*)smem;
    float* red = (float*)(xs + 2 * K);  // two buffers of WARPS x 16 rows x 2
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
    const int groups = K >> 6, per_warp = groups / WARPS, words = K >> 3;
    const int gbeg = warp * per_warp, gend = gbeg + per_warp;
    const int my_tiles = blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const int total = my_tiles * (per_warp / STEP);
    const size_t row8 = (size_t)8 * words, srow8 = (size_t)8 * groups;
    const size_t tile_words = (size_t)gridDim.x * 16 * words, tile_scales = (size_t)gridDim.x * 16 * groups;
    Cursor k = {w + (size_t)(blockIdx.x * 16 + g) * words + 8 * gbeg, s + (size_t)(blockIdx.x * 16 + g) * groups + gbeg,
                gbeg};
    Chunk A, B;
    if (total > 0) {  // the first chunk in flight before the activations' permutation
        load(A, k.w, k.s, row8, srow8, c);
        advance(k, gbeg, gend, tile_words, tile_scales);
    }
    stage_x(x, xs, K, tid);
    __syncthreads();
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    int G = gbeg, tl = 0;
    for (int j = 0; j < total; j += 2) {
        if (j + 1 < total) {
            load(B, k.w, k.s, row8, srow8, c);
            advance(k, gbeg, gend, tile_words, tile_scales);
        }
        compute(A, acc, smem, G, c, g & 1);
        finish(acc, G, tl, gbeg, gend, red, y, N, tid, warp, g, c);
        if (j + 2 < total) {
            load(A, k.w, k.s, row8, srow8, c);
            advance(k, gbeg, gend, tile_words, tile_scales);
        }
        if (j + 1 < total) {
            compute(B, acc, smem, G, c, g & 1);
            finish(acc, G, tl, gbeg, gend, red, y, N, tid, warp, g, c);
        }
    }
}
"""

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
CONFIGS3 = [dict(warps=8, depth=d, minb=b) for d in (2, 4) for b in (2, 3)]  # the baseline's best four (call 48)
CONFIGS4 = [dict(warps=w, depth=d, minb=b, span=sp) for sp in (1, 2, 4) for d in (1, 2, 4) for w in (4, 8)
            for b in ((2, 4) if w == 4 else (2, 3)) if d * sp <= 8]


def shared_bytes3(k: int, cfg: dict) -> int:
    return 2 * k * 2 + cfg["warps"] * 16 * 2 * 4


def shared_bytes4(k: int, cfg: dict) -> int:
    return 2 * k * 2 + 2 * cfg["warps"] * 32 * 4


def label(family: int, cfg: dict) -> str:
    return f"v{family} " + json.dumps(cfg)


def variants() -> list[tuple[str, str, str, dict]]:
    """(label, source, kernel name, config) of every kernel the probe compiles."""
    out = [(label(3, cfg), SOURCE3 % cfg, "int4_gemv3", cfg) for cfg in CONFIGS3]
    out += [(label(4, cfg), SOURCE4 % cfg, "int4_gemv4", cfg) for cfg in CONFIGS4]
    return out


def compile_only(arch: str) -> dict:
    from torch.cuda._utils import _nvrtc_compile

    return {key: len(_nvrtc_compile(src, name, arch)[0]) for key, src, name, _ in variants()}


def span_order(words: torch.Tensor, span: int) -> torch.Tensor:
    """[N, K / 8] stored words with each lane's words of `span` consecutive groups adjacent: [N, units, 4 lanes,
    span, 2] from [N, units, span, 4 lanes, 2]."""
    n, kw = words.shape
    return words.view(n, kw // (8 * span), span, 4, 2).transpose(2, 3).contiguous().view(n, kw)


def timed(fn, copies: int, reps: int = 20) -> float:
    """us per launch: `copies` launches (over weight copies, past the L2) captured once, replayed `reps` times."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(copies):
            fn(i)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(copies):
                fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / copies)
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def fits(cfg: dict, k: int) -> bool:
    return (k // 64) % (cfg["warps"] * cfg["depth"] * cfg.get("span", 1)) == 0


def launcher(kern, cfg: dict, x, words, scales, y, n: int, k: int, sms: int):
    tiles = n // 16
    grid = min(tiles, cfg["minb"] * sms)
    smem = shared_bytes4(k, cfg) if "span" in cfg else shared_bytes3(k, cfg)

    def launch(i):
        kern(grid=(grid, 1, 1), block=(cfg["warps"] * 32, 1, 1), args=[x, words[i], scales[i], y, n, k, tiles],
             shared_mem=smem)
    return launch


def compiled():
    out = {}
    for key, src, name, cfg in variants():
        kern = torch.cuda._compile_kernel(src, name)
        kern.set_shared_memory_config(max(shared_bytes3(12288, cfg), shared_bytes4(12288, cfg)))
        out[key] = (kern, cfg)
    return out


def run(path: str) -> None:
    from music3_demo.semantic.kernels import linear
    from music3_demo.semantic.kernels.tuning import tuning_for
    from music3_demo.semantic.quant import quantize_weight

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tuning = tuning_for(dev)
    kernels = compiled()
    report = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "sms": sms, "shapes": {}}
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        weight_bytes = n * k // 2 + n * (k // 64) * 4
        copies = max(2, -(-400_000_000 // weight_bytes))
        qws = [quantize_weight(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02, "int4", 64)
               for _ in range(copies)]
        x = torch.randn(2, k, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ qws[0].dequantize(torch.float32).T
        scales = [q.scale for q in qws]
        ordered = {sp: [span_order(q.data.view(torch.int32), sp) for q in qws] for sp in (2, 4)}
        ordered[1] = [q.data.view(torch.int32) for q in qws]
        y = torch.empty(2, n, device=dev, dtype=torch.bfloat16)
        row = {"n": n, "k": k, "weight_MB": weight_bytes / 1e6, "copies": copies, "cuda": {}}
        for key, (kern, cfg) in kernels.items():
            if not fits(cfg, k):
                continue
            launch = launcher(kern, cfg, x, ordered[cfg.get("span", 1)], scales, y, n, k, sms)
            y.zero_()
            launch(0)
            torch.cuda.synchronize()
            err = rel(y, ref)
            us = timed(launch, copies)
            row["cuda"][key] = {"us": us, "TBps": weight_bytes / us / 1e6, "rel_err": err}
        for fam in (3, 4):
            best = min(((key, v) for key, v in row["cuda"].items() if key.startswith(f"v{fam}")),
                       key=lambda kv: kv[1]["us"])
            row[f"v{fam}_best"] = {"config": best[0], **best[1]}
        for sp in (1, 2, 4):
            got = [(key, v) for key, v in row["cuda"].items() if f'"span": {sp}' in key]
            if got:
                best = min(got, key=lambda kv: kv[1]["us"])
                row[f"v4_span{sp}_best"] = {"config": best[0], **best[1]}
        bad = {key: v for key, v in row["cuda"].items() if not v["rel_err"] < 5e-3}
        row["bad"] = bad
        workspace = linear.GemvWorkspace(dev)
        cfg = tuning.gemv(2, n, k, w_bytes=1, group=64, kind="int4")
        yt = torch.empty(2, n, device=dev, dtype=torch.bfloat16)
        linear.gemv(x, qws[0], yt, config=cfg, workspace=workspace)
        torch.cuda.synchronize()
        err = rel(yt, ref)  # (before the timing, which leaves another copy's product in yt)
        us = timed(lambda i: linear.gemv(x, qws[i], yt, config=cfg, workspace=workspace), copies)
        row["triton"] = {"us": us, "TBps": weight_bytes / us / 1e6, "rel_err": err, "config": str(cfg)}
        if name == "gate_up":  # the engine's form: the same bytes as an interleaved gate|up with its SwiGLU epilogue
            cfg = tuning.gemv(2, n, k, True, w_bytes=1, group=64, kind="int4")
            half = torch.empty(2, n // 2, device=dev, dtype=torch.bfloat16)
            linear.gemv(x, qws[0], half, config=cfg, workspace=workspace, swiglu=True)
            us = timed(lambda i: linear.gemv(x, qws[i], half, config=cfg, workspace=workspace, swiglu=True), copies)
            row["triton_swiglu"] = {"us": us, "TBps": weight_bytes / us / 1e6, "config": str(cfg)}
        copy_src = torch.empty(weight_bytes // 2, device=dev, dtype=torch.bfloat16)
        copy_dst = torch.empty_like(copy_src)
        row["copy_us"] = timed(lambda i: copy_dst.copy_(copy_src), 2)  # read + write of the weight's bytes
        report["shapes"][name] = row
        print(name, json.dumps({key: row[key] for key in row if key.endswith("best") or key in ("triton", "bad")}),
              flush=True)
        del qws, ordered, scales, copy_src, copy_dst
        torch.cuda.empty_cache()
    block = {"triton": sum(r.get("triton_swiglu", r["triton"])["us"] for r in report["shapes"].values())}
    for fam in ("v3_best", "v4_best"):
        block[fam] = sum(r[fam]["us"] for r in report["shapes"].values())
    report["lm_block_us"] = block
    print("LM block's four products:", block)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def once(shapes: list[str], best_path: str) -> None:
    """Two launches each of the best baseline, the best new kernel and the engine's Triton GEMV per shape: what
    Nsight Compute profiles (`ncu -k regex:'int4_gemv|_gemv_kernel' --launch-count 12 ...`)."""
    from music3_demo.semantic.kernels import linear
    from music3_demo.semantic.kernels.tuning import tuning_for
    from music3_demo.semantic.quant import quantize_weight

    with open(best_path) as f:
        report = json.load(f)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for name in shapes:
        n, k = SHAPES[name]
        qw = quantize_weight(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02, "int4", 64)
        x = torch.randn(2, k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(2, n, device=dev, dtype=torch.bfloat16)
        launches = []
        for fam in ("v3_best", "v4_best"):
            key = report["shapes"][name][fam]["config"]
            cfg = json.loads(key.split(" ", 1)[1])
            src, kname = (SOURCE4, "int4_gemv4") if "span" in cfg else (SOURCE3, "int4_gemv3")
            kern = torch.cuda._compile_kernel(src % cfg, kname)
            kern.set_shared_memory_config(max(shared_bytes3(12288, cfg), shared_bytes4(12288, cfg)))
            words = span_order(qw.data.view(torch.int32), cfg.get("span", 1))
            launches.append(launcher(kern, cfg, x, [words], [qw.scale], y, n, k, sms))
        tcfg = tuning_for(dev).gemv(2, n, k, name == "gate_up", w_bytes=1, group=64, kind="int4")
        workspace = linear.GemvWorkspace(dev)
        yt = torch.empty(2, n // 2 if name == "gate_up" else n, device=dev, dtype=torch.bfloat16)
        launches.append(lambda i: linear.gemv(x, qw, yt, config=tcfg, workspace=workspace, swiglu=name == "gate_up"))
        for launch in launches:
            for _ in range(2):
                launch(0)
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", default="int4_cuda_probe.json")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--arch", default="90")
    parser.add_argument("--once", help="comma-separated shapes: launch each a few times for a profiler")
    parser.add_argument("--best", help="with --once: the JSON of a full run, whose best configs are launched")
    args = parser.parse_args()
    if args.once:
        once(args.once.split(","), args.best)
    elif args.compile_only:
        print(json.dumps(compile_only(args.arch), indent=1))
    else:
        run(args.output)


if __name__ == "__main__":
    main()
