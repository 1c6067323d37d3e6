// Fused CPU kernels for the TensorFlow sparsifiers (hvd_compress.tensorflow.fused_ops):
// top-k, DGC and random-k encoding, and the scatter that decodes them.
//
// Selection is the core's (hvd_compress/core/sparsifiers.py, dgc.py): the k
// largest |v|, ties to the lower index, indices increasing.  It is found, as
// the numba kernels do it (hvd_compress/fastpaths.py, _top_by_bits), from
// counts of the float32 bit patterns of |v| -- for non-negative floats the
// order of the patterns is the order of the values -- per fixed stretch of
// the tensor (at most 16, fixed by n, so that nothing depends on the number
// of threads): the top 16 bits, then the low 16 bits within the boundary
// pattern give the exact cut, the ties and each stretch's offset.  The first
// pass (error-feedback sum or momentum correction) collects the candidates
// whose top pattern reaches a guess at the cut (from a strided sample, or
// DGC's sampled threshold), and the counts come from those alone: exact
// from the guessed pattern up.  Where the guess fell short, or too many
// values reached it, every value is counted (one more pass) and the
// candidates are collected at the boundary pattern; where even those are
// too many (zeros of a sparse gradient), the same steps scan the stretches.
// The indices are written from the candidates.
//
// Values are the core's float32 values; the new state is the chain's (a sent
// value leaves the residual as x + -x = +0).  Non-finite input: the values
// are selected from the cleaned input (NaN/Inf as 0) and sent as NaN, and
// `finite` is false (the caller keeps the old state).
// Compiled without contraction of a*b+c into FMA (-ffp-contract=off).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/lib/core/threadpool.h"

namespace hvdc_sparse {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;

constexpr int kHigh = 32768;  // patterns of the top 16 bits of |v| (the sign bit clear)
constexpr int kLow = 65536;   // patterns of the low 16 bits
constexpr int kMaxStretches = 16;
constexpr int kSub = 1024;  // elements a pass holds in buffers on the stack
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();  // 0x7fc00000, as x * NaN gives

// The float32 bits of |x|.
inline uint32_t Mag(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u & 0x7fffffffu;
}

inline bool Finite(const float* __restrict v, int m) {
  uint32_t bad = 0;
  for (int j = 0; j < m; ++j) bad |= Mag(v[j]) >= 0x7f800000u;
  return bad == 0;
}

// out = v with NaN and Inf set to 0 (the core's clean-up; out may be v).
inline void Clean(const float* v, int m, float* out) {
  for (int j = 0; j < m; ++j) out[j] = Mag(v[j]) >= 0x7f800000u ? 0.0f : v[j];
}

// dst[0..m) = src (src 0: zeros) with streaming stores where the CPU has
// them: the destination's lines are not read first, which saves a third of a
// big output's memory traffic.  Fence() before the task's work ends.
inline void Stream(float* __restrict dst, const float* __restrict src, int64_t m) {
#if defined(__AVX__)
  int64_t j = 0;
  for (; j < m && (reinterpret_cast<uintptr_t>(dst + j) & 31) != 0; ++j) dst[j] = src ? src[j] : 0.0f;
  if (src) {
    for (; j + 8 <= m; j += 8) _mm256_stream_ps(dst + j, _mm256_loadu_ps(src + j));
  } else {
    const __m256 zero = _mm256_setzero_ps();
    for (; j + 8 <= m; j += 8) _mm256_stream_ps(dst + j, zero);
  }
  for (; j < m; ++j) dst[j] = src ? src[j] : 0.0f;
#else
  if (src) {
    std::memcpy(dst, src, sizeof(float) * m);
  } else {
    std::memset(dst, 0, sizeof(float) * m);
  }
#endif
}

inline void Fence() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}

inline void CountHigh(const float* __restrict v, int m, int32_t* __restrict high) {
  for (int j = 0; j < m; ++j) ++high[Mag(v[j]) >> 16];
}

// Big outputs (the new residual, u and v, the decoded tensor) come from a
// small cache of this library's own buffers, reused by size once the tensors
// holding them are gone: a fresh 100 MB buffer from malloc is fresh pages
// from the kernel, whose faults and zeroing cost about as much as copying
// the tensor, at every step.  Buffers of 1 MiB and more are kept, 1 GiB in
// all at most (the oldest are freed first).
class BufferCache {
 public:
  static BufferCache& Get() {
    static BufferCache* cache = new BufferCache();  // never destroyed: tensors may outlive exit
    return *cache;
  }
  static constexpr size_t kSmallest = size_t{1} << 20;
  static constexpr size_t kHeld = size_t{1} << 30;

  void* Take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t j = kept_.size(); j-- > 0;) {
        if (kept_[j].first == bytes) {
          void* p = kept_[j].second;
          kept_.erase(kept_.begin() + j);
          held_ -= bytes;
          return p;
        }
      }
    }
    return std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  }

  void Give(void* p, size_t bytes) {
    std::vector<void*> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (bytes > kHeld) {
        drop.push_back(p);
      } else {
        while (held_ + bytes > kHeld) {
          drop.push_back(kept_.front().second);
          held_ -= kept_.front().first;
          kept_.erase(kept_.begin());
        }
        kept_.emplace_back(bytes, p);
        held_ += bytes;
      }
    }
    for (void* q : drop) std::free(q);
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<size_t, void*>> kept_;  // oldest first
  size_t held_ = 0;
};

