# The Julia binding on fusedce's CPU backend, against a small Float64 reference written here from
# docs/semantics.md (independent of the library's code). From the repository root:
#
#   FUSEDCE_LIBRARY=$PWD/build/libfusedce.so julia --project=bindings/julia/FusedCE.jl \
#       bindings/julia/FusedCE.jl/test/runtests.jl
#
# (bindings/julia/run_tests.sh does this when julia is on the PATH.)
using Test, Random, LinearAlgebra
using FusedCE
using FusedCE: FCE_BACKEND_CPU, FCE_ERROR_INVALID_ARGUMENT, FCE_FLAG_TARGET_OUT_OF_RANGE,
               FCE_OPTIONS_INIT, bfloat16_bits, bfloat16_float

# ------------------------------------------------------------------------------ the reference

"""
    reference(z, y; options...) -> (; loss, lse, z_loss, grad, argmax, accuracy)

Cross-entropy of `z` (vocab × rows, any reals) against 0-based targets `y`, in Float64, step by
step as docs/semantics.md writes it: with token scaling each scored row's terms are times
t = p_y (a constant for the gradient); the mean divides the cross-entropy terms by the class
weights' sum D and the z-loss terms by the count n of non-ignored rows. `argmax` is 0-based
(-1 for ignored rows), `accuracy` unweighted.
"""
function reference(z::AbstractMatrix, y::AbstractVector; reduction::Symbol=:mean,
                   ignore_index::Integer=-100, label_smoothing::Real=0, z_loss_scale::Real=0,
                   softcap::Real=0, logit_scale::Real=1, class_weights=nothing,
                   shift_seq_len::Integer=0, shift::Integer=0, token_scaling::Bool=false,
                   grad_output=nothing)
    V, N = size(z)
    w = class_weights === nothing ? ones(V) : Float64.(class_weights)
    Ω = sum(w)
    ε, λ, c, s = Float64(label_smoothing), Float64(z_loss_scale), Float64(softcap),
                 Float64(logit_scale)
    k_shift = max(shift, 1)  # shift 0 means 1
    ce = zeros(N)           # t · cross-entropy of each row (rule 8)
    zl = zeros(N)           # t · λ lse² of each row
    lse = zeros(N)
    dce_da = zeros(V, N)    # ∂ce_r/∂a (rule 9), before the upstream scale k
    dzl_da = zeros(V, N)    # ∂zl_r/∂a, before the upstream scale k_z
    da_dz = fill(s, V, N)   # s · (1 − (a/c)²) with softcap, else s
    pred = fill(-1, N)      # rule 15: the 0-based argmax of the scored rows
    correct = zeros(N)
    D = 0.0                 # the cross-entropy's denominator (rule 4)
    n = 0                   # the z-loss's: the non-ignored rows, valid or invalid
    for r in 1:N
        # rule 1: the row's target
        target = if shift_seq_len > 0
            (r - 1) % shift_seq_len >= shift_seq_len - k_shift ? nothing : y[r + k_shift]
        else
            y[r]
        end
        # docs/semantics.md steps 1-3: scale, softcap, lse
        a = s .* Float64.(z[:, r])
        if c > 0
            a = c .* tanh.(a ./ c)
            da_dz[:, r] .= s .* (1 .- (a ./ c) .^ 2)
        end
        m = maximum(a)
        l = m + log(sum(exp.(a .- m)))
        lse[r] = l
        # rule 2: ignored rows
        (target === nothing || target == ignore_index) && continue
        n += 1
        first_nan = findfirst(isnan, a)  # a NaN is the largest, as torch.argmax
        pred[r] = (first_nan === nothing ? argmax(a) : first_nan) - 1
        # rule 3: invalid rows (never correct; their z-loss term unscaled)
        if !(0 <= target < V)
            ce[r] = NaN
            zl[r] = λ * l^2
            dce_da[:, r] .= NaN
            D += 1
            continue
        end
        t = target + 1
        correct[r] = pred[r] == target ? 1.0 : 0.0
        p = exp.(a .- l)
        ts = token_scaling ? p[t] : 1.0
        # rule 8, then rule 9
        ce[r] = ts * ((1 - ε) * w[t] * (l - a[t]) + (ε / V) * sum(w .* (l .- a)))
        zl[r] = ts * λ * l^2
        g = (1 - ε) * w[t] .* p
        g[t] -= (1 - ε) * w[t]
        g .+= (ε / V) .* (Ω .* p .- w)
        dce_da[:, r] .= ts .* g
        dzl_da[:, r] .= (ts * 2λ * l) .* p
        D += w[t]
    end
    over(x, d) = d == 0 ? 0.0 : x / d
    z_total = sum(zl)
    g0 = grad_output === nothing ? 1.0 : Float64(grad_output[1])
    # rules 5-7 and 15: reduction, upstream scales, z-loss total, accuracy
    if reduction === :none
        total = ce .+ zl
        k = grad_output === nothing ? ones(N) : Float64.(grad_output)
        kz = k
        accuracy = correct
    elseif reduction === :sum
        total = sum(ce) + sum(zl)
        k = kz = fill(g0, N)
        accuracy = over(sum(correct), n)
    else
        total = over(sum(ce), D) + over(sum(zl), n)
        z_total = over(z_total, n)
        k = fill(over(g0, D), N)
        kz = fill(over(g0, n), N)
        accuracy = over(sum(correct), n)
    end
    grad = (dce_da .* permutedims(k) .+ dzl_da .* permutedims(kz)) .* da_dz
    return (loss=total, lse=lse, z_loss=z_total, grad=grad, argmax=pred, accuracy=accuracy)
