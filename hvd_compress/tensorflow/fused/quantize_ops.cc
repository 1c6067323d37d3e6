// Fused CPU kernels for the TensorFlow quantizers (hvd_compress.tensorflow.fused_ops).
//
// Each encode op does a codec's whole per-element work -- the error-feedback
// sum g + residual, the statistics that set the scale, the codes, their bit
// packing and the new residual v - decode(v) -- in one or two passes over
// memory, where the chain of TensorFlow ops it replaces makes a pass (and a
// fresh 4-byte-per-element tensor) per step.  The arithmetic is the core's
// (hvd_compress/core/quantizers.py), in float32, in the same order, so the
// codes and residuals have the same bits; statistics accumulate in float64
// in fixed lanes and blocks added in a fixed order (another order than
// numpy's, agreeing after rounding to float32 as the numba kernels do), so
// results do not depend on the number of threads.  Non-finite entries count
// as 0 for the codes and the statistics (the core's clean-up) and clear the
// `finite` output.  The loops are written to vectorise (no branches on
// values), and big outputs are written with streaming stores.
//
// `residual` of 0 elements: no error feedback (residual_out is empty too).
// `noise` of 0 elements: uniform noise from a counter-based hash of the
// element index and the 64-bit `key` the caller draws from its generator.
// Compiled without contraction of a*b+c into FMA (-ffp-contract=off).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/lib/core/threadpool.h"

namespace hvdc {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;

// Elements per block (one task for a thread) and per chunk (what one pass of
// the inner loops holds in buffers on the stack).  Both are multiples of 8, so
// every block's and chunk's codes fill whole bytes for any width of 1..8 bits.
constexpr int64_t kBlock = 1 << 16;
constexpr int kChunk = 1024;
constexpr int kLanes = 8;  // float64 partial sums per block, added in lane order

inline int64_t PackedBytes(int64_t n, int bits) { return (n * bits + 7) / 8; }

// QSGD's code width: ceil(log2(2s + 1)) bits for s levels.
inline int QSGDBits(int levels) {
  int bits = 1;
  while ((1 << bits) < 2 * levels + 1) ++bits;
  return bits;
}

// fn(block, begin, end) for every block of [0, n), on TensorFlow's CPU threads.
template <typename F>
void ForBlocks(OpKernelContext* ctx, int64_t n, int64_t block, const F& fn) {
  const int64_t nb = (n + block - 1) / block;
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  pool->ParallelFor(nb, block * 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) fn(b, b * block, std::min(n, (b + 1) * block));
  });
}

// fn(c, m) for the chunks [c, c + m) of [begin, end).
template <typename F>
inline void ForChunks(int64_t begin, int64_t end, const F& fn) {
  for (int64_t c = begin; c < end; c += kChunk) fn(c, static_cast<int>(std::min<int64_t>(kChunk, end - c)));
}

// fn(j, stop, q, r) for the runs [j, stop) of a chunk [c, c + m) that lie in
// one period of p elements (a bucket, a row): element c + j = q * p + r.
template <typename F>
inline void ForRuns(int64_t c, int m, int64_t p, const F& fn) {
  for (int j = 0; j < m;) {
    const int64_t q = (c + j) / p, r = (c + j) % p;
    const int stop = static_cast<int>(std::min<int64_t>(m, j + (p - r)));
    fn(j, stop, q, r);
    j = stop;
  }
}

// dst[0..m) = src (a chunk's buffer on the stack, 64-byte aligned), with
// streaming stores where dst is 32-byte aligned: the destination's lines are
// not read first, which saves a quarter of a big output's memory traffic.
// Fence() before the block's work ends.
inline void Store(float* __restrict dst, const float* __restrict src, int m) {
#if defined(__AVX__)
  if ((reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
    int j = 0;
    for (; j + 8 <= m; j += 8) _mm256_stream_ps(dst + j, _mm256_load_ps(src + j));
    for (; j < m; ++j) dst[j] = src[j];
    return;
  }
#endif
  std::memcpy(dst, src, sizeof(float) * m);
}

inline void Fence() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}

// Element-wise helpers.  (Pointers are __restrict so that uint8 stores
// elsewhere, which may alias anything, do not stop vectorisation.)
inline void Add(const float* __restrict g, const float* __restrict r, int m, float* __restrict out) {
  for (int j = 0; j < m; ++j) out[j] = g[j] + r[j];
}

inline bool IsNonfinite(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u & 0x7f800000u) == 0x7f800000u;
}

inline bool Finite(const float* __restrict v, int m) {
  uint32_t bad = 0;
  for (int j = 0; j < m; ++j) bad |= IsNonfinite(v[j]);
  return bad == 0;
}

// out = v with NaN and Inf set to 0 (out may be v).
inline void Clean(const float* v, int m, float* out) {
  for (int j = 0; j < m; ++j) out[j] = IsNonfinite(v[j]) ? 0.0f : v[j];
}

// The common inputs: grad, residual (0 elements: no error feedback), and the
// new residual to write (nullptr: none).
struct Source {
  const float* g = nullptr;
  const float* r = nullptr;
  float* rout = nullptr;
  int64_t n = 0;

  // The values v = g (+ r) of [c, c + m): g itself where there is nothing to
  // add, else `buf`.  A chunk holding NaN or Inf is cleaned (those values set
  // to 0, as the core does) and clears `fin`.
  inline const float* Values(int64_t c, int m, float* buf, bool* fin) const {
    const float* v = g + c;
    if (r) {
      Add(g + c, r + c, m, buf);
      v = buf;
    }
    if (!Finite(v, m)) {
      *fin = false;
      Clean(v, m, buf);
      v = buf;
    }
    return v;
  }
  // The chunk's new residual goes to `buf` (nullptr without error feedback),
  // then Keep() stores it.
  float* Residual(float* buf) const { return rout ? buf : nullptr; }
  void Keep(int64_t c, int m, const float* buf) const {
    if (rout) Store(rout + c, buf, m);
  }
};