class CachedBuffer : public tensorflow::TensorBuffer {
 public:
  explicit CachedBuffer(size_t bytes) : TensorBuffer(BufferCache::Get().Take(bytes)), bytes_(bytes) {}
  ~CachedBuffer() override { BufferCache::Get().Give(data(), bytes_); }
  size_t size() const override { return bytes_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(tensorflow::AllocationDescription* proto) const override {
    proto->set_requested_bytes(static_cast<int64_t>(bytes_));
    proto->set_allocated_bytes(static_cast<int64_t>(bytes_));
    proto->set_allocator_name("hvdc_buffer_cache");
  }

 private:
  size_t bytes_;
};

// A float output of n elements, from the cache where it is big.
Status FloatOutput(OpKernelContext* ctx, const char* name, int64_t n, float** data) {
  const size_t bytes = sizeof(float) * static_cast<size_t>(n);
  if (bytes < BufferCache::kSmallest) {
    Tensor* t;
    TF_RETURN_IF_ERROR(ctx->allocate_output(name, TensorShape({n}), &t));
    *data = t->flat<float>().data();
    return tensorflow::OkStatus();
  }
  auto* buf = new CachedBuffer(bytes);
  if (buf->data() == nullptr) {
    buf->Unref();
    return tensorflow::errors::ResourceExhausted("cannot allocate ", bytes, " bytes");
  }
  Tensor t(tensorflow::DT_FLOAT, TensorShape({n}), tensorflow::core::RefCountPtr<tensorflow::TensorBuffer>(buf));
  *data = t.flat<float>().data();
  return ctx->set_output(name, t);
}

// Fixed stretches of [0, n): up to 16, fewer for small tensors.
struct Stretches {
  int64_t n = 0, size = 1;
  int count = 1;
  explicit Stretches(int64_t n_) : n(n_) {
    count = static_cast<int>(std::min<int64_t>(kMaxStretches, std::max<int64_t>(1, n >> 16)));
    size = std::max<int64_t>(1, (n + count - 1) / count);
  }
  int64_t Begin(int c) const { return std::min(n, c * size); }
  int64_t End(int c) const { return std::min(n, (c + 1) * size); }
};

// fn(i) for i in [0, count), on TensorFlow's CPU threads (cost: per item, in cycles).
template <typename F>
void Parallel(OpKernelContext* ctx, int64_t count, int64_t cost, const F& fn) {
  if (count == 1) {
    fn(0);
    return;
  }
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  pool->ParallelFor(count, cost, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) fn(i);
  });
}

// fn(begin, end) over [0, n) in blocks of 2**20 elements, in parallel.
template <typename F>
void ParallelBlocks(OpKernelContext* ctx, int64_t n, const F& fn) {
  constexpr int64_t kBlock = 1 << 20;
  Parallel(ctx, std::max<int64_t>(1, (n + kBlock - 1) / kBlock), kBlock, [&](int64_t b) {
    fn(b * kBlock, std::min(n, (b + 1) * kBlock));
  });
}

// The k largest |v| (ties to the lower index), or every value above a cut,
// from per-stretch counts of the bit patterns of |v|.
class Selector {
 public:
  Selector(OpKernelContext* ctx, int64_t n) : ctx_(ctx), s_(n), high_(static_cast<size_t>(s_.count) * kHigh, 0) {}

  const Stretches& stretches() const { return s_; }
  // The top-16-bit counts of stretch c, filled by the caller's first pass.
  int32_t* High(int c) { return &high_[static_cast<size_t>(c) * kHigh]; }
  // The values (|v| is selected on), set before any of the calls below.
  void SetValues(const float* v) { v_ = v; }

  // After the first pass: above_[b] = how many values have a top pattern >= b.
  void Tally() {
    above_.assign(kHigh + 1, 0);
    for (int c = 0; c < s_.count; ++c) {
      const int32_t* h = High(c);
      for (int b = 0; b < kHigh; ++b) above_[b] += h[b];
    }
    for (int b = kHigh - 1; b >= 0; --b) above_[b] += above_[b + 1];
  }

  // Instead of counting every value in the first pass: the candidates it
  // collected, per stretch the indices (increasing) of the values whose top
  // pattern is lo or above (lo: from a guess at the cut), and those values.
  // The counts then hold those values alone -- exact for the patterns from
  // lo up -- until a question about a lower pattern makes Full() count every
  // value.  The values kept beside the indices spare every later look at the
  // candidates a read of the tensor at scattered places.
  void SetCandidates(int lo, const std::vector<std::vector<int64_t>>& per,
                     const std::vector<std::vector<float>>& vals) {
    const int count = s_.count;
    cstart_.assign(count + 1, 0);
    for (int c = 0; c < count; ++c) cstart_[c + 1] = cstart_[c] + static_cast<int64_t>(per[c].size());
    cand_.resize(cstart_[count]);
    cval_.resize(cstart_[count]);
    Parallel(ctx_, count, s_.size / 8 + 1, [&](int64_t c) {
      std::copy(per[c].begin(), per[c].end(), cand_.begin() + cstart_[c]);
      std::copy(vals[c].begin(), vals[c].end(), cval_.begin() + cstart_[c]);
      int32_t* h = High(static_cast<int>(c));
      for (float x : vals[c]) ++h[Mag(x) >> 16];
    });
    cand_bin_ = lo;
    counted_from_ = lo;
    Tally();
  }

  // Makes the counts exact for the patterns from b up (a pass over every value
  // where the first pass counted only candidates above b).
  void Need(int b) {
    if (b >= counted_from_) return;
    Parallel(ctx_, s_.count, s_.size * 4, [&](int64_t c) {
      int32_t* h = High(static_cast<int>(c));
      std::fill(h, h + kHigh, 0);
      const int64_t begin = s_.Begin(static_cast<int>(c));
      CountHigh(v_ + begin, static_cast<int>(s_.End(static_cast<int>(c)) - begin), h);
    });
    counted_from_ = 0;
    Tally();
  }

  // The first pass collected candidates but gave up (too many): count every value.
  void CountAll() {
    counted_from_ = kHigh;
    Need(0);
  }

  int64_t AboveHigh(int b) {
    Need(std::min(b, kHigh - 1));
    return above_[std::min(b, kHigh)];
  }

