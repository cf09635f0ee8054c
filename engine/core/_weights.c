/* Sampling weights in one pass over a vocabulary: w[i] = exp((logit[i] - top) * inv_temperature)
 * and the sum of every block of them, for engine/core/sampling.py.
 *
 * numpy needs four passes for this (subtract, scale, exp, the block sums: ~150-190 us over
 * 262,144 logits, cold, on a Zen 5 core); fused, one pass that stays in the caches takes ~55 us
 * on AVX-512, ~90 us on AVX2 (the portable SSE2 copy ~245 us: sampling.py keeps numpy's
 * exponent there). The exponent is Cephes' expf's reduction (k ln 2 in two parts) with a
 * degree-5 polynomial fit for relative error (within 1.6e-7, ~1.4 ulp: Cephes' degree-7 one was
 * within 8e-8 and took ~20% longer: ~79 against ~64 us warm on a Zen 4 core), 2^k from the
 * rounding sum's own bits, written without branches so the compiler vectorizes it (given
 * -fno-trapping-math: otherwise gcc keeps the AVX2 and SSE2 copies scalar rather than evaluate
 * both sides of a select); each instruction-set level gets its own copy, picked once at import
 * from what the CPU (and the OS) supports: never -march=native, the same build runs on any
 * x86-64. Other architectures take the portable copy.
 *
 * Arguments below zero are all this needs (top is the maximum). Below -87 (a weight under
 * 1.6e-38 of the top token's, float32's smallest normal) the weight is 0: such a token is never
 * drawn, as -inf logits (masked tokens) never are.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define FLOOR (-87.0f)

#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

INLINE float exp_nonpositive(float x) {
    float c = x < FLOOR ? FLOOR : x; /* -inf too (the caller has refused NaN) */
    /* k = round(c / ln 2) by the 1.5 * 2^23 trick (exact for |k| < 2^22): the sum's low bits
     * hold k, so its bits make 2^k without a conversion */
    float shifted = c * 1.44269504088896341f + 12582912.0f;
    float k = shifted - 12582912.0f;
    float r = c - k * 0.693359375f; /* r = c - k ln 2, ln 2 in two parts */
    r = r - k * -2.12194440e-4f;
    /* exp(r), |r| <= ln 2 / 2: a degree-5 polynomial fit for relative error (9e-8; 1 at 0) */
    float y = 8.290315047e-3f;
    y = y * r + 4.189793020e-2f;
    y = y * r + 1.666763574e-1f;
    y = y * r + 4.999915063e-1f;
    y = y * r + 9.999997020e-1f;
    y = y * r + 1.0f;
    uint32_t bits; /* 2^k, k in [-126, 0]: a normal float (the magic's own bits shift out) */
    memcpy(&bits, &shifted, sizeof bits);
    bits = (bits + 127u) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float w = y * scale;
    return x < FLOOR ? 0.0f : w;
}

/* Block sums: float32 lanes over CHUNK weights at a time (vectorized: 16 additions a lane with
 * AVX-512), the chunks added in float64: within ~3e-7 of the sum, where float32 lanes over a
 * whole block were off by up to 1.2e-6 (and float64 lanes were not vectorized: 10x slower). */
#define CHUNK 256

INLINE Py_ssize_t min_size(Py_ssize_t a, Py_ssize_t b) { return a < b ? a : b; }

INLINE void weights_body(const float *logits, float *out, Py_ssize_t n, float top,
                         float inv_temperature, Py_ssize_t block, double *sums) {
    for (Py_ssize_t start = 0, b = 0; start < n; start += block, b++) {
        Py_ssize_t end = min_size(start + block, n);
        double sum = 0.0;
        for (Py_ssize_t chunk = start; chunk < end; chunk += CHUNK) {
            Py_ssize_t stop = min_size(chunk + CHUNK, end);
            float part = 0.0f;
#pragma omp simd reduction(+ : part)
            for (Py_ssize_t i = chunk; i < stop; i++) {
                float w = exp_nonpositive((logits[i] - top) * inv_temperature);
                out[i] = w;
                part += w;
            }
            sum += part;
        }
        sums[b] = sum;
    }
}

typedef void (*weights_fn)(const float *, float *, Py_ssize_t, float, float, Py_ssize_t,
                           double *);

