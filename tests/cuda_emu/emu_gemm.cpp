/*
 * emu_gemm.cpp - the inner loops of the emulated cublasGemmEx, compiled optimised and
 * without sanitizers because they are most of the emulator's time in the trainer tests
 * (the packing around them, in emu_rt.cpp, is checked by the sanitizers).
 *
 * A is (m,k) and B is (n,k), both row-major and already widened to double; out is (m,n)
 * column-major: out[i + j*m] = sum over l of A[i*k + l] * B[j*k + l]. The sum is in double
 * by default, or with acc32 in fp32 in increasing l (what a naive fp32 kernel does).
 *
 * Not a model of cuBLAS: real GEMMs accumulate in fp32 in a tiled order, with FMAs and on
 * tensor cores, so their last bits differ from both modes here.
 */
#include <cstddef>
#include <thread>

extern "C" void emu_gemm_core(int m, int n, int k, const double *A, const double *B, double *out,
                              int acc32);

/* Columns [j0, j1) of out. */
static void gemm_columns(int m, int j0, int j1, int k, const double *A, const double *B,
                         double *out, int acc32)
{
    for (int j = j0; j < j1; j++)
        for (int i = 0; i < m; i++) {
            const double *a = A + (size_t)i * k, *b = B + (size_t)j * k;
            if (acc32) {
                float s = 0;
                for (int l = 0; l < k; l++)
                    s += (float)a[l] * (float)b[l];
                out[i + (size_t)j * m] = s;
            } else {
                double s = 0;
                for (int l = 0; l < k; l++)
                    s += a[l] * b[l];
                out[i + (size_t)j * m] = s;
            }
        }
}

extern "C" void emu_gemm_core(int m, int n, int k, const double *A, const double *B, double *out,
                              int acc32)
{
    /* Two threads for the larger products: the machines this runs on have few cores, and
     * each column's sum is the same whichever thread computes it. */
    if ((double)m * n * k < 1e6 || n < 2) {
        gemm_columns(m, 0, n, k, A, B, out, acc32);
        return;
    }
    std::thread t(gemm_columns, m, n / 2, n, k, A, B, out, acc32);
    gemm_columns(m, 0, n / 2, k, A, B, out, acc32);
    t.join();
}
