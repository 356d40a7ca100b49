"""Probe: a hand-written CUDA int4 GEMV (2 rows, the stored int4/g64 weights in MMA order) against the engine's
Triton GEMV on the LM block's four products, each checked against float32 on the same dequantized weights.

What it asks: whether a kernel that owns its instruction stream (NVRTC through `torch.cuda._compile_kernel`) streams
int4 weights near the memory's bandwidth where the Triton products reach ~1 TB/s.

The kernel: a 16-row tile per block, its warps splitting K; each warp's mma.sync m16n8k16 (bf16) takes the weights
as the A operand straight from the words a thread loads (lane c of each quad: words 2c and 2c + 1 of a 64-column
scale group, 8 bytes a row; nibbles s and s + 4 of a word are the adjacent columns of one operand register, made
bf16 by a mask, the magic number 128 and one packed FMA), and the two activation rows as B (columns 0 and 1 of
n8), from a copy in shared memory permuted so each lane's operands are one 16-byte load. One MMA's K is one scale
group, so each group's product is scaled once in float32. The warps' partial sums meet in shared memory and are
added in warp order (deterministic).

Run on a GPU:  python scripts/int4_cuda_probe.py OUT.json
On a CPU (compile only, needs libnvrtc):  python scripts/int4_cuda_probe.py --compile-only [--arch 90]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

SOURCE = r"""
#define WARPS %(warps)d
#define D %(depth)d
#define MINB %(minb)d

__device__ __forceinline__ unsigned bf16_pair(unsigned w, int shift) {
    unsigned t = ((w >> shift) & 0x000F000Fu) | 0x43004300u;  // two bf16 128 + u
    unsigned q;
    asm("fma.rn.bf16x2 %%0, %%1, %%2, %%3;" : "=r"(q) : "r"(t), "r"(0x3F803F80u), "r"(0xC308C308u));
    return q;  // u - 8, exact
}

__device__ __forceinline__ void mma(float* t, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                    unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%%0,%%1,%%2,%%3}, {%%4,%%5,%%6,%%7}, {%%8,%%9}, "
        "{%%0,%%1,%%2,%%3};"
        : "+f"(t[0]), "+f"(t[1]), "+f"(t[2]), "+f"(t[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

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
            mma(t, bf16_pair(wa, 0), bf16_pair(wb, 0), bf16_pair(wa, 4), bf16_pair(wb, 4), xv.x, xv.y);
            mma(t, bf16_pair(wa, 8), bf16_pair(wb, 8), bf16_pair(wa, 12), bf16_pair(wb, 12), xv.z, xv.w);
        }
        acc[0] += t[0] * ch.sa[d];
        acc[1] += t[1] * ch.sa[d];
        acc[2] += t[2] * ch.sb[d];
        acc[3] += t[3] * ch.sb[d];
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
int4_gemv(const unsigned short* __restrict__ x, const unsigned* __restrict__ w, const float* __restrict__ s,
          unsigned short* __restrict__ y, int N, int K, int tiles) {
    extern __shared__ uint4 smem[];
    unsigned short* xs = (unsigned short*)smem;
    float* red = (float*)(xs + 2 * K);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
    // x, permuted: element (G, p, c, m, v) is x[m, column of value v of word 2c + p of group G]
    for (int i = tid; i < 2 * K; i += WARPS * 32) {
        int v = i & 7, m = (i >> 3) & 1, cc = (i >> 4) & 3, p = (i >> 6) & 1, G = i >> 7;
        int word = 2 * cc + p;
        int col = G * 64 + 32 * (word >> 2) + 16 * (v >> 2) + 8 * ((v >> 1) & 1) + 2 * (word & 3) + (v & 1);
        xs[i] = x[m * K + col];
    }
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
        __syncthreads();
    }
}
"""

# The first kernel with fp16 operands: one mask-and-or a nibble pair (no shift for the high nibbles), the
# activations rounded to fp16 in shared memory.
SOURCE3 = r"""
#define WARPS %(warps)d
#define D %(depth)d
#define MINB %(minb)d

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
    // x, permuted: element (G, p, c, m, v) is x[m, column of value v of word 2c + p of group G]
    for (int i = tid; i < 2 * K; i += WARPS * 32) {
        int v = i & 7, m = (i >> 3) & 1, cc = (i >> 4) & 3, p = (i >> 6) & 1, G = i >> 7;
        int word = 2 * cc + p;
        int col = G * 64 + 32 * (word >> 2) + 16 * (v >> 2) + 8 * ((v >> 1) & 1) + 2 * (word & 3) + (v & 1);
        float f = __uint_as_float((unsigned)x[m * K + col] << 16);
        unsigned short hv;
        asm("cvt.rn.f16.f32 %%0, %%1;" : "=h"(hv) : "f"(f));
        xs[i] = hv;  // fp16: the activations must stay under 65504
    }
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
        __syncthreads();
    }
}
"""

SOURCE2 = r"""
#define WARPS %(warps)d
#define S %(stages)d
#define MINB %(minb)d
#define STEP_BYTES 576  // a step: one scale group of a 16-row tile, 16 rows x 32 bytes of words, 16 float scales

