/* Routed experts on MXFP4-packed weights in host memory, computed on the host's cores (kimik3.ops.moe.host).

Legend: J jobs (one expert and its rows each), R rows over all jobs, L latent width, F expert width.
Per job j with expert weights w1, w3 [F, L/2] codes + [F, L/32] E8M0 scales and w2 [L, F/2] + [L, F/32]:

    stage 1   h[r, f] = SiTU(round(w1[f] . x[r]), round(w3[f] . x[r]))     (rounded once more to the compute dtype)
    stage 2   y[r, l] = w2[l] . h[r]                                       (the caller rounds y to its dtype)

round() is to bf16 (round to nearest even) when `round_bf16`, else nothing (fp32 compute). The dot products decode
each 32-column group in registers: its 16 code bytes become the even (low nibbles) and odd (high nibbles) columns,
each code an E2M1 value looked up in a 16-entry table and multiplied by the group's power of two (exact), then one
fused multiply-add per value into fp32 lane accumulators. Rows arrive group-interleaved (each group's 16 even
columns, then its 16 odd ones: `kimik3.ops.moe.triton_mxfp4._interleave`'s layout), and stage 1 writes h so.

Work is split into tasks of (job, block of output rows) run by a pool of threads the library owns (the caller's
thread takes part): the pool reads weights at the host's memory bandwidth, which is what a miss costs at decode.
Built by kimik3.ops.moe.host at first use with the machine's compiler (-O3 -march=native: AVX-512 where the CPU
has it, a portable loop elsewhere). */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static float scale_of(uint8_t s) {  /* 2^(s - 127), exactly (s = 0: the subnormal 2^-127; s = 255: inf) */
    uint32_t bits = s ? (uint32_t)s << 23 : 0x00400000u;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float round_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&v, &u, 4);
    return v;
}

#define RB 8 /* rows per pass: each decoded group is used by up to RB rows */

/* out[r] = W[o] . x[r] for the n <= RB rows x (each K wide, group-interleaved, row stride K). */
static void dot_rows(const uint8_t *codes, const uint8_t *scales, int64_t K, const float *x, int n, float *out) {
    int64_t groups = K / 32;
#ifdef __AVX512F__
    const __m512 lut = _mm512_loadu_ps(E2M1);
    __m512 acc[RB];
    for (int r = 0; r < n; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + g * 16)));
        __m512 s = _mm512_set1_ps(scale_of(scales[g]));
        __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), lut), s);
        __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut), s);
        for (int r = 0; r < n; r++) {
            const float *xg = x + r * K + g * 32;
            acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg), acc[r]);
            acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), acc[r]);
        }
    }
    for (int r = 0; r < n; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
#else
    float acc[RB][16];
    memset(acc, 0, sizeof acc);
    for (int64_t g = 0; g < groups; g++) {
        float s = scale_of(scales[g]), lo[16], hi[16];
        for (int k = 0; k < 16; k++) {
            lo[k] = E2M1[codes[g * 16 + k] & 15] * s;
            hi[k] = E2M1[codes[g * 16 + k] >> 4] * s;
        }
        for (int r = 0; r < n; r++) {
            const float *xg = x + r * K + g * 32;
            for (int k = 0; k < 16; k++) acc[r][k] = fmaf(lo[k], xg[k], fmaf(hi[k], xg[16 + k], acc[r][k]));
        }
    }
    for (int r = 0; r < n; r++) {
        float t = 0.0f;
        for (int k = 0; k < 16; k++) t += acc[r][k];
        out[r] = t;
    }
#endif
}

typedef struct {
    int64_t njobs, L, F;
    const int64_t *w;        /* [J, 6]: addresses of w1 codes, w1 scales, w3 codes, w3 scales, w2 codes, w2 scales */
    const int32_t *rows;     /* [J + 1]: job j's rows are rows[j] .. rows[j + 1] */
    const float *x;          /* [R, L] group-interleaved */
    float *h;                /* [R, F] group-interleaved (stage 1 writes, stage 2 reads) */
    float *y;                /* [R, L] */
    float beta, linear_beta;
    int round;
    int stage;
    int64_t blocks_per_job;  /* output-row blocks per job in this stage */
} Work;

#define OB 32 /* output rows per task */

static float situ(float g, float u, float beta, float linear_beta) {
    float a = beta * tanhf(g / beta) * (1.0f / (1.0f + expf(-g)));
    return a * (linear_beta * tanhf(u / linear_beta));
}

