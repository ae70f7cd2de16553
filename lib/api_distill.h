// api_distill.h — the checks the distillation calls share (lib/api_distill.cpp, where they are
// defined, and lib/api_vp_distill.cpp): the teacher, the options a distillation takes, and the
// outputs and gradients it does not write. Each names the public call and the field.
#pragma once

#include "distill.h"
#include "validate.h"

namespace fce {
namespace abi {

// The caller's teacher into *t: its struct_size must be a version's, reserved0 0, the
// divergence one of fce_divergence, beta in [0, 1] and the temperature finite and > 0.
fce_status read_teacher(const char* fn, const fce_teacher* teacher, fce_teacher* t);

// The options every call shares (check_options over rows and vocab), then those a distillation
// does not take: FCE_ERROR_UNSUPPORTED naming the call and the field. Fills *out.
fce_status check_distill_options(const char* fn, const fce_options* o, const fce_teacher& t,
                                 int64_t rows, int64_t vocab, DistillOptions* out);

// The outputs and gradients a distillation does not write: FCE_ERROR_UNSUPPORTED.
fce_status refuse_outputs(const char* fn, const fce_outputs& out, const fce_gradients& g);

// The teacher fields of the other call must be absent (NULL, 0): linear (fce_linear_distill)
// reads hidden_states, weight, hidden, hidden_row_stride; the others logits and row_stride.
fce_status check_teacher_fields(const char* fn, const fce_teacher& t, bool linear);

// teacher->hidden of the linear calls: in [1, 2^31-1].
fce_status check_teacher_hidden(const char* fn, const fce_teacher& t);

// ---- the vocabulary-parallel distillation (lib/api_vp_distill.cpp) ----

// Which of the teacher's fields the call reads: fce_vp_distill_*'s (logits, row_stride),
// fce_vp_linear_distill_*'s (hidden_states, weight, hidden, hidden_row_stride; the others must be
// absent), or none of them (fce_vp_distill_loss: either kind is accepted).
enum class TeacherFields { kLogits, kLinear, kAny };
// The checks every fce_vp_distill_* and fce_vp_linear_distill_* call shares after the options
// are read: the teacher, the options a distillation takes (over the whole vocabulary),
// options->vp_entropy (the statistics carry no entropy) and the teacher's fields.
fce_status check_vp_distill_common(const char* fn, const fce_options* o, const fce_teacher* teacher,
                                   int64_t rows, int64_t vocab_total, TeacherFields fields,
                                   fce_teacher* t, DistillOptions* opt);
// The statistics rounds of the teacher's divergence (fce_vp_distill_rounds).
int vp_distill_rounds(const fce_teacher& t);
// round in [1, rounds]; previous NULL in round 1 (round 2 requires it: check_required).
fce_status check_vp_round(const char* fn, const fce_teacher& t, int32_t round,
                          const float* previous);
// The start of a round's statistics call (fce_vp_distill_stats, fce_vp_linear_distill_stats):
// the options into *o (begin_call), the shard's pointer and sizes, check_vp_distill_common, the
// round, and the rows (of previous [ranks, rows] in round 2).
fce_status begin_vp_stats(const char* fn, const fce_options* options, const fce_teacher* teacher,
                          const fce_vp_shard* shard, int32_t round, int64_t rows,
                          const float* previous, TeacherFields fields, fce_options* o,
                          fce_teacher* t, DistillOptions* opt);
// Gathered statistics [ranks, rows, FCE_VP_DISTILL_STATS] under the argument's name.
Arg vp_distill_gathered_arg(const char* name, const float* p, int64_t ranks, int64_t rows);

}  // namespace abi
}  // namespace fce
