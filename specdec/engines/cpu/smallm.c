/* y = x·Wᵀ for a few rows x [M, I] and a weight W [O, I], both row-major float32: the product of a decode step.

BLAS kernels are tuned for large M; at M = 1..16 some of them read the weight more than once or leave the cores
idle (see kernels.py). Here each thread streams its own contiguous block of W's rows exactly once and, per weight
row, keeps the M dot products in registers while the x rows (M·I floats) stay in L1/L2: for the M of a verify block
the product costs little more than reading W once. Rows beyond BLOCK are done BLOCK at a time.

smallm_packed does the same product from W packed in blocks of PACK output rows laid out column by column
([ceil(O/PACK), I, PACK], zero-padded; smallm_pack_rows() tells PACK): per input column it loads PACK weights (two
vectors) once, broadcasts each x row's value and adds into 2·M vector accumulators, so there are no horizontal sums,
one pass over W per thread (read as STREAMS concurrent runs, see PACKED_BLOCK), and every weight load serves all M
rows. The row-major kernel above turns compute-bound from M = 3 on; this one stays near the cost of reading W once
up to 12 rows (experiments/bench_native.py times both over a model's products). The layout is a second copy of the
weight, made once per weight by kernels.py where measurement picks this kernel; smallm_packed_bf16 reads a bfloat16
copy (see below).

smallm_gemm_bf16 is the same product with W stored as bfloat16 (the upper half of each float32: widening is a shift),
x and the sums in float32: half the bytes to stream, for a drafter's weights, where a rounded weight changes only what
is drafted, never what is accepted (the base's own products always use the exact kernel).

Built at first use with the machine's own compiler for its own CPU (-march=native; see native.py), called through
ctypes. Plain C with GCC/Clang vector extensions, so one source serves AVX2, AVX-512 and NEON alike. */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#define LANES 8   /* floats per vector: 256 bits (two NEON / one AVX2 register, half an AVX-512 one) */
#define BLOCK 12  /* x rows kept in registers per pass over W */

/* The packed kernel's vectors: 512 bits where the CPU has AVX-512 (32 registers: 2·12 accumulators fit), else 256 */
#if defined(__AVX512F__)
#define PLANES 16
#define PBLOCK 12
#else
#define PLANES 8
#define PBLOCK 6 /* 2·6 accumulators + 2 weight vectors + 1 broadcast within 16 registers */
#endif
#define PACK (2 * PLANES) /* output rows per packed block */
#define STREAMS 4 /* concurrent column runs per packed block (see PACKED_BLOCK) */

/* A vector type of N floats with its loads: V (float32), from float32 (unaligned) and from bfloat16 (each 16-bit
   pattern becomes the top half of a 32-bit one). vec: the row-major kernel's LANES; pvec: the packed kernel's PLANES. */
#define VECTOR(V, N, LOAD, LOAD_BF16) \
    typedef float V __attribute__((vector_size(N * sizeof(float)))); \
    typedef uint32_t V##_wide __attribute__((vector_size(N * sizeof(uint32_t)))); \
    typedef uint16_t V##_half __attribute__((vector_size(N * sizeof(uint16_t)))); \
    static inline V LOAD(const float *p) { \
        V v; \
        __builtin_memcpy(&v, p, sizeof v); \
        return v; \
    } \
    static inline V LOAD_BF16(const uint16_t *p) { \
        V##_half h; \
        __builtin_memcpy(&h, p, sizeof h); \
        const V##_wide u = __builtin_convertvector(h, V##_wide) << 16; \
        V v; \
        __builtin_memcpy(&v, &u, sizeof v); \
        return v; \
    }
VECTOR(vec, LANES, load, load_bf16)
VECTOR(pvec, PLANES, pload, pload_bf16)

static inline float bf16_to_float(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}

/* an IEEE float16 bit pattern's value (exact in float32) */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, mant = h & 1023;
    float f;
    if (e == 0) { /* zero or subnormal: mant · 2^-24 */
        f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    const uint32_t u = sign | (e == 31 ? 0x7f800000u | (mant << 13) : ((e + 112) << 23) | (mant << 13));
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}

static inline float hsum(vec v) {
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += v[l];
    return s;
}

/* y[m, o] for m < mb over weight rows [o0, o1): per weight row, mb·split independent accumulators (mb, split:
   compile-time constants after inlining). A single x row splits its sum over several accumulators, so that enough
   FMA chains run at once to hide the FMA latency. The last I % (split·LANES) columns: vectors, then scalars.
   Written once per weight type T (float, or uint16_t holding bfloat16) with its vector and scalar loads. */
#define ROWS_BLOCK(NAME, T, WLOAD, WSCALAR) \
    static inline void NAME(const float *x, const T *w, float *y, const int mb, const int split, int I, int O, \
                            int o0, int o1) { \
        const int step = split * LANES, i_split = I - I % step, i_vec = I - I % LANES; \
        for (int o = o0; o < o1; o++) { \
            const T *wr = w + (size_t)o * I; \
            vec acc[4][BLOCK]; \
            for (int k = 0; k < split; k++) \
                for (int m = 0; m < mb; m++) acc[k][m] = (vec){0}; \
            for (int i = 0; i < i_split; i += step) \
                for (int k = 0; k < split; k++) { \
                    const vec wv = WLOAD(wr + i + k * LANES); \
                    for (int m = 0; m < mb; m++) acc[k][m] += wv * load(x + (size_t)m * I + i + k * LANES); \
                } \
            for (int i = i_split; i < i_vec; i += LANES) { \
                const vec wv = WLOAD(wr + i); \
                for (int m = 0; m < mb; m++) acc[0][m] += wv * load(x + (size_t)m * I + i); \
            } \
            for (int m = 0; m < mb; m++) { \
                for (int k = 1; k < split; k++) acc[0][m] += acc[k][m]; \
                float s = hsum(acc[0][m]); \
                for (int i = i_vec; i < I; i++) s += WSCALAR(wr[i]) * x[(size_t)m * I + i]; \
                y[(size_t)m * O + o] = s; \
            } \
        } \
    }
#define AS_FLOAT(v) (v)
ROWS_BLOCK(rows_block, float, load, AS_FLOAT)
ROWS_BLOCK(rows_block_bf16, uint16_t, load_bf16, bf16_to_float)

/* one specialisation per block height, so that each keeps its mb·split accumulators, the weight vector and an x
   vector in registers (at most 14 of AVX2's 16) */