Status ReadSource(OpKernelContext* ctx, Source* src) {
  const Tensor& g = ctx->input(0);
  const Tensor& r = ctx->input(1);
  if (g.dims() != 1) return InvalidArgument("grad must be 1-d, got shape ", g.shape().DebugString());
  if (r.NumElements() != 0 && r.NumElements() != g.NumElements())
    return InvalidArgument("residual has ", r.NumElements(), " elements, grad ", g.NumElements());
  src->n = g.NumElements();
  src->g = g.flat<float>().data();
  src->r = r.NumElements() ? r.flat<float>().data() : nullptr;
  Tensor* rout;
  TF_RETURN_IF_ERROR(ctx->allocate_output("residual_out", TensorShape({src->r ? src->n : 0}), &rout));
  src->rout = src->r ? rout->flat<float>().data() : nullptr;
  return tensorflow::OkStatus();
}

// Clears the codes past m up to the next multiple of 8.
inline void ClearTail(uint8_t* code, int m) {
  for (int j = m; j < (m + 7) / 8 * 8; ++j) code[j] = 0;
}

void Pack(const uint8_t* __restrict code, int m, int bits, uint8_t* __restrict out);

// The pass that writes the codes (`bits` wide, packed into `codes`) and the
// new residual: fn(c, m, v, code, res) fills code[0..m) for the values v of
// [c, c + m) and, with error feedback, res[0..m).  `fin` (or nullptr): per
// block, whether its values were finite.
template <typename F>
void CodesPass(OpKernelContext* ctx, const Source& s, int bits, uint8_t* codes, std::vector<char>* fin,
               const F& fn) {
  ForBlocks(ctx, s.n, kBlock, [&](int64_t b, int64_t begin, int64_t end) {
    alignas(64) float buf[kChunk], res[kChunk];
    alignas(64) uint8_t code[kChunk];
    bool f = true;
    ForChunks(begin, end, [&](int64_t c, int m) {
      fn(c, m, s.Values(c, m, buf, &f), code, s.Residual(res));
      ClearTail(code, m);
      s.Keep(c, m, res);
      Pack(code, m, bits, codes + c * bits / 8);
    });
    Fence();
    if (fin) (*fin)[b] = f;
  });
}

// Uniform [0, 1) float32 noise with 24 random bits per value: a two-round
// 32-bit hash (murmur3's finaliser) of the element index under a 64-bit key.
// Stateless, so any split of the work gives the same noise.
inline uint32_t Fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

struct Noise {
  const float* given = nullptr;  // explicit noise, or nullptr: hashed
  uint32_t k0 = 0, k1 = 0;

  // u[0..m) for the elements [c, c + m) (a chunk never straddles 2**32).
  inline void Fill(int64_t c, int m, float* u) const {
    if (given) {
      std::memcpy(u, given + c, sizeof(float) * m);
      return;
    }
    const uint32_t lo = static_cast<uint32_t>(c);
    const uint32_t k1x = k1 ^ static_cast<uint32_t>(static_cast<uint64_t>(c) >> 32);
    for (int j = 0; j < m; ++j) {
      const uint32_t h = Fmix32(Fmix32((lo + static_cast<uint32_t>(j)) * 0x9E3779B1u + k0) ^ k1x);
      u[j] = static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
    }
  }
};

Status ReadNoise(OpKernelContext* ctx, int index, int64_t n, Noise* out) {
  const Tensor& noise = ctx->input(index);
  const Tensor& key = ctx->input(index + 1);
  if (noise.NumElements() != 0 && noise.NumElements() != n)
    return InvalidArgument("noise has ", noise.NumElements(), " elements, expected 0 or ", n);
  if (key.NumElements() < 1) return InvalidArgument("key must hold one int64");
  const uint64_t k = static_cast<uint64_t>(key.flat<int64_t>()(0));
  out->given = noise.NumElements() ? noise.flat<float>().data() : nullptr;
  out->k0 = static_cast<uint32_t>(k);
  out->k1 = static_cast<uint32_t>(k >> 32);
  return tensorflow::OkStatus();
}

// Packs m codes (each < 2**bits) into the PackedBytes(m, bits) stream bytes
// at `out`; code[m..) up to the next multiple of 8 must be 0.
void Pack(const uint8_t* __restrict code, int m, int bits, uint8_t* __restrict out) {
  const int nbytes = static_cast<int>(PackedBytes(m, bits));
  switch (bits) {
    case 1:
      for (int q = 0; q < nbytes; ++q) {
        const uint8_t* c = code + 8 * q;
        out[q] = static_cast<uint8_t>(c[0] | c[1] << 1 | c[2] << 2 | c[3] << 3 | c[4] << 4 | c[5] << 5 |
                                      c[6] << 6 | c[7] << 7);
      }
      return;
    case 2:
      for (int q = 0; q < nbytes; ++q) {
        const uint8_t* c = code + 4 * q;
        out[q] = static_cast<uint8_t>(c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6);
      }
      return;
    case 4:
      for (int q = 0; q < nbytes; ++q) out[q] = static_cast<uint8_t>(code[2 * q] | code[2 * q + 1] << 4);
      return;
    case 8:
      std::memcpy(out, code, m);
      return;
    default: {
      uint64_t acc = 0;
      int have = 0;
      for (int j = 0; j < m; ++j) {
        acc |= static_cast<uint64_t>(code[j]) << have;
        have += bits;
        while (have >= 8) {
          *out++ = static_cast<uint8_t>(acc);
          acc >>= 8;
          have -= 8;
        }
      }
      if (have > 0) *out = static_cast<uint8_t>(acc);
    }
  }
}

