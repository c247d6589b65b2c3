/* The vector kernels of _rowstats.c, included once per vector width.
 *
 * The includer defines WIDTH (floats per vector: 4, 8 or 16, dividing LANES), KERNEL(name) (the name
 * of this width's copy), KERNEL_TARGET (the instruction set it is compiled for) and TO_DOUBLE(half)
 * (a VHALF's floats as a VDOUBLE).  Every width
 * does the same float32 operations on each logit and adds each exp to the same float64 lane
 * (i % LANES) in index order, so every width gives the same bits.
 */

#define VFLOAT KERNEL(vfloat)
#define VINT KERNEL(vint)
#define VHALF KERNEL(vhalf)
#define VDOUBLE KERNEL(vdouble)
#define VSPLIT KERNEL(vsplit)
#define ACCUMULATORS (LANES / (WIDTH / 2))

typedef float VFLOAT __attribute__((vector_size(WIDTH * sizeof(float))));
typedef int32_t VINT __attribute__((vector_size(WIDTH * sizeof(int32_t))));
typedef float VHALF __attribute__((vector_size(WIDTH / 2 * sizeof(float))));
typedef double VDOUBLE __attribute__((vector_size(WIDTH / 2 * sizeof(double))));
typedef union {
    VFLOAT all;
    VHALF half[2];
} VSPLIT;

#define KV_INLINE static inline __attribute__((always_inline)) KERNEL_TARGET

KV_INLINE VFLOAT KERNEL(broadcast)(float value) {
    VFLOAT v = {0};
    return v + value;
}

KV_INLINE VFLOAT KERNEL(load)(const float *x) {
    VFLOAT v;
    memcpy(&v, x, sizeof v);
    return v;
}

/* x[0..len) (len <= WIDTH, may be <= 0) with the missing lanes -inf: they never win a maximum and
 * add an exp of 0. */
KV_INLINE VFLOAT KERNEL(load_partial)(const float *x, Py_ssize_t len) {
    float padded[WIDTH];
    for (int j = 0; j < WIDTH; j++) padded[j] = -INFINITY;
    if (len > 0) memcpy(padded, x, (size_t)len * sizeof(float));
    return KERNEL(load)(padded);
}

KV_INLINE VFLOAT KERNEL(blend)(VINT mask, VFLOAT yes, VFLOAT no) {
    return (VFLOAT)((mask & (VINT)yes) | (~mask & (VINT)no));
}

KV_INLINE VFLOAT KERNEL(vmax)(VFLOAT a, VFLOAT b) { return KERNEL(blend)(a > b, a, b); }

/* exp(d) for d <= 0, lane by lane (Cephes' expf: range reduction by ln 2, degree-5 polynomial,
 * 2^n from bits); 0 below EXP_LOW. */
KV_INLINE VFLOAT KERNEL(exp_nonpositive)(VFLOAT d) {
    VINT under = d < KERNEL(broadcast)(EXP_LOW);
    VFLOAT x = KERNEL(blend)(under, KERNEL(broadcast)(EXP_LOW), d);
    VFLOAT t = x * LOG2E + ROUNDER;
    VFLOAT n = t - ROUNDER;
    VFLOAT r = x - n * LN2_HI;
    r = r - n * LN2_LO;
    VFLOAT p = KERNEL(broadcast)(P0);
    p = p * r + P1;
    p = p * r + P2;
    p = p * r + P3;
    p = p * r + P4;
    p = p * r + P5;
    VFLOAT y = p * r * r + r + 1.0f;
    VINT scale = ((VINT)t - (ROUNDER_BITS - 127)) << 23;
    return KERNEL(blend)(under, KERNEL(broadcast)(0.0f), y * (VFLOAT)scale);
}

/* Maximum of x[0..n) and of each block of BLOCK; NaN never wins (a NaN row is caught by the sum). */
KERNEL_TARGET static float KERNEL(block_maxima)(const float *x, Py_ssize_t n, float *block_max) {
    float peak = -INFINITY;
    Py_ssize_t blocks = (n + BLOCK - 1) / BLOCK;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        const float *xb = x + b * BLOCK;
        Py_ssize_t len = n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK;
        Py_ssize_t whole = len - len % WIDTH;
        VFLOAT most = KERNEL(broadcast)(-INFINITY);
        for (Py_ssize_t i = 0; i < whole; i += WIDTH) most = KERNEL(vmax)(KERNEL(load)(xb + i), most);
        if (whole < len) most = KERNEL(vmax)(KERNEL(load_partial)(xb + whole, len - whole), most);
        float m = -INFINITY;
        for (int j = 0; j < WIDTH; j++) m = most[j] > m ? most[j] : m;
        block_max[b] = m;
        peak = m > peak ? m : peak;
    }
    return peak;
}

/* Adds the float32 values e to the accumulators of their lanes (two vectors of WIDTH / 2 float64). */
KV_INLINE void KERNEL(add_to_lanes)(VDOUBLE *lanes, VFLOAT e) {
    VSPLIT halves = {.all = e};
    lanes[0] += TO_DOUBLE(halves.half[0]);
    lanes[1] += TO_DOUBLE(halves.half[1]);
}

/* Adds exp(v - peak) to the accumulators of v's lanes. */
KV_INLINE void KERNEL(accumulate)(VDOUBLE *lanes, VFLOAT v, float peak) {
    KERNEL(add_to_lanes)(lanes, KERNEL(exp_nonpositive)(v - peak));
}

/* Sum over i of exp(x[i] - peak): lane i % LANES accumulates in float64, in index order; then the
 * lanes are added in order. */
KERNEL_TARGET static double KERNEL(exp_sum)(const float *x, Py_ssize_t n, float peak) {
    VDOUBLE lanes[ACCUMULATORS];
    for (int a = 0; a < ACCUMULATORS; a++) lanes[a] = (VDOUBLE){0};
    Py_ssize_t whole = n - n % LANES, pairs = whole - whole % (2 * LANES), i = 0;
    /* Two groups of LANES at a time, their exps first: the polynomial is one long chain of dependent
     * operations, and four or more chains side by side keep the vector unit busy. */
    for (; i < pairs; i += 2 * LANES) {
        VFLOAT e[2 * LANES / WIDTH];
        for (int k = 0; k < 2 * LANES / WIDTH; k++) e[k] = KERNEL(exp_nonpositive)(KERNEL(load)(x + i + k * WIDTH) - peak);
        for (int k = 0; k < 2 * LANES / WIDTH; k++) KERNEL(add_to_lanes)(lanes + 2 * (k % (LANES / WIDTH)), e[k]);
    }
    for (; i < whole; i += LANES)
        for (int k = 0; k < LANES / WIDTH; k++)
            KERNEL(accumulate)(lanes + 2 * k, KERNEL(load)(x + i + k * WIDTH), peak);
    if (whole < n)
        for (int k = 0; k < LANES / WIDTH; k++) {
            Py_ssize_t rest = n - whole - k * WIDTH;
            KERNEL(accumulate)(lanes + 2 * k, KERNEL(load_partial)(x + whole + k * WIDTH, rest < WIDTH ? rest : WIDTH),
                               peak);
        }
    double total = 0.0;
    for (int a = 0; a < ACCUMULATORS; a++)
        for (int j = 0; j < WIDTH / 2; j++) total += lanes[a][j];
    return total;
}

#undef VFLOAT
#undef VINT
#undef VHALF
#undef VDOUBLE
#undef VSPLIT
#undef ACCUMULATORS
#undef KV_INLINE