#define SPECIALISE(MB, SPLIT) \
    static void block_##MB(const float *x, const void *w, float *y, int I, int O, int o0, int o1) { \
        rows_block(x, (const float *)w, y, MB, SPLIT, I, O, o0, o1); \
    } \
    static void block_bf16_##MB(const float *x, const void *w, float *y, int I, int O, int o0, int o1) { \
        rows_block_bf16(x, (const uint16_t *)w, y, MB, SPLIT, I, O, o0, o1); \
    }
SPECIALISE(1, 2) SPECIALISE(2, 2) SPECIALISE(3, 2) SPECIALISE(4, 2) SPECIALISE(5, 2) SPECIALISE(6, 2)
SPECIALISE(7, 1) SPECIALISE(8, 1) SPECIALISE(9, 1) SPECIALISE(10, 1) SPECIALISE(11, 1) SPECIALISE(12, 1)

typedef void (*block_fn)(const float *, const void *, float *, int, int, int, int);
static const block_fn BLOCKS[BLOCK + 1] = {0, block_1, block_2, block_3, block_4, block_5, block_6, block_7, block_8,
                                           block_9, block_10, block_11, block_12};
static const block_fn BLOCKS_BF16[BLOCK + 1] = {0, block_bf16_1, block_bf16_2, block_bf16_3, block_bf16_4,
                                                block_bf16_5, block_bf16_6, block_bf16_7, block_bf16_8, block_bf16_9,
                                                block_bf16_10, block_bf16_11, block_bf16_12};

/* y[m, o] for m < MB over packed blocks [b0, b1) of wp [ceil(O/PACK), I, PACK] (element type T): per block, MB x rows
times PACK outputs in 2·MB accumulators; x[m, i] is broadcast against the block's column i. MB is a compile-time
constant (one function per height), so the accumulators stay in registers. The block's columns are read as STREAMS
runs at once (columns i, i + I/S, i + 2I/S, ...: S sequential streams, each in its own pages, into the same
accumulators): one core following one stream keeps too few cache misses in flight to reach its share of the
bandwidth, and several streams give the prefetcher more to fetch at once. */
#define PACKED_COLUMN(PLOAD, MB, c) \
    do { \
        const pvec w0 = PLOAD(wb + (size_t)(c) * PACK), w1 = PLOAD(wb + (size_t)(c) * PACK + PLANES); \
        for (int m = 0; m < (MB); m++) { \
            const float xv = x[(size_t)m * I + (c)]; \
            lo[m] += w0 * xv; \
            hi[m] += w1 * xv; \
        } \
    } while (0)
#define PACKED_BLOCK(NAME, T, PLOAD, MB) \
    static void NAME(const float *x, const void *wp, float *y, int I, int O, int b0, int b1) { \
        const int q = I / STREAMS; \
        for (int b = b0; b < b1; b++) { \
            const T *wb = (const T *)wp + (size_t)b * I * PACK; \
            pvec lo[MB], hi[MB]; \
            for (int m = 0; m < (MB); m++) lo[m] = hi[m] = (pvec){0}; \
            for (int i = 0; i < q; i++) \
                for (int s = 0; s < STREAMS; s++) PACKED_COLUMN(PLOAD, MB, i + s * q); \
            for (int c = q * STREAMS; c < I; c++) PACKED_COLUMN(PLOAD, MB, c); /* the last I % STREAMS columns */ \
            const int o = b * PACK, n = O - o < PACK ? O - o : PACK; \
            for (int m = 0; m < (MB); m++) { \
                float *ym = y + (size_t)m * O + o; \
                if (n == PACK) { \
                    __builtin_memcpy(ym, &lo[m], sizeof lo[m]); \
                    __builtin_memcpy(ym + PLANES, &hi[m], sizeof hi[m]); \
                } else { \
                    for (int k = 0; k < n; k++) ym[k] = k < PLANES ? lo[m][k] : hi[m][k - PLANES]; \
                } \
            } \
        } \
    }
