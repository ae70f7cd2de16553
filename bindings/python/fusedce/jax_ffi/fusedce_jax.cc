// fusedce_jax.cc — libfusedce_jax.so: XLA FFI handlers that let JAX call libfusedce.
//
// A shim, not part of libfusedce: it calls the library's public C ABI (include/fusedce.h)
// through function pointers taken with dlopen/dlsym from the very library the Python binding
// loaded (fce_jax_init, called from fusedce/jax.py), and exports one XLA FFI handler per call
// and platform (XLA_FFI_DEFINE_HANDLER_SYMBOL), which fusedce/jax.py registers with
// jax.ffi.register_ffi_target:
//
//   fusedce_ce_fwd      fce_forward (+ the gradient for an upstream 1 in the same pass)
//   fusedce_ce_bwd      fce_backward, or fce_backward_rescale on the forward's gradient
//                       (aliased in place: input 5 = output 0)
//   fusedce_linear_ce   fce_linear_ce (loss only, or with gradients, for a given upstream)
//   fusedce_scale       fce_scale_gradient, in place (input 0 = output 0)
//
// and, in fusedce_jax_distill.cc (compiled into the same library), fusedce_distill and
// fusedce_linear_distill. The targets of fusedce_ce_fwd / _bwd and fusedce_linear_ce are class
// indices or class probabilities [N, V] of the logits' dtype.
//
// each as Fusedce<Name>Cpu (the CPU backend, host buffers, synchronous) and Fusedce<Name>Cuda
// (the CUDA backend on the stream XLA gives the custom call, PlatformStream<cudaStream_t>).
//
// The workspace: the LAST result of fusedce_ce_fwd, fusedce_ce_bwd and fusedce_linear_ce is a
// uint8 [workspace_bytes] buffer that fusedce/jax.py sizes at trace time with the library's own
// queries (fce_forward_workspace_size, fce_backward_workspace_size,
// fce_linear_ce_workspace_size) for the options these handlers build, and then discards. XLA
// allocates it like any other output (on the GPU inside the executable's temporary allocation,
// ordered on the call's stream; freed, or reused, after the call), so nothing here allocates:
// no ffi::ScratchAllocator (which jaxlib's GPU client may leave without an allocator, failing
// every Allocate). The handler passes the whole buffer (its size is workspace_bytes; NULL when
// it is empty); the library checks that it holds what its query asks for and is 16-byte
// aligned (one source of truth: its message is the error, with a hint at the trace-time sizing
// for a workspace too small). A handler of the other platform's size gets a clear error, never
// a smaller workspace. fusedce_linear_ce: any size >= min_bytes works; jax.py picks the fastest plan
// within the budget on CUDA and min_bytes on the CPU (there the workspace only decides whether
// the chunk buffers live in it, fusedce.h).
//
// The CUDA handlers are not marked command-buffer compatible (no
// ffi::Traits::kCmdBufferCompatible): the library's first call on a device does host-side set-up
// (fusedce.h), so XLA must run them as plain thunks, never inside a CUDA graph it captures.
//
// Building needs a C++17 compiler, the XLA FFI headers (jax.ffi.include_dir(), shipped in the
// jaxlib wheel) and fusedce.h; NOT the CUDA toolkit: cudaStream_t is only a handle type here,
// `struct CUstream_st*` as CUDA's driver_types.h defines it (with -DFCE_JAX_HAVE_CUDA_RUNTIME
// the real header is included instead and the two are checked to agree). Nothing is linked
// but libdl: one .so holds the CPU and the CUDA handlers. fusedce/jax_ffi/__init__.py builds it.
//
// Attributes (both handlers of every call take them, in this order; CEOptions.as_ffi_attrs in
// fusedce/_options.py writes them):
//   iopts  int64[8]: reduction, ignore_index, shift_seq_len, shift, token_scaling,
//                    workspace_bytes (fusedce_linear_ce: the budget jax.py sized the workspace
//                    result with; the handlers do not read it), rescale (fusedce_ce_bwd:
//                    fce_backward_rescale instead of fce_backward), batch_invariant
//   fopts  float32[4]: label_smoothing, z_loss_scale, softcap, logit_scale
// An optional input or output is passed as an empty (0,) array: a NULL pointer to the library.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "fusedce_jax_common.h"

namespace ffi = xla::ffi;

