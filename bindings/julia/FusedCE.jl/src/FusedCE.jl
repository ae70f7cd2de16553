"""
    FusedCE

Julia binding of fusedce: fused cross-entropy kernels for large vocabularies behind a C ABI
(`include/fusedce.h`; the math and its corner cases are `docs/semantics.md`).

    forward(logits, targets; grad=false, options...)   loss, lse, z-loss; the gradient with grad=true,
                                                       predicted classes / accuracy with
                                                       argmax=true / accuracy=true
    backward(logits, targets, lse; options...)         the gradient from the lse forward saved
    backward_rescale!(grad, logits, targets, lse, grad_output)
                                                       forward's gradient for an upstream 1 made
                                                       the gradient for grad_output[1], in place
    linear_ce(hidden, weight, targets; bias, options...)
                                                       z = weightᵀ·hidden .+ bias, cross-entropy and
                                                       the gradients, holding z only piece by piece in the workspace
    scale_gradient!(grad, grad_output)                 grad .*= grad_output[1], in place: the
                                                       upstream gradient, once it is known

and `forward!`, `backward!`, `linear_ce!` writing into arrays the caller owns.

# Layout
Julia is column-major, so one row of the C API is one column here: `logits` is `vocab × rows`,
`hidden` is `hidden_size × rows`, `weight` is `hidden_size × vocab` (a column per class, which is
the C API's row-major `[vocab, hidden]`). A strided view such as `view(padded, 1:vocab, :)` is
passed as is, its column stride becoming `row_stride` (`hidden_row_stride` for `hidden`).

# Data
`logits`, `hidden`, `weight`, `bias`: `Float32`, `Float16`, or bfloat16 as raw `UInt16` bits
(see [`bfloat16_bits`](@ref)) or `BFloat16s.BFloat16` once BFloat16s.jl is loaded. `targets`:
`Int32` or `Int64` holding 0-based class indices, as in C and torch (a row whose target is
`ignore_index`, -100 by default, is skipped). Losses, lse, `grad_output` and class weights are
`Float32`.

# Backends
`Array`s (and strided views of them) run on the CPU backend, synchronously. `CuArray`s run on the
CUDA backend once `using CUDA` has loaded the FusedCECUDAExt extension: asynchronously, on the
task's stream `CUDA.stream()`, or on the `stream` keyword's `CuStream`. Every buffer of a call
must be on the same backend.

# Library
The shared library is `ENV["FUSEDCE_LIBRARY"]` (a path, or a name on the library search path),
else `"libfusedce"`; it is opened the first time a function needs it. Library versions follow the
rule of every fusedce binding (bindings/README.md, "Library versions"): the library's major
version must be that of the header this binding was generated from; an older minor is accepted,
and what it lacks (a function added later, an `fce_options` field appended in 0.3) throws
`FusedCEError(FCE_ERROR_UNSUPPORTED, "<feature>: needs libfusedce >= 0.x; the loaded library
... is 0.y.z")` when asked for; a newer minor is accepted.

# Errors
Every failing status throws [`FusedCEError`](@ref)`(status, message)`, the message being
`fce_last_error()`'s, which names the function and the argument. Sizes and element types the C
API cannot see (array lengths) are checked here first and throw `ArgumentError` or
`DimensionMismatch`.

# Low level
`FusedCE.fce_*` are the C functions one for one, generated from the header into
`src/libfusedce.jl`, with [`FceOptions`](@ref) the C struct `fce_options` and the `FCE_*`
constants; they throw `FusedCEError` too.
"""
module FusedCE

const Libdl = Base.Libc.Libdl

export FusedCEError, FceOptions, build_info, forward, forward!, backward, backward!, backward_rescale!,
       linear_ce, linear_ce!, scale_gradient!

# ------------------------------------------------------------------------------ the library

const _lock = ReentrantLock()
const _loaded = Threads.Atomic{Bool}(false)
const _handle = Ref{Ptr{Cvoid}}(C_NULL)
const _name = Ref{String}("")
const _symbols = Dict{Symbol,Ptr{Cvoid}}()  # written only under _lock before _loaded is set

function __init__()
    _loaded[] = false
    _handle[] = C_NULL
    _name[] = ""
    empty!(_symbols)
    return nothing
end

"""
    library_name() -> String

The library FusedCE opens: `ENV["FUSEDCE_LIBRARY"]` when set, else `"libfusedce"`.
"""
library_name() = get(ENV, "FUSEDCE_LIBRARY", "libfusedce")

function _load_library()
    lock(_lock)
    try
        _loaded[] && return nothing
        name = library_name()
        handle = try
            Libdl.dlopen(name)
        catch err
            error("FusedCE: cannot open the fusedce library \"$name\": $(sprint(showerror, err))\n" *
                  "Build it (`make` at the root of the fusedce repository) and set " *
                  "ENV[\"FUSEDCE_LIBRARY\"] to the path of libfusedce.so before the first call.")
        end
        empty!(_symbols)
        for f in FCE_FUNCTIONS
            ptr = Libdl.dlsym(handle, f; throw_error=false)
            _symbols[f] = ptr === nothing ? C_NULL : ptr
        end
        _handle[] = handle
        _name[] = name
        _loaded[] = true
        # the library against the header the wrappers were generated from
        lib = library_version()
        if lib.major != FCE_VERSION_MAJOR
            _loaded[] = false
            error("FusedCE: $name is fusedce $lib (major $(lib.major)), but this binding was " *
                  "generated from the header of fusedce $HEADER_VERSION (major " *
                  "$FCE_VERSION_MAJOR): the major versions must be equal")
        end
    finally
        unlock(_lock)
    end
    return nothing
end

# The functions appended to the C API after 0.1, with the version that added them (the
# vocabulary-parallel fce_vp_*: 0.4, but for those listed here).
const _SINCE = Dict{Symbol,VersionNumber}(:fce_scale_gradient => v"0.2",
                                          :fce_backward_rescale => v"0.2",
                                          :fce_build_info => v"0.3",
                                          :fce_vp_linear_ce_workspace_size => v"0.5",
                                          :fce_vp_linear_ce => v"0.5")
_since(name::Symbol) = get(_SINCE, name, startswith(String(name), "fce_vp_") ? v"0.4" : v"0.1")

