/* kvtrace.patches._rowstats: the per-token numbers of one raw logits row, compiled.
 *
 * row_stats(address, n, token) -> (top1, runner_up, margin, logprob) | None
 * row_stats_at(get_logits_ith, ctx, n, nonfinite, i, token) -> (top1, runner_up, margin, logprob)
 * sampled_rows(nonfinite, row_type, address, rows, n, row_stride, ids_address, ids_stride, ids_size, skip)
 *     -> [row_type (chosen, top1, runner_up, margin, logprob, sampled)]
 *
 * Reads the n float32 logits at `address` (llama.cpp's row for the step just decoded; never
 * written) in two vectorised passes: the maximum with one maximum per block of BLOCK logits, then
 * the sum of exponentials.  The definition, and the pure-numpy twin that gives bit-identical
 * results where this module is not built, are in rowstats.py; read that first.  row_stats returns
 * None for a row with a NaN or infinite logit (the caller computes those with numpy's own
 * semantics).  row_stats_at finds the row itself, by calling llama.cpp's llama_get_logits_ith
 * through its address: no Python frame and no ctypes call per token; it hands a non-finite row to
 * `nonfinite`.  sampled_rows does a sampler's whole step in one call (vLLM: every request's row,
 * the sampled ids read from their tensor's memory, rows that sampled nothing skipped): right after a
 * model step each call from Python costs microseconds of cold caches, whatever it computes.
 *
 * Bit-identical on every machine and with the numpy twin: every element goes through the same
 * IEEE float32 operations (no fused multiply-add: -ffp-contract=off; no reassociation: no
 * -ffast-math), and the sum runs in LANES float64 accumulators in a fixed order, however wide the
 * vector unit is.  The loops are GCC/Clang vector extensions, compiled on x86 for AVX-512 (16
 * floats), AVX2 (8) and the baseline (4, SSE), and elsewhere for the baseline only;
 * the module uses the widest kernel the CPU runs (KERNEL names it).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16   /* accumulators of the sum; element i goes to lane i % LANES */
#define BLOCK 256  /* logits per block maximum (a multiple of LANES) */
#define STACK_BLOCKS 1024

#define EXP_LOW (-87.0f) /* below this exp() underflows the float32 normals: counted as 0 */
#define LOG2E 1.44269504088896341f
#define ROUNDER 12582912.0f   /* 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits */
#define ROUNDER_BITS 0x4B400000
#define LN2_HI 0.693359375f
#define LN2_LO (-2.12194440e-4f)
#define P0 1.9875691500e-4f
#define P1 1.3981999507e-3f
#define P2 8.3334519073e-3f
#define P3 4.1665795894e-2f
#define P4 1.6666665459e-1f
#define P5 5.0000001201e-1f

#if !defined(__GNUC__)
#error "_rowstats needs GCC or Clang vector extensions; kvtrace uses its numpy twin instead"
#endif
#if !defined(__clang__)
/* The vector-valued helpers are always inlined into their kernel: no call passes a vector. */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

/* The vector kernels, block_maxima_<width> and exp_sum_<width>, compiled once per vector width
 * (see _rowstats_kernels.h); the widest this CPU runs is chosen when the module loads. */
#if defined(__x86_64__) || defined(__i386__)
#define KV_X86 1
#endif

/* TO_DOUBLE: float32 to float64 (exact) by the instruction set's own conversion: GCC lowers
 * __builtin_convertvector from a half-width vector to two narrow conversions through the stack,
 * which was most of the AVX2 kernel's time. */
#ifdef KV_X86
#include <immintrin.h>
#define WIDTH 16
#define TO_DOUBLE(half) ((VDOUBLE)_mm512_cvtps_pd((__m256)(half)))
#define KERNEL(name) name##_avx512f
#define KERNEL_TARGET __attribute__((target("avx512f")))
#include "_rowstats_kernels.h"
#undef WIDTH
#undef TO_DOUBLE
#undef KERNEL
#undef KERNEL_TARGET

#define WIDTH 8
#define TO_DOUBLE(half) ((VDOUBLE)_mm256_cvtps_pd((__m128)(half)))
#define KERNEL(name) name##_avx2
#define KERNEL_TARGET __attribute__((target("avx2")))
#include "_rowstats_kernels.h"
#undef WIDTH
#undef TO_DOUBLE
#undef KERNEL
#undef KERNEL_TARGET
#endif