Status SetFinite(OpKernelContext* ctx, const std::vector<char>& fin) {
  Tensor* t;
  TF_RETURN_IF_ERROR(ctx->allocate_output("finite", TensorShape({}), &t));
  t->scalar<bool>()() = std::all_of(fin.begin(), fin.end(), [](char f) { return f != 0; });
  return tensorflow::OkStatus();
}

Status Scalar(OpKernelContext* ctx, const char* name, float value) {
  Tensor* t;
  TF_RETURN_IF_ERROR(ctx->allocate_output(name, TensorShape({1}), &t));
  t->flat<float>()(0) = value;
  return tensorflow::OkStatus();
}

uint8_t* Codes(OpKernelContext* ctx, int64_t n, int bits, Status* st) {
  Tensor* t = nullptr;
  *st = ctx->allocate_output("codes", TensorShape({PackedBytes(n, bits)}), &t);
  return st->ok() ? t->flat<uint8_t>().data() : nullptr;
}

// ---------------------------------------------------------------------------
// Per-chunk loops.  `rout` (the new residual) may be nullptr: no error feedback.

inline void ThresholdChunk(const float* __restrict v, int m, float tau, uint8_t* __restrict code,
                           float* __restrict rout) {
  // Branch-free selects (signs are random: branches would mispredict).
  const float ntau = -tau;
  for (int j = 0; j < m; ++j) code[j] = static_cast<uint8_t>((v[j] >= tau) | (v[j] <= ntau) << 1);
  if (rout) {
    for (int j = 0; j < m; ++j) {
      const float x = v[j];
      float dec = x >= tau ? tau : 0.0f;  // v - 0 is v, signed zeros included
      dec = x <= ntau ? ntau : dec;
      rout[j] = x - dec;
    }
  }
}

// float64 sums in kLanes = 8 lanes: lane l takes elements 8q + l, the lanes
// are added in order at the end.  Written with vector types so that the
// compiler neither branches nor leaves the lanes scalar.
typedef float F4 __attribute__((vector_size(16)));
typedef double D4 __attribute__((vector_size(32)));

inline D4 Widen(const float* p) {
  F4 x;
  std::memcpy(&x, p, sizeof(x));
  return __builtin_convertvector(x, D4);
}

struct Lanes {
  D4 lo = {0, 0, 0, 0}, hi = {0, 0, 0, 0};
  void AddTo(double* out) const {
    for (int l = 0; l < 4; ++l) out[l] += lo[l];
    for (int l = 0; l < 4; ++l) out[4 + l] += hi[l];
  }
};

// Count of v >= 0, sum of those, sum of the rest.
inline void SignSums(const float* __restrict v, int m, double* __restrict cnt, double* __restrict sp,
                     double* __restrict sn) {
  const D4 zero = {0, 0, 0, 0}, one = {1, 1, 1, 1};
  Lanes c, p, q;
  const int whole = m / kLanes * kLanes;
  for (int j = 0; j < whole; j += kLanes) {
    const D4 x0 = Widen(v + j), x1 = Widen(v + j + 4);
    const D4 p0 = x0 >= zero ? x0 : zero, p1 = x1 >= zero ? x1 : zero;
    c.lo += x0 >= zero ? one : zero;
    c.hi += x1 >= zero ? one : zero;
    p.lo += p0;
    p.hi += p1;
    q.lo += x0 >= zero ? zero : x0;
    q.hi += x1 >= zero ? zero : x1;
  }
  c.AddTo(cnt);
  p.AddTo(sp);
  q.AddTo(sn);
  for (int j = whole; j < m; ++j) {
    const double x = v[j];
    cnt[0] += x >= 0 ? 1.0 : 0.0;
    sp[0] += x >= 0 ? x : 0.0;
    sn[0] += x >= 0 ? 0.0 : x;
  }
}

inline void OnebitChunk(const float* __restrict v, int m, float pos, float neg, uint8_t* __restrict code,
                        float* __restrict rout) {
  for (int j = 0; j < m; ++j) code[j] = static_cast<uint8_t>(v[j] >= 0);
  if (rout) {
    for (int j = 0; j < m; ++j) {
      const float dec = v[j] >= 0 ? pos : neg;
      rout[j] = v[j] - dec;
    }
  }
}

// One row's run of columns: pos/neg per column.
inline void OnebitRun(const float* __restrict v, int m, const float* __restrict pos, const float* __restrict neg,
                      uint8_t* __restrict code, float* __restrict rout) {
  for (int j = 0; j < m; ++j) code[j] = static_cast<uint8_t>(v[j] >= 0);
  if (rout) {
    for (int j = 0; j < m; ++j) {
      const float dec = v[j] >= 0 ? pos[j] : neg[j];
      rout[j] = v[j] - dec;
    }
  }
}

// Per column (one value each): count of v >= 0, sum of those, sum of the rest.
inline void ColumnSignSums(const float* __restrict v, int m, double* __restrict cnt, double* __restrict sp,
                           double* __restrict sn) {
  const D4 zero = {0, 0, 0, 0}, one = {1, 1, 1, 1};
  int j = 0;
  for (; j + 4 <= m; j += 4) {
    const D4 x = Widen(v + j);
    D4 c, p, q;
    std::memcpy(&c, cnt + j, sizeof(c));
    std::memcpy(&p, sp + j, sizeof(p));
    std::memcpy(&q, sn + j, sizeof(q));
    c += x >= zero ? one : zero;
    p += x >= zero ? x : zero;
    q += x >= zero ? zero : x;
    std::memcpy(cnt + j, &c, sizeof(c));
    std::memcpy(sp + j, &p, sizeof(p));
    std::memcpy(sn + j, &q, sizeof(q));
  }
  for (; j < m; ++j) {
    const double x = v[j];
    cnt[j] += x >= 0 ? 1.0 : 0.0;
    sp[j] += x >= 0 ? x : 0.0;
    sn[j] += x >= 0 ? 0.0 : x;
  }
}