# "<feature>: needs libfusedce >= 0.x; the loaded library ... is 0.y.z" (FCE_ERROR_UNSUPPORTED).
function _needs(what, since::VersionNumber)
    return FusedCEError(FCE_ERROR_UNSUPPORTED,
                        "FusedCE: $what: needs libfusedce >= $(since.major).$(since.minor); the " *
                        "loaded library $(_name[]) is $(library_version())")
end

@noinline function _no_symbol(name::Symbol)
    throw(_needs(name, _since(name)))
end

"""
    libfusedce_symbol(name::Symbol) -> Ptr{Cvoid}

The address of the C function `name`, opening the library on first use: the generated wrappers
in `libfusedce.jl` ccall through it.
"""
@inline function libfusedce_symbol(name::Symbol)
    _loaded[] || _load_library()
    ptr = get(_symbols, name, C_NULL)
    ptr == C_NULL && _no_symbol(name)
    return ptr::Ptr{Cvoid}
end

# ------------------------------------------------------------------------------ errors

"""
    FusedCEError(status, message)

A fusedce call returned `status` (an `FCE_ERROR_*` code, a `Cint`); `message` is what
`fce_last_error()` said on the calling thread, naming the function and the argument.
"""
struct FusedCEError <: Exception
    status::Cint
    message::String
end

function Base.showerror(io::IO, err::FusedCEError)
    print(io, "FusedCEError: ", status_string(err.status))
    isempty(err.message) || print(io, "\n  ", err.message)
    return nothing
end

_string(s::Cstring) = (p = reinterpret(Ptr{UInt8}, s); p == C_NULL ? "" : unsafe_string(p))

"""
    status_string(status) -> String

`fce_status_string(status)`: "FCE_ERROR_NULL_POINTER: a required pointer is NULL".
"""
function status_string(status::Integer)
    try
        return _string(fce_status_string(Cint(status)))
    catch
        return "fce_status $status"
    end
end

"""
    last_error() -> String

`fce_last_error()`: the message of the last failing fusedce call on this thread ("" if none).
"""
last_error() = _string(fce_last_error())

"""
    check_status(status::Cint) -> nothing

Throws `FusedCEError(status, last_error())` unless `status == FCE_SUCCESS`: what every generated
wrapper of a function returning `fce_status` does with the status.
"""
@inline function check_status(status::Cint)
    status == FCE_SUCCESS || _throw_status(status)
    return nothing
end

# No task switch can happen between the failing ccall and this one (no yield point), so the
# message read is the one the failing call left on this thread.
@noinline _throw_status(status::Cint) = throw(FusedCEError(status, last_error()))

# A workspace query (`query`, an fce_*_workspace_size) run by `f` to size the workspace of the
# call `call` this package makes next: its failure thrown as that call's, the message's leading
# "query: " made "call: ". The query checks the options and sizes the call checks, in the
# library's words, but the caller called `call` (through this package), not the query.
function _query_for(f, call::AbstractString, query::AbstractString)
    try
        f()
    catch err
        err isa FusedCEError || rethrow()
        prefix = query * ": "
        startswith(err.message, prefix) || rethrow()
        throw(FusedCEError(err.status, call * ": " * err.message[ncodeunits(prefix)+1:end]))
    end
    return nothing
end

# ------------------------------------------------------------------------------ generated

include("libfusedce.jl")

"""The version of fusedce whose header the wrappers were generated from."""
const HEADER_VERSION = VersionNumber(FCE_VERSION_MAJOR, FCE_VERSION_MINOR, FCE_VERSION_PATCH)

"""
    library_version() -> VersionNumber

The version of the loaded library (`fce_version()`).
"""
function library_version()
    n = Int(fce_version())
    return VersionNumber(n ÷ 10000, (n ÷ 100) % 100, n % 100)
end

"""
    library_path() -> String

The path of the loaded fusedce library (opening it if need be).
"""
function library_path()
    _loaded[] || _load_library()
    return Libdl.dlpath(_handle[])
end

"""
    cuda_available() -> Bool

Whether the library has the CUDA backend and sees a CUDA device (`fce_cuda_available()`).
"""
cuda_available() = fce_cuda_available() != 0

"""
    build_info() -> String

What the loaded library was built with and runs on, one line (`fce_build_info()`): version,
backends, the CPU backend's BLAS.
"""
build_info() = unsafe_string(fce_build_info())

# ------------------------------------------------------------------------------ options

"""
    reduction_code(r) -> Cint

`:mean`, `:sum` or `:none` (or an `FCE_REDUCTION_*` code) as the C enum value.
"""
reduction_code(r::Integer) = Cint(r)
function reduction_code(r::Symbol)
    r === :mean && return FCE_REDUCTION_MEAN
    r === :sum && return FCE_REDUCTION_SUM
    r === :none && return FCE_REDUCTION_NONE
    throw(ArgumentError("reduction must be :mean, :sum or :none, not :$r"))
end

function _fce_options(values::Dict{Symbol,Any})
    base = FCE_OPTIONS_INIT
    args = ntuple(i -> get(values, fieldname(FceOptions, i), getfield(base, i)),
                  fieldcount(FceOptions))
    return FceOptions(args...)
end

"""
    FceOptions(; field = value, ...)

The C struct `fce_options`, starting from `FCE_OPTIONS_INIT` (what `fce_options_default` writes),
with the given fields set: every field of the C struct is a keyword (`class_weights` is then a
`Ptr{Cfloat}`, the outputs `argmax` and `accuracy` a `Ptr{Int64}` and a `Ptr{Cfloat}`;
`reduction` also takes `:mean`, `:sum` or `:none`). For the low-level `fce_*` functions;
`forward`, `backward` and `linear_ce` build it from their keywords and arrays.
"""
function FceOptions(; kwargs...)
    values = Dict{Symbol,Any}()
    for (k, v) in pairs(kwargs)
        k in fieldnames(FceOptions) ||
            throw(ArgumentError("fce_options has no field $k; the fields are " *
                                join(fieldnames(FceOptions), ", ")))
        values[k] = k === :reduction ? reduction_code(v) : v
    end
    return _fce_options(values)
end

