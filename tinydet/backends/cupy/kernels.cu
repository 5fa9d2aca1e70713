// The GPU backend's kernels: every output computed by the operations of the CPU backend in the same
// order (tinydet/backends/cpu, docs in each function), each chain of them in one thread (a matrix
// product's k-blocks may be separate chains, see matmul_part), so that each result has the CPU's
// bits. Built by NVRTC with --fmad=false (a*b + c stays a rounded multiply and a rounded add; NVRTC's
// default fuses them), --prec-div=true, --prec-sqrt=true, --ftz=false; no fast-math intrinsics, and
// exp/tanh are tinydet's own (CUDA's expf uses ex2.approx). No shared memory, no warp shuffles: a
// thread reads what it needs from global memory, so the same source also builds with a host C++
// compiler into a serial emulator (device.HostDevice) that the tests run on a machine without a GPU.
// tests/test_cuda.py lints the PTX: no fma, no .approx, no .ftz, every float add/sub/mul/div `.rn`.

#ifdef __CUDACC__
#define KERNEL extern "C" __global__ void
#define DEV static __device__ __forceinline__
typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
DEV float as_float(u32 u) { return __uint_as_float(u); }
DEV u32 as_u32(float f) { return __float_as_uint(f); }
DEV double as_double(i64 u) { return __longlong_as_double(u); }
#else
#include <math.h>
#include <string.h>
#define KERNEL extern "C" void
#define DEV static inline
typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
struct dim3 { unsigned x, y, z; };
static dim3 blockIdx, threadIdx, blockDim, gridDim;  // set by the emulator's launch loops
DEV float as_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
DEV u32 as_u32(float f) { u32 u; memcpy(&u, &f, 4); return u; }
DEV double as_double(i64 u) { double f; memcpy(&f, &u, 8); return f; }
#endif

// Thread indices (grids are one-dimensional but for the matrix product's rows, so that no count
// meets the 65535 limit of grid y).
#define GX ((i64)blockIdx.x * blockDim.x + threadIdx.x)
#define GY ((i64)blockIdx.y * blockDim.y + threadIdx.y)

// ---------------------------------------------------------------------------------------------------
// fp16 bits and the compensated-sum step (cpu/simd.py).

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

// y = part - c; z = s + y; c = (z - s) - y; s = z
#define KAHAN(part, s, c) do { float y_ = (part) - (c); float z_ = (s) + y_; (c) = (z_ - (s)) - y_; (s) = z_; } while (0)

// ---------------------------------------------------------------------------------------------------
// exp and tanh (cpu/vmath.py: mathfn's float64 operations, inputs clamped to [-708, 709]).

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
// Weights: element (n, k) of a matrix in one of the CPU backend's storages (cpu/layout.py), exactly
// as cpu/qblocks.py computes it. `n` counts from the first output of the panels at p0; scale arrays
// (d, m) are fp16 bits, or float32 where bit 0 (d) / bit 1 (m) of `flags` says so (MXFP4's d: E8M0 bytes).

struct W { const void *qs, *d, *m, *sc, *qh; int K, flags; i64 p0; };

DEV float scale_at(const void* a, i64 i, int is_f32) {
    return is_f32 ? ((const float*)a)[i] : f16_to_f32(((const u16*)a)[i]);
}