// The same sums from `rows` rows v[r][0..m), added in row order.
inline void ColumnSignSumsOfRows(const float* const* v, int rows, int m, double* __restrict cnt,
                                 double* __restrict sp, double* __restrict sn) {
  const D4 zero = {0, 0, 0, 0}, one = {1, 1, 1, 1};
  int j = 0;
  for (; j + 4 <= m; j += 4) {
    D4 c = zero, p = zero, q = zero;
    for (int r = 0; r < rows; ++r) {
      const D4 x = Widen(v[r] + j);
      c += x >= zero ? one : zero;
      p += x >= zero ? x : zero;
      q += x >= zero ? zero : x;
    }
    std::memcpy(cnt + j, &c, sizeof(c));
    std::memcpy(sp + j, &p, sizeof(p));
    std::memcpy(sn + j, &q, sizeof(q));
  }
  for (; j < m; ++j) {
    double c = 0.0, p = 0.0, q = 0.0;
    for (int r = 0; r < rows; ++r) {
      const double x = v[r][j];
      c += x >= 0 ? 1.0 : 0.0;
      p += x >= 0 ? x : 0.0;
      q += x >= 0 ? 0.0 : x;
    }
    cnt[j] = c;
    sp[j] = p;
    sn[j] = q;
  }
}

// Sum, sum of squares (float64) and largest magnitude.
inline void Moments(const float* __restrict v, int m, double* __restrict a, double* __restrict q,
                    float* __restrict mx) {
  Lanes s1, s2;
  float big = 0.0f;
  const int whole = m / kLanes * kLanes;
  for (int j = 0; j < whole; j += kLanes) {
    const D4 x0 = Widen(v + j), x1 = Widen(v + j + 4);
    s1.lo += x0;
    s1.hi += x1;
    s2.lo += x0 * x0;
    s2.hi += x1 * x1;
  }
  s1.AddTo(a);
  s2.AddTo(q);
  for (int j = whole; j < m; ++j) {
    const double x = v[j];
    a[0] += x;
    q[0] += x * x;
  }
  // |v| of finite floats orders as its bit pattern: an integer max vectorises.
  uint32_t bits = 0;
  for (int j = 0; j < m; ++j) {
    uint32_t u;
    std::memcpy(&u, v + j, 4);
    bits = std::max(bits, u & 0x7fffffffu);
  }
  std::memcpy(&big, &bits, 4);
  mx[0] = std::max(mx[0], big);
}

inline void TernGradChunk(const float* __restrict v, const float* __restrict u, int m, float cap, float safe,
                          float scale, uint8_t* __restrict code, float* __restrict rout) {
  const float zero = 0.0f * scale, nscale = -scale;
  for (int j = 0; j < m; ++j) {
    const float a = std::fabs(v[j]);
    const float prob = (a < cap ? a : cap) / safe;
    const uint8_t keep = u[j] < prob, neg = v[j] < 0;
    code[j] = static_cast<uint8_t>(keep + (keep & neg));
  }
  if (rout) {
    for (int j = 0; j < m; ++j) {
      float dec = v[j] < 0 ? nscale : scale;
      dec = code[j] ? dec : zero;
      rout[j] = v[j] - dec;
    }
  }
}

inline void SumSquares(const float* __restrict v, int m, double* __restrict q) {
  Lanes s2;
  const int whole = m / kLanes * kLanes;
  for (int j = 0; j < whole; j += kLanes) {
    const D4 x0 = Widen(v + j), x1 = Widen(v + j + 4);
    s2.lo += x0 * x0;
    s2.hi += x1 * x1;
  }
  s2.AddTo(q);
  for (int j = whole; j < m; ++j) q[0] += static_cast<double>(v[j]) * static_cast<double>(v[j]);
}

// One bucket's run: inverse scale ik = s / norm, decode factor fk = norm / s.
inline void QSGDRun(const float* __restrict v, const float* __restrict u, int m, float ik, float fk, int s,
                    uint8_t* __restrict code, float* __restrict rout) {
  const float sf = static_cast<float>(s);
  for (int j = 0; j < m; ++j) {
    const int lv = static_cast<int>(std::min(std::floor(std::fabs(v[j]) * ik + u[j]), sf));
    const int signed_lv = v[j] < 0 ? -lv : lv;
    code[j] = static_cast<uint8_t>(s + signed_lv);
  }
  if (rout) {
    for (int j = 0; j < m; ++j) rout[j] = v[j] - static_cast<float>(static_cast<int>(code[j]) - s) * fk;
  }
}

// m codes of `bits` bits from the stream bytes at src (any width 1..8).
inline void UnpackCodes(const uint8_t* __restrict src, int m, int bits, uint8_t* __restrict code) {
  const uint32_t mask = (1u << bits) - 1;
  for (int j = 0; j < m; ++j) {
    const int64_t bit = static_cast<int64_t>(j) * bits;
    uint32_t w = src[bit >> 3];
    if ((bit & 7) + bits > 8) w |= static_cast<uint32_t>(src[(bit >> 3) + 1]) << 8;
    code[j] = (w >> (bit & 7)) & mask;
  }
}

