/*
 * Tokens of a Qwen3-Next / Qwen3.5 hybrid (and its MTP head) through the model on the CPU,
 * one layer per call, reading the model's own weight tensors and writing the state in place
 * into the arena views. cpu_step.py builds the structs and compiles this file.
 *
 * Weights are float32 or bfloat16, and so are the conv window and the KV rows (the
 * arena's dtype); activations and sums are float32 throughout. A bf16 value widens to
 * float32 exactly (its bits shifted up), in registers as the row is read, so a bf16 model's
 * step is a float32 step over its weights' float32 values with its state rounded to bf16
 * where the arena stores it; only the bytes read halve.
 *
 * Why: on a CPU a decode step is a chain of matrix-vector products that should run at
 * memory bandwidth, plus a few hundred tiny ops. The BLAS behind torch runs a
 * matrix-vector product on one thread and, on some CPUs, well below bandwidth, and torch's
 * per-op dispatch dominates small models. The arithmetic is the model's (transformers'
 * reference code); the summation order is not, so results agree with transformers to
 * float32 rounding, not bit for bit.
 *
 * A call takes T tokens in order. Every output element is computed by the same code
 * whatever T is (each weight row meets each token in its own dot product), so T tokens in
 * one call give the same bits as T one-token calls: a speculative verify is exact by
 * construction, and reads each weight once for all its tokens.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* Below this many multiply-adds (1 MiB of float32 weights) a loop stays on the calling
 * thread. Waking the pool costs more than the work; and in a step that follows torch ops
 * after an idle moment, many small parallel loops cost far more than running them alone. */
#define PARALLEL_MIN 262144L
/*
 * Run CALL (a call that reads lo and hi) over [0, n): split over a team of `nthreads` when
 * `work` is worth waking it, else on this thread with no OpenMP call at all.
 */
#define SPLIT(n, work, nthreads, CALL)                                                     \
    do {                                                                                   \
        const int team_ = (int)(nthreads);                                                 \
        if (team_ > 1 && (work) >= PARALLEL_MIN && (n) > 1) {                              \
            _Pragma("omp parallel num_threads(team_)")                                     \
            {                                                                              \
                const int64_t c_ = omp_get_num_threads(), t_ = omp_get_thread_num();       \
                const int64_t lo = (n) * t_ / c_, hi = (n) * (t_ + 1) / c_;                \
                CALL;                                                                      \
            }                                                                              \
        } else {                                                                           \
            const int64_t lo = 0, hi = (n);                                                \
            CALL;                                                                          \
        }                                                                                  \
    } while (0)

#define SPAN 64  /* cache rows per attention work item: its K and V rows stay in L2 */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 16384  /* how far ahead attention asks for rows (a few rows of any size) */
#endif

struct fr_layer {
    int64_t kind;  /* 0: gated DeltaNet, 1: gated attention */
    int64_t hidden, inter, nthreads;
    float eps, pad0;
    int64_t w_bf16, conv_bf16, kv_bf16;   /* 1: the weight matrices / conv / KV rows are bf16 */
    const float *in_norm, *post_norm;     /* [H] each, with the model's 1 + w folded in */
    const void *w_gate, *w_up, *w_down;   /* [I, H], [I, H], [H, I] */
    float *scratch;                       /* cpu_step.py: CpuModel.scratch_floats */
    /* gated DeltaNet */
    const void *w_proj[4];                /* projections whose outputs are concatenated */
    int64_t proj_rows[4];
    const int32_t *proj_perm;             /* [P] to canonical q|k|v|z|b|a order, or NULL */
    const float *conv_w, *conv_b;         /* [C, K], [C] or NULL */
    void *conv_state;                     /* [C, K] arena view */
    int64_t conv_k, hk, hv, dk, dv;
    const float *neg_a, *dt_bias;         /* [Hv]: -exp(A_log), dt_bias */
    const float *gate_norm;               /* [Dv] */
    float *recurrent;                     /* [Hv, Dk, Dv] arena view */
    const void *w_out;                    /* [H, Hv * Dv] */
    /* gated attention */
    const void *w_q, *w_k, *w_v, *w_o;    /* [Hq*2D, H], [Hkv*D, H] x2, [H, Hq*D] */
    const float *q_norm, *k_norm;         /* [D], 1 + w folded in */
    const float *inv_freq;                /* [R/2] */
    int64_t hq, hkv, hd, rot, rope_offset;
    float scaling, rope_scale;
    void *keys, *values;                  /* arena views: [Hkv, max_len, D] */
    int64_t head_stride, seq_stride;      /* in elements, the same for keys and values */
    int64_t *length;                      /* the layer's cumulative length counter */
};

