# The Julia binding on fusedce's CPU backend, against a small Float64 reference written here from
# shared/SPEC.md and lib/SEMANTICS.md (independent of the library's code). From the repository root:
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
    reference(z, y; options...) -> (; loss, lse, z_loss, grad)

Cross-entropy of `z` (vocab × rows, any reals) against 0-based targets `y`, in Float64, step by
step as SPEC.md and SEMANTICS.md write it.
"""
function reference(z::AbstractMatrix, y::AbstractVector; reduction::Symbol=:mean,
                   ignore_index::Integer=-100, label_smoothing::Real=0, z_loss_scale::Real=0,
                   softcap::Real=0, logit_scale::Real=1, class_weights=nothing,
                   shift_seq_len::Integer=0, grad_output=nothing)
    V, N = size(z)
    w = class_weights === nothing ? ones(V) : Float64.(class_weights)
    Ω = sum(w)
    ε, λ, c, s = Float64(label_smoothing), Float64(z_loss_scale), Float64(softcap),
                 Float64(logit_scale)
    loss = zeros(N)
    lse = zeros(N)
    dloss_da = zeros(V, N)  # ∂loss_r/∂a (rule 9), before the upstream scale k
    da_dz = fill(s, V, N)   # s · (1 − (a/c)²) with softcap, else s
    counted = falses(N)     # rows not ignored (valid or invalid): in the z-loss total
    D = 0.0                 # the mean's denominator (rule 4)
    for r in 1:N
        # rule 1: the row's target
        target = if shift_seq_len > 0
            (r - 1) % shift_seq_len == shift_seq_len - 1 ? nothing : y[r + 1]
        else
            y[r]
        end
        # SPEC steps 1-3: scale, softcap, lse
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
        counted[r] = true
        # rule 3: invalid rows
        if !(0 <= target < V)
            loss[r] = NaN
            dloss_da[:, r] .= NaN
            D += 1
            continue
        end
        t = target + 1
        p = exp.(a .- l)
        # rule 8, then rule 9
        loss[r] = (1 - ε) * w[t] * (l - a[t]) + (ε / V) * sum(w .* (l .- a)) + λ * l^2
        g = (1 - ε) * w[t] .* p
        g[t] -= (1 - ε) * w[t]
        g .+= (ε / V) .* (Ω .* p .- w) .+ (2λ * l) .* p
        dloss_da[:, r] .= g
        D += w[t]
    end
    z_total = λ * sum((lse[r]^2 for r in 1:N if counted[r]); init=0.0)
    # rules 5-7: reduction, upstream scale, z-loss total
    if reduction === :none
        total = loss
        k = grad_output === nothing ? ones(N) : Float64.(grad_output)
    elseif reduction === :sum
        total = sum(loss)
        k = fill(grad_output === nothing ? 1.0 : Float64(grad_output[1]), N)
    else
        total = D == 0 ? 0.0 : sum(loss) / D
        z_total = D == 0 ? 0.0 : z_total / D
        k = fill(D == 0 ? 0.0 : (grad_output === nothing ? 1.0 : Float64(grad_output[1])) / D, N)
    end
    grad = dloss_da .* permutedims(k) .* da_dz
    return (loss=total, lse=lse, z_loss=z_total, grad=grad)
end

"""The reference of fce_linear_ce: z = weight' * hidden .+ bias, then `reference`."""
function reference_linear(h, W, b, y; options...)
    z = permutedims(Float64.(W)) * Float64.(h)
    b === nothing || (z = z .+ Float64.(b))
    r = reference(z, y; options...)
    return (loss=r.loss, lse=r.lse, z_loss=r.z_loss, grad_hidden=Float64.(W) * r.grad,
            grad_weight=Float64.(h) * permutedims(r.grad), grad_bias=vec(sum(r.grad; dims=2)))
end

close_to(a, b, rtol) = isapprox(Float64.(a), Float64.(b); rtol=rtol)

