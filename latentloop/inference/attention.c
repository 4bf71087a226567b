/* One-query attention over a long float32 or float16 cache, a decode step's:
 *
 *     out[b, h] = sum_l softmax_l(scale * q[b, h] . k[b, h / G, l]  where mask[b, h, l]) * v[b, h / G, l]
 *
 * q (B, H, 1, D) float32, k (B, Hkv, L, D) and v (B, Hkv, L, Dv) both float32 or both float16 (a cache
 * frozen with `kv_dtype=torch.float16`, as llama.cpp's default cache stores them: half the bytes to
 * stream, each element widened to float32 as it is loaded), with any strides but a contiguous last
 * dimension (the static cache's window is a slice of a longer buffer); mask bool (B | 1, H | 1, 1, L),
 * True = may attend, or none; out (B, H, 1, Dv) float32, contiguous. G = H / Hkv query heads share a
 * key/value head (grouped-query attention). A row whose keys are all masked gets zeros, as SDPA gives.
 *
 * Why not inductor's loops: the compiled step writes this attention as reductions (fast.py's
 * `_attention_by_reduction`), which inductor fuses well at a short window but, after a few thousand
 * tokens, reads the values four times over (one pass per vector of the head, 256 bytes apart) and
 * sums each head's scores in one dependent chain: at 12 layers x d 768 after 2,048 tokens it streamed
 * the cache at about 9 GB/s where llama.cpp streams it at 12. Here each head reads its keys once, in
 * order (four keys' dot products side by side), takes the softmax with a vectorised exp, and reads its
 * values once, in order (two keys' values side by side, the head's accumulators in registers).
 *
 * The sums run in another order than SDPA's (rounding differs in the last bits); exp is a degree-6
 * polynomial after range reduction (relative error about 2e-7 against expf).
 *
 * The (b, h) pairs are split over `threads` OpenMP threads (torch's pool, see native.py). Built with
 * the host's -march=native: 16 lanes with AVX-512, 8 with AVX2 + FMA, a plain loop otherwise (native.py
 * uses it with 8 lanes or more).
 *
 * LATENTLOOP_AOTI (the library's second build, linked with libtorch): `aoti_torch_cpu_decode_attention`,
 * the C function an ahead-of-time compiled decode step (aot.py) calls for `latentloop::decode_attention`.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vec;
typedef __m512i ivec;
#define vzero() _mm512_setzero_ps()
#define vset1(s) _mm512_set1_ps(s)
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vfnma(a, b, c) _mm512_fnmadd_ps(a, b, c) /* c - a * b */
#define vadd(a, b) _mm512_add_ps(a, b)
#define vsub(a, b) _mm512_sub_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vmax(a, b) _mm512_max_ps(a, b)
#define vround(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vsum(a) _mm512_reduce_add_ps(a)
#define vhmax(a) _mm512_reduce_max_ps(a)
/* 2^n for whole n in [-126, 127] */
#define vpow2(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#define vzero_below(x, bound, y) _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset1(bound), _CMP_GE_OQ), y)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vec;
#define vzero() _mm256_setzero_ps()
#define vset1(s) _mm256_set1_ps(s)
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vfnma(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vmax(a, b) _mm256_max_ps(a, b)
#define vround(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vpow2(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
#define vzero_below(x, bound, y) _mm256_and_ps(_mm256_cmp_ps(x, vset1(bound), _CMP_GE_OQ), y)
static inline float vsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float vhmax(__m256 a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
#define LANES 1
#endif

/* IEEE half -> float (a float16 cache's element; subnormals, infinities and NaN kept) */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    union { uint32_t u; float f; } bits;
    if (exponent == 0x1f)
        bits.u = sign | 0x7f800000u | (mantissa << 13);
    else if (exponent)
        bits.u = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13); /* the exponent's bias 15 -> 127 */
    else /* zero or subnormal: mantissa x 2^-24, exact in float */
        return sign ? -(float)mantissa * 0x1p-24f : (float)mantissa * 0x1p-24f;
    return bits.f;
}

#if LANES == 16
#define vload_half(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#elif LANES == 8 && defined(__F16C__)
#define vload_half(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#elif LANES == 8
static inline vec vload_half(const uint16_t *p) {
    float wide[8];
    for (int j = 0; j < 8; ++j)
        wide[j] = half_to_float(p[j]);
    return vload(wide);
}
#endif