#define WIDTH 4
#define TO_DOUBLE(half) __builtin_convertvector(half, VDOUBLE)
#define KERNEL(name) name##_portable
#define KERNEL_TARGET
#include "_rowstats_kernels.h"
#undef WIDTH
#undef TO_DOUBLE
#undef KERNEL
#undef KERNEL_TARGET

typedef struct {
    const char *name;
    float (*block_maxima)(const float *x, Py_ssize_t n, float *block_max);
    double (*exp_sum)(const float *x, Py_ssize_t n, float peak);
} kernel;

static const kernel KERNELS[] = {
#ifdef KV_X86
    {"avx512f", block_maxima_avx512f, exp_sum_avx512f},
    {"avx2", block_maxima_avx2, exp_sum_avx2},
#endif
    {"portable", block_maxima_portable, exp_sum_portable},
};
#define N_KERNELS ((int)(sizeof KERNELS / sizeof KERNELS[0]))

static int kernel_runs_here(const kernel *k) {
#ifdef KV_X86
    if (strcmp(k->name, "avx512f") == 0) return __builtin_cpu_supports("avx512f");
    if (strcmp(k->name, "avx2") == 0) return __builtin_cpu_supports("avx2");
#endif
    (void)k;
    return 1;
}

static const kernel *current = NULL; /* the first of KERNELS this CPU runs */

/* First index in [start, end) other than `skip` holding `value`, or -1. */
static Py_ssize_t find_value(const float *x, Py_ssize_t start, Py_ssize_t end, float value, Py_ssize_t skip) {
    for (Py_ssize_t i = start; i < end; i++)
        if (x[i] == value && i != skip) return i;
    return -1;
}

/* The numbers of the row x[0..n) for `token` (0 <= token < n): 1 for a finite row, 0 for a row with
 * a NaN or infinite logit (nothing set), -1 with an exception set. */
static int compute_row(const float *x, Py_ssize_t n, Py_ssize_t token, Py_ssize_t *top1_out, Py_ssize_t *runner_up_out,
                       double *margin_out, double *logprob_out) {
    Py_ssize_t blocks = (n + BLOCK - 1) / BLOCK;
    float stack_max[STACK_BLOCKS];
    float *block_max = blocks <= STACK_BLOCKS ? stack_max : PyMem_Malloc(blocks * sizeof(float));
    if (block_max == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    float peak = current->block_maxima(x, n, block_max);
    double total = current->exp_sum(x, n, peak);
    if (!isfinite(peak) || !isfinite(total)) {
        if (block_max != stack_max) PyMem_Free(block_max);
        return 0;
    }
    /* top-1: the first occurrence of the peak, in the first block that holds it */
    Py_ssize_t top_block = 0;
    while (block_max[top_block] != peak) top_block++;
    Py_ssize_t block_end = (top_block + 1) * BLOCK < n ? (top_block + 1) * BLOCK : n;
    Py_ssize_t top1 = find_value(x, top_block * BLOCK, block_end, peak, -1);
    /* runner-up: the largest logit but top-1's, lowest id first */
    float second = -INFINITY;
    for (Py_ssize_t b = 0; b < blocks; b++)
        if (b != top_block && block_max[b] > second) second = block_max[b];
    float unused[1]; /* the maxima of top-1's block on either side of it, by the vector kernel */
    if (top1 > top_block * BLOCK) {
        float before = current->block_maxima(x + top_block * BLOCK, top1 - top_block * BLOCK, unused);
        second = before > second ? before : second;
    }
    if (top1 + 1 < block_end) {
        float after = current->block_maxima(x + top1 + 1, block_end - top1 - 1, unused);
        second = after > second ? after : second;
    }
    Py_ssize_t runner_up = -1;
    for (Py_ssize_t b = 0; b < blocks && runner_up < 0 && n > 1; b++) {
        if (b == top_block || block_max[b] == second) {
            Py_ssize_t end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
            runner_up = find_value(x, b * BLOCK, end, second, top1);
        }
    }
    if (block_max != stack_max) PyMem_Free(block_max);

    *top1_out = top1;
    *runner_up_out = runner_up;
    *margin_out = (double)peak - (runner_up >= 0 ? (double)x[runner_up] : -INFINITY);
    *logprob_out = ((double)x[token] - (double)peak) - log(total);
    return 1;
}

static int check_token(Py_ssize_t token, Py_ssize_t n) {
    if (token < 0 || token >= n) {
        PyErr_Format(PyExc_IndexError, "token %zd is outside the row of %zd logits", token, n);
        return -1;
    }
    return 0;
}

/* The numbers of the finite row x[0..n) for `token`; None for a row with a NaN or infinite logit. */
static PyObject *stats_of_row(const float *x, Py_ssize_t n, Py_ssize_t token) {
    if (check_token(token, n) < 0) return NULL;
    Py_ssize_t top1, runner_up;
    double margin, logprob;
    int finite = compute_row(x, n, token, &top1, &runner_up, &margin, &logprob);
    if (finite < 0) return NULL;
    if (finite == 0) Py_RETURN_NONE;
    return Py_BuildValue("(nndd)", top1, runner_up, margin, logprob);
}

static int positive_size(PyObject *value, Py_ssize_t *out) {
    *out = PyLong_AsSsize_t(value);
    if (*out == -1 && PyErr_Occurred()) return -1;
    if (*out <= 0) {
        PyErr_SetString(PyExc_ValueError, "the row is empty");
        return -1;
    }
    return 0;
}

static PyObject *row_stats(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "row_stats(address, n, token) takes 3 arguments");
        return NULL;
    }
    const float *x = PyLong_AsVoidPtr(args[0]);
    if (x == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "no logits row (NULL address)");
        return NULL;
    }
    Py_ssize_t n, token;
    if (positive_size(args[1], &n) < 0) return NULL;
    token = PyLong_AsSsize_t(args[2]);
    if (token == -1 && PyErr_Occurred()) return NULL;
    return stats_of_row(x, n, token);
}

