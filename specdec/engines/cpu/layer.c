/* One Llama-style decoder layer for a batch of one row, in native code: what specdec/sampling/lean.py's LeanLayer
computes, in one call instead of ~15 PyTorch ops.

An AR step of a small model (SmolLM2-135M) spends a large share of its time outside the products: each of the ~15 ops a
lean layer dispatches per token costs microseconds of framework overhead, 30 layers times over. Here the layer is one
ctypes call: RMSNorm, the fused q|k|v product, rotary on q and k, the keys and values written into the slot cache,
attention over the cache window (with the caller's additive mask, or none), the output product and residual, RMSNorm,
the fused gate|up product, SiLU·up, the down product and residual. The four products are smallm.c's packed kernels, each
over its weight in the form the caller chose: float32, bfloat16 (a drafter's rounded copy under draft_precision=bf16, or
a weight that holds bfloat16 values exactly), or an exact compact form (compact.py's q4 / q8: the same float32 numbers
from about a fifth or a quarter of the bytes); everything else vectorised here; smallm_layers runs a model's whole stack
in one call, so a forward's layers pay one call's overhead. Numbers: the same math as the lean layer in float32, summed
in another order (native.py checks every layer against the lean one before it is used, and measurement decides whether
it is used at all: see native_layer.py).

Built into the same library as smallm.c (native.py compiles both). */

#include <stddef.h>
#include <stdint.h>

/* the vector width smallm.c's packed kernel uses (512 bits with AVX-512, else 256) */
#if defined(__AVX512F__)
#define PLANES 16
#else
#define PLANES 8
#endif

void smallm_packed(const float *x, const float *wp, float *y, int M, int I, int O, int threads); /* smallm.c */
void smallm_packed_bf16(const float *x, const uint16_t *wp, float *y, int M, int I, int O, int threads);
void smallm_packed_q4(const float *x, const void *wp, float *y, int M, int I, int O, int threads);
void smallm_packed_q8(const float *x, const void *wp, float *y, int M, int I, int O, int threads);
void smallm_q4a8(const float *x, const void *wp, float *y, int M, int I, int O, int threads);
void smallm_next(const void *w, int form, int I, int O, int rows);

enum { QKV, OUT, GATE_UP, DOWN };   /* a layer's products, in the order it runs them */
enum { F32, BF16, Q4, Q8, Q4A8 };   /* the form a product's weight is held in (native_layer.FORMATS) */

/* A layer's fixed parts: pointers into tensors the Python side keeps alive (native_layer.NativeLayer). */
typedef struct {
    const float *norm1, *norm2;                  /* [H] RMSNorm weights */
    const void *weights[4];                      /* the products' weights (QKV..DOWN) in smallm.c's packed layouts */
    float *keys, *values;                        /* this layer's slot cache, [kv_heads, max_len, d] each */
    int hidden, heads, kv_heads, head_dim, intermediate, max_len;
    float eps, scaling;
    int formats[4];                              /* each weight's form: F32, BF16, Q4, Q8 or Q4A8 */
} layer_t;

/* y [M, O] = x [M, I] · wᵀ for the layer's product `which`, by the kernel of its weight's form */
static void product(const layer_t *L, int which, const float *x, float *y, int M, int I, int O, int threads) {
    const void *w = L->weights[which];
    switch (L->formats[which]) {
    case BF16: smallm_packed_bf16(x, (const uint16_t *)w, y, M, I, O, threads); break;
    case Q4: smallm_packed_q4(x, w, y, M, I, O, threads); break;
    case Q8: smallm_packed_q8(x, w, y, M, I, O, threads); break;
    case Q4A8: smallm_q4a8(x, w, y, M, I, O, threads); break;
    default: smallm_packed(x, (const float *)w, y, M, I, O, threads);
    }
}

typedef float fvec __attribute__((vector_size(PLANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(PLANES * sizeof(int32_t))));

static inline fvec vload(const float *p) {
    fvec v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}
static inline void vstore(float *p, fvec v) { __builtin_memcpy(p, &v, sizeof v); }
static inline fvec splat(float f) { return (fvec){0} + f; }

/* the lanes' sum: one shuffle-and-add tree in registers where the CPU has the vectors (the generic loop goes through
   the stack, a chain of 15 dependent adds) */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
static inline float vsum(fvec v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX2__)
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
    float s = 0.f;
    for (int l = 0; l < PLANES; l++) s += v[l];
    return s;
#endif
}