// Bumped whenever the handlers' arguments or attributes change: fusedce/jax.py checks it.
#define FCE_JAX_ABI 6  // 6: one init binds the distillation calls too (5: probability
                       // targets, the distillation handlers; 4: entropy,
                       // grad_lse, grad_entropy; 3: libfusedce 1.0's calls)

namespace fce_jax {

Api g_api;
bool g_ready = false;
size_t g_options_size = 0;
std::string g_init_error = "fce_jax_init was not called";

ffi::Error NotReady() {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "fusedce_jax: the shim is not initialised (" + g_init_error +
                        "); import fusedce.jax to register the handlers");
}

ffi::Error Fail(fce_status st, const char* fn) {
  return StatusError(st, fn, g_api.last_error, g_api.status_string);
}

ffi::Error NeedsError(const char* what, const char* since) {
  unsigned v = g_api.version ? g_api.version() : 0;
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    std::string("fusedce_jax: ") + what + ": needs libfusedce >= " + since +
                        "; the loaded library is " + std::to_string(v / 10000) + "." +
                        std::to_string(v / 100 % 100) + "." + std::to_string(v % 100));
}

}  // namespace fce_jax

namespace {

using namespace fce_jax;

std::mutex g_init_mutex;

// ---------------------------------------------------------------------- helpers ----
bool TargetCode(ffi::DataType t, int32_t* code) {
  switch (t) {
    case ffi::DataType::S32: *code = FCE_INT32; return true;
    case ffi::DataType::S64: *code = FCE_INT64; return true;
    default: return false;
  }
}

// The targets of fusedce_ce_fwd / _bwd and fusedce_linear_ce: class indices (int32/int64 [N]),
// or class probabilities [N, V] of the logits' (hidden states') dtype (a float target_dtype,
// docs/semantics.md rule 19).
ffi::Error Targets(const ffi::AnyBuffer& targets, const ffi::AnyBuffer& logits, int64_t n,
                   int64_t v, int32_t* code) {
  if (TargetCode(targets.element_type(), code)) {
    if (static_cast<int64_t>(targets.element_count()) != n)
      return Invalid("targets must have one element per row");
    return ffi::Error::Success();
  }
  if (targets.element_type() != logits.element_type() || !FloatCode(targets.element_type(), code))
    return Invalid("targets must be int32/int64, or class probabilities of the logits' dtype");
  if (static_cast<int64_t>(targets.element_count()) != n * v)
    return Invalid("class-probability targets must be [N, V]");
  return ffi::Error::Success();
}


constexpr size_t kIopts = 8, kFopts = 4;
enum {
  kReduction, kIgnoreIndex, kShiftSeqLen, kShift, kTokenScaling, kWorkspaceBytes, kRescale,
  kBatchInvariant
};

ffi::Error MakeOptions(ffi::Span<const int64_t> iopts, ffi::Span<const float> fopts,
                       int32_t backend, int32_t dtype, int32_t target_dtype,
                       const ffi::AnyBuffer& class_weights, int64_t vocab, fce_options* o) {
  if (iopts.size() != kIopts || fopts.size() != kFopts)
    return Invalid("iopts must hold 8 int64 and fopts 4 float32 (fusedce/jax.py and the shim "
                   "disagree: rebuild the shim)");
  std::memset(o, 0, sizeof(*o));
  o->struct_size = g_options_size;
  g_api.options_default(o);
  o->backend = backend;
  o->dtype = dtype;
  o->target_dtype = target_dtype;
  o->reduction = static_cast<int32_t>(iopts[kReduction]);
  o->ignore_index = iopts[kIgnoreIndex];
  o->shift_seq_len = iopts[kShiftSeqLen];
  o->label_smoothing = fopts[0];
  o->z_loss_scale = fopts[1];
  o->softcap = fopts[2];
  o->logit_scale = fopts[3];
  o->shift = iopts[kShift];
  o->token_scaling = static_cast<int32_t>(iopts[kTokenScaling] != 0);
  o->batch_invariant = static_cast<int32_t>(iopts[kBatchInvariant] != 0);
  if (class_weights.element_count()) {
    if (class_weights.element_type() != ffi::DataType::F32 ||
        static_cast<int64_t>(class_weights.element_count()) != vocab)
      return Invalid("class_weights must be float32 [vocab]");
    o->class_weights = static_cast<const float*>(class_weights.untyped_data());
  }
  return ffi::Error::Success();
}

// The outputs of a loss call (loss required; the others NULL when empty).
fce_outputs LossOutputs(ffi::Result<ffi::AnyBuffer>& loss, ffi::Result<ffi::AnyBuffer>& lse,
                        ffi::Result<ffi::AnyBuffer>& z_loss, ffi::Result<ffi::AnyBuffer>& accuracy,
                        ffi::Result<ffi::AnyBuffer>& argmax,
                        ffi::Result<ffi::AnyBuffer>& entropy) {
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = static_cast<float*>(loss->untyped_data());
  out.lse = static_cast<float*>(Opt(lse));
  out.z_loss = static_cast<float*>(Opt(z_loss));
  out.argmax = static_cast<int64_t*>(Opt(argmax));
  out.accuracy = static_cast<float*>(Opt(accuracy));
  out.entropy = static_cast<float*>(Opt(entropy));
  return out;
}

// Every buffer the library reads or writes is checked against the sizes it will use: on a GPU
// a mismatch would otherwise be an out-of-bounds access, a sticky error of the CUDA context.
// A float32 buffer of `count` elements; `optional`: also an empty (0,) one (NULL).
ffi::Error F32(const ffi::AnyBuffer& b, const char* name, int64_t count, bool optional) {
  if (optional && b.element_count() == 0) return ffi::Error::Success();
  if (b.element_type() != ffi::DataType::F32 || static_cast<int64_t>(b.element_count()) != count)
    return Invalid(std::string(name) + " must be float32 of " + std::to_string(count) +
                   (count == 1 ? " element" : " elements") + (optional ? " (or empty)" : ""));
  return ffi::Error::Success();
}

// The forward outputs of fusedce_ce_fwd and fusedce_linear_ce: loss (() | [N]), lse [N] | (0,),
// z_loss () | (0,), accuracy (() | [N]) | (0,), argmax int64 [N] as int32 [N, 2] | (0,),
// entropy [N] | (0,).
ffi::Error ForwardOutputs(int64_t n, bool none, const ffi::AnyBuffer& loss,
                          const ffi::AnyBuffer& lse, const ffi::AnyBuffer& z_loss,
                          const ffi::AnyBuffer& accuracy, const ffi::AnyBuffer& argmax,
                          const ffi::AnyBuffer& entropy) {
  const int64_t per = none ? n : 1;
  if (auto e = F32(loss, "loss", per, false); e.failure()) return e;
  if (auto e = F32(lse, "lse", n, true); e.failure()) return e;
  if (auto e = F32(z_loss, "z_loss", 1, true); e.failure()) return e;
  if (auto e = F32(accuracy, "accuracy", per, true); e.failure()) return e;
  if (auto e = F32(entropy, "entropy", n, true); e.failure()) return e;
  if (argmax.element_count() && static_cast<int64_t>(argmax.size_bytes()) != 8 * n)
    return Invalid("argmax must be int64 [N] (int32 [N, 2])");
  return ffi::Error::Success();
}

// The upstream gradients of lse and the entropy (float32 [N] | (0,): NULL = 0) into grads.
ffi::Error RowUpstreams(int64_t n, const ffi::AnyBuffer& grad_lse,
                        const ffi::AnyBuffer& grad_entropy, fce_gradients* grads) {
  if (auto e = F32(grad_lse, "grad_lse", n, true); e.failure()) return e;
  if (auto e = F32(grad_entropy, "grad_entropy", n, true); e.failure()) return e;
  grads->grad_lse = static_cast<const float*>(
      grad_lse.element_count() ? grad_lse.untyped_data() : nullptr);
  grads->grad_entropy = static_cast<const float*>(
      grad_entropy.element_count() ? grad_entropy.untyped_data() : nullptr);
  return ffi::Error::Success();
}

ffi::Error Matrix(const ffi::AnyBuffer& b, const char* name, int64_t* rows, int64_t* cols) {
  auto d = b.dimensions();
  if (d.size() != 2) return Invalid(std::string(name) + " must be rank 2");
  *rows = d[0];
  *cols = d[1];
  return ffi::Error::Success();
}

// ------------------------------------------------------------------ the calls ----
// ce_fwd: logits [N, V], targets [N], class_weights [V] | (0,), grad_output (() | [N]) float32
//   | (0,) (= 1), grad_lse [N] | (0,), grad_entropy [N] | (0,) (the upstream gradients of the
//   gradient written, with grad only)
//   -> loss (() | [N]), lse [N] | (0,), z_loss () | (0,), accuracy (() | [N]) | (0,),
//      argmax [N] int64 (as int32 [N, 2]) | (0,), entropy [N] | (0,), grad [N, V] | (0,),
//      workspace uint8 [fce_forward_workspace_size] | (0,)
ffi::Error CeForward(int32_t backend, void* stream, ffi::AnyBuffer logits, ffi::AnyBuffer targets,
                     ffi::AnyBuffer class_weights, ffi::AnyBuffer grad_output,
                     ffi::AnyBuffer grad_lse, ffi::AnyBuffer grad_entropy,
                     ffi::Result<ffi::AnyBuffer> loss,
                     ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> z_loss,
                     ffi::Result<ffi::AnyBuffer> accuracy, ffi::Result<ffi::AnyBuffer> argmax,
                     ffi::Result<ffi::AnyBuffer> entropy, ffi::Result<ffi::AnyBuffer> grad,
                     ffi::Result<ffi::AnyBuffer> workspace, ffi::Span<const int64_t> iopts,
                     ffi::Span<const float> fopts) {
  if (!g_ready) return NotReady();
  int64_t n, v;
  if (auto e = Matrix(logits, "logits", &n, &v); e.failure()) return e;
  int32_t dt, tdt;
  if (!FloatCode(logits.element_type(), &dt))
    return Invalid("logits must be float32, float16 or bfloat16");
  if (auto e = Targets(targets, logits, n, v, &tdt); e.failure()) return e;
  void* g = Opt(grad);
  if (g && (grad->element_type() != logits.element_type() ||
            static_cast<int64_t>(grad->element_count()) != n * v))
    return Invalid("grad must be [N, V] of the logits' dtype");
  fce_options o;
  if (auto e = MakeOptions(iopts, fopts, backend, dt, tdt, class_weights, v, &o); e.failure())
    return e;
  const bool none = o.reduction == FCE_REDUCTION_NONE;
  if (auto e = ForwardOutputs(n, none, *loss, *lse, *z_loss, *accuracy, *argmax, *entropy);
      e.failure())
    return e;
  if (auto e = F32(grad_output, "grad_output", none ? n : 1, true); e.failure()) return e;
  const fce_outputs out = LossOutputs(loss, lse, z_loss, accuracy, argmax, entropy);
  fce_gradients grads = FCE_GRADIENTS_INIT;
  grads.grad_logits = g;
  grads.grad_output = static_cast<const float*>(
      grad_output.element_count() ? grad_output.untyped_data() : nullptr);
  if (auto e = RowUpstreams(n, grad_lse, grad_entropy, &grads); e.failure()) return e;
  void* ws;
  size_t ws_bytes;
  if (auto e = Workspace(workspace, &ws, &ws_bytes); e.failure()) return e;
  if (fce_status st = g_api.forward(&o, n, v, logits.untyped_data(), targets.untyped_data(),
                                    &out, &grads, ws, ws_bytes, stream))
    return Fail(st, "fce_forward");
  return ffi::Error::Success();
}

// ce_bwd: logits [N, V], targets [N], class_weights, lse [N], grad_output (() | [N]) float32,
//   grad_in [N, V] (rescale: the forward's gradient, aliased to the output) | (0,),
//   grad_lse [N] | (0,) (fce_backward only)
//   -> grad [N, V], workspace uint8 [fce_backward_workspace_size] | (0,)
ffi::Error CeBackward(int32_t backend, void* stream, ffi::AnyBuffer logits,
                      ffi::AnyBuffer targets, ffi::AnyBuffer class_weights, ffi::AnyBuffer lse,
                      ffi::AnyBuffer grad_output, ffi::AnyBuffer grad_in, ffi::AnyBuffer grad_lse,
                      ffi::Result<ffi::AnyBuffer> grad, ffi::Result<ffi::AnyBuffer> workspace,
                      ffi::Span<const int64_t> iopts, ffi::Span<const float> fopts) {
  if (!g_ready) return NotReady();
  int64_t n, v;
  if (auto e = Matrix(logits, "logits", &n, &v); e.failure()) return e;
  int32_t dt, tdt;
  if (!FloatCode(logits.element_type(), &dt))
    return Invalid("logits must be float32, float16 or bfloat16");
  if (auto e = Targets(targets, logits, n, v, &tdt); e.failure()) return e;
  if (lse.element_type() != ffi::DataType::F32 || static_cast<int64_t>(lse.element_count()) != n)
    return Invalid("lse must be float32 [N]");
  if (grad->element_type() != logits.element_type() ||
      static_cast<int64_t>(grad->element_count()) != n * v)
    return Invalid("grad must be [N, V] of the logits' dtype");
  fce_options o;
  if (auto e = MakeOptions(iopts, fopts, backend, dt, tdt, class_weights, v, &o); e.failure())
    return e;
  bool rescale = iopts[kRescale] != 0;
  if (auto e = F32(grad_output, "grad_output",
                   o.reduction == FCE_REDUCTION_NONE && !rescale ? n : 1, false);
      e.failure())
    return e;
  if (rescale && grad_in.untyped_data() != grad->untyped_data())
    return Invalid("rescale: the forward's gradient (input 5) must be aliased to the output");
  void* ws;
  size_t ws_bytes;
  if (auto e = Workspace(workspace, &ws, &ws_bytes); e.failure()) return e;
  auto fn = rescale ? g_api.backward_rescale : g_api.backward;
  if (!fn) return NeedsError("fce_backward_rescale", "0.2");
  fce_gradients grads = FCE_GRADIENTS_INIT;
  grads.grad_output = static_cast<const float*>(grad_output.untyped_data());
  grads.grad_logits = grad->untyped_data();
  if (auto e = F32(grad_lse, "grad_lse", n, true); e.failure()) return e;
  grads.grad_lse = static_cast<const float*>(
      grad_lse.element_count() ? grad_lse.untyped_data() : nullptr);
  if (fce_status st = fn(&o, n, v, logits.untyped_data(), targets.untyped_data(),
                         static_cast<const float*>(lse.untyped_data()), nullptr, &grads, ws,
                         ws_bytes, stream))
    return Fail(st, rescale ? "fce_backward_rescale" : "fce_backward");
  return ffi::Error::Success();
}

// linear_ce: hidden [N, D], weight [V, D], bias [V] | (0,), targets [N], class_weights,
//   grad_output (() | [N]) float32 | (0,) (= 1), grad_lse [N] | (0,), grad_entropy [N] | (0,)
//   -> loss, lse [N], z_loss, accuracy, argmax, entropy (as ce_fwd), grad_hidden [N, D] | (0,),
//      grad_weight [V, D] | (0,), grad_bias [V] | (0,),
//      workspace uint8 [>= min_bytes of fce_linear_ce_workspace_size] | (0,)
ffi::Error LinearCe(int32_t backend, void* stream, ffi::AnyBuffer hidden,
                    ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::AnyBuffer targets,
                    ffi::AnyBuffer class_weights, ffi::AnyBuffer grad_output,
                    ffi::AnyBuffer grad_lse, ffi::AnyBuffer grad_entropy,
                    ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                    ffi::Result<ffi::AnyBuffer> z_loss, ffi::Result<ffi::AnyBuffer> accuracy,
                    ffi::Result<ffi::AnyBuffer> argmax, ffi::Result<ffi::AnyBuffer> entropy,
                    ffi::Result<ffi::AnyBuffer> grad_hidden,
                    ffi::Result<ffi::AnyBuffer> grad_weight,
                    ffi::Result<ffi::AnyBuffer> grad_bias, ffi::Result<ffi::AnyBuffer> workspace,
                    ffi::Span<const int64_t> iopts, ffi::Span<const float> fopts) {
  if (!g_ready) return NotReady();
  int64_t n, d, v, d2;
  if (auto e = Matrix(hidden, "hidden", &n, &d); e.failure()) return e;
  if (auto e = Matrix(weight, "weight", &v, &d2); e.failure()) return e;
  if (d2 != d) return Invalid("weight must be [V, D] with the D of hidden");
  int32_t dt, tdt;
  if (!FloatCode(hidden.element_type(), &dt))
    return Invalid("hidden must be float32, float16 or bfloat16");
  if (weight.element_type() != hidden.element_type() ||
      (bias.element_count() && bias.element_type() != hidden.element_type()))
    return Invalid("hidden, weight and bias must have one dtype");
  if (bias.element_count() && static_cast<int64_t>(bias.element_count()) != v)
    return Invalid("bias must be [V]");
  if (auto e = Targets(targets, hidden, n, v, &tdt); e.failure()) return e;
  void* gh = Opt(grad_hidden);
  void* gw = Opt(grad_weight);
  void* gb = Opt(grad_bias);
  if (gh && (grad_hidden->element_type() != hidden.element_type() ||
             static_cast<int64_t>(grad_hidden->element_count()) != n * d))
    return Invalid("grad_hidden must be [N, D] of the hidden states' dtype");
  if (gw && static_cast<int64_t>(grad_weight->element_count()) != v * d)
    return Invalid("grad_weight must be [V, D]");
  if (gb && (!bias.element_count() || static_cast<int64_t>(grad_bias->element_count()) != v))
    return Invalid("grad_bias must be [V], and only with a bias");
  fce_options o;
  if (auto e = MakeOptions(iopts, fopts, backend, dt, tdt, class_weights, v, &o); e.failure())
    return e;
  if (gw && grad_weight->element_type() != weight.element_type()) {
    if (grad_weight->element_type() != ffi::DataType::F32)
      return Invalid("grad_weight must have the weight's dtype or float32");
    o.grad_weight_fp32 = 1;
  }
  if (gb && grad_bias->element_type() != (o.grad_weight_fp32 ? ffi::DataType::F32
                                                              : weight.element_type()))
    return Invalid("grad_bias must have grad_weight's dtype");
  const bool none = o.reduction == FCE_REDUCTION_NONE;
  if (auto e = ForwardOutputs(n, none, *loss, *lse, *z_loss, *accuracy, *argmax, *entropy);
      e.failure())
    return e;
  if (auto e = F32(grad_output, "grad_output", none ? n : 1, true); e.failure()) return e;
  const fce_outputs out = LossOutputs(loss, lse, z_loss, accuracy, argmax, entropy);
  fce_gradients grads = FCE_GRADIENTS_INIT;
  grads.grad_output = static_cast<const float*>(Opt(grad_output));
  grads.grad_hidden = gh;
  grads.grad_weight = gw;
  grads.grad_bias = gb;
  if (auto e = RowUpstreams(n, grad_lse, grad_entropy, &grads); e.failure()) return e;
  // The whole workspace result, whose size decides the plan: fusedce/jax.py sized it (CUDA: the
  // fastest plan within the budget, never below min_bytes; CPU: min_bytes, the workspace only
  // deciding where the chunk buffers live). Below min_bytes the library refuses it, never a
  // silently different size.
  void* ws;
  size_t ws_bytes;
  if (auto e = Workspace(workspace, &ws, &ws_bytes); e.failure()) return e;
  if (fce_status st = g_api.linear_ce(&o, n, d, v, hidden.untyped_data(), weight.untyped_data(),
                                      Opt(bias), targets.untyped_data(), &out, &grads, ws,
                                      ws_bytes, stream))
    return Fail(st, "fce_linear_ce");
  return ffi::Error::Success();
}

// scale: grad (any shape, f32/f16/bf16), grad_output () float32 -> grad (aliased)
ffi::Error Scale(int32_t backend, void* stream, ffi::AnyBuffer grad_in,
                 ffi::AnyBuffer grad_output, ffi::Result<ffi::AnyBuffer> grad) {
  if (!g_ready) return NotReady();
  int32_t dt;
  if (!FloatCode(grad->element_type(), &dt))
    return Invalid("scale: grad must be float32, float16 or bfloat16");
  if (grad_in.untyped_data() != grad->untyped_data())
    return Invalid("scale: the gradient (input 0) must be aliased to the output");
  if (grad_output.element_type() != ffi::DataType::F32 || grad_output.element_count() != 1)
    return Invalid("scale: grad_output must be one float32");
  int64_t count = static_cast<int64_t>(grad->element_count());
  if (count == 0) return ffi::Error::Success();
  if (!g_api.scale_gradient) return NeedsError("fce_scale_gradient", "0.2");
  if (fce_status st =
          g_api.scale_gradient(backend, dt, count, grad->untyped_data(),
                               static_cast<const float*>(grad_output.untyped_data()), stream))
    return Fail(st, "fce_scale_gradient");
  return ffi::Error::Success();
}

// ------------------------------------------------------- the platform wrappers ----
using Buf = ffi::AnyBuffer;
using Ret = ffi::Result<ffi::AnyBuffer>;
using I64s = ffi::Span<const int64_t>;
using F32s = ffi::Span<const float>;

ffi::Error CeForwardCpu(Buf z, Buf y, Buf w, Buf go, Buf gl, Buf ge, Ret loss, Ret lse, Ret zl,
                        Ret acc, Ret am, Ret ent, Ret grad, Ret ws, I64s io, F32s fo) {
  return CeForward(FCE_BACKEND_CPU, nullptr, z, y, w, go, gl, ge, loss, lse, zl, acc, am, ent,
                   grad, ws, io, fo);
}
ffi::Error CeForwardCuda(cudaStream_t stream, Buf z, Buf y, Buf w, Buf go, Buf gl, Buf ge,
                         Ret loss, Ret lse, Ret zl, Ret acc, Ret am, Ret ent, Ret grad, Ret ws,
                         I64s io, F32s fo) {
  return CeForward(FCE_BACKEND_CUDA, stream, z, y, w, go, gl, ge, loss, lse, zl, acc, am, ent,
                   grad, ws, io, fo);
}
ffi::Error CeBackwardCpu(Buf z, Buf y, Buf w, Buf lse, Buf go, Buf gin, Buf gl, Ret grad, Ret ws,
                         I64s io, F32s fo) {
  return CeBackward(FCE_BACKEND_CPU, nullptr, z, y, w, lse, go, gin, gl, grad, ws, io, fo);
}
ffi::Error CeBackwardCuda(cudaStream_t stream, Buf z, Buf y, Buf w, Buf lse, Buf go, Buf gin,
                          Buf gl, Ret grad, Ret ws, I64s io, F32s fo) {
  return CeBackward(FCE_BACKEND_CUDA, stream, z, y, w, lse, go, gin, gl, grad, ws, io, fo);
}
ffi::Error LinearCeCpu(Buf h, Buf wt, Buf b, Buf y, Buf cw, Buf go, Buf gl, Buf ge, Ret loss,
                       Ret lse, Ret zl, Ret acc, Ret am, Ret ent, Ret gh, Ret gw, Ret gb, Ret ws,
                       I64s io, F32s fo) {
  return LinearCe(FCE_BACKEND_CPU, nullptr, h, wt, b, y, cw, go, gl, ge, loss, lse, zl, acc, am,
                  ent, gh, gw, gb, ws, io, fo);
}
ffi::Error LinearCeCuda(cudaStream_t stream, Buf h, Buf wt, Buf b, Buf y, Buf cw, Buf go, Buf gl,
                        Buf ge, Ret loss, Ret lse, Ret zl, Ret acc, Ret am, Ret ent, Ret gh,
                        Ret gw, Ret gb, Ret ws, I64s io, F32s fo) {
  return LinearCe(FCE_BACKEND_CUDA, stream, h, wt, b, y, cw, go, gl, ge, loss, lse, zl, acc, am,
                  ent, gh, gw, gb, ws, io, fo);
}
ffi::Error ScaleCpu(Buf gin, Buf go, Ret grad) {
  return Scale(FCE_BACKEND_CPU, nullptr, gin, go, grad);
}
ffi::Error ScaleCuda(cudaStream_t stream, Buf gin, Buf go, Ret grad) {
  return Scale(FCE_BACKEND_CUDA, stream, gin, go, grad);
}

}  // namespace