/* The largest logit, NaN if any is (numpy's max, whose dispatch alone costs ~20 us right after
 * a decode step, its code cold). */
INLINE float top_body(const float *logits, Py_ssize_t n) {
    float top = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
    for (Py_ssize_t i = 0; i < n; i++) {
        top = logits[i] > top ? logits[i] : top;
        nan |= logits[i] != logits[i];
    }
    return nan ? NAN : top;
}

typedef float (*top_fn)(const float *, Py_ssize_t);

/* Top-k's head: the k largest logits (k <= TOP_K_MAX) and any equal to the k-th, as ids in
 * order. A chunk of SCAN logits is read element by element only where its maximum (one vector
 * reduction) would enter the k best so far: over a vocabulary in no particular order a few
 * dozen chunks are (numpy's sampled threshold, mask and partition took ~210 us for the sampler
 * view's 12 over 262,144 logits right after a decode step). NaN never enters. */
#define TOP_K_MAX 256
#define SCAN 128

/* top_body without its NaN flag: a NaN must not hide the chunk's other logits. */
INLINE float chunk_max(const float *x, Py_ssize_t n) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (Py_ssize_t i = 0; i < n; i++)
        m = x[i] > m ? x[i] : m;
    return m;
}

/* The k-th largest of the logits (the smallest non-NaN one if fewer than k are; -inf if none):
 * best[0, filled) holds the largest so far, ascending, best[0] the k-th. */
INLINE float kth_largest(const float *x, Py_ssize_t n, Py_ssize_t k, float *best) {
    Py_ssize_t filled = 0;
    for (Py_ssize_t start = 0; start < n; start += SCAN) {
        Py_ssize_t end = min_size(start + SCAN, n);
        if (filled == k && !(chunk_max(x + start, end - start) > best[0]))
            continue;
        for (Py_ssize_t i = start; i < end; i++) {
            float v = x[i];
            Py_ssize_t j;
            if (filled < k) {
                if (v != v)
                    continue;
                for (j = filled++; j > 0 && best[j - 1] > v; j--)
                    best[j] = best[j - 1];
                best[j] = v;
            } else if (v > best[0]) { /* the k-th leaves, v takes its rank */
                for (j = 0; j + 1 < k && best[j + 1] < v; j++)
                    best[j] = best[j + 1];
                best[j] = v;
            }
        }
    }
    return filled ? best[0] : -INFINITY;
}

/* The ids of the logits >= the k-th largest, in order, the first `capacity` of them written;
 * how many there are. */
INLINE Py_ssize_t top_k_body(const float *x, Py_ssize_t n, Py_ssize_t k, int64_t *ids,
                             Py_ssize_t capacity) {
    float best[TOP_K_MAX];
    float kth = kth_largest(x, n, k, best);
    Py_ssize_t count = 0;
    for (Py_ssize_t start = 0; start < n; start += SCAN) {
        Py_ssize_t end = min_size(start + SCAN, n);
        if (!(chunk_max(x + start, end - start) >= kth))
            continue;
        for (Py_ssize_t i = start; i < end; i++)
            if (x[i] >= kth) {
                if (count < capacity)
                    ids[count] = i;
                count++;
            }
    }
    return count;
}

typedef Py_ssize_t (*top_k_fn)(const float *, Py_ssize_t, Py_ssize_t, int64_t *, Py_ssize_t);

static Py_ssize_t top_k_portable(const float *x, Py_ssize_t n, Py_ssize_t k, int64_t *ids,
                                 Py_ssize_t capacity) {
    return top_k_body(x, n, k, ids, capacity);
}

static float top_portable(const float *logits, Py_ssize_t n) { return top_body(logits, n); }

