/* Token ids hashed in their place, in one call per request: the compiled twin of
 * kvtrace/recording/capture.py's `_encrypt` (the construction and why it is safe are explained
 * there).  For position i with keys (k0, k1, k2):
 *
 *     hash = P(P(id ^ k0) ^ k1) ^ k2, top bit cleared;  a negative id stays -1
 *
 * with P SplitMix64's output function.  Integer arithmetic only, so both give the same bits on
 * every machine.  What it saves is the per-element Python work around numpy (a list to an array,
 * the array back to a list of ints, ~15 array operations): ids are read straight from the lists
 * the recorder keeps and the hashes written as little-endian int64, the spool's packed form.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ROUNDS 2
#define KEYS_PER_POSITION (ROUNDS + 1)
#define LOW_63 UINT64_C(0x7FFFFFFFFFFFFFFF)

static inline uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

static inline uint64_t little_endian_u64(const unsigned char *p) {
    uint64_t v = 0;
    for (int b = 7; b >= 0; b--) v = (v << 8) | p[b];
    return v;
}

static inline void store_little_endian_u64(unsigned char *p, uint64_t v) {
    for (int b = 0; b < 8; b++, v >>= 8) p[b] = (unsigned char)v;
}

/* One sequence of ids (ints, or anything with __index__) → little-endian int64 hashes as bytes. */
static PyObject *encrypt_one(PyObject *ids, const unsigned char *keys, Py_ssize_t positions) {
    PyObject *fast = PySequence_Fast(ids, "token ids must be a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > positions) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "more ids than keyed positions");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    unsigned char *hashes = (unsigned char *)PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long id = PyLong_AsLongLong(items[i]);
        if (id == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            Py_DECREF(out);
            return NULL;
        }
        if (id < 0) {
            store_little_endian_u64(hashes + 8 * i, UINT64_MAX); /* -1 */
            continue;
        }
        const unsigned char *k = keys + (size_t)i * KEYS_PER_POSITION * 8;
        uint64_t z = (uint64_t)id ^ little_endian_u64(k);
        for (int r = 1; r <= ROUNDS; r++) z = mix(z) ^ little_endian_u64(k + 8 * r);
        store_little_endian_u64(hashes + 8 * i, z & LOW_63);
    }
    Py_DECREF(fast);
    return out;
}

static PyObject *encrypt_ids(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "encrypt_ids(keys, arrays) takes 2 arguments");
        return NULL;
    }
    Py_buffer keys;
    if (PyObject_GetBuffer(args[0], &keys, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t positions = keys.len / (KEYS_PER_POSITION * 8);
    PyObject *arrays = PySequence_Fast(args[1], "arrays must be a sequence of id sequences");
    if (arrays == NULL) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(arrays);
    PyObject *result = PyTuple_New(count);
    for (Py_ssize_t a = 0; result != NULL && a < count; a++) {
        PyObject *hashed = encrypt_one(PySequence_Fast_GET_ITEM(arrays, a), keys.buf, positions);
        if (hashed == NULL) Py_CLEAR(result);
        else PyTuple_SET_ITEM(result, a, hashed);
    }
    Py_DECREF(arrays);
    PyBuffer_Release(&keys);
    return result;
}

static PyMethodDef methods[] = {
    {"encrypt_ids", (PyCFunction)(void (*)(void))encrypt_ids, METH_FASTCALL,
     "encrypt_ids(keys, arrays) -> one bytes of little-endian int64 hashes per array of ids: id i hashed\n"
     "under the three little-endian uint64 keys at keys[24*i:24*i+24]; a negative id gives -1."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_placehash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__placehash(void) { return PyModule_Create(&module); }
