"""The cuBLAS reference for dz_gemm.cu (dev/NOTES.md "∂Z made inside the ∂h GEMM"): torch.matmul of the
same ∂h shapes, dZ [M, K] @ W [K, N] in bf16, and the separate CE-pass-sized copy (read the logits
and write ∂Z: 2 · M · K · 2 bytes) it would save, timed with CUDA events (median of 5 after 2)."""
import torch

def ms(fn, reps=5):
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]

torch.manual_seed(0)
print(torch.cuda.get_device_name())
for M, N, K in [(8192, 4096, 128256), (8192, 2304, 256000), (16384, 4096, 32000)]:
    a = (torch.rand(M, K, device="cuda") - 0.5).mul_(8).bfloat16()
    w = (torch.rand(K, N, device="cuda") - 0.5).mul_(0.05).bfloat16()
    t = ms(lambda: a @ w)
    c = torch.empty_like(a)
    tc = ms(lambda: c.copy_(a))
    print(f"{M}x{N}x{K}  cuBLAS {t:.3f} ms ({2 * M * N * K / t / 1e9:.0f} TFLOP/s)  "
          f"copy of the logits {tc:.3f} ms")
    del a, w, c
    torch.cuda.empty_cache()
