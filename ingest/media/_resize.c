/* Qwen2-VL image patches on the CPU without torch: torch's uint8 antialiased bicubic resize, then the processor's
 * patch order, written straight into the caller's buffer.
 *
 * The arithmetic is torch's (aten/src/ATen/native/cpu/UpSampleKernel.cpp, the uint8 path torchvision's resize takes
 * on the CPU): per axis, Keys cubic weights (a = -0.5) over the antialiasing support in double, normalized, scaled to
 * int16 with the largest precision that keeps the biggest weight below 2^15, then for each output value
 * clamp((2^(precision-1) + sum(pixel * weight)) >> precision, 0, 255); the horizontal pass first into a uint8 image,
 * then the vertical one, each skipped where that side keeps its size. Integer sums are exact in any order, so the
 * result is torch's to the bit (tests/media/test_pixels.py checks it against torch on many sizes).
 *
 * Why: importing torch costs a CPU vision actor ~1.5 s of CPU at start-up, a quarter of a 1,000-row bench run on two
 * cores (docs/benchmarks.md). ingest/media/pixels.py falls back to torch where this module was not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

typedef struct {
    int *first;       /* first input index of each output index */
    int *count;       /* input indices it reads */
    int16_t *weights; /* taps per output index, zero past count */
    int taps;
    int precision;
} Axis;

/* torch's HelperInterpCubic::aa_filter: cubic_convolution1 / 2 with a = -0.5, the same expressions. */
static double cubic_filter(double x) {
    const double a = -0.5;
    x = fabs(x);
    if (x < 1.0) return ((a + 2) * x - (a + 3)) * x * x + 1;
    if (x < 2.0) return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a;
    return 0.0;
}

static void axis_free(Axis *axis) { /* safe to call twice */
    free(axis->first);
    free(axis->count);
    free(axis->weights);
    axis->first = axis->count = NULL;
    axis->weights = NULL;
}

/* _compute_index_ranges_int16_weights(antialias=True, align_corners=False, no scale given). */
static int axis_init(Axis *axis, int in_size, int out_size) {
    const double scale = (double)in_size / out_size;
    const double support = scale >= 1.0 ? 2.0 * scale : 2.0;
    const double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
    const int taps = (int)ceil(support) * 2 + 1;
    double *w = calloc((size_t)out_size * taps, sizeof(double));
    axis->first = malloc(sizeof(int) * out_size);
    axis->count = malloc(sizeof(int) * out_size);
    axis->weights = calloc((size_t)out_size * taps, sizeof(int16_t));
    axis->taps = taps;
    if (!w || !axis->first || !axis->count || !axis->weights) {
        free(w);
        axis_free(axis);
        return -1;
    }
    double wt_max = 0.0;
    for (int i = 0; i < out_size; i++) {
        const double center = scale * (i + 0.5);
        int64_t xmin = (int64_t)(center - support + 0.5);
        if (xmin < 0) xmin = 0;
        int64_t xmax = (int64_t)(center + support + 0.5);
        if (xmax > in_size) xmax = in_size;
        int64_t xsize = xmax - xmin;
        if (xsize < 0) xsize = 0;
        if (xsize > taps) xsize = taps;
        double *wi = w + (size_t)i * taps, total = 0.0;
        for (int64_t j = 0; j < xsize; j++) {
            wi[j] = cubic_filter(((double)(j + xmin) - center + 0.5) * invscale);
            total += wi[j];
        }
        if (total != 0.0) {
            for (int64_t j = 0; j < xsize; j++) {
                wi[j] /= total;
                if (wi[j] > wt_max) wt_max = wi[j];
            }
        }
        axis->first[i] = (int)xmin;
        axis->count[i] = (int)xsize;
    }
    unsigned int precision;
    for (precision = 0; precision < 22; ++precision) {
        int next_value = (int)(0.5 + wt_max * (1 << (precision + 1)));
        if (next_value >= (1 << 15)) break;
    }
    for (size_t k = 0; k < (size_t)out_size * taps; k++) {
        double v = w[k] * (1 << precision);
        axis->weights[k] = (int16_t)((v < 0) ? (int)(-0.5 + v) : (int)(0.5 + v));
    }
    axis->precision = (int)precision;
    free(w);
    return 0;
}

static inline uint8_t clip_shift(int32_t sum, int precision) {
    sum >>= precision; /* arithmetic, as torch's _mm256_srai_epi32 */
    return (uint8_t)(sum < 0 ? 0 : sum > 255 ? 255 : sum);
}

/* Rows the width pass takes at a time: it transposes them into (in_w, ROWS, 3) so that each tap is one multiply-add
 * over ROWS * 3 contiguous values (vectorized), instead of three scalar ones per output pixel. */
#define ROWS 16