enum { F32P, F16P, F32R, F16R, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K, MXFP4 };

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
    const int b = k / 32, e = k % 32, nb = K / 32, ns = K / 256;
    const int d32 = w.flags & 1, m32 = (w.flags >> 1) & 1;
    if (KIND == Q8_0) {
        float q = (float)((const signed char*)w.qs)[(p * K + k) * 32 + j];
        return q * scale_at(w.d, (p * nb + b) * 32 + j, d32);  // q * d
    }
    u32 lo = (((const u32*)w.qs)[((p * nb + b) * 4 + e / 8) * 32 + j] >> (4 * (e % 8))) & 15u;
    if (KIND == MXFP4) {  // d * q: d = 2^(e - 128) from the E8M0 byte's bits (ggml's E8M0_TO_FP32_HALF),
        // q = kvalues_mxfp4[code] (code 8: +0)
        const int kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
        u32 e = ((const unsigned char*)w.d)[(p * nb + b) * 32 + j];
        float d = as_float(e < 2u ? 0x00200000u << e : (e - 1u) << 23);
        return d * (float)kv[lo];
    }
    if (KIND == Q4_0 || KIND == Q4_1 || KIND == Q5_0) {
        float d = scale_at(w.d, (p * nb + b) * 32 + j, d32);
        if (KIND == Q4_0) return d * (float)((int)lo - 8);  // d * (q - 8)
        if (KIND == Q4_1) return (d * (float)lo) + scale_at(w.m, (p * nb + b) * 32 + j, m32);  // (d * q) + m
        u32 hi = (((const u32*)w.qh)[(p * nb + b) * 32 + j] >> e) & 1u;
        return d * (float)((int)(lo | (hi << 4)) - 16);  // d * q
    }
    const int s = b / 8, jj = b % 8;
    if (KIND == Q4_K || KIND == Q5_K) {
        const unsigned char* sc = (const unsigned char*)w.sc + (p * ns + s) * 12 * 32 + j;
        u32 scale, mn;  // ggml's get_scale_min_k4
        if (jj < 4) {
            scale = sc[jj * 32] & 63u;
            mn = sc[(jj + 4) * 32] & 63u;
        } else {
            scale = (sc[(jj + 4) * 32] & 15u) | ((sc[(jj - 4) * 32] >> 6) << 4);
            mn = (sc[(jj + 4) * 32] >> 4) | ((sc[jj * 32] >> 6) << 4);
        }
        u32 q = lo;
        if (KIND == Q5_K) q |= ((((const u32*)w.qh)[(p * nb + b) * 32 + j] >> e) & 1u) << 4;
        float dl = scale_at(w.d, (p * ns + s) * 32 + j, d32) * (float)scale;  // d * sc
        float ml = scale_at(w.m, (p * ns + s) * 32 + j, m32) * (float)mn;  // dmin * mn
        return (dl * (float)q) - ml;
    }
    // Q6_K
    u32 hi = (((const u32*)w.qh)[((p * nb + b) * 2 + e / 16) * 32 + j] >> (2 * (e % 16))) & 3u;
    float sc = (float)((const signed char*)w.sc)[((p * ns + s) * 16 + 2 * jj + e / 16) * 32 + j];
    float dl = scale_at(w.d, (p * ns + s) * 32 + j, d32) * sc;  // d * sc
    return dl * (float)((int)(lo | (hi << 4)) - 32);
}

// ---------------------------------------------------------------------------------------------------
// The matrix product (cpu/matmul.py, cpu/tiles.py): out[t, c0 + n] = sum_k x[t, k] W[n, k] for outputs
// c0 <= c0 + n < n1, per output: s = c = 0; for each k-block [k0, k0 + 64): part = 0, then
// part = part + w * x for k in order; then the Kahan step of (part) into (s, c). Two ways to the same
// operations: `matmul` gives a thread one output for MM_ROWS rows (grid y: groups of rows), loading
// each weight once for them, and runs the whole chain; or, where the host has room for the partials
// (decode, small batches: too few outputs to fill the GPU, and each thread's chain as long as K),
// `matmul_part` gives a thread one k-block of one output for MM_ROWS rows and stores its part sums,
// part[(t * nkb + kb) * N + n], and `mm_sum` then takes each output's Kahan steps over them in order.

#define MM_ROWS 4

// a[r] = part, the plain float32 sum of W[n, k] x[t0 + r, k] over k in [k0, k1) in k order, for the
// MM_ROWS rows from t0 (rows past T repeat the last, never stored): one k-block of both ways.
template <int KIND> DEV void block_sums(const float* x, int T, int K, const W& w, i64 n, int t0, int k0, int k1,
                                        float* a) {
    for (int r = 0; r < MM_ROWS; r++) a[r] = 0.0f;
    for (int k = k0; k < k1; k++) {
        float wk = wat<KIND>(w, n, k);
        for (int r = 0; r < MM_ROWS; r++) {
            int t = t0 + r < T ? t0 + r : T - 1;
            a[r] = a[r] + wk * x[(i64)t * K + k];
        }
    }
}

template <int KIND> DEV void matmul(const float* x, int T, int K, const W& w, int c0, int n1, float* out, int ldo) {
    i64 n = (i64)GX;
    int t0 = (int)GY * MM_ROWS;
    if (c0 + n >= n1 || t0 >= T) return;
    float s[MM_ROWS], c[MM_ROWS], a[MM_ROWS];
    for (int r = 0; r < MM_ROWS; r++) { s[r] = 0.0f; c[r] = 0.0f; }
    for (int k0 = 0; k0 < K; k0 += 64) {
        block_sums<KIND>(x, T, K, w, n, t0, k0, k0 + 64 < K ? k0 + 64 : K, a);
        for (int r = 0; r < MM_ROWS; r++) KAHAN(a[r], s[r], c[r]);
    }
    for (int r = 0; r < MM_ROWS && t0 + r < T; r++) out[(i64)(t0 + r) * ldo + c0 + n] = s[r];
}