"""
The `fce_options` fields the high-level functions take as keywords. `backend`, `dtype`,
`target_dtype` and the strides are read off the arrays (a value given must agree with them;
describe strided memory with a view), `class_weights` is a `Float32` vector of `vocab` weights
on the data's backend, `struct_size` is `sizeof(FceOptions)` (`FCE_OPTIONS_SIZE_V1_0`) and
`vp_entropy` is read by the vocabulary-parallel calls only. `shift` (the k of the causal shift: row b·T+t against target
b·T+t+k, the last k rows of each sequence of `shift_seq_len` T ignored; 0 means 1, and it must
be 0 without `shift_seq_len`) and `token_scaling` (each scored row's loss, z-loss term included,
and gradient times p_y = exp(a_y - lse), a constant for the gradient) and `batch_invariant`
(nonzero: each row's loss for reduction none, lse, entropy, argmax and gradient row bitwise the
same whatever the other rows; docs/semantics.md rule 21). The outputs (`fce_outputs`:
`argmax`, `accuracy`, ...) are not options but output arrays of
[`forward!`](@ref) and [`linear_ce!`](@ref) (`argmax=true`, `accuracy=true` for
[`forward`](@ref) and [`linear_ce`](@ref)).
"""
const OPTION_KEYWORDS = (:class_weights, :ignore_index, :row_stride, :grad_row_stride,
                         :shift_seq_len, :hidden_row_stride, :backend, :dtype, :target_dtype,
                         :reduction, :label_smoothing, :z_loss_scale, :softcap, :logit_scale,
                         :deterministic, :accumulate, :grad_weight_fp32, :shift, :token_scaling,
                         :batch_invariant)

# The options of one call: the caller's keywords, checked, then what the arrays say.
function _options(kw, derived::NamedTuple, dense::NamedTuple, class_weights::Ptr)
    values = Dict{Symbol,Any}()
    for (k, v) in pairs(kw)
        k in OPTION_KEYWORDS ||
            throw(ArgumentError("unknown keyword `$k`; the options are " *
                                join(OPTION_KEYWORDS, ", ")))
        k === :class_weights && continue
        if haskey(derived, k)
            v === nothing && continue
            d = derived[k]
            agrees = v == d || (v == 0 && haskey(dense, k) && d == dense[k])
            agrees || throw(ArgumentError("$k = $v disagrees with the arrays, which give $k = $d " *
                                          "(pass a view of the array to describe its strides)"))
        else
            values[k] = k === :reduction ? reduction_code(v) : v
        end
    end
    for (k, v) in pairs(derived)
        values[k] = v
    end
    values[:class_weights] = class_weights
    return _fce_options(values)
end

# The fce_outputs and fce_gradients of one call from the pointers given (C_NULL: absent).
_outputs(; loss=C_NULL, lse=C_NULL, z_loss=C_NULL, argmax=C_NULL, accuracy=C_NULL,
         error_flags=C_NULL) =
    FceOutputs(sizeof(FceOutputs), Ptr{Cfloat}(loss), Ptr{Cfloat}(lse), Ptr{Cfloat}(z_loss),
               Ptr{Int64}(argmax), Ptr{Cfloat}(accuracy), Ptr{UInt32}(error_flags),
               Ptr{Cfloat}(C_NULL))
_gradients(; grad_output=C_NULL, grad_logits=C_NULL, grad_hidden=C_NULL, grad_weight=C_NULL,
           grad_bias=C_NULL) =
    FceGradients(sizeof(FceGradients), Ptr{Cfloat}(grad_output), Ptr{Cvoid}(grad_logits),
                 Ptr{Cvoid}(grad_hidden), Ptr{Cvoid}(grad_weight), Ptr{Cvoid}(grad_bias),
                 Int32(FCE_FLOAT32), Int32(0), Ptr{Cfloat}(C_NULL), Ptr{Cfloat}(C_NULL))

_reduction(kw) = reduction_code(get(kw, :reduction, :mean))
_flag(kw, key::Symbol) = get(kw, key, false) != 0

# ------------------------------------------------------------------------------ element types

"""
    dtype_code(T) -> Cint

The `fce_dtype` of element type `T`: `Float32`, `Float16`, `UInt16` (raw bfloat16 bits), and
`BFloat16s.BFloat16` once BFloat16s.jl is loaded.
"""
dtype_code(::Type{Float32}) = FCE_FLOAT32
dtype_code(::Type{Float16}) = FCE_FLOAT16
dtype_code(::Type{UInt16}) = FCE_BFLOAT16
dtype_code(::Type{T}) where {T} =
    throw(ArgumentError("fusedce takes Float32, Float16 or bfloat16 (UInt16 bits, or " *
                        "BFloat16s.BFloat16 with BFloat16s.jl loaded) data, not $T"))

"""
    target_dtype_code(T) -> Cint

The `fce_dtype` of a target element type: `Int32` or `Int64`.
"""
target_dtype_code(::Type{Int32}) = FCE_INT32
target_dtype_code(::Type{Int64}) = FCE_INT64
target_dtype_code(::Type{T}) where {T} =
    throw(ArgumentError("targets must be Int32 or Int64 (0-based class indices), not $T"))

"""
    bfloat16_bits(x) -> UInt16

The bfloat16 nearest to `x` (ties to even) as raw bits, for bfloat16 data held in `UInt16`
arrays: `bfloat16_bits.(x)`.
"""
function bfloat16_bits(x::Float32)
    isnan(x) && return 0x7fc0
    u = reinterpret(UInt32, x)
    u += 0x00007fff + ((u >> 16) & 0x00000001)
    return (u >> 16) % UInt16
end
bfloat16_bits(x::Real) = bfloat16_bits(Float32(x))

"""
    bfloat16_float(bits::UInt16) -> Float32

The value of raw bfloat16 bits.
"""
bfloat16_float(bits::UInt16) = reinterpret(Float32, UInt32(bits) << 16)

# ------------------------------------------------------------------------------ memory

# The array that owns the memory of x (x itself, or the parent of a view or reshape).
storage(x::AbstractArray) = (p = parent(x); p === x ? x : storage(p))

# Backend hooks: host Arrays here, CuArrays in ext/FusedCECUDAExt.jl.
_storage_backend(::Array) = FCE_BACKEND_CPU
_storage_backend(s) =
    throw(ArgumentError("FusedCE cannot hand a $(typeof(s)) to fusedce: use an Array (CPU " *
                        "backend), a CuArray (CUDA backend, after `using CUDA`), or a " *
                        "strided view of one"))
