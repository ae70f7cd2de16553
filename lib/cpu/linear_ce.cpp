// linear_ce.cpp — fused linear + cross-entropy on the CPU: z = h·Wᵀ + b, one chunk of token rows
// at a time (the N×V logits exist whole only when N fits one chunk), then ce_row.h's row-by-row
// cross-entropy on the chunk, then the gradients (SEMANTICS 13): ∂h = ∂z·W, ∂W (+)= ∂zᵀ·h
// accumulated in float32, ∂b (+)= Σ_r ∂z_r. The GEMMs are OpenBLAS cblas_sgemm in float32: float32 inputs are used as
// they are; float16/bfloat16 ones are widened (W and b once per call, in host memory; h chunk by
// chunk); the per-row cross-entropy is ce_row.h's (float32 vectorised, sums in double).
//
// The chunk has a fixed number of rows that depends on the problem sizes only, never on the
// workspace, so every workspace of at least min_bytes gives bit for bit the same result (BLAS
// results depend on the shapes they are called with, ∂W on how its sum over rows is split). The
// chunk's buffers live in the workspace when it holds optimal_bytes, else in host memory.
#include <cblas.h>

#include <climits>
#include <new>
#include <vector>

#include "ce_row.h"

namespace fce {
namespace {

using namespace cpu;

constexpr int64_t kChunkRows = 1024;  // rows per chunk (big: fewer passes over ∂W) ...
constexpr int64_t kChunkLogitsBytes = int64_t(128) << 20;  // ... fewer when V is huge

int64_t chunk_rows(int64_t rows, int64_t vocab) {
  const int64_t fit = std::max<int64_t>(1, kChunkLogitsBytes / (4 * vocab));
  return std::min(rows, std::min(kChunkRows, fit));
}

size_t align16(size_t bytes) { return (bytes + 15) & ~size_t(15); }

// The float32 buffers of a chunk of `rows` rows, in this order in the workspace.
struct ChunkLayout {
  size_t logits;       // z, then ∂z in place [rows, V]
  size_t hidden;       // h as float32 [rows, D]: only when dtype is not float32
  size_t grad_hidden;  // ∂h as float32 [rows, D]: only with gradients and dtype not float32
  size_t total() const { return logits + hidden + grad_hidden; }
};

ChunkLayout chunk_layout(int dtype, int64_t rows, int64_t hidden, int64_t vocab, bool with_grad) {
  const bool convert = dtype != FCE_FLOAT32;
  ChunkLayout layout;
  layout.logits = align16(size_t(rows) * size_t(vocab) * 4);
  layout.hidden = convert ? align16(size_t(rows) * size_t(hidden) * 4) : 0;
  layout.grad_hidden = convert && with_grad ? align16(size_t(rows) * size_t(hidden) * 4) : 0;
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

FloatMatrix as_float(int dtype, const void* src, int64_t rows, int64_t cols) {
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

// The chunk's hidden rows [r0, r0 + count) as float32: the caller's rows (float32, with their
// stride) or a dense float32 copy in the chunk buffer.
const float* hidden_chunk(const LinearCeProblem& p, int64_t r0, int64_t count, float* buffer,
                          int64_t* ld) {
  const size_t esize = dtype_size(p.opt.dtype);
  const char* first =
      static_cast<const char*>(p.hidden_states) + size_t(r0) * p.hidden_row_stride * esize;
  if (p.opt.dtype == FCE_FLOAT32) {
    *ld = p.hidden_row_stride;
    return reinterpret_cast<const float*>(first);
  }
  for (int64_t i = 0; i < count; ++i)
    convert_row_to_float(p.opt.dtype, first + size_t(i) * p.hidden_row_stride * esize, p.hidden,
                         buffer + size_t(i) * p.hidden);
  *ld = p.hidden;
  return buffer;
}

// z [count, V] = h·Wᵀ + b.
void logits_chunk(const float* h, int64_t ldh, const FloatMatrix& W, const float* b, int64_t count,
                  int64_t hidden, int64_t vocab, float* z) {
  if (b)
    for (int64_t i = 0; i < count; ++i) std::copy(b, b + vocab, z + size_t(i) * vocab);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(count), int(vocab), int(hidden), 1.0f, h,
              int(ldh), W.data(), int(W.ld), b ? 1.0f : 0.0f, z, int(vocab));
}

// ∂h [count, D] = ∂z·W, into the caller's rows (float32) or the chunk buffer, then rounded.
void grad_hidden_chunk(const LinearCeProblem& p, const float* dz, const FloatMatrix& W, int64_t r0,
                       int64_t count, float* buffer) {
  const int dtype = p.opt.dtype;
  const size_t esize = dtype_size(dtype);
  char* first = static_cast<char*>(p.grad_hidden) + size_t(r0) * p.hidden * esize;
  float* dh = dtype == FCE_FLOAT32 ? reinterpret_cast<float*>(first) : buffer;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(count), int(p.hidden), int(p.vocab),
              1.0f, dz, int(p.vocab), W.data(), int(W.ld), 0.0f, dh, int(p.hidden));
  if (dtype == FCE_FLOAT32) return;
  for (int64_t i = 0; i < count * p.hidden; ++i) store_float(dtype, first, i, dh[i]);
}

// ∂W [V, D] += ∂zᵀ·h over the chunk's rows, in float32.
void grad_weight_chunk(const float* dz, const float* h, int64_t ldh, int64_t count, int64_t hidden,
                       int64_t vocab, float* dW) {
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(vocab), int(hidden), int(count), 1.0f,
              dz, int(vocab), h, int(ldh), 1.0f, dW, int(hidden));
}

// ∂b [V] += Σ_r ∂z_r over the chunk's rows, in row order, in double.
void grad_bias_chunk(const float* dz, int64_t count, int64_t vocab, double* db) {
  parallel_for(vocab, thread_count(vocab, 4096), [&](int64_t begin, int64_t end, int) {
    for (int64_t i = 0; i < count; ++i)
      for (int64_t j = begin; j < end; ++j) db[j] += dz[size_t(i) * vocab + j];
  });
}

}  // namespace

