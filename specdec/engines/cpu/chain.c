/* A feature-level drafter's greedy chain in one native call: the prophet's (EAGLE's) depth loop at T = 0; and its
`observe` (the real entries of the newly committed positions) in another. Also Hydra's chain of heads in one call.

Each depth of such a chain is: the parent's predicted feature ĥ and the embedding of the token drafted from it, the
embedding RMSNormed, through fc [H, 2H]; the drafter's decoder layers over that one row (layer.c); the final RMSNorm
(-> this depth's ĥ); the vocab head and its argmax (-> the next token). From Python a depth is ~40 ops and four
layer stacks' worth of argument handling, whose dispatch costs more than the native layers and the head's product
themselves at one row. Here the whole chain is one call.

The math is the Python path's (specdec/drafters/prophet.py: `step_input`, `readout`, `expand`): the same products from
the same weight copies where the caller passes those (native_chain.py), the norms by layer.c's formula, the argmax the
first index of the largest logit (torch.argmax's). Built into the same library as smallm.c and layer.c (native.py). */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* smallm.c's products and layer.c's layer stack and norm (a layer is passed through as an opaque pointer) */
void smallm_packed(const float *x, const float *wp, float *y, int M, int I, int O, int threads);
void smallm_packed_bf16(const float *x, const uint16_t *wp, float *y, int M, int I, int O, int threads);
void smallm_packed_q4(const float *x, const void *wp, float *y, int M, int I, int O, int threads);
void smallm_packed_q8(const float *x, const void *wp, float *y, int M, int I, int O, int threads);
void smallm_q4a8(const float *x, const void *wp, float *y, int M, int I, int O, int threads);
int smallm_layers(const void *const *layers, int count, float *h, int n, const float *cos, const float *sin,
                  const int64_t *slots, int width, const float *mask, float *scratch, int threads, float *const *keep);
void smallm_rms_norm(const float *x, const float *w, float *out, int n, int H, float eps);

enum { F32, BF16, Q4, Q8, Q4A8 }; /* a weight's form, as layer.c's (native_layer.FORMATS) */

/* The chain's fixed parts: pointers into tensors the Python side keeps alive (native_chain.FeatureChain). */
typedef struct {
    const float *embed;                  /* [V, H] the base's token embeddings, float32 */
    const float *emb_norm, *norm;        /* [H] RMSNorm weights: the embedding's, the final one */
    const void *fc, *head;               /* [H, 2H] and [V_d, H] in smallm.c's packed layouts */
    const int64_t *vocab;                /* [V_d] draft index -> base token id, NULL without a draft vocab */
    const void *const *layers;           /* the drafter's layer_t's */
    int count, hidden, draft_vocab, rope_dim, fc_form, head_form;
    float emb_eps, norm_eps;
} chain_t;

/* y [M, O] = x [M, I] Wᵀ, by the kernel of W's form */
static void product(int form, const void *w, const float *x, float *y, int M, int I, int O, int threads) {
    switch (form) {
    case BF16: smallm_packed_bf16(x, (const uint16_t *)w, y, M, I, O, threads); break;
    case Q4: smallm_packed_q4(x, w, y, M, I, O, threads); break;
    case Q8: smallm_packed_q8(x, w, y, M, I, O, threads); break;
    case Q4A8: smallm_q4a8(x, w, y, M, I, O, threads); break;
    default: smallm_packed(x, (const float *)w, y, M, I, O, threads);
    }
}

/* in [n, 2H] = [features_i; RMSNorm(emb(tokens_i))] per row: fc's input */
static void step_inputs(const chain_t *C, const float *features, const int64_t *tokens, float *in, int n) {
    const int H = C->hidden;
    for (int i = 0; i < n; i++) {
        float *row = in + (size_t)i * 2 * H;
        memcpy(row, features + (size_t)i * H, sizeof(float) * H);
        smallm_rms_norm(C->embed + (size_t)tokens[i] * H, C->emb_norm, row + H, 1, H, C->emb_eps);
    }
}