static void weights_portable(const float *logits, float *out, Py_ssize_t n, float top,
                             float inv_temperature, Py_ssize_t block, double *sums) {
    weights_body(logits, out, n, top, inv_temperature, block, sums);
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define X86_LEVELS 1
__attribute__((target("avx2,fma"))) static void weights_avx2(
    const float *logits, float *out, Py_ssize_t n, float top, float inv_temperature,
    Py_ssize_t block, double *sums) {
    weights_body(logits, out, n, top, inv_temperature, block, sums);
}

__attribute__((target("avx512f,avx2,fma"))) static void weights_avx512(
    const float *logits, float *out, Py_ssize_t n, float top, float inv_temperature,
    Py_ssize_t block, double *sums) {
    weights_body(logits, out, n, top, inv_temperature, block, sums);
}

__attribute__((target("avx2,fma"))) static Py_ssize_t top_k_avx2(
    const float *x, Py_ssize_t n, Py_ssize_t k, int64_t *ids, Py_ssize_t capacity) {
    return top_k_body(x, n, k, ids, capacity);
}

__attribute__((target("avx512f,avx2,fma"))) static Py_ssize_t top_k_avx512(
    const float *x, Py_ssize_t n, Py_ssize_t k, int64_t *ids, Py_ssize_t capacity) {
    return top_k_body(x, n, k, ids, capacity);
}

__attribute__((target("avx2,fma"))) static float top_avx2(const float *logits, Py_ssize_t n) {
    return top_body(logits, n);
}

__attribute__((target("avx512f,avx2,fma"))) static float top_avx512(const float *logits,
                                                                   Py_ssize_t n) {
    return top_body(logits, n);
}
#endif

typedef struct {
    const char *name;
    weights_fn fn;
    top_fn top;
    top_k_fn top_k;
    int needs_avx2_fma, needs_avx512f;
} weights_level;

static const weights_level levels[] = { /* the best first */
#ifdef X86_LEVELS
    {"avx512", weights_avx512, top_avx512, top_k_avx512, 1, 1},
    {"avx2", weights_avx2, top_avx2, top_k_avx2, 1, 0},
#endif
    {"portable", weights_portable, top_portable, top_k_portable, 0, 0},
};
#define LEVELS ((int)(sizeof levels / sizeof levels[0]))

static int runs_here(const weights_level *level) {
#ifdef X86_LEVELS
    __builtin_cpu_init(); /* the checks include the OS saving the registers (XCR0) */
    if (level->needs_avx2_fma &&
        !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
        return 0;
    if (level->needs_avx512f && !__builtin_cpu_supports("avx512f"))
        return 0;
#endif
    return 1;
}

static const weights_level *running = &levels[LEVELS - 1];

static void choose(void) {
    for (int i = LEVELS - 1; i >= 0; i--)
        if (runs_here(&levels[i]))
            running = &levels[i];
}

#define BLOCKS_MISFIT "weights must be float32 with one float64 sum per block"

/* Whether `weights` holds float32s and `sums` one float64 for each block of them. */
static int blocks_fit(const Py_buffer *weights, const Py_buffer *sums, Py_ssize_t block) {
    Py_ssize_t n = weights->len / (Py_ssize_t)sizeof(float);
    return block >= 1 && weights->len % (Py_ssize_t)sizeof(float) == 0 &&
           sums->len == (n + block - 1) / block * (Py_ssize_t)sizeof(double);
}

/* Whether the pass's buffers fit: float32 logits and out of one length, a float64 sum per
 * block. */
static int pass_fits(const Py_buffer *logits, const Py_buffer *out, const Py_buffer *sums,
                     Py_ssize_t block) {
    return blocks_fit(logits, sums, block) && out->len == logits->len;
}

/* Release the pass's buffers, with the error where they did not fit; whether they did. */
static int release_pass(Py_buffer *logits, Py_buffer *out, Py_buffer *sums, int fits) {
    PyBuffer_Release(logits);
    PyBuffer_Release(out);
    PyBuffer_Release(sums);
    if (!fits)
        PyErr_SetString(PyExc_ValueError, "logits and out: " BLOCKS_MISFIT ", of one length");
    return fits;
}

static PyObject *exp_weights(PyObject *self, PyObject *args) {
    Py_buffer logits, out, sums;
    float top, inv_temperature;
    Py_ssize_t block;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*ffw*w*n", &logits, &top, &inv_temperature, &out, &sums,
                          &block))
        return NULL;
    int fits = pass_fits(&logits, &out, &sums, block);
    if (fits) {
        Py_BEGIN_ALLOW_THREADS
        running->fn((const float *)logits.buf, (float *)out.buf,
                    logits.len / (Py_ssize_t)sizeof(float), top, inv_temperature, block,
                    (double *)sums.buf);
        Py_END_ALLOW_THREADS
    }
    if (!release_pass(&logits, &out, &sums, fits))
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *top(PyObject *self, PyObject *arg) {
    Py_buffer logits;
    float found = 0.0f;
    (void)self;
    if (PyObject_GetBuffer(arg, &logits, PyBUF_SIMPLE) < 0)
        return NULL;
    int fits = logits.itemsize == (Py_ssize_t)sizeof(float) && logits.len > 0 &&
               logits.len % (Py_ssize_t)sizeof(float) == 0;
    if (fits) {
        Py_BEGIN_ALLOW_THREADS
        found = running->top((const float *)logits.buf, logits.len / (Py_ssize_t)sizeof(float));
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&logits);
    if (!fits) {
        PyErr_SetString(PyExc_ValueError, "top needs float32 logits, at least one");
        return NULL;
    }
    return PyFloat_FromDouble((double)found);
}

static PyObject *top_k(PyObject *self, PyObject *args) {
    Py_buffer logits, ids;
    Py_ssize_t k, count = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nw*", &logits, &k, &ids))
        return NULL;
    Py_ssize_t n = logits.len / (Py_ssize_t)sizeof(float);
    int fits = logits.itemsize == (Py_ssize_t)sizeof(float) && ids.itemsize == 8 && k >= 1 &&
               k <= TOP_K_MAX && k <= n;
    if (fits) {
        Py_BEGIN_ALLOW_THREADS
        count = running->top_k((const float *)logits.buf, n, k, (int64_t *)ids.buf,
                               ids.len / 8);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&logits);
    PyBuffer_Release(&ids);
    if (!fits) {
        PyErr_SetString(PyExc_ValueError, "top_k needs float32 logits, int64 ids and "
                                          "1 <= k <= 256 (and their size)");
        return NULL;
    }
    return PyLong_FromSsize_t(count);
}

/* The index of the first weight whose cumulative sum passes u times the total, walking the
 * block sums first and then the one block the draw lands in, in float64 and in order: the
 * token engine/core/sampling.py's pick finds with numpy's cumulative sums, in one call (after a
 * decode step each numpy call costs 5-15 us, its code cold in the caches). */
static Py_ssize_t pick_body(const float *weights, Py_ssize_t n, const double *sums,
                            Py_ssize_t blocks, Py_ssize_t block, double u) {
    double total = 0.0;
    for (Py_ssize_t b = 0; b < blocks; b++)
        total += sums[b];
    double target = u * total, before = 0.0;
    Py_ssize_t b = 0;
    for (double end = sums[0]; b < blocks - 1 && !(end > target); end += sums[++b])
        before = end;
    Py_ssize_t start = b * block, stop = start + block < n ? start + block : n;
    double cumulative = 0.0, rest = target - before;
    Py_ssize_t last = -1;
    for (Py_ssize_t i = start; i < stop; i++) {
        cumulative += weights[i];
        if (cumulative > rest)
            return i;
        if (weights[i] != 0.0f)
            last = i;
    }
    return last; /* rounding: the block's last token with mass (-1: none, the caller's case) */
}

static PyObject *pick(PyObject *self, PyObject *args) {
    Py_buffer weights, sums;
    double u;
    Py_ssize_t block, index = -1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*dn", &weights, &sums, &u, &block))
        return NULL;
    Py_ssize_t n = weights.len / (Py_ssize_t)sizeof(float);
    int fits = n >= 1 && blocks_fit(&weights, &sums, block);
    if (fits)
        index = pick_body((const float *)weights.buf, n, (const double *)sums.buf,
                          sums.len / (Py_ssize_t)sizeof(double), block, u);
    PyBuffer_Release(&weights);
    PyBuffer_Release(&sums);
    if (!fits) {
        PyErr_SetString(PyExc_ValueError, BLOCKS_MISFIT " (at least one)");
        return NULL;
    }
    return PyLong_FromSsize_t(index);
}

/* Top-p's selection by mass, as a radix select on the weights' bits (non-negative floats order as
 * their bit patterns do): the mass of each value of the top 12 bits, then of the next 12 bits
 * among the weights in the bucket the target is crossed in, then of the last 8: three passes,
 * whatever the distribution's shape (numpy's rounds of sampled brackets took 0.1-0.6 ms on a
 * trained model's 49,152 weights, cold; ~1.4 ms on a flat 262,144). The largest weight w whose
 * weights >= w hold `target`, and the mass of those heavier than w (bucket masses in float64). */
static float reaching_body(const float *weights, Py_ssize_t n, double target, double *above) {
    static const int shifts[3] = {20, 8, 0};
    double mass[4096];
    uint32_t prefix = 0; /* the chosen buckets' bits so far */
    double heavier = 0.0;
    int high = 32; /* bits at and above `high` are fixed to prefix */
    for (int level = 0; level < 3; level++) {
        int shift = shifts[level], width = high - shift;
        uint32_t buckets = 1u << width;
        memset(mass, 0, buckets * sizeof mass[0]);
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t bits;
            memcpy(&bits, &weights[i], sizeof bits);
            if (high == 32 || (bits >> high) == prefix)
                mass[(bits >> shift) & (buckets - 1)] += weights[i];
        }
        uint32_t chosen = buckets, lowest = buckets; /* lowest: the last bucket with mass */
        for (uint32_t b = buckets; b-- > 0;) {
            if (mass[b] == 0.0)
                continue;
            if (heavier + mass[b] >= target) {
                chosen = b;
                break;
            }
            lowest = b;
            heavier += mass[b];
        }
        if (chosen == buckets && lowest < buckets) { /* rounding: even the whole pool falls
                                                         short of target; it ends there */
            chosen = lowest;
            heavier -= mass[lowest];
        } else if (chosen == buckets) { /* no mass at all (never a distribution's weights) */
            chosen = 0;
        }
        prefix = (prefix << width) | chosen;
        high = shift;
    }
    float last;
    memcpy(&last, &prefix, sizeof last);
    *above = heavier;
    return last;
}