__device__ __forceinline__ unsigned bf16_pair(unsigned w, int shift) {
    unsigned t = ((w >> shift) & 0x000F000Fu) | 0x43004300u;
    unsigned q;
    asm("fma.rn.bf16x2 %%0, %%1, %%2, %%3;" : "=r"(q) : "r"(t), "r"(0x3F803F80u), "r"(0xC308C308u));
    return q;
}

__device__ __forceinline__ void mma(float* t, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                    unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%%0,%%1,%%2,%%3}, {%%4,%%5,%%6,%%7}, {%%8,%%9}, "
        "{%%0,%%1,%%2,%%3};"
        : "+f"(t[0]), "+f"(t[1]), "+f"(t[2]), "+f"(t[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// step j of this warp's stream: tile blockIdx.x + (j / gpw) * gridDim.x, group gbeg + j %% gpw
__device__ __forceinline__ void issue(char* ring, const unsigned* w, const float* s, int j, int total, int gpw,
                                      int gbeg, int groups, int words, int lane) {
    if (j < total) {
        int tile = blockIdx.x + (j / gpw) * gridDim.x, G = gbeg + j %% gpw;
        char* st = ring + (j %% S) * STEP_BYTES;
        int row = lane >> 1, half = lane & 1;
        const unsigned* src = w + (size_t)(tile * 16 + row) * words + 8 * G + 4 * half;
        asm volatile("cp.async.cg.shared.global [%%0], [%%1], 16;" :: "r"(smem_addr(st + row * 32 + half * 16)),
                     "l"(src));
        if (lane < 16) {
            const float* ss = s + (size_t)(tile * 16 + lane) * groups + G;
            asm volatile("cp.async.ca.shared.global [%%0], [%%1], 4;" :: "r"(smem_addr(st + 512 + lane * 4)),
                         "l"(ss));
        }
    }
    asm volatile("cp.async.commit_group;");
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
int4_gemv2(const unsigned short* __restrict__ x, const unsigned* __restrict__ w, const float* __restrict__ s,
           unsigned short* __restrict__ y, int N, int K, int tiles) {
    extern __shared__ uint4 smem[];
    unsigned short* xs = (unsigned short*)smem;
    char* rings = (char*)(xs + 2 * K);
    float* red = (float*)(rings + WARPS * S * STEP_BYTES);  // two buffers of WARPS x 16 rows x 2
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
    const int groups = K >> 6, gpw = groups / WARPS, words = K >> 3, gbeg = warp * gpw;
    const int my_tiles = blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const int total = my_tiles * gpw;
    char* ring = rings + warp * S * STEP_BYTES;
    for (int j = 0; j < S - 1; j++) issue(ring, w, s, j, total, gpw, gbeg, groups, words, lane);
    // x, permuted (as the first kernel), 8 columns a thread at a time while the first steps are in flight
    for (int q = tid; q < 2 * K / 8; q += WARPS * 32) {
        int m = q / (K / 8), col0 = (q %% (K / 8)) * 8;
        uint4 v8 = __ldg((const uint4*)(x + m * K) + (col0 >> 3));
        const unsigned short* e = (const unsigned short*)&v8;
#pragma unroll
        for (int t = 0; t < 8; t++) {
            int col = col0 + t, G = col >> 6, cl = col & 63, run = cl >> 5, h = (cl >> 4) & 1, a = (cl >> 3) & 1;
            int cw = (cl >> 1) & 3, b = cl & 1, word = 4 * run + cw;
            xs[((((G * 2 + (word & 1)) * 4 + (word >> 1)) * 2 + m) * 8) + 4 * h + 2 * a + b] = e[t];
        }
    }
    __syncthreads();
    const uint4* xs4 = (const uint4*)smem;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < total; j++) {
        asm volatile("cp.async.wait_group %%0;" :: "n"(S - 2));
        __syncwarp();
        const char* st = ring + (j %% S) * STEP_BYTES;
        uint2 wa = *(const uint2*)(st + g * 32 + 8 * c);
        uint2 wb = *(const uint2*)(st + (g + 8) * 32 + 8 * c);
        float sa = *(const float*)(st + 512 + g * 4), sb = *(const float*)(st + 512 + (g + 8) * 4);
        __syncwarp();
        issue(ring, w, s, j + S - 1, total, gpw, gbeg, groups, words, lane);
        const int G = gbeg + j %% gpw;
        float t[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int p = 0; p < 2; p++) {
            unsigned ua = p ? wa.y : wa.x, ub = p ? wb.y : wb.x;
            uint4 xv = xs4[((G * 2 + p) * 4 + c) * 2 + (g & 1)];
            mma(t, bf16_pair(ua, 0), bf16_pair(ub, 0), bf16_pair(ua, 4), bf16_pair(ub, 4), xv.x, xv.y);
            mma(t, bf16_pair(ua, 8), bf16_pair(ub, 8), bf16_pair(ua, 12), bf16_pair(ub, 12), xv.z, xv.w);
        }
        acc[0] += t[0] * sa;
        acc[1] += t[1] * sa;
        acc[2] += t[2] * sb;
        acc[3] += t[3] * sb;
        if (j %% gpw == gpw - 1) {  // this warp's slice of the tile is done: the warps' sums meet, in warp order
            const int tl = j / gpw, tile = blockIdx.x + tl * gridDim.x;
            float* rb = red + (tl & 1) * WARPS * 32;
            if (c == 0) {
                rb[(warp * 16 + g) * 2] = acc[0];
                rb[(warp * 16 + g) * 2 + 1] = acc[1];
                rb[(warp * 16 + g + 8) * 2] = acc[2];
                rb[(warp * 16 + g + 8) * 2 + 1] = acc[3];
            }
            acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
            __syncthreads();
            if (tid < 32) {
                int r = tid >> 1, m = tid & 1;
                float sum = 0.f;
#pragma unroll
                for (int k = 0; k < WARPS; k++) sum += rb[(k * 16 + r) * 2 + m];
                unsigned short o;
                asm("cvt.rn.bf16.f32 %%0, %%1;" : "=h"(o) : "f"(sum));
                y[m * N + tile * 16 + r] = o;
            }
        }
    }
    asm volatile("cp.async.wait_group 0;");
}
"""
CONFIGS2 = [dict(warps=w, stages=st, minb=b) for w, st, b in
            ((8, 4, 2), (8, 8, 2), (8, 12, 2), (8, 8, 3), (8, 6, 3), (4, 8, 3), (4, 12, 4), (8, 16, 2))]


def shared_bytes2(k: int, cfg: dict) -> int:
    return 2 * k * 2 + cfg["warps"] * cfg["stages"] * 576 + 2 * cfg["warps"] * 32 * 4


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
CONFIGS = [dict(warps=w, depth=d, minb=b) for w in (4, 8) for d in (2, 4) for b in (1, 2, 3)]


def source(cfg: dict) -> str:
    return SOURCE % cfg


def shared_bytes(k: int, warps: int) -> int:
    return 2 * k * 2 + warps * 16 * 2 * 4


def compile_only(arch: str) -> dict:
    from torch.cuda._utils import _nvrtc_compile

    out = {}
    for cfg in CONFIGS:
        cubin, _ = _nvrtc_compile(source(cfg), "int4_gemv", arch)
        out["v1 " + json.dumps(cfg)] = len(cubin)
    for cfg in CONFIGS:
        cubin, _ = _nvrtc_compile(SOURCE3 % cfg, "int4_gemv3", arch)
        out["v3 " + json.dumps(cfg)] = len(cubin)
    for cfg in CONFIGS2:
        cubin, _ = _nvrtc_compile(SOURCE2 % cfg, "int4_gemv2", arch)
        out["v2 " + json.dumps(cfg)] = len(cubin)
    return out


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


def run(path: str) -> None:
    from music3_demo.semantic.kernels import linear
    from music3_demo.semantic.kernels.tuning import tuning_for
    from music3_demo.semantic.quant import quantize_weight

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tuning = tuning_for(dev)
    kernels = {}  # name -> (kernel, cfg, shared bytes of K, kernel family)
    for cfg in CONFIGS:
        kern = torch.cuda._compile_kernel(source(cfg), "int4_gemv")
        kern.set_shared_memory_config(shared_bytes(12288, cfg["warps"]))
        kernels["v1 " + json.dumps(cfg)] = (kern, cfg, lambda k, cfg=cfg: shared_bytes(k, cfg["warps"]), 1)
    for cfg in CONFIGS:
        kern = torch.cuda._compile_kernel(SOURCE3 % cfg, "int4_gemv3")
        kern.set_shared_memory_config(shared_bytes(12288, cfg["warps"]))
        kernels["v3 " + json.dumps(cfg)] = (kern, cfg, lambda k, cfg=cfg: shared_bytes(k, cfg["warps"]), 3)
    for cfg in CONFIGS2:
        kern = torch.cuda._compile_kernel(SOURCE2 % cfg, "int4_gemv2")
        kern.set_shared_memory_config(shared_bytes2(12288, cfg))
        kernels["v2 " + json.dumps(cfg)] = (kern, cfg, lambda k, cfg=cfg: shared_bytes2(k, cfg), 2)
    report = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "sms": sms, "shapes": {}}
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        weight_bytes = n * k // 2 + n * (k // 64) * 4
        copies = max(2, -(-400_000_000 // weight_bytes))
        qws = [quantize_weight(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02, "int4", 64)
               for _ in range(copies)]
        x = torch.randn(2, k, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ qws[0].dequantize(torch.float32).T
        words = [q.data.view(torch.int32) for q in qws]
        y = torch.empty(2, n, device=dev, dtype=torch.bfloat16)
        row = {"n": n, "k": k, "weight_MB": weight_bytes / 1e6, "copies": copies, "cuda": {}}
        for key, (kern, cfg, smem, family) in kernels.items():
            if (k // 64) % (cfg["warps"] * cfg.get("depth", 1)):
                continue
            tiles = n // 16
            grid = min(tiles, cfg["minb"] * sms)

            def launch(i, kern=kern, cfg=cfg, grid=grid, tiles=tiles, smem=smem):
                kern(grid=(grid, 1, 1), block=(cfg["warps"] * 32, 1, 1),
                     args=[x, words[i], qws[i].scale, y, n, k, tiles], shared_mem=smem(k))

            y.zero_()
            launch(0)
            torch.cuda.synchronize()
            err = rel(y, ref)
            us = timed(launch, copies)
            row["cuda"][key] = {"us": us, "TBps": weight_bytes / us / 1e6, "rel_err": err}
        best = min(row["cuda"].items(), key=lambda kv: kv[1]["us"])
        row["cuda_best"] = {"config": best[0], **best[1]}
        assert all(v["rel_err"] < 5e-3 for v in row["cuda"].values()), row["cuda"]
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
        dense = qws[0].dequantize()
        ybf = torch.empty(2, n, device=dev, dtype=torch.bfloat16)
        linear.gemv(x, dense, ybf, config=tuning.gemv(2, n, k))
        torch.cuda.synchronize()
        row["bf16_rel_err"] = rel(ybf, ref)
        report["shapes"][name] = row
        print(name, json.dumps({"cuda": row["cuda_best"], "triton": row["triton"], "bf16_err": row["bf16_rel_err"]}),
              flush=True)
        del qws, words, dense
        torch.cuda.empty_cache()
    block = {"triton": sum(r.get("triton_swiglu", r["triton"])["us"] for r in report["shapes"].values()),
             "cuda": sum(r["cuda_best"]["us"] for r in report["shapes"].values())}
    report["lm_block_us"] = block
    print("LM block's four products:", block)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def once(shapes: list[str]) -> None:
    """One launch of the third kernel's best config and of the engine's Triton GEMV per shape, after a warm-up:
    what Nsight Compute profiles (`ncu -k regex:'int4_gemv3|_gemv_kernel' ...`)."""
    from music3_demo.semantic.kernels import linear
    from music3_demo.semantic.kernels.tuning import tuning_for
    from music3_demo.semantic.quant import quantize_weight

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    best = {"gate_up": dict(warps=8, depth=4, minb=2), "down": dict(warps=8, depth=2, minb=2),
            "qkv": dict(warps=8, depth=2, minb=3), "o": dict(warps=8, depth=2, minb=2)}
    for name in shapes:
        n, k = SHAPES[name]
        cfg = best[name]
        kern = torch.cuda._compile_kernel(SOURCE3 % cfg, "int4_gemv3")
        kern.set_shared_memory_config(shared_bytes(12288, cfg["warps"]))
        qw = quantize_weight(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02, "int4", 64)
        x = torch.randn(2, k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(2, n, device=dev, dtype=torch.bfloat16)
        tiles = n // 16
        tcfg = tuning_for(dev).gemv(2, n, k, name == "gate_up", w_bytes=1, group=64, kind="int4")
        workspace = linear.GemvWorkspace(dev)
        yt = torch.empty(2, n // 2 if name == "gate_up" else n, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            kern(grid=(min(tiles, cfg["minb"] * sms), 1, 1), block=(cfg["warps"] * 32, 1, 1),
                 args=[x, qw.data.view(torch.int32), qw.scale, y, n, k, tiles], shared_mem=shared_bytes(k, cfg["warps"]))
            linear.gemv(x, qw, yt, config=tcfg, workspace=workspace, swiglu=name == "gate_up")
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", default="int4_cuda_probe.json")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--arch", default="90")
    parser.add_argument("--once", help="comma-separated shapes: launch each a few times for a profiler")
    args = parser.parse_args()
    if args.once:
        once(args.once.split(","))
    elif args.compile_only:
        print(json.dumps(compile_only(args.arch), indent=1))
    else:
        run(args.output)


if __name__ == "__main__":
    main()
