/*
 * A self-contained run of cpu_step.c for a build without Python (a cross-compiled one run
 * under qemu): a gated-DeltaNet layer and an attention layer with seeded weights, float32
 * or bf16 (argv[1] "bf16"). It checks that four tokens in one call give the bits of four
 * one-token calls (outputs and state), then prints the outputs for another build to compare.
 */
#include "cpu_step.c"

#include <stdio.h>
#include <stdlib.h>

enum { H = 40, I = 72, HK = 2, HV = 4, DK = 16, DV = 16, CK = 4, HQ = 4, HKV = 2, D = 16,
       ROT = 8, LEN = 96, T = 4, WARM = 70 };

static uint64_t seed = 12345;

static float rnd(float scale)  /* uniform in [-scale, scale) from a fixed LCG */
{
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return scale * ((float)(seed >> 40) / (float)(1 << 23) - 1.0f);
}

/* n seeded values as float32, or as bf16 when bf; the caller frees */
static void *weights(int64_t n, float scale, int bf)
{
    float *f = malloc((size_t)n * sizeof *f);
    for (int64_t i = 0; i < n; i++)
        f[i] = rnd(scale);
    if (!bf)
        return f;
    uint16_t *h = malloc((size_t)n * sizeof *h);
    for (int64_t i = 0; i < n; i++)
        h[i] = bf16_round(f[i]);
    free(f);
    return h;
}

static float *ones(int64_t n, float v)
{
    float *f = malloc((size_t)n * sizeof *f);
    for (int64_t i = 0; i < n; i++)
        f[i] = v + rnd(0.1f);
    return f;
}

int main(int argc, char **argv)
{
    const int bf = argc > 1 && strcmp(argv[1], "bf16") == 0, es = bf ? 2 : 4;
    const int64_t C = 2 * HK * DK + HV * DV;
    static int64_t length;
    struct fr_layer L[2];
    memset(L, 0, sizeof L);
    float *scratch = calloc(1 << 20, sizeof(float));
    for (int i = 0; i < 2; i++) {
        L[i] = (struct fr_layer){.kind = i, .hidden = H, .inter = I, .eps = 1e-6f,
                                 .w_bf16 = bf, .conv_bf16 = bf, .kv_bf16 = bf};
        L[i].in_norm = ones(H, 1.0f);
        L[i].post_norm = ones(H, 1.0f);
        L[i].w_gate = weights(I * H, 0.2f, bf);
        L[i].w_up = weights(I * H, 0.2f, bf);
        L[i].w_down = weights(H * I, 0.2f, bf);
        L[i].scratch = scratch;
    }
    struct fr_layer *g = &L[0];
    const int64_t rows[4] = {C, HV * DV, HV, HV};
    for (int m = 0; m < 4; m++) {
        g->w_proj[m] = weights(rows[m] * H, 0.2f, bf);
        g->proj_rows[m] = rows[m];
    }
    g->conv_w = ones(C * CK, 0.0f);
    g->conv_state = calloc((size_t)(C * CK), (size_t)es);
    g->conv_k = CK, g->hk = HK, g->hv = HV, g->dk = DK, g->dv = DV;
    g->neg_a = ones(HV, -0.5f);
    g->dt_bias = ones(HV, 0.0f);
    g->gate_norm = ones(DV, 1.0f);
    g->recurrent = calloc(HV * DK * DV, sizeof(float));
    g->w_out = weights(H * HV * DV, 0.2f, bf);
    struct fr_layer *a = &L[1];
    a->w_q = weights(HQ * 2 * D * H, 0.2f, bf);
    a->w_k = weights(HKV * D * H, 0.2f, bf);
    a->w_v = weights(HKV * D * H, 0.2f, bf);
    a->w_o = weights(H * HQ * D, 0.2f, bf);
    a->q_norm = ones(D, 1.0f);
    a->k_norm = ones(D, 1.0f);
    float inv_freq[ROT / 2];
    for (int i = 0; i < ROT / 2; i++)
        inv_freq[i] = powf(10000.0f, -2.0f * i / ROT);
    a->inv_freq = inv_freq;
    a->hq = HQ, a->hkv = HKV, a->hd = D, a->rot = ROT, a->scaling = 0.25f, a->rope_scale = 1;
    a->keys = calloc(HKV * LEN * D, (size_t)es);
    a->values = calloc(HKV * LEN * D, (size_t)es);
    a->head_stride = LEN * D, a->seq_stride = D, a->length = &length;

    /* WARM tokens one at a time: attention spans more than one SPAN of rows */
    static int32_t stop;
    float h[T * H], single[T * H];
    for (int t = 0; t < WARM; t++) {
        for (int i = 0; i < H; i++)
            h[i] = rnd(1.0f);
        fr_layers(L, 0, 2, h, 1, t, NULL, 2, &stop);
    }
    const size_t conv_n = (size_t)(C * CK) * es, rec_n = HV * DK * DV * sizeof(float);
    const size_t kv_n = (size_t)(HKV * LEN * D) * es;
    char *start = malloc(conv_n + rec_n + 2 * kv_n), *after = malloc(conv_n + rec_n + 2 * kv_n);
    char *parts[4] = {g->conv_state, (char *)g->recurrent, a->keys, a->values};
    const size_t sizes[4] = {conv_n, rec_n, kv_n, kv_n};
    for (int p = 0, at = 0; p < 4; at += sizes[p++])
        memcpy(start + at, parts[p], sizes[p]);
    float x[T * H];
    for (int i = 0; i < T * H; i++)
        x[i] = rnd(1.0f);
    memcpy(single, x, sizeof x);
    for (int t = 0; t < T; t++)
        fr_layers(L, 0, 2, single + t * H, 1, WARM + t, NULL, 2, &stop);
    for (int p = 0, at = 0; p < 4; at += sizes[p++]) {
        memcpy(after + at, parts[p], sizes[p]);
        memcpy(parts[p], start + at, sizes[p]);
    }
    length -= T;
    memcpy(h, x, sizeof x);
    fr_layers(L, 0, 2, h, T, WARM, NULL, 2, &stop);
    int same = memcmp(h, single, sizeof h) == 0;
    for (int p = 0, at = 0; p < 4; at += sizes[p++])
        same = same && memcmp(after + at, parts[p], sizes[p]) == 0;
    for (int i = 0; i < T * H; i++)
        printf("%.9g\n", h[i]);
    if (!same) {
        fprintf(stderr, "a %d-token call differs from %d one-token calls\n", T, T);
        return 1;
    }
    return 0;
}
