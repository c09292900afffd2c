"""C source of the native sequential kernels (see :mod:`paraprop.scan.native`).

Kept as a Python string so that it ships with the package without package-data settings. The
body is compiled twice, once per scalar type (``float`` -> ``*_f32``, ``double`` -> ``*_f64``).
"""

# The kernels evaluate h_t = A_t h_prev + b_t step by step, one batch row after another
# (batch rows are independent, so the caller splits them across threads). Every array is
# addressed as base + n * stride_n + t * stride_t (+ the feature index, contiguous), so
# time-major, batch-major and broadcast (stride 0) layouts need no copy. `reverse` walks t from
# T-1 down to 0 (h_prev = h_{t+1}); h0 == NULL means a zero initial state.
BODY = r"""
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

typedef long long i64;

/* Flush subnormals to zero while a kernel runs. A backward pass multiplies by Jacobians whose
   products decay geometrically, and arithmetic on subnormal floats costs ~100 cycles on x86:
   without this a long recurrence can run 5x slower. Only values below the smallest normal
   number (1.2e-38 in float32) change. */
static unsigned pp_ftz_begin(void) {
#if defined(__SSE__)
    unsigned old = _mm_getcsr();
    _mm_setcsr(old | 0x8040u); /* FTZ | DAZ */
    return old;
#else
    return 0;
#endif
}

static void pp_ftz_end(unsigned old) {
#if defined(__SSE__)
    _mm_setcsr(old);
#else
    (void)old;
#endif
}

#define T_ SCALAR

/* Built once generic (sizes at run time) and, for large problems, once per state size with
   PP_FIXED_H / PP_FIXED_K defined: known trip counts let the compiler unroll and vectorise the
   short inner loops completely (about 2.5x faster at H = 20). */
#ifdef PP_FIXED_H
#define HH ((i64)PP_FIXED_H)
#else
#define HH H
#endif
#ifdef PP_FIXED_K
#define KK ((i64)PP_FIXED_K)
#else
#define KK K
#endif

/* out_i = b_i + sum_k A[i, k] h_k  (A_t dense, rows contiguous) */
void SFX(pp_dense)(i64 N, i64 T, i64 H, int reverse,
                   const T_ *restrict A, i64 A_sn, i64 A_st,
                   const T_ *restrict b, i64 b_sn, i64 b_st,
                   const T_ *restrict h0, i64 h0_sn,
                   T_ *restrict out, i64 o_sn, i64 o_st) {
    const unsigned csr = pp_ftz_begin();
    T_ *restrict h = (T_ *)malloc(sizeof(T_) * (size_t)HH);
    for (i64 n = 0; n < N; ++n) {
        if (h0) memcpy(h, h0 + n * h0_sn, sizeof(T_) * (size_t)HH);
        else memset(h, 0, sizeof(T_) * (size_t)HH);
        for (i64 s = 0; s < T; ++s) {
            const i64 t = reverse ? T - 1 - s : s;
            const T_ *restrict At = A + n * A_sn + t * A_st;
            const T_ *restrict bt = b + n * b_sn + t * b_st;
            T_ *restrict ot = out + n * o_sn + t * o_st;
            for (i64 i = 0; i < HH; ++i) {
                const T_ *restrict row = At + i * HH;
                T_ acc = 0;
                for (i64 k = 0; k < HH; ++k) acc += row[k] * h[k];
                ot[i] = acc + bt[i];
            }
            memcpy(h, ot, sizeof(T_) * (size_t)HH);
        }
    }
    free(h);
    pp_ftz_end(csr);
}

/* out_i = a_i h_i + b_i  (A_t diagonal) */
void SFX(pp_diag)(i64 N, i64 T, i64 H, int reverse,
                  const T_ *restrict a, i64 a_sn, i64 a_st,
                  const T_ *restrict b, i64 b_sn, i64 b_st,
                  const T_ *restrict h0, i64 h0_sn,
                  T_ *restrict out, i64 o_sn, i64 o_st) {
    const unsigned csr = pp_ftz_begin();
    for (i64 n = 0; n < N; ++n) {
        const T_ *hp = h0 ? h0 + n * h0_sn : NULL;
        for (i64 s = 0; s < T; ++s) {
            const i64 t = reverse ? T - 1 - s : s;
            const T_ *restrict at = a + n * a_sn + t * a_st;
            const T_ *restrict bt = b + n * b_sn + t * b_st;
            T_ *restrict ot = out + n * o_sn + t * o_st;
            if (hp) {
                for (i64 i = 0; i < HH; ++i) ot[i] = at[i] * hp[i] + bt[i];
            } else {
                for (i64 i = 0; i < HH; ++i) ot[i] = bt[i];
            }
            hp = ot;
        }
    }
    pp_ftz_end(csr);
}

/* A_t = diag(d_t) + L diag(s_t) R with L (H x K) or NULL = [I ... I] (block sum) and
   R (K x H) or NULL = [I; ...; I] (block tile). The caller passes the transposes
   LT = L^T (K x H) and RT = R^T (H x K), row-major, so that both products are axpy loops over
   contiguous rows (vectorised without reassociating sums):
   u = s_t * (R h) = s_t * sum_j h_j RT[j, :],   out = b_t + d_t * h + sum_k u_k LT[k, :]. */
void SFX(pp_factored)(i64 N, i64 T, i64 H, i64 K, int reverse,
                      const T_ *restrict d, i64 d_sn, i64 d_st,
                      const T_ *restrict sc, i64 s_sn, i64 s_st,
                      const T_ *restrict LT, const T_ *restrict RT,
                      const T_ *restrict b, i64 b_sn, i64 b_st,
                      const T_ *restrict h0, i64 h0_sn,
                      T_ *restrict out, i64 o_sn, i64 o_st) {
    const unsigned csr = pp_ftz_begin();
    T_ *restrict h = (T_ *)malloc(sizeof(T_) * (size_t)(H + K));
    T_ *restrict u = h + H;
    for (i64 n = 0; n < N; ++n) {
        if (h0) memcpy(h, h0 + n * h0_sn, sizeof(T_) * (size_t)HH);
        else memset(h, 0, sizeof(T_) * (size_t)HH);
        for (i64 s = 0; s < T; ++s) {
            const i64 t = reverse ? T - 1 - s : s;
            const T_ *restrict st = sc + n * s_sn + t * s_st;
            const T_ *restrict bt = b + n * b_sn + t * b_st;
            T_ *restrict ot = out + n * o_sn + t * o_st;
            if (RT) {
                for (i64 k = 0; k < KK; ++k) u[k] = 0;
                for (i64 j = 0; j < HH; ++j) {
                    const T_ hj = h[j];
                    const T_ *restrict row = RT + j * KK;
                    for (i64 k = 0; k < KK; ++k) u[k] += hj * row[k];
                }
                for (i64 k = 0; k < KK; ++k) u[k] *= st[k];
            } else {
                for (i64 j0 = 0; j0 < KK; j0 += HH)
                    for (i64 i = 0; i < HH; ++i) u[j0 + i] = h[i] * st[j0 + i];
            }
            for (i64 i = 0; i < HH; ++i) ot[i] = bt[i];
            if (d) {
                const T_ *restrict dt = d + n * d_sn + t * d_st;
                for (i64 i = 0; i < HH; ++i) ot[i] += dt[i] * h[i];
            }
            if (LT) {
                for (i64 k = 0; k < KK; ++k) {
                    const T_ uk = u[k];
                    const T_ *restrict row = LT + k * HH;
                    for (i64 i = 0; i < HH; ++i) ot[i] += uk * row[i];
                }
            } else {
                for (i64 j0 = 0; j0 < KK; j0 += HH)
                    for (i64 i = 0; i < HH; ++i) ot[i] += u[j0 + i];
            }
            memcpy(h, ot, sizeof(T_) * (size_t)HH);
        }
    }
    free(h);
    pp_ftz_end(csr);
}

/* The LSTM Jacobians on the state x = [x_h; x_c] (H here is the hidden size, the state has 2H;
   see paraprop.scan.LSTMFactored), s_t (4H), f_t and k_t (H) per step, W_hh shared.
   transposed (back-propagation), W = W_hh (4H x H) row-major, axpy over its rows:
       v = x_c + k_t x_h,  u = s_t * [v; v; v; x_h],  y_h = sum_q u_q W[q, :],  y_c = f_t v;
   forward (Newton), W = W_hh^T (H x 4H) row-major:
       u = s_t * sum_j x_h[j] W[j, :],  y_c = u_i + u_f + u_g + f_t x_c,  y_h = u_o + k_t y_c;
   and out = y + b_t. */
void SFX(pp_lstm)(i64 N, i64 T, i64 H, int transposed, int reverse,
                  const T_ *restrict sc, i64 s_sn, i64 s_st,
                  const T_ *restrict fg, i64 f_sn, i64 f_st,
                  const T_ *restrict kk, i64 k_sn, i64 k_st,
                  const T_ *restrict W,
                  const T_ *restrict b, i64 b_sn, i64 b_st,
                  const T_ *restrict h0, i64 h0_sn,
                  T_ *restrict out, i64 o_sn, i64 o_st) {
    const unsigned csr = pp_ftz_begin();
    T_ *restrict x = (T_ *)malloc(sizeof(T_) * (size_t)(7 * H));
    T_ *restrict u = x + 2 * H;      /* 4H */
    T_ *restrict v = u + 4 * H;      /* H */
    for (i64 n = 0; n < N; ++n) {
        if (h0) memcpy(x, h0 + n * h0_sn, sizeof(T_) * (size_t)(2 * HH));
        else memset(x, 0, sizeof(T_) * (size_t)(2 * HH));
        for (i64 s = 0; s < T; ++s) {
            const i64 t = reverse ? T - 1 - s : s;
            const T_ *restrict st = sc + n * s_sn + t * s_st;
            const T_ *restrict ft = fg + n * f_sn + t * f_st;
            const T_ *restrict kt = kk + n * k_sn + t * k_st;
            const T_ *restrict bt = b + n * b_sn + t * b_st;
            T_ *restrict ot = out + n * o_sn + t * o_st;
            if (transposed) {
                for (i64 i = 0; i < HH; ++i) v[i] = x[HH + i] + kt[i] * x[i];
                for (i64 i = 0; i < HH; ++i) {
                    u[i] = st[i] * v[i];
                    u[HH + i] = st[HH + i] * v[i];
                    u[2 * HH + i] = st[2 * HH + i] * v[i];
                    u[3 * HH + i] = st[3 * HH + i] * x[i];
                }
                for (i64 i = 0; i < HH; ++i) ot[i] = bt[i];
                for (i64 q = 0; q < 4 * HH; ++q) {
                    const T_ uq = u[q];
                    const T_ *restrict row = W + q * HH;
                    for (i64 i = 0; i < HH; ++i) ot[i] += uq * row[i];
                }
                for (i64 i = 0; i < HH; ++i) ot[HH + i] = bt[HH + i] + ft[i] * v[i];
            } else {
                for (i64 q = 0; q < 4 * HH; ++q) u[q] = 0;
                for (i64 j = 0; j < HH; ++j) {
                    const T_ xj = x[j];
                    const T_ *restrict row = W + j * 4 * HH;
                    for (i64 q = 0; q < 4 * HH; ++q) u[q] += xj * row[q];
                }
                for (i64 i = 0; i < HH; ++i) {
                    const T_ yc = st[i] * u[i] + st[HH + i] * u[HH + i]
                                  + st[2 * HH + i] * u[2 * HH + i] + ft[i] * x[HH + i];
                    ot[HH + i] = yc + bt[HH + i];
                    ot[i] = st[3 * HH + i] * u[3 * HH + i] + kt[i] * yc + bt[i];
                }
            }
            memcpy(x, ot, sizeof(T_) * (size_t)(2 * HH));
        }
    }
    free(x);
    pp_ftz_end(csr);
}
"""

UNITS = {
    "f32": "#define SCALAR float\n#define SFX(name) name##_f32\n",
    "f64": "#define SCALAR double\n#define SFX(name) name##_f64\n",
}