#define PACKED_HEIGHTS(P, T, PLOAD) \
    PACKED_BLOCK(P##1, T, PLOAD, 1) PACKED_BLOCK(P##2, T, PLOAD, 2) PACKED_BLOCK(P##3, T, PLOAD, 3) \
    PACKED_BLOCK(P##4, T, PLOAD, 4) PACKED_BLOCK(P##5, T, PLOAD, 5) PACKED_BLOCK(P##6, T, PLOAD, 6) \
    PACKED_BLOCK(P##7, T, PLOAD, 7) PACKED_BLOCK(P##8, T, PLOAD, 8) PACKED_BLOCK(P##9, T, PLOAD, 9) \
    PACKED_BLOCK(P##10, T, PLOAD, 10) PACKED_BLOCK(P##11, T, PLOAD, 11) PACKED_BLOCK(P##12, T, PLOAD, 12)
PACKED_HEIGHTS(packed_, float, pload)
PACKED_HEIGHTS(packed_bf16_, uint16_t, pload_bf16)
static const block_fn PACKED[BLOCK + 1] = {0, packed_1, packed_2, packed_3, packed_4, packed_5, packed_6, packed_7,
                                           packed_8, packed_9, packed_10, packed_11, packed_12};
static const block_fn PACKED_BF16[BLOCK + 1] = {0, packed_bf16_1, packed_bf16_2, packed_bf16_3, packed_bf16_4,
                                                packed_bf16_5, packed_bf16_6, packed_bf16_7, packed_bf16_8,
                                                packed_bf16_9, packed_bf16_10, packed_bf16_11, packed_bf16_12};

/* The compact layouts of compact.py: per packed block of PACK rows and per group of QGROUP columns, the rows' scales d
(and for q4 offsets m) as float16, then the group's columns of 4-bit (q4: PLANES bytes, row k's q in byte k's low
nibble and row k + PLANES's in its high one) or 8-bit (q8: PACK signed bytes) codes. Each weight is decoded in
registers to the float32 number the model holds: q4 fma(d, q, m), which is the one rounding of d·q + m (d·q is exact),
q8 d·q (exact); then the same broadcast-and-accumulate as the packed kernel. About a quarter (q8) to a sixth (q4) of
the float32 bytes to stream, paid for with a few vector ops per column, shared by all the block's x rows.
The scales are float16 because llama.cpp's are (an exact form's d and m are float16 numbers: compact.py) and a
decode step at one row streams the weights' bytes: float32 scales would add about a sixth to a step's bytes
(SmolLM2's products: 111 MB a step against 96) for the same numbers. */
#define QGROUP 32
/* Each group's codes are asked for this many bytes ahead (into every cache level: prefetcht0, which serves the decode
   better than a prefetch that skips the near caches): the hardware prefetcher alone leaves the decode waiting on
   memory. A prefetch past the weight's end is harmless (it never faults). How far ahead pays differs by CPU and by
   rows, so the distance is per block height (x rows a pass), measured per machine through a base's stack of native
   layers (native_layer.tune_prefetch) and set with smallm_set_prefetch; QPREFETCH until then
   (experiments/ab_native.py --forward --prefetch compares distances). */
#define QPREFETCH 4096
static int qprefetch[13] = {QPREFETCH, QPREFETCH, QPREFETCH, QPREFETCH, QPREFETCH, QPREFETCH, QPREFETCH,
                            QPREFETCH, QPREFETCH, QPREFETCH, QPREFETCH, QPREFETCH, QPREFETCH};
typedef uint8_t pvec_u8 __attribute__((vector_size(PLANES)));
typedef int8_t pvec_s8 __attribute__((vector_size(PLANES)));
typedef int32_t pvec_i32 __attribute__((vector_size(PLANES * sizeof(int32_t))));

/* PLANES bytes at p widened to PLANES int32 lanes, sign-extended where is_signed (a constant at every call, so the
   choice folds away): one instruction where the CPU has it (GCC scalarises the generic __builtin_convertvector of
   bytes), the generic form elsewhere */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
static inline pvec_i32 widen(const uint8_t *p, const int is_signed) {
#if defined(__AVX512F__)
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m512i v = is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
#elif defined(__AVX2__)
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    const __m256i v = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
#else
    pvec_u8 u;
    pvec_s8 s;
    __builtin_memcpy(&u, p, sizeof u);
    __builtin_memcpy(&s, p, sizeof s);
    const pvec_i32 v = is_signed ? __builtin_convertvector(s, pvec_i32) : __builtin_convertvector(u, pvec_i32);
#endif
    pvec_i32 r;
    __builtin_memcpy(&r, &v, sizeof r);
    return r;
}

#if defined(__AVX512F__)
#define QBLOCK 12 /* 2·12 accumulators + 4 scale vectors + the decoded weights: 32 registers (x is a memory operand);
                     12 rather than 8, so that one decode of each weight serves a whole 9-12 token verify */
#else
#define QBLOCK 4 /* 2·4 accumulators + 4 scale vectors + the decoded weights within AVX2's 16 registers */
#endif

static inline void store_rows(float *y, const pvec *lo, const pvec *hi, int mb, int O, int o) {
    const int n = O - o < PACK ? O - o : PACK;
    for (int m = 0; m < mb; m++) {
        float *ym = y + (size_t)m * O + o;
        if (n == PACK) {
            __builtin_memcpy(ym, &lo[m], sizeof lo[m]);
            __builtin_memcpy(ym + PLANES, &hi[m], sizeof hi[m]);
        } else {
            for (int k = 0; k < n; k++) ym[k] = k < PLANES ? lo[m][k] : hi[m][k - PLANES];
        }
    }
}

#define Q4_GROUP_BYTES (2 * PACK * sizeof(uint16_t) + QGROUP * PLANES)
#define Q8_GROUP_BYTES (PACK * sizeof(uint16_t) + QGROUP * PACK)

/* PLANES float16 scales at p, widened (exactly) to float32: one instruction where the CPU has it */
static inline pvec pload_half(const uint16_t *p) {
#if defined(__AVX512F__)
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__) && defined(__F16C__)
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    pvec v;
    for (int l = 0; l < PLANES; l++) v[l] = half_to_float(p[l]);
#endif
    pvec r;
    __builtin_memcpy(&r, &v, sizeof r);
    return r;
}

/* group g of packed block b in a q4 / q8 layout of `groups` groups a block, its bytes `ahead` bytes ahead asked for */
static inline const uint8_t *q_group(const void *wp, int b, int g, int groups, size_t group_bytes, int ahead) {
    const uint8_t *grp = (const uint8_t *)wp + ((size_t)b * groups + g) * group_bytes;
    for (size_t line = 0; line < group_bytes; line += 64) __builtin_prefetch(grp + ahead + line, 0, 3);
    return grp;
}

/* the prefetch distance for blocks of `rows` x rows (0: all heights) set to `bytes` (clamped to 0..64 KB); returns
   the distance now at `rows` (or at 1) */
int smallm_set_prefetch(int rows, int bytes) {
    bytes = bytes < 0 ? 0 : bytes > 65536 ? 65536 : bytes;
    for (int m = 1; m <= 12; m++)
        if (rows == 0 || rows == m) qprefetch[m] = bytes;
    return qprefetch[rows >= 1 && rows <= 12 ? rows : 1];
}
int smallm_prefetch(int rows) { return qprefetch[rows >= 1 && rows <= 12 ? rows : 1]; }

#define Q_BLOCK(NAME, MB, Q4) \
    static void NAME(const float *x, const void *wp, float *y, int I, int O, int b0, int b1) { \
        const int groups = I / QGROUP; \
        const size_t group_bytes = (Q4) ? Q4_GROUP_BYTES : Q8_GROUP_BYTES; \
        const int ahead = qprefetch[MB]; \
        for (int b = b0; b < b1; b++) { \
            pvec lo[MB], hi[MB]; \
            for (int m = 0; m < (MB); m++) lo[m] = hi[m] = (pvec){0}; \
            for (int g = 0; g < groups; g++) { \
                const uint8_t *grp = q_group(wp, b, g, groups, group_bytes, ahead); \
                const uint16_t *scales = (const uint16_t *)grp; \
                const pvec d0 = pload_half(scales), d1 = pload_half(scales + PLANES); \
                const pvec m0 = (Q4) ? pload_half(scales + PACK) : (pvec){0}; \
                const pvec m1 = (Q4) ? pload_half(scales + PACK + PLANES) : (pvec){0}; \
                const uint8_t *codes = grp + ((Q4) ? 2 : 1) * PACK * sizeof(uint16_t); \
                const float *xg = x + (size_t)g * QGROUP; \
                for (int c = 0; c < QGROUP; c++) { \
                    pvec w0, w1; \
                    if (Q4) { \
                        const pvec_i32 v = widen(codes + (size_t)c * PLANES, 0); \
                        w0 = d0 * __builtin_convertvector(v & 15, pvec) + m0; \
                        w1 = d1 * __builtin_convertvector(v >> 4, pvec) + m1; \
                    } else { \
                        w0 = d0 * __builtin_convertvector(widen(codes + (size_t)c * PACK, 1), pvec); \
                        w1 = d1 * __builtin_convertvector(widen(codes + (size_t)c * PACK + PLANES, 1), pvec); \
                    } \
                    for (int m = 0; m < (MB); m++) { \
                        const float xv = xg[(size_t)m * I + c]; \
                        lo[m] += w0 * xv; \
                        hi[m] += w1 * xv; \
                    } \
                } \
            } \
            store_rows(y, lo, hi, MB, O, b * PACK); \
        } \
    }
#define Q_HEIGHTS(P, Q4) \
    Q_BLOCK(P##1, 1, Q4) Q_BLOCK(P##2, 2, Q4) Q_BLOCK(P##3, 3, Q4) Q_BLOCK(P##4, 4, Q4) \
    Q_BLOCK(P##5, 5, Q4) Q_BLOCK(P##6, 6, Q4) Q_BLOCK(P##7, 7, Q4) Q_BLOCK(P##8, 8, Q4) \
    Q_BLOCK(P##9, 9, Q4) Q_BLOCK(P##10, 10, Q4) Q_BLOCK(P##11, 11, Q4) Q_BLOCK(P##12, 12, Q4)
Q_HEIGHTS(q4_, 1)
Q_HEIGHTS(q8_, 0)
static const block_fn Q4[13] = {0, q4_1, q4_2, q4_3, q4_4, q4_5, q4_6, q4_7, q4_8, q4_9, q4_10, q4_11, q4_12};

#if defined(__AVX512F__)
/* The same products at a few rows, reassociated: per group g of 32 columns c, d·(Σ_c q·x) (+ m·(Σ_c x) for q4) instead
   of Σ_c (d·q + m)·x. A column then costs only its codes' decode into float32 numbers (q4: one widen, one shift and two
   permutes from the table 0..15; q8: two widens, two converts) and the rows' FMAs; the scales are applied once a group,
   to per-group sums held in 2·MB more accumulators (up to 6 rows in AVX-512's 32 registers). That is 4 + 2·MB vector
   ops a column instead of 7 + 2·MB (q4) or 6 + 2·MB (q8). Still the weights' exact numbers, only the float32 sums in
   another order (a q4 weight is no longer rounded to float32 on its own; against float64, the sums' largest error
   relative to Σ|x·w| was no larger). With up to six rows, two sets of partial sums (even and odd columns) keep 8-24
   FMA chains in flight instead of 4-12: a core with two FMA pipes needs about 8 independent chains to keep both busy,
   more than one set gives at the fewest rows.
   Past 6 rows the totals no longer fit in registers beside the partial sums; the compiler then keeps some in memory,
   touched once a group. Whether the decode ops these blocks save still outweigh the totals' trips to memory differs
   by CPU, by a few per cent either way, so which serves more than 6 rows is measured where the library loads
   (smallm_calibrate). */
#define QS_HEIGHT 12
#define QS_SAFE 6 /* the rows the reassociated blocks always serve (their totals in registers) */
#define QS_SPLIT(MB) ((MB) <= 6 ? 2 : 1)
#define QS_BLOCK(NAME, MB, Q4) \
    static void NAME(const float *x, const void *wp, float *y, int I, int O, int b0, int b1) { \
        const int groups = I / QGROUP; \
        const size_t group_bytes = (Q4) ? Q4_GROUP_BYTES : Q8_GROUP_BYTES; \
        const int ahead = qprefetch[MB]; \
        float sx[(MB) * groups]; /* q4: Σ x over each row's groups */ \
        for (int m = 0; (Q4) && m < (MB); m++) \
            for (int g = 0; g < groups; g++) { \
                const float *xg = x + (size_t)m * I + (size_t)g * QGROUP; \
                const pvec s = pload(xg) + pload(xg + PLANES); \
                float t = 0.f; \
                for (int l = 0; l < PLANES; l++) t += s[l]; \
                sx[m * groups + g] = t; \
            } \
        const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); \
        for (int b = b0; b < b1; b++) { \
            pvec lo[MB], hi[MB]; \
            for (int m = 0; m < (MB); m++) lo[m] = hi[m] = (pvec){0}; \
            for (int g = 0; g < groups; g++) { \
                const uint8_t *grp = q_group(wp, b, g, groups, group_bytes, ahead); \
                const uint8_t *codes = grp + ((Q4) ? 2 : 1) * PACK * sizeof(uint16_t); \
                const float *xg = x + (size_t)g * QGROUP; \
                pvec plo[QS_SPLIT(MB)][MB], phi[QS_SPLIT(MB)][MB]; \
                for (int k = 0; k < QS_SPLIT(MB); k++) \
                    for (int m = 0; m < (MB); m++) plo[k][m] = phi[k][m] = (pvec){0}; \
                for (int c = 0; c < QGROUP; c += QS_SPLIT(MB)) \
                    for (int k = 0; k < QS_SPLIT(MB); k++) { \
                        pvec q0, q1; \
                        if (Q4) { \
                            const __m512i v = \
                                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + (c + k) * PLANES))); \
                            q0 = (pvec)_mm512_permutexvar_ps(v, levels); /* the low nibble: index bits 0-3 */ \
                            q1 = (pvec)_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), levels); \
                        } else { \
                            q0 = __builtin_convertvector(widen(codes + (size_t)(c + k) * PACK, 1), pvec); \
                            q1 = __builtin_convertvector(widen(codes + (size_t)(c + k) * PACK + PLANES, 1), pvec); \
                        } \
                        for (int m = 0; m < (MB); m++) { \
                            const float xv = xg[(size_t)m * I + c + k]; \
                            plo[k][m] += q0 * xv; \
                            phi[k][m] += q1 * xv; \
                        } \
                    } \
                for (int k = 1; k < QS_SPLIT(MB); k++) \
                    for (int m = 0; m < (MB); m++) { \
                        plo[0][m] += plo[k][m]; \
                        phi[0][m] += phi[k][m]; \
                    } \
                const uint16_t *scales = (const uint16_t *)grp; \
                const pvec d0 = pload_half(scales), d1 = pload_half(scales + PLANES); \
                for (int m = 0; m < (MB); m++) { \
                    lo[m] += d0 * plo[0][m]; \
                    hi[m] += d1 * phi[0][m]; \
                } \
                if (Q4) { \
                    const pvec m0 = pload_half(scales + PACK), m1 = pload_half(scales + PACK + PLANES); \
                    for (int m = 0; m < (MB); m++) { \
                        lo[m] += m0 * sx[m * groups + g]; \
                        hi[m] += m1 * sx[m * groups + g]; \
                    } \
                } \
            } \
            store_rows(y, lo, hi, MB, O, b * PACK); \
        } \
    }