void cpu_linear_ce_workspace_size(const CeOptions& opt, int64_t rows, int64_t hidden, int64_t vocab,
                                  bool with_grad, bool /*grad_weight_fp32*/, size_t* min_bytes,
                                  size_t* optimal_bytes) {
  const ChunkLayout one_row = chunk_layout(opt.dtype, 1, hidden, vocab, with_grad);
  const ChunkLayout chunk =
      chunk_layout(opt.dtype, chunk_rows(rows, vocab), hidden, vocab, with_grad);
  if (min_bytes) *min_bytes = one_row.total();
  if (optimal_bytes) *optimal_bytes = chunk.total();
}

fce_status cpu_linear_ce(const LinearCeProblem& p) {
  const char* fn = "fce_linear_ce (CPU)";
  const int64_t R = chunk_rows(p.rows, p.vocab);
  if (p.vocab > INT_MAX || p.hidden > INT_MAX || p.hidden_row_stride > INT_MAX)
    return fail(FCE_ERROR_UNSUPPORTED,
                "%s: BLAS takes int sizes: vocab %lld, hidden %lld, "
                "hidden_row_stride %lld must be at most %d",
                fn, (long long)p.vocab, (long long)p.hidden, (long long)p.hidden_row_stride,
                INT_MAX);
  const int dtype = p.opt.dtype;
  const int grad_weight_dtype = p.grad_weight_fp32 ? FCE_FLOAT32 : dtype;
  const bool with_grad = p.with_grad();
  try {
    // Everything is allocated before any output is written.
    const CeSetup setup = make_setup(p.opt, p.rows, p.vocab, p.targets, p.grad_output);
    RowScratch scratch(setup, R);
    RowResults results(p.rows, p.accuracy != nullptr);
    const FloatMatrix W = as_float(dtype, p.weight, p.vocab, p.hidden);
    const FloatMatrix b = p.bias ? as_float(dtype, p.bias, 1, p.vocab) : FloatMatrix();
    ChunkBuffers chunk(chunk_layout(dtype, R, p.hidden, p.vocab, with_grad), p.workspace,
                       p.workspace_bytes);
    // ∂W in float32: the caller's buffer when it is float32, else an accumulator added at the end.
    std::vector<float> dW_accumulator;
    float* dW = nullptr;
    if (p.grad_weight && grad_weight_dtype == FCE_FLOAT32) {
      dW = static_cast<float*>(p.grad_weight);
    } else if (p.grad_weight) {
      dW_accumulator.assign(size_t(p.vocab) * size_t(p.hidden), 0.0f);
      dW = dW_accumulator.data();
    }
    std::vector<double> db(p.grad_bias ? size_t(p.vocab) : 0, 0.0);
    if (dW && dW == p.grad_weight && !p.accumulate)
      std::fill(dW, dW + size_t(p.vocab) * size_t(p.hidden), 0.0f);

    bool invalid_seen = false;
    for (int64_t r0 = 0; r0 < p.rows; r0 += R) {
      const int64_t count = std::min(R, p.rows - r0);
      int64_t ldh = 0;
      const float* h = hidden_chunk(p, r0, count, chunk.hidden, &ldh);
      logits_chunk(h, ldh, W, b.data(), count, p.hidden, p.vocab, chunk.logits);

      RowsJob job;
      job.first_row = r0;
      job.count = count;
      job.logits = chunk.logits;
      job.logits_stride = p.vocab;
      job.logits_dtype = FCE_FLOAT32;
      job.grad = with_grad ? chunk.logits : nullptr;  // ∂z over z, in place
      job.grad_stride = p.vocab;
      job.grad_dtype = FCE_FLOAT32;
      job.lse_in = nullptr;
      job.lse_out = p.lse;
      job.argmax = p.argmax;
      job.results = &results;
      invalid_seen |= run_rows(setup, job, scratch);
      if (!with_grad) continue;

      const float* dz = chunk.logits;
      if (p.grad_hidden) grad_hidden_chunk(p, dz, W, r0, count, chunk.grad_hidden);
      if (dW) grad_weight_chunk(dz, h, ldh, count, p.hidden, p.vocab, dW);
      if (p.grad_bias) grad_bias_chunk(dz, count, p.vocab, db.data());
    }

    // ∂W and ∂b in their dtype: (old value when accumulating) + the sum, rounded once.
    if (p.grad_weight && dW != p.grad_weight) {
      const int64_t n = p.vocab * p.hidden;
      parallel_for(n, thread_count(n, int64_t(1) << 16), [&](int64_t begin, int64_t end, int) {
        for (int64_t i = begin; i < end; ++i) {
          const double old = p.accumulate ? load_float(grad_weight_dtype, p.grad_weight, i) : 0.0;
          store_double(grad_weight_dtype, p.grad_weight, i, old + double(dW[i]));
        }
      });
    }
    if (p.grad_bias) {
      for (int64_t j = 0; j < p.vocab; ++j) {
        const double old = p.accumulate ? load_float(grad_weight_dtype, p.grad_bias, j) : 0.0;
        store_double(grad_weight_dtype, p.grad_bias, j, old + db[size_t(j)]);
      }
    }

    write_reduction(setup, results, p.loss, p.z_loss, p.accuracy);
    if (invalid_seen && p.error_flags) *p.error_flags |= FCE_FLAG_TARGET_OUT_OF_RANGE;
    return FCE_SUCCESS;
  } catch (const std::bad_alloc&) {
    return fail(FCE_ERROR_INTERNAL, "%s: out of host memory (rows %lld, hidden %lld, vocab %lld)",
                fn, (long long)p.rows, (long long)p.hidden, (long long)p.vocab);
  }
}

}  // namespace fce