end

"""The reference of fce_linear_ce: z = weight' * hidden .+ bias, then `reference`."""
function reference_linear(h, W, b, y; options...)
    z = permutedims(Float64.(W)) * Float64.(h)
    b === nothing || (z = z .+ Float64.(b))
    r = reference(z, y; options...)
    return (loss=r.loss, lse=r.lse, z_loss=r.z_loss, grad_hidden=Float64.(W) * r.grad,
            grad_weight=Float64.(h) * permutedims(r.grad), grad_bias=vec(sum(r.grad; dims=2)),
            argmax=r.argmax, accuracy=r.accuracy, z=z)
end

close_to(a, b, rtol) = isapprox(Float64.(a), Float64.(b); rtol=rtol)

# fce_backward against fce_forward (docs/semantics.md rule 12): each p_j = exp(a_j - lse) carries the
# rounding of the Float32 lse, a relative |lse|·2^-24 (rows with |lse| >= 1024 are exact).
backward_rtol(lse) = 1e-6 + 2 * min(maximum(abs, filter(isfinite, lse); init=0.0), 1024) * 2.0^-24

# Seven rows (columns) of four classes whose predicted classes are known by hand: ties (the
# lowest index wins), a NaN (the largest, as torch.argmax), -Inf, an ignored row (-1, not
# counted) and an invalid target (counted, never right).
const HAND_Z = Float32[1   0 1     2  -Inf32 0 5;
                       3   0 NaN32 1  -1     9 1;
                       3   0 5     0  7      1 2;
                       0   0 NaN32 -1 7      2 3]
const HAND_Y = [1, 2, 1, -100, 3, 4, 0]

# Logits with a realistic spread (docs/semantics.md: standard deviation 1-30), targets with ignored rows.
function make_data(rng, V, N; std=8.0, ignore_index=-100)
    z = Float32.(randn(rng, V, N) .* std)
    y = rand(rng, 0:V-1, N)
    for r in 1:N
        rand(rng) < 0.15 && (y[r] = ignore_index)
    end
    return z, y
end

# ------------------------------------------------------------------------------ the tests

const rng = MersenneTwister(20240607)
const V, N = 101, 24          # N is a multiple of the shift_seq_len used below
const weights = Float32.(0.5 .+ 1.5 .* rand(rng, V))
const CASES = [
    ("defaults", (;)),
    ("label smoothing", (label_smoothing=0.1,)),
    ("z-loss", (z_loss_scale=1e-3,)),
    ("softcap and logit scale", (softcap=15.0, logit_scale=0.7)),
    ("class weights", (class_weights=weights,)),
    ("causal shift", (shift_seq_len=6,)),
    ("everything", (label_smoothing=0.05, z_loss_scale=1e-4, softcap=20.0, logit_scale=1.3,
                    class_weights=weights, ignore_index=-1)),
    # the options of 0.3
    ("causal shift by 3", (shift_seq_len=6, shift=3)),
    ("token scaling", (token_scaling=true, label_smoothing=0.1, z_loss_scale=1e-3)),
    ("class weights and z-loss", (class_weights=weights, z_loss_scale=1e-2)),
    ("everything of 0.3", (label_smoothing=0.05, z_loss_scale=1e-3, softcap=20.0,
                           class_weights=weights, shift_seq_len=8, shift=2, token_scaling=true)),
]

@testset "FusedCE.jl on the CPU backend" begin