#define QS_HEIGHTS(P, Q4) \
    QS_BLOCK(P##1, 1, Q4) QS_BLOCK(P##2, 2, Q4) QS_BLOCK(P##3, 3, Q4) QS_BLOCK(P##4, 4, Q4) QS_BLOCK(P##5, 5, Q4) \
    QS_BLOCK(P##6, 6, Q4) QS_BLOCK(P##7, 7, Q4) QS_BLOCK(P##8, 8, Q4) QS_BLOCK(P##9, 9, Q4) QS_BLOCK(P##10, 10, Q4) \
    QS_BLOCK(P##11, 11, Q4) QS_BLOCK(P##12, 12, Q4)
QS_HEIGHTS(q4s_, 1)
QS_HEIGHTS(q8s_, 0)
static const block_fn Q4S[QS_HEIGHT + 1] = {0, q4s_1, q4s_2, q4s_3, q4s_4, q4s_5, q4s_6, q4s_7, q4s_8, q4s_9,
                                           q4s_10, q4s_11, q4s_12};
static const block_fn Q8S[QS_HEIGHT + 1] = {0, q8s_1, q8s_2, q8s_3, q8s_4, q8s_5, q8s_6, q8s_7, q8s_8, q8s_9,
                                           q8s_10, q8s_11, q8s_12};
#endif
static const block_fn Q8[13] = {0, q8_1, q8_2, q8_3, q8_4, q8_5, q8_6, q8_7, q8_8, q8_9, q8_10, q8_11, q8_12};

/* Q4_1 weights times activations rounded to 8 bits: a drafter's products under draft_precision=q4a8, where a rounded
input, like a rounded weight, changes what is drafted, never what the base accepts (llama.cpp's Q4_1 · Q8_1 dot).
The float32 kernels above are compute-bound at one row: each weight costs a decode to float32 and an FMA per row, 4-6
vector ops for 32 weights. Here a row's x is rounded per group of 32 columns to int8 (x ≈ s·xq, s = the group's largest
magnitude / 127) and the codes multiply xq as integers, four columns a 32-bit lane: AVX-512 VNNI's vpdpbusd sums 64
code·xq products in one instruction. Per group, Σ w·x ≈ d·s·Σ q·xq + m·Σ x (Σ x in float32, so the offsets see x
unrounded). Fewer ops a weight than q4's decode, so a drafter's product at one row costs less from the caches and from
memory alike; the kernel table times it against the others where it offers it.
Layout (compact.pack_q4a8), per block of A8_ROWS output rows and per group of 32 columns: d [16] and m [16] float16,
then 4 units of 64 bytes; byte 4r + k of unit u holds row r's code of column 4u + k in its low nibble and of column
16 + 4u + k in its high one: 0.625 bytes per weight. With AVX2 alone the same sums by vpmaddubsw and vpmaddwd (three
instructions where VNNI has one, on half the lanes); with neither, in plain C (correct, far slower: the kernel table does
not offer it there, native.int8_dots). */
#define A8_ROWS 16                                   /* output rows per block: one 32-bit lane each */
#define A8_UNIT 64                                   /* bytes per unit: 16 rows × 4 columns, two nibbles a byte */
#define A8_GROUP_BYTES (2 * A8_ROWS * 2 + 4 * A8_UNIT) /* the scales and the 4 units of one group: 320 */
#define A8_HEIGHT 4                                  /* x rows per pass over the weight */

/* x [I] -> xq [I] int8, per group of 32: s (the scale) and sx (Σ x, unrounded) */
static void a8_round(const float *x, int I, int8_t *xq, float *s, float *sx) {
    for (int g = 0; g < I / QGROUP; g++) {
        const float *xg = x + (size_t)g * QGROUP;
        float most = 0.f, sum = 0.f;
        for (int c = 0; c < QGROUP; c++) {
            const float a = xg[c] < 0 ? -xg[c] : xg[c];
            most = a > most ? a : most;
            sum += xg[c];
        }
        const float inv = most > 0.f ? 127.f / most : 0.f;
        for (int c = 0; c < QGROUP; c++) xq[(size_t)g * QGROUP + c] = (int8_t)__builtin_lrintf(xg[c] * inv);
        s[g] = most / 127.f;
        sx[g] = sum;
    }
}

/* a block's MB rows of x rounded (a8_round), in its scope: xq [MB·I] int8, s and sx [MB·groups] */
#define A8_ROUNDED_ROWS(MB) \
    const int groups = I / QGROUP; \
    int8_t xq[(MB) * I]; \
    float s[(MB) * groups], sx[(MB) * groups]; \
    for (int m = 0; m < (MB); m++) a8_round(x + (size_t)m * I, I, xq + (size_t)m * I, s + m * groups, sx + m * groups)

static inline void a8_store(float *y, const float *acc, int O, int o) {
    const int n = O - o < A8_ROWS ? O - o : A8_ROWS;
    for (int r = 0; r < n; r++) y[o + r] = acc[r];
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define A8_BLOCK(NAME, MB) \
    static void NAME(const float *x, const void *wp, float *y, int I, int O, int b0, int b1) { \
        A8_ROUNDED_ROWS(MB); \
        const __m512i nibble = _mm512_set1_epi8(15); \
        const int ahead = qprefetch[1]; \
        for (int b = b0; b < b1; b++) { \
            __m512 acc[MB]; \
            for (int m = 0; m < (MB); m++) acc[m] = _mm512_setzero_ps(); \
            for (int g = 0; g < groups; g++) { \
                const uint8_t *grp = q_group(wp, b, g, groups, A8_GROUP_BYTES, ahead); \
                __m512i lo[MB], hi[MB]; \
                for (int m = 0; m < (MB); m++) lo[m] = hi[m] = _mm512_setzero_si512(); \
                for (int u = 0; u < 4; u++) { \
                    const __m512i v = _mm512_loadu_si512((const void *)(grp + 4 * A8_ROWS + u * A8_UNIT)); \
                    const __m512i q0 = _mm512_and_si512(v, nibble); \
                    const __m512i q1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble); \
                    for (int m = 0; m < (MB); m++) { \
                        const int8_t *xg = xq + (size_t)m * I + (size_t)g * QGROUP + 4 * u; \
                        int32_t c0, c1; \
                        __builtin_memcpy(&c0, xg, 4); \
                        __builtin_memcpy(&c1, xg + 16, 4); \
                        lo[m] = _mm512_dpbusd_epi32(lo[m], q0, _mm512_set1_epi32(c0)); \
                        hi[m] = _mm512_dpbusd_epi32(hi[m], q1, _mm512_set1_epi32(c1)); \
                    } \
                } \
                const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)grp)); \
                const __m512 off = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(grp + 2 * A8_ROWS))); \
                for (int m = 0; m < (MB); m++) { \
                    const __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(lo[m], hi[m])); \
                    acc[m] = _mm512_fmadd_ps(sums, _mm512_mul_ps(d, _mm512_set1_ps(s[m * groups + g])), acc[m]); \
                    acc[m] = _mm512_fmadd_ps(off, _mm512_set1_ps(sx[m * groups + g]), acc[m]); \
                } \
            } \
            for (int m = 0; m < (MB); m++) { \
                float out[A8_ROWS]; \
                _mm512_storeu_ps(out, acc[m]); \
                a8_store(y + (size_t)m * O, out, O, b * A8_ROWS); \
            } \
        } \
    }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2 without VNNI: a unit's two halves (rows 0-7, 8-15) at a time; vpmaddubsw multiplies code·xq pairs into int16
   sums (at most 2·15·127: no saturation) and vpmaddwd adds those pairs into int32 lanes, 4 columns a lane as above */