  // How many values have |v| bits >= t, exactly.
  int64_t CountAtLeast(uint32_t t) {
    if (t == 0) return s_.n;
    const int64_t x = static_cast<int64_t>(t) - 1;
    Need(static_cast<int>(x >> 16));
    Prepare(x);
    int64_t total = 0;
    for (int c = 0; c < s_.count; ++c) total += CountAbove(c, x);
    return total;
  }

  // The cut of the k largest (1 <= k <= n): every value with bits > cut, and
  // the first `take` (in index order) of those with bits == cut.
  void TopCut(int64_t k, int64_t* cut, int64_t* take) {
    if (above_[counted_from_] < k) Need(0);  // the cut lies below what was counted
    int b = kHigh - 1;
    while (above_[b] < k) --b;  // above_[0] = n >= k
    const int64_t need = k - above_[b + 1];
    LowCounts(b);
    std::vector<int64_t> lows(kLow, 0);
    for (int c = 0; c < s_.count; ++c) {
      const int32_t* l = Low(c);
      for (int j = 0; j < kLow; ++j) lows[j] += l[j];
    }
    int64_t at_least = 0;  // values of pattern b with low bits >= j
    int j = kLow - 1;
    for (;; --j) {
      if (at_least + lows[j] >= need) break;
      at_least += lows[j];
    }
    *cut = (static_cast<int64_t>(b) << 16) | j;
    *take = need - at_least;
  }

  // fn(slot, i, v[i]) for every value with bits > cut (cut >= -1) and the
  // first `take` equal to it, slots 0, 1, ... in index order; the stretches in
  // parallel.  Returns how many.
  template <typename F>
  int64_t Take(int64_t cut, int64_t take, const F& fn) {
    Need(cut < 0 ? 0 : static_cast<int>(cut >> 16));
    Prepare(cut);
    const int count = s_.count;
    std::vector<int64_t> start(count), ties(count);
    int64_t at = 0, equal_before = 0;
    for (int c = 0; c < count; ++c) {
      const int64_t eq = take > 0 ? Equal(c, cut) : 0;
      ties[c] = std::max<int64_t>(0, std::min(eq, take - equal_before));
      equal_before += eq;
      start[c] = at;
      at += CountAbove(c, cut) + ties[c];
    }
    const int bin = cut < 0 ? 0 : static_cast<int>(cut >> 16);
    Parallel(ctx_, count, s_.size * 4, [&](int64_t c) {
      int64_t slot = start[c], left = ties[c];
      ForValues(static_cast<int>(c), bin, [&](int64_t i, float x) {
        const int64_t w = Mag(x);
        if (w > cut || (w == cut && left > 0)) {
          if (w == cut) --left;
          fn(slot++, i, x);
        }
      });
    });
    return at;
  }

 private:
  int32_t* Low(int c) { return &low_[static_cast<size_t>(c) * kLow]; }

  // fn(i, v[i]) for the values of stretch c that may have a top pattern >= b:
  // the candidates (their kept values) where they were collected at b or
  // below, else every value of the stretch.
  template <typename F>
  void ForValues(int c, int b, const F& fn) const {
    if (cand_bin_ >= 0 && cand_bin_ <= b) {
      for (int64_t q = cstart_[c]; q < cstart_[c + 1]; ++q) fn(cand_[q], cval_[q]);
      return;
    }
    for (int64_t i = s_.Begin(c); i < s_.End(c); ++i) fn(i, v_[i]);
  }

  // The candidates at pattern b (every index with a top pattern >= b), if
  // there are few enough and none were collected at b or below.
  void Collect(int b) {
    if (cand_bin_ >= 0 && cand_bin_ <= b) return;
    const int64_t total = above_[b];
    if (total > std::max<int64_t>(int64_t{1} << 16, s_.n / 4)) return;
    const int count = s_.count;
    cstart_.assign(count + 1, 0);
    for (int c = 0; c < count; ++c) {
      const int32_t* h = High(c);
      int64_t m = 0;
      for (int p = b; p < kHigh; ++p) m += h[p];
      cstart_[c + 1] = cstart_[c] + m;
    }
    cand_.resize(total);
    cval_.resize(total);
    const uint32_t lo = static_cast<uint32_t>(b) << 16;
    const float* v = v_;
    int64_t* cand = cand_.data();
    float* cval = cval_.data();
    Parallel(ctx_, count, s_.size * 2, [&](int64_t c) {
      int64_t at = cstart_[c];
      for (int64_t i = s_.Begin(c), end = s_.End(c); i < end; ++i) {
        if (Mag(v[i]) >= lo) {
          cand[at] = i;
          cval[at++] = v[i];
        }
      }
    });
    cand_bin_ = b;
  }

  // Per stretch, the counts of the low 16 bits of the values whose top pattern is b.
  void LowCounts(int b) {
    if (low_bin_ == b) return;
    Need(b);
    Collect(b);
    low_.assign(static_cast<size_t>(s_.count) * kLow, 0);
    Parallel(ctx_, s_.count, s_.size * 2, [&](int64_t c) {
      int32_t* l = Low(static_cast<int>(c));
      const uint32_t want = static_cast<uint32_t>(b);
      ForValues(static_cast<int>(c), b, [&](int64_t, float x) {
        const uint32_t a = Mag(x);
        if ((a >> 16) == want) ++l[a & 0xffff];
      });
    });
    low_bin_ = b;
  }

  // What CountAbove and Equal at x need.
  void Prepare(int64_t x) {
    if (x >= 0 && (x & 0xffff) != 0xffff) LowCounts(static_cast<int>(x >> 16));
  }

  // How many values of stretch c have bits > x (x >= -1; Prepare(x) first).
  int64_t CountAbove(int c, int64_t x) {
    if (x < 0) return s_.End(c) - s_.Begin(c);
    const int b = static_cast<int>(x >> 16), l = static_cast<int>(x & 0xffff);
    const int32_t* h = High(c);
    int64_t m = 0;
    for (int p = b + 1; p < kHigh; ++p) m += h[p];
    if (l != 0xffff) {
      const int32_t* lo = Low(c);
      for (int j = l + 1; j < kLow; ++j) m += lo[j];
    }
    return m;
  }