/* per lane: a where m is set (all ones), else b */
static inline fvec blend(ivec m, fvec a, fvec b) {
    ivec ia, ib;
    __builtin_memcpy(&ia, &a, sizeof ia);
    __builtin_memcpy(&ib, &b, sizeof ib);
    const ivec r = (ia & m) | (ib & ~m);
    fvec out;
    __builtin_memcpy(&out, &r, sizeof out);
    return out;
}

/* exp(x) per lane, Cephes' single-precision polynomial (within ~2 ulp of expf); exactly 0 below -87 (a masked
   score: the additive mask is the dtype's lowest value, and its weight must vanish as in SDPA) */
static inline fvec vexp(fvec x) {
    const ivec dead = x < -87.0f;
    x = blend(x > 88.3f, splat(88.3f), blend(dead, splat(-87.0f), x));
    fvec fx = x * 1.44269504088896341f + 0.5f;
    ivec n = __builtin_convertvector(fx, ivec);                 /* truncates toward zero: floor needs a fix-up */
    n += (ivec)(__builtin_convertvector(n, fvec) > fx);         /* true is -1 */
    const fvec fn = __builtin_convertvector(n, fvec);
    x = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    fvec y = splat(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + 1.0f;
    const ivec scale = (n + 127) << 23;                         /* 2^n as a float's bits */
    fvec p;
    __builtin_memcpy(&p, &scale, sizeof p);
    return blend(dead, (fvec){0}, y * p);
}

static float vexp_scalar(float x) {
    fvec v = vexp(splat(x));
    return v[0];
}

/* out [n, H] = RMSNorm(x [n, H]) · w, as F.rms_norm: x · (mean(x²) + eps)^-½ · w */
static void rms_norm(const float *x, const float *w, float *out, int n, int H, float eps) {
    for (int r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * H;
        float *yr = out + (size_t)r * H;
        fvec acc = {0};
        int i = 0;
        for (; i + PLANES <= H; i += PLANES) {
            const fvec v = vload(xr + i);
            acc += v * v;
        }
        float s = vsum(acc);
        for (; i < H; i++) s += xr[i] * xr[i];
        const float inv = 1.0f / __builtin_sqrtf(s / (float)H + eps);
        for (i = 0; i < H; i++) yr[i] = w[i] * (xr[i] * inv);
    }
}

/* x [d] rotated in place at one position: x·cos + roll(x, d/2)·sin, sin's first half negated (lean_rope's form) */
static void rotate(float *x, const float *cos, const float *sin, int d) {
    float tmp[512];
    const int half = d / 2;
    /* two loops without a per-element branch: both vectorise */
    for (int j = 0; j < half; j++) tmp[j] = x[j] * cos[j] + x[j + half] * sin[j];
    for (int j = half; j < d; j++) tmp[j] = x[j] * cos[j] + x[j - half] * sin[j];
    __builtin_memcpy(x, tmp, sizeof(float) * d);
}

/* Two-source lane shuffles with constant indices (GCC's and Clang's spellings of the same builtin) */
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (ivec){__VA_ARGS__})
#endif

/* The lane sums of PLANES vectors a_k as one vector, lane k = Σ_l a_k[l]: a transpose-and-add tree. Each level adds
   the low and high halves of every segment of a pair of vectors (2 shuffles and an add per vector out): 3·(PLANES - 1)
   vector ops for PLANES sums, where summing each vector alone is a chain of log2(PLANES) dependent shuffles and adds.
   pair_sums is the first level (a_2i, a_2i+1 -> b_i, so the a need not all be live at once), lane_sums the rest. */