@testset "library, header and options" begin
    @test FusedCE.library_version().major == FusedCE.HEADER_VERSION.major
    @test isfile(FusedCE.library_path())
    @test FusedCE.cuda_available() isa Bool
    @test startswith(build_info(), "fusedce $(FusedCE.library_version().major).")
    @test occursin("BLAS: ", build_info())
    @test sizeof(FceOptions) == FusedCE.FCE_OPTIONS_SIZE_V1_0
    @test sizeof(FusedCE.FceOutputs) == FusedCE.FCE_OUTPUTS_SIZE_V1_0
    @test sizeof(FusedCE.FceGradients) == FusedCE.FCE_GRADIENTS_SIZE_V1_0
    # fce_options_default writes exactly FCE_OPTIONS_INIT over a struct of junk
    junk = FceOptions(; ignore_index=7, row_stride=7, shift_seq_len=3, backend=1, dtype=2,
                      reduction=:none, label_smoothing=0.5, softcap=2, logit_scale=3,
                      deterministic=1, accumulate=1, shift=4, token_scaling=1)
    r = Ref(junk)
    FusedCE.fce_options_default(r)
    @test r[] == FCE_OPTIONS_INIT
    @test FceOptions() == FCE_OPTIONS_INIT
    @test FceOptions(reduction=:sum).reduction == FusedCE.FCE_REDUCTION_SUM
    o3 = FceOptions(shift=2, token_scaling=1)
    @test o3.shift == 2 && o3.token_scaling == 1 && o3.reserved1 == 0
    @test :shift in FusedCE.OPTION_KEYWORDS && :token_scaling in FusedCE.OPTION_KEYWORDS
    @test_throws ArgumentError FceOptions(no_such_field=1)
    @test startswith(FusedCE.status_string(FusedCE.FCE_ERROR_NULL_POINTER),
                     "FCE_ERROR_NULL_POINTER")
    # the low-level wrappers, as generated
    o = FceOptions(backend=FCE_BACKEND_CPU)
    bytes = Ref{Csize_t}(typemax(Csize_t))
    @test FusedCE.fce_forward_workspace_size(o, N, V, bytes) === nothing
    @test bytes[] < typemax(Csize_t)
    err = try
        FusedCE.fce_forward_workspace_size(o, -1, V, bytes)
    catch e
        e
    end
    @test err isa FusedCEError
    @test err.status == FCE_ERROR_INVALID_ARGUMENT
    @test occursin("rows", err.message)
    @test FusedCE.last_error() == err.message
end

@testset "forward, $name, reduction=$red" for (name, opts) in CASES, red in (:mean, :sum, :none)
    z, y = make_data(rng, V, N; ignore_index=get(opts, :ignore_index, -100))
    ref = reference(z, y; reduction=red, opts...)
    res = forward(z, y; grad=true, argmax=true, accuracy=true, reduction=red, opts...)
    @test res.loss isa (red === :none ? Vector{Float32} : Float32)
    @test close_to(res.loss, ref.loss, 1e-5)
    @test close_to(res.lse, ref.lse, 1e-5)
    @test isapprox(res.z_loss, ref.z_loss; rtol=1e-5, atol=1e-6)
    @test close_to(res.grad, ref.grad, 1e-5)
    @test res.error_flags == 0
    @test res.argmax == ref.argmax
    @test res.accuracy isa (red === :none ? Vector{Float32} : Float32)
    @test isapprox(res.accuracy, ref.accuracy; atol=1e-6)
    # not asking for them: nothing, and the same loss and gradient bit for bit
    plain = forward(z, y; grad=true, reduction=red, opts...)
    @test plain.argmax === nothing && plain.accuracy === nothing
    @test reinterpret(UInt32, plain.grad) == reinterpret(UInt32, res.grad)
    # backward: the same gradient from the saved lse, to the rounding of lse
    g = backward(z, y, res.lse; reduction=red, opts...)
    @test close_to(g, res.grad, backward_rtol(res.lse))
    @test close_to(g, ref.grad, 1e-5)
    # Int32 targets
    @test close_to(forward(z, Int32.(y); reduction=red, opts...).loss, ref.loss, 1e-5)
end

@testset "grad_output" begin
    z, y = make_data(rng, V, N)
    g = Float32[0.25]
    res = forward(z, y; grad=true, grad_output=g)
    @test close_to(res.grad, reference(z, y; grad_output=g).grad, 1e-5)
    g = rand(rng, Float32, N)
    res = forward(z, y; grad=true, reduction=:none, grad_output=g)
    ref = reference(z, y; reduction=:none, grad_output=g)
    @test close_to(res.grad, ref.grad, 1e-5)
    @test close_to(backward(z, y, res.lse; reduction=:none, grad_output=g), ref.grad, 1e-5)
end

