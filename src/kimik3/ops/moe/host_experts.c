/* Routed experts on MXFP4-packed weights in host memory, computed on the host's cores (kimik3.ops.moe.host).

Legend: J jobs (one expert and its rows each), R rows over all jobs, L latent width, F expert width.
Per job j with expert weights w1, w3 [F, L/2] codes + [F, L/32] E8M0 scales and w2 [L, F/2] + [L, F/32]:

    stage 1   h[r, f] = SiTU(round(w1[f] . x[r]), round(w3[f] . x[r]))     (rounded once more to the compute dtype)
    stage 2   y[r, l] = w2[l] . h[r]                                       (the caller rounds y to its dtype)

round() is to bf16 (round to nearest even) in the bf16 modes, else nothing (fp32 compute). Two ways to take a dot
product, both decoding the codes in registers (the low nibble of a byte is an even column, the high nibble the odd
one after it; each code an E2M1 value from a 16-entry table; each 32-column group times its power of two, exact):
    fp32 (mode 0, 1)  per group: 16 + 16 values looked up as fp32, scaled, one fused multiply-add each into fp32
                      lane accumulators; rows (and h) group-interleaved: each group's 16 even columns, then its 16
                      odd ones (`triton_mxfp4._interleave`'s layout). Mode 1 rounds to bf16, mode 0 does not.
    bf16 (mode 2)     AVX-512 BF16 CPUs, K a multiple of 64: per pair of groups, 32 + 32 E2M1 values looked up as
                      bf16 (exact) and multiplied with bf16 rows by VDPBF16PS (exact products, fp32 sums), each
                      group's sum then times its power of two into the accumulators: half the instructions. Rows
                      (and h) bf16, pair-interleaved: per two groups their even columns, then their odd ones.

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

#if defined(__AVX512BF16__)
static const uint16_t E2M1_BF16[32] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                       0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

/* out[r] = W[o] . x[r] for the n <= RB bf16 rows x (pair-interleaved, row stride K; K a multiple of 64). */
static void dot_rows_bf16(const uint8_t *codes, const uint8_t *scales, int64_t K, const uint16_t *x, int n,
                          float *out) {
    int64_t groups = K / 32;
    float sc[groups + 16];
    for (int64_t g = 0; g < groups; g += 16) { /* 2^(s - 127) for 16 groups at once (s = 0: 2^-127, subnormal) */
        __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(scales + g)));
        s = _mm512_max_epi32(_mm512_slli_epi32(s, 23), _mm512_set1_epi32(0x00400000));
        _mm512_storeu_ps(sc + g, _mm512_castsi512_ps(s));
    }
    const __m512i lut = _mm512_loadu_si512(E2M1_BF16);
    __m512 acc[RB];
    for (int r = 0; r < n; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < groups / 2; p++) {
        __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + p * 32)));
        __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(b, _mm512_set1_epi16(15)), lut);
        __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut);
        /* lanes 0-7 sum group 2p's pairs, lanes 8-15 group 2p + 1's */
        __m512 s = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sc[2 * p]), _mm512_set1_ps(sc[2 * p + 1]));
        for (int r = 0; r < n; r++) {
            const uint16_t *xp = x + r * K + p * 64;
            __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, (__m512bh)_mm512_loadu_si512(xp));
            t = _mm512_dpbf16_ps(t, hi, (__m512bh)_mm512_loadu_si512(xp + 32));
            acc[r] = _mm512_fmadd_ps(t, s, acc[r]);
        }
    }
    for (int r = 0; r < n; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

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

static uint16_t bf16_bits(float v) { /* v already rounded to bf16 */
    uint32_t u;
    memcpy(&u, &v, 4);
    return (uint16_t)(u >> 16);
}

/* Where column c of a K-wide row lies in the mode's layout. */
static int64_t position(int64_t c, int mode) {
    if (mode == 2) /* pair-interleaved: pair, parity, group within the pair, column within the parity */
        return (c / 64) * 64 + (c % 2) * 32 + ((c / 32) % 2) * 16 + (c % 32) / 2;
    return (c / 32) * 32 + (c % 2) * 16 + (c % 32) / 2; /* group-interleaved */
}

static void dot(const uint8_t *codes, const uint8_t *scales, int64_t K, const void *x, int mode, int64_t row, int n,
                float *out) {
#if defined(__AVX512BF16__)
    if (mode == 2) {
        dot_rows_bf16(codes, scales, K, (const uint16_t *)x + row * K, n, out);
        return;
    }
#endif
    dot_rows(codes, scales, K, (const float *)x + row * K, n, out);
}

typedef struct {
    int64_t njobs, L, F;
    const int64_t *w;        /* [J, 6]: addresses of w1 codes, w1 scales, w3 codes, w3 scales, w2 codes, w2 scales */
    const int32_t *rows;     /* [J + 1]: job j's rows are rows[j] .. rows[j + 1] */
    const void *x;           /* [R, L] in the mode's layout: fp32 or (mode 2) bf16 */
    void *h;                 /* [R, F] likewise (stage 1 writes, stage 2 reads) */
    float *y;                /* [R, L] fp32 */
    float beta, linear_beta;
    int mode;
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
                dot((const uint8_t *)p[0] + o * (L / 2), (const uint8_t *)p[1] + o * (L / 32), L, w->x, w->mode, r, n, g);
                dot((const uint8_t *)p[2] + o * (L / 2), (const uint8_t *)p[3] + o * (L / 32), L, w->x, w->mode, r, n, u);
                int64_t c = position(o, w->mode); /* h in the layout stage 2 reads */
                for (int k = 0; k < n; k++) {
                    float gk = w->mode ? round_bf16(g[k]) : g[k], uk = w->mode ? round_bf16(u[k]) : u[k];
                    float hk = situ(gk, uk, w->beta, w->linear_beta);
                    if (w->mode == 2)
                        ((uint16_t *)w->h)[(r + k) * w->F + c] = bf16_bits(round_bf16(hk));
                    else
                        ((float *)w->h)[(r + k) * w->F + c] = w->mode ? round_bf16(hk) : hk;
                }
            }
        }
    } else {
        int64_t o1 = o0 + OB < w->L ? o0 + OB : w->L, F = w->F;
        for (int32_t r = r0; r < r1; r += RB) {
            int n = r1 - r < RB ? r1 - r : RB;
            for (int64_t o = o0; o < o1; o++) {
                dot((const uint8_t *)p[4] + o * (F / 2), (const uint8_t *)p[5] + o * (F / 32), F, w->h, w->mode, r, n, g);
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

void k3_expert_rows(int64_t njobs, const int64_t *w, const int32_t *rows, const void *x, void *h, float *y,
                    int64_t L, int64_t F, float beta, float linear_beta, int mode) {
    Work work = {njobs, L, F, w, rows, x, h, y, beta, linear_beta, mode, 1, (F + OB - 1) / OB};
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

int k3_has_bf16_pairs(void) { /* mode 2 built in */
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