#if PLANES == 16
#define L16A 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define L16B 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define L8A 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define L8B 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define L4A 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define L4B 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define L2A 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define L2B 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#else
#define L8A 0, 1, 2, 3, 8, 9, 10, 11
#define L8B 4, 5, 6, 7, 12, 13, 14, 15
#define L4A 0, 1, 4, 5, 8, 9, 12, 13
#define L4B 2, 3, 6, 7, 10, 11, 14, 15
#define L2A 0, 2, 4, 6, 8, 10, 12, 14
#define L2B 1, 3, 5, 7, 9, 11, 13, 15
#endif
#define HALVES(u, v, lo, hi) (SHUFFLE(u, v, lo) + SHUFFLE(u, v, hi))
static inline fvec pair_sums(fvec u, fvec v) {
#if PLANES == 16
    return HALVES(u, v, L16A, L16B);
#else
    return HALVES(u, v, L8A, L8B);
#endif
}
static inline fvec lane_sums(const fvec *b) { /* b: the PLANES/2 pair_sums */
#if PLANES == 16
    fvec c[4], e[2];
    for (int i = 0; i < 4; i++) c[i] = HALVES(b[2 * i], b[2 * i + 1], L8A, L8B);
#else
    const fvec *c = b;
    fvec e[2];
#endif
    for (int i = 0; i < 2; i++) e[i] = HALVES(c[2 * i], c[2 * i + 1], L4A, L4B);
    return HALVES(e[0], e[1], L2A, L2B);
}

/* One kv head's attention over the window's keys [w0, w1), for its nq queries (GQA: its group of heads times the rows;
   qs[i] query i's [d] vector, ms[i] its row's additive mask [width] or NULL). Keys go PLANES at a time: a query's
   PLANES scores are d/PLANES FMAs per key and one lane_sums, so the scores come out as a vector with the keys in its
   lanes; the softmax runs down the keys lane-wise (the lanes past w1 at the lowest float, so exp gives them 0); each
   value row serves QB queries from registers. The keys and values come from memory once (asked for up front: in a
   forward the layers' weights have evicted them since the last one); the queries' later passes find them in the cache.
   sc: nq·(w1 - w0 + PLANES + 1) floats of scratch. Out: the normalised output out[i], or where part is not NULL, per
   query its softmax's max and sum and the unnormalised Σ p·v (part: [nq] maxima, [nq] sums, [nq, d]).
   Keys in the lanes, rather than one (head, row) at a time or the queries in the lanes: one kv head's keys and values
   serve all its queries, and PLANES scores take one lane_sums where a score each would take a horizontal sum, which
   pays most at a verify's few rows and is about even past them (experiments/ab_native.py --forward times the verify
   forward against another revision). */
#define QB (PLANES == 16 ? 6 : 2) /* queries per pass over the values: QB·d/PLANES accumulators */
static inline __attribute__((always_inline)) void attend_keys(const float *const *qs, const float *const *ms, int nq,
                                                              const float *K, const float *V, int w0, int w1, int d,
                                                              float scaling, float *sc, float *part,
                                                              float *const *out) {
    const int width = w1 - w0, stride = (width + PLANES - 1) / PLANES * PLANES, parts = d / PLANES;
    for (size_t b = 0; b < (size_t)width * d * sizeof(float); b += 64) {
        __builtin_prefetch((const char *)(K + (size_t)w0 * d) + b, 0, 3);
        __builtin_prefetch((const char *)(V + (size_t)w0 * d) + b, 0, 3);
    }
    for (int i = 0; i < nq; i++) {
        fvec q[16];                                             /* d ≤ 16·PLANES */
        for (int c = 0; c < parts; c++) q[c] = vload(qs[i] + c * PLANES);
        float *row = sc + (size_t)i * stride;
        for (int w = 0; w < width; w += PLANES) {
            const int m = width - w < PLANES ? width - w : PLANES;
            fvec b[PLANES / 2];
            for (int k = 0; k < PLANES; k += 2) {
                const float *k0 = K + (size_t)(w0 + w + (k < m ? k : 0)) * d;
                const float *k1 = K + (size_t)(w0 + w + (k + 1 < m ? k + 1 : 0)) * d;
                fvec a0 = q[0] * vload(k0), a1 = q[0] * vload(k1);
                for (int c = 1; c < parts; c++) {
                    a0 += q[c] * vload(k0 + c * PLANES);
                    a1 += q[c] * vload(k1 + c * PLANES);
                }
                b[k / 2] = pair_sums(a0, a1);
            }
            fvec s = lane_sums(b) * scaling;
            if (m == PLANES) {
                if (ms[i]) s += vload(ms[i] + w0 + w);
            } else
                for (int k = 0; k < PLANES; k++) s[k] = k < m ? s[k] + (ms[i] ? ms[i][w0 + w + k] : 0.f) : -3.4e38f;
            vstore(row + w, s);
        }
        fvec most = splat(-3.4e38f), total = {0};
        for (int w = 0; w < stride; w += PLANES) {
            const fvec v = vload(row + w);
            most = blend(v > most, v, most);
        }
        float top = most[0];
        for (int l = 1; l < PLANES; l++) top = most[l] > top ? most[l] : top;
        for (int w = 0; w < stride; w += PLANES) {
            const fvec e = vexp(vload(row + w) - top);
            vstore(row + w, e);
            total += e;
        }
        const float sum = vsum(total);
        sc[(size_t)nq * stride + i] = sum;
        if (part) {
            part[i] = top;
            part[nq + i] = sum;
        }
    }
    for (int i0 = 0; i0 < nq; i0 += QB) {
        const int qb = nq - i0 < QB ? nq - i0 : QB;
        fvec acc[QB][16];
        for (int k = 0; k < QB; k++)
            for (int c = 0; c < parts; c++) acc[k][c] = (fvec){0};
        const float *p[QB];
        for (int k = 0; k < QB; k++) p[k] = sc + (size_t)(i0 + (k < qb ? k : 0)) * stride;
        for (int w = 0; w < width; w++) {
            const float *v = V + (size_t)(w0 + w) * d;
            for (int c = 0; c < parts; c++) {
                const fvec vc = vload(v + c * PLANES);
                for (int k = 0; k < QB; k++) acc[k][c] += vc * p[k][w];
            }
        }
        for (int k = 0; k < qb; k++) {
            float *o = part ? part + 2 * nq + (size_t)(i0 + k) * d : out[i0 + k];
            const float scale = part ? 1.0f : 1.0f / sc[(size_t)nq * stride + i0 + k];
            for (int c = 0; c < parts; c++) vstore(o + c * PLANES, acc[k][c] * scale);
        }
    }
}