@testset "strided views, in place, caller-owned outputs" begin
    z, y = make_data(rng, V, N)
    ref = reference(z, y)
    padded = fill(NaN32, V + 27, N)
    padded[1:V, :] .= z
    zv = view(padded, 1:V, :)
    gpadded = fill(NaN32, V + 5, N)
    gv = view(gpadded, 1:V, :)
    loss, lse = fill(NaN32, 1), fill(NaN32, N)
    @test forward!(loss, zv, y; lse=lse, grad_logits=gv) === loss
    @test close_to(loss[1], ref.loss, 1e-5)
    @test close_to(lse, ref.lse, 1e-5)
    @test close_to(gv, ref.grad, 1e-5)
    @test all(isnan, gpadded[V+1:end, :])  # nothing written past the view's rows
    @test all(isnan, padded[V+1:end, :])
    # a stride keyword agreeing with the view is fine; one that does not is refused
    @test close_to(forward(zv, y; row_stride=V + 27).loss, ref.loss, 1e-5)
    @test_throws ArgumentError forward(zv, y; row_stride=V)
    # the gradient over the logits themselves
    zc = copy(z)
    res = forward(zc, y; grad=true, inplace=true)
    @test res.grad === zc
    @test close_to(zc, ref.grad, 1e-5)
    zc = copy(z)
    @test backward(zc, y, lse; inplace=true) === zc
    @test close_to(zc, ref.grad, 1e-5)
    # a caller's workspace: the queried size, and 16 bytes to align it
    bytes = Ref{Csize_t}(0)
    FusedCE.fce_forward_workspace_size(FceOptions(backend=FCE_BACKEND_CPU), N, V, bytes)
    ws = zeros(UInt8, Int(bytes[]) + 16)
    @test close_to(forward!(fill(NaN32, 1), z, y; workspace=ws)[1], ref.loss, 1e-5)
end

@testset "targets out of range, rows all ignored" begin
    z, y = make_data(rng, V, N)
    bad = copy(y)
    bad[3] = V
    res = forward(z, bad; grad=true)
    @test isnan(res.loss)
    @test res.error_flags & FCE_FLAG_TARGET_OUT_OF_RANGE != 0
    @test all(isnan, res.grad[:, 3])
    per_row = forward(z, bad; reduction=:none)
    @test isnan(per_row.loss[3])
    @test all(isfinite, per_row.loss[[1:2; 4:N]])
    flags = zeros(UInt32, 1)
    forward!(zeros(Float32, 1), z, y; error_flags=flags)
    @test flags[1] == 0
    res = forward(z, fill(-100, N); grad=true)
    @test res.loss == 0
    @test all(iszero, res.grad)
end

@testset "Float16 and bfloat16 data" begin
    z, y = make_data(rng, V, N)
    zh = Float16.(z)
    ref = reference(Float64.(zh), y)
    res = forward(zh, y; grad=true)
    @test eltype(res.grad) == Float16
    @test close_to(res.loss, ref.loss, 1e-4)
    @test close_to(res.grad, ref.grad, 2e-3)
    @test bfloat16_bits(1.0f0) == 0x3f80
    @test bfloat16_float(bfloat16_bits(-2.5f0)) == -2.5f0
    zb = bfloat16_bits.(z)
    ref = reference(Float64.(bfloat16_float.(zb)), y)
    res = forward(zb, y; grad=true)
    @test eltype(res.grad) == UInt16
    @test close_to(res.loss, ref.loss, 1e-4)
    @test close_to(bfloat16_float.(res.grad), ref.grad, 1e-2)
end

@testset "linear_ce" begin
    D, Vl, Nl = 32, 67, 18
    h = randn(rng, Float32, D, Nl)
    W = 0.5f0 .* randn(rng, Float32, D, Vl)
    b = randn(rng, Float32, Vl)
    y = rand(rng, 0:Vl-1, Nl)
    y[2] = -100
    for red in (:mean, :sum, :none),
        (bias, opts) in ((b, (;)), (nothing, (label_smoothing=0.1, z_loss_scale=1e-3, softcap=30.0)))

        ref = reference_linear(h, W, bias, y; reduction=red, opts...)
        res = linear_ce(h, W, y; bias=bias, reduction=red, opts...)
        # GEMMs in float32 (BLAS): a little looser than forward's 1e-5
        @test close_to(res.loss, ref.loss, 1e-4)
        @test close_to(res.lse, ref.lse, 1e-4)
        @test close_to(res.grad_hidden, ref.grad_hidden, 1e-4)
        @test close_to(res.grad_weight, ref.grad_weight, 1e-4)
        if bias === nothing
            @test res.grad_bias === nothing
        else
            @test close_to(res.grad_bias, ref.grad_bias, 1e-4)
        end
    end
    ref = reference_linear(h, W, b, y)
    # the loss alone
    res = linear_ce(h, W, y; bias=b, grad=false)
    @test res.grad_hidden === nothing && res.grad_weight === nothing
    @test close_to(res.loss, ref.loss, 1e-4)
    # the least workspace gives the same loss
    @test close_to(linear_ce(h, W, y; bias=b, workspace=:min).loss, ref.loss, 1e-4)
    # a strided view of hidden
    hp = fill(NaN32, D + 3, Nl)
    hp[1:D, :] .= h
    @test close_to(linear_ce(view(hp, 1:D, :), W, y; bias=b).grad_weight, ref.grad_weight, 1e-4)
    # accumulate into caller-owned gradients; grad_hidden is overwritten
    gh, gw, gb = fill(NaN32, D, Nl), ones(Float32, D, Vl), ones(Float32, Vl)
    linear_ce!(zeros(Float32, 1), h, W, y; bias=b, grad_hidden=gh, grad_weight=gw, grad_bias=gb,
               accumulate=true)
    @test close_to(gh, ref.grad_hidden, 1e-4)
    @test close_to(gw, 1 .+ ref.grad_weight, 1e-4)
    @test close_to(gb, 1 .+ ref.grad_bias, 1e-4)
    # Float16 data, float32 weight gradients
    h16, W16, b16 = Float16.(h), Float16.(W), Float16.(b)
    ref = reference_linear(Float64.(h16), Float64.(W16), Float64.(b16), y)
    res = linear_ce(h16, W16, y; bias=b16, grad_weight_fp32=true)
    @test eltype(res.grad_hidden) == Float16
    @test eltype(res.grad_weight) == Float32 && eltype(res.grad_bias) == Float32
    @test close_to(res.loss, ref.loss, 1e-3)
    @test close_to(res.grad_weight, ref.grad_weight, 1e-2)
    @test close_to(res.grad_hidden, ref.grad_hidden, 1e-2)
    # mistakes the binding catches before C
    @test_throws DimensionMismatch linear_ce(h, W[1:end-1, :], y)
    @test_throws ArgumentError linear_ce(h, W, y; accumulate=true)
    @test_throws ArgumentError linear_ce!(zeros(Float32, 1), h, W, y; grad_bias=zeros(Float32, Vl))
    @test_throws ArgumentError linear_ce(h, Float16.(W), y)
