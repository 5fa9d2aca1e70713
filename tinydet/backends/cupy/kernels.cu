// The GPU backend's kernels: every output computed by the operations of the CPU backend in the same
// order (tinydet/backends/cpu, docs in each function), each chain of them in one thread, so that each
// result has the CPU's bits. Built by NVRTC with --fmad=false (a*b + c stays a rounded multiply and a
// rounded add; NVRTC's default fuses them), --prec-div=true, --prec-sqrt=true, --ftz=false; no
// fast-math intrinsics, and exp/tanh are tinydet's own (CUDA's expf uses ex2.approx). No warp
// shuffles and no atomics: threads share work only through shared memory between barriers, in the
// block kernels (BLOCK_KERNEL), so that the same source also builds with a host C++ compiler into a
// serial emulator (device.HostDevice) that the tests run on a machine without a GPU.
// tests/test_cuda.py lints the PTX: no fma, no .approx, no .ftz, every float add/sub/mul/div `.rn`.
//
// A KERNEL's threads are independent: the emulator runs them one after another. A BLOCK_KERNEL's body
// runs once per thread block: code outside FOR_THREADS { ... } must be the same for every thread of
// the block (it runs once on the host); FOR_THREADS { ... } is each thread's part (a loop over the
// block's threads on the host, which must not return from inside it); SYNC is __syncthreads() (on the
// host the loop's end is the barrier), and follows every FOR_THREADS but a kernel's last (the tests
// check it, and that running the threads in reverse changes no bit). SHARED arrays are the block's shared memory; a thread's own
// values that outlive a SYNC are PER_THREAD arrays, read and written as MY(name).

#ifdef __CUDACC__
#define KERNEL extern "C" __global__ void
#define BLOCK_KERNEL extern "C" __global__ void
#define DEV static __device__ __forceinline__
#define UNROLL _Pragma("unroll")
#define UNROLL16 _Pragma("unroll 16")
#define SHARED __shared__
#define SYNC __syncthreads()
#define FOR_THREADS
#define PER_THREAD(type, name, dims) type name dims
#define MY(name) name
typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
DEV float as_float(u32 u) { return __uint_as_float(u); }
DEV u32 as_u32(float f) { return __float_as_uint(f); }
DEV double as_double(i64 u) { return __longlong_as_double(u); }
DEV int dp4a(int a, int b, int c) { return __dp4a(a, b, c); }  // c + the 4 signed byte products of a and b
#else
#include <math.h>
#include <string.h>
#define KERNEL extern "C" void
#define BLOCK_KERNEL extern "C" void
#define DEV static inline
#define UNROLL
#define UNROLL16
#define SHARED static
#define SYNC
// emu_reverse (HostDevice(reverse=True)) runs threads and blocks in the opposite order: results that
// changed with it would show threads that read what others of the same step write.
static int emu_reverse = 0;
extern "C" void emu_set_reverse(int r) { emu_reverse = r; }
#define FOR_THREADS for (unsigned l_t = 0; l_t < blockDim.x && \
    ((threadIdx.x = emu_reverse ? blockDim.x - 1 - l_t : l_t), 1); l_t++)