_storage_pointer(::Array, x::AbstractArray) = pointer(x)
_storage_stream(::Array) = C_NULL

"""
    array_backend(x) -> Cint

`FCE_BACKEND_CPU` for host arrays, `FCE_BACKEND_CUDA` for CuArrays (with CUDA loaded).
"""
array_backend(x::AbstractArray) = _storage_backend(storage(x))

"""
    buffer_pointer(x) -> Ptr

The address fusedce gets for buffer `x` (`C_NULL` for `nothing`): a host address for an Array,
the device address for a CuArray (`Base.unsafe_convert(CuPtr{T}, x)`, by the extension). Valid
while `x` is preserved (`GC.@preserve`).
"""
buffer_pointer(::Nothing) = C_NULL
buffer_pointer(x::AbstractArray) = _storage_pointer(storage(x), x)

"""
    current_stream(x) -> Ptr{Cvoid}

The stream for a call on `x`'s backend: `C_NULL` on the host (ignored by the CPU backend), the
task's `CUDA.stream()` for CuArrays.
"""
current_stream(x::AbstractArray) = _storage_stream(storage(x))

"""
    with_stream(f, stream)

Runs `f()` with `stream` as the task's stream: `nothing` keeps the current one; the CUDA
extension takes a `CuStream` (`CUDA.stream!`), so that the buffers the call allocates, uses and
frees are all ordered on it.
"""
with_stream(f, ::Nothing) = f()
with_stream(f, s) =
    throw(ArgumentError("stream must be nothing (the task's stream) or, with CUDA loaded, a " *
                        "CuStream; not a $(typeof(s))"))

"""
    release_workspace!(ws)

Returns a workspace this package allocated once the call is enqueued (CuArrays: stream-ordered
`CUDA.unsafe_free!`); host workspaces are left to the GC.
"""
release_workspace!(ws) = nothing

_scalar(x::Array) = x[1]
_scalar(x) = x  # device arrays stay arrays: reading them would synchronise

_backend_name(b) = b == FCE_BACKEND_CPU ? "host memory (CPU backend)" :
                   b == FCE_BACKEND_CUDA ? "CUDA device memory" : "backend $b"

function _check_same_backend(be, buffers::NamedTuple)
    for (name, x) in pairs(buffers)
        x isa AbstractArray || continue
        b = array_backend(x)
        b == be || throw(ArgumentError("$name is in $(_backend_name(b)) but the data is in " *
                                       _backend_name(be)))
    end
    return nothing
end

function _check_vector(x::AbstractVector, name, len::Integer; at_least::Bool=false)
    ok = at_least ? length(x) >= len : length(x) == len
    ok || throw(DimensionMismatch("$name has $(length(x)) elements, expected " *
                                  (at_least ? "at least " : "") * "$len"))
    (length(x) <= 1 || stride(x, 1) == 1) ||
        throw(ArgumentError("$name must be contiguous (stride 1)"))
    return nothing
end

# The C row stride of a matrix whose columns are the C API's rows.
function _row_stride(x::AbstractMatrix, name)
    stride(x, 1) == 1 ||
        throw(ArgumentError("$name must have unit stride along its first dimension (each " *
                            "column is a row of the C API)"))
    return Int64(stride(x, 2))
end

function _check_dense(x::AbstractMatrix, name)
    _row_stride(x, name) == size(x, 1) || size(x, 2) <= 1 ||
        throw(ArgumentError("$name must be dense (a view with a column stride is not)"))
    return nothing
end

# Any number of dimensions: the elements are one contiguous run of memory (column-major).
function _check_contiguous(x::AbstractArray, name)
    expected = 1
    for (n, s) in zip(size(x), strides(x))
        n == 1 || s == expected ||
            throw(ArgumentError("$name must be dense (contiguous memory, not a strided view): " *
                                "scale each contiguous part with its own call"))
        expected *= n
    end
    return nothing
end

function _check_matrix(x::AbstractMatrix, name, dims::Tuple, T::Type)
    size(x) == dims || throw(DimensionMismatch("$name is $(join(size(x), "×")), expected " *
                                               join(dims, "×")))
    eltype(x) == T || throw(ArgumentError("$name has element type $(eltype(x)), expected $T"))
    return nothing
end

# The argmax ([rows] Int64) and accuracy ([1], or [rows] for :none, Float32) outputs of a
# forward call, checked.
function _check_outputs(argmax, accuracy, rows, per_row)
    argmax === nothing || _check_vector(argmax, "argmax", rows)
    accuracy === nothing || _check_vector(accuracy, "accuracy", per_row ? rows : 1)
    return nothing
end

# The fce_outputs of a forward call on these arrays (`nothing`: not written).
_loss_outputs(loss, lse, z_loss, argmax, accuracy, error_flags) =
    _outputs(loss=buffer_pointer(loss), lse=buffer_pointer(lse), z_loss=buffer_pointer(z_loss),
             argmax=buffer_pointer(argmax), accuracy=buffer_pointer(accuracy),
             error_flags=buffer_pointer(error_flags))

function _class_weights(kw, be, vocab)
    cw = get(kw, :class_weights, nothing)
    cw === nothing && return nothing
    cw isa AbstractVector{Float32} ||
        throw(ArgumentError("class_weights must be a Float32 vector (one weight per class), " *
                            "not a $(typeof(cw))"))
    _check_vector(cw, "class_weights", vocab)
    _check_same_backend(be, (class_weights = cw,))
    return cw
end

# A workspace of nbytes (plus room to align it to 16 bytes) on like's backend, unless the
# caller gave one: (workspace, allocated here).
function _workspace(like, given, nbytes::Integer)
    given === nothing || return (given, false)
    nbytes == 0 && return (nothing, false)
    return (similar(like, UInt8, Int(nbytes) + 16), true)
end

# The workspace's 16-byte-aligned address and the bytes from there on.
function _workspace_args(ws)
    ws === nothing && return (C_NULL, Csize_t(0))
    p = buffer_pointer(ws)
    pad = Int((16 - UInt(p) % 16) % 16)
    length(ws) > pad || return (C_NULL, Csize_t(0))
    return (convert(Ptr{Cvoid}, p + pad), Csize_t(length(ws) - pad))