static PyObject *reaching(PyObject *self, PyObject *args) {
    Py_buffer weights;
    double target, above = 0.0;
    float last = 0.0f;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*d", &weights, &target))
        return NULL;
    int fits = weights.len > 0 && weights.len % (Py_ssize_t)sizeof(float) == 0;
    if (fits) {
        Py_BEGIN_ALLOW_THREADS
        last = reaching_body((const float *)weights.buf, weights.len / (Py_ssize_t)sizeof(float),
                             target, &above);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&weights);
    if (!fits) {
        PyErr_SetString(PyExc_ValueError, "weights must be a non-empty float32 buffer");
        return NULL;
    }
    return Py_BuildValue("(dd)", (double)last, above);
}

INLINE double block_sum(const float *weights, Py_ssize_t start, Py_ssize_t end) {
    double sum = 0.0;
    for (Py_ssize_t chunk = start; chunk < end; chunk += CHUNK) {
        Py_ssize_t stop = min_size(chunk + CHUNK, end);
        float part = 0.0f;
#pragma omp simd reduction(+ : part)
        for (Py_ssize_t i = chunk; i < stop; i++)
            part += weights[i];
        sum += part;
    }
    return sum;
}

/* Drop what a cut at `last` drops, in place: every weight below it, and the weights equal to it
 * after the first `stay` (by index); the block sums follow. How many equal `last`. */