# Logits with a realistic spread (SPEC: standard deviation 1-30), targets with ignored rows.
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
]

@testset "FusedCE.jl on the CPU backend" begin

@testset "library, header and options" begin
    @test FusedCE.library_version().major == FusedCE.HEADER_VERSION.major
    @test isfile(FusedCE.library_path())
    @test FusedCE.cuda_available() isa Bool
    @test sizeof(FceOptions) >= FusedCE.FCE_OPTIONS_SIZE_V0_1
    # fce_options_default writes exactly FCE_OPTIONS_INIT over a struct of junk
    junk = FceOptions(; ignore_index=7, row_stride=7, shift_seq_len=3, backend=1, dtype=2,
                      reduction=:none, label_smoothing=0.5, softcap=2, logit_scale=3,
                      deterministic=1, accumulate=1)
    r = Ref(junk)
    FusedCE.fce_options_default(r)
    @test r[] == FCE_OPTIONS_INIT
    @test FceOptions() == FCE_OPTIONS_INIT
    @test FceOptions(reduction=:sum).reduction == FusedCE.FCE_REDUCTION_SUM
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
    res = forward(z, y; grad=true, reduction=red, opts...)
    @test res.loss isa (red === :none ? Vector{Float32} : Float32)
    @test close_to(res.loss, ref.loss, 1e-5)
    @test close_to(res.lse, ref.lse, 1e-5)
    @test isapprox(res.z_loss, ref.z_loss; rtol=1e-5, atol=1e-6)
    @test close_to(res.grad, ref.grad, 1e-5)
    @test res.error_flags == 0
    # backward: the same gradient from the saved lse
    g = backward(z, y, res.lse; reduction=red, opts...)
    @test close_to(g, res.grad, 1e-6)
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

@testset "backward_rescale!" begin
    z, y = make_data(rng, V, N)
    opts = (label_smoothing=0.1, z_loss_scale=1e-3, class_weights=weights)
    ignored = [r for r in 1:N if y[r] == -100]
    scored = setdiff(1:N, ignored)
    # Bitwise what forward writes given g; ignored rows 0 of either sign (scaling in place turns
    # the +0 there into -0 for a negative g).
    same_as_forward(got, want) =
        reinterpret(UInt32, got[:, scored]) == reinterpret(UInt32, want[:, scored]) &&
        all(iszero, got[:, ignored]) && all(iszero, want[:, ignored])
    for red in (:mean, :sum)
        res = forward(z, y; grad=true, reduction=red, opts...)
        # 1: untouched; 0.75, -1.7: computed again; 2, -0.25, 0: scaled in place
        for g in (1.0f0, 0.75f0, -1.7f0, 2.0f0, -0.25f0, 0.0f0)
            G = copy(res.grad)
            @test backward_rescale!(G, z, y, res.lse, Float32[g]; reduction=red, opts...) === G
            want = forward(z, y; grad=true, grad_output=Float32[g], reduction=red, opts...).grad
            @test same_as_forward(G, want)
            if g == 1
                @test reinterpret(UInt32, G) == reinterpret(UInt32, res.grad)
            end
            if g == 0.75f0
                ref = reference(z, y; reduction=red, grad_output=[0.75], opts...)
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

@testset "errors" begin
    z, y = make_data(rng, V, N)
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
    @test_throws DimensionMismatch forward(z, y[1:end-1])
    @test_throws ArgumentError forward(z, y; no_such_option=1)
    @test_throws ArgumentError forward(Float64.(z), y)
    @test_throws ArgumentError forward(z, Float32.(y))
    @test_throws ArgumentError forward(z, y; reduction=:median)
    @test_throws ArgumentError forward(z, y; backend=FusedCE.FCE_BACKEND_CUDA)
    @test_throws DimensionMismatch forward!(zeros(Float32, 2), z, y)
end

end # @testset
