// distill.h — what the ABI layer (lib/api_distill.cpp) hands to a backend for the distillation
// calls fce_distill and fce_linear_distill (docs/semantics.md rule 20), every argument checked.
#pragma once

#include <cstddef>
#include <cstdint>

#include "internal.h"

namespace fce {

// The options of a distillation: the student's transform (scale, cap) applies to both rows.
struct DistillOptions {
  int dtype;           // of both rows' logits (or hidden states and weights)
  bool targets_int64;  // when targets are given
  int reduction;       // fce_reduction
  int64_t ignore_index;
  float softcap;      // c, 0 = off
  float logit_scale;  // s
  int divergence;     // fce_divergence
  float beta;         // JSD's β in [0, 1]
  float temperature;  // T > 0
};

// fce_distill.
struct DistillProblem {
  const char* fn;  // "fce_distill"
  DistillOptions opt;
  int64_t rows, vocab;
  int64_t row_stride;          // student logits, >= vocab
  int64_t teacher_row_stride;  // >= vocab
  int64_t grad_row_stride;     // >= vocab
  const void* logits;          // student [rows, row_stride]
  const void* teacher;         // [rows, teacher_row_stride]
  const void* targets;         // [rows] or nullptr (every row counts)
  float* loss;                 // [1] or [rows]
  float* lse;                  // optional [rows]: the student's lse of a / T
  void* grad;                  // optional; may == logits
  const float* grad_output;    // nullptr = 1
  void* workspace;
  size_t workspace_bytes;
  void* stream;
};

// fce_linear_distill.
struct LinearDistillProblem {
  const char* fn;  // "fce_linear_distill"
  DistillOptions opt;
  int64_t rows, hidden, vocab, teacher_hidden;
  int64_t hidden_row_stride, teacher_hidden_row_stride;  // >= hidden / teacher_hidden
  const void* hidden_states;                             // [rows, hidden_row_stride]
  const void* weight;                                    // [vocab, hidden]
  const void* teacher_hidden_states;                     // [rows, teacher_hidden_row_stride]
  const void* teacher_weight;                            // [vocab, teacher_hidden]
  const void* targets;                                   // [rows] or nullptr
  float* loss;
  float* lse;
  void* grad_hidden;  // optional [rows, hidden] dense, dtype
  void* grad_weight;  // optional [vocab, hidden] dense, dtype or f32
  bool grad_weight_fp32;
  bool accumulate;
  const float* grad_output;
  void* workspace;
  size_t workspace_bytes;
  void* stream;
  bool with_grad() const { return grad_hidden || grad_weight; }
};

// ---- CPU backend (lib/cpu/distill.cpp, lib/cpu/linear_distill.cpp) ----
size_t cpu_distill_workspace_size(const DistillOptions& opt, int64_t rows, int64_t vocab);
fce_status cpu_distill(const DistillProblem& p);
void cpu_linear_distill_workspace_size(const DistillOptions& opt, int64_t rows, int64_t hidden,
                                       int64_t teacher_hidden, int64_t vocab, bool with_grad,
                                       size_t* min_bytes, size_t* optimal_bytes);
fce_status cpu_linear_distill(const LinearDistillProblem& p);

// ---- CUDA backend (lib/cuda/distill/); stubs in a build without it ----
size_t cuda_distill_workspace_size(const DistillOptions& opt, int64_t rows, int64_t vocab);
fce_status cuda_distill(const DistillProblem& p);
void cuda_linear_distill_workspace_size(const DistillOptions& opt, int64_t rows, int64_t hidden,
                                        int64_t teacher_hidden, int64_t vocab, bool with_grad,
                                        bool grad_weight_fp32, size_t* min_bytes,
                                        size_t* optimal_bytes);
fce_status cuda_linear_distill(const LinearDistillProblem& p);

}  // namespace fce