/* float *llama_get_logits_ith(struct llama_context *ctx, int32_t i), from llama.h */
typedef float *(*get_logits_ith_fn)(void *ctx, int32_t i);

static PyObject *row_stats_at(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "row_stats_at(get_logits_ith, ctx, n, nonfinite, i, token) takes 6 arguments");
        return NULL;
    }
    void *function = PyLong_AsVoidPtr(args[0]);
    void *ctx = PyLong_AsVoidPtr(args[1]);
    if (function == NULL || ctx == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "no llama_get_logits_ith or no context");
        return NULL;
    }
    Py_ssize_t n, token;
    if (positive_size(args[2], &n) < 0) return NULL;
    long i = PyLong_AsLong(args[4]);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < INT32_MIN || i > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "logits row %ld is out of range", i);
        return NULL;
    }
    token = PyLong_AsSsize_t(args[5]);
    if (token == -1 && PyErr_Occurred()) return NULL;
    get_logits_ith_fn get_logits_ith;
    memcpy(&get_logits_ith, &function, sizeof get_logits_ith);
    const float *x = get_logits_ith(ctx, (int32_t)i);
    if (x == NULL) {
        PyErr_Format(PyExc_ValueError, "llama.cpp has no logits for output row %ld", i);
        return NULL;
    }
    PyObject *stats = stats_of_row(x, n, token);
    if (stats != Py_None) return stats;
    Py_DECREF(stats);
    PyObject *address = PyLong_FromVoidPtr((void *)x);
    if (address == NULL) return NULL;
    PyObject *call_args[3] = {address, args[2], args[5]};
    PyObject *result = PyObject_Vectorcall(args[3], call_args, 3, NULL);
    Py_DECREF(address);
    return result;
}

/* Whether a buffer's struct format is one of `codes` in native byte order ("?", "@?", "=?"; "<?" here). */
static int native_format(const char *format, const char *codes) {
    if (format == NULL) format = "B";
    if (*format == '@' || *format == '=') format++;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    else if (*format == '<') format++;
#endif
    return format[0] != '\0' && format[1] == '\0' && strchr(codes, format[0]) != NULL;
}

/* tuple.__new__(row_type, (chosen, top1, runner_up, margin, logprob, sampled)) */
static PyObject *make_sampled_row(PyTypeObject *row_type, Py_ssize_t chosen, Py_ssize_t top1, Py_ssize_t runner_up,
                                  double margin, double logprob, double sampled) {
    PyObject *values[6] = {PyLong_FromSsize_t(chosen), PyLong_FromSsize_t(top1), PyLong_FromSsize_t(runner_up),
                           PyFloat_FromDouble(margin), PyFloat_FromDouble(logprob), PyFloat_FromDouble(sampled)};
    PyObject *row = NULL;
    if (values[0] && values[1] && values[2] && values[3] && values[4] && values[5])
        row = row_type->tp_alloc(row_type, 6);
    if (row == NULL) {
        for (int k = 0; k < 6; k++) Py_XDECREF(values[k]);
        return NULL;
    }
    for (int k = 0; k < 6; k++) PyTuple_SET_ITEM(row, k, values[k]);
    return row;
}

/* The row at x that has a NaN or infinite logit, by nonfinite(address, n, token) -> (top1, runner_up,
 * margin, logprob); 0, or -1 with an exception set. */
