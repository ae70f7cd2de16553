// linear_chunks.h — the token chunks of the CPU's fused linear + CE (linear_ce.cpp) and of its
// vocabulary-parallel phases (vocab_parallel.cpp): z = h·Wᵀ + b made one chunk of rows at a time
// in float32 by cblas_sgemm, from float32 inputs as they are or 16-bit ones widened (W and b once
// per call, h chunk by chunk). The chunk's rows depend on the sizes only, never on the
// workspace; its buffers live in the workspace when it is large enough, else in host memory.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"
#include "cpu/blas.h"

namespace fce {
namespace cpu {

constexpr int64_t kChunkRows = 1024;  // rows per chunk (big: fewer passes over ∂W) ...
constexpr int64_t kChunkLogitsBytes = int64_t(128) << 20;  // ... fewer when V is huge

inline int64_t chunk_rows(int64_t rows, int64_t vocab) {
  const int64_t fit = std::max<int64_t>(1, kChunkLogitsBytes / (4 * vocab));
  return std::min(rows, std::min(kChunkRows, fit));
}

inline size_t align16(size_t bytes) { return (bytes + 15) & ~size_t(15); }

// The float32 buffers of a chunk of `rows` rows, in this order in the workspace.
struct ChunkLayout {
  size_t logits;       // z, then ∂z in place [rows, V]
  size_t hidden;       // h as float32 [rows, D]: only when dtype is not float32
  size_t grad_hidden;  // ∂h as float32 [rows, D]: only when ∂h is made and is not float32
  size_t total() const { return logits + hidden + grad_hidden; }
};

// dtype: of h, W, b; f32_grad_hidden: ∂h is made and rounded to a 16-bit type afterwards.
inline ChunkLayout chunk_layout(int dtype, int64_t rows, int64_t hidden, int64_t vocab,
                                bool f32_grad_hidden) {
  ChunkLayout layout;
  layout.logits = align16(size_t(rows) * size_t(vocab) * 4);
  layout.hidden = dtype != FCE_FLOAT32 ? align16(size_t(rows) * size_t(hidden) * 4) : 0;
  layout.grad_hidden = f32_grad_hidden ? align16(size_t(rows) * size_t(hidden) * 4) : 0;
  return layout;
}

// A [rows, cols] float32 matrix with leading dimension ld: either the caller's float32 data or
// a float32 copy of data of another dtype.
struct FloatMatrix {
  const float* borrowed = nullptr;
  std::vector<float> copy;
  int64_t ld = 0;
  const float* data() const { return borrowed ? borrowed : copy.empty() ? nullptr : copy.data(); }
};

inline FloatMatrix as_float(int dtype, const void* src, int64_t rows, int64_t cols) {
  FloatMatrix m;
  m.ld = cols;
  if (dtype == FCE_FLOAT32) {
    m.borrowed = static_cast<const float*>(src);
    return m;
  }
  m.copy.resize(size_t(rows) * size_t(cols));
  const size_t esize = dtype_size(dtype);
  parallel_for(rows, thread_count(rows, std::max<int64_t>(1, (int64_t(1) << 16) / cols)),
               [&](int64_t begin, int64_t end, int) {
                 for (int64_t r = begin; r < end; ++r)
                   convert_row_to_float(dtype,
                                        static_cast<const char*>(src) + size_t(r) * cols * esize,
                                        cols, m.copy.data() + size_t(r) * cols);
               });
  return m;
}

// Where the chunk's buffers are: the workspace, or host memory when the workspace is smaller
// than the chunk (the same chunk either way).
struct ChunkBuffers {
  float* logits;
  float* hidden;
  float* grad_hidden;
  std::vector<float> host;
  ChunkBuffers(const ChunkLayout& layout, void* workspace, size_t workspace_bytes) {
    char* base = static_cast<char*>(workspace);
    if (workspace_bytes < layout.total()) {
      host.resize(layout.total() / 4);
      base = reinterpret_cast<char*>(host.data());
    }
    logits = reinterpret_cast<float*>(base);
    hidden = reinterpret_cast<float*>(base + layout.logits);
    grad_hidden = reinterpret_cast<float*>(base + layout.logits + layout.hidden);
  }
};

// Hidden rows [r0, r0 + count) of h [rows, stride] of dtype as float32: the caller's rows
// (float32, with their stride) or a dense float32 copy in `buffer`; *ld their leading dimension.
inline const float* hidden_chunk(int dtype, const void* hidden_states, int64_t stride,
                                 int64_t hidden, int64_t r0, int64_t count, float* buffer,
                                 int64_t* ld) {
  const size_t esize = dtype_size(dtype);
  const char* first = static_cast<const char*>(hidden_states) + size_t(r0) * stride * esize;
  if (dtype == FCE_FLOAT32) {
    *ld = stride;
    return reinterpret_cast<const float*>(first);
  }
  for (int64_t i = 0; i < count; ++i)
    convert_row_to_float(dtype, first + size_t(i) * stride * esize, hidden,
                         buffer + size_t(i) * hidden);
  *ld = hidden;
  return buffer;
}

// z [count, V] = h·Wᵀ + b, float32.
inline void logits_chunk(const float* h, int64_t ldh, const FloatMatrix& W, const float* b,
                         int64_t count, int64_t hidden, int64_t vocab, float* z) {
  if (b)
    for (int64_t i = 0; i < count; ++i) std::copy(b, b + vocab, z + size_t(i) * vocab);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(count), int(vocab), int(hidden), 1.0f, h,
              int(ldh), W.data(), int(W.ld), b ? 1.0f : 0.0f, z, int(vocab));
}

// ∂h [count, D] = ∂z [count, V]·W into grad_hidden's rows [r0, r0 + count) (dense, of dtype):
// straight into them for float32, else through the float32 `buffer`, rounded once.
inline void grad_hidden_chunk(int dtype, void* grad_hidden, const float* dz, const FloatMatrix& W,
                              int64_t r0, int64_t count, int64_t hidden, int64_t vocab,
                              float* buffer) {
  const size_t esize = dtype_size(dtype);
  char* first = static_cast<char*>(grad_hidden) + size_t(r0) * hidden * esize;
  float* dh = dtype == FCE_FLOAT32 ? reinterpret_cast<float*>(first) : buffer;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(count), int(hidden), int(vocab), 1.0f,
              dz, int(vocab), W.data(), int(W.ld), 0.0f, dh, int(hidden));
  if (dtype == FCE_FLOAT32) return;
  for (int64_t i = 0; i < count * hidden; ++i) store_float(dtype, first, i, dh[i]);
}