/* 8 floats as one value: GCC and clang lower it to the target's SIMD (AVX, NEON, ...) */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p)
{
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

static inline float hsum8(v8 v)
{
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* bfloat16 is the high half of a float32: widening is a shift, exact. */
static inline float bf16_float(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to the nearest bf16, ties to even, as torch's .to(torch.bfloat16) does. */
static inline uint16_t bf16_round(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;  /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Element i of a float32 (bf == 0) or bf16 (bf == 1) array; bf a constant after inlining. */
static inline float elem(const void *p, int64_t i, const int bf)
{
    return bf ? bf16_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* n floats into a float32 or bf16 row (rounded) */
static void put_row(void *dst, const float *src, int64_t n, int bf)
{
    if (!bf) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < n; i++)
        ((uint16_t *)dst)[i] = bf16_round(src[i]);
}

typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

/* 8 elements from i of a float32 or bf16 array, as floats: bf16 widens in registers */
static inline v8 load8w(const void *p, int64_t i, const int bf)
{
    if (!bf)
        return load8((const float *)p + i);
    v8h h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    return (v8)(__builtin_convertvector(h, v8u) << 16);
}

/*
 * The weight products' vectors: LANES floats (8 or 16), chosen when cpu_step.py compiles
 * this file by timing both (16 lanes pay only where the CPU runs them at full rate).
 */
#ifndef LANES
#define LANES 8
#endif
typedef float vw __attribute__((vector_size(4 * LANES)));
typedef uint16_t vwh __attribute__((vector_size(2 * LANES)));
typedef uint32_t vwu __attribute__((vector_size(4 * LANES)));

static inline vw loadw(const void *p, int64_t i, const int bf)
{
    vw v;
    if (!bf) {
        memcpy(&v, (const float *)p + i, sizeof v);
        return v;
    }
    vwh h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    return (vw)(__builtin_convertvector(h, vwu) << 16);
}

static inline float hsumw(vw v)
{
#if LANES == 16
    v8 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    return hsum8(lo + hi);
#else
    return hsum8(v);
#endif
}

/* a . b[0, n) for b float32 or bf16: two vector accumulators, a scalar tail */
static inline __attribute__((always_inline)) float dot(const float *a, const void *b,
                                                       int64_t n, const int bf)
{
    v8 s0 = {0}, s1 = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        s0 += load8(a + j) * load8w(b, j, bf);
        s1 += load8(a + j + 8) * load8w(b, j + 8, bf);
    }
    if (j + 8 <= n) {
        s0 += load8(a + j) * load8w(b, j, bf);
        j += 8;
    }
    float s = hsum8(s0 + s1);
    for (; j < n; j++)
        s = fmaf(a[j], elem(b, j, bf), s);
    return s;
}

/*
 * y[r + t * width] = dot(a[r], x[t]) for r < R, t < T (R and T constants after inlining).
 * Each chunk of a weight row is loaded once for all tokens. Every (row, token) pair has
 * its own two accumulators and forms its sum exactly as dot() does, so a result depends
 * on neither R nor T; R * T pairs give R * T * 2 independent FMA chains, enough to hide
 * the FMA latency that a single row's two chains would wait on.
 */
static inline __attribute__((always_inline)) void dots(const void *const *a, const int R,
                                                       const float *x, int64_t k, float *y,
                                                       int64_t width, const int T, const int bf)
{
    vw s0[4][4], s1[4][4];
    for (int r = 0; r < R; r++)  /* not `= {0}`: that zeroes all 16 with a slow rep stos */
        for (int t = 0; t < T; t++)
            s0[r][t] = s1[r][t] = (vw){0};
    int64_t j = 0;
    if (bf)  /* x is split_pairs()'s copy: a bf16 pair widens with one AND and one shift */
        for (; j + 2 * LANES <= k; j += 2 * LANES)
            for (int r = 0; r < R; r++) {
                vwu pair;
                memcpy(&pair, (const uint16_t *)a[r] + j, sizeof pair);
                const vw even = (vw)(pair << 16), odd = (vw)(pair & 0xffff0000u);
                for (int t = 0; t < T; t++) {
                    s0[r][t] += even * loadw(x + t * k, j, 0);
                    s1[r][t] += odd * loadw(x + t * k, j + LANES, 0);
                }
            }
    for (; j + 2 * LANES <= k; j += 2 * LANES)
        for (int r = 0; r < R; r++) {
            const vw a0 = loadw(a[r], j, bf), a1 = loadw(a[r], j + LANES, bf);
            for (int t = 0; t < T; t++) {
                s0[r][t] += a0 * loadw(x + t * k, j, 0);
                s1[r][t] += a1 * loadw(x + t * k, j + LANES, 0);
            }
        }
    if (!bf && j + LANES <= k) {
        for (int r = 0; r < R; r++) {
            const vw a0 = loadw(a[r], j, bf);
            for (int t = 0; t < T; t++)
                s0[r][t] += a0 * loadw(x + t * k, j, 0);
        }
        j += LANES;
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            float s = hsumw(s0[r][t] + s1[r][t]);
            for (int64_t i = j; i < k; i++)  /* fmaf: one rounding whatever the dtype */
                s = fmaf(elem(a[r], i, bf), x[t * k + i], s);
            y[r + t * width] = s;
        }
}

/* dots() of R rows with T tokens, R * T <= 4: the chains registers hold */
static inline __attribute__((always_inline)) void dots_block(const void *const *a, int R,
                                                             const float *x, int64_t k,
                                                             float *y, int64_t width, int T,
                                                             const int bf)
{
    switch (R * 4 + T) {
    case 4 + 1: dots(a, 1, x, k, y, width, 1, bf); break;
    case 4 + 2: dots(a, 1, x, k, y, width, 2, bf); break;
    case 4 + 3: dots(a, 1, x, k, y, width, 3, bf); break;
    case 4 + 4: dots(a, 1, x, k, y, width, 4, bf); break;
    case 8 + 1: dots(a, 2, x, k, y, width, 1, bf); break;
    case 8 + 2: dots(a, 2, x, k, y, width, 2, bf); break;
    default: dots(a, 4, x, k, y, width, 1, bf); break;
    }
}

/*
 * y[t, :] = concat_m(W_m x[t]) for t < T, W_m [rows[m], k], y rows `width` floats apart,
 * over the concatenated rows [lo, hi): `most` rows at a time (R * T <= 4), each row of W
 * read once for up to 4 tokens. W float32 (bf 0) or bf16 (bf 1).
 */
static inline __attribute__((always_inline)) void project_rows(
    const void *const *w, const int64_t *rows, const float *x, float *y, int64_t k, int64_t T,
    int64_t width, int64_t lo, int64_t hi, int most, const int bf)
{
    const int64_t row_bytes = k * (bf ? 2 : 4);
    int m = 0;
    int64_t first = 0;  /* the first row of matrix m */
    for (int64_t i = lo; i < hi;) {
        int R = hi - i < most ? (int)(hi - i) : most;
        R = R == 3 ? 2 : R;
        const void *a[4];
        for (int r = 0; r < R; r++) {
            while (i + r - first >= rows[m])
                first += rows[m++];
            a[r] = (const char *)w[m] + (i + r - first) * row_bytes;
        }
        for (int64_t t0 = 0; t0 < T; t0 += 4)  /* 4 tokens at a time: registers */
            dots_block(a, R, x + t0 * k, k, y + t0 * width + i, width,
                       T - t0 < 4 ? (int)(T - t0) : 4, bf);
        i += R;
    }
}

/*
 * x[0, k) reordered for bf16 rows: in each block of 2 LANES, the even elements then the odd
 * ones, as a row's bf16 pairs widen (dots()); the tail past the last block stays in place.
 */
static void split_pairs(const float *x, float *out, int64_t k)
{
    int64_t j = 0;
    for (; j + 2 * LANES <= k; j += 2 * LANES)
        for (int i = 0; i < LANES; i++) {
            out[j + i] = x[j + 2 * i];
            out[j + LANES + i] = x[j + 2 * i + 1];
        }
    for (; j < k; j++)
        out[j] = x[j];
}

static void project(const void *const *w, const int64_t *rows, int count, const float *x,
                    float *y, int64_t k, int64_t T, int64_t width, int nthreads, int bf)
{
    float split[bf ? T * k : 1];
    if (bf) {
        for (int64_t t = 0; t < T; t++)
            split_pairs(x + t * k, split + t * k, k);
        x = split;
    }
    int64_t n = 0;
    for (int m = 0; m < count; m++)
        n += rows[m];
    /* Rows per block: several for few tokens while the weights come from cache; one when
     * they stream from memory, where one sequential stream per thread reads fastest. */
    const int64_t bytes = n * k * (bf ? 2 : 4);
    const int most = bytes >= 4 * PARALLEL_MIN ? 1 : T == 1 ? 4 : T == 2 ? 2 : 1;
    /* Split by multiply-adds whatever the dtype: a bf16 row costs nearly a float32 row's
     * arithmetic (it widens in registers), so halving its bytes does not halve its work. */
    if (bf)
        SPLIT(n, n * k * T, nthreads, project_rows(w, rows, x, y, k, T, width, lo, hi, most, 1));
    else
        SPLIT(n, n * k * T, nthreads, project_rows(w, rows, x, y, k, T, width, lo, hi, most, 0));
}

/* y[t, n] = W[n, k] x[t, k] for t < T */
static void matmul(const void *w, const float *x, float *y, int64_t n, int64_t k, int64_t T,
                   int nthreads, int bf)
{
    project(&w, &n, 1, x, y, k, T, n, nthreads, bf);
}

/*
 * exp(x) of 8 values x <= 0 (a softmax's scores less their maximum) without a libm call:
 * x = k ln2 + r, |r| <= ln2/2, exp(r) by its Taylor series to r^7/5040 (below float32's
 * precision there), 2^k put into the exponent bits. Within 3 ulp of expf.
 */
static inline v8 exp8_nonpositive(v8 x)
{
    const v8 floor = {-87, -87, -87, -87, -87, -87, -87, -87};  /* exp: ~1e-38 */
    const v8 magic = {12582912, 12582912, 12582912, 12582912,  /* 1.5 * 2^23 */
                      12582912, 12582912, 12582912, 12582912};
    const v8i above = x > floor;
    x = (v8)(((v8i)x & above) | ((v8i)floor & ~above));
    const v8 k = (x * 1.44269504f + magic) - magic;  /* round to nearest */
    const v8 r = (x - k * 0.693145752f) - k * 1.42860677e-6f;  /* ln2 in two parts */
    v8 p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (v8)((__builtin_convertvector(k, v8i) + 127) << 23);
}

/* exp8_nonpositive over n floats at s, less `top` first */
static void exp_nonpositive(float *s, int64_t n, float top)
{
    int64_t r = 0;
    for (; r + 8 <= n; r += 8)
        store8(s + r, exp8_nonpositive(load8(s + r) - top));
    if (r < n) {  /* the tail through the same lanes: every value gets the same bits */
        float tail[8] = {0};
        memcpy(tail, s + r, (size_t)(n - r) * sizeof(float));
        store8(tail, exp8_nonpositive(load8(tail) - top));
        memcpy(s + r, tail, (size_t)(n - r) * sizeof(float));
    }
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* out = x * rsqrt(mean(x^2) + eps) * w */
static void rms_norm(const float *x, const float *w, float *out, int64_t n, float eps)
{
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++)
        ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++)
        out[i] = x[i] * r * w[i];
}

static void l2_norm(float *x, int64_t n, float scale)
{
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++)
        ss += x[i] * x[i];
    float r = scale / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++)
        x[i] *= r;
}