// For widths that divide 8: the values of the 8/bits codes of every byte
// value, so that decoding is one look-up (a short copy) per byte.
std::vector<float> ByteTable(const float* table, int bits) {
  const int per = 8 / bits;
  const uint32_t mask = (1u << bits) - 1;
  std::vector<float> t(256 * per);
  for (int b = 0; b < 256; ++b)
    for (int j = 0; j < per; ++j) t[b * per + j] = table[(b >> (j * bits)) & mask];
  return t;
}

template <int kPer>
inline void ExpandBytes(const uint8_t* __restrict src, int nbytes, const float* __restrict t, float* __restrict out) {
  for (int q = 0; q < nbytes; ++q) std::memcpy(out + q * kPer, t + src[q] * kPer, sizeof(float) * kPer);
}

// The values of the m codes of [c, c + m) from the stream bytes at src into
// val (room for kChunk + 8 values): by byte where there is a byte table
// (widths that divide 8, one column), else code by code; with cols > 1 the
// table is code-major, table[code * cols + column].
inline void Decode(const uint8_t* __restrict src, int64_t c, int m, int bits, int64_t cols,
                   const float* __restrict table, const std::vector<float>& byte_table, uint8_t* __restrict code,
                   float* __restrict val) {
  if (!byte_table.empty()) {
    const int nbytes = static_cast<int>(PackedBytes(m, bits));
    const float* t = byte_table.data();
    switch (bits) {
      case 1:
        return ExpandBytes<8>(src, nbytes, t, val);
      case 2:
        return ExpandBytes<4>(src, nbytes, t, val);
      case 4:
        return ExpandBytes<2>(src, nbytes, t, val);
      default:
        return ExpandBytes<1>(src, nbytes, t, val);
    }
  }
  UnpackCodes(src, m, bits, code);
  if (cols == 1) {
    for (int j = 0; j < m; ++j) val[j] = table[code[j]];
    return;
  }
  ForRuns(c, m, cols, [&](int j, int stop, int64_t, int64_t k) {  // one row's run of columns
    if (bits == 1) {  // a select between the two rows of the table
      const float* t0 = table + k;
      const float* t1 = table + cols + k;
      for (int i = j; i < stop; ++i) val[i] = code[i] ? t1[i - j] : t0[i - j];
    } else {
      for (int i = j; i < stop; ++i) val[i] = table[code[i] * cols + k + (i - j)];
    }
  });
}

// out = val * factor (scaled) or val.
inline void Finish(const float* __restrict val, int m, float factor, bool scaled, float* __restrict out) {
  if (scaled) {
    for (int j = 0; j < m; ++j) out[j] = val[j] * factor;
  } else {
    std::memcpy(out, val, sizeof(float) * m);
  }
}

// ---------------------------------------------------------------------------
// 2-bit threshold (Strom 2015): 1 for v >= tau, 2 for v <= -tau, else 0; the
// residual keeps v - tau, v + tau or v.
class ThresholdEncodeOp : public OpKernel {
 public:
  explicit ThresholdEncodeOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("tau", &tau_));
  }
  void Compute(OpKernelContext* ctx) override {
    Source s;
    OP_REQUIRES_OK(ctx, ReadSource(ctx, &s));
    Status st;
    uint8_t* codes = Codes(ctx, s.n, 2, &st);
    OP_REQUIRES_OK(ctx, st);
    const float tau = tau_;
    std::vector<char> fin((s.n + kBlock - 1) / kBlock, 1);
    CodesPass(ctx, s, 2, codes, &fin, [&](int64_t, int m, const float* v, uint8_t* code, float* res) {
      ThresholdChunk(v, m, tau, code, res);
    });
    OP_REQUIRES_OK(ctx, SetFinite(ctx, fin));
  }

 private:
  float tau_;
};