/* What a cache element is. The functions below take it as an argument and are inlined into one copy
 * a type (`attend_f32`, `attend_f16`), where it is a constant: no branch on it is left in a loop. */
typedef enum { KV_FLOAT32, KV_FLOAT16 } kv_type;
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* the address of element i of a cache tensor at p */
ALWAYS_INLINE const void *kv_at(const void *p, int64_t i, kv_type t) {
    return t == KV_FLOAT16 ? (const void *)((const uint16_t *)p + i) : (const void *)((const float *)p + i);
}

ALWAYS_INLINE float load_kv(const void *p, int64_t i, kv_type t) {
    return t == KV_FLOAT16 ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if LANES > 1
ALWAYS_INLINE vec vload_kv(const void *p, int64_t i, kv_type t) {
    return t == KV_FLOAT16 ? vload_half((const uint16_t *)p + i) : vload((const float *)p + i);
}
#endif

#ifndef PREFETCH_KEYS
#define PREFETCH_KEYS 12
#endif
/* the lines of four keys from element i of p on (keys `stride` elements apart) are asked for now (a
 * stream of one core waits on memory otherwise) */
#define PREFETCH(p, i, stride, t) \
    do { for (int j_ = 0; j_ < 4; ++j_) __builtin_prefetch(kv_at(p, (i) + j_ * (stride), t)); } while (0)

/* Below this, exp underflows float32's normal range: the weight is taken as 0 (a masked key's
 * -inf lands here too). Against the row's largest weight, 1, such a term is below float32's epsilon. */
#define EXP_FLOOR -87.0f

#if LANES > 1
/* exp(x) for x <= 0 (the softmax's shifted scores): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its
 * Taylor polynomial to r^6 in Horner form, times 2^n; x below EXP_FLOOR gives 0. */
static inline vec vexp(vec x) {
    vec xc = vmax(x, vset1(EXP_FLOOR));
    vec n = vround(vmul(xc, vset1(1.44269504088896341f)));
    vec r = vfnma(n, vset1(0.693359375f), xc); /* ln 2 in two parts: the first exact in a float */
    r = vfnma(n, vset1(-2.12194440e-4f), r);
    vec p = vset1(1.0f / 720);
    p = vfma(p, r, vset1(1.0f / 120));
    p = vfma(p, r, vset1(1.0f / 24));
    p = vfma(p, r, vset1(1.0f / 6));
    p = vfma(p, r, vset1(0.5f));
    p = vfma(p, r, vset1(1.0f));
    p = vfma(p, r, vset1(1.0f));
    return vzero_below(x, EXP_FLOOR, vmul(p, vpow2(n)));
}

/* q . (the key from element i of k on) */
ALWAYS_INLINE float dot(const float *q, const void *k, int64_t i, int64_t D, kv_type t) {
    vec acc = vzero();
    int64_t d = 0;
    for (; d + LANES <= D; d += LANES)
        acc = vfma(vload(q + d), vload_kv(k, i + d, t), acc);
    float s = vsum(acc);
    for (; d < D; ++d)
        s += q[d] * load_kv(k, i + d, t);
    return s;
}
#endif

/* The scores of one query against its head's keys: s[l] = scale * q . k_l, or -inf where masked;
 * returns the largest. Four keys at a time, each with its accumulator (independent chains). */
ALWAYS_INLINE float scores(const float *q, const void *k, int64_t ks, const uint8_t *mask, int64_t ms,
                           float scale, float *s, int64_t L, int64_t D, kv_type t) {
    float top = -INFINITY;
    int64_t l = 0;
#if LANES > 1
    if (D % LANES == 0) {
        for (; l + 4 <= L; l += 4) {
            /* Four masked keys are not read: a batch's rows share one window, as long as its longest
             * row, so a shorter row's (or a free row's) window ends in slots it never filled. */
            if (mask && !(mask[l * ms] | mask[(l + 1) * ms] | mask[(l + 2) * ms] | mask[(l + 3) * ms])) {
                s[l] = s[l + 1] = s[l + 2] = s[l + 3] = -INFINITY;
                continue;
            }
            int64_t k0 = l * ks, k1 = k0 + ks, k2 = k1 + ks, k3 = k2 + ks, ahead = k0 + PREFETCH_KEYS * ks;
            vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
            for (int64_t d = 0; d < D; d += LANES) {
                PREFETCH(k, ahead + d, ks, t);
                vec qv = vload(q + d);
                a0 = vfma(qv, vload_kv(k, k0 + d, t), a0);
                a1 = vfma(qv, vload_kv(k, k1 + d, t), a1);
                a2 = vfma(qv, vload_kv(k, k2 + d, t), a2);
                a3 = vfma(qv, vload_kv(k, k3 + d, t), a3);
            }
            float dots[4] = {vsum(a0), vsum(a1), vsum(a2), vsum(a3)};
            for (int j = 0; j < 4; ++j) {
                float x = (mask && !mask[(l + j) * ms]) ? -INFINITY : dots[j] * scale;
                s[l + j] = x;
                top = x > top ? x : top;
            }
        }
    }
#endif
    for (; l < L; ++l) {
        float x = -INFINITY;
        if (!mask || mask[l * ms]) {
#if LANES > 1
            x = dot(q, k, l * ks, D, t) * scale;
#else
            x = 0.0f;
            for (int64_t d = 0; d < D; ++d)
                x += q[d] * load_kv(k, l * ks + d, t);
            x *= scale;
#endif
        }
        s[l] = x;
        top = x > top ? x : top;
    }
    return top;
}

/* s[l] = exp(s[l] - top) in place; returns their sum. */
static float exponentials(float *s, int64_t L, float top) {
    float sum = 0.0f;
    int64_t l = 0;
#if LANES > 1
    vec acc = vzero(), t = vset1(top);
    for (; l + LANES <= L; l += LANES) {
        vec e = vexp(vsub(vload(s + l), t));
        vstore(s + l, e);
        acc = vadd(acc, e);
    }
    sum = vsum(acc);
#endif
    for (; l < L; ++l) {
        float x = s[l] - top;
        s[l] = x < EXP_FLOOR ? 0.0f : expf(x);
        sum += s[l];
    }
    return sum;
}

#define MAX_HEAD_VECTORS 16 /* Dv up to 16 vectors (256 with AVX-512): the head's accumulators */

/* out[0:Dv] = sum_l p[l] v_l / total: two keys at a time, each with its own accumulators. */
ALWAYS_INLINE void weighted_values(const float *p, const void *v, int64_t vs, int64_t L, int64_t Dv, float total,
                                   float *out, kv_type t) {
    float inv = 1.0f / total;
#if LANES > 1
    if (Dv % LANES == 0 && Dv / LANES <= MAX_HEAD_VECTORS) {
        int64_t n = Dv / LANES;
        vec a[MAX_HEAD_VECTORS], b[MAX_HEAD_VECTORS];
        for (int64_t c = 0; c < n; ++c)
            a[c] = b[c] = vzero();
        int64_t l = 0;
        for (; l + 2 <= L; l += 2) {
            if (p[l] == 0.0f && p[l + 1] == 0.0f)
                continue; /* masked (or negligible) keys: their values are not read */
            vec p0 = vset1(p[l]), p1 = vset1(p[l + 1]);
            int64_t v0 = l * vs, v1 = v0 + vs, ahead = v0 + PREFETCH_KEYS * vs;
            for (int64_t c = 0; c < n; ++c) {
                PREFETCH(v, ahead + c * LANES, vs, t);
                a[c] = vfma(p0, vload_kv(v, v0 + c * LANES, t), a[c]);
                b[c] = vfma(p1, vload_kv(v, v1 + c * LANES, t), b[c]);
            }
        }
        for (; l < L; ++l) {
            vec p0 = vset1(p[l]);
            for (int64_t c = 0; c < n; ++c)
                a[c] = vfma(p0, vload_kv(v, l * vs + c * LANES, t), a[c]);
        }
        for (int64_t c = 0; c < n; ++c)
            vstore(out + c * LANES, vmul(vadd(a[c], b[c]), vset1(inv)));
        return;
    }
#endif
    for (int64_t d = 0; d < Dv; ++d)
        out[d] = 0.0f;
    for (int64_t l = 0; l < L; ++l) {
        if (p[l] == 0.0f)
            continue;
        for (int64_t d = 0; d < Dv; ++d)
            out[d] += p[l] * load_kv(v, l * vs + d, t);
    }
    for (int64_t d = 0; d < Dv; ++d)
        out[d] *= inv;
}

/* The rows one vector holds (1: a plain loop, see native.py). */
int latentloop_attention_lanes(void) { return LANES; }

#define ATTEND_ARGUMENTS                                                                                           \
    const float *q, const void *k, const void *v, const uint8_t *mask, float *out, int64_t i, int64_t H,           \
        int64_t group, int64_t L, int64_t D, int64_t Dv, const int64_t *q_strides, const int64_t *k_strides,         \
        const int64_t *v_strides, const int64_t *mask_strides, float scale, float *s
#define ATTEND_PASSED q, k, v, mask, out, i, H, group, L, D, Dv, q_strides, k_strides, v_strides, mask_strides, scale, s

/* One (b, h) pair's output; `s` holds L floats. */
ALWAYS_INLINE void attend(ATTEND_ARGUMENTS, kv_type t) {
    int64_t b = i / H, h = i % H, hk = h / group;
    const float *qp = q + b * q_strides[0] + h * q_strides[1];
    const void *kp = kv_at(k, b * k_strides[0] + hk * k_strides[1], t);
    const void *vp = kv_at(v, b * v_strides[0] + hk * v_strides[1], t);
    const uint8_t *mp = mask ? mask + b * mask_strides[0] + h * mask_strides[1] : NULL;
    float *op = out + i * Dv;
    float top = scores(qp, kp, k_strides[2], mp, mask ? mask_strides[2] : 0, scale, s, L, D, t);
    if (top == -INFINITY) { /* every key masked: SDPA's zeros */
        for (int64_t d = 0; d < Dv; ++d)
            op[d] = 0.0f;
        return;
    }
    weighted_values(s, vp, v_strides[2], L, Dv, exponentials(s, L, top), op, t);
}

static void attend_f32(ATTEND_ARGUMENTS) { attend(ATTEND_PASSED, KV_FLOAT32); }
static void attend_f16(ATTEND_ARGUMENTS) { attend(ATTEND_PASSED, KV_FLOAT16); }
typedef void (*attend_function)(ATTEND_ARGUMENTS);

#define STACK_SCORES 4096 /* a window up to this many keys keeps its scores on the stack (one thread) */

/* Every (b, h) pair through `attend_one` (the copy for the cache's type). */
static int attend_all(attend_function attend_one, const float *q, const void *k, const void *v, const uint8_t *mask,
                      float *out, int64_t B, int64_t H, int64_t Hkv, int64_t L, int64_t D, int64_t Dv,
                      const int64_t *q_strides, const int64_t *k_strides, const int64_t *v_strides,
                      const int64_t *mask_strides, float scale, int threads) {
    int64_t group = H / Hkv, pairs = B * H;
    if (threads <= 1 && L <= STACK_SCORES) {
        float s[STACK_SCORES];
        for (int64_t i = 0; i < pairs; ++i)
            attend_one(ATTEND_PASSED);
        return 0;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *s = malloc((size_t)(L > 0 ? L : 1) * sizeof(float)); /* this thread's scores */
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < pairs; ++i)
            if (s)
                attend_one(ATTEND_PASSED);
        free(s);
    }
    return failed ? -1 : 0;
}