/* floats of scratch `smallm_layer` needs for n rows over a window of `width` slots on `threads` threads */
long smallm_layer_scratch(const layer_t *L, int n, int width, int threads) {
    const long qkv = (long)(L->heads + 2 * L->kv_heads) * L->head_dim;
    const long wide = qkv > 2L * L->intermediate ? qkv : 2L * L->intermediate;
    const long nq = (long)n * (L->heads / L->kv_heads);
    return (long)n * (2L * L->hidden + wide + (long)L->heads * L->head_dim + L->intermediate)
           + threads * nq * (width + PLANES + 1)                     /* attend_keys' scores, per thread */
           + (long)L->kv_heads * threads * nq * (2 + L->head_dim);   /* the key splits' partial results */
}

/* the calling OpenMP thread's number (0 without OpenMP) */
static inline int thread_num(void) {
#ifdef _OPENMP
    extern int omp_get_thread_num(void);
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* att [n, heads·d]: the attention of the rows' queries (q | k | v per row in wide) over the window's `width` slots,
   mask [n, width] additive or NULL; scratch: smallm_layer_scratch's attention part. A task per kv head with all its
   queries; where the kv heads do not spread evenly over the threads (SmolLM2: 3 over 2, so one thread would do twice
   the other's work), a task per kv head and share of the keys, the shares' partial softmaxes then merged (rescaled to
   the largest maximum): every thread reads the same number of keys. */
static void attention(const layer_t *L, const float *wide, int qkv_width, const float *mask, float *att, int n,
                      int width, float *scratch, int threads) {
    const int d = L->head_dim, heads = L->heads, kv = L->kv_heads, group = heads / kv, nq = n * group;
    const int splits = kv % threads == 0 || width < 2 * PLANES * threads ? 1 : threads;
    const size_t sc_size = (size_t)nq * (width + PLANES + 1), part_size = (size_t)nq * (2 + d);
    float *parts = scratch + (size_t)threads * sc_size;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int task = 0; task < kv * splits; task++) {
            const int g = task % kv, s = task / kv;
            const float *qs[nq], *ms[nq];
            float *outs[nq];
            for (int i = 0; i < nq; i++) {
                const int r = i / group, hd = g * group + i % group;
                qs[i] = wide + (size_t)r * qkv_width + (size_t)hd * d;
                ms[i] = mask ? mask + (size_t)r * width : NULL;
                outs[i] = att + (size_t)r * heads * d + (size_t)hd * d;
            }
            const float *K = L->keys + (size_t)g * L->max_len * d, *V = L->values + (size_t)g * L->max_len * d;
            const int w0 = (int)((long)width * s / splits), w1 = (int)((long)width * (s + 1) / splits);
            float *sc = scratch + (size_t)thread_num() * sc_size, *part = splits > 1 ? parts + task * part_size : NULL;
            if (d == 64) /* the common head size as a constant: its loops unroll */
                attend_keys(qs, ms, nq, K, V, w0, w1, 64, L->scaling, sc, part, outs);
            else
                attend_keys(qs, ms, nq, K, V, w0, w1, d, L->scaling, sc, part, outs);
        }
    }
    if (splits > 1) /* each query's shares merged (a few vector ops per query: not worth waking the threads) */
        for (int g = 0; g < kv; g++)
            for (int i = 0; i < nq; i++) {
                const int r = i / group, hd = g * group + i % group;
                float top = -3.4e38f, sum = 0.f;
                for (int s = 0; s < splits; s++) {
                    const float m = parts[(s * kv + g) * part_size + i];
                    top = m > top ? m : top;
                }
                fvec o[16] = {{0}};
                for (int s = 0; s < splits; s++) {
                    const float *p = parts + (s * kv + g) * part_size;
                    const float scale = vexp_scalar(p[i] - top);
                    sum += scale * p[nq + i];
                    for (int c = 0; c < d / PLANES; c++) o[c] += vload(p + 2 * nq + (size_t)i * d + c * PLANES) * scale;
                }
                float *out = att + (size_t)r * heads * d + (size_t)hd * d;
                for (int c = 0; c < d / PLANES; c++) vstore(out + c * PLANES, o[c] * (1.0f / sum));
            }
}