/* h[t] += W_down (silu(W_gate x) * W_up x), x = post_norm(h[t]) */
static void mlp(const struct fr_layer *L, float *h, float *x, float *g, float *u, int64_t T)
{
    const int64_t H = L->hidden, I = L->inter;
    const void *w[2] = {L->w_gate, L->w_up};
    const int64_t rows[2] = {I, I};
    for (int64_t t = 0; t < T; t++)
        rms_norm(h + t * H, L->post_norm, x + t * H, H, L->eps);
    project(w, rows, 2, x, g, H, T, 2 * I, L->nthreads, L->w_bf16);  /* g[t] = [gate | up] */
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < I; i++)
            u[t * I + i] = silu(g[t * 2 * I + i]) * g[t * 2 * I + I + i];
    matmul(L->w_down, u, x, H, I, T, L->nthreads, L->w_bf16);
    for (int64_t i = 0; i < T * H; i++)
        h[i] += x[i];
}

static void delta_heads(const struct fr_layer *L, const float *q, const float *k,
                        const float *v, const float *z, const float *b, const float *a,
                        float *o, int64_t lo, int64_t hi);

/* One token's conv + gated delta rule + gated norm; p is its canonical projection row. */
static void delta_token(const struct fr_layer *L, float *p, float *o)
{
    const int64_t hk = L->hk, hv = L->hv, dk = L->dk, dv = L->dv, K = L->conv_k;
    const int64_t conv_dim = 2 * hk * dk + hv * dv;
    /* conv: shift the token into the window (as the window stores it: a bf16 window
     * rounds it), then one K-tap dot product per channel over the window */
    const int bf = (int)L->conv_bf16;
    for (int64_t c = 0; c < conv_dim; c++) {
        float acc = L->conv_b ? L->conv_b[c] : 0.0f;
        if (bf) {
            uint16_t *s = (uint16_t *)L->conv_state + c * K;
            memmove(s, s + 1, (size_t)(K - 1) * sizeof *s);
            s[K - 1] = bf16_round(p[c]);
            for (int64_t t = 0; t < K; t++)
                acc += bf16_float(s[t]) * L->conv_w[c * K + t];
        } else {
            float *s = (float *)L->conv_state + c * K;
            for (int64_t t = 0; t + 1 < K; t++)
                s[t] = s[t + 1];
            s[K - 1] = p[c];
            for (int64_t t = 0; t < K; t++)
                acc += s[t] * L->conv_w[c * K + t];
        }
        p[c] = silu(acc);
    }
    float *q = p, *k = p + hk * dk, *v = p + 2 * hk * dk, *z = p + conv_dim;
    float *b = z + hv * dv, *a = b + hv;
    for (int64_t i = 0; i < hk; i++) {
        l2_norm(q + i * dk, dk, 1.0f / sqrtf((float)dk));
        l2_norm(k + i * dk, dk, 1.0f);
    }
    SPLIT(hv, hv * dk * dv, L->nthreads, delta_heads(L, q, k, v, z, b, a, o, lo, hi));
}