end

# ------------------------------------------------------------------------------ forward

"""
    forward!(loss, logits, targets; lse=nothing, z_loss=nothing, argmax=nothing,
             accuracy=nothing, grad_logits=nothing, grad_output=nothing, error_flags=nothing,
             workspace=nothing, stream=nothing, options...) -> loss

`fce_forward` into caller-owned arrays. `logits` is `vocab × rows` (a strided view is fine),
`targets` `rows` Int32/Int64 class indices (0-based). `loss` gets 1 value (`reduction` `:mean`
or `:sum`) or `rows` values (`:none`); `lse` (`rows`) the log-sum-exp that `backward!` needs;
`z_loss` (1) the z-loss total for logging (for `:mean` divided by the number of non-ignored
rows). `argmax` (`rows` Int64) gets each row's predicted class, 0-based as the targets: the
argmax of its scaled, capped logits (lowest index among equal maxima, a NaN the largest, as
torch.argmax), -1 for ignored rows. `accuracy` (1 Float32 for `:mean`/`:sum`: the fraction of
non-ignored rows whose argmax is the target; `rows` for `:none`: 1 or 0 each, 0 for ignored
rows) is unweighted. With `grad_logits` (the shape and element type of
`logits`, maybe `logits` itself) the gradient of the loss times `grad_output` (1 or `rows`
Float32 values; 1 when `nothing`) is written in the same pass. `error_flags` (a UInt32 the call
ORs `FCE_FLAG_*` bits into: zero it first) reports targets out of range. `workspace`: a UInt8
buffer of at least the queried size + 16; allocated when `nothing`. Options: see
[`OPTION_KEYWORDS`](@ref).
"""
function forward!(loss::AbstractVector{Float32}, logits::AbstractMatrix, targets::AbstractVector;
                  lse::Union{Nothing,AbstractVector{Float32}}=nothing,
                  z_loss::Union{Nothing,AbstractVector{Float32}}=nothing,
                  argmax::Union{Nothing,AbstractVector{Int64}}=nothing,
                  accuracy::Union{Nothing,AbstractVector{Float32}}=nothing,
                  grad_logits::Union{Nothing,AbstractMatrix}=nothing,
                  grad_output::Union{Nothing,AbstractVector{Float32}}=nothing,
                  error_flags::Union{Nothing,AbstractVector{UInt32}}=nothing,
                  workspace::Union{Nothing,AbstractVector{UInt8}}=nothing,
                  stream=nothing, options...)
    return with_stream(stream) do
        vocab, rows = size(logits)
        be = array_backend(logits)
        _check_same_backend(be, (; targets, loss, lse, z_loss, argmax, accuracy, grad_logits,
                                 grad_output, error_flags, workspace))
        per_row = _reduction(options) == FCE_REDUCTION_NONE
        row_stride = _row_stride(logits, "logits")
        _check_vector(targets, "targets", rows)
        _check_vector(loss, "loss", per_row ? rows : 1)
        lse === nothing || _check_vector(lse, "lse", rows)
        z_loss === nothing || _check_vector(z_loss, "z_loss", 1)
        _check_outputs(argmax, accuracy, rows, per_row)
        grad_output === nothing || _check_vector(grad_output, "grad_output", per_row ? rows : 1)
        error_flags === nothing || _check_vector(error_flags, "error_flags", 1; at_least=true)
        grad_logits === nothing ||
            _check_matrix(grad_logits, "grad_logits", size(logits), eltype(logits))
        grad_row_stride = grad_logits === nothing ? Int64(0) :
                          _row_stride(grad_logits, "grad_logits")
        cw = _class_weights(options, be, vocab)
        derived = (backend=be, dtype=dtype_code(eltype(logits)),
                   target_dtype=target_dtype_code(eltype(targets)), row_stride=row_stride,
                   grad_row_stride=grad_row_stride)
        dense = (row_stride=vocab, grad_row_stride=vocab)
        GC.@preserve logits targets loss lse z_loss argmax accuracy grad_logits grad_output error_flags cw begin
            opts = _options(options, derived, dense, buffer_pointer(cw))
            outs = _loss_outputs(loss, lse, z_loss, argmax, accuracy, error_flags)
            grads = _gradients(grad_output=buffer_pointer(grad_output),
                               grad_logits=buffer_pointer(grad_logits))
            nbytes = Ref{Csize_t}(0)
            _query_for("fce_forward", "fce_forward_workspace_size") do
                fce_forward_workspace_size(opts, rows, vocab, nbytes)
            end
            ws, owned = _workspace(logits, workspace, nbytes[])
            GC.@preserve ws begin
                wsp, wsn = _workspace_args(ws)
                fce_forward(opts, rows, vocab, buffer_pointer(logits), buffer_pointer(targets),
                            outs, grads, wsp, wsn, current_stream(logits))
            end
            owned && release_workspace!(ws)
        end
        loss
    end
end