#define MAX_THREADS 1024
#define PER_THREAD(type, name, dims) static type name[MAX_THREADS] dims
#define MY(name) name[threadIdx.x]
typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
struct dim3 { unsigned x, y, z; };
static dim3 blockIdx, threadIdx, blockDim, gridDim;  // set by the emulator's launch loops
DEV float as_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
DEV u32 as_u32(float f) { u32 u; memcpy(&u, &f, 4); return u; }
DEV double as_double(i64 u) { double f; memcpy(&f, &u, 8); return f; }
DEV int dp4a(int a, int b, int c) {  // __dp4a(int, int, int): c + sum of a's and b's signed bytes' products
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
#endif

// Thread indices (grids are one-dimensional but for the matrix product's rows, so that no count
// meets the 65535 limit of grid y).
#define GX ((i64)blockIdx.x * blockDim.x + threadIdx.x)
#define GY ((i64)blockIdx.y * blockDim.y + threadIdx.y)

// ---------------------------------------------------------------------------------------------------
// fp16 bits and the compensated-sum step (numerics/simd.py).

// binary16 bits -> float32, exactly (no float32 subnormal is ever formed: a half subnormal is m * 2**-24).
DEV float f16_to_f32(u32 h) {
    u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
    float v;
    if (e == 0) v = (float)m * 5.9604644775390625e-08f;
    else if (e == 31) v = as_float(0x7F800000u | (m << 13));
    else v = as_float(((e + 112u) << 23) | (m << 13));
    return as_float(as_u32(v) | sign);
}

// float32 -> binary16 bits, round to nearest even: simd.f32_to_f16's operations.
DEV u16 f32_to_f16(float x) {
    u32 f = as_u32(x), sign = f & 0x80000000u, o;
    f ^= sign;
    if (f >= (143u << 23)) {
        o = f > 0x7F800000u ? 0x7E00u : 0x7C00u;
    } else if (f < (113u << 23)) {
        u32 magic = 126u << 23;
        o = as_u32(as_float(f) + as_float(magic)) - magic;
    } else {
        u32 mant_odd = (f >> 13) & 1u;
        f = f + 0xC8000000u + 0xFFFu + mant_odd;  // 0xC8000000 = (15 - 127) << 23, modulo 2**32
        o = f >> 13;
    }
    return (u16)(o | (sign >> 16));
}

// y = part - c; z = s + y; c = (z - s) - y; s = z. A chain of these over values in memory is unrolled
// (UNROLL16) so that its loads are in flight together: with a loop of one load and one dependent step
// each step would wait for its load (the arithmetic and its order are the same).
#define KAHAN(part, s, c) do { float y_ = (part) - (c); float z_ = (s) + y_; (c) = (z_ - (s)) - y_; (s) = z_; } while (0)

// ---------------------------------------------------------------------------------------------------
// exp and tanh (numerics/vmath.py: mathfn's float64 operations, inputs clamped to [-708, 709]).

#define LN2_HI 6.93147180369123816490e-01
#define LN2_LO 1.90821492927058770002e-10
#define INV_LN2 1.44269504088896338700e+00

DEV double exp64(double x) {
    bool nan = x != x;
    double xc = x < -708.0 ? -708.0 : x;
    xc = xc > 709.0 ? 709.0 : xc;
    xc = nan ? 0.0 : xc;
    double k = floor(xc * INV_LN2 + 0.5);
    double r = (xc - k * LN2_HI) - k * LN2_LO;
    double p = 1.0 / 6227020800.0;
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 1.0 / 2.0;
    p = p * r + 1.0;
    p = p * r + 1.0;
    double scale = as_double(((i64)k + 1023) << 52);
    return nan ? x : p * scale;
}

DEV float exp32(float x) { return (float)exp64((double)x); }

DEV float tanh32(float v) {
    double x = (double)v;
    bool neg = x < 0.0;
    double a = neg ? -0.0 - x : x;
    double t = 1.0 - 2.0 / (exp64(2.0 * a) + 1.0);
    return (float)(neg ? -0.0 - t : t);
}

// ---------------------------------------------------------------------------------------------------
// Weights: element (n, k) of a matrix in one of the CPU backend's storages (packing/layout.py), exactly
// as cpu/qblocks.py computes it. `n` counts from the first output of the panels at p0; scale arrays
// (d, m) are fp16 bits (MXFP4's d: E8M0 bytes).

struct W { const void *qs, *d, *m, *sc, *qh; int K; i64 p0; };

DEV float scale_at(const void* a, i64 i) { return f16_to_f32(((const u16*)a)[i]); }

// Q8_0I: Q8_0 in the integer mode's layout (packing/intpanels.py: qs (P, nb, 8, 32, 4)), for embeddings only.
enum { F32P, F16P, F32R, F16R, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K, MXFP4, Q8_0I, Q5_1 };

// A quantized 32-element block's values, in two steps: `qblock` loads what its elements share (scales,
// high bits) once, `qel` makes element e from that and the element's low-bits word (the byte, for
// Q8_0) and, for Q6_K, its high-bits word. `wat` takes one element; `wblock` a whole k-block of 64,
// each word read once (gemv's decode).
struct QB { float d, m; u32 h; };

template <int KIND> DEV void qblock(const W& w, i64 p, i64 j, int b, QB& o) {
    const int nb = w.K / 32, ns = w.K / 256;
    const i64 bi = (p * nb + b) * 32 + j;
    o.m = 0.0f;
    o.h = 0u;
    if (KIND == MXFP4) {  // d = 2^(e - 128) from the E8M0 byte's bits (ggml's E8M0_TO_FP32_HALF)
        u32 e = ((const unsigned char*)w.d)[bi];
        o.d = as_float(e < 2u ? 0x00200000u << e : (e - 1u) << 23);
    } else if (KIND == Q8_0 || KIND == Q8_0I || KIND == Q4_0 || KIND == Q4_1 || KIND == Q5_0 || KIND == Q5_1) {
        o.d = scale_at(w.d, bi);
        if (KIND == Q4_1 || KIND == Q5_1) o.m = scale_at(w.m, bi);
        if (KIND == Q5_0 || KIND == Q5_1) o.h = ((const u32*)w.qh)[bi];
    } else if (KIND == Q4_K || KIND == Q5_K) {
        const int s = b / 8, jj = b % 8;
        const unsigned char* sc = (const unsigned char*)w.sc + (p * ns + s) * 12 * 32 + j;
        u32 scale, mn;  // ggml's get_scale_min_k4
        if (jj < 4) {
            scale = sc[jj * 32] & 63u;
            mn = sc[(jj + 4) * 32] & 63u;
        } else {
            scale = (sc[(jj + 4) * 32] & 15u) | ((sc[(jj - 4) * 32] >> 6) << 4);
            mn = (sc[(jj + 4) * 32] >> 4) | ((sc[jj * 32] >> 6) << 4);
        }
        o.d = scale_at(w.d, (p * ns + s) * 32 + j) * (float)scale;  // d * sc
        o.m = scale_at(w.m, (p * ns + s) * 32 + j) * (float)mn;  // dmin * mn
        if (KIND == Q5_K) o.h = ((const u32*)w.qh)[bi];
    } else {  // Q6_K: d * sc for elements 0-15 (d) and 16-31 (m)
        const int s = b / 8, jj = b % 8;
        const float d = scale_at(w.d, (p * ns + s) * 32 + j);
        o.d = d * (float)((const signed char*)w.sc)[((p * ns + s) * 16 + 2 * jj) * 32 + j];
        o.m = d * (float)((const signed char*)w.sc)[((p * ns + s) * 16 + 2 * jj + 1) * 32 + j];
    }
}

template <int KIND> DEV float qel(const QB& o, u32 word, u32 hword, int e) {
    if (KIND == Q8_0 || KIND == Q8_0I) return (float)(signed char)(unsigned char)word * o.d;  // q * d
    const u32 lo = (word >> (4 * (e % 8))) & 15u;
    if (KIND == MXFP4) {  // d * kvalues_mxfp4[code] (code 8: +0)
        const int kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
        return o.d * (float)kv[lo];
    }
    if (KIND == Q4_0) return o.d * (float)((int)lo - 8);  // d * (q - 8)
    if (KIND == Q4_1) return (o.d * (float)lo) + o.m;  // (d * q) + m
    if (KIND == Q5_0) return o.d * (float)((int)(lo | (((o.h >> e) & 1u) << 4)) - 16);  // d * q
    if (KIND == Q5_1) return (o.d * (float)(lo | (((o.h >> e) & 1u) << 4))) + o.m;  // (d * q) + m
    if (KIND == Q4_K) return (o.d * (float)lo) - o.m;  // (dl * q) - ml
    if (KIND == Q5_K) return (o.d * (float)(lo | (((o.h >> e) & 1u) << 4))) - o.m;
    const u32 hi = (hword >> (2 * (e % 16))) & 3u;  // Q6_K
    return (e < 16 ? o.d : o.m) * (float)((int)(lo | (hi << 4)) - 32);
}

// The low-bits word (Q8_0: the byte) of element e of block b, row j of quantized panel p; Q6_K's
// high-bits word.
template <int KIND> DEV u32 qword(const W& w, i64 p, i64 j, int b, int e) {
    if (KIND == Q8_0) return ((const unsigned char*)w.qs)[(p * w.K + b * 32 + e) * 32 + j];
    if (KIND == Q8_0I)  // [p, b, 2g + h, j, i] = element 8g + 2i + h
        return ((const unsigned char*)w.qs)[(((p * (w.K / 32) + b) * 8 + 2 * (e / 8) + (e % 2)) * 32 + j) * 4 + (e % 8) / 2];
    return ((const u32*)w.qs)[((p * (w.K / 32) + b) * 4 + e / 8) * 32 + j];
}

template <int KIND> DEV u32 qhword(const W& w, i64 p, i64 j, int b, int e) {
    return KIND == Q6_K ? ((const u32*)w.qh)[((p * (w.K / 32) + b) * 2 + e / 16) * 32 + j] : 0u;
}

#define IS_QUANT(KIND) (KIND >= Q8_0)

template <int KIND> DEV float wat(const W& w, i64 n, int k) {
    const int K = w.K;
    if (KIND == F32P || KIND == F16P) {  // float panels (P, K, 64)
        i64 i = ((w.p0 + n / 64) * K + k) * 64 + n % 64;
        return KIND == F32P ? ((const float*)w.qs)[i] : f16_to_f32(((const u16*)w.qs)[i]);
    }
    if (KIND == F32R || KIND == F16R) {  // a (rows, K) table
        i64 i = n * K + k;
        return KIND == F32R ? ((const float*)w.qs)[i] : f16_to_f32(((const u16*)w.qs)[i]);
    }
    // quantized panels of 32 rows: row 32p + j, block b of 32 elements, element e of the block
    const i64 p = w.p0 + n / 32, j = n % 32;
    const int b = k / 32, e = k % 32;
    QB o;
    qblock<KIND>(w, p, j, b, o);
    return qel<KIND>(o, qword<KIND>(w, p, j, b, e), qhword<KIND>(w, p, j, b, e), e);
}

// v[0 .. 32) = W[n, 32 b .. 32 b + 32) of a quantized kind (block b), each word read once.
template <int KIND> DEV void wblock(const W& w, i64 n, int b, float* v) {
    const i64 p = w.p0 + n / 32, j = n % 32;
    QB o;
    qblock<KIND>(w, p, j, b, o);
    u32 words[4], hwords[2];
    UNROLL for (int i = 0; i < 4; i++) words[i] = KIND == Q8_0 ? 0u : qword<KIND>(w, p, j, b, 8 * i);
    UNROLL for (int i = 0; i < 2; i++) hwords[i] = qhword<KIND>(w, p, j, b, 16 * i);
    UNROLL for (int e = 0; e < 32; e++)
        v[e] = qel<KIND>(o, KIND == Q8_0 ? qword<KIND>(w, p, j, b, e) : words[e / 8], hwords[e / 16], e);
}

// ---------------------------------------------------------------------------------------------------
// The matrix product (cpu/matmul.py, cpu/tiles.py): out[t, c0 + n] = sum_k x[t, k] W[n, k] for outputs
// c0 <= c0 + n < n1, per output: s = c = 0; for each k-block [k0, k0 + 64): part = 0, then
// part = part + w * x for k in order; then the Kahan step of (part) into (s, c). Each k-block's part
// is a chain of its own, and only the Kahan steps must follow k-block order, so the product is tiled
// like any other: `gemm` (many rows) stages a 64 x 64 tile of x and of W (quantized blocks decoded by
// `wblock`, a thread per block of 32) per k-block in shared memory, and each thread runs the k-block's
// 64-long chains of its 4 x 4 (row, output) pairs and their Kahan steps; `gemv` (a few rows: decode,
// small batches) reads each weight once: a block owns `tn` outputs, its threads run all their (output,
// k-block) chains at once into shared memory, and then one thread per (row, output) takes the Kahan
// steps in order.
//
// Both can take, instead of x, RMSNorm's output (x[t, k] * inv[t]) * nw[k] computed as they load it
// (`norm`; rms_scale's operations), and end in an epilogue `epi`: 0 out = s; 1 out = s + bias[col]
// (add_bias's); 2 out = out + s (a residual add, add_rows's), where col = c0 + n.

DEV float rms_inv(const float* x, int n, float eps) {  // 1 / sqrt(mean(x^2) + eps), squares Kahan-summed in order
    float s = 0.0f, c = 0.0f;
    UNROLL16 for (int i = 0; i < n; i++) KAHAN(x[i] * x[i], s, c);
    return 1.0f / sqrtf(s / (float)n + eps);
}

DEV void epilogue(float s, float* out, i64 i, const float* bias, i64 col, int epi) {
    if (epi == 1) out[i] = s + bias[col];
    else if (epi == 2) out[i] = out[i] + s;
    else out[i] = s;
}

#define GT 64         // gemm's tile: rows, outputs, and k (one k-block)
#define GTHREADS 256  // gemm's threads: 16 x 16, each 4 rows x 4 outputs (rows ty + 16 i, outputs tx + 16 j)

template <int KIND> DEV void gemm(const float* x, int T, int K, const W& w, int c0, int n1, float* out, int ldo,
                                  const float* nw, const float* inv, int norm, const float* bias, int epi) {
    SHARED float xs[GT][GT + 1];  // xs[k][row]: padded so that a column's stores fall in different banks
    SHARED float ws[GT][GT + 1];  // ws[k][output]
    PER_THREAD(float, s, [16]);
    PER_THREAD(float, c, [16]);
    const i64 N = n1 - c0, nb = (i64)blockIdx.x * GT;
    const int tb = (int)blockIdx.y * GT;
    FOR_THREADS {
        UNROLL for (int i = 0; i < 16; i++) { MY(s)[i] = 0.0f; MY(c)[i] = 0.0f; }
    }
    SYNC;
    for (int k0 = 0; k0 < K; k0 += GT) {
        const int kn = K - k0 < GT ? K - k0 : GT;
        FOR_THREADS {
            for (int e = (int)threadIdx.x; e < GT * GT; e += GTHREADS) {
                int r = e / GT, k = e % GT;  // x along k (coalesced loads)
                float v = 0.0f;
                if (tb + r < T && k < kn) {
                    i64 t = tb + r;
                    v = x[t * K + k0 + k];
                    if (norm) v = (v * inv[t]) * nw[k0 + k];
                }
                xs[k][r] = v;
                if (!IS_QUANT(KIND)) {  // W along outputs (the panels' contiguous direction)
                    int n = e % GT;
                    k = e / GT;
                    ws[k][n] = nb + n < N && k < kn ? wat<KIND>(w, nb + n, k0 + k) : 0.0f;
                }
            }
            const int n = (int)threadIdx.x % GT, half = (int)threadIdx.x / GT;
            if (IS_QUANT(KIND) && half < 2) {  // a thread per (output, block of 32): each word read once
                float v[32];
                if (nb + n < N && 32 * half < kn) wblock<KIND>(w, nb + n, k0 / 32 + half, v);
                else UNROLL for (int e = 0; e < 32; e++) v[e] = 0.0f;
                UNROLL for (int e = 0; e < 32; e++) ws[32 * half + e][n] = v[e];
            }
        }
        SYNC;
        FOR_THREADS {
            const int ty = (int)threadIdx.x / 16, tx = (int)threadIdx.x % 16;
            float a[16];
            UNROLL for (int i = 0; i < 16; i++) a[i] = 0.0f;
            for (int k = 0; k < kn; k++) {
                float xv[4], wv[4];
                UNROLL for (int i = 0; i < 4; i++) { xv[i] = xs[k][ty + 16 * i]; wv[i] = ws[k][tx + 16 * i]; }
                UNROLL for (int i = 0; i < 4; i++)
                    UNROLL for (int j = 0; j < 4; j++) a[i * 4 + j] = a[i * 4 + j] + wv[j] * xv[i];
            }
            UNROLL for (int i = 0; i < 16; i++) KAHAN(a[i], MY(s)[i], MY(c)[i]);
        }
        SYNC;
    }
    FOR_THREADS {
        const int ty = (int)threadIdx.x / 16, tx = (int)threadIdx.x % 16;
        UNROLL for (int i = 0; i < 4; i++)
            UNROLL for (int j = 0; j < 4; j++) {
                i64 t = tb + ty + 16 * i, n = nb + tx + 16 * j;
                if (t < T && n < N) epilogue(MY(s)[i * 4 + j], out, t * ldo + c0 + n, bias, c0 + n, epi);
            }
    }
}

#define VROWS 8       // gemv's rows per block (grid y: groups of rows)
#define RCHUNK 256

// sinv[r] = rms_inv(row r of x) for the block's rows r < rows (at most VROWS; x (rows, K)): a thread per
// row runs its chain over a copy in shared memory that all the block's threads load, RCHUNK elements
// at a time (each step of the chain then waits on shared memory, not on a load from L2).
DEV void rms_inv_block(const float* x, int K, int rows, float eps, float* sinv) {
    SHARED float xs[VROWS][RCHUNK];
    PER_THREAD(float, s, [1]);
    PER_THREAD(float, c, [1]);
    FOR_THREADS {
        MY(s)[0] = 0.0f;
        MY(c)[0] = 0.0f;
    }
    SYNC;
    for (int k0 = 0; k0 < K; k0 += RCHUNK) {
        const int kn = K - k0 < RCHUNK ? K - k0 : RCHUNK;
        FOR_THREADS {
            for (int i = (int)threadIdx.x; i < rows * RCHUNK; i += (int)blockDim.x)
                if (i % RCHUNK < kn) xs[i / RCHUNK][i % RCHUNK] = x[(i64)(i / RCHUNK) * K + k0 + i % RCHUNK];
        }
        SYNC;
        FOR_THREADS {
            const int r = (int)threadIdx.x;
            if (r < rows) {
                float ss = MY(s)[0], cc = MY(c)[0];
                UNROLL16 for (int k = 0; k < kn; k++) KAHAN(xs[r][k] * xs[r][k], ss, cc);
                MY(s)[0] = ss;
                MY(c)[0] = cc;
            }
        }
        SYNC;
    }
    FOR_THREADS {
        if ((int)threadIdx.x < rows) sinv[threadIdx.x] = 1.0f / sqrtf(MY(s)[0] / (float)K + eps);  // rms_inv's
    }
    SYNC;
}

#define VPART 8192    // gemv's shared floats for the chains' sums: rows x k-blocks x tn (the host keeps to it)

template <int KIND> DEV void gemv(const float* x, int T, int K, const W& w, int c0, int n1, float* out, int ldo,
                                  const float* nw, int norm, float eps, const float* bias, int epi, int tn) {
    SHARED float part[VPART];  // part[(r * nkb + kb) * tn + n]
    SHARED float sinv[VROWS];
    const int nkb = (K + 63) / 64, tb = (int)blockIdx.y * VROWS;
    const int rows = T - tb < VROWS ? T - tb : VROWS;
    const i64 N = n1 - c0, nb = (i64)blockIdx.x * tn;
    if (norm) rms_inv_block(x + (i64)tb * K, K, rows, eps, sinv);
    FOR_THREADS {
        for (int i = (int)threadIdx.x; i < tn * nkb; i += (int)blockDim.x) {
            const int n = i % tn, kb = i / tn, k0 = kb * 64, k1 = k0 + 64 < K ? k0 + 64 : K;
            if (nb + n >= N) continue;
            float a[VROWS];  // unrolled over VROWS with the row test inside: registers, not local memory
            UNROLL for (int r = 0; r < VROWS; r++) a[r] = 0.0f;
            if (IS_QUANT(KIND)) {  // block by block of 32, each decoded at once (the chain runs on across them)
                for (int k = k0; k < k1; k += 32) {
                    float wv[32];
                    wblock<KIND>(w, nb + n, k / 32, wv);
                    UNROLL for (int e = 0; e < 32; e++) {
                        UNROLL for (int r = 0; r < VROWS; r++) {
                            if (r < rows) {
                                float v = x[(i64)(tb + r) * K + k + e];
                                if (norm) v = (v * sinv[r]) * nw[k + e];
                                a[r] = a[r] + wv[e] * v;
                            }
                        }
                    }
                }
            } else {
                for (int k = k0; k < k1; k++) {
                    const float wk = wat<KIND>(w, nb + n, k);
                    UNROLL for (int r = 0; r < VROWS; r++) {
                        if (r < rows) {
                            float v = x[(i64)(tb + r) * K + k];
                            if (norm) v = (v * sinv[r]) * nw[k];
                            a[r] = a[r] + wk * v;
                        }
                    }
                }
            }
            UNROLL for (int r = 0; r < VROWS; r++) if (r < rows) part[(r * nkb + kb) * tn + n] = a[r];
        }
    }
    SYNC;
    FOR_THREADS {
        for (int i = (int)threadIdx.x; i < tn * rows; i += (int)blockDim.x) {
            const int n = i % tn, r = i / tn;
            if (nb + n >= N) continue;
            float s = 0.0f, c = 0.0f;
            UNROLL16 for (int kb = 0; kb < nkb; kb++) KAHAN(part[(r * nkb + kb) * tn + n], s, c);
            epilogue(s, out, (i64)(tb + r) * ldo + c0 + nb + n, bias, c0 + nb + n, epi);
        }
    }
}

// x[t, i] = W[ids[t] - c0, i] for the rows ids[t] in [c0, n1) (an embedding; a thread per (t, i)).
template <int KIND> DEV void embed(const long long* ids, int T, int K, const W& w, int c0, int n1, float* x) {
    i64 j = GX, t = j / K;
    int i = (int)(j % K);
    if (t >= T || ids[t] < c0 || ids[t] >= n1) return;
    x[j] = wat<KIND>(w, ids[t] - c0, i);
}

#define STORAGE_KERNELS(NAME, KIND) \
BLOCK_KERNEL gemm_##NAME(const float* x, int T, int K, const void* qs, const void* d, const void* m, const void* sc, \
                         const void* qh, long long p0, int c0, int n1, float* out, int ldo, \
                         const float* nw, const float* inv, int norm, const float* bias, int epi) { \
    W w = {qs, d, m, sc, qh, K, p0}; \
    gemm<KIND>(x, T, K, w, c0, n1, out, ldo, nw, inv, norm, bias, epi); \
} \
BLOCK_KERNEL gemv_##NAME(const float* x, int T, int K, const void* qs, const void* d, const void* m, const void* sc, \
                         const void* qh, long long p0, int c0, int n1, float* out, int ldo, \
                         const float* nw, int norm, float eps, const float* bias, int epi, int tn) { \
    W w = {qs, d, m, sc, qh, K, p0}; \
    gemv<KIND>(x, T, K, w, c0, n1, out, ldo, nw, norm, eps, bias, epi, tn); \
} \
KERNEL embed_##NAME(const long long* ids, int T, int K, const void* qs, const void* d, const void* m, \
                    const void* sc, const void* qh, long long p0, int c0, int n1, float* x) { \
    W w = {qs, d, m, sc, qh, K, p0}; \
    embed<KIND>(ids, T, K, w, c0, n1, x); \
}