// ------------------------------------------------------------------ the handlers ----
#define FCE_ATTRS .Attr<I64s>("iopts").Attr<F32s>("fopts")
#define FCE_CUDA_CTX .Ctx<ffi::PlatformStream<cudaStream_t>>()

// The last .Ret<Buf>() of each: the workspace.
#define FCE_ARGS3 .Arg<Buf>().Arg<Buf>().Arg<Buf>()
#define FCE_RETS4 .Ret<Buf>().Ret<Buf>().Ret<Buf>().Ret<Buf>()
#define FCE_CE_FWD_SIG FCE_ARGS3 FCE_ARGS3 FCE_RETS4 FCE_RETS4 FCE_ATTRS
#define FCE_CE_BWD_SIG FCE_ARGS3 FCE_ARGS3 .Arg<Buf>().Ret<Buf>().Ret<Buf>() FCE_ATTRS
#define FCE_LINEAR_SIG FCE_ARGS3 FCE_ARGS3 .Arg<Buf>().Arg<Buf>() FCE_RETS4 FCE_RETS4 \
    .Ret<Buf>().Ret<Buf>() FCE_ATTRS

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedceCeForwardCpu, CeForwardCpu,
                              ffi::Ffi::Bind() FCE_CE_FWD_SIG);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedceCeForwardCuda, CeForwardCuda,
                              ffi::Ffi::Bind() FCE_CUDA_CTX FCE_CE_FWD_SIG);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedceCeBackwardCpu, CeBackwardCpu,
                              ffi::Ffi::Bind() FCE_CE_BWD_SIG);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedceCeBackwardCuda, CeBackwardCuda,
                              ffi::Ffi::Bind() FCE_CUDA_CTX FCE_CE_BWD_SIG);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedceLinearCeCpu, LinearCeCpu,
                              ffi::Ffi::Bind() FCE_LINEAR_SIG);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedceLinearCeCuda, LinearCeCuda,
                              ffi::Ffi::Bind() FCE_CUDA_CTX FCE_LINEAR_SIG);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedceScaleCpu, ScaleCpu,
                              ffi::Ffi::Bind().Arg<Buf>().Arg<Buf>().Ret<Buf>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedceScaleCuda, ScaleCuda,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<Buf>().Arg<Buf>().Ret<Buf>());