"""
    forward(logits, targets; grad=false, inplace=false, argmax=false, accuracy=false,
            grad_output=nothing, stream=nothing, options...)
        -> (; loss, lse, z_loss, grad, error_flags, argmax, accuracy)

Cross-entropy of `logits` (`vocab × rows`) against `targets` (0-based class indices), with
`fce_forward`. `loss` is a Float32 for `:mean`/`:sum` and a vector for `reduction=:none`;
`lse` the per-row log-sum-exp (for [`backward`](@ref)); `z_loss` the z-loss total;
`error_flags` the `FCE_FLAG_*` bits (`FCE_FLAG_TARGET_OUT_OF_RANGE`: some target was outside
`[0, vocab)` and not `ignore_index`; its row's loss is NaN). With `grad=true`, `grad` is the
gradient of the loss (times `grad_output`) over the logits, written over `logits` itself when
`inplace=true`. With `argmax=true`, `argmax` is each row's predicted class (an Int64 vector,
0-based, -1 for ignored rows); with `accuracy=true`, `accuracy` is the fraction of non-ignored
rows predicted right (a Float32; a vector of 1s and 0s for `:none`); each is `nothing` when
not asked for (see [`forward!`](@ref)). On the CUDA backend the scalars stay 1-element CuArrays
and the call returns before the work is done.

Options (keywords, as in C): `reduction` (`:mean`, `:sum`, `:none`), `ignore_index` (-100),
`label_smoothing`, `z_loss_scale`, `softcap`, `logit_scale`, `class_weights` (a Float32 vector
of `vocab` weights), `shift_seq_len` (causal shift within sequences of that length), `shift`
(by how many positions: 1 by default), `token_scaling`, `deterministic`; see
[`OPTION_KEYWORDS`](@ref).
"""
function forward(logits::AbstractMatrix, targets::AbstractVector; grad::Bool=false,
                 inplace::Bool=false, argmax::Bool=false, accuracy::Bool=false,
                 grad_output=nothing, stream=nothing, options...)
    return with_stream(stream) do
        vocab, rows = size(logits)
        per_row = _reduction(options) == FCE_REDUCTION_NONE
        loss = similar(logits, Float32, per_row ? rows : 1)
        lse = similar(logits, Float32, rows)
        z_loss = similar(logits, Float32, 1)
        error_flags = fill!(similar(logits, UInt32, 1), zero(UInt32))
        grad_logits = !grad ? nothing : inplace ? logits : similar(logits, eltype(logits), vocab, rows)
        pred = argmax ? similar(logits, Int64, rows) : nothing
        acc = accuracy ? similar(logits, Float32, per_row ? rows : 1) : nothing
        forward!(loss, logits, targets; lse=lse, z_loss=z_loss, argmax=pred, accuracy=acc,
                 grad_logits=grad_logits, grad_output=grad_output, error_flags=error_flags,
                 options...)
        (loss=per_row ? loss : _scalar(loss), lse=lse, z_loss=_scalar(z_loss), grad=grad_logits,
         error_flags=_scalar(error_flags), argmax=pred,
         accuracy=acc === nothing || per_row ? acc : _scalar(acc))
    end
end

# ------------------------------------------------------------------------------ backward

"""
    backward!(grad_logits, logits, targets, lse; grad_output=nothing, error_flags=nothing,
              workspace=nothing, stream=nothing, options...) -> grad_logits

`fce_backward`: the gradient over `logits` (written to `grad_logits`, which may be `logits`)
from the `lse` that `forward!` saved with the same options, scaled by `grad_output` (1 or `rows`
Float32 values; 1 when `nothing`). Its p_j = exp(a_j - lse) carry the rounding of the Float32
lse (a relative |lse|·2^-24): `forward!`'s gradient to that rounding, not bit for bit
([`backward_rescale!`](@ref) is).
"""
function backward!(grad_logits::AbstractMatrix, logits::AbstractMatrix, targets::AbstractVector,
                   lse::AbstractVector{Float32};
                   grad_output::Union{Nothing,AbstractVector{Float32}}=nothing,
                   error_flags::Union{Nothing,AbstractVector{UInt32}}=nothing,
                   workspace::Union{Nothing,AbstractVector{UInt8}}=nothing,
                   stream=nothing, options...)
    return _backward!(fce_backward, grad_logits, logits, targets, lse, grad_output, error_flags,
                      workspace, stream, options)
end

"""
    backward_rescale!(grad_logits, logits, targets, lse, grad_output; error_flags=nothing,
                      workspace=nothing, stream=nothing, options...) -> grad_logits

`fce_backward_rescale`: `grad_logits` holds the gradient `forward!` wrote with
`grad_output=nothing` (an upstream 1), and becomes the gradient for the upstream scalar
`grad_output` (a 1-element Float32 vector on the same backend; reductions `:mean` and `:sum`),
bit for bit what `forward!` writes given it: the training path when the upstream gradient is
known only after the forward. `logits`, `targets`, `lse` and the options are the forward's;
`grad_logits` must not be `logits`. Decided on the device (no synchronisation on CUDA): a
scalar of exactly 1 writes nothing, 0 or ±2^k scales `grad_logits` in place (ignored rows stay
+0), anything else computes the gradient again from `logits`, by the computation `forward!`
runs. Neither backward call writes `argmax` or `accuracy`.
"""
function backward_rescale!(grad_logits::AbstractMatrix, logits::AbstractMatrix,
                           targets::AbstractVector, lse::AbstractVector{Float32},
                           grad_output::AbstractVector{Float32};
                           error_flags::Union{Nothing,AbstractVector{UInt32}}=nothing,
                           workspace::Union{Nothing,AbstractVector{UInt8}}=nothing,
                           stream=nothing, options...)
    return _backward!(fce_backward_rescale, grad_logits, logits, targets, lse, grad_output,
                      error_flags, workspace, stream, options)
end

# fce_backward or fce_backward_rescale (`cfunction`: the same arguments) into grad_logits.
function _backward!(cfunction, grad_logits, logits, targets, lse, grad_output, error_flags,
                    workspace, stream, options)
    return with_stream(stream) do
        vocab, rows = size(logits)
        be = array_backend(logits)
        _check_same_backend(be, (; grad_logits, targets, lse, grad_output, error_flags,
                                 workspace))
        per_row = _reduction(options) == FCE_REDUCTION_NONE
        row_stride = _row_stride(logits, "logits")
        _check_matrix(grad_logits, "grad_logits", size(logits), eltype(logits))
        grad_row_stride = _row_stride(grad_logits, "grad_logits")
        _check_vector(targets, "targets", rows)
        _check_vector(lse, "lse", rows)
        grad_output === nothing || _check_vector(grad_output, "grad_output", per_row ? rows : 1)
        error_flags === nothing || _check_vector(error_flags, "error_flags", 1; at_least=true)
        cw = _class_weights(options, be, vocab)
        derived = (backend=be, dtype=dtype_code(eltype(logits)),
                   target_dtype=target_dtype_code(eltype(targets)), row_stride=row_stride,
                   grad_row_stride=grad_row_stride)
        dense = (row_stride=vocab, grad_row_stride=vocab)
        GC.@preserve grad_logits logits targets lse grad_output error_flags cw begin
            opts = _options(options, derived, dense, buffer_pointer(cw))
            nbytes = Ref{Csize_t}(0)
            _query_for(string(nameof(cfunction)), "fce_backward_workspace_size") do
                fce_backward_workspace_size(opts, rows, vocab, nbytes)
            end
            ws, owned = _workspace(logits, workspace, nbytes[])
            GC.@preserve ws begin
                wsp, wsn = _workspace_args(ws)
                outs = _outputs(error_flags=buffer_pointer(error_flags))
                grads = _gradients(grad_output=buffer_pointer(grad_output),
                                   grad_logits=buffer_pointer(grad_logits))
                cfunction(opts, rows, vocab, buffer_pointer(logits), buffer_pointer(targets),
                          buffer_pointer(lse), outs, grads, wsp, wsn, current_stream(logits))
            end
            owned && release_workspace!(ws)
        end
        grad_logits
    end
