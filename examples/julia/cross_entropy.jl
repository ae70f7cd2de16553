# cross_entropy.jl: fused cross-entropy from Julia (FusedCE.jl) on fusedce's CPU backend, and on
# the GPU too when CUDA.jl is installed, sees a device, and the library was built with CUDA.
#
# Run from the repository root, after `make`:
#   FUSEDCE_LIBRARY=$PWD/build/libfusedce.so julia --project=bindings/julia/FusedCE.jl examples/julia/cross_entropy.jl

using FusedCE
using Random

rng = MersenneTwister(0)
vocab, hidden_size, rows = 8192, 128, 48  # small: the CPU backend is the reference, not the fast path

# Layout: one column per row of the C API. Targets are 0-based class indices; -100 is ignored.
logits = 4 .* randn(rng, Float32, vocab, rows)
targets = rand(rng, 0:vocab-1, rows)
targets[5] = -100

# 1. Loss and gradient over given logits, in one pass.
res = forward(logits, targets; grad=true, label_smoothing=0.1)
println("forward:   loss = ", res.loss, ", z-loss = ", res.z_loss,
        ", |grad| = ", sqrt(sum(abs2, res.grad)), ", error flags = ", res.error_flags)

# 2. The gradient later, from the saved lse (e.g. once the upstream gradient is known).
grad = backward(logits, targets, res.lse; label_smoothing=0.1, grad_output=Float32[0.5])
println("backward:  |grad| with grad_output 0.5 = ", sqrt(sum(abs2, grad)))

# 3. The LM head fused: z = weight' * hidden is produced piece by piece within the workspace.
hidden = randn(rng, Float32, hidden_size, rows)
weight = 0.1f0 .* randn(rng, Float32, hidden_size, vocab)  # one column per class
lc = linear_ce(hidden, weight, targets; z_loss_scale=1e-4)
direct = forward(permutedims(weight) * hidden, targets; z_loss_scale=1e-4)
println("linear_ce: loss = ", lc.loss, " (via materialised logits: ", direct.loss, "), ",
        "grad_hidden ", size(lc.grad_hidden), ", grad_weight ", size(lc.grad_weight))

# 4. Mistakes come back as exceptions naming the argument.
try
    forward(logits, targets; label_smoothing=1.5)
catch err
    println("error:     ", sprint(showerror, err))
end

# 5. The same on the GPU: CuArrays run on the CUDA backend, on the task's stream.
const GPU = Base.find_package("CUDA") !== nothing && FusedCE.cuda_available()
GPU && @eval using CUDA
if GPU && CUDA.functional()
    r = forward(CuArray(logits), CuArray(targets); grad=true, label_smoothing=0.1)
    println("GPU:       loss = ", Array(r.loss)[1], " (CPU ", res.loss, ")")
else
    println("GPU:       skipped (needs CUDA.jl, a CUDA device and a library built with CUDA)")
end