end

@testset "argmax and accuracy by hand" begin
    # the argmax of the scaled logits: a negative scale turns it around; 6 rows are not ignored
    # (the invalid one counts), 3 of them right, or 1
    for (scale, want_pred, want_none) in ((1.0f0, [1, 0, 1, -1, 2, 1, 0], Float32[1, 0, 1, 0, 0, 0, 1]),
                                          (-0.5f0, [3, 0, 1, -1, 0, 0, 1], Float32[0, 0, 1, 0, 0, 0, 0])),
        red in (:mean, :sum, :none)

        res = forward(HAND_Z, HAND_Y; reduction=red, logit_scale=scale, argmax=true,
                      accuracy=true)
        @test res.argmax == want_pred
        if red === :none
            @test res.accuracy == want_none
        else
            @test isapprox(res.accuracy, sum(want_none) / 6; atol=1e-7)
        end
        @test res.error_flags & FCE_FLAG_TARGET_OUT_OF_RANGE != 0
        # the reference above agrees with the hand
        ref = reference(HAND_Z, HAND_Y; reduction=red, logit_scale=scale)
        @test ref.argmax == want_pred
        @test isapprox(ref.accuracy, res.accuracy; atol=1e-7)
        # caller-owned outputs
        pred, acc = fill(typemin(Int64), 7), fill(NaN32, red === :none ? 7 : 1)
        forward!(fill(NaN32, red === :none ? 7 : 1), HAND_Z, HAND_Y; reduction=red,
                 logit_scale=scale, argmax=pred, accuracy=acc)
        @test pred == want_pred
        @test acc == (red === :none ? res.accuracy : [res.accuracy])
    end
    # every row ignored: argmax -1, accuracy 0
    for red in (:mean, :sum, :none)
        res = forward(HAND_Z, fill(-100, 7); reduction=red, argmax=true, accuracy=true)
        @test all(==(-1), res.argmax)
        @test all(iszero, res.accuracy)
    end
end

@testset "token scaling: the unscaled row times p_y" begin
    z, y = make_data(rng, V, N; std=3.0)
    opts = (reduction=:none, label_smoothing=0.1, z_loss_scale=1e-3, logit_scale=0.5)
    plain = forward(z, y; grad=true, argmax=true, opts...)
    scaled = forward(z, y; grad=true, argmax=true, token_scaling=true, opts...)
    want_z = 0.0
    for r in 1:N
        a = 0.5 .* Float64.(z[:, r])
        m = maximum(a)
        l = m + log(sum(exp.(a .- m)))
        # p_y: a constant for the gradient; ignored rows have loss and gradient 0 either way
        p_y = y[r] == -100 ? 0.0 : exp(a[y[r]+1] - l)
        @test isapprox(scaled.loss[r], p_y * plain.loss[r]; rtol=1e-5, atol=1e-7)
        @test close_to(scaled.grad[:, r], p_y .* Float64.(plain.grad[:, r]), 1e-5)
        y[r] == -100 || (want_z += p_y * 1e-3 * l^2)
    end
    @test isapprox(scaled.z_loss, want_z; rtol=1e-5)
    # lse and the predictions do not change
    @test reinterpret(UInt32, scaled.lse) == reinterpret(UInt32, plain.lse)
    @test scaled.argmax == plain.argmax