STORAGE_KERNELS(f32, F32P)
STORAGE_KERNELS(f16, F16P)
STORAGE_KERNELS(rows_f32, F32R)
STORAGE_KERNELS(rows_f16, F16R)
STORAGE_KERNELS(q8_0, Q8_0)
STORAGE_KERNELS(q4_0, Q4_0)
STORAGE_KERNELS(q4_1, Q4_1)
STORAGE_KERNELS(q5_0, Q5_0)
STORAGE_KERNELS(q5_1, Q5_1)
STORAGE_KERNELS(q4_k, Q4_K)
STORAGE_KERNELS(q5_k, Q5_K)
STORAGE_KERNELS(q6_k, Q6_K)
STORAGE_KERNELS(mxfp4, MXFP4)

KERNEL embed_q8_0i(const long long* ids, int T, int K, const void* qs, const void* d, const void* m,
                   const void* sc, const void* qh, long long p0, int c0, int n1, float* x) {
    W w = {qs, d, m, sc, qh, K, p0};
    embed<Q8_0I>(ids, T, K, w, c0, n1, x);
}

// ---------------------------------------------------------------------------------------------------
// The integer mode (dtype "int8"; cpu/actq.py, cpu/intdot.py). Activations are quantized per row in
// blocks of B = 32 (or 256 beside the K-quants) by `act_quant`: amax the largest |x| bit pattern; a NaN
// or infinity in the block: d = NaN, q = 0; amax < 2^-64: d = 0, q = 0; else d = amax / 127,
// id = 127 / amax, q = (x * id + 1.5 * 2^23) - 1.5 * 2^23 clamped to [-127, 127]. Stored as the CPU
// stores them: xq int8 in groups of 8 ordered (0, 2, 4, 6, 1, 3, 5, 7) (the weights' nibble order), xd
// float32 per block, xs int32 the sums of q per 16. With `norm` x is RMSNorm's input and the block
// quantizes its output (x * inv[t]) * nw[k] (rms_scale's operations), inv from rms_inv_rows.