/* The gated delta rule of value heads [lo, hi) for one token (see delta_token). */
static void delta_heads(const struct fr_layer *L, const float *q, const float *k,
                        const float *v, const float *z, const float *b, const float *a,
                        float *o, int64_t lo, int64_t hi)
{
    const int64_t dk = L->dk, dv = L->dv, r = L->hv / L->hk;
    for (int64_t h = lo; h < hi; h++) {
        const float *qh = q + (h / r) * dk, *kh = k + (h / r) * dk, *vh = v + h * dv;
        float *S = L->recurrent + h * dk * dv, *oh = o + h * dv;
        const float decay = expf(L->neg_a[h] * softplus(a[h] + L->dt_bias[h]));
        const float beta = sigmoid(b[h]);
        float mem[dv];
        for (int64_t j = 0; j < dv; j++)
            mem[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            float *row = S + i * dv;
            for (int64_t j = 0; j < dv; j++) {
                row[j] *= decay;
                mem[j] += row[j] * kh[i];
            }
        }
        for (int64_t j = 0; j < dv; j++) {
            mem[j] = (vh[j] - mem[j]) * beta;
            oh[j] = 0.0f;
        }
        for (int64_t i = 0; i < dk; i++) {
            float *row = S + i * dv;
            for (int64_t j = 0; j < dv; j++) {
                row[j] += kh[i] * mem[j];
                oh[j] += row[j] * qh[i];
            }
        }
        float ss = 0.0f;  /* gated RMSNorm of the head's output */
        for (int64_t j = 0; j < dv; j++)
            ss += oh[j] * oh[j];
        float rs = 1.0f / sqrtf(ss / (float)dv + L->eps);
        for (int64_t j = 0; j < dv; j++)
            oh[j] = L->gate_norm[j] * (oh[j] * rs) * silu(z[h * dv + j]);
    }
}

