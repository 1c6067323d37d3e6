// Fused CPU kernels for PowerSGD's products in TensorFlow (hvd_compress.tensorflow.fused_ops).
//
// PowerSGD multiplies a big matrix M (rows x cols) by thin ones (r columns,
// r small): P = M Q, Q_w = M^T P, and rebuilds M's low-rank part P Q_w^T for
// the error-feedback residual M - P Q_w^T and for the decoded sum.  As
// TensorFlow ops these take a materialised transpose, general matrix
// products that are slow for r = 1..8, and a separate subtraction, each a
// pass over memory and a fresh tensor.  The kernels below make one pass each,
// at memory speed, on TensorFlow's CPU threads:
//
//   HvdcMatmul       M Q          (one row of M at a time, fixed lanes)
//   HvdcMatmulT      M^T P        (blocks of rows of M, their sums added in order)
//   HvdcLowRank      P Q^T        (streaming stores)
//   HvdcSubLowRank   M - P Q^T    (the product rounded to float32 first, as
//                                  the reference computes it, then subtracted)
//   HvdcAllFinite    no NaN/Inf in x
//
// Long sums (M Q, M^T P) add float32 products in float32 over short blocks
// and the blocks' sums in float64; P Q^T sums its r products in float32, as a
// plain float32 product does.  The order is fixed, so results do not depend on
// the number of threads; they agree with the numpy reference's float32 BLAS
// products to float32 rounding, not bit for bit (no two BLAS libraries agree
// bit for bit either).  Compiled without contraction of a*b+c into FMA
// (-ffp-contract=off).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/lib/core/threadpool.h"

namespace hvdc_lowrank {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;

constexpr int kMaxRank = 16;   // thin factors only; wider ones are general products
constexpr int kChunk = 1024;   // columns per inner pass (buffers on the stack)
constexpr int kLanes = 8;      // float32 partial sums per dot product, added in order

// fn(begin, end) over [0, n) on TensorFlow's CPU threads, `cost` per unit.
template <typename F>
void Parallel(OpKernelContext* ctx, int64_t n, int64_t cost, const F& fn) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  pool->ParallelFor(n, cost, [&](int64_t b, int64_t e) { fn(b, e); });
}

// dst[0..m) = src, with streaming stores from the first 32-byte boundary on:
// the destination's lines are not read first.  Fence() when a task is done.
inline void Store(float* __restrict dst, const float* __restrict src, int m) {
#if defined(__AVX__)
  int j = 0;
  for (; j < m && (reinterpret_cast<uintptr_t>(dst + j) & 31) != 0; ++j) dst[j] = src[j];
  for (; j + 8 <= m; j += 8) _mm256_stream_ps(dst + j, _mm256_loadu_ps(src + j));
  for (; j < m; ++j) dst[j] = src[j];
#else
  std::memcpy(dst, src, sizeof(float) * m);
#endif
}

inline void Fence() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}

// q (n x r, row-major) as r rows of n (qt[k * n + j] = q[j * r + k]).
std::vector<float> Transposed(const float* q, int64_t n, int r) {
  std::vector<float> qt(static_cast<size_t>(n) * r);
  for (int64_t j = 0; j < n; ++j)
    for (int k = 0; k < r; ++k) qt[k * n + j] = q[j * r + k];
  return qt;
}

Status CheckThin(const Tensor& t, const char* name, int64_t rows) {
  if (t.dims() != 2) return InvalidArgument(name, " must be a matrix, got ", t.shape().DebugString());
  if (t.dim_size(0) != rows) return InvalidArgument(name, " has ", t.dim_size(0), " rows, expected ", rows);
  if (t.dim_size(1) < 1 || t.dim_size(1) > kMaxRank)
    return InvalidArgument(name, " has ", t.dim_size(1), " columns, expected 1..", kMaxRank);
  return tensorflow::OkStatus();
}

// ---------------------------------------------------------------------------
// out = M Q (rows x r): each row's r dot products; float32 products summed in
// kLanes lanes over blocks of kSpan elements, the blocks' sums in float64.
class MatmulOp : public OpKernel {
 public:
  explicit MatmulOp(OpKernelConstruction* c) : OpKernel(c) {}
  void Compute(OpKernelContext* ctx) override {
    const Tensor& m_t = ctx->input(0);
    const Tensor& q_t = ctx->input(1);
    OP_REQUIRES(ctx, m_t.dims() == 2, InvalidArgument("m must be a matrix"));
    const int64_t rows = m_t.dim_size(0), cols = m_t.dim_size(1);
    OP_REQUIRES_OK(ctx, CheckThin(q_t, "q", cols));
    const int r = static_cast<int>(q_t.dim_size(1));
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows, r}), &out_t));
    const float* m = m_t.flat<float>().data();
    float* out = out_t->flat<float>().data();
    const std::vector<float> qt = Transposed(q_t.flat<float>().data(), cols, r);
    Parallel(ctx, rows, cols * (r + 1), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const float* row = m + i * cols;
        for (int k = 0; k < r; ++k) out[i * r + k] = static_cast<float>(Dot(row, qt.data() + k * cols, cols));
      }
    });
  }

 private:
  static constexpr int kSpan = 64;  // elements per float32 block (kSpan / kLanes per lane)

  static double Dot(const float* __restrict a, const float* __restrict b, int64_t n) {
    double s = 0;
    int64_t j = 0;
    for (; j + kSpan <= n; j += kSpan) {
      float lane[kLanes] = {0};
      for (int t = 0; t < kSpan; t += kLanes)
        for (int l = 0; l < kLanes; ++l) lane[l] += a[j + t + l] * b[j + t + l];
      double block = 0;
      for (int l = 0; l < kLanes; ++l) block += lane[l];
      s += block;
    }
    for (; j < n; ++j) s += static_cast<double>(a[j] * b[j]);
    return s;
  }
};