KERNEL act_quant(const float* x, int T, int K, int B, const float* nw, const float* inv, int norm, void* xq,
                 float* xd, void* xs) {
    const i64 i = GX, nblk = K / B, t = i / nblk;
    if (t >= T) return;
    const int k0 = (int)(i % nblk) * B;
    const float* row = x + t * K;
    signed char* q = (signed char*)xq + t * K;
    u32 m = 0u;
    for (int k = k0; k < k0 + B; k++) {
        float v = norm ? (row[k] * inv[t]) * nw[k] : row[k];
        u32 a = as_u32(v) & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    const float amax = as_float(m);
    if (m >= 0x7F800000u || amax < as_float(0x1F800000u)) {  // 2^-64
        xd[i] = m >= 0x7F800000u ? as_float(0x7FC00000u) : 0.0f;
        for (int k = k0; k < k0 + B; k++) q[k] = 0;
    } else {
        xd[i] = amax / 127.0f;
        const float id = 127.0f / amax;
        for (int k = k0; k < k0 + B; k++) {
            float v = norm ? (row[k] * inv[t]) * nw[k] : row[k];
            float r = (v * id + 12582912.0f) - 12582912.0f;  // to nearest, ties to even
            r = r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r);
            const int e = k & 7;
            q[(k - e) + (e & 1) * 4 + (e >> 1)] = (signed char)(int)r;
        }
    }
    int* s = (int*)xs + t * (K / 16);
    for (int k = k0; k < k0 + B; k += 16) {
        int a = 0;
        for (int e = 0; e < 16; e++) a += q[k + e];
        s[k / 16] = a;
    }
}

