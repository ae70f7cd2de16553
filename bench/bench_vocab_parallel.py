"""Vocabulary-parallel linear CE over P GPUs, one process per GPU on NCCL: time and parallel
efficiency against the same problem on one GPU, with a Megatron-style torch peer, and a
correctness check of every configuration against the unsharded call.

Per shape (N, D, V; bf16; default 16384x4096x128256 and 16384x4096x256000):
  * t1: fusedce.torch.linear_cross_entropy(h, W, y) loss + backward on ONE GPU (rank 0, the
    other ranks idle at a barrier), the torch layer's default 1 GiB budget;
  * tP: fusedce.torch.distributed.vocab_parallel_linear_cross_entropy(h, W_r, y) loss +
    backward on every rank at once (W_r: rank r's V/P rows; the statistics all-gathers and the
    float32 ∂h all-reduce included), each iteration's time the slowest rank's: with libfusedce
    >= 0.5 the one-call fce_vp_linear_ce (the logits made once); "two_phase" the same call
    with that withheld (fce_vp_linear_stats + fce_vp_linear_backward, the logits made twice);
  * megatron: the same sharded step as Megatron-LM writes it in torch: logits_r = h·W_rᵀ (bf16,
    cuBLAS) made float32, the max / target-logit / Σexp all-reduces and a float32 softmax kept
    for the backward (its _VocabParallelCrossEntropy), ∂h all-reduced in the linear's backward;
  * efficiency = t1 / (P · tP) (the aim: ≥ 0.90).
Correctness (before the timings, every rank): the loss equals the unsharded one within float32
rounding, ∂h and the rank's slice of ∂W within the dtype's rounding (max |diff| / max |ref|).

Timing: CUDA events; rounds of t1, tP and two-phase in turns (2 warm-up rounds, then --iters),
then megatron's rounds alone, a barrier before each step; per step the median over rounds of the
slowest rank's ms (all_reduce MAX). Memory: torch.cuda.max_memory_allocated
of one step beyond the inputs (measured with no gradient held) and beyond the gradients it
returns (∂h and the rank's ∂W_r, subtracted), rank 0's.

    python3 bench/bench_vocab_parallel.py [--gpus 2] [--shapes 16384x4096x128256,...] [--out DIR]
    python3 bench/bench_vocab_parallel.py --backend gloo --gpus 2 --shapes 64x32x1000 --iters 2
        (the same on CPU processes and the library's CPU backend: a smoke test of the script)
Writes bench/results/vocab-parallel-<device>x<P>.json (and DIR/; the gloo smoke test only to
DIR/); bench/tables.py --op vp prints its table. NCCL's NVLink multicast stays off
(NCCL_NVLS_ENABLE=0): it can take a shared machine's GPUs out of service.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import harness

SHAPES = "16384x4096x128256,16384x4096x256000"


# ---------------------------------------------------------------- the Megatron peer ----
class _CopyToTP(torch.autograd.Function):
    """Megatron's copy_to_tensor_model_parallel_region: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _MegatronVocabParallelCE(torch.autograd.Function):
    """Megatron-LM's _VocabParallelCrossEntropy (tensor_parallel/cross_entropy.py), written out:
    three all-reduces and a float32 softmax [N, V/P] saved for the backward."""

    @staticmethod
    def forward(ctx, logits, target, vstart, group):
        logits_max = logits.max(dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits = logits - logits_max.unsqueeze(-1)
        vl = logits.shape[-1]
        mask = (target < vstart) | (target >= vstart + vl)
        masked = (target - vstart).masked_fill(mask, 0)
        rows = torch.arange(logits.shape[0], device=logits.device)
        predicted = logits[rows, masked].masked_fill(mask, 0.0)
        dist.all_reduce(predicted, group=group)
        exp_logits = logits.exp_()
        sum_exp = exp_logits.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = torch.log(sum_exp) - predicted
        exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp_logits, mask, masked)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, mask, masked = ctx.saved_tensors
        grad = softmax
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, masked] -= 1.0 - mask.float()
        grad.mul_(g.unsqueeze(-1))
        return grad, None, None, None


def megatron_step(h, w_r, y, vstart, group):
    x = _CopyToTP.apply(h, group)
    logits = F.linear(x, w_r).float()
    return _MegatronVocabParallelCE.apply(logits, y, vstart, group).mean()