  // How many values of stretch c have bits == x (0 for x < 0; Prepare(x) first).
  int64_t Equal(int c, int64_t x) {
    if (x < 0) return 0;
    if ((x & 0xffff) == 0xffff) {  // counted by no low table yet: count it
      LowCounts(static_cast<int>(x >> 16));
    }
    return Low(c)[x & 0xffff];
  }

  OpKernelContext* ctx_;
  Stretches s_;
  const float* v_ = nullptr;
  std::vector<int32_t> high_, low_;
  std::vector<int64_t> above_, cand_, cstart_;
  std::vector<float> cval_;  // the candidates' values, beside cand_
  int low_bin_ = -1, cand_bin_ = -1;
  int counted_from_ = 0;  // the counts are exact for the top patterns from this one up
};

Status CheckVector(const Tensor& t, const char* name) {
  if (t.dims() != 1) return InvalidArgument(name, " must be 1-d, got shape ", t.shape().DebugString());
  return tensorflow::OkStatus();
}

Status SetFinite(OpKernelContext* ctx, const char* name, bool finite) {
  Tensor* t;
  TF_RETURN_IF_ERROR(ctx->allocate_output(name, TensorShape({}), &t));
  t->scalar<bool>()() = finite;
  return tensorflow::OkStatus();
}

// The error-feedback sum v = g + r (r may be nullptr: v = g) of stretch c,
// cleaned where not finite, written to `out` (may be nullptr) and its top
// patterns counted into `high`; returns whether it was finite.
// What the first pass keeps of a stretch's values for the selection: with lo
// < 0 the counts of their top patterns (`high`); else the indices (`cand`,
// from `first` on) and values (`vals`) of those whose top pattern is lo or
// above, at most `cap` of them (more: `over`, and the counts are left to
// Selector::CountAll).
struct Account {
  int lo = -1;
  int32_t* high = nullptr;
  std::vector<int64_t>* cand = nullptr;
  std::vector<float>* vals = nullptr;
  size_t cap = 0;
  bool over = false;

  inline void Add(const float* __restrict v, int m, int64_t first) {
    if (lo < 0) {
      CountHigh(v, m, high);
      return;
    }
    if (over) return;
    const uint32_t bound = static_cast<uint32_t>(lo) << 16;
    // 16 values at a time are tested first (a loop that vectorises); only the
    // groups holding a candidate are looked at again.
    for (int q = 0; q < m; q += 16) {
      const int e = std::min(m, q + 16);
      uint32_t hits = 0;
      for (int j = q; j < e; ++j) hits |= static_cast<uint32_t>(Mag(v[j]) >= bound);
      if (hits == 0) continue;
      for (int j = q; j < e; ++j) {
        if (Mag(v[j]) >= bound) {
          if (cand->size() >= cap) {
            over = true;
            return;
          }
          cand->push_back(first + j);
          vals->push_back(v[j]);
        }
      }
    }
  }
};

// The accounts of every stretch for a first pass (lo: as Account's).
struct Accounts {
  std::vector<std::vector<int64_t>> cand;
  std::vector<std::vector<float>> vals;
  std::vector<Account> of;
  Accounts(Selector* sel, int lo)
      : cand(sel->stretches().count), vals(sel->stretches().count), of(sel->stretches().count) {
    const Stretches& s = sel->stretches();
    for (int c = 0; c < s.count; ++c) {
      of[c].lo = lo;
      of[c].high = sel->High(c);
      of[c].cand = &cand[c];
      of[c].vals = &vals[c];
      of[c].cap = static_cast<size_t>(std::max<int64_t>(4096, (s.End(c) - s.Begin(c)) / 8));
    }
  }
  // After the pass (the selector's values set): the counts or the candidates.
  void Finish(Selector* sel) {
    const int lo = of.empty() ? -1 : of[0].lo;
    if (lo < 0) {
      sel->Tally();
    } else if (std::any_of(of.begin(), of.end(), [](const Account& a) { return a.over; })) {
      sel->CountAll();
    } else {
      sel->SetCandidates(lo, cand, vals);
    }
  }
};

// The top pattern of a value a little below the k-th largest of the n
// magnitudes mag(i), from every stride-th of them (the rank a half beyond
// k's, plus 32): where the first pass may collect candidates instead of
// counting every value.  -1 where that does not pay (small n, k not far
// below n).  Only a guess: the selection checks it, and counts all where it
// fell short.
template <typename F>
int GuessBin(int64_t n, int64_t k, const F& mag) {
  if (n <= 65536 || k * 64 >= n) return -1;
  const int64_t stride = std::max<int64_t>(1, n / 16384), m = (n + stride - 1) / stride;
  const int64_t want = std::min<int64_t>(m, k * m / n * 3 / 2 + 32);
  std::vector<uint32_t> sample(m);
  for (int64_t j = 0; j < m; ++j) sample[j] = mag(j * stride);
  std::nth_element(sample.begin(), sample.begin() + (want - 1), sample.end(), std::greater<uint32_t>());
  return static_cast<int>(sample[want - 1] >> 16);
}

// |x| bits, NaN and Inf as 0 (the core's clean-up).
inline uint32_t CleanMag(float x) {
  const uint32_t a = Mag(x);
  return a >= 0x7f800000u ? 0 : a;
}

bool SumPass(const float* g, const float* r, float* out, int64_t begin, int64_t end, Account* account) {
  alignas(64) float buf[kSub];
  bool fin = true;
  for (int64_t c = begin; c < end; c += kSub) {
    const int m = static_cast<int>(std::min<int64_t>(kSub, end - c));
    const float* v = g + c;
    if (r) {
      for (int j = 0; j < m; ++j) buf[j] = g[c + j] + r[c + j];
      v = buf;
    }
    if (!Finite(v, m)) {
      fin = false;
      Clean(v, m, buf);
      v = buf;
    }
    if (out) Stream(out + c, v, m);
    if (account) account->Add(v, m, c);
  }
  Fence();
  return fin;
}