template <int KIND> DEV void matmul_part(const float* x, int T, int K, const W& w, int c0, int n1, float* part) {
    i64 N = n1 - c0, n = (i64)GX % N, kb = (i64)GX / N;
    int t0 = (int)GY * MM_ROWS, nkb = (K + 63) / 64;
    if (kb >= nkb || t0 >= T) return;
    int k0 = (int)kb * 64;
    float a[MM_ROWS];
    block_sums<KIND>(x, T, K, w, n, t0, k0, k0 + 64 < K ? k0 + 64 : K, a);
    for (int r = 0; r < MM_ROWS && t0 + r < T; r++) part[((i64)(t0 + r) * nkb + kb) * N + n] = a[r];
}

// out[t, c0 + n] = the Kahan steps of part[t, 0 .. nkb, n] in order (matmul_part's sums). A thread per (t, n).
KERNEL mm_sum(const float* part, int T, int nkb, int c0, int n1, float* out, int ldo) {
    i64 N = n1 - c0, t = (i64)GX / N, n = (i64)GX % N;
    if (t >= T) return;
    float s = 0.0f, c = 0.0f;
    for (int kb = 0; kb < nkb; kb++) KAHAN(part[(t * nkb + kb) * N + n], s, c);
    out[t * ldo + c0 + n] = s;
}

// x[t, i] = W[ids[t] - c0, i] for the rows ids[t] in [c0, n1) (an embedding; a thread per (t, i)).
template <int KIND> DEV void embed(const long long* ids, int T, int K, const W& w, int c0, int n1, float* x) {
    i64 j = GX, t = j / K;
    int i = (int)(j % K);
    if (t >= T || ids[t] < c0 || ids[t] >= n1) return;
    x[j] = wat<KIND>(w, ids[t] - c0, i);
}

