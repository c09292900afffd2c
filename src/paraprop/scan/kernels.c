/* The native sequential kernels of paraprop.scan (loaded by paraprop/scan/native.py, built by
   paraprop/scan/native_build.py). This body is compiled twice, once per scalar type: the unit
   defines SCALAR (float or double) and SFX(name) (name_f32 or name_f64), then includes it.

   The kernels evaluate h_t = A_t h_prev + b_t step by step, one batch row after another
   (batch rows are independent, so the caller splits them across threads). Every array is
   addressed as base + n * stride_n + t * stride_t (+ the feature index, contiguous), so
   time-major, batch-major and broadcast (stride 0) layouts need no copy. `reverse` walks t from
   T-1 down to 0 (h_prev = h_{t+1}); h0 == NULL means a zero initial state. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
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

/* ---- the cells' forward recurrences (paraprop.nn forward="native") ----------------------------
   Elementwise functions: in float, exp by range reduction and a degree-7 polynomial, exact to
   about 1 ulp and written so that the compiler vectorises the loops that call it (libm's scalar
   expf/tanhf would cost more than the matrix-vector products at these sizes); tanh as an odd
   polynomial below |x| = 0.55 and from exp above; in double, libm. */
#ifdef PP_SINGLE
static inline float pp_exp_neg(float y) {          /* exp(y) for y <= 0 (clamped at -87) */
    y = y < -87.0f ? -87.0f : y;
    const float kf = floorf(y * 1.44269504088896341f + 0.5f);
    /* y - k ln2 with ln2 in two parts (k 0.693359375 is exact); explicit fmas, which the
       reassociation the kernels are compiled with leaves alone */
    const float r = fmaf(kf, 2.12194440e-4f, fmaf(-kf, 0.693359375f, y));
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)kf + 127) * (1 << 23);           /* 2^k as a float */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float pp_tanh1(float x) {
    const float a = fabsf(x), x2 = x * x;
    float p = 6404582.0f / 10854718875.0f;          /* Taylor series to x^17 (|x| < 0.55) */
    p = p * x2 - 929569.0f / 638512875.0f;
    p = p * x2 + 21844.0f / 6081075.0f;
    p = p * x2 - 1382.0f / 155925.0f;
    p = p * x2 + 62.0f / 2835.0f;
    p = p * x2 - 17.0f / 315.0f;
    p = p * x2 + 2.0f / 15.0f;
    p = p * x2 - 1.0f / 3.0f;
    const float small = x + x * x2 * p;
    const float e = pp_exp_neg(-2.0f * (a > 9.0f ? 9.0f : a));
    const float big = copysignf((1.0f - e) / (1.0f + e), x);
    return a < 0.55f ? small : big;
}

static inline float pp_sigmoid1(float x) {
    const float e = pp_exp_neg(-fabsf(x)), q = 1.0f / (1.0f + e);
    return x >= 0.0f ? q : e * q;                   /* NaN stays NaN */
}
#else
static inline double pp_tanh1(double x) { return tanh(x); }

static inline double pp_sigmoid1(double x) {
    const double e = exp(-fabs(x)), q = 1.0 / (1.0 + e);
    return x >= 0.0 ? q : e * q;
}
#endif

/* Several batch rows' hidden products at once, so that each row of W is loaded once per group
   of rows and the partial sums stay in registers (a small matrix-matrix product):
       acc[r * Gp + q] = init[r][q] (0 for init[r] NULL) + sum_{j < H} h[r][j] W[j * Gp + q],
   r < R <= 4, q < G, with W (H x Gp) row-major, its rows zero-padded to Gp, a multiple of the
   vector length (pp_pad), so that no scalar tail is left. The summation order over j is the
   same for every layout. */
#if defined(__AVX512F__)
#define PP_VBYTES 64
#define PP_NV 4
#else
#define PP_VBYTES 32
#define PP_NV 2
#endif
typedef T_ SFX(pp_vec) __attribute__((vector_size(PP_VBYTES), aligned(sizeof(T_))));
#define VEC SFX(pp_vec)
#define VL ((i64)(PP_VBYTES / sizeof(T_)))

/* W (H x G) as rows of Gp = G rounded up to the vector length: W itself when G is a multiple,
   else a zero-padded copy in *owned (free it; NULL when none was made). */