end

@testset "causal shift by k: slicing by hand" begin
    T = 6                  # N = 24: four sequences
    z, y = make_data(rng, V, N)
    opts = (label_smoothing=0.1, z_loss_scale=1e-3)
    for k in (0, 1, 2, 5), red in (:mean, :sum, :none)
        kk = max(k, 1)     # 0 means 1
        kept = [r for r in 1:N if (r - 1) % T < T - kk]
        dropped = setdiff(1:N, kept)
        shifted = forward(z, y; grad=true, argmax=true, accuracy=true, reduction=red,
                          shift_seq_len=T, shift=k, opts...)
        sliced = forward(z[:, kept], y[kept .+ kk]; grad=true, argmax=true, accuracy=true,
                         reduction=red, opts...)
        unshifted = forward(z, y; reduction=red, opts...)
        ref = reference(z, y; reduction=red, shift_seq_len=T, shift=k, opts...)
        @test close_to(shifted.loss, ref.loss, 1e-5)
        @test close_to(shifted.grad, ref.grad, 1e-5)
        @test shifted.argmax == ref.argmax
        # against the slicing
        if red === :none
            @test close_to(shifted.loss[kept], sliced.loss, 1e-6)
            @test all(iszero, shifted.loss[dropped])
            @test shifted.accuracy[kept] == sliced.accuracy
        else
            @test isapprox(shifted.loss, sliced.loss; rtol=1e-6)
            @test isapprox(shifted.z_loss, sliced.z_loss; rtol=1e-6)
            @test isapprox(shifted.accuracy, sliced.accuracy; atol=1e-7)
        end
        @test close_to(shifted.grad[:, kept], sliced.grad, 1e-6)
        @test all(==(0x00000000), reinterpret(UInt32, shifted.grad[:, dropped]))
        @test shifted.argmax[kept] == sliced.argmax
        @test all(==(-1), shifted.argmax[dropped])
        # lse is written for every row, the shifted-out ones too
        @test reinterpret(UInt32, shifted.lse) == reinterpret(UInt32, unshifted.lse)
    end
end

@testset "mean z-loss over the count of rows, with class weights" begin
    z, y = make_data(rng, V, N; std=5.0)
    λ = 1f-2
    opts = (class_weights=weights, z_loss_scale=λ, label_smoothing=0.1)
    res = forward(z, y; grad=true, grad_output=Float32[1.3], opts...)
    ref = reference(z, y; grad_output=[1.3], opts...)
    @test close_to(res.loss, ref.loss, 1e-5)
    @test close_to(res.grad, ref.grad, 1e-5)
    scored = [r for r in 1:N if y[r] != -100]
    n = length(scored)
    D = sum(Float64(weights[y[r]+1]) for r in scored)
    @test abs(D - n) > 1  # the weights make the two divisors differ
    # z_loss = λ Σ lse² / n, from the library's own lse
    want_z = λ * sum(Float64(res.lse[r])^2 for r in scored) / n
    @test isapprox(res.z_loss, want_z; rtol=1e-5)
    # the loss: the cross-entropy over D (the loss without z-loss) plus that
    plain = forward(z, y; merge(opts, (z_loss_scale=0,))...)
    @test isapprox(res.loss, plain.loss + want_z; rtol=1e-5)
    # the sum has no divisor: Σ ce + λ Σ lse²
    s = forward(z, y; reduction=:sum, opts...)
    plain_s = forward(z, y; reduction=:sum, merge(opts, (z_loss_scale=0,))...)
    @test isapprox(s.loss, plain_s.loss + want_z * n; rtol=1e-5)
end

@testset "linear_ce: argmax, accuracy, token scaling, shift" begin
    D, Vl, Nl, T = 16, 37, 12, 4
    h = randn(rng, Float32, D, Nl)
    W = 0.5f0 .* randn(rng, Float32, D, Vl)
    b = 0.5f0 .* randn(rng, Float32, Vl)
    y = rand(rng, 0:Vl-1, Nl)
    y[3] = -100
    for red in (:mean, :sum, :none)
        opts = (reduction=red, token_scaling=true, z_loss_scale=1e-3, shift_seq_len=T, shift=2)
        g = red === :none ? rand(rng, Float32, Nl) : Float32[0.8]
        ref = reference_linear(h, W, b, y; grad_output=g, opts...)
        res = linear_ce(h, W, y; bias=b, argmax=true, accuracy=true, grad_output=g, opts...)
        @test close_to(res.loss, ref.loss, 1e-4)
        @test isapprox(res.z_loss, ref.z_loss; rtol=1e-4, atol=1e-6)
        @test close_to(res.grad_hidden, ref.grad_hidden, 1e-4)
        @test close_to(res.grad_weight, ref.grad_weight, 1e-4)
        @test close_to(res.grad_bias, ref.grad_bias, 1e-4)
        # the predicted class is a maximum of the Float64 logits (up to the GEMM's rounding),
        # -1 exactly where the row is ignored; the accuracy follows from it
        correct = zeros(Nl)
        for r in 1:Nl
            if ref.argmax[r] == -1
                @test res.argmax[r] == -1
            else
                col = ref.z[:, r]
                @test 0 <= res.argmax[r] < Vl
                @test col[res.argmax[r]+1] >= maximum(col) - 1e-4 * max(abs(maximum(col)), 1)
                correct[r] = res.argmax[r] == y[r + 2] ? 1.0 : 0.0
            end
        end
        n = count(>=(0), ref.argmax)
        @test isapprox(res.accuracy, red === :none ? correct : sum(correct) / n; atol=1e-6)
    end
    # caller-owned outputs, checked before C
    @test_throws DimensionMismatch linear_ce!(zeros(Float32, 1), h, W, y;
                                              argmax=zeros(Int64, Nl + 1))