end

"""
    backward(logits, targets, lse; inplace=false, grad_output=nothing, stream=nothing,
             options...) -> grad

The gradient over `logits` from the `lse` of [`forward`](@ref) with the same options (a new
array, or `logits` itself overwritten when `inplace=true`).
"""
function backward(logits::AbstractMatrix, targets::AbstractVector, lse::AbstractVector{Float32};
                  inplace::Bool=false, grad_output=nothing, stream=nothing, options...)
    return with_stream(stream) do
        vocab, rows = size(logits)
        grad = inplace ? logits : similar(logits, eltype(logits), vocab, rows)
        backward!(grad, logits, targets, lse; grad_output=grad_output, options...)
    end
end

# ------------------------------------------------------------------------------ linear + CE

"""
    linear_ce!(loss, hidden, weight, targets; bias=nothing, lse=nothing, z_loss=nothing,
               argmax=nothing, accuracy=nothing, grad_hidden=nothing, grad_weight=nothing,
               grad_bias=nothing, grad_output=nothing, error_flags=nothing, workspace=nothing,
               stream=nothing, options...) -> loss

`fce_linear_ce`: logits `z = weight' * hidden .+ bias` (never held whole) then cross-entropy.
`hidden` is `hidden_size × rows` (a strided view is fine), `weight` `hidden_size × vocab` dense
(one column per class), `bias` `vocab` or `nothing`. Gradients, each optional: `grad_hidden`
(like `hidden`, dense; overwritten), `grad_weight` (like `weight`) and `grad_bias` (`vocab`,
only with a bias), of the data's element type or Float32 with `grad_weight_fp32=true`,
overwritten or, with `accumulate=true`, added to. With none of them the loss alone is computed.
`lse`, `z_loss`, `argmax`, `accuracy`, `grad_output` and `error_flags` are as for
[`forward!`](@ref).
`workspace`: `nothing` or `:optimal` (allocate the size for full speed), `:min` (the least that
works, same result), or a UInt8 buffer (16 bytes beyond the queried size, for alignment).
"""
function linear_ce!(loss::AbstractVector{Float32}, hidden::AbstractMatrix, weight::AbstractMatrix,
                    targets::AbstractVector;
                    bias::Union{Nothing,AbstractVector}=nothing,
                    lse::Union{Nothing,AbstractVector{Float32}}=nothing,
                    z_loss::Union{Nothing,AbstractVector{Float32}}=nothing,
                    argmax::Union{Nothing,AbstractVector{Int64}}=nothing,
                    accuracy::Union{Nothing,AbstractVector{Float32}}=nothing,
                    grad_hidden::Union{Nothing,AbstractMatrix}=nothing,
                    grad_weight::Union{Nothing,AbstractMatrix}=nothing,
                    grad_bias::Union{Nothing,AbstractVector}=nothing,
                    grad_output::Union{Nothing,AbstractVector{Float32}}=nothing,
                    error_flags::Union{Nothing,AbstractVector{UInt32}}=nothing,
                    workspace::Union{Nothing,Symbol,AbstractVector{UInt8}}=nothing,
                    stream=nothing, options...)
    return with_stream(stream) do
        dim, rows = size(hidden)
        size(weight, 1) == dim ||
            throw(DimensionMismatch("weight is $(size(weight, 1))×$(size(weight, 2)); it must " *
                                    "be hidden_size × vocab = $dim × vocab"))
        vocab = size(weight, 2)
        T = eltype(hidden)
        GW = _flag(options, :grad_weight_fp32) ? Float32 : T
        be = array_backend(hidden)
        given_ws = workspace isa AbstractVector ? workspace : nothing
        workspace isa Symbol && !(workspace in (:min, :optimal)) &&
            throw(ArgumentError("workspace must be :min, :optimal, nothing or a UInt8 buffer"))
        _check_same_backend(be, (; weight, bias, targets, loss, lse, z_loss, argmax, accuracy,
                                 grad_hidden, grad_weight, grad_bias, grad_output, error_flags,
                                 workspace=given_ws))
        per_row = _reduction(options) == FCE_REDUCTION_NONE
        hidden_row_stride = _row_stride(hidden, "hidden")
        _check_matrix(weight, "weight", (dim, vocab), T)
        _check_dense(weight, "weight")
        if bias !== nothing
            _check_vector(bias, "bias", vocab)
            eltype(bias) == T || throw(ArgumentError("bias has element type $(eltype(bias)), " *
                                                     "expected $T"))
        end
        _check_vector(targets, "targets", rows)
        _check_vector(loss, "loss", per_row ? rows : 1)
        lse === nothing || _check_vector(lse, "lse", rows)
        z_loss === nothing || _check_vector(z_loss, "z_loss", 1)
        _check_outputs(argmax, accuracy, rows, per_row)
        grad_output === nothing || _check_vector(grad_output, "grad_output", per_row ? rows : 1)
        error_flags === nothing || _check_vector(error_flags, "error_flags", 1; at_least=true)
        if grad_hidden !== nothing
            _check_matrix(grad_hidden, "grad_hidden", (dim, rows), T)
            _check_dense(grad_hidden, "grad_hidden")
        end
        if grad_weight !== nothing
            _check_matrix(grad_weight, "grad_weight", (dim, vocab), GW)
            _check_dense(grad_weight, "grad_weight")
        end
        if grad_bias !== nothing
            bias === nothing && throw(ArgumentError("grad_bias is only for a call with a bias"))
            _check_vector(grad_bias, "grad_bias", vocab)
            eltype(grad_bias) == GW ||
                throw(ArgumentError("grad_bias has element type $(eltype(grad_bias)), " *
                                    "expected $GW"))
        end
        with_grad = grad_hidden !== nothing || grad_weight !== nothing || grad_bias !== nothing
        cw = _class_weights(options, be, vocab)
        derived = (backend=be, dtype=dtype_code(T), target_dtype=target_dtype_code(eltype(targets)),
                   hidden_row_stride=hidden_row_stride)
        dense = (hidden_row_stride=dim,)
        GC.@preserve hidden weight bias targets loss lse z_loss argmax accuracy grad_hidden grad_weight grad_bias grad_output error_flags cw begin
            opts = _options(options, derived, dense, buffer_pointer(cw))
            outs = _loss_outputs(loss, lse, z_loss, argmax, accuracy, error_flags)
            grads = _gradients(grad_output=buffer_pointer(grad_output),
                               grad_hidden=buffer_pointer(grad_hidden),
                               grad_weight=buffer_pointer(grad_weight),
                               grad_bias=buffer_pointer(grad_bias))
            min_bytes = Ref{Csize_t}(0)
            optimal_bytes = Ref{Csize_t}(0)
            _query_for("fce_linear_ce", "fce_linear_ce_workspace_size") do
                fce_linear_ce_workspace_size(opts, rows, dim, vocab, Cint(with_grad), min_bytes,
                                             optimal_bytes)
            end
            nbytes = workspace === :min ? min_bytes[] : optimal_bytes[]
            ws, owned = _workspace(hidden, given_ws, nbytes)
            GC.@preserve ws begin
                wsp, wsn = _workspace_args(ws)
                fce_linear_ce(opts, rows, dim, vocab, buffer_pointer(hidden),
                              buffer_pointer(weight), buffer_pointer(bias),
                              buffer_pointer(targets), outs, grads, wsp, wsn,
                              current_stream(hidden))
            end
            owned && release_workspace!(ws)
        end
        loss
    end