static const T_ *SFX(pp_pad)(const T_ *W, i64 H, i64 G, i64 *Gp, T_ **owned) {
    *Gp = (G + VL - 1) / VL * VL;
    *owned = NULL;
    if (*Gp == G) return W;
    T_ *p = (T_ *)calloc((size_t)(H * *Gp), sizeof(T_));
    for (i64 j = 0; j < H; ++j) memcpy(p + j * *Gp, W + j * G, sizeof(T_) * (size_t)G);
    *owned = p;
    return p;
}

static void SFX(pp_rows_product)(i64 R, i64 H, i64 G, i64 Gp, const T_ *restrict W,
                                 const T_ *const *init, const T_ *const *h, T_ *restrict acc) {
    for (i64 r = 0; r < R; ++r) {
        T_ *restrict ar = acc + r * Gp;
        if (init[r]) memcpy(ar, init[r], sizeof(T_) * (size_t)G);
        else memset(ar, 0, sizeof(T_) * (size_t)G);
        for (i64 q = G; q < Gp; ++q) ar[q] = 0;
    }
    i64 q0 = 0;
    if (R == 4) {
        for (; q0 + PP_NV * VL <= Gp; q0 += PP_NV * VL) {
            VEC a[4][PP_NV];
            for (int r = 0; r < 4; ++r)
                for (int v = 0; v < PP_NV; ++v)
                    a[r][v] = *(const VEC *)(acc + r * Gp + q0 + v * VL);
            for (i64 j = 0; j < H; ++j) {
                const T_ *restrict w = W + j * Gp + q0;
                VEC wv[PP_NV];
                for (int v = 0; v < PP_NV; ++v) wv[v] = *(const VEC *)(w + v * VL);
                for (int r = 0; r < 4; ++r) {
                    const T_ hr = h[r][j];
                    for (int v = 0; v < PP_NV; ++v) a[r][v] += hr * wv[v];
                }
            }
            for (int r = 0; r < 4; ++r)
                for (int v = 0; v < PP_NV; ++v) *(VEC *)(acc + r * Gp + q0 + v * VL) = a[r][v];
        }
        for (; q0 < Gp; q0 += VL) {
            VEC a[4];
            for (int r = 0; r < 4; ++r) a[r] = *(const VEC *)(acc + r * Gp + q0);
            for (i64 j = 0; j < H; ++j) {
                const VEC wv = *(const VEC *)(W + j * Gp + q0);
                for (int r = 0; r < 4; ++r) a[r] += h[r][j] * wv;
            }
            for (int r = 0; r < 4; ++r) *(VEC *)(acc + r * Gp + q0) = a[r];
        }
        return;
    }
    for (i64 r = 0; r < R; ++r) {
        const T_ *restrict hr = h[r];
        for (q0 = 0; q0 < Gp; q0 += VL) {
            VEC a = *(const VEC *)(acc + r * Gp + q0);
            for (i64 j = 0; j < H; ++j) a += hr[j] * *(const VEC *)(W + j * Gp + q0);
            *(VEC *)(acc + r * Gp + q0) = a;
        }
    }
}

/* The factored and LSTM kernels below walk time in the outer loop and the batch rows in groups
   of four inside it, like the forward kernels: their products with W go through
   pp_rows_product. prev[r] is row r's state of the previous step (h0, or zeros, first). */
#define PP_PREV_ROWS(width_zero)                                                                \
            const i64 R = N - n0 < 4 ? N - n0 : 4;                                              \
            const T_ *prev[4] = {width_zero, width_zero, width_zero, width_zero};               \
            for (i64 r = 0; r < R; ++r) {                                                       \
                const i64 n = n0 + r;                                                           \
                if (s) prev[r] = out + n * o_sn + tp * o_st;                                    \
                else if (h0) prev[r] = h0 + n * h0_sn;                                          \
            }

/* A_t = diag(d_t) + L diag(s_t) R with L (H x K) or NULL = [I ... I] (block sum) and
   R (K x H) or NULL = [I; ...; I] (block tile). The caller passes the transposes
   LT = L^T (K x H) and RT = R^T (H x K), row-major:
   u = s_t * (R h) = s_t * sum_j h_j RT[j, :],   out = b_t + sum_k u_k LT[k, :] + d_t * h. */