#define A8_BLOCK(NAME, MB) \
    static void NAME(const float *x, const void *wp, float *y, int I, int O, int b0, int b1) { \
        A8_ROUNDED_ROWS(MB); \
        const __m256i nibble = _mm256_set1_epi8(15), pairs = _mm256_set1_epi16(1); \
        const int ahead = qprefetch[1]; \
        for (int b = b0; b < b1; b++) { \
            __m256 acc[MB][2]; \
            for (int m = 0; m < (MB); m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps(); \
            for (int g = 0; g < groups; g++) { \
                const uint8_t *grp = q_group(wp, b, g, groups, A8_GROUP_BYTES, ahead); \
                for (int half = 0; half < 2; half++) { \
                    __m256i sums[MB]; \
                    for (int m = 0; m < (MB); m++) sums[m] = _mm256_setzero_si256(); \
                    for (int u = 0; u < 4; u++) { \
                        const __m256i v = \
                            _mm256_loadu_si256((const __m256i *)(grp + 4 * A8_ROWS + u * A8_UNIT + 32 * half)); \
                        const __m256i q0 = _mm256_and_si256(v, nibble); \
                        const __m256i q1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble); \
                        for (int m = 0; m < (MB); m++) { \
                            const int8_t *xg = xq + (size_t)m * I + (size_t)g * QGROUP + 4 * u; \
                            int32_t c0, c1; \
                            __builtin_memcpy(&c0, xg, 4); \
                            __builtin_memcpy(&c1, xg + 16, 4); \
                            const __m256i p0 = _mm256_maddubs_epi16(q0, _mm256_set1_epi32(c0)); \
                            const __m256i p1 = _mm256_maddubs_epi16(q1, _mm256_set1_epi32(c1)); \
                            sums[m] = _mm256_add_epi32(sums[m], _mm256_madd_epi16(_mm256_add_epi16(p0, p1), pairs)); \
                        } \
                    } \
                    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(grp + 16 * half))); \
                    const __m256 off = \
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(grp + 2 * A8_ROWS + 16 * half))); \
                    for (int m = 0; m < (MB); m++) { \
                        acc[m][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[m]), \
                                                       _mm256_mul_ps(d, _mm256_set1_ps(s[m * groups + g])), \
                                                       acc[m][half]); \
                        acc[m][half] = _mm256_fmadd_ps(off, _mm256_set1_ps(sx[m * groups + g]), acc[m][half]); \
                    } \
                } \
            } \
            for (int m = 0; m < (MB); m++) { \
                float out[A8_ROWS]; \
                _mm256_storeu_ps(out, acc[m][0]); \
                _mm256_storeu_ps(out + 8, acc[m][1]); \
                a8_store(y + (size_t)m * O, out, O, b * A8_ROWS); \
            } \
        } \
    }
