# FusedCECUDAExt: CuArrays on fusedce's CUDA backend. Loaded by `using CUDA` next to FusedCE.
#
# The core's wrappers take Ptr arguments (src/libfusedce.jl); a CuArray's device address gets there
# through CUDA.jl's own conversion, Base.unsafe_convert(CuPtr{T}, x), which also records that
# the buffer is used on the task's stream, as any CUDA.jl library call does. The call is enqueued
# on the task's stream, CUDA.stream() (or the `stream` keyword's CuStream, made the task's stream
# for the duration of the call by CUDA.stream!), and returns before the work is done: read the
# results as usual (Array(x), or x[1] for a scalar, synchronise).
module FusedCECUDAExt

using FusedCE
using CUDA

# A CuArray (or a strided view of one, whose storage is a CuArray) runs on the CUDA backend.
FusedCE._storage_backend(::CuArray) = FusedCE.FCE_BACKEND_CUDA

# The device address as the Ptr the wrappers take (the bits of the CuPtr; never dereferenced on
# the host).
function FusedCE._storage_pointer(::CuArray, x::AbstractArray{T}) where {T}
    return reinterpret(Ptr{T}, Base.unsafe_convert(CuPtr{T}, x))
end

# fusedce's `void* stream` is a cudaStream_t, which is CUDA.jl's CUstream handle.
FusedCE._storage_stream(::CuArray) = convert(Ptr{Cvoid}, CUDA.stream().handle)

FusedCE.with_stream(f, s::CuStream) = CUDA.stream!(f, s)

# Stream-ordered free on the task's stream, after the work that uses the workspace.
FusedCE.release_workspace!(ws::CuArray) = CUDA.unsafe_free!(ws)

end # module FusedCECUDAExt
