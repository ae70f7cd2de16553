"""A small Hugging Face causal LM (Llama, randomly initialised: nothing downloaded) trained under
FSDP2 (``fully_shard``: each decoder layer, lm_head as its own unit, the root) for --steps
steps, once with transformers' own loss (the logits) and once with fusedce.transformers.apply
(the fused linear cross-entropy, lm_head's weight gathered by FSDP2's own hooks), from the same
initial weights on the same batches (each rank its own).

Per variant: the loss curve (the mean over ranks of each step's loss), the time per step (the
slowest rank's; forward, backward and the AdamW step; the median over the steps after the first
two), and the peak memory (torch.cuda.max_memory_allocated over the run, the largest rank's).

    python3 bench/fsdp_train.py                      # 2 GPUs, NCCL: bench/results/fsdp2-<gpu>x2.json
    python3 bench/fsdp_train.py --cpu --steps 2      # smoke test: 2 CPU processes on gloo
Sizes: --hidden --layers --vocab --seq --batch (GPU default 1024, 8, 128256, 4096, 2; bf16
parameters under FSDP2's MixedPrecisionPolicy, float32 gradient reduction); --cpu defaults to a
tiny float32 model. No torchrun: the ranks are spawned here. NCCL's NVLink multicast stays off
(NCCL_NVLS_ENABLE=0).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

VARIANTS = ("transformers", "fusedce")


def _model(args, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.hidden * 4, num_hidden_layers=args.layers,
                      num_attention_heads=max(1, args.hidden // 64),
                      num_key_value_heads=max(1, args.hidden // 256),
                      max_position_embeddings=max(args.seq, 64), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def _shard(model, mesh, cpu):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp_policy = (MixedPrecisionPolicy() if cpu else
                 MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model.lm_head, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def _batches(args, rank):
    gen = torch.Generator().manual_seed(1234 + rank)
    out = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        labels = ids.clone()
        labels[:, : args.seq // 8] = -100  # a prompt: ignored tokens
        out.append((ids, labels))
    return out


def _worker(rank, world, args, init_file, result_file):
    cpu = args.cpu
    if not cpu:
        torch.cuda.set_device(rank)
    dev = torch.device("cpu" if cpu else f"cuda:{rank}")
    dist.init_process_group("gloo" if cpu else "nccl", init_method="file://" + init_file,
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600),
                            **({} if cpu else {"device_id": dev}))
    from torch.distributed.device_mesh import init_device_mesh
    import fusedce.transformers
    mesh = init_device_mesh(dev.type, (world,))
    batches = _batches(args, rank)
    records = []
    for variant in VARIANTS:
        model = _model(args).to(dev)
        if variant == "fusedce":
            fusedce.transformers.apply(model)
        _shard(model, mesh, cpu)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=not cpu)
        if not cpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        losses, times = [], []
        for ids, labels in batches:
            ids, labels = ids.to(dev), labels.to(dev)
            dist.barrier()
            if not cpu:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            out = model(input_ids=ids, labels=labels)
            out.loss.backward()
            opt.step()
            if not cpu:
                torch.cuda.synchronize(dev)
            dt = torch.tensor([(time.perf_counter() - t0) * 1e3], device=dev)
            loss = out.loss.detach().float().reshape(1)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            times.append(float(dt))
            losses.append(float(loss) / world)
            if variant == "fusedce":
                assert out.logits is None, "the fused path"
        peak = None
        if not cpu:
            p = torch.tensor([torch.cuda.max_memory_allocated(dev) / 2**20], device=dev)
            dist.all_reduce(p, op=dist.ReduceOp.MAX)
            peak = float(p)
        timed = times[2:] or times
        records.append(dict(variant=variant, losses=losses, step_ms=times,
                            median_step_ms=statistics.median(timed), peak_mib=peak))
        if rank == 0:
            print(f"{variant}: median step {records[-1]['median_step_ms']:.1f} ms, peak "
                  f"{peak if peak is None else round(peak)} MiB, loss {losses[0]:.4f} -> "
                  f"{losses[-1]:.4f}", flush=True)
        del model, opt, out
        if not cpu:
            torch.cuda.empty_cache()
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(records, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=2, help="ranks (one GPU each; CPU processes "
                    "with --cpu)")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU processes: a smoke test")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--out", default=None, help="also write the result file into this folder "
                    "(with --cpu: only there)")
    args = ap.parse_args()
    defaults = (dict(hidden=64, layers=2, vocab=512, seq=32) if args.cpu else
                dict(hidden=1024, layers=8, vocab=128256, seq=4096))
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not args.cpu and torch.cuda.device_count() < args.gpus:
        sys.exit(f"needs {args.gpus} CUDA devices, found {torch.cuda.device_count()} "
                 "(--cpu for the gloo smoke test)")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.cpu:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "records.json")
        mp.start_processes(_worker, args=(args.gpus, args, os.path.join(tmp, "store"),
                                          result_file),
                           nprocs=args.gpus, join=True, start_method="spawn")
        with open(result_file) as f:
            variants = json.load(f)
    device = ("cpu" if args.cpu else torch.cuda.get_device_name(0).replace(" ", "-"))
    device += f"x{args.gpus}"
    by = {r["variant"]: r for r in variants}
    ref, fused = by["transformers"], by["fusedce"]
    record = dict(
        model=dict(family="llama", hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                   seq=args.seq, batch_per_rank=args.batch,
                   dtype="float32" if args.cpu else "bfloat16 (FSDP2 param_dtype)"),
        ranks=args.gpus, steps=args.steps, lm_head="its own fully_shard unit",
        variants=variants,
        max_abs_loss_diff=max(abs(a - b) for a, b in zip(ref["losses"], fused["losses"])),
        step_speedup=ref["median_step_ms"] / fused["median_step_ms"],
        peak_mib_saved=(None if ref["peak_mib"] is None
                        else ref["peak_mib"] - fused["peak_mib"]))
    run = harness.run_info(ranks=args.gpus, backend="gloo" if args.cpu else "nccl",
                           nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"))
    if not args.cpu:
        harness.write("fsdp2", device, run, [record], [args.out])
        print(f"wrote {harness.result_path('fsdp2', device)}")
    elif args.out:  # the smoke test: never into bench/results
        os.makedirs(args.out, exist_ok=True)
        path = harness.result_path("fsdp2", device, args.out)
        with open(path, "w") as f:
            json.dump(dict(schema=harness.SCHEMA, bench="fsdp2", device=device,
                           date=run["date"], runs=[run], records=[record]), f, indent=1)
        print(f"wrote {path}")
    saved = record["peak_mib_saved"]
    print(f"loss curves: max |diff| {record['max_abs_loss_diff']:.3g}; step time "
          f"{ref['median_step_ms']:.1f} -> {fused['median_step_ms']:.1f} ms "
          f"(x{record['step_speedup']:.2f}); peak memory saved "
          f"{'n/a (CPU)' if saved is None else f'{saved:.0f} MiB'}")


if __name__ == "__main__":
    main()