// out = M^T P (cols x r), reading M row by row: rows in a fixed number of
// blocks (at most kBlocks, each its own task), each block adding row i times
// P[i, k] in float32 over groups of kGroup rows and the groups' sums in
// float64; then the blocks' sums are added in block order.
class MatmulTOp : public OpKernel {
 public:
  explicit MatmulTOp(OpKernelConstruction* c) : OpKernel(c) {}
  void Compute(OpKernelContext* ctx) override {
    const Tensor& m_t = ctx->input(0);
    const Tensor& p_t = ctx->input(1);
    OP_REQUIRES(ctx, m_t.dims() == 2, InvalidArgument("m must be a matrix"));
    const int64_t rows = m_t.dim_size(0), cols = m_t.dim_size(1);
    OP_REQUIRES_OK(ctx, CheckThin(p_t, "p", rows));
    const int r = static_cast<int>(p_t.dim_size(1));
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({cols, r}), &out_t));
    const float* m = m_t.flat<float>().data();
    const float* p = p_t.flat<float>().data();
    float* out = out_t->flat<float>().data();
    // rows per block: a whole number of groups, at most kBlocks blocks
    const int64_t groups = (rows + kGroup - 1) / kGroup;
    const int64_t per = (groups + kBlocks - 1) / kBlocks * kGroup;
    const int64_t nb = (rows + per - 1) / per;
    const int64_t width = cols * r;  // one block's sums: [k][j]
    std::vector<double> sums(static_cast<size_t>(nb * width), 0.0);
    Parallel(ctx, nb, per * cols * (r + 1), [&](int64_t b0, int64_t b1) {
      std::vector<float> part(static_cast<size_t>(width));
      for (int64_t b = b0; b < b1; ++b) {
        double* __restrict acc = sums.data() + b * width;
        const int64_t end = std::min(rows, (b + 1) * per);
        for (int64_t g = b * per; g < end; g += kGroup) {
          std::fill(part.begin(), part.end(), 0.0f);
          for (int64_t i = g; i < std::min(end, g + kGroup); ++i) {
            const float* __restrict row = m + i * cols;
            for (int k = 0; k < r; ++k) {
              const float pk = p[i * r + k];
              float* __restrict a = part.data() + k * cols;
              for (int64_t j = 0; j < cols; ++j) a[j] += row[j] * pk;
            }
          }
          const float* __restrict pa = part.data();
          for (int64_t j = 0; j < width; ++j) acc[j] += pa[j];
        }
      }
    });
    Parallel(ctx, cols, nb * r * 2, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j)
        for (int k = 0; k < r; ++k) {
          double t = 0;
          for (int64_t b = 0; b < nb; ++b) t += sums[b * width + k * cols + j];
          out[j * r + k] = static_cast<float>(t);
        }
    });
  }

 private:
  static constexpr int64_t kGroup = 16;   // rows per float32 partial sum
  static constexpr int64_t kBlocks = 64;  // the most blocks of rows (tasks)
};