static void run_task(const Work *w, int64_t task) {
    int64_t j = task / w->blocks_per_job, o0 = (task % w->blocks_per_job) * OB;
    const int64_t *p = w->w + 6 * j;
    int32_t r0 = w->rows[j], r1 = w->rows[j + 1];
    float g[RB], u[RB];
    if (w->stage == 1) {
        int64_t o1 = o0 + OB < w->F ? o0 + OB : w->F, L = w->L;
        for (int32_t r = r0; r < r1; r += RB) {
            int n = r1 - r < RB ? r1 - r : RB;
            for (int64_t o = o0; o < o1; o++) {
                dot_rows((const uint8_t *)p[0] + o * (L / 2), (const uint8_t *)p[1] + o * (L / 32), L, w->x + r * L, n, g);
                dot_rows((const uint8_t *)p[2] + o * (L / 2), (const uint8_t *)p[3] + o * (L / 32), L, w->x + r * L, n, u);
                int64_t c = (o / 32) * 32 + (o % 2) * 16 + (o % 32) / 2; /* h stored group-interleaved */
                for (int k = 0; k < n; k++) {
                    float gk = w->round ? round_bf16(g[k]) : g[k], uk = w->round ? round_bf16(u[k]) : u[k];
                    float hk = situ(gk, uk, w->beta, w->linear_beta);
                    w->h[(r + k) * w->F + c] = w->round ? round_bf16(hk) : hk;
                }
            }
        }
    } else {
        int64_t o1 = o0 + OB < w->L ? o0 + OB : w->L, F = w->F;
        for (int32_t r = r0; r < r1; r += RB) {
            int n = r1 - r < RB ? r1 - r : RB;
            for (int64_t o = o0; o < o1; o++) {
                dot_rows((const uint8_t *)p[4] + o * (F / 2), (const uint8_t *)p[5] + o * (F / 32), F, w->h + r * F, n, g);
                for (int k = 0; k < n; k++) w->y[(r + k) * w->L + o] = g[k];
            }
        }
    }
}

/* The pool: workers sleep on `wake` until a new generation of tasks is posted, take tasks from `next` until none
   are left, and count themselves out; the poster takes tasks too and waits for the count to reach zero. */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER, done = PTHREAD_COND_INITIALIZER;
static int workers, busy;
static long generation;
static const Work *current;
static int64_t ntasks, next;

static int64_t take(void) {
    pthread_mutex_lock(&mu);
    int64_t t = next < ntasks ? next++ : -1;
    pthread_mutex_unlock(&mu);
    return t;
}

static void *worker(void *arg) {
    long seen = (long)(intptr_t)arg; /* the generation posted before this thread existed: not its work */
    for (;;) {
        pthread_mutex_lock(&mu);
        while (generation == seen) pthread_cond_wait(&wake, &mu);
        seen = generation;
        const Work *w = current;
        pthread_mutex_unlock(&mu);
        for (int64_t t; (t = take()) >= 0;) run_task(w, t);
        pthread_mutex_lock(&mu);
        if (--busy == 0) pthread_cond_signal(&done);
        pthread_mutex_unlock(&mu);
    }
    return NULL;
}

static void run_all(const Work *w, int64_t n) {
    pthread_mutex_lock(&mu);
    current = w, ntasks = n, next = 0, busy = workers, generation++;
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&mu);
    for (int64_t t; (t = take()) >= 0;) run_task(w, t);
    pthread_mutex_lock(&mu);
    while (busy > 0) pthread_cond_wait(&done, &mu);
    pthread_mutex_unlock(&mu);
}

/* Start the pool's threads (the caller's thread is one more); returns how many run in all. Idempotent upward. */
int k3_threads(int nthreads) {
    pthread_mutex_lock(&mu);
    while (workers < nthreads - 1) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker, (void *)(intptr_t)generation) != 0) break;
        pthread_detach(t);
        workers++;
    }
    int total = workers + 1;
    pthread_mutex_unlock(&mu);
    return total;
}

void k3_expert_rows(int64_t njobs, const int64_t *w, const int32_t *rows, const float *x, float *h, float *y,
                    int64_t L, int64_t F, float beta, float linear_beta, int round) {
    Work work = {njobs, L, F, w, rows, x, h, y, beta, linear_beta, round, 1, (F + OB - 1) / OB};
    run_all(&work, njobs * work.blocks_per_job);
    work.stage = 2;
    work.blocks_per_job = (L + OB - 1) / OB;
    run_all(&work, njobs * work.blocks_per_job);
}

int k3_has_avx512(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}
