/* One Llama-style decoder layer for a batch of one row, in native code: what specdec/sampling/lean.py's LeanLayer
computes, in one call instead of ~15 PyTorch ops.

On a 2-core CPU an AR step of SmolLM2-135M spends ~16 of its ~40 ms outside the products: each of the ~15 ops a lean
layer dispatches per token costs microseconds of framework overhead, 30 layers times over. Here the layer is one
ctypes call: RMSNorm, the fused q|k|v product, rotary on q and k, the keys and values written into the slot cache,
attention over the cache window (with the caller's additive mask, or none), the output product and residual, RMSNorm,
the fused gate|up product, SiLU·up, the down product and residual. The four products are smallm.c's packed kernels,
each over its weight in the form the caller chose: float32, bfloat16 (a drafter's rounded copy under
draft_precision=bf16, or a weight that holds bfloat16 values exactly), or an exact compact form (compact.py's q4 / q8:
the same float32 numbers from about a fifth or a quarter of the bytes); everything else vectorised here; smallm_layers
runs a model's whole stack in one call.
(make bench, 2-core Intel Xeon family 6 model 167: a pass through SmolLM2's 30 layers 14.9 ms at one token against
25.3 ms for the lean layers with their measured kernels, and 24.4 against 46.1 ms at 12 tokens; from SmolLM2's exact
compact forms, 5.2 ms at one token and 12.7 at 12, twenty-fourth session.) Numbers: the same math as the lean layer in
float32, summed in another order (native.py checks every layer against the lean one before it is used, and measurement
decides whether it is used at all: see native_layer.py).

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

enum { QKV, OUT, GATE_UP, DOWN };   /* a layer's products, in the order it runs them */
enum { F32, BF16, Q4, Q8 };         /* the form a product's weight is held in (native_layer.FORMATS) */

/* A layer's fixed parts: pointers into tensors the Python side keeps alive (native_layer.NativeLayer). */
typedef struct {
    const float *norm1, *norm2;                  /* [H] RMSNorm weights */
    const void *weights[4];                      /* the products' weights (QKV..DOWN) in smallm.c's packed layouts */
    float *keys, *values;                        /* this layer's slot cache, [kv_heads, max_len, d] each */
    int hidden, heads, kv_heads, head_dim, intermediate, max_len;
    float eps, scaling;
    int formats[4];                              /* each weight's form: F32, BF16, Q4 or Q8 */
} layer_t;