end

"""
    linear_ce(hidden, weight, targets; bias=nothing, grad=true, argmax=false, accuracy=false,
              grad_output=nothing, stream=nothing, options...)
        -> (; loss, lse, z_loss, grad_hidden, grad_weight, grad_bias, error_flags, argmax,
              accuracy)

Cross-entropy of `z = weight' * hidden .+ bias` against `targets` without materialising `z`
(`fce_linear_ce`): `hidden` is `hidden_size × rows`, `weight` `hidden_size × vocab`. With
`grad=true` (the default) the gradients over `hidden`, `weight` and `bias` (new arrays; Float32
for `weight` and `bias` with `grad_weight_fp32=true`); with `grad=false` the loss only. Results
(`argmax` and `accuracy` included, when asked for) as for [`forward`](@ref); options likewise (`accumulate` needs existing gradients: use
[`linear_ce!`](@ref)).
"""
function linear_ce(hidden::AbstractMatrix, weight::AbstractMatrix, targets::AbstractVector;
                   bias::Union{Nothing,AbstractVector}=nothing, grad::Bool=true,
                   argmax::Bool=false, accuracy::Bool=false, grad_output=nothing,
                   stream=nothing, options...)
    return with_stream(stream) do
        dim, rows = size(hidden)
        vocab = size(weight, 2)
        grad && _flag(options, :accumulate) &&
            throw(ArgumentError("accumulate=true adds into existing gradients: pass them to " *
                                "linear_ce!"))
        T = eltype(hidden)
        GW = _flag(options, :grad_weight_fp32) ? Float32 : T
        per_row = _reduction(options) == FCE_REDUCTION_NONE
        loss = similar(hidden, Float32, per_row ? rows : 1)
        lse = similar(hidden, Float32, rows)
        z_loss = similar(hidden, Float32, 1)
        error_flags = fill!(similar(hidden, UInt32, 1), zero(UInt32))
        grad_hidden = grad ? similar(hidden, T, dim, rows) : nothing
        grad_weight = grad ? similar(weight, GW, dim, vocab) : nothing
        grad_bias = grad && bias !== nothing ? similar(weight, GW, vocab) : nothing
        pred = argmax ? similar(hidden, Int64, rows) : nothing
        acc = accuracy ? similar(hidden, Float32, per_row ? rows : 1) : nothing
        linear_ce!(loss, hidden, weight, targets; bias=bias, lse=lse, z_loss=z_loss,
                   argmax=pred, accuracy=acc, grad_hidden=grad_hidden, grad_weight=grad_weight,
                   grad_bias=grad_bias, grad_output=grad_output, error_flags=error_flags,
                   options...)
        (loss=per_row ? loss : _scalar(loss), lse=lse, z_loss=_scalar(z_loss),
         grad_hidden=grad_hidden, grad_weight=grad_weight, grad_bias=grad_bias,
         error_flags=_scalar(error_flags), argmax=pred,
         accuracy=acc === nothing || per_row ? acc : _scalar(acc))
    end
end

# ------------------------------------------------------------------------------ upstream scale

"""
    scale_gradient!(grad, grad_output; stream=nothing) -> grad

`fce_scale_gradient`: every element of `grad` multiplied by `grad_output[1]`, in place. It
applies an upstream gradient that was not known when the gradient was written without one
(`forward!` or `linear_ce!` with `grad_output=nothing`). `grad` is a dense array of any shape
of Float32, Float16 or bfloat16 (`UInt16` bits, or `BFloat16` with BFloat16s.jl) elements;
`grad_output` a 1-element Float32 vector on the same backend. Each product is computed in
Float32 and rounded once to the element type; a `grad_output` of exactly 1 leaves `grad`
untouched. On the CUDA backend the scalar is read by the device (earlier work on the stream may
write it), and the call returns before the work is done.
"""
function scale_gradient!(grad::AbstractArray, grad_output::AbstractVector{Float32};
                         stream=nothing)
    return with_stream(stream) do
        be = array_backend(grad)
        _check_same_backend(be, (; grad_output))
        _check_vector(grad_output, "grad_output", 1)
        _check_contiguous(grad, "grad")
        dtype = dtype_code(eltype(grad))
        GC.@preserve grad grad_output begin
            fce_scale_gradient(be, dtype, Int64(length(grad)), buffer_pointer(grad),
                               buffer_pointer(grad_output), current_stream(grad))
        end
        grad
    end
end

end # module FusedCE
