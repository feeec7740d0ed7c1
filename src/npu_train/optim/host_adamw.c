/* One-pass host AdamW of one offloaded tensor (npu_train.optim.onepass): read the gradient (fp32 or bf16),
 * scale it by the clip coefficient, update the fp32 master and both fp32 moments, and write the
 * compute-dtype copy (bf16 or fp32) for the upload -- one sweep over memory, 28 B/param with bf16.
 *
 * Operation order is that of torch's fused CPU AdamW (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
 * ADAMW mode, fp32, as built for AVX2/AVX512): decoupled decay p *= (1 - lr*wd); m = fma(w, g - m, m)
 * (lerp with w = 1 - beta1 < 0.5, else fma(w - 1, g - m, g)); v = fma(c2*g, g, v*beta2) in the vectorized
 * body and fma(v, beta2, (c2*g)*g) in the scalar tail (the last n % vector-width elements: torch's build
 * contracts the two expressions differently); p = p + (-step_size*m) / (sqrt(v)/bc2_sqrt + eps).
 * fused = 0 (a build without fma): every product and sum rounded on its own. The scalars are computed by the caller in
 * double exactly as torch does and rounded to float. Compiled with -ffp-contract=off so that only the
 * explicit fmaf calls fuse. bf16 out: round to nearest even, NaN -> 0x7fc0 (c10::BFloat16).
 * The clip is g * clip in fp32 (torch's mul_ by a Python float), skipped at clip == 1 (x * 1 == x). */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    float *p, *m, *v;
    const void *g;
    void *out;
    int64_t begin, end;
    int64_t tail_from;  /* elements from here on take torch's scalar-tail order */
    int g_bf16, out_kind, do_clip, do_decay, small_w, fused, probe;
    float clip, decay, w, beta2, c2, bc2s, eps, neg_step;
} npt_job;

static inline float bf16_to_f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One element range [b, e) of job j; G_BF16, OUT, FUSED, BODY are constants at every call (one loop
 * each, vectorized by the compiler): BODY 1 = torch's vectorized body, 0 = its scalar tail. */
static inline __attribute__((always_inline)) void sweep(const npt_job *j, int64_t b, int64_t e, const int G_BF16,
                                                        const int OUT, const int FUSED, const int BODY) {
    float *restrict p = j->p, *restrict m = j->m, *restrict v = j->v;
    const float *restrict gf = (const float *)j->g;
    const uint16_t *restrict gh = (const uint16_t *)j->g;
    uint16_t *restrict oh = (uint16_t *)j->out;
    float *restrict of = (float *)j->out;
    const float clip = j->clip, decay = j->decay, beta2 = j->beta2, c2 = j->c2;
    const float bc2s = j->bc2s, eps = j->eps, neg_step = j->neg_step;
    /* lerp(m, g, w) as torch writes it: small weight m + w*(g - m), else g + (w - 1)*(g - m) (exact w - 1) */
    const float lw = j->small_w ? j->w : j->w - 1.0f, lbase = j->small_w ? 0.0f : 1.0f;
    const int do_clip = j->do_clip, do_decay = j->do_decay;
    for (int64_t i = b; i < e; i++) {
        float g = G_BF16 ? bf16_to_f(gh[i]) : gf[i];
        g = do_clip ? g * clip : g;
        float pi = p[i];
        pi = do_decay ? pi * decay : pi;
        float mi = m[i];
        float base = lbase != 0.0f ? g : mi;
        mi = FUSED ? fmaf(lw, g - mi, base) : base + lw * (g - mi);
        float vi;
        if (!FUSED) vi = v[i] * beta2 + (c2 * g) * g;
        else if (BODY) vi = fmaf(c2 * g, g, v[i] * beta2);
        else vi = fmaf(v[i], beta2, (c2 * g) * g);
        m[i] = mi;
        v[i] = vi;
        pi = pi + (neg_step * mi) / (sqrtf(vi) / bc2s + eps);
        p[i] = pi;
        if (OUT == 1) oh[i] = f_to_bf16(pi);
        if (OUT == 2) of[i] = pi;
    }
}

#define NPT_SWEEPS(GB, OUT)                                                   \
    do {                                                                      \
        if (j->fused) {                                                       \
            sweep(j, j->begin, split, GB, OUT, 1, 1);                         \
            sweep(j, split, j->end, GB, OUT, 1, 0);                           \
        } else {                                                              \
            sweep(j, j->begin, j->end, GB, OUT, 0, 0);                        \
        }                                                                     \
    } while (0)

/* The bandwidth probe (npt_stream_probe): the loads and stores of sweep() -- gradient in, master and both
 * moments read and written in place, the copy out -- with one add each instead of AdamW's arithmetic, so its
 * time is the memory traffic of the update alone (the benchmark's "same traffic" limit). */