// options->batch_invariant (docs/semantics.md rule 21): a BLAS's order of summation may follow
// the rows it is given (its blocking, its threads, a GEMV for one row), so the per-row products
// below replace the two GEMMs whose rows are outputs. The same code for every element: the
// results depend on neither the rows nor the thread. x·y over n: eight float32 partial sums
// (k mod 8), folded pairwise, then the tail in order.
inline float fixed_dot(const float* x, const float* y, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int u = 0; u < 8; ++u) acc[u] += x[k + u] * y[k + u];
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; k < n; ++k) s += x[k] * y[k];
  return s;
}

constexpr int64_t kFixedBlock = 256;  // columns of a work item of the per-row products

// z [count, V] = h·Wᵀ + b row by row: z_ij = fixed_dot(h_i, W_j) + b_j.
inline void logits_rows_fixed(const float* h, int64_t ldh, const FloatMatrix& W, const float* b,
                              int64_t count, int64_t hidden, int64_t vocab, float* z) {
  const int64_t blocks = (vocab + kFixedBlock - 1) / kFixedBlock;
  const float* w = W.data();
  parallel_for(count * blocks, thread_count(count * blocks, std::max<int64_t>(1, 64 / blocks)),
               [&](int64_t begin, int64_t end, int) {
                 for (int64_t item = begin; item < end; ++item) {
                   const int64_t i = item / blocks, j0 = item % blocks * kFixedBlock;
                   const int64_t j1 = std::min(vocab, j0 + kFixedBlock);
                   const float* hi = h + size_t(i) * size_t(ldh);
                   float* zi = z + size_t(i) * size_t(vocab);
                   for (int64_t j = j0; j < j1; ++j)
                     zi[j] = fixed_dot(hi, w + size_t(j) * size_t(W.ld), hidden) + (b ? b[j] : 0.f);
                 }
               });
}