void SFX(pp_factored)(i64 N, i64 T, i64 H, i64 K, int reverse,
                      const T_ *restrict d, i64 d_sn, i64 d_st,
                      const T_ *restrict sc, i64 s_sn, i64 s_st,
                      const T_ *restrict LT, const T_ *restrict RT,
                      const T_ *restrict b, i64 b_sn, i64 b_st,
                      const T_ *restrict h0, i64 h0_sn,
                      T_ *restrict out, i64 o_sn, i64 o_st) {
    const unsigned csr = pp_ftz_begin();
    i64 Kp = KK, Hp = HH;
    T_ *ownR = NULL, *ownL = NULL;
    const T_ *Rp = RT ? SFX(pp_pad)(RT, HH, KK, &Kp, &ownR) : NULL;
    const T_ *Lp = LT ? SFX(pp_pad)(LT, KK, HH, &Hp, &ownL) : NULL;
    if (!RT) Kp = (KK + VL - 1) / VL * VL;
    if (!LT) Hp = (HH + VL - 1) / VL * VL;
    T_ *restrict u = (T_ *)malloc(sizeof(T_) * (size_t)(4 * Kp + 4 * Hp + HH));
    T_ *restrict acc = u + 4 * Kp;
    T_ *restrict zero = acc + 4 * Hp;
    memset(zero, 0, sizeof(T_) * (size_t)HH);
    const T_ *none[4] = {NULL, NULL, NULL, NULL};
    for (i64 s = 0; s < T; ++s) {
        const i64 t = reverse ? T - 1 - s : s, tp = reverse ? t + 1 : t - 1;
        for (i64 n0 = 0; n0 < N; n0 += 4) {
            PP_PREV_ROWS(zero)
            const T_ *bt[4] = {NULL, NULL, NULL, NULL}, *ur[4] = {u, u, u, u};
            for (i64 r = 0; r < R; ++r) {
                bt[r] = b + (n0 + r) * b_sn + t * b_st;
                ur[r] = u + r * Kp;
            }
            if (RT) SFX(pp_rows_product)(R, HH, KK, Kp, Rp, none, prev, u);
            for (i64 r = 0; r < R; ++r) {
                const T_ *restrict st = sc + (n0 + r) * s_sn + t * s_st;
                T_ *restrict ru = u + r * Kp;
                if (RT) {
                    for (i64 k = 0; k < KK; ++k) ru[k] *= st[k];
                } else {
                    for (i64 j0 = 0; j0 < KK; j0 += HH)
                        for (i64 i = 0; i < HH; ++i) ru[j0 + i] = prev[r][i] * st[j0 + i];
                }
            }
            if (LT) {
                SFX(pp_rows_product)(R, KK, HH, Hp, Lp, bt, ur, acc);
            } else {
                for (i64 r = 0; r < R; ++r) {
                    T_ *restrict ra = acc + r * Hp;
                    const T_ *restrict ru = u + r * Kp;
                    for (i64 i = 0; i < HH; ++i) ra[i] = bt[r][i];
                    for (i64 j0 = 0; j0 < KK; j0 += HH)
                        for (i64 i = 0; i < HH; ++i) ra[i] += ru[j0 + i];
                }
            }
            for (i64 r = 0; r < R; ++r) {
                const i64 n = n0 + r;
                const T_ *restrict ra = acc + r * Hp;
                T_ *restrict ot = out + n * o_sn + t * o_st;
                if (d) {
                    const T_ *restrict dt = d + n * d_sn + t * d_st;
                    const T_ *restrict h = prev[r];
                    for (i64 i = 0; i < HH; ++i) ot[i] = ra[i] + dt[i] * h[i];
                } else {
                    for (i64 i = 0; i < HH; ++i) ot[i] = ra[i];
                }
            }
        }
    }
    free(u);
    free(ownR);
    free(ownL);
    pp_ftz_end(csr);
}