// The integer products: per output and row, per block b of 32 (super-block of 256 for the K-quants)
// isum (exact integers: `dp4a`, 4 bytes of weights times 4 of activations, signed; every weight byte
// the kernels form is a signed value or an unsigned one <= 63) and
//   f = float(isum) * (dw * dx)                                  Q8_0, Q4_0, Q5_0, MXFP4 (offsets in isum)
//   f = float(isum) * (dw * dx) + float(bs) * (mw * dx)          Q4_1
//   f = float(isum) * (d * dx) - float(msum) * (dmin * dx)       Q4_K, Q5_K (Q6_K: without msum)
// each product rounded on its own, and the output the Kahan sum of the blocks' f in order (intdot.py).
// `imm`: a block owns tn outputs (8, 16 or 32 of one panel's rows, loads coalesced across them: the
// host narrows tn where N would give the GPU few blocks) and IROWS rows (grid y: groups of rows); per
// chunk of ICHUNK blocks its threads compute the f of every (output, block) for all its rows into
// shared memory, each weight block read once, then a thread per (row, output) takes the chunk's Kahan
// steps in order; an epilogue `epi` as the float products'.

#define IROWS 8
#define IOUT 32  // the largest tn
#define ICHUNK 32
#define ITHREADS 256  // IROWS x IOUT: the Kahan step's threads

#define IS_K(KIND) (KIND == Q4_K || KIND == Q5_K || KIND == Q6_K)

// 8 nibbles of a word (elements 8g .. 8g + 7 of a block) as two words of bytes: elements (0, 2, 4, 6)
// and (1, 3, 5, 7); with `hb` (bit e of it: element 8g + e) a 5th bit at bit 4 of each byte.
DEV u32 lo4(u32 w) { return w & 0x0F0F0F0Fu; }
DEV u32 hi4(u32 w) { return (w >> 4) & 0x0F0F0F0Fu; }
DEV u32 bit5(u32 hb, int odd) {
    u32 o = 0u;
    for (int i = 0; i < 4; i++) o |= ((hb >> (2 * i + odd)) & 1u) << (8 * i + 4);
    return o;
}
// Q6_K's high 2 bits (bits 2e, 2e + 1 of h for element e of a group of 8) at bits 4, 5 of each byte
DEV u32 bits6(u32 h, int odd) {
    u32 o = 0u;
    for (int i = 0; i < 4; i++) o |= ((h >> (4 * i + 2 * odd)) & 3u) << (8 * i + 4);
    return o;
}
// MXFP4 codes (one per byte) -> their signed kvalues' bytes (0, 1, 2, 3, 4, 6, 8, 12, then negated):
// the magnitude m + (m > 4 ? m - 4 : 0) + (m == 7 ? 2 : 0) of m = code & 7, negative where bit 3 is set
DEV u32 mxbytes(u32 w) {
    u32 o = 0u;
    for (int i = 0; i < 4; i++) {
        const int c = (int)((w >> (8 * i)) & 15u), m = c & 7;
        const int mag = m + (m > 4 ? m - 4 : 0) + (m == 7 ? 2 : 0);
        o |= ((u32)(c & 8 ? -mag : mag) & 0xFFu) << (8 * i);
    }
    return o;
}