/* Strides in elements: q's (b, h), k's and v's (b, h, l), mask's (b, h, l), a broadcast dimension's
 * stride 0; mask may be NULL. Returns 0, or -1 when a buffer could not be allocated (out is then not
 * fully written). One thread runs without entering OpenMP (a short window's step calls this once a
 * layer). k and v float32 here, float16 (uint16_t bits) in `latentloop_decode_attention_f16`. */
int latentloop_decode_attention_f32(const float *q, const float *k, const float *v, const uint8_t *mask, float *out,
                                    int64_t B, int64_t H, int64_t Hkv, int64_t L, int64_t D, int64_t Dv,
                                    const int64_t *q_strides, const int64_t *k_strides, const int64_t *v_strides,
                                    const int64_t *mask_strides, float scale, int threads) {
    return attend_all(attend_f32, q, k, v, mask, out, B, H, Hkv, L, D, Dv, q_strides, k_strides, v_strides,
                      mask_strides, scale, threads);
}

int latentloop_decode_attention_f16(const float *q, const uint16_t *k, const uint16_t *v, const uint8_t *mask,
                                    float *out, int64_t B, int64_t H, int64_t Hkv, int64_t L, int64_t D, int64_t Dv,
                                    const int64_t *q_strides, const int64_t *k_strides, const int64_t *v_strides,
                                    const int64_t *mask_strides, float scale, int threads) {
    return attend_all(attend_f16, q, k, v, mask, out, B, H, Hkv, L, D, Dv, q_strides, k_strides, v_strides,
                      mask_strides, scale, threads);
}