end

@testset "backward_rescale!" begin
    z, y = make_data(rng, V, N)
    opts = (label_smoothing=0.1, z_loss_scale=1e-3, class_weights=weights)
    ignored = [r for r in 1:N if y[r] == -100]
    # Bitwise what forward writes given g, ignored rows included: +0 there whatever g's sign.
    same_as_forward(got, want) = reinterpret(UInt32, got) == reinterpret(UInt32, want)
    for red in (:mean, :sum),
        extra in ((;), (token_scaling=true,), (shift_seq_len=8, shift=3),
                  (token_scaling=true, shift_seq_len=6, shift=2, softcap=20.0))

        res = forward(z, y; grad=true, reduction=red, opts..., extra...)
        # 1: untouched; 0.75, -1.7: computed again; 2, -0.25, 0: scaled in place
        for g in (1.0f0, 0.75f0, -1.7f0, 2.0f0, -0.25f0, 0.0f0)
            G = copy(res.grad)
            @test backward_rescale!(G, z, y, res.lse, Float32[g]; reduction=red, opts...,
                                    extra...) === G
            want = forward(z, y; grad=true, grad_output=Float32[g], reduction=red, opts...,
                           extra...).grad
            @test same_as_forward(G, want)
            if isempty(extra)
                @test all(==(0x00000000), reinterpret(UInt32, G[:, ignored]))
            end
            if g == 1
                @test reinterpret(UInt32, G) == reinterpret(UInt32, res.grad)
            end
            if g == 0.75f0
                ref = reference(z, y; reduction=red, grad_output=[0.75], opts..., extra...)
                @test close_to(G, ref.grad, 1e-5)
            end
        end
    end
    # exactly 1 writes nothing: what is not a gradient stays as it is
    res = forward(z, y; grad=true, opts...)
    G = fill(NaN32, V, N)
    G[1, 1] = reinterpret(Float32, 0x7f800001)  # a multiplication would quiet it
    bits = copy(reinterpret(UInt32, G))
    backward_rescale!(G, z, y, res.lse, Float32[1]; opts...)
    @test reinterpret(UInt32, G) == bits
    # mistakes the binding catches, and those C reports
    @test_throws DimensionMismatch backward_rescale!(copy(res.grad), z, y, res.lse, Float32[1, 2])
    err = try
        backward_rescale!(copy(res.grad), z, y, res.lse, ones(Float32, N); reduction=:none)
    catch e
        e
    end
    @test err isa FusedCEError
    @test err.status == FCE_ERROR_INVALID_ARGUMENT
    @test occursin("fce_backward_rescale", err.message) && occursin("reduction", err.message)
    zc = copy(z)
    err = try
        backward_rescale!(zc, zc, y, res.lse, Float32[0.5])
    catch e
        e
    end
    @test err isa FusedCEError
    @test err.status == FCE_ERROR_INVALID_ARGUMENT
    @test occursin("fce_backward_rescale", err.message) && occursin("grad_logits", err.message)
    @test zc == z
end