/*
 * save: NULL, or room for T - 1 states (conv [C, K] then recurrent [Hv, Dk, Dv] each); the
 * state after token t < T - 1 is copied there, so a verify can commit a shorter prefix.
 */
static void gated_delta(const struct fr_layer *L, const float *x, float *out, float *buf,
                        int64_t T, float *save)
{
    const int64_t hv = L->hv, dv = L->dv, H = L->hidden;
    const int64_t conv_dim = 2 * L->hk * L->dk + hv * dv, width = conv_dim + hv * dv + 2 * hv;
    const int64_t conv_n = conv_dim * L->conv_k, rec_n = hv * L->dk * dv;
    const size_t conv_bytes = (size_t)conv_n * (L->conv_bf16 ? 2 : 4);
    float *raw = buf, *p = raw + T * width, *o = p + T * width;
    int count = 0;
    while (count < 4 && L->w_proj[count])
        count++;
    project(L->w_proj, L->proj_rows, count, x, L->proj_perm ? raw : p, H, T, width,
            L->nthreads, L->w_bf16);
    for (int64_t t = 0; t < T; t++) {
        if (L->proj_perm)
            for (int64_t i = 0; i < width; i++)
                p[t * width + i] = raw[t * width + L->proj_perm[i]];
        delta_token(L, p + t * width, o + t * hv * dv);
        if (save && t < T - 1) {
            memcpy(save + t * (conv_n + rec_n), L->conv_state, conv_bytes);
            memcpy(save + t * (conv_n + rec_n) + conv_n, L->recurrent,
                   (size_t)rec_n * sizeof(float));
        }
    }
    matmul(L->w_out, o, out, H, hv * dv, T, L->nthreads, L->w_bf16);
}

static void rope(float *x, const float *cosv, const float *sinv, int64_t rot)
{
    const int64_t half = rot / 2;
    for (int64_t i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cosv[i] - x2 * sinv[i];
        x[i + half] = x2 * cosv[i] + x1 * sinv[i];
    }
}

/* Ask for the cache lines of n bytes at p (rows a page apart defeat the hardware's). */
static inline void prefetch_row(const char *p, int64_t n)
{
    for (int64_t i = 0; i < n; i += 64)
        __builtin_prefetch(p + i, 0, 0);
}