static Py_ssize_t cut_body(float *weights, Py_ssize_t n, float last, Py_ssize_t stay,
                           Py_ssize_t block, double *sums) {
    Py_ssize_t ties = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        float w = weights[i] < last ? 0.0f : weights[i];
        ties += w == last;
        weights[i] = w;
    }
    for (Py_ssize_t start = 0, b = 0; start < n; start += block, b++)
        sums[b] = block_sum(weights, start, min_size(start + block, n));
    if (ties > stay) { /* rare: equal weights past the set's end; the first `stay` remain */
        Py_ssize_t seen = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (weights[i] != last || seen++ < stay)
                continue;
            weights[i] = 0.0f;
            Py_ssize_t b = i / block, start = b * block;
            sums[b] = block_sum(weights, start, start + block < n ? start + block : n);
        }
    }
    return ties;
}

static PyObject *cut(PyObject *self, PyObject *args) {
    Py_buffer weights, sums;
    float last;
    Py_ssize_t stay, block, ties = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*fnw*n", &weights, &last, &stay, &sums, &block))
        return NULL;
    int fits = blocks_fit(&weights, &sums, block);
    if (fits) {
        Py_BEGIN_ALLOW_THREADS
        ties = cut_body((float *)weights.buf, weights.len / (Py_ssize_t)sizeof(float), last,
                        stay, block, (double *)sums.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&weights);
    PyBuffer_Release(&sums);
    if (!fits) {
        PyErr_SetString(PyExc_ValueError, BLOCKS_MISFIT);
        return NULL;
    }
    return PyLong_FromSsize_t(ties);
}

/* Bounds a rounding of the block sums may be off by against the check's own sums (both are
 * float32 lanes over CHUNK weights added in float64; ~1e-6 of a block at worst). */
#define SUMS_SLACK 1e-4

/* Whether top-p keeps the weight at `index`: the mass before it, in order of weight (the heavier
 * weights, and the equal ones before it: ties rank by index), is short of top_p of the whole
 * (the block sums' total, in order). Float32 lanes over CHUNK weights, the chunks added in
 * float64, block by block; a block's end decides early when the mass counted already reaches
 * the target (it only grows: exact), or when even every weight not yet read (the block sums
 * left, with slack) could not bring it there. A token drawn by its weight is usually decided
 * within a few blocks of a flat 262,144; one near top-p's edge is read to the end. */
static int keeps_body(const float *weights, Py_ssize_t n, Py_ssize_t index, const double *sums,
                      Py_ssize_t block, double top_p) {
    const float x = weights[index];
    double left = 0.0; /* the mass of the blocks not yet read */
    for (Py_ssize_t b = 0, blocks = (n + block - 1) / block; b < blocks; b++)
        left += sums[b];
    const double target = top_p * left;
    const double drift = left * 1e-12; /* what subtracting the blocks read may leave in `left` */
    double above = 0.0;
    Py_ssize_t ties = 0;
    for (Py_ssize_t start = 0, b = 0; start < n; start += block, b++) {
        Py_ssize_t end = min_size(start + block, n);
        for (Py_ssize_t chunk = start; chunk < end; chunk += CHUNK) {
            Py_ssize_t stop = min_size(chunk + CHUNK, end), tied = min_size(stop, index);
            float part = 0.0f;
#pragma omp simd reduction(+ : part)
            for (Py_ssize_t i = chunk; i < stop; i++)
                part += weights[i] > x ? weights[i] : 0.0f;
            above += part;
            Py_ssize_t equal = 0;
#pragma omp simd reduction(+ : equal)
            for (Py_ssize_t i = chunk; i < tied; i++)
                equal += weights[i] == x;
            ties += equal;
        }
        double before = above + (double)ties * (double)x;
        left -= sums[b];
        if (before >= target)
            return 0;
        if (before + (left > 0.0 ? left : 0.0) * (1.0 + SUMS_SLACK) + drift < target)
            return 1;
    }
    return above + (double)ties * (double)x < target;
}

static PyObject *keeps(PyObject *self, PyObject *args) {
    Py_buffer weights, sums;
    Py_ssize_t index, block;
    double top_p;
    int kept = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*ny*nd", &weights, &index, &sums, &block, &top_p))
        return NULL;
    Py_ssize_t n = weights.len / (Py_ssize_t)sizeof(float);
    int fits = weights.itemsize == (Py_ssize_t)sizeof(float) && index >= 0 && index < n &&
               blocks_fit(&weights, &sums, block);
    if (fits) {
        Py_BEGIN_ALLOW_THREADS
        kept = keeps_body((const float *)weights.buf, n, index, (const double *)sums.buf, block,
                          top_p);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&weights);
    PyBuffer_Release(&sums);
    if (!fits) {
        PyErr_SetString(PyExc_ValueError, BLOCKS_MISFIT ", and an index inside them");
        return NULL;
    }
    return PyBool_FromLong(kept);
}

/* A sampled token in one call: the maximum, the weights and their block sums, the draw, and
 * top-p's check of it (top_p 1: none), as top, exp_weights, pick and keeps make them one by one
 * (right after a decode step each call from Python costs 5-15 us, its code cold). A maximum that
 * is not finite (NaN, an overflow, every token masked) stops there: index -1. */
static PyObject *draw(PyObject *self, PyObject *args) {
    Py_buffer logits, out, sums;
    float inv_temperature, found = NAN;
    double top_p, u;
    Py_ssize_t block, index = -1;
    int kept = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*fddw*w*n", &logits, &inv_temperature, &top_p, &u, &out,
                          &sums, &block))
        return NULL;
    Py_ssize_t n = logits.len / (Py_ssize_t)sizeof(float);
    int fits = n >= 1 && pass_fits(&logits, &out, &sums, block);
    if (fits) {
        const float *x = (const float *)logits.buf;
        float *weights = (float *)out.buf;
        double *block_sums = (double *)sums.buf;
        Py_BEGIN_ALLOW_THREADS
        found = running->top(x, n);
        if (isfinite(found)) {
            running->fn(x, weights, n, found, inv_temperature, block, block_sums);
            index = pick_body(weights, n, block_sums, sums.len / (Py_ssize_t)sizeof(double),
                              block, u);
            kept = index >= 0 &&
                   (top_p >= 1.0 || keeps_body(weights, n, index, block_sums, block, top_p));
        }
        Py_END_ALLOW_THREADS
    }
    if (!release_pass(&logits, &out, &sums, fits))
        return NULL;
    return Py_BuildValue("(dnO)", (double)found, index, kept ? Py_True : Py_False);
}

