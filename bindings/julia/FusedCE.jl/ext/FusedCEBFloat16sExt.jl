# FusedCEBFloat16sExt: BFloat16s.BFloat16 arrays (host or CuArray) are fusedce's FCE_BFLOAT16.
# Loaded by `using BFloat16s` next to FusedCE. Without it, bfloat16 data is passed as UInt16 bits.
module FusedCEBFloat16sExt

using FusedCE
using BFloat16s: BFloat16

FusedCE.dtype_code(::Type{BFloat16}) = FusedCE.FCE_BFLOAT16

end # module FusedCEBFloat16sExt