// ------------------------------------------------------------- set-up from Python ----
// Binds the shim to libfusedce: library_path is the library the Python binding loaded (dlopen
// of an already loaded path returns that same library), options_size the fce_options
// struct_size to pass it (fusedce._lib.options_size(): FCE_OPTIONS_SIZE_V1_0).
// Returns 0, or -1 with fce_jax_init_error() saying why. Idempotent.
FCE_JAX_API int fce_jax_init(const char* library_path, size_t options_size) {
  std::lock_guard<std::mutex> lock(g_init_mutex);
  if (g_ready) return 0;
  if (options_size < FCE_OPTIONS_SIZE_V1_0 || options_size > sizeof(fce_options)) {
    g_init_error = "options_size " + std::to_string(options_size) + " is not a size this shim "
                   "knows (" + std::to_string(FCE_OPTIONS_SIZE_V1_0) + ".." +
                   std::to_string(sizeof(fce_options)) + ")";
    return -1;
  }
  void* h = dlopen(library_path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    g_init_error = std::string("dlopen(") + library_path + ") failed: " + (e ? e : "?");
    return -1;
  }
  Api a{};
  std::string missing;
  Sym(h, "fce_version", a.version, missing);
  Sym(h, "fce_last_error", a.last_error, missing);
  Sym(h, "fce_status_string", a.status_string, missing);
  Sym(h, "fce_options_default", a.options_default, missing);
  Sym(h, "fce_forward", a.forward, missing);
  Sym(h, "fce_backward", a.backward, missing);
  Sym(h, "fce_linear_ce", a.linear_ce, missing);
  // added in 0.2: optional (a handler that needs one the library lacks says so, NeedsError)
  std::string optional;
  Sym(h, "fce_backward_rescale", a.backward_rescale, optional);
  Sym(h, "fce_scale_gradient", a.scale_gradient, optional);
  // 1.0's distillation calls (fusedce_jax_distill.cc): optional like those (NeedsError), so
  // that the cross-entropy handlers keep working with a library that lacks them
  Sym(h, "fce_distill", a.distill, optional);
  Sym(h, "fce_linear_distill", a.linear_distill, optional);
  if (!missing.empty()) {
    g_init_error = std::string(library_path) + " lacks " + missing;
    return -1;
  }
  if (a.version() / 10000 != FCE_VERSION_MAJOR) {
    g_init_error = "libfusedce major version " + std::to_string(a.version() / 10000) +
                   " differs from the shim's header (" + std::to_string(FCE_VERSION_MAJOR) + ")";
    return -1;
  }
  g_api = a;
  g_options_size = options_size;
  g_ready = true;
  g_init_error.clear();
  return 0;
}

FCE_JAX_API const char* fce_jax_init_error(void) { return g_init_error.c_str(); }

// FCE_JAX_ABI: the handlers' argument and attribute layout (fusedce/jax.py checks it).
FCE_JAX_API unsigned fce_jax_abi(void) { return FCE_JAX_ABI; }

// The XLA FFI API version of the headers this shim was built with (major * 1000 + minor).
FCE_JAX_API unsigned fce_jax_xla_ffi_api_version(void) {
  return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR;
}