// The f of block (super-block) u, row j of panel p, for rows tb .. tb + rows: f[r].
template <int KIND> DEV void iunit(const W& w, i64 p, i64 j, int u, const int* xq, const float* xd, const int* xs,
                                   int tb, int rows, float* f) {
    const int K = w.K, nb = K / 32, kw = K / 4, k16 = K / 16;
    if (!IS_K(KIND)) {
        const i64 bi = (p * nb + u) * 32 + j;
        u32 a[4], b[4];  // the block's weight bytes: elements 8g + (0, 2, 4, 6), 8g + (1, 3, 5, 7)
        float dw, mw = 0.0f;
        if (KIND == MXFP4) {
            u32 e = ((const unsigned char*)w.d)[bi];
            dw = as_float(e < 2u ? 0x00200000u << e : (e - 1u) << 23);
        } else {
            dw = scale_at(w.d, bi);
        }
        if (KIND == Q4_1) mw = scale_at(w.m, bi);
        const u32 hb = KIND == Q5_0 ? ((const u32*)w.qh)[bi] : 0u;
        for (int g = 0; g < 4; g++) {
            if (KIND == Q8_0) {  // (P, nb, 8, 32, 4) int8: words [p, u, 2g + h, j]
                a[g] = ((const u32*)w.qs)[((p * nb + u) * 8 + 2 * g) * 32 + j];
                b[g] = ((const u32*)w.qs)[((p * nb + u) * 8 + 2 * g + 1) * 32 + j];
            } else {
                const u32 wd = ((const u32*)w.qs)[((p * nb + u) * 4 + g) * 32 + j];
                a[g] = lo4(wd);
                b[g] = hi4(wd);
                if (KIND == Q5_0) {
                    a[g] |= bit5(hb >> (8 * g), 0);
                    b[g] |= bit5(hb >> (8 * g), 1);
                }
                if (KIND == MXFP4) {
                    a[g] = mxbytes(a[g]);
                    b[g] = mxbytes(b[g]);
                }
            }
        }
        const int off = KIND == Q4_0 ? 8 : (KIND == Q5_0 ? 16 : 0);
        UNROLL for (int r = 0; r < IROWS; r++) {
            if (r < rows) {
                const i64 t = tb + r;
                const int* q = xq + t * kw + 8 * u;
                int s = 0;
                UNROLL for (int g = 0; g < 4; g++) s = dp4a((int)b[g], q[2 * g + 1], dp4a((int)a[g], q[2 * g], s));
                const int bs = xs[t * k16 + 2 * u] + xs[t * k16 + 2 * u + 1];
                s -= off * bs;
                const float dx = xd[t * nb + u];
                float v = (float)s * (dw * dx);
                if (KIND == Q4_1) v = v + (float)bs * (mw * dx);
                f[r] = v;
            }
        }
        return;
    }
    const int ns = K / 256;
    int is[IROWS], ms[IROWS];
    UNROLL for (int r = 0; r < IROWS; r++) { is[r] = 0; ms[r] = 0; }
    for (int jj = 0; jj < 8; jj++) {
        const int b = u * 8 + jj;
        const i64 bi = (p * nb + b) * 32 + j;
        u32 wa[4], wb[4];
        for (int g = 0; g < 4; g++) {
            const u32 wd = ((const u32*)w.qs)[((p * nb + b) * 4 + g) * 32 + j];
            wa[g] = lo4(wd);
            wb[g] = hi4(wd);
        }
        if (KIND == Q6_K) {
            for (int hh = 0; hh < 2; hh++) {
                const int sg = ((const signed char*)w.sc)[((p * ns + u) * 16 + 2 * jj + hh) * 32 + j];
                const u32 hw = ((const u32*)w.qh)[((p * nb + b) * 2 + hh) * 32 + j];
                u32 a2[2], b2[2];
                for (int gg = 0; gg < 2; gg++) {
                    const u32 h = (hw >> (16 * gg)) & 0xFFFFu;
                    a2[gg] = wa[2 * hh + gg] | bits6(h, 0);
                    b2[gg] = wb[2 * hh + gg] | bits6(h, 1);
                }
                UNROLL for (int r = 0; r < IROWS; r++) {
                    if (r < rows) {
                        const i64 t = tb + r;
                        const int* q = xq + t * kw + 8 * b + 4 * hh;
                        int s = 0;
                        UNROLL for (int gg = 0; gg < 2; gg++)
                            s = dp4a((int)b2[gg], q[2 * gg + 1], dp4a((int)a2[gg], q[2 * gg], s));
                        is[r] += sg * (s - 32 * xs[t * k16 + 2 * b + hh]);
                    }
                }
            }
        } else {
            const unsigned char* sc = (const unsigned char*)w.sc + (p * ns + u) * 12 * 32 + j;
            int scale, mn;  // ggml's get_scale_min_k4
            if (jj < 4) {
                scale = sc[jj * 32] & 63;
                mn = sc[(jj + 4) * 32] & 63;
            } else {
                scale = (sc[(jj + 4) * 32] & 15) | ((sc[(jj - 4) * 32] >> 6) << 4);
                mn = (sc[(jj + 4) * 32] >> 4) | ((sc[jj * 32] >> 6) << 4);
            }
            if (KIND == Q5_K) {
                const u32 hb = ((const u32*)w.qh)[bi];
                for (int g = 0; g < 4; g++) {
                    wa[g] |= bit5(hb >> (8 * g), 0);
                    wb[g] |= bit5(hb >> (8 * g), 1);
                }
            }
            UNROLL for (int r = 0; r < IROWS; r++) {
                if (r < rows) {
                    const i64 t = tb + r;
                    const int* q = xq + t * kw + 8 * b;
                    int s = 0;
                    UNROLL for (int g = 0; g < 4; g++) s = dp4a((int)wb[g], q[2 * g + 1], dp4a((int)wa[g], q[2 * g], s));
                    is[r] += scale * s;
                    ms[r] += mn * (xs[t * k16 + 2 * b] + xs[t * k16 + 2 * b + 1]);
                }
            }
        }
    }
    const float dw = scale_at(w.d, (p * ns + u) * 32 + j);
    const float mw = KIND == Q6_K ? 0.0f : scale_at(w.m, (p * ns + u) * 32 + j);
    UNROLL for (int r = 0; r < IROWS; r++) {
        if (r < rows) {
            const float dx = xd[(i64)(tb + r) * ns + u];
            float v = (float)is[r] * (dw * dx);
            if (KIND != Q6_K) v = v - (float)ms[r] * (mw * dx);
            f[r] = v;
        }
    }
}