// ∂h [count, D] = ∂z·W row by row, each element summed over j = 0..V-1 in order (float32), into
// grad_hidden's rows [r0, r0 + count) as grad_hidden_chunk writes them.
inline void grad_hidden_rows_fixed(int dtype, void* grad_hidden, const float* dz,
                                   const FloatMatrix& W, int64_t r0, int64_t count, int64_t hidden,
                                   int64_t vocab, float* buffer) {
  const size_t esize = dtype_size(dtype);
  char* first = static_cast<char*>(grad_hidden) + size_t(r0) * hidden * esize;
  float* dh = dtype == FCE_FLOAT32 ? reinterpret_cast<float*>(first) : buffer;
  const int64_t blocks = (hidden + kFixedBlock - 1) / kFixedBlock;
  const float* w = W.data();
  parallel_for(count * blocks, thread_count(count * blocks), [&](int64_t begin, int64_t end, int) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / blocks, k0 = item % blocks * kFixedBlock;
      const int64_t k1 = std::min(hidden, k0 + kFixedBlock);
      float* out = dh + size_t(i) * size_t(hidden);
      const float* dzi = dz + size_t(i) * size_t(vocab);
      std::fill(out + k0, out + k1, 0.f);
      for (int64_t j = 0; j < vocab; ++j) {
        const float g = dzi[j];
        const float* wj = w + size_t(j) * size_t(W.ld);
        for (int64_t k = k0; k < k1; ++k) out[k] += g * wj[k];
      }
    }
  });
  if (dtype == FCE_FLOAT32) return;
  for (int64_t i = 0; i < count * hidden; ++i) store_float(dtype, first, i, dh[i]);
}

// ∂W [V, D] += ∂zᵀ·h over the chunk's rows, in float32.
inline void grad_weight_chunk(const float* dz, const float* h, int64_t ldh, int64_t count, int64_t hidden,
                       int64_t vocab, float* dW) {
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(vocab), int(hidden), int(count), 1.0f,
              dz, int(vocab), h, int(ldh), 1.0f, dW, int(hidden));
}

// ∂b [V] += Σ_r ∂z_r over the chunk's rows, in row order, in double.
inline void grad_bias_chunk(const float* dz, int64_t count, int64_t vocab, double* db) {
  parallel_for(vocab, thread_count(vocab, 4096), [&](int64_t begin, int64_t end, int) {
    for (int64_t i = 0; i < count; ++i)
      for (int64_t j = begin; j < end; ++j) db[j] += dz[size_t(i) * vocab + j];
  });
}

// ∂W [V, D] and ∂b [V] of a call, summed over its chunks: ∂W in float32 (the caller's
// grad_weight when it is float32, zeroed unless accumulating; else an accumulator), ∂b in
// double. The constructor allocates and then writes that zeroing, the one output written before
// the chunks: construct it after every other allocation of the call.
class WeightGrads {
 public:
  WeightGrads(int dtype, void* grad_weight, void* grad_bias, bool accumulate, int64_t vocab,
              int64_t hidden)
      : dtype_(dtype), grad_weight_(grad_weight), grad_bias_(grad_bias), accumulate_(accumulate),
        vocab_(vocab), hidden_(hidden) {
    const size_t n = size_t(vocab) * size_t(hidden);
    if (grad_weight && dtype == FCE_FLOAT32) {
      dW_ = static_cast<float*>(grad_weight);
    } else if (grad_weight) {
      accumulator_.assign(n, 0.0f);
      dW_ = accumulator_.data();
    }
    db_.assign(grad_bias ? size_t(vocab) : 0, 0.0);
    if (dW_ && dW_ == grad_weight && !accumulate) std::fill(dW_, dW_ + n, 0.0f);
  }

  // ∂W += ∂zᵀ·h and ∂b += Σ_r ∂z_r over a chunk of `count` rows.
  void add(const float* dz, const float* h, int64_t ldh, int64_t count) {
    if (dW_) grad_weight_chunk(dz, h, ldh, count, hidden_, vocab_, dW_);
    if (grad_bias_) grad_bias_chunk(dz, count, vocab_, db_.data());
  }

  // ∂W and ∂b in their dtype: (the old value when accumulating) + the sum, rounded once.
  void store() const {
    if (grad_weight_ && dW_ != grad_weight_) {
      const int64_t n = vocab_ * hidden_;
      parallel_for(n, thread_count(n, int64_t(1) << 16), [&](int64_t begin, int64_t end, int) {
        for (int64_t i = begin; i < end; ++i) {
          const double old = accumulate_ ? load_float(dtype_, grad_weight_, i) : 0.0;
          store_double(dtype_, grad_weight_, i, old + double(dW_[i]));
        }
      });
    }
    if (grad_bias_) {
      for (int64_t j = 0; j < vocab_; ++j) {
        const double old = accumulate_ ? load_float(dtype_, grad_bias_, j) : 0.0;
        store_double(dtype_, grad_bias_, j, old + db_[size_t(j)]);
      }
    }
  }

 private:
  int dtype_;  // of grad_weight and grad_bias
  void* grad_weight_;
  void* grad_bias_;
  bool accumulate_;
  int64_t vocab_, hidden_;
  std::vector<float> accumulator_;
  float* dW_ = nullptr;
  std::vector<double> db_;
};

}  // namespace cpu
}  // namespace fce