#else
#define A8_BLOCK(NAME, MB) \
    static void NAME(const float *x, const void *wp, float *y, int I, int O, int b0, int b1) { \
        A8_ROUNDED_ROWS(MB); \
        for (int b = b0; b < b1; b++) { \
            float acc[MB][A8_ROWS]; \
            for (int m = 0; m < (MB); m++) \
                for (int r = 0; r < A8_ROWS; r++) acc[m][r] = 0.f; \
            for (int g = 0; g < groups; g++) { \
                const uint8_t *grp = (const uint8_t *)wp + ((size_t)b * groups + g) * A8_GROUP_BYTES; \
                const uint8_t *codes = grp + 4 * A8_ROWS; \
                for (int m = 0; m < (MB); m++) { \
                    const int8_t *xg = xq + (size_t)m * I + (size_t)g * QGROUP; \
                    for (int r = 0; r < A8_ROWS; r++) { \
                        int32_t sum = 0; \
                        for (int u = 0; u < 4; u++) \
                            for (int k = 0; k < 4; k++) { \
                                const uint8_t byte = codes[u * A8_UNIT + 4 * r + k]; \
                                sum += (byte & 15) * xg[4 * u + k] + (byte >> 4) * xg[16 + 4 * u + k]; \
                            } \
                        uint16_t dh, mh; \
                        __builtin_memcpy(&dh, grp + 2 * r, 2); \
                        __builtin_memcpy(&mh, grp + 2 * A8_ROWS + 2 * r, 2); \
                        acc[m][r] += (float)sum * (half_to_float(dh) * s[m * groups + g]); \
                        acc[m][r] += half_to_float(mh) * sx[m * groups + g]; \
                    } \
                } \
            } \
            for (int m = 0; m < (MB); m++) a8_store(y + (size_t)m * O, acc[m], O, b * A8_ROWS); \
        } \
    }