@testset "scale_gradient!" begin
    x = randn(rng, Float32, 7, 5)
    g = copy(x)
    @test scale_gradient!(g, Float32[2.5]) === g
    @test g == x .* 2.5f0
    # exactly 1: not one bit changes (a signalling NaN would be quieted by a multiplication)
    h = copy(x)
    h[3] = reinterpret(Float32, 0x7f800001)
    bits = copy(reinterpret(UInt32, h))
    scale_gradient!(h, Float32[1])
    @test reinterpret(UInt32, h) == bits
    # Float16 and bfloat16: the Float32 product (exact here) rounded once
    xh = Float16.(x)
    gh = copy(xh)
    scale_gradient!(gh, Float32[-0.375])
    @test gh == Float16.(Float32.(xh) .* -0.375f0)
    xb = bfloat16_bits.(x)
    gb = copy(xb)
    scale_gradient!(gb, Float32[2.5])
    @test gb == bfloat16_bits.(bfloat16_float.(xb) .* 2.5f0)
    # a contiguous view: its elements only; empty arrays are fine
    A = ones(Float32, 4, 6)
    scale_gradient!(view(A, :, 2:3), Float32[3])
    @test A[:, 2:3] == fill(3.0f0, 4, 2)
    @test A[:, [1; 4:6]] == ones(Float32, 4, 4)
    @test isempty(scale_gradient!(Float32[], Float32[2]))
    # mistakes the binding catches before C, and one C reports
    @test_throws ArgumentError scale_gradient!(view(A, 1:2, :), Float32[2])  # strided
    @test_throws DimensionMismatch scale_gradient!(A, Float32[1, 2])
    @test_throws ArgumentError scale_gradient!(Float64.(A), Float32[2])
    two = Float32[2]
    err = try
        GC.@preserve A two FusedCE.fce_scale_gradient(FCE_BACKEND_CPU, FusedCE.FCE_INT32, 4,
                                                      pointer(A), pointer(two), C_NULL)
    catch e
        e
    end
    @test err isa FusedCEError
    @test err.status == FCE_ERROR_INVALID_ARGUMENT
    @test occursin("fce_scale_gradient", err.message) && occursin("dtype", err.message)
    @test A[:, 1] == ones(Float32, 4)
end

@testset "zero rows: the empty problem" begin
    z, y = zeros(Float32, V, 0), Int64[]
    for red in (:mean, :sum, :none)
        res = forward(z, y; grad=true, reduction=red, label_smoothing=0.1, z_loss_scale=1e-3)
        @test red === :none ? length(res.loss) == 0 : res.loss == 0
        @test size(res.grad) == (V, 0)
        @test size(backward(z, y, Float32[]; reduction=red)) == (V, 0)
        D = 4
        W = randn(rng, Float32, D, V)
        res = linear_ce(zeros(Float32, D, 0), W, y; bias=ones(Float32, V), reduction=red)
        @test red === :none ? length(res.loss) == 0 : res.loss == 0
        @test size(res.grad_hidden) == (D, 0)
        @test all(iszero, res.grad_weight) && all(iszero, res.grad_bias)
    end
end

@testset "errors" begin
    z, y = make_data(rng, V, N)
    # an option the workspace query (run first, to size the workspace) finds wrong is reported
    # under the call made, never the query's name
    for (call, name) in ((() -> forward(z, y; label_smoothing=1.5), "fce_forward"),
                         (() -> backward(z, y, zeros(Float32, N); label_smoothing=1.5),
                          "fce_backward"),
                         (() -> linear_ce(randn(rng, Float32, 4, N), randn(rng, Float32, 4, V), y;
                                          label_smoothing=1.5), "fce_linear_ce"))
        err = try
            call()
        catch e
            e
        end
        @test err isa FusedCEError
        @test startswith(err.message, name * ": options->label_smoothing (1.5)")
    end
    err = try
        forward(z, y; label_smoothing=1.5)
    catch e
        e
    end
    @test err isa FusedCEError
    @test err.status == FCE_ERROR_INVALID_ARGUMENT
    @test occursin("label_smoothing", err.message)
    @test occursin("FCE_ERROR_INVALID_ARGUMENT", sprint(showerror, err))
    @test_throws FusedCEError forward(z, y; softcap=-1)
    @test_throws FusedCEError forward(z[:, 1:5], y[1:5]; shift_seq_len=2)  # 5 % 2 != 0
    for bad in ((shift=2,), (shift_seq_len=6, shift=-1))  # a shift needs T; k >= 0
        err = try
            forward(z, y; bad...)
        catch e
            e
        end
        @test err isa FusedCEError
        @test err.status == FCE_ERROR_INVALID_ARGUMENT
        @test occursin("shift", err.message)
    end
    @test_throws DimensionMismatch forward!(zeros(Float32, 1), z, y; argmax=zeros(Int64, N - 1))
    @test_throws DimensionMismatch forward!(zeros(Float32, N), z, y; reduction=:none,
                                            accuracy=zeros(Float32, 1))
    @test_throws TypeError forward(z, y; argmax=zeros(Int64, N))  # forward takes a Bool
    @test_throws DimensionMismatch forward(z, y[1:end-1])
    @test_throws ArgumentError forward(z, y; no_such_option=1)
    @test_throws ArgumentError forward(Float64.(z), y)
    @test_throws ArgumentError forward(z, Float32.(y))
    @test_throws ArgumentError forward(z, y; reduction=:median)
    @test_throws ArgumentError forward(z, y; backend=FusedCE.FCE_BACKEND_CUDA)
    @test_throws DimensionMismatch forward!(zeros(Float32, 2), z, y)
end

end # @testset