/* (rows, in_w, 3) -> (rows, out_w, 3) along the width; ``block``: in_w * ROWS * 3 bytes of scratch. */
VECTOR_CLONES
static void horizontal(const uint8_t *in, uint8_t *out, int rows, int in_w, int out_w, const Axis *axis,
                       uint8_t *block) {
    const int32_t initial = 1 << (axis->precision - 1);
    int32_t sums[ROWS * 3];
    for (int y0 = 0; y0 < rows; y0 += ROWS) {
        const int n = rows - y0 < ROWS ? rows - y0 : ROWS;
        if (n < ROWS) memset(block, 0, (size_t)in_w * ROWS * 3);
        for (int r = 0; r < n; r++) {
            const uint8_t *src = in + (size_t)(y0 + r) * in_w * 3;
            for (int x = 0; x < in_w; x++) {
                uint8_t *dst = block + ((size_t)x * ROWS + r) * 3;
                dst[0] = src[3 * x], dst[1] = src[3 * x + 1], dst[2] = src[3 * x + 2];
            }
        }
        for (int x = 0; x < out_w; x++) {
            const int16_t *k = axis->weights + (size_t)x * axis->taps;
            const uint8_t *column = block + (size_t)axis->first[x] * ROWS * 3;
            for (int i = 0; i < ROWS * 3; i++) sums[i] = initial;
            for (int j = 0; j < axis->count[x]; j++) {
                const uint8_t *src = column + (size_t)j * ROWS * 3;
                const int32_t weight = k[j];
                for (int i = 0; i < ROWS * 3; i++) sums[i] += src[i] * weight;
            }
            for (int r = 0; r < n; r++) {
                uint8_t *dst = out + ((size_t)(y0 + r) * out_w + x) * 3;
                for (int c = 0; c < 3; c++) dst[c] = clip_shift(sums[r * 3 + c], axis->precision);
            }
        }
    }
}

/* One output row along the height: sum over the axis' input rows of (width * 3) values. */
VECTOR_CLONES
static void vertical_row(const uint8_t *in, uint8_t *dst, int32_t *sums, size_t n, int y, const Axis *axis) {
    const int32_t initial = 1 << (axis->precision - 1);
    const int16_t *k = axis->weights + (size_t)y * axis->taps;
    for (size_t i = 0; i < n; i++) sums[i] = initial;
    for (int j = 0; j < axis->count[y]; j++) {
        const uint8_t *src = in + (size_t)(axis->first[y] + j) * n;
        const int32_t weight = k[j];
        for (size_t i = 0; i < n; i++) sums[i] += src[i] * weight;
    }
    for (size_t i = 0; i < n; i++) dst[i] = clip_shift(sums[i], axis->precision);
}

/* One resized (width, 3) row into the (grid_h/m, grid_w/m, m, m, 3, P, P) patch layout. */
static void scatter_row(const uint8_t *row, uint8_t *patches, int y, int width, int patch, int merge) {
    const int grid_w = width / patch, ph = y % patch, by = y / patch;
    const int bh = by / merge, mh = by % merge;
    const size_t plane = (size_t)patch * patch;
    for (int bx = 0; bx < grid_w; bx++) {
        const int bw = bx / merge, mw = bx % merge;
        const size_t index = (((size_t)bh * (grid_w / merge) + bw) * merge + mh) * merge + mw;
        uint8_t *dst = patches + index * 3 * plane + (size_t)ph * patch;
        const uint8_t *src = row + (size_t)bx * patch * 3;
        for (int c = 0; c < 3; c++)
            for (int pw = 0; pw < patch; pw++) dst[c * plane + pw] = src[pw * 3 + c];
    }
}

/* Per-thread scratch (grown, never shrunk): fresh pages for every image cost more than the resize here. */
static __thread uint8_t *scratch;
static __thread size_t scratch_size;

static uint8_t *scratch_take(size_t size) {
    if (size > scratch_size) {
        uint8_t *grown = realloc(scratch, size);
        if (!grown) return NULL;
        scratch = grown, scratch_size = size;
    }
    return scratch;
}

static int resize_into(const uint8_t *in, int in_h, int in_w, uint8_t *patches, int out_h, int out_w, int patch,
                       int merge) {
    const int need_h = in_w != out_w, need_v = in_h != out_h;
    Axis across = {0}, down = {0};
    if ((need_h && axis_init(&across, in_w, out_w)) || (need_v && axis_init(&down, in_h, out_h))) {
        axis_free(&across);
        axis_free(&down);
        return -1;
    }
    const size_t row = (size_t)out_w * 3;
    /* the row's int32 sums, one output row, the width-resized image */
    const size_t sums_size = row * sizeof(int32_t), mid_size = need_h ? (size_t)in_h * row : 0;
    const size_t block_size = need_h ? (size_t)in_w * ROWS * 3 : 0;
    uint8_t *buffer = scratch_take(sums_size + row + mid_size + block_size);
    if (!buffer) {
        axis_free(&across);
        axis_free(&down);
        return -1;
    }
    int32_t *sums = (int32_t *)buffer; /* realloc's memory is aligned for any type */
    uint8_t *line = buffer + sums_size, *mid = need_h ? line + row : (uint8_t *)in;
    if (need_h) horizontal(in, mid, in_h, in_w, out_w, &across, mid + mid_size);
    for (int y = 0; y < out_h; y++) {
        const uint8_t *resized = mid + (size_t)y * row;
        if (need_v) {
            vertical_row(mid, line, sums, row, y, &down);
            resized = line;
        }
        scatter_row(resized, patches, y, out_w, patch, merge);
    }
    axis_free(&across);
    axis_free(&down);
    return 0;
}