#ifdef LATENTLOOP_AOTI
#include "aoti_shim.h"

/* Strides of a 4-d tensor's dimensions `dims`, 0 where the size is 1 (broadcast), into `out`. */
static int strides_of(AtenTensorHandle t, const int *dims, int n, int64_t *out) {
    int64_t *sizes, *strides;
    if (aoti_torch_get_sizes(t, &sizes) || aoti_torch_get_strides(t, &strides))
        return 1;
    for (int j = 0; j < n; ++j)
        out[j] = sizes[dims[j]] == 1 ? 0 : strides[dims[j]];
    return 0;
}

/* latentloop::decode_attention(q (B, H, 1, D) float32, k (B, Hkv, L, D) and v (B, Hkv, L, Dv) both float32 or
 * both float16, mask bool (B | 1, H | 1, 1, L), scale) -> (B, H, 1, Dv) float32, as AOTInductor calls an
 * operator listed in `aot_inductor.custom_ops_to_c_shims` (native.py checks the shapes before the
 * operator is traced). */
AOTITorchError aoti_torch_cpu_decode_attention(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                               AtenTensorHandle mask, double scale, AtenTensorHandle *out) {
    int64_t dims[4], *qs, *ks, *vs, *ms, *strides;
    int32_t types[3], mask_type;
    AtenTensorHandle all[3] = {q, k, v};
    for (int j = 0; j < 3; ++j)
        if (aoti_torch_get_dim(all[j], &dims[j]) || dims[j] != 4 || aoti_torch_get_dtype(all[j], &types[j]) ||
            aoti_torch_get_strides(all[j], &strides) || strides[3] != 1)
            return FAILED;
    int half = types[1] == aoti_torch_dtype_float16();
    if (types[0] != aoti_torch_dtype_float32() || types[1] != types[2] ||
        (types[1] != aoti_torch_dtype_float32() && !half))
        return FAILED;
    if (aoti_torch_get_dim(mask, &dims[3]) || dims[3] != 4 || aoti_torch_get_dtype(mask, &mask_type) ||
        mask_type != aoti_torch_dtype_bool() || aoti_torch_get_sizes(q, &qs) || aoti_torch_get_sizes(k, &ks) ||
        aoti_torch_get_sizes(v, &vs) || aoti_torch_get_sizes(mask, &ms))
        return FAILED;
    int64_t B = qs[0], H = qs[1], Hkv = ks[1], L = ks[2], D = qs[3], Dv = vs[3];
    if (qs[2] != 1 || ks[0] != B || vs[0] != B || vs[1] != Hkv || vs[2] != L || ks[3] != D || Hkv < 1 || H % Hkv ||
        (ms[0] != 1 && ms[0] != B) || (ms[1] != 1 && ms[1] != H) || ms[2] != 1 || ms[3] != L)
        return FAILED;
    static const int qd[2] = {0, 1}, kd[3] = {0, 1, 2}, md[3] = {0, 1, 3};
    int64_t q_strides[2], k_strides[3], v_strides[3], mask_strides[3];
    if (strides_of(q, qd, 2, q_strides) || strides_of(k, kd, 3, k_strides) || strides_of(v, kd, 3, v_strides) ||
        strides_of(mask, md, 3, mask_strides))
        return FAILED;
    int64_t out_sizes[4] = {B, H, 1, Dv};
    void *qp, *kp, *vp, *mp, *op;
    if (empty_like_rows(4, out_sizes, Dv, out) || aoti_torch_get_data_ptr(q, &qp) || aoti_torch_get_data_ptr(k, &kp) ||
        aoti_torch_get_data_ptr(v, &vp) || aoti_torch_get_data_ptr(mask, &mp) || aoti_torch_get_data_ptr(*out, &op))
        return FAILED;
    int threads = package_threads(B * H * L * (D + Dv));
    if (B * H > 0 && attend_all(half ? attend_f16 : attend_f32, qp, kp, vp, mp, op, B, H, Hkv, L, D, Dv, q_strides,
                                k_strides, v_strides, mask_strides, (float)scale, threads))
        return FAILED;
    return 0;
}
#endif