/* the first index of the largest of x [n] */
static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* softmax(x [n])'s probability at its largest entry x[best]: 1 / Σ exp(x_i − x_best), the sum in double */
static float top1(const float *x, int n, int best) {
    double sum = 0;
    for (int i = 0; i < n; i++) sum += __builtin_exp((double)x[i] - x[best]);
    return (float)(1.0 / sum);
}

/* floats of `work` smallm_feature_chain needs (its own; the layers' scratch is passed apart) */
long smallm_chain_work(const chain_t *C) { return 3L * C->hidden + C->draft_vocab; }

/* The chain's `steps` depths from the root: depth 0 reads out root [H] (the root entry's layer output, which the
   drafter's observe ran); depth d ≥ 1 runs the layers over fc([ĥ_{d-1}; norm(emb(token_d))]) at rotary row d - 1 of
   cos, sin [steps - 1, rope_dim], writing its key and value at slot `slot` + d and attending to slots
   [0, slot + d + 1) (all of them: a chain's query sees its whole window). Writes tokens [steps] (base ids) and
   hats [steps, H] (each depth's ĥ). With stop > 0 (an adaptive draft length, trees.draft_static's keep_going) the
   chain ends after its first token whose top-1 probability (softmax of that depth's draft logits) is < stop: the
   depths after it are not run. Returns the depths drafted (steps, or fewer with stop), or the layers' -1 for a window
   they do not take (what was written before that depth stays written, as a Python chain stopped there would leave
   it). */
int smallm_feature_chain(const chain_t *C, const float *root, int steps, const float *cos, const float *sin,
                         int64_t slot, float *scratch, float *work, int threads, int64_t *tokens, float *hats,
                         float stop) {
    const int H = C->hidden;
    float *in = work;              /* [2H]: ĥ of the parent | its token's normed embedding */
    float *x = in + 2 * H;         /* [H] the layers' row */
    float *logits = x + H;         /* [V_d] */
    for (int d = 0; d < steps; d++) {
        const float *out = root;
        if (d > 0) {
            step_inputs(C, hats + (size_t)(d - 1) * H, tokens + d - 1, in, 1);
            product(C->fc_form, C->fc, in, x, 1, 2 * H, H, threads);
            const int64_t at = slot + d;
            const size_t row = (size_t)(d - 1) * C->rope_dim;
            if (smallm_layers(C->layers, C->count, x, 1, cos + row, sin + row, &at, (int)(at + 1), NULL, scratch,
                              threads, NULL))
                return -1;
            out = x;
        }
        float *hat = hats + (size_t)d * H;
        smallm_rms_norm(out, C->norm, hat, 1, H, C->norm_eps);
        product(C->head_form, C->head, hat, logits, 1, H, C->draft_vocab, threads);
        const int best = argmax(logits, C->draft_vocab);
        tokens[d] = C->vocab ? C->vocab[best] : best;
        if (stop > 0 && top1(logits, C->draft_vocab, best) < stop) return d + 1;
    }
    return steps;
}

/* The drafter's real entries (its `observe`, one pass for the newly committed positions and the next root): x [n, H] =
   fc([features_i; norm(emb(tokens_i))]) through fc's copy for n rows (fc, fc_form), then the layers for n rows (layers,
   count: their layer_t's) over x in place, with smallm_layers' rotary rows, slots, window, mask and scratch. in: [n, 2H]
   floats of work. Returns smallm_layers' -1, having written no key or value, for a window they do not take. */
int smallm_feature_entries(const chain_t *C, const void *fc, int fc_form, const void *const *layers, int count,
                           const float *features, const int64_t *tokens, float *in, float *x, int n, const float *cos,
                           const float *sin, const int64_t *slots, int width, const float *mask, float *scratch,
                           int threads) {
    step_inputs(C, features, tokens, in, n);
    product(fc_form, fc, in, x, n, 2 * C->hidden, C->hidden, threads);
    return smallm_layers(layers, count, x, n, cos, sin, slots, width, mask, scratch, threads, NULL);
}