// ---------------------------------------------------------------------------
// Top-k with error feedback (residual of 0 elements: none): the k largest
// |g + r|, sent as indices (T) and values; residual_out is g + r with the sent
// values cleared.
template <typename T>
class TopkEncodeOp : public OpKernel {
 public:
  explicit TopkEncodeOp(OpKernelConstruction* c) : OpKernel(c) { OP_REQUIRES_OK(c, c->GetAttr("k", &k_)); }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& g_t = ctx->input(0);
    const Tensor& r_t = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckVector(g_t, "grad"));
    const int64_t n = g_t.NumElements(), k = k_;
    const bool ef = r_t.NumElements() != 0;
    OP_REQUIRES(ctx, !ef || r_t.NumElements() == n,
                InvalidArgument("residual has ", r_t.NumElements(), " elements, grad ", n));
    OP_REQUIRES(ctx, k >= 1 && k <= n, InvalidArgument("k = ", k, " for ", n, " elements"));
    Tensor *idx_t, *val_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output("indices", TensorShape({k}), &idx_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output("values", TensorShape({k}), &val_t));
    float* rout = nullptr;
    OP_REQUIRES_OK(ctx, FloatOutput(ctx, "residual_out", ef ? n : 0, &rout));
    if (!ef) rout = nullptr;
    const float* g = g_t.flat<float>().data();
    const float* r = ef ? r_t.flat<float>().data() : nullptr;

    Selector sel(ctx, n);
    const Stretches& s = sel.stretches();
    std::vector<char> fin(s.count, 1);
    Accounts accounts(&sel, GuessBin(n, k, [&](int64_t i) { return CleanMag(r ? g[i] + r[i] : g[i]); }));
    Parallel(ctx, s.count, s.size * 8, [&](int64_t c) {
      fin[c] = SumPass(g, r, rout, s.Begin(c), s.End(c), &accounts.of[c]);
    });
    const bool finite = std::all_of(fin.begin(), fin.end(), [](char f) { return f != 0; });
    const float* v = ef ? rout : g;
    Tensor clean_t;
    if (!finite && !ef) {  // selected from the cleaned gradient (a rare step: a copy)
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_FLOAT, TensorShape({n}), &clean_t));
      float* clean = clean_t.flat<float>().data();
      ParallelBlocks(ctx, n, [&](int64_t b, int64_t e) { Clean(g + b, static_cast<int>(e - b), clean + b); });
      v = clean;
    }
    sel.SetValues(v);
    accounts.Finish(&sel);
    int64_t cut, take;
    sel.TopCut(k, &cut, &take);
    T* idx = idx_t->flat<T>().data();
    float* val = val_t->flat<float>().data();
    sel.Take(cut, take, [&](int64_t slot, int64_t i, float x) {
      idx[slot] = static_cast<T>(i);
      val[slot] = finite ? x : kNaN;
      if (rout) rout[i] = 0.0f;  // x + -x
    });
    OP_REQUIRES_OK(ctx, SetFinite(ctx, "finite", finite));
  }

 private:
  int64_t k_;
};

