/* y = x·Wᵀ for a few rows x [M, I] and a weight W [O, I], both row-major float32: the product of a decode step.

BLAS kernels are tuned for large M; at M = 1..16 some of them read the weight more than once or leave the cores
idle (see kernels.py). Here each thread streams its own contiguous block of W's rows exactly once and, per weight
row, keeps the M dot products in registers while the x rows (M·I floats) stay in L1/L2: for the M of a verify block
the product costs little more than reading W once (960×576 on a Zen 3 EPYC: 128 µs at 1 row, 186 at 5, against 211
and 317 for PyTorch's default). Rows beyond BLOCK are done BLOCK at a time.

Built at first use with the machine's own compiler for its own CPU (-march=native; see native.py), called through
ctypes. Plain C with GCC/Clang vector extensions, so one source serves AVX2, AVX-512 and NEON alike. */

#include <stddef.h>

#define LANES 8   /* floats per vector: 256 bits (two NEON / one AVX2 register, half an AVX-512 one) */
#define BLOCK 12  /* x rows kept in registers per pass over W */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static inline vec load(const float *p) {
    vec v;
    __builtin_memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline float hsum(vec v) {
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += v[l];
    return s;
}

/* y[m, o] for m < mb over weight rows [o0, o1): per weight row, mb·split independent accumulators (mb, split:
   compile-time constants after inlining). A single x row splits its sum over several accumulators, so that enough
   FMA chains run at once to hide the FMA latency. The last I % (split·LANES) columns: vectors, then scalars. */
static inline void rows_block(const float *x, const float *w, float *y, const int mb, const int split, int I, int O,
                              int o0, int o1) {
    const int step = split * LANES, i_split = I - I % step, i_vec = I - I % LANES;
    for (int o = o0; o < o1; o++) {
        const float *wr = w + (size_t)o * I;
        vec acc[4][BLOCK];
        for (int k = 0; k < split; k++)
            for (int m = 0; m < mb; m++) acc[k][m] = (vec){0};
        for (int i = 0; i < i_split; i += step)
            for (int k = 0; k < split; k++) {
                const vec wv = load(wr + i + k * LANES);
                for (int m = 0; m < mb; m++) acc[k][m] += wv * load(x + (size_t)m * I + i + k * LANES);
            }
        for (int i = i_split; i < i_vec; i += LANES) {
            const vec wv = load(wr + i);
            for (int m = 0; m < mb; m++) acc[0][m] += wv * load(x + (size_t)m * I + i);
        }
        for (int m = 0; m < mb; m++) {
            for (int k = 1; k < split; k++) acc[0][m] += acc[k][m];
            float s = hsum(acc[0][m]);
            for (int i = i_vec; i < I; i++) s += wr[i] * x[(size_t)m * I + i];
            y[(size_t)m * O + o] = s;
        }
    }
}

/* one specialisation per block height, so that each keeps its mb·split accumulators, the weight vector and an x
   vector in registers (at most 14 of AVX2's 16) */
#define SPECIALISE(MB, SPLIT) \
    static void block_##MB(const float *x, const float *w, float *y, int I, int O, int o0, int o1) { \
        rows_block(x, w, y, MB, SPLIT, I, O, o0, o1); \
    }
SPECIALISE(1, 2) SPECIALISE(2, 2) SPECIALISE(3, 2) SPECIALISE(4, 2) SPECIALISE(5, 2) SPECIALISE(6, 2)
SPECIALISE(7, 1) SPECIALISE(8, 1) SPECIALISE(9, 1) SPECIALISE(10, 1) SPECIALISE(11, 1) SPECIALISE(12, 1)

typedef void (*block_fn)(const float *, const float *, float *, int, int, int, int);
static const block_fn BLOCKS[BLOCK + 1] = {0, block_1, block_2, block_3, block_4, block_5, block_6, block_7, block_8,
                                           block_9, block_10, block_11, block_12};

/* x [M, I], w [O, I], y [M, O]; threads: how many OpenMP threads split W's rows (PyTorch's own runtime: the
   process has loaded PyTorch's libgomp before this library, and the dynamic linker binds this one to it). */
void smallm_gemm(const float *x, const float *w, float *y, int M, int I, int O, int threads) {
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        extern int omp_get_num_threads(void);
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
#else
        const int t = 0, n = 1;
#endif
        /* contiguous row ranges, one per thread, each a multiple of 4 rows (cache lines of the output) */
        const int chunk = ((O + n - 1) / n + 3) / 4 * 4;
        const int o0 = t * chunk < O ? t * chunk : O, o1 = o0 + chunk < O ? o0 + chunk : O;
        for (int m0 = 0; m0 < M; m0 += BLOCK) {
            const int mb = M - m0 < BLOCK ? M - m0 : BLOCK;
            BLOCKS[mb](x + (size_t)m0 * I, w, y + (size_t)m0 * O, I, O, o0, o1);
        }
    }
}
