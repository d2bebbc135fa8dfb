/* Route MLX's float32 GEMM to OpenBLAS on Linux.
 *
 * The mlx[cpu] wheel links a reference BLAS (about 4 GFLOP/s here). scipy-openblas32
 * ships a fast OpenBLAS, but with prefixed symbol names. This library defines the
 * standard cblas_sgemm name by forwarding to scipy_cblas_sgemm; tiny_llm loads it
 * with RTLD_GLOBAL before mlx.core, so MLX's own calls resolve here first.
 */
#include <cblas.h>

void cblas_sgemm(const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE trans_a,
                 const enum CBLAS_TRANSPOSE trans_b, const blasint m, const blasint n,
                 const blasint k, const float alpha, const float *a, const blasint lda,
                 const float *b, const blasint ldb, const float beta, float *c,
                 const blasint ldc) {
  scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