// ---------------------------------------------------------------------------
// DGC's step for a sampled tensor: momentum correction (u = u*m + g, v = v +
// u; Nesterov: u = (u + g)*m, v = (v + u) + g), the threshold -- the
// want-th largest |v| of the sampled positions, lowered by 0.8 (ten rounds at
// most) while fewer than 0.8k values reach it -- and the selection: the k
// largest |v| where at least k reach the threshold, else every value that
// does, in index order (unused slots: index 0, value 0, not valid).  The sent
// values leave v (and, with masking, u).
class DgcEncodeOp : public OpKernel {
 public:
  explicit DgcEncodeOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("k", &k_));
    OP_REQUIRES_OK(c, c->GetAttr("want", &want_));
    OP_REQUIRES_OK(c, c->GetAttr("momentum", &momentum_));
    OP_REQUIRES_OK(c, c->GetAttr("nesterov", &nesterov_));
    OP_REQUIRES_OK(c, c->GetAttr("masking", &masking_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& g_t = ctx->input(0);
    const Tensor& u_t = ctx->input(1);
    const Tensor& v_t = ctx->input(2);
    const Tensor& pos_t = ctx->input(3);
    OP_REQUIRES_OK(ctx, CheckVector(g_t, "grad"));
    const int64_t n = g_t.NumElements(), k = k_, ns = pos_t.NumElements();
    OP_REQUIRES(ctx, u_t.NumElements() == n && v_t.NumElements() == n,
                InvalidArgument("u and v must have the grad's ", n, " elements"));
    OP_REQUIRES(ctx, k >= 1 && k <= n, InvalidArgument("k = ", k, " for ", n, " elements"));
    OP_REQUIRES(ctx, want_ >= 1 && want_ <= ns, InvalidArgument("want = ", want_, " of ", ns, " sampled"));
    Tensor *idx_t, *val_t, *valid_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output("indices", TensorShape({k}), &idx_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output("values", TensorShape({k}), &val_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output("valid", TensorShape({k}), &valid_t));
    float *uo, *vo;
    OP_REQUIRES_OK(ctx, FloatOutput(ctx, "u_out", n, &uo));
    OP_REQUIRES_OK(ctx, FloatOutput(ctx, "v_out", n, &vo));
    const float* g = g_t.flat<float>().data();
    const float* u = u_t.flat<float>().data();
    const float* v = v_t.flat<float>().data();
    const float m = momentum_;
    const bool nesterov = nesterov_;

    const int64_t* pos = pos_t.flat<int64_t>().data();
    for (int64_t j = 0; j < ns; ++j)
      OP_REQUIRES(ctx, pos[j] >= 0 && pos[j] < n, InvalidArgument("sampled position ", pos[j], " out of range"));
    Selector sel(ctx, n);
    const Stretches& s = sel.stretches();
    std::vector<char> fin(s.count, 1);
    // The sampled threshold, the want-th largest sampled |v|, from the sampled
    // positions' new v computed before the pass with the pass's own float32
    // arithmetic (the same bits the pass writes there).  The first pass then
    // collects the candidates at or above its top pattern: where at least 0.8k
    // reach it (the correction loop stops at once, almost always where the
    // sample is large) the selection needs no more passes; a lowering counts
    // every value (one more pass).  Collecting below it would gather every
    // value between the two, many times k where |v| is flat near the cut.
    float thr;
    {
      std::vector<uint32_t> sample(ns);
      constexpr int64_t kPart = 1 << 14;
      Parallel(ctx, (ns + kPart - 1) / kPart, kPart * 64, [&](int64_t b) {
        for (int64_t j = b * kPart, e = std::min(ns, (b + 1) * kPart); j < e; ++j) {
          const int64_t i = pos[j];
          const float gi = Mag(g[i]) >= 0x7f800000u ? 0.0f : g[i];
          sample[j] = Mag(nesterov ? (v[i] + (u[i] + gi) * m) + gi : v[i] + (u[i] * m + gi));
        }
      });
      std::nth_element(sample.begin(), sample.begin() + (want_ - 1), sample.end(), std::greater<uint32_t>());
      std::memcpy(&thr, &sample[want_ - 1], 4);
    }
    const int lo = static_cast<int>(Mag(thr) >> 16);
    Accounts accounts(&sel, lo);
    Parallel(ctx, s.count, s.size * 12, [&](int64_t c) {
      alignas(64) float buf[kSub], ub[kSub], vb[kSub];
      Account* account = &accounts.of[c];
      bool f = true;
      for (int64_t a = s.Begin(c), end = s.End(c); a < end; a += kSub) {
        const int w = static_cast<int>(std::min<int64_t>(kSub, end - a));
        const float* gx = g + a;
        if (!Finite(gx, w)) {
          f = false;
          Clean(gx, w, buf);
          gx = buf;
        }
        const float* __restrict ux = u + a;
        const float* __restrict vx = v + a;
        if (nesterov) {
          for (int j = 0; j < w; ++j) {
            const float x = (ux[j] + gx[j]) * m;
            ub[j] = x;
            vb[j] = (vx[j] + x) + gx[j];
          }
        } else {
          for (int j = 0; j < w; ++j) {
            const float x = ux[j] * m + gx[j];
            ub[j] = x;
            vb[j] = vx[j] + x;
          }
        }
        Stream(uo + a, ub, w);
        Stream(vo + a, vb, w);
        account->Add(vb, w, a);
      }
      Fence();
      fin[c] = f;
    });
    const bool finite = std::all_of(fin.begin(), fin.end(), [](char f) { return f != 0; });
    sel.SetValues(vo);
    accounts.Finish(&sel);

    // How many |v| reach thr: exact, or a lower bound of at least k (all that
    // the correction loop and the choice below need).
    auto count = [&](float t) -> int64_t {
      const uint32_t bits = Mag(t);
      const int b = static_cast<int>(bits >> 16);
      if ((bits & 0xffff) == 0) return sel.AboveHigh(b);
      if (sel.AboveHigh(b + 1) >= k) return sel.AboveHigh(b + 1);
      return sel.CountAtLeast(bits);
    };
    for (int round = 0; round < 10; ++round) {
      if (static_cast<double>(count(thr)) >= 0.8 * static_cast<double>(k)) break;
      thr = thr * 0.8f;
    }
    int64_t* idx = idx_t->flat<int64_t>().data();
    float* val = val_t->flat<float>().data();
    bool* valid = valid_t->flat<bool>().data();
    const bool masking = masking_;
    auto send = [&](int64_t slot, int64_t i, float x) {
      idx[slot] = i;
      val[slot] = finite ? x : kNaN;
      valid[slot] = true;
      vo[i] = 0.0f;  // v keeps what was not sent: x + -x
      if (masking) uo[i] = 0.0f;
    };
    int64_t got;
    if (count(thr) >= k) {
      int64_t cut, take;
      sel.TopCut(k, &cut, &take);
      got = sel.Take(cut, take, send);
    } else {
      got = sel.Take(static_cast<int64_t>(Mag(thr)) - 1, 0, send);
    }
    for (int64_t j = got; j < k; ++j) {
      idx[j] = 0;
      val[j] = finite ? 0.0f : kNaN;
      valid[j] = false;
    }
    OP_REQUIRES_OK(ctx, SetFinite(ctx, "finite", finite));
  }

 private:
  int64_t k_, want_;
  float momentum_;
  bool nesterov_, masking_;
};

// ---------------------------------------------------------------------------
// Random-k with error feedback (residual of 0 elements: none): the values of
// v = g + r at the given (distinct) indices, times `scale` (0 elements: none);
// residual_out is v with the sent values taken out (x + -sent).
class RandomkEncodeOp : public OpKernel {
 public:
  explicit RandomkEncodeOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& g_t = ctx->input(0);
    const Tensor& r_t = ctx->input(1);
    const Tensor& idx_t = ctx->input(2);
    const Tensor& scale_t = ctx->input(3);
    OP_REQUIRES_OK(ctx, CheckVector(g_t, "grad"));
    const int64_t n = g_t.NumElements(), k = idx_t.NumElements();
    const bool ef = r_t.NumElements() != 0;
    OP_REQUIRES(ctx, !ef || r_t.NumElements() == n,
                InvalidArgument("residual has ", r_t.NumElements(), " elements, grad ", n));
    OP_REQUIRES(ctx, scale_t.NumElements() == 0 || scale_t.NumElements() == k,
                InvalidArgument("scale: one per index, or none"));
    Tensor* val_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output("values", TensorShape({k}), &val_t));
    float* rout = nullptr;
    OP_REQUIRES_OK(ctx, FloatOutput(ctx, "residual_out", ef ? n : 0, &rout));
    if (!ef) rout = nullptr;
    const float* g = g_t.flat<float>().data();
    const float* r = ef ? r_t.flat<float>().data() : nullptr;
    const int64_t* idx = idx_t.flat<int64_t>().data();
    const float* scale = scale_t.NumElements() ? scale_t.flat<float>().data() : nullptr;
    float* val = val_t->flat<float>().data();
    for (int64_t j = 0; j < k; ++j)
      OP_REQUIRES(ctx, idx[j] >= 0 && idx[j] < n, InvalidArgument("index ", idx[j], " out of range"));

    constexpr int64_t kBlock = 1 << 20;
    const int64_t nb = std::max<int64_t>(1, (n + kBlock - 1) / kBlock);
    std::vector<char> fin(nb, 1);
    Parallel(ctx, nb, kBlock * 4, [&](int64_t b) {
      fin[b] = SumPass(g, r, rout, b * kBlock, std::min(n, (b + 1) * kBlock), nullptr);
    });
    const bool finite = std::all_of(fin.begin(), fin.end(), [](char f) { return f != 0; });
    for (int64_t j = 0; j < k; ++j) {  // every value before any leaves the residual
      float x = ef ? rout[idx[j]] : g[idx[j]];
      if (Mag(x) >= 0x7f800000u) x = 0.0f;  // (without error feedback: cleaned here)
      val[j] = scale ? x * scale[j] : x;
    }
    if (rout) {
      for (int64_t j = 0; j < k; ++j) rout[idx[j]] = rout[idx[j]] + -val[j];
    }
    if (!finite) std::fill(val, val + k, kNaN);
    OP_REQUIRES_OK(ctx, SetFinite(ctx, "finite", finite));
  }
};