/* y [M, O] = x [M, I] · wᵀ for the layer's product `which`, by the kernel of its weight's form */
static void product(const layer_t *L, int which, const float *x, float *y, int M, int I, int O, int threads) {
    const void *w = L->weights[which];
    switch (L->formats[which]) {
    case BF16: smallm_packed_bf16(x, (const uint16_t *)w, y, M, I, O, threads); break;
    case Q4: smallm_packed_q4(x, w, y, M, I, O, threads); break;
    case Q8: smallm_packed_q8(x, w, y, M, I, O, threads); break;
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

/* the lanes' sum: one shuffle-and-add tree in registers where the CPU has the vectors. The generic loop went through
   the stack, each attention score waiting on a chain of 15 dependent adds: outside its products, a pass of SmolLM2's
   30 layers over 9 tokens took 3.8 ms with it, 2.4 ms with this and the vector max in `attend` (products 7.5-7.8 ms;
   2-core Xeon, twenty-fifth session) */
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

/* o [d] = softmax(q·Kᵀ·scaling + mask) · V over the window's `width` slots; scores: `width` floats of scratch */
static inline __attribute__((always_inline)) void attend(const float *q, const float *K, const float *V,
                                                         const float *mask, float *scores, float *o, int width, int d,
                                                         float scaling) {
    for (int w = 0; w < width; w++) {
        const float *k = K + (size_t)w * d;
        fvec acc = {0};
        for (int j = 0; j < d; j += PLANES) acc += vload(q + j) * vload(k + j);
        scores[w] = vsum(acc) * scaling + (mask ? mask[w] : 0.f);
    }
    /* the largest score, PLANES at a time (a running scalar max made every score wait on the one before) */
    fvec most = splat(-3.4e38f);
    int w = 0;
    for (; w + PLANES <= width; w += PLANES) {
        const fvec v = vload(scores + w);
        most = blend(v > most, v, most);
    }
    float top = -3.4e38f;
    for (int l = 0; l < PLANES; l++) top = most[l] > top ? most[l] : top;
    for (; w < width; w++) top = scores[w] > top ? scores[w] : top;
    fvec total = {0};
    w = 0;
    for (; w + PLANES <= width; w += PLANES) {
        const fvec e = vexp(vload(scores + w) - top);
        vstore(scores + w, e);
        total += e;
    }
    float sum = vsum(total);
    for (; w < width; w++) {
        scores[w] = vexp_scalar(scores[w] - top);
        sum += scores[w];
    }
    fvec acc[16] = {{0}};                                       /* d ≤ 16·PLANES */
    const int parts = d / PLANES;
    for (w = 0; w < width; w++) {
        const float *v = V + (size_t)w * d;
        const float p = scores[w];
        for (int j = 0; j < parts; j++) acc[j] += vload(v + j * PLANES) * p;
    }
    const float inv = 1.0f / sum;
    for (int j = 0; j < parts; j++) vstore(o + j * PLANES, acc[j] * inv);
}

/* The attention of up to PLANES queries of one kv head at once, lane l for the l-th of them (q[l], or NULL past the
   last), over the window's `width` keys. `attend`, called per (head, row), spends most of its time summing each score's
   lanes (a shuffle chain per key) and reads the keys once per query; here the queries are transposed, qt [d, PLANES],
   so that one key's scores for all of them are one vector, st[w] = Σ_j K[w, j]·qt[j] (8 keys in flight to hide the FMA
   latency), the softmax runs lane-wise down the keys, and each value row serves QV queries at a time. masks[l]: lane
   l's additive mask row or NULL (no mask at all: masks NULL), whose entries are 0 before masked_from (the prompt's
   keys, which every row sees: only the last few keys are looked up per lane). out[l]: where lane l's [d] output goes
   (NULL past the last query). qt: d·PLANES, st: width·PLANES floats of scratch. On the 2-core Xeon (family 6 model
   167), 9 heads over 3 kv heads of 64, 170 keys, a layer's attention over 1 / 2 / 5 / 9 rows took 7.1 / 13.9 / 33 / 56
   µs with `attend` per (head, row), 10.6 / 12.3 / 15.6 / 22.9 this way (thirtieth session, one process). In a forward,
   where the keys and values come from memory, it gained at 9 rows (see `attention`). */
#define QV (PLANES == 16 ? 4 : 2) /* queries per pass over the values: QV·d/PLANES accumulators in registers */
static inline __attribute__((always_inline)) void attend_lanes(const float *const *q, const float *const *masks,
                                                               int masked_from, const float *K, const float *V,
                                                               float *qt, float *st, float *const *out, int width,
                                                               int d, float scaling) {
    for (int j = 0; j < d; j++)
        for (int l = 0; l < PLANES; l++) qt[(size_t)j * PLANES + l] = q[l] ? q[l][j] : 0.f;
    int w = 0;
    for (; w + 8 <= width; w += 8) {
        fvec a[8] = {{0}};
        for (int j = 0; j < d; j++) {
            const fvec qv = vload(qt + (size_t)j * PLANES);
            for (int k = 0; k < 8; k++) a[k] += qv * K[(size_t)(w + k) * d + j];
        }
        for (int k = 0; k < 8; k++) vstore(st + (size_t)(w + k) * PLANES, a[k] * scaling);
    }
    for (; w < width; w++) {
        fvec a = {0};
        for (int j = 0; j < d; j++) a += vload(qt + (size_t)j * PLANES) * K[(size_t)w * d + j];
        vstore(st + (size_t)w * PLANES, a * scaling);
    }
    if (masks)
        for (w = masked_from; w < width; w++)
            for (int l = 0; l < PLANES; l++)
                if (masks[l]) st[(size_t)w * PLANES + l] += masks[l][w];
    fvec most = splat(-3.4e38f), total = {0};
    for (w = 0; w < width; w++) {
        const fvec v = vload(st + (size_t)w * PLANES);
        most = blend(v > most, v, most);
    }
    for (w = 0; w < width; w++) {
        const fvec e = vexp(vload(st + (size_t)w * PLANES) - most);
        vstore(st + (size_t)w * PLANES, e);
        total += e;
    }
    const int parts = d / PLANES;
    for (int l0 = 0; l0 < PLANES && q[l0]; l0 += QV) {
        fvec acc[QV][16] = {{{0}}}; /* d ≤ 16·PLANES */
        for (w = 0; w < width; w++) {
            const float *v = V + (size_t)w * d, *p = st + (size_t)w * PLANES + l0;
            for (int c = 0; c < parts; c++) {
                const fvec vc = vload(v + c * PLANES);
                for (int k = 0; k < QV; k++) acc[k][c] += vc * p[k];
            }
        }
        for (int k = 0; k < QV && l0 + k < PLANES && out[l0 + k]; k++)
            for (int c = 0; c < parts; c++) vstore(out[l0 + k] + c * PLANES, acc[k][c] * (1.0f / total[l0 + k]));
    }
}

/* the first key where any of the n mask rows [width] is not 0 (width where none is) */
static int masked_from(const float *mask, int n, int width) {
    int first = width;
    for (int r = 0; r < n; r++)
        for (int w = 0; w < first; w++)
            if (mask[(size_t)r * width + w] != 0.f) {
                first = w;
                break;
            }
    return first;
}

/* floats of scratch `smallm_layer` needs for n rows over a window of `width` slots on `threads` threads */
long smallm_layer_scratch(const layer_t *L, int n, int width, int threads) {
    const long qkv = (long)(L->heads + 2 * L->kv_heads) * L->head_dim;
    const long wide = qkv > 2L * L->intermediate ? qkv : 2L * L->intermediate;
    return (long)n * (2L * L->hidden + wide + (long)L->heads * L->head_dim + L->intermediate)
           + (long)threads * (width + (L->head_dim + width) * PLANES); /* attend's scores, attend_lanes' qt and st */
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
   mask [n, width] additive or NULL; scratch: smallm_layer_scratch's attention part, `scores` on */
static void attention(const layer_t *L, const float *wide, int qkv_width, const float *mask, float *att, int n,
                      int width, float *scores, int threads) {
    const int d = L->head_dim, heads = L->heads, kv = L->kv_heads;
    const int group = heads / kv, nq = n * group; /* a kv head's queries: (row, head of its group) in that order */
    const int blocks = (nq + PLANES - 1) / PLANES;
    /* attend_lanes where every thread gets two of its tasks or more: a task per kv head and PLANES queries, each
       reading its keys and values once. With fewer tasks than that (SmolLM2, 3 kv heads: under 6 rows), one thread
       does twice the other's and the forward lost or gained nothing over `attend` (ab_native.py --forward on the
       2-core Xeon, HEAD / this: 0.96 at 3 rows, 0.99-1.01 at 5 and 6, 1.02-1.05 at 9) */
    if (n > 1 && kv * blocks >= 2 * threads) {
        const int from = mask ? masked_from(mask, n, width) : width;
        float *lanes = scores + (size_t)threads * width; /* per thread: qt, st */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int task = 0; task < kv * blocks; task++) {
            const int t = thread_num();
            const int g = task / blocks, b = task % blocks;
            const float *qs[PLANES], *ms[PLANES];
            float *outs[PLANES];
            for (int l = 0; l < PLANES; l++) {
                const int i = b * PLANES + l, r = i / group, hd = g * group + i % group;
                qs[l] = i < nq ? wide + (size_t)r * qkv_width + (size_t)hd * d : NULL;
                ms[l] = i < nq && mask ? mask + (size_t)r * width : NULL;
                outs[l] = i < nq ? att + (size_t)r * heads * d + (size_t)hd * d : NULL;
            }
            const float *K = L->keys + (size_t)g * L->max_len * d, *V = L->values + (size_t)g * L->max_len * d;
            float *qt = lanes + (size_t)t * (d + width) * PLANES, *st = qt + (size_t)d * PLANES;
            if (d == 64)
                attend_lanes(qs, mask ? ms : NULL, from, K, V, qt, st, outs, width, 64, L->scaling);
            else
                attend_lanes(qs, mask ? ms : NULL, from, K, V, qt, st, outs, width, d, L->scaling);
        }
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int task = 0; task < heads * n; task++) {
            const int t = thread_num();
            const int hd = task / n, r = task % n, g = hd / group;
            const float *q = wide + (size_t)r * qkv_width + (size_t)hd * d;
            const float *K = L->keys + (size_t)g * L->max_len * d, *V = L->values + (size_t)g * L->max_len * d;
            const float *m = mask ? mask + (size_t)r * width : NULL;
            float *o = att + (size_t)r * heads * d + (size_t)hd * d, *sc = scores + (size_t)t * width;
            if (d == 64)  /* the common head size as a constant: its loops unroll */
                attend(q, K, V, m, sc, o, width, 64, L->scaling);
            else
                attend(q, K, V, m, sc, o, width, d, L->scaling);
        }
    }
}

/* The layer over h [n, H] in place (batch of one). cos, sin [n, d]: lean_rope's tables at the rows' positions;
   slots [n]: where each row's key and value go in the cache; width: keys attended, slots [0, width); mask [n, width]
   additive, or NULL when every row sees the whole window; scratch: smallm_layer_scratch(...) floats. Returns 0, or -1
   for a shape it does not handle (the caller then runs the lean layer). */
/* whether smallm_layer computes L over a window of `width` slots */
static int fits(const layer_t *L, int width) {
    const int d = L->head_dim;
    return !(d % PLANES || d > 16 * PLANES || d > 512 || L->heads % L->kv_heads || width > L->max_len);
}

int smallm_layer(const layer_t *L, float *h, int n, const float *cos, const float *sin, const int64_t *slots,
                 int width, const float *mask, float *scratch, int threads) {
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
    product(L, OUT, att, y, n, heads * d, H, threads);
    for (size_t i = 0; i < (size_t)n * H; i++) h[i] += y[i];

    rms_norm(h, L->norm2, x, n, H, L->eps);
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
    product(L, DOWN, act, y, n, inter, H, threads);
    for (size_t i = 0; i < (size_t)n * H; i++) h[i] += y[i];
    return 0;
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
        smallm_layer(layers[i], h, n, cos, sin, slots, width, mask, scratch, threads);
    }
    return 0;
}

/* smallm_layers, then the model's final RMSNorm (weight norm [H], eps) over h in place: a forward's last op in the
   same call. Run as a PyTorch op after the layers, the norm took 90-120 µs on the 2-core Xeon (family 6 model 167),
   its code and data evicted from the caches by the layers' weights, against ~19 µs for a second call. */
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