# ------------------------------------------------------------------------ the ranks ----
def _ms(step, dev):
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b)
    t0 = datetime.datetime.now()
    step()
    return (datetime.datetime.now() - t0).total_seconds() * 1e3


def _time_interleaved(steps, dev, iters, group, rank):
    """steps: (name, fn, rank0_only). Rounds of every step once, in turn (so that the GPUs'
    clocks and temperature drift alike for all), a barrier before each; per step the median
    over rounds (after 2 warm-up rounds) of the slowest rank's ms (a rank0_only step: rank 0's,
    the other ranks idle at the barrier)."""
    out = {name: [] for name, _, _ in steps}
    for i in range(2 + iters):
        for name, step, rank0_only in steps:
            dist.barrier(group=group)
            ms = _ms(step, dev) if (rank == 0 or not rank0_only) else 0.0
            t = torch.tensor([ms], dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            if i >= 2:
                out[name].append(float(t.item()))
    return {name: statistics.median(v) for name, v in out.items()}


def _peak_extra_mib(step, dev, base, grads):
    """Peak bytes of one step beyond ``base`` (the inputs, no gradient held) and beyond the
    gradients the step returns (``grads()``: the tensors, sized after the step)."""
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    step()
    torch.cuda.synchronize()
    returned = sum(g.numel() * g.element_size() for g in grads() if g is not None)
    return (torch.cuda.max_memory_allocated(dev) - base - returned) / 2**20


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _worker(rank, world, backend, init_file, shapes, iters, result_file):
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        dev = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    group = dist.group.WORLD
    import fusedce.torch as ft
    from fusedce import _lib as fusedce_lib
    from fusedce.torch.distributed import vocab_parallel_linear_cross_entropy
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    records = []
    for N, D, V in shapes:
        assert V % world == 0, f"V = {V} must split evenly over {world} ranks"
        vl = V // world
        g = torch.Generator(device=dev).manual_seed(1234)  # the same tensors on every rank
        h = (torch.randn(N, D, device=dev, generator=g) * 0.5).to(dt)
        W = (torch.randn(V, D, device=dev, generator=g) * 0.02).to(dt)
        y = torch.randint(0, V, (N,), device=dev, generator=g)
        W_r = W[rank * vl:(rank + 1) * vl].clone()
        hl = h.clone().requires_grad_()
        Wl = W.clone().requires_grad_()
        Wrl = W_r.clone().requires_grad_()

        def unsharded():
            hl.grad = None
            Wl.grad = None
            loss = ft.linear_cross_entropy(hl, Wl, y)
            loss.backward()
            return loss

        def sharded():
            hl.grad = None
            Wrl.grad = None
            loss = vocab_parallel_linear_cross_entropy(hl, Wrl, y, group=group)
            loss.backward()
            return loss

        def two_phase():  # the same call with the fused step withheld (the 0.4 path)
            had = fusedce_lib.has_vp_linear_ce
            fusedce_lib.has_vp_linear_ce = lambda: False
            try:
                return sharded()
            finally:
                fusedce_lib.has_vp_linear_ce = had

        def megatron():
            hl.grad = None
            Wrl.grad = None
            loss = megatron_step(hl, Wrl, y, rank * vl, group)
            loss.backward()
            return loss

        # correctness, every rank against its own unsharded call
        ref_loss = unsharded().detach()
        ref_dh, ref_dw = hl.grad.clone(), Wl.grad[rank * vl:(rank + 1) * vl].clone()
        errs = {}
        for name, fn in (("fusedce-vp", sharded), ("fusedce-vp-two-phase", two_phase),
                         ("megatron-torch", megatron)):
            loss = fn().detach()
            e = torch.tensor([abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                              _rel(hl.grad, ref_dh), _rel(Wrl.grad, ref_dw)],
                             dtype=torch.float64, device=dev)
            dist.all_reduce(e, op=dist.ReduceOp.MAX, group=group)
            # within float32 rounding for the loss, the dtype's for the gradients
            tol = 2.0 ** -7 if dt == torch.bfloat16 else 1e-5
            errs[name] = {"loss_rel": e[0].item(), "grad_hidden_rel": e[1].item(),
                          "grad_weight_rel": e[2].item(),
                          "ok": bool(e[0].item() <= 1e-5 and e[1].item() <= tol and e[2].item() <= tol)}
        del ref_dh, ref_dw
        Wl.grad = None
        hl.grad = None
        Wrl.grad = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        # t1 (one GPU alone: rank 0, the others wait at the barrier) and fusedce's sharded
        # steps, in turns; then the Megatron peer on its own (its many-GiB float32 buffers
        # would leave torch's allocator re-allocating for the others); then the peak memory of
        # each sharded step on its own (Wl, the one-GPU weight copy, dropped first)
        ms = _time_interleaved([("t1", unsharded, True), ("vp", sharded, False),
                                ("two_phase", two_phase, False)], dev, iters, group, rank)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        ms.update(_time_interleaved([("megatron", megatron, False)], dev, iters, group, rank))
        t1, tp, t2p, tm = ms["t1"], ms["vp"], ms["two_phase"], ms["megatron"]
        del Wl
        hl.grad = None
        Wrl.grad = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(dev)
        else:
            base = 0
        grads = lambda: (hl.grad, Wrl.grad)  # noqa: E731
        mem_vp = _peak_extra_mib(sharded, dev, base, grads)
        mem_2p = _peak_extra_mib(two_phase, dev, base, grads)
        mem_meg = _peak_extra_mib(megatron, dev, base, grads)
        if rank == 0:
            rec = {"N": N, "D": D, "V": V, "dtype": str(dt).replace("torch.", ""),
                   "ranks": world, "t1_ms": t1, "fusedce_vp_ms": tp,
                   "fusedce_vp_two_phase_ms": t2p, "megatron_torch_ms": tm,
                   "efficiency": t1 / (world * tp),
                   "two_phase_efficiency": t1 / (world * t2p),
                   "megatron_efficiency": t1 / (world * tm),
                   "extra_mib_rank0": {"fusedce-vp": mem_vp, "fusedce-vp-two-phase": mem_2p,
                                       "megatron-torch": mem_meg},
                   "check": errs}
            records.append(rec)
            print(json.dumps(rec), flush=True)
        del h, W, y, W_r, hl, Wrl
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(records, f)
    dist.barrier(group=group)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2, help="ranks (one GPU each with nccl)")
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.backend == "nccl" and torch.cuda.device_count() < args.gpus:
        sys.exit(f"needs {args.gpus} CUDA devices, found {torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "records.json")
        mp.start_processes(_worker, args=(args.gpus, args.backend, os.path.join(tmp, "store"),
                                          shapes, args.iters, result_file),
                           nprocs=args.gpus, join=True, start_method="spawn")
        with open(result_file) as f:
            records = json.load(f)
    device = (torch.cuda.get_device_name(0).replace(" ", "-") if args.backend == "nccl"
              else "cpu") + f"x{args.gpus}"
    run = harness.run_info(ranks=args.gpus, backend=args.backend,
                           nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"))
    if args.backend == "nccl":
        harness.write("vocab-parallel", device, run, records, [args.out])
        print(f"wrote {harness.result_path('vocab-parallel', device)}")
    elif args.out:  # the smoke test: never into bench/results
        os.makedirs(args.out, exist_ok=True)
        with open(harness.result_path("vocab-parallel", device, args.out), "w") as f:
            json.dump(dict(schema=harness.SCHEMA, bench="vocab-parallel", device=device,
                           date=run["date"], runs=[run], records=records), f, indent=1)
    for r in records:
        print(f"{r['N']}x{r['D']}x{r['V']}: 1 GPU {r['t1_ms']:.2f} ms, {args.gpus} ranks "
              f"{r['fusedce_vp_ms']:.2f} ms (efficiency {r['efficiency']:.3f}), two-phase "
              f"{r['fusedce_vp_two_phase_ms']:.2f} ms ({r['two_phase_efficiency']:.3f}), megatron-torch "
              f"{r['megatron_torch_ms']:.2f} ms ({r['megatron_efficiency']:.3f}); check "
              + ", ".join(f"{k} {'ok' if v['ok'] else 'FAILED ' + str(v)}" for k, v in r["check"].items()))
    if not all(v["ok"] for r in records for v in r["check"].values()):
        sys.exit("a sharded result differs from the unsharded call beyond rounding")


if __name__ == "__main__":
    main()