static int nonfinite_row(PyObject *nonfinite, const float *x, Py_ssize_t n, Py_ssize_t token, Py_ssize_t *top1,
                         Py_ssize_t *runner_up, double *margin, double *logprob) {
    PyObject *address = PyLong_FromVoidPtr((void *)x);
    PyObject *n_obj = PyLong_FromSsize_t(n);
    PyObject *token_obj = PyLong_FromSsize_t(token);
    PyObject *stats = NULL;
    if (address && n_obj && token_obj) {
        PyObject *call_args[3] = {address, n_obj, token_obj};
        stats = PyObject_Vectorcall(nonfinite, call_args, 3, NULL);
    }
    Py_XDECREF(address);
    Py_XDECREF(n_obj);
    Py_XDECREF(token_obj);
    if (stats == NULL) return -1;
    int ok = -1;
    PyObject *items = PySequence_Fast(stats, "nonfinite() must return (top1, runner_up, margin, logprob)");
    if (items != NULL && PySequence_Fast_GET_SIZE(items) == 4) {
        PyObject **item = PySequence_Fast_ITEMS(items);
        *top1 = PyLong_AsSsize_t(item[0]);
        *runner_up = PyLong_AsSsize_t(item[1]);
        *margin = PyFloat_AsDouble(item[2]);
        *logprob = PyFloat_AsDouble(item[3]);
        ok = PyErr_Occurred() ? -1 : 0;
        if (ok == 0 && (*top1 < 0 || *top1 >= n)) {
            PyErr_Format(PyExc_ValueError, "nonfinite() gave top-1 %zd outside the row of %zd logits", *top1, n);
            ok = -1;
        }
    } else if (items != NULL) {
        PyErr_SetString(PyExc_ValueError, "nonfinite() must return (top1, runner_up, margin, logprob)");
    }
    Py_XDECREF(items);
    Py_DECREF(stats);
    return ok;
}