#endif
A8_BLOCK(a8_1, 1)
A8_BLOCK(a8_2, 2)
A8_BLOCK(a8_3, 3)
A8_BLOCK(a8_4, 4)
static const block_fn A8[A8_HEIGHT + 1] = {0, a8_1, a8_2, a8_3, a8_4};

/* The next product's head start (smallm_next): the weight a caller will multiply next, its packed blocks (bytes a
   block, blocks: gemm splits them over the threads in contiguous ranges) and how many of its first bytes each thread
   asks for. */
typedef struct {
    const uint8_t *w;
    size_t unit_bytes;
    int units, bytes;
} head_t;
static head_t next_head;

/* x [M, I], w (the layout and element type `blocks` read), y [M, O]; `blocks` take `height` x rows per pass and a range
   [r0, r1) of `units` (W's rows, or packed blocks), which the threads split into contiguous ranges, each a multiple of
   `align`. threads: how many OpenMP threads (PyTorch's own runtime: the process has loaded PyTorch's libgomp before
   this library, and the dynamic linker binds this one to it). */
static void gemm(const block_fn *blocks, int height, int units, int align, const float *x, const void *w, float *y,
                 int M, int I, int O, int threads) {
    const head_t head = next_head;
    next_head.w = NULL; /* one product's: the caller names the next one before each */
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        extern int omp_get_num_threads(void);
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
#else
        const int t = 0, n = 1;
#endif
        const int chunk = ((units + n - 1) / n + align - 1) / align * align;
        const int r0 = t * chunk < units ? t * chunk : units, r1 = r0 + chunk < units ? r0 + chunk : units;
        for (int m0 = 0; m0 < M; m0 += height) {
            const int mb = M - m0 < height ? M - m0 : height;
            blocks[mb](x + (size_t)m0 * I, w, y + (size_t)m0 * O, I, O, r0, r1);
        }
        if (head.w) { /* this thread's first bytes of the next product, into L2 */
            const int c = (head.units + n - 1) / n; /* the split above, for packed blocks (align 1) */
            const size_t u0 = t * c < head.units ? (size_t)t * c : (size_t)head.units;
            const size_t u1 = u0 + c < (size_t)head.units ? u0 + c : (size_t)head.units;
            const size_t from = u0 * head.unit_bytes, to = u1 * head.unit_bytes;
            for (size_t at = from; at < to && at < from + (size_t)head.bytes; at += 64)
                __builtin_prefetch(head.w + at, 0, 2);
        }
    }
}

int smallm_pack_rows(void) { return PACK; }

/* wp [ceil(O/PACK), I, PACK]: PBLOCK x rows per pass (more would spill registers) */
void smallm_packed(const float *x, const float *wp, float *y, int M, int I, int O, int threads) {
    gemm(PACKED, PBLOCK, (O + PACK - 1) / PACK, 1, x, wp, y, M, I, O, threads);
}

void smallm_packed_bf16(const float *x, const uint16_t *wp, float *y, int M, int I, int O, int threads) {
    gemm(PACKED_BF16, PBLOCK, (O + PACK - 1) / PACK, 1, x, wp, y, M, I, O, threads);
}

/* w [O, I]: BLOCK x rows per pass; the threads' row ranges are multiples of 4 rows (cache lines of the output) */
void smallm_gemm(const float *x, const float *w, float *y, int M, int I, int O, int threads) {
    gemm(BLOCKS, BLOCK, O, 4, x, w, y, M, I, O, threads);
}

/* w: bfloat16 bit patterns */
void smallm_gemm_bf16(const float *x, const uint16_t *w, float *y, int M, int I, int O, int threads) {
    gemm(BLOCKS_BF16, BLOCK, O, 4, x, w, y, M, I, O, threads);
}

/* How many rows the reassociated blocks serve at most, QS_SAFE or QS_HEIGHT (then also every M, in blocks of
   QS_HEIGHT); the plain blocks the rest. Set by smallm_calibrate (or smallm_set_reassociated_rows), QS_SAFE until. */
#if defined(__AVX512F__)
static int qs_rows = QS_SAFE;
#else
static int qs_rows = 0;
#endif

static void packed_q(const block_fn *qs, const block_fn *plain, const float *x, const void *wp, float *y, int M, int I,
                     int O, int threads) {
    const int blocks = (O + PACK - 1) / PACK;
#if defined(__AVX512F__)
    if (M <= qs_rows || qs_rows == QS_HEIGHT) {
        gemm(qs, QS_HEIGHT, blocks, 1, x, wp, y, M, I, O, threads);
        return;
    }
#else
    (void)qs;
#endif
    gemm(plain, QBLOCK, blocks, 1, x, wp, y, M, I, O, threads);
}

/* wp: compact.py's q4 / q8 layout; I a multiple of QGROUP (compact.py only makes these forms then) */
void smallm_packed_q4(const float *x, const void *wp, float *y, int M, int I, int O, int threads) {
#if defined(__AVX512F__)
    packed_q(Q4S, Q4, x, wp, y, M, I, O, threads);
#else
    packed_q(Q4, Q4, x, wp, y, M, I, O, threads);
#endif
}

void smallm_packed_q8(const float *x, const void *wp, float *y, int M, int I, int O, int threads) {
#if defined(__AVX512F__)
    packed_q(Q8S, Q8, x, wp, y, M, I, O, threads);
#else
    packed_q(Q8, Q8, x, wp, y, M, I, O, threads);
#endif
}

/* wp: compact.py's q4a8 layout (above); I a multiple of QGROUP */
void smallm_q4a8(const float *x, const void *wp, float *y, int M, int I, int O, int threads) {
    gemm(A8, A8_HEIGHT, (O + A8_ROWS - 1) / A8_ROWS, 1, x, wp, y, M, I, O, threads);
}

/* Name the product that follows the next one: w [O, I] held in `form` (layer.c's codes: 0 float32, 1 bfloat16, 2 q4,
   3 q8, 4 q4a8 — native_layer.FORMATS), multiplied at `rows` rows. When the next product's threads finish their
   rows, each asks for the first bytes of its own rows of w (as many as the compact kernels' prefetch distance at that
   many rows: the bytes their own prefetches, always that far ahead, never ask for). A product then starts on weights
   already on the way instead of waiting on memory while the hardware prefetcher ramps up: each of a layer stack's 120
   products is a new stream, 0.1-1 MB. Only the next product call reads it (and forgets it). layer.c names each
   product of its stack. It pays most at one row, where a product is shortest: at more rows it runs longer, so the
   ramp-up is a smaller share of it. */