// ---------------------------------------------------------------------------
// core.sampling's stratified indices (random-k's, DGC's sample): k strata of
// [0, n), stratum j = [j*n/k, (j+1)*n/k) (floor), its index lo + (h_j * size)
// >> 32 for h_j = lowbias32(lowbias32(j ^ key0) ^ key1); int64 indices and
// sizes.  The bounds step on by the remainder (one division a block).
inline uint64_t Lowbias32(uint64_t x) {
  x ^= x >> 16;
  x = (x * 0x7FEB352Dull) & 0xFFFFFFFFull;
  x ^= x >> 15;
  x = (x * 0x846CA68Bull) & 0xFFFFFFFFull;
  return x ^ (x >> 16);
}

class StratifiedOp : public OpKernel {
 public:
  explicit StratifiedOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("n", &n_));
    OP_REQUIRES_OK(c, c->GetAttr("k", &k_));
    OP_REQUIRES(c, k_ >= 1 && k_ <= n_, InvalidArgument("need 1 <= k <= n, got k=", k_, ", n=", n_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& k0_t = ctx->input(0);
    const Tensor& k1_t = ctx->input(1);
    OP_REQUIRES(ctx, k0_t.NumElements() == 1 && k1_t.NumElements() == 1, InvalidArgument("keys are scalars"));
    const uint64_t key0 = static_cast<uint64_t>(k0_t.flat<int64_t>()(0)) & 0xFFFFFFFFull;
    const uint64_t key1 = static_cast<uint64_t>(k1_t.flat<int64_t>()(0)) & 0xFFFFFFFFull;
    const int64_t n = n_, k = k_;
    Tensor *idx_t, *size_t_;
    OP_REQUIRES_OK(ctx, ctx->allocate_output("indices", TensorShape({k}), &idx_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output("sizes", TensorShape({k}), &size_t_));
    int64_t* idx = idx_t->flat<int64_t>().data();
    int64_t* sizes = size_t_->flat<int64_t>().data();
    const int64_t q = n / k, rem = n % k;
    constexpr int64_t kBlock = 1 << 16;
    Parallel(ctx, (k + kBlock - 1) / kBlock, kBlock * 16, [&](int64_t b) {
      const int64_t j0 = b * kBlock;
      // j0*n/k = j0*q + j0*rem/k, with j0*rem (below k*k) in 128 bits
      const __int128 jr = static_cast<__int128>(j0) * rem;
      int64_t r = static_cast<int64_t>(jr % k);
      int64_t hi = j0 * q + static_cast<int64_t>(jr / k);
      for (int64_t j = j0, end = std::min(k, j0 + kBlock); j < end; ++j) {
        const int64_t lo = hi;
        r += rem;
        hi = lo + q;
        if (r >= k) {
          r -= k;
          hi += 1;
        }
        const uint64_t size = static_cast<uint64_t>(hi - lo);
        const uint64_t h = Lowbias32(Lowbias32((static_cast<uint64_t>(j) ^ key0) & 0xFFFFFFFFull) ^ key1);
        idx[j] = lo + static_cast<int64_t>((h * size) >> 32);
        sizes[j] = static_cast<int64_t>(size);
      }
    });
  }

 private:
  int64_t n_, k_;
};

// ---------------------------------------------------------------------------
// Decode: out = acc (0 elements: zeros of n) with values[j] added at
// indices[j], in slot order (as numpy's add.at).
template <typename T>
class ScatterAddOp : public OpKernel {
 public:
  explicit ScatterAddOp(OpKernelConstruction* c) : OpKernel(c) { OP_REQUIRES_OK(c, c->GetAttr("n", &n_)); }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& acc_t = ctx->input(0);
    const Tensor& idx_t = ctx->input(1);
    const Tensor& val_t = ctx->input(2);
    const int64_t n = n_, k = idx_t.NumElements();
    OP_REQUIRES(ctx, acc_t.NumElements() == 0 || acc_t.NumElements() == n,
                InvalidArgument("acc has ", acc_t.NumElements(), " elements, expected 0 or ", n));
    OP_REQUIRES(ctx, val_t.NumElements() == k, InvalidArgument("one value per index"));
    const T* idx = idx_t.flat<T>().data();
    for (int64_t j = 0; j < k; ++j)
      OP_REQUIRES(ctx, idx[j] >= 0 && idx[j] < n, InvalidArgument("index ", idx[j], " out of range"));
    float* out;
    const bool given = acc_t.NumElements() == n && n > 0;
    std::unique_ptr<Tensor> forwarded;
    if (given) {  // the accumulator's own buffer where nothing else holds it
      forwarded = ctx->forward_input(0, 0, tensorflow::DT_FLOAT, TensorShape({n}), tensorflow::DEVICE_MEMORY,
                                     tensorflow::AllocatorAttributes());
    }
    if (forwarded) {
      out = forwarded->flat<float>().data();
      ctx->set_output(0, *forwarded);
    } else {
      OP_REQUIRES_OK(ctx, FloatOutput(ctx, "out", n, &out));
      const float* acc = given ? acc_t.flat<float>().data() : nullptr;  // else zeros
      ParallelBlocks(ctx, n, [&](int64_t b, int64_t e) {
        Stream(out + b, acc ? acc + b : nullptr, e - b);
        Fence();
      });
    }
    const float* val = val_t.flat<float>().data();
    for (int64_t j = 0; j < k; ++j) out[idx[j]] += val[j];
  }

 private:
  int64_t n_;
};

}  // namespace hvdc_sparse