template <int KIND> DEV void imm(const int* xq, const float* xd, const int* xs, int T, const W& w, int c0, int n1,
                                 float* out, int ldo, const float* bias, int epi, int tn) {
    SHARED float part[IROWS * ICHUNK * IOUT];  // part[(r * ICHUNK + u) * IOUT + n], n < tn
    PER_THREAD(float, ks, [2]);  // the Kahan pair of this thread's (row, output)
    const int nu = w.K / (IS_K(KIND) ? 256 : 32), tb = (int)blockIdx.y * IROWS;
    const int rows = T - tb < IROWS ? T - tb : IROWS;
    const i64 N = n1 - c0, nb = (i64)blockIdx.x * tn;
    FOR_THREADS {
        MY(ks)[0] = 0.0f;
        MY(ks)[1] = 0.0f;
    }
    SYNC;
    for (int u0 = 0; u0 < nu; u0 += ICHUNK) {
        const int un = nu - u0 < ICHUNK ? nu - u0 : ICHUNK;
        FOR_THREADS {
            for (int i = (int)threadIdx.x; i < tn * un; i += (int)blockDim.x) {
                const int n = i % tn, u = i / tn;
                if (nb + n >= N) continue;
                float f[IROWS];
                iunit<KIND>(w, w.p0 + (nb + n) / 32, (nb + n) % 32, u0 + u, xq, xd, xs, tb, rows, f);
                UNROLL for (int r = 0; r < IROWS; r++) if (r < rows) part[(r * ICHUNK + u) * IOUT + n] = f[r];
            }
        }
        SYNC;
        FOR_THREADS {
            const int n = (int)threadIdx.x % tn, r = (int)threadIdx.x / tn;
            if (r < rows && nb + n < N)
                for (int u = 0; u < un; u++) KAHAN(part[(r * ICHUNK + u) * IOUT + n], MY(ks)[0], MY(ks)[1]);
        }
        SYNC;
    }
    FOR_THREADS {
        const int n = (int)threadIdx.x % tn, r = (int)threadIdx.x / tn;
        if (r < rows && nb + n < N) epilogue(MY(ks)[0], out, (i64)(tb + r) * ldo + c0 + nb + n, bias, c0 + nb + n, epi);
    }
}

#define INT_KERNELS(NAME, KIND) \
BLOCK_KERNEL imm_##NAME(const void* xq, const float* xd, const void* xs, int T, int K, const void* qs, const void* d, \
                        const void* m, const void* sc, const void* qh, long long p0, int c0, int n1, \
                        float* out, int ldo, const float* bias, int epi, int tn) { \
    W w = {qs, d, m, sc, qh, K, p0}; \
    imm<KIND>((const int*)xq, xd, (const int*)xs, T, w, c0, n1, out, ldo, bias, epi, tn); \
}

INT_KERNELS(q8_0, Q8_0)
INT_KERNELS(q4_0, Q4_0)
INT_KERNELS(q4_1, Q4_1)
INT_KERNELS(q5_0, Q5_0)
INT_KERNELS(q4_k, Q4_K)
INT_KERNELS(q5_k, Q5_K)
INT_KERNELS(q6_k, Q6_K)
INT_KERNELS(mxfp4, MXFP4)

// ---------------------------------------------------------------------------------------------------
// RMSNorm (cpu/ops.py): out = (x * (1 / sqrt(mean(x^2) + eps))) * w, the sum of squares a Kahan sum
// in index order: rms_inv_rows a block per VROWS rows, a thread per row running the chain over the
// rows staged in shared memory (rms_inv_block); rms_scale a thread per element; out may be x.

BLOCK_KERNEL rms_inv_rows(const float* x, int T, int D, float eps, float* inv) {
    SHARED float sinv[VROWS];
    const int tb = (int)blockIdx.x * VROWS, rows = T - tb < VROWS ? T - tb : VROWS;
    rms_inv_block(x + (i64)tb * D, D, rows, eps, sinv);
    FOR_THREADS {
        if ((int)threadIdx.x < rows) inv[tb + (int)threadIdx.x] = sinv[threadIdx.x];
    }
    SYNC;
}

KERNEL rms_scale(const float* x, int T, int D, const float* inv, const float* w, float* out) {
    i64 i = (i64)GX;
    if (i < (i64)T * D) out[i] = (x[i] * inv[i / D]) * w[i % D];
}

// x += RMSNorm(y): rms_scale into y, then add_rows, as one step (a post-norm before the residual add).
KERNEL rms_scale_add(float* x, const float* y, int T, int D, const float* inv, const float* w) {
    i64 i = (i64)GX;
    if (i < (i64)T * D) x[i] = x[i] + ((y[i] * inv[i / D]) * w[i % D]);
}

// ---------------------------------------------------------------------------------------------------
// Element-wise steps.

KERNEL add_rows(float* x, const float* y, long long n) {  // x += y (a residual add)
    i64 i = (i64)GX;
    if (i < n) x[i] = x[i] + y[i];
}

KERNEL add_bias(float* x, const float* b, int T, int D) {  // x[t] += b
    i64 i = (i64)GX;
    if (i < (i64)T * D) x[i] = x[i] + b[i % D];
}

KERNEL scale_rows(float* x, float s, long long n) {  // x *= s (the embedding scale)
    i64 i = (i64)GX;
    if (i < n) x[i] = x[i] * s;
}

KERNEL softcap(float* x, long long n, float cap) {  // x = cap * tanh(x / cap), as three float32 steps
    i64 i = (i64)GX;
    if (i < n) x[i] = tanh32(x[i] / cap) * cap;
}

// act[t, i] = f(gate) * up, gu[t] = [gate | up]: SiLU g / (1 + e**-g), or GELU-tanh
// 0.5 g (1 + tanh(b (g + k g^3))) with PyTorch's float32 constants (cpu/ops.py).
KERNEL glu(const float* gu, int T, int F, int kind, float b, float kk, float* act) {
    i64 i = (i64)GX;
    if (i >= (i64)T * F) return;
    i64 t = i / F, n = i % F;
    float g = gu[t * 2 * F + n], u = gu[t * 2 * F + F + n], f;
    if (kind == 0) f = g / (1.0f + exp32(-0.0f - g));
    else f = (0.5f * g) * (1.0f + tanh32(b * (g + kk * ((g * g) * g))));
    act[i] = f * u;
}

// ---------------------------------------------------------------------------------------------------
// RoPE with the cache write (cpu/ops.py rope_store): per row t and head, QK-norm where given, rotate
// pairs (i, i + hd/2), q to q_out, k and v into this layer's cache (fp16 bits when `half`).
// Key cache (slots, kv_heads, tiles, hd, 64), values (slots, cap, kv_dim). A thread per (row, head).