static PyObject *resize_patches(PyObject *Py_UNUSED(module), PyObject *args) {
    Py_buffer image, out;
    int in_h, in_w, out_h, out_w, patch, merge;
    if (!PyArg_ParseTuple(args, "y*iiw*iiii", &image, &in_h, &in_w, &out, &out_h, &out_w, &patch, &merge))
        return NULL;
    const char *error = NULL;
    if (in_h <= 0 || in_w <= 0 || out_h <= 0 || out_w <= 0 || patch <= 0 || merge <= 0)
        error = "sizes must be positive";
    else if (out_h % (patch * merge) || out_w % (patch * merge))
        error = "the output size must be a multiple of patch * merge";
    else if (image.len != (Py_ssize_t)in_h * in_w * 3)
        error = "the image must hold height * width * 3 bytes";
    else if (out.len < (Py_ssize_t)out_h * out_w * 3)
        error = "the output buffer is too small";
    int failed = 0;
    if (!error) {
        Py_BEGIN_ALLOW_THREADS;
        failed = resize_into(image.buf, in_h, in_w, out.buf, out_h, out_w, patch, merge);
        Py_END_ALLOW_THREADS;
    }
    PyBuffer_Release(&image);
    PyBuffer_Release(&out);
    if (error) {
        PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* out[i][c][t][k] = lut[c][src[i][c][k]] for every frame t: the processor's rescale + normalize of uint8 patches
   (each value's float ops done once, in the table) and its repeat to temporal_patch_size frames, in one pass. */
static void normalize_into(const uint8_t *src, float *out, const float *lut, Py_ssize_t count, int channels,
                           int frames, Py_ssize_t plane) {
    for (Py_ssize_t i = 0; i < count; i++)
        for (int c = 0; c < channels; c++) {
            const uint8_t *values = src + ((size_t)i * channels + c) * plane;
            float *first = out + ((size_t)i * channels + c) * frames * plane;
            const float *table = lut + (size_t)c * 256;
            for (Py_ssize_t k = 0; k < plane; k++) first[k] = table[values[k]];
            for (int t = 1; t < frames; t++) memcpy(first + (size_t)t * plane, first, (size_t)plane * sizeof(float));
        }
}

static PyObject *normalize_patches(PyObject *Py_UNUSED(module), PyObject *args) {
    Py_buffer src, out, lut;
    Py_ssize_t count, plane;
    int channels, frames;
    if (!PyArg_ParseTuple(args, "y*w*y*niin", &src, &out, &lut, &count, &channels, &frames, &plane)) return NULL;
    const char *error = NULL;
    if (count < 0 || channels <= 0 || frames <= 0 || plane <= 0)
        error = "count must be >= 0; channels, frames and plane positive";
    else if (src.len != count * channels * plane)
        error = "src must hold count * channels * plane bytes";
    else if (out.len < count * channels * frames * plane * (Py_ssize_t)sizeof(float))
        error = "out is too small for count * channels * frames * plane float32 values";
    else if (lut.len != channels * 256 * (Py_ssize_t)sizeof(float))
        error = "lut must hold channels * 256 float32 values";
    if (!error) {
        Py_BEGIN_ALLOW_THREADS;
        normalize_into(src.buf, out.buf, lut.buf, count, channels, frames, plane);
        Py_END_ALLOW_THREADS;
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    PyBuffer_Release(&lut);
    if (error) {
        PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"normalize_patches", normalize_patches, METH_VARARGS,
     "normalize_patches(src, out, lut, count, channels, frames, plane): (count, channels, plane) uint8 -> "
     "(count, channels, frames, plane) float32 in out, each value looked up in its channel's row of lut "
     "(channels, 256) float32 and repeated in every frame."},
    {"resize_patches", resize_patches, METH_VARARGS,
     "resize_patches(image, height, width, out, out_height, out_width, patch, merge): (height, width, 3) uint8 RGB "
     "bytes -> torch's uint8 antialiased bicubic resize to (out_height, out_width), written into out as "
     "(out_height/patch/merge, out_width/patch/merge, merge, merge, 3, patch, patch) uint8 patches."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_resize", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__resize(void) { return PyModule_Create(&module); }