// out = (M -) P Q^T (rows x cols): each element's r products summed in
// float32 in order (as a plain float32 product does), with M subtracted from
// M's element.
template <bool kSub>
class LowRankOp : public OpKernel {
 public:
  explicit LowRankOp(OpKernelConstruction* c) : OpKernel(c) {}
  void Compute(OpKernelContext* ctx) override {
    const int first = kSub ? 1 : 0;
    const Tensor& p_t = ctx->input(first);
    const Tensor& q_t = ctx->input(first + 1);
    OP_REQUIRES(ctx, p_t.dims() == 2 && q_t.dims() == 2, InvalidArgument("p and q must be matrices"));
    const int64_t rows = p_t.dim_size(0), cols = q_t.dim_size(0);
    OP_REQUIRES_OK(ctx, CheckThin(p_t, "p", rows));
    OP_REQUIRES_OK(ctx, CheckThin(q_t, "q", cols));
    const int r = static_cast<int>(p_t.dim_size(1));
    OP_REQUIRES(ctx, q_t.dim_size(1) == r, InvalidArgument("p has ", r, " columns, q ", q_t.dim_size(1)));
    const float* m = nullptr;
    if (kSub) {
      const Tensor& m_t = ctx->input(0);
      OP_REQUIRES(ctx, m_t.dims() == 2 && m_t.dim_size(0) == rows && m_t.dim_size(1) == cols,
                  InvalidArgument("m has shape ", m_t.shape().DebugString(), ", expected [", rows, ",", cols, "]"));
      m = m_t.flat<float>().data();
    }
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows, cols}), &out_t));
    const float* p = p_t.flat<float>().data();
    float* out = out_t->flat<float>().data();
    const std::vector<float> qt = Transposed(q_t.flat<float>().data(), cols, r);
    Parallel(ctx, rows, cols * (r + 2), [&](int64_t i0, int64_t i1) {
      alignas(64) float buf[kChunk];
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t c = 0; c < cols; c += kChunk) {
          const int w = static_cast<int>(std::min<int64_t>(kChunk, cols - c));
          const float p0 = p[i * r];
          const float* __restrict q0 = qt.data() + c;
          for (int j = 0; j < w; ++j) buf[j] = p0 * q0[j];
          for (int k = 1; k < r; ++k) {
            const float pk = p[i * r + k];
            const float* __restrict qk = qt.data() + k * cols + c;
            for (int j = 0; j < w; ++j) buf[j] += pk * qk[j];
          }
          if (kSub) {
            const float* __restrict mr = m + i * cols + c;
            for (int j = 0; j < w; ++j) buf[j] = mr[j] - buf[j];
          }
          Store(out + i * cols + c, buf, w);
        }
      }
      Fence();
    });
  }
};

// Whether x (any shape) holds no NaN and no Inf: the exponent bits of every
// element, per block, or-ed together.
class AllFiniteOp : public OpKernel {
 public:
  explicit AllFiniteOp(OpKernelConstruction* c) : OpKernel(c) {}
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_t = ctx->input(0);
    const int64_t n = x_t.NumElements();
    const uint32_t* x = reinterpret_cast<const uint32_t*>(x_t.flat<float>().data());
    constexpr int64_t kBlock = 1 << 16;
    const int64_t nb = (n + kBlock - 1) / kBlock;
    std::vector<char> bad(nb, 0);
    Parallel(ctx, nb, kBlock, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t e = std::min(n, (b + 1) * kBlock);
        uint32_t any = 0;
        for (int64_t j = b * kBlock; j < e; ++j) any |= static_cast<uint32_t>((x[j] & 0x7f800000u) == 0x7f800000u);
        bad[b] = any != 0;
      }
    });
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out_t));
    out_t->scalar<bool>()() = std::find(bad.begin(), bad.end(), 1) == bad.end();
  }
};

}  // namespace hvdc_lowrank

namespace {
using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

// A [dim a of input i, dim b of input j] matrix.
tensorflow::Status Matrix(InferenceContext* c, int i, int a, int j, int b) {
  ShapeHandle x, y;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 2, &x));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(j), 2, &y));
  c->set_output(0, c->Matrix(c->Dim(x, a), c->Dim(y, b)));
  return tensorflow::OkStatus();
}
}  // namespace

REGISTER_OP("HvdcMatmul")
    .Input("m: float")
    .Input("q: float")
    .Output("out: float")
    .SetShapeFn([](InferenceContext* c) { return Matrix(c, 0, 0, 1, 1); });

REGISTER_OP("HvdcMatmulT")
    .Input("m: float")
    .Input("p: float")
    .Output("out: float")
    .SetShapeFn([](InferenceContext* c) { return Matrix(c, 0, 1, 1, 1); });

REGISTER_OP("HvdcLowRank")
    .Input("p: float")
    .Input("q: float")
    .Output("out: float")
    .SetShapeFn([](InferenceContext* c) { return Matrix(c, 0, 0, 1, 0); });

REGISTER_OP("HvdcSubLowRank")
    .Input("m: float")
    .Input("p: float")
    .Input("q: float")
    .Output("out: float")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle m;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &m));
      c->set_output(0, m);
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcAllFinite")
    .Input("x: float")
    .Output("finite: bool")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return tensorflow::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("HvdcMatmul").Device(tensorflow::DEVICE_CPU), hvdc_lowrank::MatmulOp);
REGISTER_KERNEL_BUILDER(Name("HvdcMatmulT").Device(tensorflow::DEVICE_CPU), hvdc_lowrank::MatmulTOp);
REGISTER_KERNEL_BUILDER(Name("HvdcLowRank").Device(tensorflow::DEVICE_CPU), hvdc_lowrank::LowRankOp<false>);
REGISTER_KERNEL_BUILDER(Name("HvdcSubLowRank").Device(tensorflow::DEVICE_CPU), hvdc_lowrank::LowRankOp<true>);
REGISTER_KERNEL_BUILDER(Name("HvdcAllFinite").Device(tensorflow::DEVICE_CPU), hvdc_lowrank::AllFiniteOp);