using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("HvdcTopkEncode")
    .Input("grad: float")
    .Input("residual: float")
    .Attr("k: int")
    .Attr("index_type: {int32, int64}")
    .Output("indices: index_type")
    .Output("values: float")
    .Output("residual_out: float")
    .Output("finite: bool")
    .SetShapeFn([](InferenceContext* c) {
      int64_t k;
      TF_RETURN_IF_ERROR(c->GetAttr("k", &k));
      ShapeHandle g;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &g));
      c->set_output(0, c->Vector(k));
      c->set_output(1, c->Vector(k));
      c->set_output(2, c->input(1));
      c->set_output(3, c->Scalar());
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcDgcEncode")
    .Input("grad: float")
    .Input("u: float")
    .Input("v: float")
    .Input("sample: int64")
    .Attr("k: int")
    .Attr("want: int")
    .Attr("momentum: float")
    .Attr("nesterov: bool")
    .Attr("masking: bool")
    .Output("indices: int64")
    .Output("values: float")
    .Output("valid: bool")
    .Output("u_out: float")
    .Output("v_out: float")
    .Output("finite: bool")
    .SetShapeFn([](InferenceContext* c) {
      int64_t k;
      TF_RETURN_IF_ERROR(c->GetAttr("k", &k));
      ShapeHandle g;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &g));
      for (int i = 0; i < 3; ++i) c->set_output(i, c->Vector(k));
      c->set_output(3, g);
      c->set_output(4, g);
      c->set_output(5, c->Scalar());
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcRandomkEncode")
    .Input("grad: float")
    .Input("residual: float")
    .Input("indices: int64")
    .Input("scale: float")
    .Output("values: float")
    .Output("residual_out: float")
    .Output("finite: bool")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle g;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &g));
      c->set_output(0, c->Vector(c->Dim(c->input(2), 0)));
      c->set_output(1, c->input(1));
      c->set_output(2, c->Scalar());
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcStratified")
    .Input("key0: int64")
    .Input("key1: int64")
    .Attr("n: int")
    .Attr("k: int")
    .Output("indices: int64")
    .Output("sizes: int64")
    .SetShapeFn([](InferenceContext* c) {
      int64_t k;
      TF_RETURN_IF_ERROR(c->GetAttr("k", &k));
      c->set_output(0, c->Vector(k));
      c->set_output(1, c->Vector(k));
      return tensorflow::OkStatus();
    });

REGISTER_OP("HvdcScatterAdd")
    .Input("acc: float")
    .Input("indices: Tindex")
    .Input("values: float")
    .Attr("n: int")
    .Attr("Tindex: {int32, int64}")
    .Output("out: float")
    .SetShapeFn([](InferenceContext* c) {
      int64_t n;
      TF_RETURN_IF_ERROR(c->GetAttr("n", &n));
      c->set_output(0, c->Vector(n));
      return tensorflow::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("HvdcTopkEncode").Device(tensorflow::DEVICE_CPU).TypeConstraint<int32_t>("index_type"),
                        hvdc_sparse::TopkEncodeOp<int32_t>);
REGISTER_KERNEL_BUILDER(Name("HvdcTopkEncode").Device(tensorflow::DEVICE_CPU).TypeConstraint<int64_t>("index_type"),
                        hvdc_sparse::TopkEncodeOp<int64_t>);
REGISTER_KERNEL_BUILDER(Name("HvdcDgcEncode").Device(tensorflow::DEVICE_CPU), hvdc_sparse::DgcEncodeOp);
REGISTER_KERNEL_BUILDER(Name("HvdcRandomkEncode").Device(tensorflow::DEVICE_CPU), hvdc_sparse::RandomkEncodeOp);
REGISTER_KERNEL_BUILDER(Name("HvdcStratified").Device(tensorflow::DEVICE_CPU), hvdc_sparse::StratifiedOp);
REGISTER_KERNEL_BUILDER(Name("HvdcScatterAdd").Device(tensorflow::DEVICE_CPU).TypeConstraint<int32_t>("Tindex"),
                        hvdc_sparse::ScatterAddOp<int32_t>);
REGISTER_KERNEL_BUILDER(Name("HvdcScatterAdd").Device(tensorflow::DEVICE_CPU).TypeConstraint<int64_t>("Tindex"),
                        hvdc_sparse::ScatterAddOp<int64_t>);