// ---------------------------------------------------------------------------
// 1-bit SGD (Seide et al. 2014), one column: bit 1 for v >= 0; pos and neg
// are the means (float64 sums) of the non-negative and the negative values.
class OnebitEncodeOp : public OpKernel {
 public:
  explicit OnebitEncodeOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("cols", &cols_));
    OP_REQUIRES(c, cols_ >= 1, InvalidArgument("cols must be >= 1"));
  }
  void Compute(OpKernelContext* ctx) override {
    Source s;
    OP_REQUIRES_OK(ctx, ReadSource(ctx, &s));
    const int64_t cols = cols_;
    OP_REQUIRES(ctx, s.n % cols == 0, InvalidArgument(s.n, " values do not make rows of ", cols));
    Tensor *pos_t, *neg_t, *signs_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output("pos", TensorShape({cols}), &pos_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output("neg", TensorShape({cols}), &neg_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output("signs", TensorShape({PackedBytes(s.n, 1)}), &signs_t));
    float* pos = pos_t->flat<float>().data();
    float* neg = neg_t->flat<float>().data();
    std::vector<char> fin;
    if (cols == 1) {
      WholeMeans(ctx, s, pos, neg, &fin);
    } else {
      ColumnMeans(ctx, s, cols, pos, neg, &fin);
    }
    uint8_t* signs = signs_t->flat<uint8_t>().data();
    CodesPass(ctx, s, 1, signs, nullptr, [&](int64_t c, int m, const float* v, uint8_t* code, float* res) {
      if (cols == 1) {
        OnebitChunk(v, m, pos[0], neg[0], code, res);
        return;
      }
      ForRuns(c, m, cols, [&](int j, int stop, int64_t, int64_t k) {  // one row's run of columns
        OnebitRun(v + j, stop - j, pos + k, neg + k, code + j, res ? res + j : nullptr);
      });
    });
    OP_REQUIRES_OK(ctx, SetFinite(ctx, fin));
  }

 private:
  // The means of the non-negative and of the negative values, from float64
  // sums and counts (exact in float64 below 2**53 values).
  static void Means(double cnt, double sp, double sn, int64_t rows, float* pos, float* neg) {
    const int64_t np = static_cast<int64_t>(cnt), nn = rows - np;
    *pos = np > 0 ? static_cast<float>(sp / static_cast<double>(np)) : 0.0f;
    *neg = nn > 0 ? static_cast<float>(sn / static_cast<double>(nn)) : 0.0f;
  }

  // One column: eight float64 lanes per block, blocks added in order.
  static void WholeMeans(OpKernelContext* ctx, const Source& s, float* pos, float* neg, std::vector<char>* fin) {
    const int64_t nb = (s.n + kBlock - 1) / kBlock;
    std::vector<double> bc(nb * kLanes, 0.0), bp(nb * kLanes, 0.0), bn(nb * kLanes, 0.0);
    fin->assign(nb, 1);
    ForBlocks(ctx, s.n, kBlock, [&](int64_t b, int64_t begin, int64_t end) {
      alignas(64) float buf[kChunk];
      bool f = true;
      ForChunks(begin, end, [&](int64_t c, int m) {
        SignSums(s.Values(c, m, buf, &f), m, &bc[b * kLanes], &bp[b * kLanes], &bn[b * kLanes]);
      });
      (*fin)[b] = f;
    });
    double cnt = 0.0, sp = 0.0, sn = 0.0;
    for (int64_t b = 0; b < nb; ++b) {
      double c = 0.0, p = 0.0, q = 0.0;
      for (int l = 0; l < kLanes; ++l) {
        c += bc[b * kLanes + l];
        p += bp[b * kLanes + l];
        q += bn[b * kLanes + l];
      }
      cnt += c;
      sp += p;
      sn += q;
    }
    Means(cnt, sp, sn, s.n, pos, neg);
  }

  // Columns of a rows x cols matrix (row-major): each task takes a range of
  // columns and adds its rows in order, so every column's sums have one order.
  static void ColumnMeans(OpKernelContext* ctx, const Source& s, int64_t cols, float* pos, float* neg,
                          std::vector<char>* fin) {
    constexpr int64_t kFewRows = 16;  // up to this many rows are held at once
    const int64_t rows = s.n / cols;
    const int64_t width = std::min<int64_t>(cols, kChunk);  // rows are read in runs of 4 KB
    fin->assign((cols + width - 1) / width, 1);
    ForBlocks(ctx, cols, width, [&](int64_t t, int64_t k0, int64_t k1) {
      const int w = static_cast<int>(k1 - k0);
      double c[kChunk] = {0}, p[kChunk] = {0}, q[kChunk] = {0};  // this range's sums
      bool f = true;
      if (rows <= kFewRows) {  // each column's sums in registers, over the rows held
        std::vector<float> held(rows * kChunk);
        const float* v[kFewRows];
        for (int64_t r = 0; r < rows; ++r) v[r] = s.Values(r * cols + k0, w, held.data() + r * kChunk, &f);
        ColumnSignSumsOfRows(v, static_cast<int>(rows), w, c, p, q);
      } else {  // row after row into the range's sums (in L1)
        alignas(64) float buf[kChunk];
        for (int64_t r = 0; r < rows; ++r) ColumnSignSums(s.Values(r * cols + k0, w, buf, &f), w, c, p, q);
      }
      for (int j = 0; j < w; ++j) Means(c[j], p[j], q[j], rows, pos + k0 + j, neg + k0 + j);
      (*fin)[t] = f;
    });
  }

  int cols_;
};

// ---------------------------------------------------------------------------
// TernGrad (Wen et al. 2017): clip at c * sigma (c = 0: no clipping), scale =
// max |clipped v|, code 1 (+1) or 2 (-1) with probability |clipped v| / scale.
class TernGradEncodeOp : public OpKernel {
 public:
  explicit TernGradEncodeOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("clip", &clip_));
  }
  void Compute(OpKernelContext* ctx) override {
    Source s;
    OP_REQUIRES_OK(ctx, ReadSource(ctx, &s));
    Noise noise;
    OP_REQUIRES_OK(ctx, ReadNoise(ctx, 2, s.n, &noise));
    const int64_t nb = (s.n + kBlock - 1) / kBlock;
    std::vector<double> s1(nb, 0.0), s2(nb, 0.0);
    std::vector<float> amax(nb, 0.0f);
    std::vector<char> fin(nb, 1);
    ForBlocks(ctx, s.n, kBlock, [&](int64_t b, int64_t begin, int64_t end) {
      alignas(64) float buf[kChunk];
      double a[kLanes] = {0}, q[kLanes] = {0};
      float mx[kLanes] = {0};
      bool f = true;
      ForChunks(begin, end, [&](int64_t c, int m) {
        Moments(s.Values(c, m, buf, &f), m, a, q, mx);
      });
      for (int l = 0; l < kLanes; ++l) {
        s1[b] += a[l];
        s2[b] += q[l];
        amax[b] = std::max(amax[b], mx[l]);
      }
      fin[b] = f;
    });
    double a = 0.0, q = 0.0;
    float m = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      a += s1[b];
      q += s2[b];
      m = std::max(m, amax[b]);
    }
    float cap = std::numeric_limits<float>::infinity();
    if (clip_ > 0) {
      const double mean = a / static_cast<double>(s.n);
      const double var = std::max(q / static_cast<double>(s.n) - mean * mean, 0.0);
      cap = clip_ * static_cast<float>(std::sqrt(var));
    }
    const float scale = std::min(m, cap);
    const float safe = scale > 0 ? scale : 1.0f;
    OP_REQUIRES_OK(ctx, Scalar(ctx, "scale", scale));
    Status st;
    uint8_t* codes = Codes(ctx, s.n, 2, &st);
    OP_REQUIRES_OK(ctx, st);
    CodesPass(ctx, s, 2, codes, nullptr, [&](int64_t c, int m, const float* v, uint8_t* code, float* res) {
      alignas(64) float u[kChunk];
      noise.Fill(c, m, u);
      TernGradChunk(v, u, m, cap, safe, scale, code, res);
    });
    OP_REQUIRES_OK(ctx, SetFinite(ctx, fin));
  }

 private:
  float clip_;
};

