/*
 * matmul.cu - the linear layer on the GPU: the CUDA twins of ops_linear_forward and
 * ops_linear_backward, as cuBLAS GEMMs (cublasGemmEx, fp32 accumulation
 * CUBLAS_COMPUTE_32F, inputs fp32, bf16 or fp16) around two small kernels: the bias and
 * residual written into the output before the forward GEMM adds into it (beta = 1), and
 * the bias gradient as a deterministic column sum (reduce.cu).
 *
 * cuBLAS is column-major and our matrices are row-major. A row-major (R,K) matrix with
 * leading dimension K is, read column-major, its transpose (K,R) with the same leading
 * dimension. So each row-major product Y = A @ B is computed as Y^T = B^T @ A^T:
 *
 *   forward   out (N,OC) = inp (N,IC) @ W^T, W (OC,IC)
 *             out^T (OC,N) = W (OC,IC) @ inp^T (IC,N)
 *             gemm(opA = T on W as (IC,OC) ld IC, opB = N on inp as (IC,N) ld IC,
 *                  m = OC, n = N, k = IC, C = out as (OC,N) ld OC)
 *   d_inp     d_inp (N,IC) = d_out (N,OC) @ W (OC,IC)
 *             d_inp^T (IC,N) = W^T (IC,OC) @ d_out^T (OC,N)
 *             gemm(opA = N on W as (IC,OC) ld IC, opB = N on d_out as (OC,N) ld OC,
 *                  m = IC, n = N, k = OC, C = d_inp as (IC,N) ld IC, beta = 0)
 *   dW        dW (OC,IC) += d_out^T (OC,N) @ inp (N,IC)
 *             dW^T (IC,OC) += inp^T (IC,N) @ d_out (N,OC)
 *             gemm(opA = N on inp as (IC,N) ld IC, opB = T on d_out as (OC,N) ld OC,
 *                  m = IC, n = OC, k = N, C = dW as (IC,OC) ld IC, fp32, beta = 1)
 *
 * Precision: fp32 GEMMs run as true fp32 (CUBLAS_COMPUTE_32F) unless the caller has put
 * the handle in CUBLAS_TF32_TENSOR_OP_MATH; this file does not change the handle's math
 * mode. It sets the handle's stream to s and its pointer mode to host on every call.
 * The output is in the inputs' type or in fp32 (cuBLAS has no fp32-input GEMM with a 16-bit
 * output, nor one that mixes bf16 and fp16); any other out_dt is -EINVAL.
 *
 * Not here: fused epilogues (GELU, bias in cublasLt), the GEMM workspace policy (cuBLAS's
 * default), batched attention GEMMs.
 */
#include "kernels/common.cuh"

static cudaDataType_t cuda_type(enum kdtype dt)
{
    return dt == KDT_BF16 ? CUDA_R_16BF : dt == KDT_F16 ? CUDA_R_16F : CUDA_R_32F;
}

static int cublas_result(cublasStatus_t st)
{
    return st == CUBLAS_STATUS_SUCCESS ? 0 : -EIO;
}

static int use_stream(cublasHandle_t h, cudaStream_t s)
{
    int r = cublas_result(cublasSetStream(h, s));
    if (r == 0) r = cublas_result(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
    return r;
}

/* out (N,OC) = [residual (N,OC)] + [bias (OC)], the starting value the forward GEMM adds
 * to. out may be residual (each element is read, then written, by one thread). */
template <typename O, typename E>
__global__ static void bias_residual_kernel(O *out, const O *residual, const E *__restrict__ bias,
                                            size_t N, size_t OC)
{
    size_t total = N * OC, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        float r = residual ? ld(residual, i) : 0.0f;
        float b = bias ? ld(bias, i % OC) : 0.0f;
        st(out, i, r + b);
    }
}

template <typename O, typename E>
static int bias_residual_launch(void *out, const void *residual, const void *bias, size_t N,
                                size_t OC, cudaStream_t s)
{
    bias_residual_kernel<<<grid_for(N * OC, KTHREADS), KTHREADS, 0, s>>>(
        (O *)out, (const O *)residual, (const E *)bias, N, OC);
    return launch_result();
}

extern "C" int kernel_matmul_forward(cublasHandle_t h, void *out, enum kdtype out_dt,
                                     const void *inp, const void *W, const void *bias,
                                     const void *residual, int N, int IC, int OC, enum kdtype dt,
                                     void *scratch, cudaStream_t s)
{
    if (!h || !out || !inp || !W || N <= 0 || IC <= 0 || OC <= 0 || !dt_ok(dt) || !dt_ok(out_dt))
        return -EINVAL;
    if (out_dt != dt && out_dt != KDT_F32) return -EINVAL;
    int r = 0;
    /* With residual == out and no bias the GEMM adds straight into out. */
    if (bias || (residual && residual != out)) {
        size_t n = (size_t)N, oc = (size_t)OC;
        r = with_elem(dt, [&](auto t) {
            using E = ELEM(t);
            return out_dt == KDT_F32 ? bias_residual_launch<float, E>(out, residual, bias, n, oc, s)
                                     : bias_residual_launch<E, E>(out, residual, bias, n, oc, s);
        });
        if (r < 0) return r;
    }
    r = use_stream(h, s);
    if (r < 0) return r;
    const float alpha = 1.0f, beta = (bias || residual) ? 1.0f : 0.0f;
    cudaDataType_t t = cuda_type(dt);
    return cublas_result(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, IC, &alpha, W, t, IC, inp,
                                      t, IC, &beta, out, cuda_type(out_dt), OC, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
}

extern "C" int kernel_matmul_backward(cublasHandle_t h, void *d_inp, float *dW, float *db,
                                      const void *d_out, const void *inp, const void *W, int N,
                                      int IC, int OC, enum kdtype dt, void *scratch, cudaStream_t s)
{
    if (!h || !d_inp || !dW || !d_out || !inp || !W || (db && !scratch) || N <= 0 || IC <= 0 ||
        OC <= 0 || !dt_ok(dt))
        return -EINVAL;
    int r = use_stream(h, s);
    if (r < 0) return r;
    const float one = 1.0f, zero = 0.0f;
    cudaDataType_t t = cuda_type(dt);
    r = cublas_result(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, IC, N, OC, &one, W, t, IC, d_out, t,
                                   OC, &zero, d_inp, t, IC, CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
    if (r < 0) return r;
    r = cublas_result(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, IC, OC, N, &one, inp, t, IC, d_out,
                                   t, OC, &one, dW, CUDA_R_32F, IC, CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
    if (r < 0 || !db) return r;
    return kernel_colsum(db, d_out, N, OC, dt, scratch, s);
}