static inline __attribute__((always_inline)) void probe_sweep(const npt_job *j, int64_t b, int64_t e,
                                                              const int G_BF16, const int OUT) {
    float *restrict p = j->p, *restrict m = j->m, *restrict v = j->v;
    const float *restrict gf = (const float *)j->g;
    const uint16_t *restrict gh = (const uint16_t *)j->g;
    uint16_t *restrict oh = (uint16_t *)j->out;
    float *restrict of = (float *)j->out;
    for (int64_t i = b; i < e; i++) {
        float g = G_BF16 ? bf16_to_f(gh[i]) : gf[i];
        float pi = p[i] + g;
        m[i] = m[i] + g;
        v[i] = v[i] + g;
        p[i] = pi;
        uint32_t u;
        memcpy(&u, &pi, 4);
        if (OUT == 1) oh[i] = (uint16_t)(u >> 16);
        if (OUT == 2) of[i] = pi;
    }
}

static void run_probe(const npt_job *j) {
    switch (j->g_bf16 * 3 + j->out_kind) {
        case 0: probe_sweep(j, j->begin, j->end, 0, 0); break;
        case 1: probe_sweep(j, j->begin, j->end, 0, 1); break;
        case 2: probe_sweep(j, j->begin, j->end, 0, 2); break;
        case 3: probe_sweep(j, j->begin, j->end, 1, 0); break;
        case 4: probe_sweep(j, j->begin, j->end, 1, 1); break;
        default: probe_sweep(j, j->begin, j->end, 1, 2); break;
    }
}

static void run(const npt_job *j) {
    if (j->probe) {
        run_probe(j);
        return;
    }
    int64_t split = j->tail_from < j->begin ? j->begin : (j->tail_from > j->end ? j->end : j->tail_from);
    switch (j->g_bf16 * 3 + j->out_kind) {
        case 0: NPT_SWEEPS(0, 0); break;
        case 1: NPT_SWEEPS(0, 1); break;
        case 2: NPT_SWEEPS(0, 2); break;
        case 3: NPT_SWEEPS(1, 0); break;
        case 4: NPT_SWEEPS(1, 1); break;
        default: NPT_SWEEPS(1, 2); break;
    }
}

static void *run_thread(void *arg) {
    run((const npt_job *)arg);
    return NULL;
}

static int run_all(float *p, float *m, float *v, const void *g, int g_bf16, void *out, int out_kind,
                   int64_t n, float clip, int do_clip, float decay, int do_decay, float w, float beta2,
                   float c2, float bc2s, float eps, float neg_step, int64_t tail_from, int fused, int threads,
                   int probe) {
    enum { MAXT = 256 };
    npt_job jobs[MAXT];
    pthread_t tid[MAXT];
    int started[MAXT];
    if (threads < 1) threads = 1;
    if (threads > MAXT) threads = MAXT;
    const int64_t unit = 64;  /* chunk boundaries on whole cache lines of every array */
    int64_t units = (n + unit - 1) / unit;
    if (threads > units) threads = units > 0 ? (int)units : 1;
    int rc = 0;
    for (int t = 0; t < threads; t++) {
        npt_job *j = &jobs[t];
        j->p = p; j->m = m; j->v = v; j->g = g; j->out = out;
        j->begin = units * t / threads * unit;
        j->end = units * (t + 1) / threads * unit;
        if (j->end > n) j->end = n;
        j->g_bf16 = g_bf16; j->out_kind = out_kind; j->do_clip = do_clip; j->do_decay = do_decay;
        j->small_w = fabsf(w) < 0.5f;
        j->tail_from = tail_from; j->fused = fused;
        j->clip = clip; j->decay = decay; j->w = w; j->beta2 = beta2; j->c2 = c2;
        j->bc2s = bc2s; j->eps = eps; j->neg_step = neg_step; j->probe = probe;
        started[t] = 0;
    }
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tid[t], NULL, run_thread, &jobs[t]) == 0) started[t] = 1;
        else rc = -1;
    }
    run(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else run(&jobs[t]);
    }
    return rc;
}

/* Returns 0, or -1 when a thread could not be started (the work is then done on the calling thread). */
int npt_adamw_onepass(float *p, float *m, float *v, const void *g, int g_bf16, void *out, int out_kind,
                      int64_t n, float clip, int do_clip, float decay, int do_decay, float w, float beta2,
                      float c2, float bc2s, float eps, float neg_step, int64_t tail_from, int fused, int threads) {
    return run_all(p, m, v, g, g_bf16, out, out_kind, n, clip, do_clip, decay, do_decay, w, beta2, c2, bc2s, eps,
                   neg_step, tail_from, fused, threads, 0);
}

/* The memory traffic of npt_adamw_onepass with the same arrays and threads, without its arithmetic
 * (probe_sweep: p, m, v each += g; the copy out is p's upper 16 bits). Changes p, m and v. */
int npt_stream_probe(float *p, float *m, float *v, const void *g, int g_bf16, void *out, int out_kind, int64_t n,
                     int threads) {
    return run_all(p, m, v, g, g_bf16, out, out_kind, n, 1.0f, 0, 1.0f, 0, 0.0f, 0.0f, 0.0f, 1.0f, 0.0f, 0.0f, n,
                   0, threads, 1);
}
