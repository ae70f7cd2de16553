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

}  // namespace abi
}  // namespace fce