/* The LSTM Jacobians on the state x = [x_h; x_c] (H here is the hidden size, the state has 2H;
   see paraprop.scan.LSTMFactored), s_t (4H), f_t and k_t (H) per step, W_hh shared.
   transposed (back-propagation), W = W_hh (4H x H) row-major:
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
    i64 Gp;                            /* the padded width of W's rows: H or 4H, rounded up */
    T_ *ownW = NULL;
    const T_ *Wp = SFX(pp_pad)(W, transposed ? 4 * HH : HH, transposed ? HH : 4 * HH, &Gp, &ownW);
    T_ *restrict u = (T_ *)malloc(sizeof(T_) * (size_t)(4 * (4 * HH + Gp) + 4 * HH + 4 * Gp
                                                         + 2 * HH));
    T_ *restrict v = u + 4 * (4 * HH + Gp);  /* 4 x H */
    T_ *restrict acc = v + 4 * HH;           /* 4 x Gp */
    T_ *restrict zero = acc + 4 * Gp;        /* 2H */
    memset(zero, 0, sizeof(T_) * (size_t)(2 * HH));
    const T_ *none[4] = {NULL, NULL, NULL, NULL};
    for (i64 s = 0; s < T; ++s) {
        const i64 t = reverse ? T - 1 - s : s, tp = reverse ? t + 1 : t - 1;
        for (i64 n0 = 0; n0 < N; n0 += 4) {
            PP_PREV_ROWS(zero)
            if (transposed) {
                const T_ *bt[4] = {NULL, NULL, NULL, NULL}, *ur[4] = {u, u, u, u};
                for (i64 r = 0; r < R; ++r) {
                    const i64 n = n0 + r;
                    const T_ *restrict st = sc + n * s_sn + t * s_st;
                    const T_ *restrict kt = kk + n * k_sn + t * k_st;
                    const T_ *restrict x = prev[r];
                    T_ *restrict rv = v + r * HH, *restrict ru = u + r * (4 * HH + Gp);
                    for (i64 i = 0; i < HH; ++i) rv[i] = x[HH + i] + kt[i] * x[i];
                    for (i64 i = 0; i < HH; ++i) {
                        ru[i] = st[i] * rv[i];
                        ru[HH + i] = st[HH + i] * rv[i];
                        ru[2 * HH + i] = st[2 * HH + i] * rv[i];
                        ru[3 * HH + i] = st[3 * HH + i] * x[i];
                    }
                    bt[r] = b + n * b_sn + t * b_st;
                    ur[r] = ru;
                }
                SFX(pp_rows_product)(R, 4 * HH, HH, Gp, Wp, bt, ur, acc);
                for (i64 r = 0; r < R; ++r) {
                    const i64 n = n0 + r;
                    const T_ *restrict ft = fg + n * f_sn + t * f_st;
                    const T_ *restrict rv = v + r * HH, *restrict ra = acc + r * Gp;
                    T_ *restrict ot = out + n * o_sn + t * o_st;
                    for (i64 i = 0; i < HH; ++i) ot[i] = ra[i];
                    for (i64 i = 0; i < HH; ++i) ot[HH + i] = bt[r][HH + i] + ft[i] * rv[i];
                }
            } else {
                SFX(pp_rows_product)(R, HH, 4 * HH, Gp, Wp, none, prev, u);
                for (i64 r = 0; r < R; ++r) {
                    const i64 n = n0 + r;
                    const T_ *restrict st = sc + n * s_sn + t * s_st;
                    const T_ *restrict ft = fg + n * f_sn + t * f_st;
                    const T_ *restrict kt = kk + n * k_sn + t * k_st;
                    const T_ *restrict bt = b + n * b_sn + t * b_st;
                    const T_ *restrict x = prev[r], *restrict ru = u + r * Gp;
                    T_ *restrict ot = out + n * o_sn + t * o_st;
                    for (i64 i = 0; i < HH; ++i) {
                        const T_ yc = st[i] * ru[i] + st[HH + i] * ru[HH + i]
                                      + st[2 * HH + i] * ru[2 * HH + i] + ft[i] * x[HH + i];
                        ot[HH + i] = yc + bt[HH + i];
                        ot[i] = st[3 * HH + i] * ru[3 * HH + i] + kt[i] * yc + bt[i];
                    }
                }
            }
        }
    }
    free(u);
    free(ownW);
    pp_ftz_end(csr);
}

/* The forward kernels walk time in the outer loop and the batch rows in groups of four inside
   it, as the scan kernels above (PP_PREV_ROWS; h0 NULL: zero states). */
#define PP_FORWARD_ROWS                                                                         \
    for (i64 s = 0; s < T; ++s)                                                                 \
        for (i64 n0 = 0, t = s, tp = s - 1; n0 < N; n0 += 4)

/* Their working memory: W = W_hh^T (H x G) as rows of Gp (pp_pad; own: the padded copy, or
   NULL), the hidden products of four rows (acc, 4 x Gp) and a zero state (zero, H), the last
   two in one allocation. */
typedef struct {
    const T_ *W;
    T_ *own, *acc, *zero;
    i64 Gp;
} SFX(pp_work);

