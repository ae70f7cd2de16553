// fusedce_jax_distill.cc — the distillation handlers of libfusedce_jax.so (built into the same
// library as fusedce_jax.cc, which holds the cross-entropy handlers and describes the shim:
// dlsym binding, workspaces as the last result, CPU and CUDA handlers per call).
//
//   fusedce_distill         fce_distill (the loss; with the student's gradient for a given
//                           upstream, 1 when grad_output is empty)
//   fusedce_linear_distill  fce_linear_distill (the loss; with the student's grad_hidden and
//                           grad_weight when their results are not empty)
//
// each as Fusedce<Name>Cpu and Fusedce<Name>Cuda, calling the library through g_api
// (fusedce_jax_common.h, bound by fce_jax_init).
//
// Attributes:
//   iopts  int64[3]: reduction, ignore_index, divergence
//   fopts  float32[4]: beta, temperature, softcap, logit_scale
// An optional input or output is passed as an empty (0,) array: a NULL pointer to the library.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "fusedce_jax_common.h"

namespace ffi = xla::ffi;

namespace {

using namespace fce_jax;

ffi::Error DMatrix(const ffi::AnyBuffer& b, const char* name, int64_t* rows, int64_t* cols) {
  auto d = b.dimensions();
  if (d.size() != 2) return Invalid(std::string(name) + " must be rank 2");
  *rows = d[0];
  *cols = d[1];
  return ffi::Error::Success();
}

constexpr size_t kDIopts = 3, kDFopts = 4;

// The options and the teacher (without its arrays) of a distillation call; the targets, when
// present, int32 or int64 [N] (only ignore_index is read from them). What
// fusedce/_jax_calls.py gives the workspace queries: int32 targets when there are none.
ffi::Error MakeDistill(ffi::Span<const int64_t> iopts, ffi::Span<const float> fopts,
                       int32_t backend, int32_t dtype, const ffi::AnyBuffer& targets, int64_t n,
                       fce_options* o, fce_teacher* t) {
  if (iopts.size() != kDIopts || fopts.size() != kDFopts)
    return Invalid("distillation iopts must hold 3 int64 and fopts 4 float32 (fusedce/jax.py "
                    "and the shim disagree: rebuild the shim)");
  int32_t tdt = FCE_INT32;
  if (targets.element_count()) {
    if (targets.element_type() == ffi::DataType::S64)
      tdt = FCE_INT64;
    else if (targets.element_type() != ffi::DataType::S32)
      return Invalid("targets must be int32/int64");
    if (static_cast<int64_t>(targets.element_count()) != n)
      return Invalid("targets must have one element per row");
  }
  std::memset(o, 0, sizeof(*o));
  o->struct_size = g_options_size;
  g_api.options_default(o);
  o->backend = backend;
  o->dtype = dtype;
  o->target_dtype = tdt;
  o->reduction = static_cast<int32_t>(iopts[0]);
  o->ignore_index = iopts[1];
  o->softcap = fopts[2];
  o->logit_scale = fopts[3];
  const fce_teacher init = FCE_TEACHER_INIT;
  *t = init;
  t->divergence = static_cast<int32_t>(iopts[2]);
  t->beta = fopts[0];
  t->temperature = fopts[1];
  return ffi::Error::Success();
}

// loss (() | [N]) float32 and grad_output (() | [N]) float32 | (0,) (= 1).
ffi::Error LossAndUpstream(const fce_options& o, int64_t n, const ffi::AnyBuffer& loss,
                           const ffi::AnyBuffer& grad_output) {
  const int64_t per = o.reduction == FCE_REDUCTION_NONE ? n : 1;
  if (loss.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(loss.element_count()) != per)
    return Invalid("loss must be float32 of " + std::to_string(per) + " elements");
  if (grad_output.element_count() &&
      (grad_output.element_type() != ffi::DataType::F32 ||
       static_cast<int64_t>(grad_output.element_count()) != per))
    return Invalid("grad_output must be float32 of " + std::to_string(per) +
                    " elements (or empty)");
  return ffi::Error::Success();
}

// distill: logits [N, V], teacher_logits [N, V] (the same dtype), targets [N] | (0,),
//   grad_output (() | [N]) float32 | (0,) (= 1)
//   -> loss (() | [N]), grad [N, V] of the logits' dtype | (0,),
//      workspace uint8 [fce_distill_workspace_size] | (0,)
ffi::Error Distill(int32_t backend, void* stream, ffi::AnyBuffer logits, ffi::AnyBuffer teacher,
                   ffi::AnyBuffer targets, ffi::AnyBuffer grad_output,
                   ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> grad,
                   ffi::Result<ffi::AnyBuffer> workspace, ffi::Span<const int64_t> iopts,
                   ffi::Span<const float> fopts) {
  if (!g_ready) return NotReady();
  if (!g_api.distill) return NeedsError("fce_distill", "1.0");
  int64_t n, v, tn, tv;
  if (auto e = DMatrix(logits, "logits", &n, &v); e.failure()) return e;
  if (auto e = DMatrix(teacher, "teacher_logits", &tn, &tv); e.failure()) return e;
  int32_t dt;
  if (!FloatCode(logits.element_type(), &dt))
    return Invalid("logits must be float32, float16 or bfloat16");
  if (teacher.element_type() != logits.element_type() || tn != n || tv != v)
    return Invalid("teacher_logits must be [N, V] of the student logits' dtype");
  void* g = Opt(grad);
  if (g && (grad->element_type() != logits.element_type() ||
            static_cast<int64_t>(grad->element_count()) != n * v))
    return Invalid("grad must be [N, V] of the logits' dtype");
  fce_options o;
  fce_teacher t;
  if (auto e = MakeDistill(iopts, fopts, backend, dt, targets, n, &o, &t); e.failure()) return e;
  if (auto e = LossAndUpstream(o, n, *loss, grad_output); e.failure()) return e;
  t.logits = teacher.untyped_data();
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = static_cast<float*>(loss->untyped_data());
  fce_gradients grads = FCE_GRADIENTS_INIT;
  grads.grad_logits = g;
  grads.grad_output = static_cast<const float*>(Opt(grad_output));
  void* ws;
  size_t ws_bytes;
  if (auto e = Workspace(workspace, &ws, &ws_bytes); e.failure()) return e;
  if (fce_status st = g_api.distill(&o, &t, n, v, logits.untyped_data(), Opt(targets), &out,
                                     g ? &grads : nullptr, ws, ws_bytes, stream))
    return Fail(st, "fce_distill");
  return ffi::Error::Success();
}

// linear_distill: hidden [N, D], weight [V, D], teacher_hidden [N, D'], teacher_weight [V, D']
//   (one dtype), targets [N] | (0,), grad_output (() | [N]) float32 | (0,) (= 1)
//   -> loss (() | [N]), grad_hidden [N, D] | (0,), grad_weight [V, D] | (0,) (the student's,
//      of its dtype; grad_weight may be float32 for a 16-bit weight), workspace uint8 [>= min_bytes of fce_linear_distill_workspace_size]
ffi::Error LinearDistill(int32_t backend, void* stream, ffi::AnyBuffer hidden,
                         ffi::AnyBuffer weight, ffi::AnyBuffer teacher_hidden,
                         ffi::AnyBuffer teacher_weight, ffi::AnyBuffer targets,
                         ffi::AnyBuffer grad_output, ffi::Result<ffi::AnyBuffer> loss,
                         ffi::Result<ffi::AnyBuffer> grad_hidden,
                         ffi::Result<ffi::AnyBuffer> grad_weight,
                         ffi::Result<ffi::AnyBuffer> workspace, ffi::Span<const int64_t> iopts,
                         ffi::Span<const float> fopts) {
  if (!g_ready) return NotReady();
  if (!g_api.linear_distill) return NeedsError("fce_linear_distill", "1.0");
  int64_t n, d, v, d2, tn, td, tv, td2;
  if (auto e = DMatrix(hidden, "hidden", &n, &d); e.failure()) return e;
  if (auto e = DMatrix(weight, "weight", &v, &d2); e.failure()) return e;
  if (auto e = DMatrix(teacher_hidden, "teacher_hidden", &tn, &td); e.failure()) return e;
  if (auto e = DMatrix(teacher_weight, "teacher_weight", &tv, &td2); e.failure()) return e;
  if (d2 != d) return Invalid("weight must be [V, D] with the D of hidden");
  if (tn != n || tv != v || td2 != td)
    return Invalid("teacher_hidden must be [N, D'] and teacher_weight [V, D']");
  int32_t dt;
  if (!FloatCode(hidden.element_type(), &dt))
    return Invalid("hidden must be float32, float16 or bfloat16");
  if (weight.element_type() != hidden.element_type() ||
      teacher_hidden.element_type() != hidden.element_type() ||
      teacher_weight.element_type() != hidden.element_type())
    return Invalid("hidden, weight, teacher_hidden and teacher_weight must have one dtype");
  void* gh = Opt(grad_hidden);
  void* gw = Opt(grad_weight);
  if (gh && (grad_hidden->element_type() != hidden.element_type() ||
             static_cast<int64_t>(grad_hidden->element_count()) != n * d))
    return Invalid("grad_hidden must be [N, D] of the hidden states' dtype");
  if (gw && ((grad_weight->element_type() != weight.element_type() &&
              grad_weight->element_type() != ffi::DataType::F32) ||
             static_cast<int64_t>(grad_weight->element_count()) != v * d))
    return Invalid("grad_weight must be [V, D] of the weight's dtype or float32");
  fce_options o;
  fce_teacher t;
  if (auto e = MakeDistill(iopts, fopts, backend, dt, targets, n, &o, &t); e.failure()) return e;
  // a float32 grad_weight for a 16-bit weight: accumulated in float32 (grad_weight_fp32)
  if (gw && grad_weight->element_type() != weight.element_type()) o.grad_weight_fp32 = 1;
  if (auto e = LossAndUpstream(o, n, *loss, grad_output); e.failure()) return e;
  t.hidden_states = teacher_hidden.untyped_data();
  t.weight = teacher_weight.untyped_data();
  t.hidden = td;
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = static_cast<float*>(loss->untyped_data());
  fce_gradients grads = FCE_GRADIENTS_INIT;
  grads.grad_hidden = gh;
  grads.grad_weight = gw;
  grads.grad_output = static_cast<const float*>(Opt(grad_output));
  void* ws;
  size_t ws_bytes;
  if (auto e = Workspace(workspace, &ws, &ws_bytes); e.failure()) return e;
  if (fce_status st = g_api.linear_distill(&o, &t, n, d, v, hidden.untyped_data(),
                                            weight.untyped_data(), Opt(targets), &out,
                                            (gh || gw) ? &grads : nullptr, ws, ws_bytes,
                                            stream))
    return Fail(st, "fce_linear_distill");
  return ffi::Error::Success();
}

using Buf = ffi::AnyBuffer;
using Ret = ffi::Result<ffi::AnyBuffer>;
using I64s = ffi::Span<const int64_t>;
using F32s = ffi::Span<const float>;

ffi::Error DistillCpu(Buf z, Buf t, Buf y, Buf go, Ret loss, Ret grad, Ret ws, I64s io,
                      F32s fo) {
  return Distill(FCE_BACKEND_CPU, nullptr, z, t, y, go, loss, grad, ws, io, fo);
}
ffi::Error DistillCuda(cudaStream_t stream, Buf z, Buf t, Buf y, Buf go, Ret loss, Ret grad,
                       Ret ws, I64s io, F32s fo) {
  return Distill(FCE_BACKEND_CUDA, stream, z, t, y, go, loss, grad, ws, io, fo);
}
ffi::Error LinearDistillCpu(Buf h, Buf w, Buf th, Buf tw, Buf y, Buf go, Ret loss, Ret gh,
                            Ret gw, Ret ws, I64s io, F32s fo) {
  return LinearDistill(FCE_BACKEND_CPU, nullptr, h, w, th, tw, y, go, loss, gh, gw, ws, io, fo);
}
ffi::Error LinearDistillCuda(cudaStream_t stream, Buf h, Buf w, Buf th, Buf tw, Buf y, Buf go,
                             Ret loss, Ret gh, Ret gw, Ret ws, I64s io, F32s fo) {
  return LinearDistill(FCE_BACKEND_CUDA, stream, h, w, th, tw, y, go, loss, gh, gw, ws, io, fo);
}

}  // namespace

#define FCE_DATTRS .Attr<I64s>("iopts").Attr<F32s>("fopts")
#define FCE_DCUDA_CTX .Ctx<ffi::PlatformStream<cudaStream_t>>()
#define FCE_DISTILL_SIG \
  .Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Ret<Buf>().Ret<Buf>().Ret<Buf>() FCE_DATTRS
#define FCE_LINEAR_DISTILL_SIG                                                             \
  .Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Ret<Buf>().Ret<Buf>() \
      .Ret<Buf>().Ret<Buf>() FCE_DATTRS

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedceDistillCpu, DistillCpu, ffi::Ffi::Bind() FCE_DISTILL_SIG);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedceDistillCuda, DistillCuda,
                              ffi::Ffi::Bind() FCE_DCUDA_CTX FCE_DISTILL_SIG);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedceLinearDistillCpu, LinearDistillCpu,
                              ffi::Ffi::Bind() FCE_LINEAR_DISTILL_SIG);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedceLinearDistillCuda, LinearDistillCuda,
                              ffi::Ffi::Bind() FCE_DCUDA_CTX FCE_LINEAR_DISTILL_SIG);