/* whether smallm_layer computes L over a window of `width` slots */
static int fits(const layer_t *L, int width) {
    const int d = L->head_dim;
    return !(d % PLANES || d > 16 * PLANES || d > 512 || L->heads % L->kv_heads || width > L->max_len);
}

/* Name L's product `which` as the one after the next (smallm_next: the next product's threads ask for its first bytes
   as they finish); none where L is NULL */
static void announce(const layer_t *L, int which, int rows) {
    if (!L) return;
    const int H = L->hidden, att = L->heads * L->head_dim, inter = L->intermediate;
    const int in[4] = {H, att, H, inter}, out[4] = {att + 2 * L->kv_heads * L->head_dim, H, 2 * inter, H};
    smallm_next(L->weights[which], L->formats[which], in[which], out[which], rows);
}

/* smallm_layer, and `next` (NULL: none) the layer after it, whose first product is named while this one's last runs */
static int layer_forward(const layer_t *L, const layer_t *next, float *h, int n, const float *cos, const float *sin,
                         const int64_t *slots, int width, const float *mask, float *scratch, int threads) {
    const int H = L->hidden, d = L->head_dim, heads = L->heads, kv = L->kv_heads, inter = L->intermediate;
    if (!fits(L, width)) return -1;
    const int qkv_width = (heads + 2 * kv) * d;
    float *x = scratch;                                          /* [n, H] normed input */
    float *y = x + (size_t)n * H;                                /* [n, H] a product's output */
    float *wide = y + (size_t)n * H;                             /* [n, max(qkv, 2·inter)] */
    const size_t wide_n = qkv_width > 2 * inter ? qkv_width : 2 * inter;
    float *att = wide + (size_t)n * wide_n;                      /* [n, heads·d] attention output */
    float *act = att + (size_t)n * heads * d;                    /* [n, inter] SiLU(gate)·up */
    float *scores = act + (size_t)n * inter;                     /* the attention's (see attention) */

    rms_norm(h, L->norm1, x, n, H, L->eps);
    announce(L, OUT, n);
    product(L, QKV, x, wide, n, H, qkv_width, threads);      /* [n, (heads + 2kv)·d]: q | k | v per row */
    for (int r = 0; r < n; r++) {
        float *row = wide + (size_t)r * qkv_width;
        for (int hd = 0; hd < heads + kv; hd++) rotate(row + (size_t)hd * d, cos + (size_t)r * d, sin + (size_t)r * d, d);
        for (int g = 0; g < kv; g++) {
            const size_t at = ((size_t)g * L->max_len + (size_t)slots[r]) * d;
            __builtin_memcpy(L->keys + at, row + (size_t)(heads + g) * d, sizeof(float) * d);
            __builtin_memcpy(L->values + at, row + (size_t)(heads + kv + g) * d, sizeof(float) * d);
        }
    }
    attention(L, wide, qkv_width, mask, att, n, width, scores, threads);
    announce(L, GATE_UP, n);
    product(L, OUT, att, y, n, heads * d, H, threads);
    for (size_t i = 0; i < (size_t)n * H; i++) h[i] += y[i];

    rms_norm(h, L->norm2, x, n, H, L->eps);
    announce(L, DOWN, n);
    product(L, GATE_UP, x, wide, n, H, 2 * inter, threads);  /* [n, 2·inter]: gate | up per row */
    for (int r = 0; r < n; r++) {
        const float *gate = wide + (size_t)r * 2 * inter, *up = gate + inter;
        float *a = act + (size_t)r * inter;
        int i = 0;
        for (; i + PLANES <= inter; i += PLANES) {
            const fvec gv = vload(gate + i);
            vstore(a + i, gv / (1.0f + vexp(-gv)) * vload(up + i));
        }
        for (; i < inter; i++) a[i] = gate[i] / (1.0f + vexp_scalar(-gate[i])) * up[i];
    }
    announce(next, QKV, n);
    product(L, DOWN, act, y, n, inter, H, threads);
    for (size_t i = 0; i < (size_t)n * H; i++) h[i] += y[i];
    return 0;
}