// ---------------------------------------------------------------------------
// QSGD (Alistarh et al. 2017), buckets of d: code s + sign * level, level =
// min(floor(|v| * s / ||bucket|| + u), s), ceil(log2(2s + 1)) bits a code.
class QSGDEncodeOp : public OpKernel {
 public:
  explicit QSGDEncodeOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("levels", &levels_));
    OP_REQUIRES_OK(c, c->GetAttr("bucket", &bucket_));
    OP_REQUIRES(c, levels_ >= 1 && levels_ <= 127, InvalidArgument("levels must be in [1, 127]"));
    OP_REQUIRES(c, bucket_ >= 1, InvalidArgument("bucket must be >= 1"));
    bits_ = QSGDBits(levels_);
  }
  void Compute(OpKernelContext* ctx) override {
    Source s;
    OP_REQUIRES_OK(ctx, ReadSource(ctx, &s));
    Noise noise;
    OP_REQUIRES_OK(ctx, ReadNoise(ctx, 2, s.n, &noise));
    const int64_t d = bucket_, nbk = (s.n + d - 1) / d;
    Tensor* norms_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output("norms", TensorShape({nbk}), &norms_t));
    Status st;
    uint8_t* codes = Codes(ctx, s.n, bits_, &st);
    OP_REQUIRES_OK(ctx, st);
    float* norms = norms_t->flat<float>().data();
    std::vector<float> inv(nbk), factor(nbk);
    const float sf = static_cast<float>(levels_);
    // Norms: whole buckets per block, each in lanes added in lane order.
    const int64_t per = std::max<int64_t>(1, kBlock / d);
    std::vector<char> fin((nbk + per - 1) / per, 1);
    ForBlocks(ctx, nbk, per, [&](int64_t b, int64_t k0, int64_t k1) {
      alignas(64) float buf[kChunk];
      bool f = true;
      for (int64_t k = k0; k < k1; ++k) {
        double q[kLanes] = {0};
        ForChunks(k * d, std::min(s.n, (k + 1) * d), [&](int64_t c, int m) {
          SumSquares(s.Values(c, m, buf, &f), m, q);
        });
        double sum = 0.0;
        for (int l = 0; l < kLanes; ++l) sum += q[l];
        const float nrm = static_cast<float>(std::sqrt(sum));
        norms[k] = nrm;
        inv[k] = nrm > 0 ? sf / nrm : 0.0f;
        factor[k] = nrm / sf;
      }
      fin[b] = f;
    });
    const int s_ = levels_, bits = bits_;
    CodesPass(ctx, s, bits, codes, nullptr, [&](int64_t c, int m, const float* v, uint8_t* code, float* res) {
      alignas(64) float u[kChunk];
      noise.Fill(c, m, u);
      ForRuns(c, m, d, [&](int j, int stop, int64_t k, int64_t) {  // one bucket's run
        QSGDRun(v + j, u + j, stop - j, inv[k], factor[k], s_, code + j, res ? res + j : nullptr);
      });
    });
    OP_REQUIRES_OK(ctx, SetFinite(ctx, fin));
  }

 private:
  int levels_, bucket_, bits_;
};

// ---------------------------------------------------------------------------
// Decode: out[i] = table[code i] * factors[i / bucket]; `factors` of 0
// elements: no scaling.  With `cols` > 1 the table holds one value per code
// and column (code-major) for the rows x cols matrix the n values make.
class UnpackOp : public OpKernel {
 public:
  explicit UnpackOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    OP_REQUIRES_OK(c, c->GetAttr("bits", &bits_));
    OP_REQUIRES_OK(c, c->GetAttr("bucket", &bucket_));
    OP_REQUIRES_OK(c, c->GetAttr("cols", &cols_));
    OP_REQUIRES(c, bits_ >= 1 && bits_ <= 8, InvalidArgument("bits must be in [1, 8]"));
    OP_REQUIRES(c, bucket_ >= 1 && n_ >= 0 && cols_ >= 1, InvalidArgument("bucket, cols must be >= 1, n >= 0"));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& data_t = ctx->input(0);
    const Tensor& table_t = ctx->input(1);
    const Tensor& factors_t = ctx->input(2);
    const int64_t n = n_, d = bucket_;
    const int bits = bits_;
    OP_REQUIRES(ctx, data_t.NumElements() == PackedBytes(n, bits),
                InvalidArgument("data has ", data_t.NumElements(), " bytes, expected ", PackedBytes(n, bits)));
    const int64_t cols = cols_;
    OP_REQUIRES(ctx, table_t.NumElements() == (int64_t{1} << bits) * cols,
                InvalidArgument("table needs 2**bits x cols values"));
    OP_REQUIRES(ctx, n % cols == 0, InvalidArgument(n, " values do not make rows of ", cols));
    OP_REQUIRES(ctx, factors_t.NumElements() == 0 || factors_t.NumElements() == (n + d - 1) / d,
                InvalidArgument("factors: one per bucket, or none"));
    Tensor* out_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output("out", TensorShape({n}), &out_t));
    const uint8_t* data = data_t.flat<uint8_t>().data();
    const float* table = table_t.flat<float>().data();
    const float* factors = factors_t.NumElements() ? factors_t.flat<float>().data() : nullptr;
    float* out = out_t->flat<float>().data();
    const std::vector<float> byte_table = cols == 1 && 8 % bits == 0 ? ByteTable(table, bits) : std::vector<float>();
    ForBlocks(ctx, n, kBlock, [&](int64_t, int64_t begin, int64_t end) {
      alignas(64) uint8_t code[kChunk];
      alignas(64) float val[kChunk + 8], res[kChunk];
      ForChunks(begin, end, [&](int64_t c, int m) {
        Decode(data + c * bits / 8, c, m, bits, cols, table, byte_table, code, val);
        ForRuns(c, m, d, [&](int j, int stop, int64_t k, int64_t) {  // one bucket's run
          Finish(val + j, stop - j, factors ? factors[k] : 1.0f, factors != nullptr, res + j);
        });
        Store(out + c, res, m);
      });
      Fence();
    });
  }

 private:
  int64_t n_;
  int bits_, bucket_, cols_;
};

}  // namespace hvdc