#define STORAGE_KERNELS(NAME, KIND) \
KERNEL mm_##NAME(const float* x, int T, int K, const void* qs, const void* d, const void* m, const void* sc, \
                 const void* qh, int flags, long long p0, int c0, int n1, float* out, int ldo) { \
    W w = {qs, d, m, sc, qh, K, flags, p0}; \
    matmul<KIND>(x, T, K, w, c0, n1, out, ldo); \
} \
KERNEL mm_part_##NAME(const float* x, int T, int K, const void* qs, const void* d, const void* m, const void* sc, \
                      const void* qh, int flags, long long p0, int c0, int n1, float* part) { \
    W w = {qs, d, m, sc, qh, K, flags, p0}; \
    matmul_part<KIND>(x, T, K, w, c0, n1, part); \
} \
KERNEL embed_##NAME(const long long* ids, int T, int K, const void* qs, const void* d, const void* m, \
                    const void* sc, const void* qh, int flags, long long p0, int c0, int n1, float* x) { \
    W w = {qs, d, m, sc, qh, K, flags, p0}; \
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
STORAGE_KERNELS(q4_k, Q4_K)
STORAGE_KERNELS(q5_k, Q5_K)
STORAGE_KERNELS(q6_k, Q6_K)
STORAGE_KERNELS(mxfp4, MXFP4)

// ---------------------------------------------------------------------------------------------------
// RMSNorm (cpu/ops.py): out = (x * (1 / sqrt(mean(x^2) + eps))) * w, the sum of squares a Kahan sum
// in index order: rms_inv_rows a thread per row (the chain), rms_scale a thread per element; out may be x.

DEV float rms_inv(const float* x, int n, float eps) {
    float s = 0.0f, c = 0.0f;
    for (int i = 0; i < n; i++) KAHAN(x[i] * x[i], s, c);
    return 1.0f / sqrtf(s / (float)n + eps);
}

KERNEL rms_inv_rows(const float* x, int T, int D, float eps, float* inv) {
    int t = (int)GX;
    if (t < T) inv[t] = rms_inv(x + (i64)t * D, D, eps);
}

KERNEL rms_scale(const float* x, int T, int D, const float* inv, const float* w, float* out) {
    i64 i = (i64)GX;
    if (i < (i64)T * D) out[i] = (x[i] * inv[i / D]) * w[i % D];
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
// (lo = 0, or with window > 0 the first of the last `window`). Four steps, each a kernel; scores
// (T, H, ncols) float32 hold the scores, then their exponentials.

DEV float cache_at(const void* a, i64 i, int half) {
    return half ? f16_to_f32(((const u16*)a)[i]) : ((const float*)a)[i];
}

DEV int first_pos(i64 n, int window) { return window > 0 && n - window > 0 ? (int)(n - window) : 0; }

// scores[t, h, p] = (Kahan over d in order of q[t, h, d] k[p, d]) * scale. A thread per (t, h, p).
KERNEL attn_scores(const float* q, int T, int H, int n_kv, int hd, const void* kc, int half, int tiles,
                   const long long* pos, const long long* slot, float scale, int window, float* scores, int ncols) {
    i64 th = GX / ncols;
    int p = (int)(GX % ncols);
    if (th >= (i64)T * H) return;
    i64 t = th / H, h = th % H;
    i64 n = pos[t] + 1;
    if (p >= n || p < first_pos(n, window)) return;
    i64 g = h / (H / n_kv);
    i64 kb = ((slot[t] * n_kv + g) * tiles + p / 64) * hd * 64 + p % 64;
    const float* qr = q + (i64)t * H * hd + (i64)h * hd;
    float s = 0.0f, c = 0.0f;
    for (int d = 0; d < hd; d++) KAHAN(qr[d] * cache_at(kc, kb + (i64)d * 64, half), s, c);
    scores[(i64)th * ncols + p] = s * scale;
}

// m[t, h] = the largest score (a float64 holding a float32; -inf if none is greater). The order of the
// comparisons does not matter: only a zero's sign could differ, and exp(s - m) does not see it.
KERNEL attn_max(const float* scores, int TH, int H, const long long* pos, int window, int ncols, double* m) {
    int th = (int)GX;
    if (th >= TH) return;
    i64 n = pos[th / H] + 1;
    double mx = -as_double(0x7FF0000000000000LL);  // -inf
    for (i64 p = first_pos(n, window); p < n; p++) {
        double e = (double)scores[(i64)th * ncols + p];
        if (e > mx) mx = e;
    }
    m[th] = mx;
}

// scores[t, h, p] = exp32(scores - m) with the difference taken in float64. A thread per (t, h, p).
KERNEL attn_exp(float* scores, int TH, int H, const long long* pos, int window, const double* m, int ncols) {
    i64 th = GX / ncols;
    int p = (int)(GX % ncols);
    if (th >= TH) return;
    i64 n = pos[th / H] + 1;
    if (p >= n || p < first_pos(n, window)) return;
    i64 i = th * ncols + p;
    scores[i] = (float)exp64((double)scores[i] - m[th]);
}

// den[t, h] = Kahan sum of the exponentials in position order.
KERNEL attn_den(const float* scores, int TH, int H, const long long* pos, int window, int ncols, float* den) {
    int th = (int)GX;
    if (th >= TH) return;
    i64 n = pos[th / H] + 1;
    float s = 0.0f, c = 0.0f;
    for (i64 p = first_pos(n, window); p < n; p++) KAHAN(scores[(i64)th * ncols + p], s, c);
    den[th] = s;
}

// out[t, h * hd + d] = (Kahan over positions in order of e_p v[p, d]) / den. A thread per (t, h, d).
KERNEL attn_pv(const float* scores, const float* den, int T, int H, int n_kv, int hd, const void* vc, int half,
               int cap, const long long* pos, const long long* slot, int window, int ncols, float* out) {
    i64 th = GX / hd;
    int d = (int)(GX % hd);
    if (th >= (i64)T * H) return;
    i64 t = th / H, h = th % H;
    i64 n = pos[t] + 1, g = h / (H / n_kv), kv_dim = (i64)n_kv * hd;
    i64 vi = slot[t] * cap * kv_dim + g * hd + d;
    float s = 0.0f, c = 0.0f;
    for (i64 p = first_pos(n, window); p < n; p++)
        KAHAN(scores[(i64)th * ncols + p] * cache_at(vc, vi + p * kv_dim, half), s, c);
    out[(i64)t * H * hd + (i64)h * hd + d] = s / den[th];
}

// out[r] = x[rows[r]] (the rows whose logits are wanted; a copy).
KERNEL gather_rows(const float* x, int D, const long long* rows, int R, float* out) {
    i64 i = (i64)GX;
    if (i < (i64)R * D) out[i] = x[rows[i / D] * D + i % D];
}