static SFX(pp_work) SFX(pp_work_begin)(const T_ *WT, i64 H, i64 G) {
    SFX(pp_work) w;
    w.W = SFX(pp_pad)(WT, H, G, &w.Gp, &w.own);
    w.acc = (T_ *)malloc(sizeof(T_) * (size_t)(4 * w.Gp + H));
    w.zero = w.acc + 4 * w.Gp;
    memset(w.zero, 0, sizeof(T_) * (size_t)H);
    return w;
}

static void SFX(pp_work_end)(SFX(pp_work) *w) {
    free(w->acc);
    free(w->own);
}

/* Elman RNN: out_t = act(p_t + W_hh h_{t-1}), p (N, T, H) = W_ih x_t + b_ih + b_hh. */
void SFX(pp_rnn_fwd)(i64 N, i64 T, i64 H, int relu,
                     const T_ *restrict p, i64 p_sn, i64 p_st,
                     const T_ *restrict WT,
                     const T_ *restrict h0, i64 h0_sn,
                     T_ *restrict out, i64 o_sn, i64 o_st) {
    const unsigned csr = pp_ftz_begin();
    SFX(pp_work) work = SFX(pp_work_begin)(WT, HH, HH);
    const i64 Gp = work.Gp;
    const T_ *Wp = work.W;
    T_ *restrict a = work.acc, *restrict zero = work.zero;
    PP_FORWARD_ROWS {
        PP_PREV_ROWS(zero)
        const T_ *init[4] = {NULL, NULL, NULL, NULL};
        for (i64 r = 0; r < R; ++r) init[r] = p + (n0 + r) * p_sn + t * p_st;
        SFX(pp_rows_product)(R, HH, HH, Gp, Wp, init, prev, a);
        for (i64 r = 0; r < R; ++r) {
            T_ *restrict ar = a + r * Gp;
            T_ *restrict ot = out + (n0 + r) * o_sn + t * o_st;
            if (relu) {
                for (i64 i = 0; i < HH; ++i) ot[i] = ar[i] < 0 ? (T_)0 : ar[i];
            } else {  /* over the padded row: whole vectors, no scalar tail */
                for (i64 i = 0; i < Gp; ++i) ar[i] = pp_tanh1(ar[i]);
                memcpy(ot, ar, sizeof(T_) * (size_t)HH);
            }
        }
    }
    SFX(pp_work_end)(&work);
    pp_ftz_end(csr);
}

/* torch's GRU step (gates r, z, n):  r = sig(gi_r + gh_r), z = sig(gi_z + gh_z),
   n = tanh(gi_n + r gh_n), h' = (h - n) z + n,  gi (N, T, 3H) = W_ih x_t + b_ih,
   gh = W_hh h + b_hh (bh, or NULL). When zz is given, also the factors of the transposed
   Jacobian (paraprop.jacobians.cells.gru_scale): z (N, T, H), s (N, T, 3H), dn (N, T, H). */
void SFX(pp_gru_fwd)(i64 N, i64 T, i64 H,
                     const T_ *restrict gi, i64 g_sn, i64 g_st,
                     const T_ *restrict WT, const T_ *restrict bh,
                     const T_ *restrict h0, i64 h0_sn,
                     T_ *restrict out, i64 o_sn, i64 o_st,
                     T_ *restrict zz, i64 z_sn, i64 z_st,
                     T_ *restrict ss, i64 s_sn, i64 s_st,
                     T_ *restrict dd, i64 d_sn, i64 d_st) {
    const unsigned csr = pp_ftz_begin();
    SFX(pp_work) work = SFX(pp_work_begin)(WT, HH, 3 * HH);
    const i64 Gp = work.Gp;
    const T_ *Wp = work.W;
    T_ *restrict gh_all = work.acc, *restrict zero = work.zero;
    const T_ *bias[4] = {bh, bh, bh, bh};
    PP_FORWARD_ROWS {
        PP_PREV_ROWS(zero)
        SFX(pp_rows_product)(R, HH, 3 * HH, Gp, Wp, bias, prev, gh_all);
        for (i64 r = 0; r < R; ++r) {
            const i64 n = n0 + r;
            const T_ *restrict gh = gh_all + r * Gp;
            const T_ *restrict h = prev[r];
            const T_ *restrict gt = gi + n * g_sn + t * g_st;
            T_ *restrict ot = out + n * o_sn + t * o_st;
            T_ *restrict zt = zz ? zz + n * z_sn + t * z_st : NULL;
            T_ *restrict st = zz ? ss + n * s_sn + t * s_st : NULL;
            T_ *restrict dt = zz ? dd + n * d_sn + t * d_st : NULL;
            for (i64 i = 0; i < HH; ++i) {   /* (the compiler unswitches the zz test) */
                const T_ rg = pp_sigmoid1(gt[i] + gh[i]);
                const T_ z = pp_sigmoid1(gt[HH + i] + gh[HH + i]);
                const T_ c = pp_tanh1(gt[2 * HH + i] + rg * gh[2 * HH + i]);
                ot[i] = (h[i] - c) * z + c;
                if (zz) {
                    const T_ dn = (1 - c * c) * (1 - z);
                    zt[i] = z;
                    dt[i] = dn;
                    st[2 * HH + i] = dn * rg;
                    st[i] = dn * rg * gh[2 * HH + i] * (1 - rg);
                    st[HH + i] = (h[i] - c) * z * (1 - z);
                }
            }
        }
    }
    SFX(pp_work_end)(&work);
    pp_ftz_end(csr);
}