/* A product with its bias: y [1, O] = W x + b (b NULL: none), W in one of smallm.c's packed layouts */
typedef struct {
    const void *w;
    const float *bias;
    int form, inputs, outputs;
} linear_t;

static void linear(const linear_t *L, const float *x, float *y, int threads) {
    product(L->form, L->w, x, y, 1, L->inputs, L->outputs, threads);
    if (L->bias)
        for (int o = 0; o < L->outputs; o++) y[o] += L->bias[o];
}

/* One Hydra head (Medusa's, with the tokens on its path): [h; norm(emb(t_0)); …; norm(emb(t_k))] -> in_proj -> `count`
   residual blocks x + SiLU(W x + b) -> the vocab head */
typedef struct {
    linear_t in_proj, head;
    const linear_t *blocks;
    const float *emb_norm;
    float eps;
    int count;
} head_t;

/* floats of work smallm_head_chain needs for `steps` heads of hidden size H and a vocab head of V_d rows */
long smallm_head_chain_work(int steps, int H, int V_d) { return (long)(steps + 3) * H + V_d; }

/* best [k]: the indices of x [n]'s k largest, largest first (the lower index first on a tie, as argmax); k ≤ n */
static void top_k(const float *x, int n, int k, int *best) {
    int have = 0;
    for (int i = 0; i < n; i++) {
        if (have == k && !(x[i] > x[best[k - 1]])) continue;
        int at = have < k ? have++ : k - 1; /* insert i, dropping the smallest when full */
        while (at > 0 && x[i] > x[best[at - 1]]) {
            best[at] = best[at - 1];
            at--;
        }
        best[at] = i;
    }
}

/* A Hydra drafter's greedy chain: head d (heads[d]) drafts token d + 1 from the base's newest feature h [H] and the
   tokens t_0 (the root) .. t_d of its path, each the argmax of the one before it (mapped to base ids through vocab
   [V_d], or NULL). Writes tokens [steps - 1 + top]: t_1 .. t_{steps-1}, then the last head's `top` best tokens, best
   first (a chain that fans out at its end: top 1 is the chain). `embed` [V, H]: the base's token embeddings. */
int smallm_head_chain(const head_t *heads, int steps, int top, const float *embed, const int64_t *vocab, int H,
                      int V_d, const float *h, int64_t root, float *work, int threads, int64_t *tokens) {
    if (top < 1 || top > 64 || top > V_d) return 1;
    float *in = work;                      /* [(steps + 1)·H]: h | the path's normed embeddings */
    float *x = in + (size_t)(steps + 1) * H, *y = x + H; /* [H] each */
    float *logits = y + H;                 /* [V_d] */
    memcpy(in, h, sizeof(float) * H);
    for (int d = 0; d < steps; d++) {
        const head_t *k = heads + d;
        for (int j = 0; j <= d; j++) /* the head's own norm over each token on the path */
            smallm_rms_norm(embed + (size_t)(j ? tokens[j - 1] : root) * H, k->emb_norm, in + (size_t)(j + 1) * H, 1,
                            H, k->eps);
        linear(&k->in_proj, in, x, threads);
        for (int b = 0; b < k->count; b++) {
            linear(k->blocks + b, x, y, threads);
            for (int i = 0; i < H; i++) x[i] += y[i] / (1.0f + __builtin_expf(-y[i]));
        }
        linear(&k->head, x, logits, threads);
        if (d + 1 < steps || top == 1) {
            const int best = argmax(logits, V_d);
            tokens[d] = vocab ? vocab[best] : best;
        } else {
            int best[64];
            top_k(logits, V_d, top, best);
            for (int j = 0; j < top; j++) tokens[d + j] = vocab ? vocab[best[j]] : best[j];
        }
    }
    return 0;
}