static PyObject *sampled_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "sampled_rows(nonfinite, row_type, address, rows, n, row_stride, ids_address, "
                                         "ids_stride, ids_size, skip) takes 10 arguments");
        return NULL;
    }
    PyObject *nonfinite = args[0], *skip_obj = args[9];
    if (!PyType_Check(args[1]) || !PyType_IsSubtype((PyTypeObject *)args[1], &PyTuple_Type) ||
        ((PyTypeObject *)args[1])->tp_basicsize != PyTuple_Type.tp_basicsize) {
        PyErr_SetString(PyExc_TypeError, "row_type must be a tuple subclass without fields of its own (a NamedTuple)");
        return NULL;
    }
    PyTypeObject *row_type = (PyTypeObject *)args[1];
    const char *logits = PyLong_AsVoidPtr(args[2]);
    if (logits == NULL && PyErr_Occurred()) return NULL;
    Py_ssize_t rows = PyLong_AsSsize_t(args[3]);
    if (rows == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t n;
    if (positive_size(args[4], &n) < 0) return NULL;
    Py_ssize_t row_stride = PyLong_AsSsize_t(args[5]);
    if (row_stride == -1 && PyErr_Occurred()) return NULL;
    const char *ids = PyLong_AsVoidPtr(args[6]);
    if (ids == NULL && PyErr_Occurred()) return NULL;
    Py_ssize_t ids_stride = PyLong_AsSsize_t(args[7]);
    if (ids_stride == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t ids_size = PyLong_AsSsize_t(args[8]);
    if (ids_size == -1 && PyErr_Occurred()) return NULL;
    if (rows < 0) {
        PyErr_SetString(PyExc_ValueError, "rows must not be negative");
        return NULL;
    }
    if (ids_size != 4 && ids_size != 8) {
        PyErr_SetString(PyExc_ValueError, "sampled ids must be int32 or int64 (ids_size 4 or 8)");
        return NULL;
    }
    if (rows > 0 && (logits == NULL || ids == NULL)) {
        PyErr_SetString(PyExc_ValueError, "no logits or no sampled ids (NULL address)");
        return NULL;
    }
    Py_buffer skip;
    int have_skip = 0;
    if (skip_obj != Py_None) {
        if (PyObject_GetBuffer(skip_obj, &skip, PyBUF_RECORDS_RO) < 0) return NULL;
        have_skip = 1;
        if (skip.ndim != 1 || skip.itemsize != 1 || !native_format(skip.format, "?bB") || skip.shape[0] < rows) {
            PyErr_SetString(PyExc_ValueError, "skip must be a bool array with at least one entry per logits row");
            PyBuffer_Release(&skip);
            return NULL;
        }
    }
    PyObject *out = PyList_New(rows);
    for (Py_ssize_t i = 0; out != NULL && i < rows; i++) {
        const float *x = (const float *)(logits + i * row_stride);
        Py_ssize_t token, top1, runner_up;
        double margin, logprob;
        if (ids_size == 4) {
            int32_t id;
            memcpy(&id, ids + i * ids_stride, sizeof id);
            token = id;
        } else {
            int64_t id;
            memcpy(&id, ids + i * ids_stride, sizeof id);
            token = (Py_ssize_t)id;
        }
        PyObject *row = NULL;
        if (have_skip && *((const char *)skip.buf + i * skip.strides[0])) {
            row = make_sampled_row(row_type, token, -1, -1, 0.0, 0.0, 0.0);
        } else if (check_token(token, n) == 0) {
            int finite = compute_row(x, n, token, &top1, &runner_up, &margin, &logprob);
            if (finite == 0) finite = nonfinite_row(nonfinite, x, n, token, &top1, &runner_up, &margin, &logprob) + 1;
            if (finite > 0) {
                if (token != top1 && x[token] == x[top1]) { /* a random sampler took a token tied with the maximum */
                    runner_up = top1;
                    top1 = token;
                }
                row = make_sampled_row(row_type, token, top1, runner_up, margin, logprob, 1.0);
            }
        }
        if (row == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, row);
    }
    if (have_skip) PyBuffer_Release(&skip);
    return out;
}

static PyObject *kernels(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    PyObject *names = PyList_New(0);
    if (names == NULL) return NULL;
    for (int k = 0; k < N_KERNELS; k++) {
        if (!kernel_runs_here(&KERNELS[k])) continue;
        PyObject *name = PyUnicode_FromString(KERNELS[k].name);
        if (name == NULL || PyList_Append(names, name) < 0) {
            Py_XDECREF(name);
            Py_DECREF(names);
            return NULL;
        }
        Py_DECREF(name);
    }
    return names;
}

static PyObject *use_kernel(PyObject *module, PyObject *name) {
    const char *wanted = PyUnicode_AsUTF8(name);
    if (wanted == NULL) return NULL;
    for (int k = 0; k < N_KERNELS; k++) {
        if (strcmp(KERNELS[k].name, wanted) == 0 && kernel_runs_here(&KERNELS[k])) {
            const char *previous = current->name;
            current = &KERNELS[k];
            if (PyModule_AddStringConstant(module, "KERNEL", current->name) < 0) return NULL;
            return PyUnicode_FromString(previous);
        }
    }
    PyErr_Format(PyExc_ValueError, "no kernel %R runs on this CPU", name);
    return NULL;
}

static PyMethodDef methods[] = {
    {"row_stats", (PyCFunction)(void (*)(void))row_stats, METH_FASTCALL,
     "row_stats(address, n, token) -> (top1, runner_up, margin, logprob), or None for a non-finite row."},
    {"row_stats_at", (PyCFunction)(void (*)(void))row_stats_at, METH_FASTCALL,
     "row_stats_at(get_logits_ith, ctx, n, nonfinite, i, token) -> (top1, runner_up, margin, logprob):\n"
     "the row llama_get_logits_ith(ctx, i) points to (function and context as addresses);\n"
     "nonfinite(address, n, token) answers for a row with a NaN or infinite logit."},
    {"sampled_rows", (PyCFunction)(void (*)(void))sampled_rows, METH_FASTCALL,
     "sampled_rows(nonfinite, row_type, address, rows, n, row_stride, ids_address, ids_stride, ids_size, skip)\n"
     "-> [row_type (chosen, top1, runner_up, margin, logprob, sampled)]: a sampler's step, one row per logits row\n"
     "(see rowstats.sampled_rows_numpy)."},
    {"kernels", kernels, METH_NOARGS, "Names of the vector kernels this CPU runs, widest first."},
    {"use_kernel", use_kernel, METH_O,
     "use_kernel(name) -> the previous kernel's name: compute with another kernel (for tests; all give the same bits)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_rowstats", "The per-token numbers of one raw logits row (see rowstats.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rowstats(void) {
#ifdef KV_X86
    __builtin_cpu_init();
#endif
    for (int k = 0; k < N_KERNELS && current == NULL; k++)
        if (kernel_runs_here(&KERNELS[k])) current = &KERNELS[k];
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (PyModule_AddStringConstant(module, "KERNEL", current->name) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