static PyObject *level(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(running->name);
}

/* Another level this CPU runs (tests compare every copy with numpy; benchmarks time them). */
static PyObject *use(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL)
        return NULL;
    for (int i = 0; i < LEVELS; i++)
        if (strcmp(levels[i].name, name) == 0) {
            if (!runs_here(&levels[i]))
                Py_RETURN_FALSE;
            running = &levels[i];
            Py_RETURN_TRUE;
        }
    PyErr_Format(PyExc_ValueError, "no weights level %R here", arg);
    return NULL;
}

static PyMethodDef methods[] = {
    {"exp_weights", exp_weights, METH_VARARGS,
     "exp_weights(logits, top, inv_temperature, out, sums, block): out[i] = exp((logits[i] - "
     "top) * inv_temperature) (0 below exp(-87)), sums[b] = the sum of block b of out."},
    {"top", top, METH_O, "top(logits) -> float: the largest float32 logit (NaN if any is)."},
    {"top_k", top_k, METH_VARARGS,
     "top_k(logits, k, ids) -> count: the ids of the logits >= the k-th largest (k <= 256), in "
     "order; as many as fit written to ids, how many there are returned."},
    {"pick", pick, METH_VARARGS,
     "pick(weights, sums, u, block): the index of the first weight whose cumulative sum passes "
     "u times the total (-1 if rounding leaves the draw's block without mass)."},
    {"reaching", reaching, METH_VARARGS,
     "reaching(weights, target) -> (last, above): the largest weight w whose weights >= w hold "
     "target, and the mass of those heavier than w (top-p's selection by mass)."},
    {"cut", cut, METH_VARARGS,
     "cut(weights, last, stay, sums, block) -> ties: zero the weights below last and those equal "
     "to it after the first stay, in place; the block sums follow."},
    {"keeps", keeps, METH_VARARGS,
     "keeps(weights, index, sums, block, top_p) -> bool: whether top-p keeps weights[index]: "
     "the mass of the heavier weights and of the equal ones before it is short of top_p of the "
     "sums' total."},
    {"draw", draw, METH_VARARGS,
     "draw(logits, inv_temperature, top_p, u, out, sums, block) -> (top, index, kept): "
     "top(logits); if finite, exp_weights into out and sums, pick(out, sums, u, block) and "
     "keeps(out, index, sums, block, top_p) (kept where top_p >= 1); else index -1."},
    {"level", level, METH_NOARGS, "The instruction-set level the weights run on."},
    {"use", use, METH_O,
     "use(level) -> bool: run the weights on this level ('avx512', 'avx2', 'portable') if the "
     "CPU can (False, unchanged, if not)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_weights",
                                    "Sampling weights in one native pass.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__weights(void) {
    choose();
    return PyModule_Create(&module);
}