using tensorflow::shape_inference::InferenceContext;

namespace {
// Static output shapes: a 1-d output of f(n) elements for the grad's n.
using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::ShapeHandle;

template <typename F>
ShapeHandle Vec(InferenceContext* c, const F& f) {
  DimensionHandle n = c->Dim(c->input(0), 0);
  return c->Vector(c->ValueKnown(n) ? c->MakeDim(f(c->Value(n))) : c->UnknownDim());
}

// codes of `bits` bits, residual_out as the residual input, finite: the last three outputs.
tensorflow::Status EncodeShapes(InferenceContext* c, int bits) {
  ShapeHandle g;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &g));
  const int k = c->num_outputs();
  c->set_output(k - 3, Vec(c, [bits](int64_t n) { return hvdc::PackedBytes(n, bits); }));
  c->set_output(k - 2, c->input(1));
  c->set_output(k - 1, c->Scalar());
  for (int i = 0; i < k - 3; ++i) c->set_output(i, c->Vector(1));  // scalars of the payload
  return tensorflow::OkStatus();
}
}  // namespace

REGISTER_OP("HvdcThresholdEncode")
    .Input("grad: float")
    .Input("residual: float")
    .Attr("tau: float")
    .Output("codes: uint8")
    .Output("residual_out: float")
    .Output("finite: bool")
    .SetShapeFn([](InferenceContext* c) { return EncodeShapes(c, 2); });

REGISTER_OP("HvdcOnebitEncode")
    .Input("grad: float")
    .Input("residual: float")
    .Attr("cols: int = 1")
    .Output("pos: float")
    .Output("neg: float")
    .Output("signs: uint8")
    .Output("residual_out: float")
    .Output("finite: bool")
    .SetShapeFn([](InferenceContext* c) {
      int cols;
      TF_RETURN_IF_ERROR(c->GetAttr("cols", &cols));
      TF_RETURN_IF_ERROR(EncodeShapes(c, 1));
      c->set_output(0, c->Vector(cols));
      c->set_output(1, c->Vector(cols));
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcTernGradEncode")
    .Input("grad: float")
    .Input("residual: float")
    .Input("noise: float")
    .Input("key: int64")
    .Attr("clip: float")
    .Output("scale: float")
    .Output("codes: uint8")
    .Output("residual_out: float")
    .Output("finite: bool")
    .SetShapeFn([](InferenceContext* c) { return EncodeShapes(c, 2); });

REGISTER_OP("HvdcQSGDEncode")
    .Input("grad: float")
    .Input("residual: float")
    .Input("noise: float")
    .Input("key: int64")
    .Attr("levels: int")
    .Attr("bucket: int")
    .Output("norms: float")
    .Output("codes: uint8")
    .Output("residual_out: float")
    .Output("finite: bool")
    .SetShapeFn([](InferenceContext* c) {
      int levels, bucket;
      TF_RETURN_IF_ERROR(c->GetAttr("levels", &levels));
      TF_RETURN_IF_ERROR(c->GetAttr("bucket", &bucket));
      TF_RETURN_IF_ERROR(EncodeShapes(c, hvdc::QSGDBits(levels)));
      c->set_output(0, Vec(c, [bucket](int64_t n) { return (n + bucket - 1) / bucket; }));
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcUnpack")
    .Input("data: uint8")
    .Input("table: float")
    .Input("factors: float")
    .Attr("n: int")
    .Attr("bits: int")
    .Attr("bucket: int")
    .Attr("cols: int = 1")
    .Output("out: float")
    .SetShapeFn([](InferenceContext* c) {
      int64_t n;
      TF_RETURN_IF_ERROR(c->GetAttr("n", &n));
      c->set_output(0, c->Vector(n));
      return tensorflow::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("HvdcThresholdEncode").Device(tensorflow::DEVICE_CPU), hvdc::ThresholdEncodeOp);
REGISTER_KERNEL_BUILDER(Name("HvdcOnebitEncode").Device(tensorflow::DEVICE_CPU), hvdc::OnebitEncodeOp);
REGISTER_KERNEL_BUILDER(Name("HvdcTernGradEncode").Device(tensorflow::DEVICE_CPU), hvdc::TernGradEncodeOp);
REGISTER_KERNEL_BUILDER(Name("HvdcQSGDEncode").Device(tensorflow::DEVICE_CPU), hvdc::QSGDEncodeOp);
REGISTER_KERNEL_BUILDER(Name("HvdcUnpack").Device(tensorflow::DEVICE_CPU), hvdc::UnpackOp);