#if defined(__clang__)
#define SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* [x0+x1, x2+x3, y0+y1, y2+y3, x4+x5, x6+x7, y4+y5, y6+y7] (AVX's vhaddps) */
static inline v8 pairs8(v8 x, v8 y)
{
    return SHUFFLE8(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE8(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* Lane r: the sum of the 8 lanes of a[r], ((0+1)+(2+3))+((4+5)+(6+7)) for every r */
static inline v8 hsum8x8(const v8 *a)
{
    const v8 q0 = pairs8(pairs8(a[0], a[1]), pairs8(a[2], a[3]));
    const v8 q1 = pairs8(pairs8(a[4], a[5]), pairs8(a[6], a[7]));
    return SHUFFLE8(q0, q1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE8(q0, q1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/*
 * s[r] = scaling * q . k_r for rows r < n of kb (rows `stride` bytes apart, d % 8 == 0,
 * float32 or bf16 as bf): 8 rows at a time, each row's products in its own register and
 * the 8 sums reduced together. A block past the end repeats the last row, so every score
 * is formed the same way wherever it sits. Returns the largest score.
 */
static inline __attribute__((always_inline)) float scores8(
    const float *restrict q, const char *restrict kb, int64_t n, int64_t stride, int64_t d,
    float scaling, int64_t ahead, float *restrict s, const int bf)
{
    v8 best = {-INFINITY, -INFINITY, -INFINITY, -INFINITY,
               -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    for (int64_t r0 = 0; r0 < n; r0 += 8) {
        const char *rows[8];
        for (int r = 0; r < 8; r++)
            rows[r] = kb + (r0 + r < n ? r0 + r : n - 1) * stride;
        if (ahead)
            for (int r = 0; r < 8; r++)
                prefetch_row(rows[r] + ahead, d * (bf ? 2 : 4));
        v8 acc[8];
        for (int r = 0; r < 8; r++)
            acc[r] = (v8){0};
        for (int64_t i = 0; i < d; i += 8) {
            const v8 qi = load8(q + i);
            for (int r = 0; r < 8; r++)
                acc[r] += qi * load8w(rows[r], i, bf);
        }
        const v8 sc = hsum8x8(acc) * scaling;
        best = (v8)(((v8i)best & (v8i)(best >= sc)) | ((v8i)sc & (v8i)(best < sc)));
        if (r0 + 8 <= n) {
            store8(s + r0, sc);
        } else {
            float tail[8];
            store8(tail, sc);
            memcpy(s + r0, tail, (size_t)(n - r0) * sizeof(float));
        }
    }
    float top = best[0];
    for (int r = 1; r < 8; r++)
        top = best[r] > top ? best[r] : top;
    return top;
}

/*
 * out[c..c + 8 NV) = sum over rows r < n, in order, of p[r] * v_r[c..c + 8 NV): NV
 * registers of sums (NV and bf constants after inlining; rows `stride` bytes apart).
 */
static inline __attribute__((always_inline)) void weigh_rows(
    const char *restrict vb, int64_t stride, const float *restrict p, int64_t n, int64_t c,
    float *restrict out, int64_t ahead, int64_t d, const int NV, const int bf)
{
    v8 acc[8];
    for (int i = 0; i < NV; i++)
        acc[i] = (v8){0};
    for (int64_t r = 0; r < n; r++) {
        const char *vr = vb + r * stride;
        if (ahead)
            prefetch_row(vr + ahead, d * (bf ? 2 : 4));
        const float pr = p[r];
        for (int i = 0; i < NV; i++)
            acc[i] += pr * load8w(vr, c + 8 * i, bf);
    }
    for (int i = 0; i < NV; i++)
        store8(out + c + 8 * i, acc[i]);
}

/* weigh_rows() over all d dims (d % 8 == 0), 64 at a time: the sums stay in registers */
static inline __attribute__((always_inline)) void weigh(const char *vb, int64_t stride,
                                                        const float *p, int64_t n, float *out,
                                                        int64_t ahead, int64_t d, const int bf)
{
    for (int64_t c = 0; c < d; c += 64) {
        const int64_t pf = c == 0 ? ahead : 0;  /* each row is asked for once */
        switch (d - c >= 64 ? 8 : (int)((d - c) / 8)) {
        case 1: weigh_rows(vb, stride, p, n, c, out, pf, d, 1, bf); break;
        case 2: weigh_rows(vb, stride, p, n, c, out, pf, d, 2, bf); break;
        case 3: weigh_rows(vb, stride, p, n, c, out, pf, d, 3, bf); break;
        case 4: weigh_rows(vb, stride, p, n, c, out, pf, d, 4, bf); break;
        case 5: weigh_rows(vb, stride, p, n, c, out, pf, d, 5, bf); break;
        case 6: weigh_rows(vb, stride, p, n, c, out, pf, d, 6, bf); break;
        case 7: weigh_rows(vb, stride, p, n, c, out, pf, d, 7, bf); break;
        default: weigh_rows(vb, stride, p, n, c, out, pf, d, 8, bf); break;
        }
    }
}

/*
 * Softmax attention of the `groups` query heads of kv head g over cache rows [lo, hi): a
 * span's key and value rows stay in cache for all of them. Leaves, per head, the running
 * max, the sum of exponentials and the unnormalised output (acc [groups, d]).
 */
static inline __attribute__((always_inline)) void attend_span(
    const struct fr_layer *L, const float *restrict q, int64_t g, int64_t lo, int64_t hi,
    float *restrict s, float *restrict top, float *restrict sum, float *restrict acc,
    const int bf)
{
    const int64_t d = L->hd, groups = L->hq / L->hkv, n = hi - lo, es = bf ? 2 : 4;
    const int64_t stride = L->seq_stride * es;  /* bytes */
    const float scaling = L->scaling;
    /* Rows are a whole arena row apart (one page or more): prefetch a few ahead. */
    const int64_t rows_ahead = PREFETCH_BYTES / stride;
    const int64_t ahead = (rows_ahead > 2 ? rows_ahead : 2) * stride;
    const char *restrict kb = (const char *)L->keys + (g * L->head_stride) * es + lo * stride;
    const char *restrict vb = (const char *)L->values + (g * L->head_stride) * es + lo * stride;
    if (d % 8 == 0) {  /* head dims are multiples of 8 in practice */
        for (int64_t j = 0; j < groups; j++)
            top[j] = scores8(q + (g * groups + j) * 2 * d, kb, n, stride, d, scaling,
                             j == 0 ? ahead : 0, s + j * n, bf);
    } else {
        for (int64_t j = 0; j < groups; j++) {
            top[j] = -INFINITY;
            for (int64_t r = 0; r < n; r++) {
                const float v = dot(q + (g * groups + j) * 2 * d, kb + r * stride, d, bf)
                                * scaling;
                s[j * n + r] = v;
                top[j] = v > top[j] ? v : top[j];
            }
        }
    }
    for (int64_t j = 0; j < groups; j++) {
        exp_nonpositive(s + j * n, n, top[j]);
        sum[j] = 0.0f;
        for (int64_t r = 0; r < n; r++)
            sum[j] += s[j * n + r];
    }
    for (int64_t j = 0; j < groups; j++) {
        float *a = acc + j * d;
        if (d % 8 == 0) {
            weigh(vb, stride, s + j * n, n, a, j == 0 ? ahead : 0, d, bf);
        } else {
            for (int64_t i = 0; i < d; i++)
                a[i] = 0.0f;
            for (int64_t r = 0; r < n; r++)
                for (int64_t i = 0; i < d; i++)
                    a[i] += s[j * n + r] * elem(vb + r * stride, i, bf);
        }
    }
}

/*
 * Spans [lo, hi) of attention(), each for every kv head in turn (the heads of a row are
 * adjacent: a span's rows are read whole), results in scores at (kv head, span).
 */
static void attend_items(const struct fr_layer *L, const float *q, int64_t kv_len,
                         int64_t spans, float *scores, int64_t lo, int64_t hi)
{
    const int64_t groups = L->hq / L->hkv, item = groups * (SPAN + L->hd + 2);
    for (int64_t sp = lo; sp < hi; sp++) {
        const int64_t first = sp * SPAN, last = first + SPAN < kv_len ? first + SPAN : kv_len;
        for (int64_t g = 0; g < L->hkv; g++) {
            float *s = scores + (g * spans + sp) * item, *top = s + groups * SPAN;
            if (L->kv_bf16)
                attend_span(L, q, g, first, last, s, top, top + groups, top + 2 * groups, 1);
            else
                attend_span(L, q, g, first, last, s, top, top + groups, top + 2 * groups, 0);
        }
    }
}

/*
 * Token t sits at cache row pos0 + t and attends to rows [0, pos0 + t]. The rows are cut
 * into spans of SPAN; each (kv head, span) is a work item and the spans of a head merge in
 * order, so the result does not depend on the number of threads.
 */
static void attention(const struct fr_layer *L, const float *x, float *out, float *buf,
                      int64_t T, int64_t pos0)
{
    const int64_t hq = L->hq, hkv = L->hkv, d = L->hd, groups = hq / hkv, H = L->hidden;
    float *qg = buf, *att = qg + T * (2 * hq * d + 2 * hkv * d);
    float *cosv = att + T * hq * d, *sinv = cosv + L->rot, *scores = sinv + L->rot;
    const void *w[3] = {L->w_q, L->w_k, L->w_v};
    const int64_t rows[3] = {2 * hq * d, hkv * d, hkv * d}, width = 2 * hq * d + 2 * hkv * d;
    const int64_t es = L->kv_bf16 ? 2 : 4;
    project(w, rows, 3, x, qg, H, T, width, L->nthreads, L->w_bf16);  /* qg[t]=[q | k | v] */
    for (int64_t t = 0; t < T; t++) {
        const int64_t pos = pos0 + t, kv_len = pos + 1;
        float *q = qg + t * width, *k = q + 2 * hq * d, *v = k + hkv * d;
        for (int64_t i = 0; i < L->rot / 2; i++) {
            float f = (float)(pos + L->rope_offset) * L->inv_freq[i];
            cosv[i] = cosv[i + L->rot / 2] = cosf(f) * L->rope_scale;
            sinv[i] = sinv[i + L->rot / 2] = sinf(f) * L->rope_scale;
        }
        for (int64_t h = 0; h < hq; h++) {  /* q_proj rows are [q | gate] per head */
            rms_norm(q + h * 2 * d, L->q_norm, q + h * 2 * d, d, L->eps);
            rope(q + h * 2 * d, cosv, sinv, L->rot);
        }
        for (int64_t g = 0; g < hkv; g++) {
            rms_norm(k + g * d, L->k_norm, k + g * d, d, L->eps);
            rope(k + g * d, cosv, sinv, L->rot);
            const int64_t at = (g * L->head_stride + pos * L->seq_stride) * es;
            put_row((char *)L->keys + at, k + g * d, d, (int)L->kv_bf16);
            put_row((char *)L->values + at, v + g * d, d, (int)L->kv_bf16);
        }
        *L->length += 1;
        const int64_t spans = (kv_len + SPAN - 1) / SPAN, item = groups * (SPAN + d + 2);
        /* Parallel from 1 MiB of keys: below it one thread reads the rows about as fast,
         * and the first step after an idle moment does not wait for the pool to wake. */
        SPLIT(spans, hkv * kv_len * d, L->nthreads,
              attend_items(L, q, kv_len, spans, scores, lo, hi));
        for (int64_t h = 0; h < hq; h++) {
            const int64_t g = h / groups, j = h % groups;
            float best = -INFINITY, total = 0.0f, *oh = att + t * hq * d + h * d;
            for (int64_t sp = 0; sp < spans; sp++) {
                const float m = scores[(g * spans + sp) * item + groups * SPAN + j];
                best = m > best ? m : best;
            }
            for (int64_t i = 0; i < d; i++)
                oh[i] = 0.0f;
            for (int64_t sp = 0; sp < spans; sp++) {
                const float *base = scores + (g * spans + sp) * item + groups * SPAN;
                const float c = expf(base[j] - best), *acc = base + 2 * groups + j * d;
                total += c * base[groups + j];
                for (int64_t i = 0; i < d; i++)
                    oh[i] += c * acc[i];
            }
            for (int64_t i = 0; i < d; i++)
                oh[i] = oh[i] / total * sigmoid(q[h * 2 * d + d + i]);
        }
    }
    matmul(L->w_o, att, out, H, hq * d, T, L->nthreads, L->w_bf16);
}

/*
 * T tokens through one layer: h[t] += mixer(in_norm(h[t])); h[t] += mlp(post_norm(h[t])).
 * Token t is at the layer's cache row pos0 + t. save: see gated_delta (attention: unused).
 */
static void layer(const struct fr_layer *L, float *h, int64_t T, int64_t pos0, float *save)
{
    const int64_t H = L->hidden;
    float *x = L->scratch, *mixed = x + T * H, *g = mixed + T * H, *u = g + 2 * T * L->inter;
    float *buf = u + T * L->inter;
    for (int64_t t = 0; t < T; t++)
        rms_norm(h + t * H, L->in_norm, x + t * H, H, L->eps);
    if (L->kind == 0)
        gated_delta(L, x, mixed, buf, T, save);
    else
        attention(L, x, mixed, buf, T, pos0);
    for (int64_t i = 0; i < T * H; i++)
        h[i] += mixed[i];
    mlp(L, h, x, g, u, T);
}

/*
 * Layers [from, count) in order; saves: NULL or one pointer (or NULL) per layer. After the
 * first, a layer is not started while *stop is set (a waiting preemption: the caller meets
 * it there, as a module call would). Returns the index of the first layer not run.
 */
int64_t fr_layers(struct fr_layer *layers, int64_t from, int64_t count, float *h, int64_t T,
                  int64_t pos0, float *const *saves, int64_t nthreads,
                  const volatile int32_t *stop)
{
    for (int64_t i = from; i < count; i++) {
        if (i > from && *stop)
            return i;
        layers[i].nthreads = nthreads;
        layer(&layers[i], h, T, pos0, saves ? saves[i] : NULL);
    }
    return count;
}

/* n floats from row `row` of a float32 or bf16 table */
static void get_row(const void *table, int64_t row, int64_t n, float *out, int bf)
{
    if (!bf) {
        memcpy(out, (const float *)table + row * n, (size_t)n * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < n; i++)
        out[i] = bf16_float(((const uint16_t *)table)[row * n + i]);
}

/* h[t] = embedding row tokens[t] (bf: the weights are bf16) */
void fr_embed(const void *table, const int64_t *tokens, int64_t T, float *h, int64_t hidden,
              int64_t bf)
{
    for (int64_t t = 0; t < T; t++)
        get_row(table, tokens[t], hidden, h + t * hidden, (int)bf);
}

/* normed[t] = norm(h[t]); logits[t] = W normed[t] (W NULL: no logits) */
void fr_head(const float *h, const float *norm, float eps, const void *w, float *logits,
             float *normed, int64_t hidden, int64_t vocab, int64_t T, int64_t nthreads,
             int64_t bf)
{
    for (int64_t t = 0; t < T; t++)
        rms_norm(h + t * hidden, norm, normed + t * hidden, hidden, eps);
    if (w)
        matmul(w, normed, logits, vocab, hidden, T, (int)nthreads, (int)bf);
}

/*
 * The MTP head's input: out[t] = fc([norm_e(embed(tokens[t])); norm_h(prev[t])]).
 * cat: scratch of T * 2H floats.
 */
void fr_mtp_input(const void *table, const int64_t *tokens, const float *prev,
                  const float *norm_e, const float *norm_h, float eps, const void *fc,
                  float *out, float *cat, int64_t hidden, int64_t T, int64_t nthreads,
                  int64_t bf)
{
    for (int64_t t = 0; t < T; t++) {
        float *e = cat + t * 2 * hidden;
        get_row(table, tokens[t], hidden, e, (int)bf);
        rms_norm(e, norm_e, e, hidden, eps);
        rms_norm(prev + t * hidden, norm_h, e + hidden, hidden, eps);
    }
    matmul(fc, cat, out, hidden, 2 * hidden, T, (int)nthreads, (int)bf);
}

/* The vector width this build's weight products use (cpu_step.py chose it by timing). */
int64_t fr_lanes(void) { return LANES; }