/* The layer over h [n, H] in place (batch of one). cos, sin [n, d]: lean_rope's tables at the rows' positions;
   slots [n]: where each row's key and value go in the cache; width: keys attended, slots [0, width); mask [n, width]
   additive, or NULL when every row sees the whole window; scratch: smallm_layer_scratch(...) floats. Returns 0, or -1
   for a shape it does not handle (the caller then runs the lean layer). */
int smallm_layer(const layer_t *L, float *h, int n, const float *cos, const float *sin, const int64_t *slots,
                 int width, const float *mask, float *scratch, int threads) {
    return layer_forward(L, NULL, h, n, cos, sin, slots, width, mask, scratch, threads);
}

/* A stack of layers over h [n, H] in one call (each as smallm_layer, all on the same rows, rotary, slots, window and
   mask; scratch sized for the largest). keep: NULL, or per layer NULL or [n, H] floats that receive the layer's
   input (a model's hidden states that drafters read). Returns -1, having changed nothing, if any layer does not fit. */
int smallm_layers(const layer_t *const *layers, int count, float *h, int n, const float *cos, const float *sin,
                  const int64_t *slots, int width, const float *mask, float *scratch, int threads,
                  float *const *keep) {
    for (int i = 0; i < count; i++)
        if (!fits(layers[i], width) || layers[i]->hidden != layers[0]->hidden) return -1;
    for (int i = 0; i < count; i++) {
        if (keep && keep[i]) __builtin_memcpy(keep[i], h, sizeof(float) * (size_t)n * layers[i]->hidden);
        layer_forward(layers[i], i + 1 < count ? layers[i + 1] : NULL, h, n, cos, sin, slots, width, mask, scratch,
                      threads);
    }
    return 0;
}

/* smallm_layers, then the model's final RMSNorm (weight norm [H], eps) over h in place: a forward's last op in the
   same call. Run as a PyTorch op after the layers, the norm pays for its code and data coming back into the caches
   after the layers' weights evicted them, several times what it costs with them warm. */
int smallm_layers_normed(const layer_t *const *layers, int count, float *h, int n, const float *cos, const float *sin,
                         const int64_t *slots, int width, const float *mask, float *scratch, int threads,
                         float *const *keep, const float *norm, float eps) {
    const int done = smallm_layers(layers, count, h, n, cos, sin, slots, width, mask, scratch, threads, keep);
    if (done == 0) rms_norm(h, norm, h, n, layers[0]->hidden, eps);
    return done;
}

/* out [n, H] = RMSNorm(x [n, H]) · w (F.rms_norm's formula; out may be x): a drafter's standalone norm as one call. On
   the CPU F.rms_norm runs as ~10 small ops (pow, mean, rsqrt, ...), each paying for its code and data coming back into
   the caches after the base's forward evicted them. */
void smallm_rms_norm(const float *x, const float *w, float *out, int n, int H, float eps) {
    rms_norm(x, w, out, n, H, eps);
}