/* torch's LSTM step (gates i, f, g, o): a = gi + W_hh h, c' = f c + i g, h' = o tanh(c'),
   gi (N, T, 4H) = W_ih x_t + b_ih + b_hh. Writes h' to out and c' to cell (N, T, H). When ss is
   given, also the factors of paraprop.jacobians.cells.lstm_scale: s (N, T, 4H), f and k
   (N, T, H). */
void SFX(pp_lstm_fwd)(i64 N, i64 T, i64 H,
                      const T_ *restrict gi, i64 g_sn, i64 g_st,
                      const T_ *restrict WT,
                      const T_ *restrict h0, i64 h0_sn,
                      const T_ *restrict c0, i64 c0_sn,
                      T_ *restrict out, i64 o_sn, i64 o_st,
                      T_ *restrict cell, i64 c_sn, i64 c_st,
                      T_ *restrict ss, i64 s_sn, i64 s_st,
                      T_ *restrict ff, i64 f_sn, i64 f_st,
                      T_ *restrict kk, i64 k_sn, i64 k_st) {
    const unsigned csr = pp_ftz_begin();
    SFX(pp_work) work = SFX(pp_work_begin)(WT, HH, 4 * HH);
    const i64 Gp = work.Gp;
    const T_ *Wp = work.W;
    T_ *restrict a_all = work.acc, *restrict zero = work.zero;
    PP_FORWARD_ROWS {
        PP_PREV_ROWS(zero)
        const T_ *init[4] = {NULL, NULL, NULL, NULL};
        for (i64 r = 0; r < R; ++r) init[r] = gi + (n0 + r) * g_sn + t * g_st;
        SFX(pp_rows_product)(R, HH, 4 * HH, Gp, Wp, init, prev, a_all);
        for (i64 r = 0; r < R; ++r) {
            const i64 n = n0 + r;
            const T_ *restrict a = a_all + r * Gp;
            const T_ *restrict cp = t ? cell + n * c_sn + (t - 1) * c_st
                                      : (c0 ? c0 + n * c0_sn : zero);
            T_ *restrict ot = out + n * o_sn + t * o_st;
            T_ *restrict ct = cell + n * c_sn + t * c_st;
            T_ *restrict st = ss ? ss + n * s_sn + t * s_st : NULL;
            T_ *restrict ft = ss ? ff + n * f_sn + t * f_st : NULL;
            T_ *restrict kt = ss ? kk + n * k_sn + t * k_st : NULL;
            for (i64 q = 0; q < HH; ++q) {   /* (the compiler unswitches the ss test) */
                const T_ i = pp_sigmoid1(a[q]), f = pp_sigmoid1(a[HH + q]);
                const T_ g = pp_tanh1(a[2 * HH + q]), o = pp_sigmoid1(a[3 * HH + q]);
                const T_ c = f * cp[q] + i * g, tc = pp_tanh1(c);
                ct[q] = c;
                ot[q] = o * tc;
                if (ss) {
                    st[q] = g * i * (1 - i);
                    st[HH + q] = cp[q] * f * (1 - f);
                    st[2 * HH + q] = i * (1 - g * g);
                    st[3 * HH + q] = tc * o * (1 - o);
                    ft[q] = f;
                    kt[q] = o * (1 - tc * tc);
                }
            }
        }
    }
    SFX(pp_work_end)(&work);
    pp_ftz_end(csr);
}