KERNEL rope_store(float* qkv, int T, int q_dim, int kv_dim, int hd, const float* cos_t, const float* sin_t,
                  const long long* pos, const long long* slot, void* kc, void* vc, int half, int tiles, int cap,
                  float* q_out, const float* qn, int has_qn, const float* kn, int has_kn, float eps) {
    int n_q = q_dim / hd, n_kv = kv_dim / hd;
    i64 j = GX, t = j / (n_q + n_kv);
    int h = (int)(j % (n_q + n_kv));
    if (t >= T) return;
    int n_qkv = q_dim + 2 * kv_dim, hh = hd / 2;
    float* row = qkv + (i64)t * n_qkv + (i64)h * hd;
    const float* nw = h < n_q ? qn : kn;
    if (h < n_q ? has_qn : has_kn) {
        float inv = rms_inv(row, hd, eps);
        for (int d = 0; d < hd; d++) row[d] = (row[d] * inv) * nw[d];
    }
    i64 p = pos[t], s = slot[t];
    for (int i = 0; i < hh; i++) {
        float x0 = row[i], x1 = row[i + hh];
        float cs = cos_t[p * hh + i], sn = sin_t[p * hh + i];
        float r0 = x0 * cs - x1 * sn;
        float r1 = x1 * cs + x0 * sn;
        if (h < n_q) {
            q_out[(i64)t * q_dim + (i64)h * hd + i] = r0;
            q_out[(i64)t * q_dim + (i64)h * hd + i + hh] = r1;
        } else {
            i64 g = h - n_q;
            i64 k0 = (((s * n_kv + g) * tiles + p / 64) * hd + i) * 64 + p % 64;
            i64 k1 = k0 + (i64)hh * 64;
            if (half) { ((u16*)kc)[k0] = f32_to_f16(r0); ((u16*)kc)[k1] = f32_to_f16(r1); }
            else { ((float*)kc)[k0] = r0; ((float*)kc)[k1] = r1; }
        }
    }
    if (h >= n_q) {  // this kv head's values
        i64 g = h - n_q;
        for (int d = 0; d < hd; d++) {
            float v = qkv[(i64)t * n_qkv + q_dim + kv_dim + g * hd + d];
            i64 vi = (s * cap + p) * kv_dim + g * hd + d;
            if (half) ((u16*)vc)[vi] = f32_to_f16(v);
            else ((float*)vc)[vi] = v;
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Attention (cpu/ops.py _attend): row t, head h attends to positions lo..pos[t] of sequence slot[t]
// (lo = 0, or with window > 0 the first of the last `window`).

DEV float cache_at(const void* a, i64 i, int half) {
    return half ? f16_to_f32(((const u16*)a)[i]) : ((const float*)a)[i];
}

DEV int first_pos(i64 n, int window) { return window > 0 && n - window > 0 ? (int)(n - window) : 0; }

#define AMAX_HD 256        // the largest head_dim `attend` takes (the backend refuses larger)
#define AMAX_THREADS 1024
#define ACHUNK 512         // positions whose exponentials a block holds at once

// q.k for position p: (Kahan over d in order of q[d] k[p, d]) * scale.
DEV float score(const float* sq, const void* kc, i64 kbase, i64 p, int hd, int half, float scale) {
    const i64 kb = kbase + (p / 64) * hd * 64 + p % 64;
    float s = 0.0f, c = 0.0f;
    UNROLL16 for (int d = 0; d < hd; d++) KAHAN(sq[d] * cache_at(kc, kb + (i64)d * 64, half), s, c);
    return s * scale;
}

// Row t = blockIdx.x / H, head h = blockIdx.x % H, one thread block (more threads than head_dim):
// m = the largest score (a float64 holding a float32, -inf if none is greater: the order of the
// comparisons does not matter, only a zero's sign could differ and exp(s - m) does not see it), the
// scores spread over the threads; then, ACHUNK positions at a time, e_p = exp32(score_p - m) with the
// difference taken in float64 (each score computed again, the same operations) into shared memory, and
// thread d < head_dim continues the Kahan sum over positions in order of e_p v[p, d], thread head_dim
// the denominator's, the Kahan sum of the e_p in order; out = sum / den. Nothing per position is kept
// beyond a chunk, so a block's memory does not grow with the context.
BLOCK_KERNEL attend(const float* q, int T, int H, int n_kv, int hd, const void* kc, const void* vc, int half,
                    int tiles, int cap, const long long* pos, const long long* slot, float scale, int window,
                    float* out) {
    SHARED float sq[AMAX_HD];
    SHARED float se[ACHUNK];
    SHARED float num[AMAX_HD + 1];  // the sums, and the denominator at [hd]
    SHARED double red[AMAX_THREADS];
    SHARED double smax;
    PER_THREAD(float, acc, [2]);  // this thread's (s, c)
    const i64 th = blockIdx.x, t = th / H, h = th % H, n = pos[t] + 1, g = h / (H / n_kv);
    const i64 lo = first_pos(n, window), kv_dim = (i64)n_kv * hd;
    const i64 kbase = (slot[t] * n_kv + g) * tiles * hd * 64, vbase = slot[t] * cap * kv_dim + g * hd;
    FOR_THREADS {
        for (int d = (int)threadIdx.x; d < hd; d += (int)blockDim.x) sq[d] = q[(t * H + h) * hd + d];
    }
    SYNC;
    FOR_THREADS {
        double mx = -as_double(0x7FF0000000000000LL);  // -inf
        for (i64 p = lo + threadIdx.x; p < n; p += blockDim.x) {
            const double e = (double)score(sq, kc, kbase, p, hd, half, scale);
            if (e > mx) mx = e;
        }
        red[threadIdx.x] = mx;
        MY(acc)[0] = 0.0f;
        MY(acc)[1] = 0.0f;
    }
    SYNC;
    FOR_THREADS {
        if (threadIdx.x == 0) {
            double mx = red[0];
            for (unsigned i = 1; i < blockDim.x; i++) if (red[i] > mx) mx = red[i];
            smax = mx;
        }
    }
    SYNC;
    for (i64 p0 = lo; p0 < n; p0 += ACHUNK) {
        const int pn = n - p0 < ACHUNK ? (int)(n - p0) : ACHUNK;
        FOR_THREADS {
            for (int i = (int)threadIdx.x; i < pn; i += (int)blockDim.x)
                se[i] = (float)exp64((double)score(sq, kc, kbase, p0 + i, hd, half, scale) - smax);
        }
        SYNC;
        FOR_THREADS {
            const int d = (int)threadIdx.x;
            float s = MY(acc)[0], c = MY(acc)[1];
            if (d < hd) {
                UNROLL16 for (int i = 0; i < pn; i++) KAHAN(se[i] * cache_at(vc, vbase + (p0 + i) * kv_dim + d, half), s, c);
            } else if (d == hd) {
                UNROLL16 for (int i = 0; i < pn; i++) KAHAN(se[i], s, c);
            }
            MY(acc)[0] = s;
            MY(acc)[1] = c;
        }
        SYNC;
    }
    FOR_THREADS {
        if ((int)threadIdx.x <= hd) num[threadIdx.x] = MY(acc)[0];
    }
    SYNC;
    FOR_THREADS {
        for (int d = (int)threadIdx.x; d < hd; d += (int)blockDim.x) out[(t * H + h) * hd + d] = num[d] / num[hd];
    }
}

// out[r] = x[rows[r]] (the rows whose logits are wanted; a copy).
KERNEL gather_rows(const float* x, int D, const long long* rows, int R, float* out) {
    i64 i = (i64)GX;
    if (i < (i64)R * D) out[i] = x[rows[i / D] * D + i % D];
}