void smallm_next(const void *w, int form, int I, int O, int rows) {
    const int groups = I / QGROUP, packs = (O + PACK - 1) / PACK;
    head_t h = {(const uint8_t *)w, 0, packs, qprefetch[rows >= 1 && rows <= 12 ? rows : 12]};
    switch (form) {
    case 0: h.unit_bytes = (size_t)I * PACK * sizeof(float); break;
    case 1: h.unit_bytes = (size_t)I * PACK * sizeof(uint16_t); break;
    case 2: h.unit_bytes = (size_t)groups * Q4_GROUP_BYTES; break;
    case 3: h.unit_bytes = (size_t)groups * Q8_GROUP_BYTES; break;
    case 4:
        h.unit_bytes = (size_t)groups * A8_GROUP_BYTES;
        h.units = (O + A8_ROWS - 1) / A8_ROWS;
        break;
    default: h.w = NULL;
    }
    next_head = h;
}

/* which integer dot products smallm_q4a8 sums with: 2 AVX-512 VNNI, 1 AVX2's multiply-adds, 0 none (plain C) */
int smallm_q4a8_simd(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

/* the most x rows one pass of the compact blocks takes (their block heights are 1..this): the prefetch distances
   above this height are never used */
int smallm_block_rows(void) {
#if defined(__AVX512F__)
    return QS_HEIGHT > QBLOCK ? QS_HEIGHT : QBLOCK;
#else
    return QBLOCK;
#endif
}

/* the rows the reassociated blocks serve at most (0 where the CPU has no AVX-512: none) */
int smallm_reassociated_rows(void) { return qs_rows; }

/* set it (QS_SAFE or QS_HEIGHT; tests force both); returns what it is now */
int smallm_set_reassociated_rows(int rows) {
#if defined(__AVX512F__)
    qs_rows = rows >= QS_HEIGHT ? QS_HEIGHT : QS_SAFE;
#else
    (void)rows;
#endif
    return qs_rows;
}

/* Time the reassociated against the plain blocks at 8 and 12 rows on one thread, over a q4 weight [1536, 576] (a
   SmolLM2 MLP half's shape, ~0.7 MB: in the core's L2, so the blocks' own cost decides, not memory), best of 5 each,
   interleaved; the reassociated ones serve every row count if they win at both, else only up to QS_SAFE. A few ms,
   once per process (native.py). Returns the choice. */
static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
int smallm_calibrate(void) {
#if defined(__AVX512F__)
    const int O = 1536, I = 576, groups = I / QGROUP, blocks = O / PACK, most = 12;
    const size_t bytes = (size_t)blocks * groups * Q4_GROUP_BYTES;
    uint8_t *w = malloc(bytes);
    float *x = malloc(sizeof(float) * most * I), *y = malloc(sizeof(float) * most * O);
    if (!w || !x || !y) {
        free(w), free(x), free(y);
        return qs_rows;
    }
    for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)(i * 2654435761u >> 13); /* codes: any */
    for (size_t g = 0; g < (size_t)blocks * groups; g++) /* scales and offsets: normal numbers (not denormals) */
        for (int k = 0; k < 2 * PACK; k++) ((uint16_t *)(w + g * Q4_GROUP_BYTES))[k] = 0x211f; /* ~0.01 */
    for (int i = 0; i < most * I; i++) x[i] = (float)(i % 7) - 3.f;
    int wins = 1;
    for (int M = 8; M <= most; M += 4) {
        double best[2] = {1e9, 1e9};
        for (int rep = 0; rep < 6; rep++)
            for (int way = 0; way < 2; way++) {
                const double t = now_s();
                gemm(way ? Q4 : Q4S, way ? QBLOCK : QS_HEIGHT, blocks, 1, x, w, y, M, I, O, 1);
                const double dt = now_s() - t;
                if (rep && dt < best[way]) best[way] = dt; /* the first pass of each warms up */
            }
        wins &= best[0] < best[1];
    }
    free(w), free(x), free(y);
    qs_rows = wins ? QS_HEIGHT : QS_SAFE;
#endif
    return qs_rows;
}

/* This CPU's float32 FMA throughput on `threads` threads (FLOP/s): the compute roof make bench draws the products
   against. PyTorch's large product is no measure of it where MKL does not use the CPU's widest vectors (the roof is
   cores × FMA pipes × lanes × 2 flops × clock; a product on narrower vectors stops well short of it). 12 independent
   accumulators of the packed kernels' vector width per thread, best of 3, ~20 ms. */
double smallm_fma_peak(int threads) {
    double best = 0.0;
    for (int rep = 0; rep < 3; rep++) {
        const long iters = 1L << 21;
        int team = 1;
        float sink = 0.f;
        const double t = now_s();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
#ifdef _OPENMP
            extern int omp_get_num_threads(void);
#pragma omp single
            team = omp_get_num_threads();
#endif
            pvec a[12];
            for (int i = 0; i < 12; i++) a[i] = (pvec){0} + 1e-3f * (float)i;
            const pvec b = (pvec){0} + 0.999f, c = (pvec){0} + 1e-4f;
            for (long k = 0; k < iters; k++)
                for (int i = 0; i < 12; i++) a[i] = a[i] * b + c;
            for (int i = 0; i < 12; i++)
                for (int l = 0; l < PLANES; l++) sink += a[i][l];
        }
        const double dt = now_s() - t, flops = 2.0 * 12 * PLANES * (double)iters * team / dt;
        if (flops > best && sink == sink) best = flops;
    }
    return best;
}

/* Drop [p, p + bytes) from every cache level (written back first where dirty): the kernel table times a drafter's
   weight as a decode reads it, from memory, after the base's whole step went through the caches in between. Without
   a cache-line flush instruction (not x86) it does nothing, and the weight is timed as it lies. */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
void smallm_evict(const void *p, long bytes) {
#if defined(__x86_64__) || defined(__i386__)
    const char *c = (const char *)((uintptr_t)p & ~(uintptr_t)63);
    for (const char *end = (const char *)p + bytes; c < end; c += 64)
#if defined(__CLFLUSHOPT__)
        _mm_clflushopt((void *)c);
#else
        _mm_clflush(c);
#endif
    _mm_mfence();
#else
    (void)p;
    (void)bytes;
#endif
}
