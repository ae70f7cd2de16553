"""bench/bench_heads.py: the RL and distillation heads through torch on one GPU, bf16, loss +
.backward(): what each output of docs/semantics.md rules 18-20 costs over the plain loss of the
same call (time, and memory beyond the inputs and the gradients returned), and the distillation
losses against their floor and against torch eager.

  cross-entropy over logits [N, V]:
    plain            cross_entropy(z, y)
    lse              loss + 1e-4 · mean(lse²) (the lse's gradient flows: CCE's z-loss use)
    entropy          loss − 0.01 · mean(H) (an entropy bonus)
    policy           reduction "none": −mean(A · log p_y) − 0.01 · mean(H), per-token (RL)
    soft             probability targets q [N, V] (rule 19)
    batch invariant  plain with batch_invariant=True (rule 21)
    policy, batch invariant   policy with batch_invariant=True (a sampler's log-probs and the
                     trainer's, bit for bit)
    torch policy     the same policy loss in torch eager (log_softmax, Categorical entropy)
  linear cross-entropy over hidden [N, D] and weight [V, D]: plain, entropy, policy, batch
    invariant (plain with batch_invariant=True).
  distillation over logits [N, V]: forward KL and JSD(β = 0.5) against torch eager's F.kl_div.
  linear distillation (student [N, D] · [V, D], teacher [N, Dt] · [V, Dt]): forward KL and JSD
    against their floor, 6·N·D·V + 2·N·Dt·V FLOPs at the GEMM rate measured in the run, the
    vocabulary-parallel call on one rank (its backward makes both logits again), and torch
    eager (both logits whole).
  vocabulary-parallel over logits [N, V] on one rank (fusedce.torch.distributed without a
    process group: fce_vp_stats, fce_vp_loss, fce_vp_backward), reduction "none" with an
    upstream per token: plain, batch invariant (rule 21: the exact statistics, the same bits
    on any number of shards), and the one-GPU cross_entropy beside them.

Writes bench/results/<name>-<GPU>.json (--name, default heads; --out for another place)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_torch  # noqa: E402
import harness  # noqa: E402

CE_SHAPES = [(16384, 128256), (8192, 256000), (32768, 32000), (4096, 50257)]
LIN_SHAPES = [(8192, 4096, 128256)]
DISTILL_SHAPES = [(8192, 128256)]
VP_SHAPES = [(16384, 128256), (8192, 256000), (4096, 50257)]
LIN_DISTILL_SHAPES = [(8192, 4096, 4096, 128256)]  # N, D (student), Dt (teacher), V


def ce_variants(N, V, gen):
    import torch
    import torch.nn.functional as F

    import fusedce.torch as fce
    z = (torch.randn(N, V, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    z.requires_grad_(True)
    y = bench_torch.targets(N, V, gen)
    adv = torch.randn(N, device="cuda", generator=gen)
    q = torch.softmax(torch.randn(N, V, device="cuda", generator=gen), -1).to(torch.bfloat16)

    def plain():
        return fce.cross_entropy(z, y)

    def lse():
        loss, s = fce.cross_entropy(z, y, return_lse=True)
        return loss + 1e-4 * s.pow(2).mean()

    def entropy():
        loss, h = fce.cross_entropy(z, y, return_entropy=True)
        return loss - 0.01 * h.mean()

    def policy():
        nll, h = fce.cross_entropy(z, y, reduction="none", return_entropy=True)
        return (adv * nll).mean() - 0.01 * h.mean()

    def soft():
        return fce.cross_entropy(z, q)

    def invariant():
        return fce.cross_entropy(z, y, batch_invariant=True)

    def policy_invariant():
        nll, h = fce.cross_entropy(z, y, reduction="none", return_entropy=True,
                                   batch_invariant=True)
        return (adv * nll).mean() - 0.01 * h.mean()

    def torch_policy():
        logp = F.log_softmax(z.float(), -1)
        lp_y = logp.gather(1, y.clamp(min=0)[:, None])[:, 0] * (y != bench_torch.IGNORE)
        h = torch.distributions.Categorical(logits=z.float()).entropy()
        return -(adv * lp_y).mean() - 0.01 * h.mean()

    return [z], {"plain": plain, "lse": lse, "entropy": entropy, "policy": policy,
                 "soft": soft, "batch invariant": invariant,
                 "policy, batch invariant": policy_invariant, "torch policy": torch_policy}


def linear_variants(N, D, V, gen):
    import torch

    import fusedce.torch as fce
    h = (torch.randn(N, D, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    w = (torch.randn(V, D, device="cuda", generator=gen) * D ** -0.5).to(torch.bfloat16)
    h.requires_grad_(True)
    w.requires_grad_(True)
    y = bench_torch.targets(N, V, gen)
    adv = torch.randn(N, device="cuda", generator=gen)

    def plain():
        return fce.linear_cross_entropy(h, w, y)

    def entropy():
        loss, e = fce.linear_cross_entropy(h, w, y, return_entropy=True)
        return loss - 0.01 * e.mean()

    def policy():
        nll, e = fce.linear_cross_entropy(h, w, y, reduction="none", return_entropy=True)
        return (adv * nll).mean() - 0.01 * e.mean()

    def invariant():
        return fce.linear_cross_entropy(h, w, y, batch_invariant=True)

    return [h, w], {"plain": plain, "entropy": entropy, "policy": policy,
                    "batch invariant": invariant}


def distill_variants(N, V, gen):
    import torch
    import torch.nn.functional as F

    import fusedce.torch as fce
    s = (torch.randn(N, V, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    t = (torch.randn(N, V, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    s.requires_grad_(True)

    def kl():
        return fce.distill(s, t, divergence="forward_kl")

    def jsd():
        return fce.distill(s, t, divergence="jsd", beta=0.5)

    def torch_kl():
        return F.kl_div(F.log_softmax(s.float(), -1), F.log_softmax(t.float(), -1),
                        log_target=True, reduction="batchmean")

    return [s], {"forward KL": kl, "JSD": jsd, "torch forward KL": torch_kl}


def linear_distill_variants(N, D, Dt, V, gen):
    import torch
    import torch.nn.functional as F

    import fusedce.torch as fce
    from fusedce.torch.distributed import vocab_parallel_linear_distill
    h = (torch.randn(N, D, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    w = (torch.randn(V, D, device="cuda", generator=gen) * D ** -0.5).to(torch.bfloat16)
    ht = (torch.randn(N, Dt, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    wt = (torch.randn(V, Dt, device="cuda", generator=gen) * Dt ** -0.5).to(torch.bfloat16)
    h.requires_grad_(True)
    w.requires_grad_(True)

    def kl():
        return fce.linear_distill(h, w, ht, wt, divergence="forward_kl")

    def jsd():
        return fce.linear_distill(h, w, ht, wt, divergence="jsd", beta=0.5)

    def vp_kl():  # the vocabulary-parallel call on one rank (no process group)
        return vocab_parallel_linear_distill(h, w, ht, wt, divergence="forward_kl")

    def vp_jsd():
        return vocab_parallel_linear_distill(h, w, ht, wt, divergence="jsd", beta=0.5)

    def torch_kl():
        with torch.no_grad():
            log_q = F.log_softmax((ht @ wt.T).float(), -1)
        return F.kl_div(F.log_softmax((h @ w.T).float(), -1), log_q, log_target=True,
                        reduction="batchmean")

    return [h, w], {"forward KL": kl, "JSD": jsd, "vp forward KL, one rank": vp_kl,
                    "vp JSD, one rank": vp_jsd, "torch forward KL": torch_kl}


def vp_variants(N, V, gen):
    import torch

    import fusedce.torch as fce
    from fusedce.torch.distributed import vocab_parallel_cross_entropy
    z = (torch.randn(N, V, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    z.requires_grad_(True)
    y = bench_torch.targets(N, V, gen)
    adv = torch.randn(N, device="cuda", generator=gen)

    def plain():
        return (adv * vocab_parallel_cross_entropy(z, y)).mean()

    def invariant():
        return (adv * vocab_parallel_cross_entropy(z, y, batch_invariant=True)).mean()

    def one_gpu():
        return (adv * fce.cross_entropy(z, y, reduction="none")).mean()

    return [z], {"vp plain": plain, "vp batch invariant": invariant,
                 "one-GPU cross_entropy": one_gpu}


def run_group(section, shape, make, records, slow=False, floor_ms=None):
    import torch
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    leaves, variants = make(*shape, gen)
    base = None
    for name, fn in variants.items():
        rec = {"section": section, "shape": "x".join(map(str, shape)), "variant": name,
               "impl": "torch-eager" if name.startswith("torch") else "fusedce"}
        try:
            r = bench_torch.measure(bench_torch.step_of(fn, leaves, ()), leaves, slow, 5)
            rec.update(ms=round(r["ms"], 4), extra_mib=round(r["extra_mib"], 1))
            if base is None:
                base = r["ms"]
            rec["x_first"] = round(r["ms"] / base, 3)
            if floor_ms:
                rec["x_floor"] = round(r["ms"] / floor_ms, 3)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            torch.cuda.empty_cache()
        print(rec, flush=True)
        records.append(rec)
        bench_torch.free(leaves)
    del leaves, variants
    bench_torch.free()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="ce,linear,distill,linear_distill")
    ap.add_argument("--out", default=None, help="also write the JSON there")
    ap.add_argument("--name", default="heads", help="the results file's name")
    args = ap.parse_args()
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    sections = args.sections.split(",")
    copy_tbps = harness.copy_tbps()
    tflops = harness.gemm_tflops()
    records = []
    if "ce" in sections:
        for shape in CE_SHAPES:
            run_group("ce", shape, ce_variants, records)
    if "linear" in sections:
        for shape in LIN_SHAPES:
            run_group("linear", shape, linear_variants, records, slow=True)
    if "distill" in sections:
        for shape in DISTILL_SHAPES:
            run_group("distill", shape, distill_variants, records)
    if "linear_distill" in sections:
        for N, D, Dt, V in LIN_DISTILL_SHAPES:
            floor = (6 * N * D * V + 2 * N * Dt * V) / (tflops * 1e12) * 1e3
            run_group("linear_distill", (N, D, Dt, V), linear_distill_variants, records,
                      slow=True, floor_ms=floor)
    if "vp" in sections:
        for shape in VP_SHAPES:
            run_group("vp", shape, vp_variants, records)
    run = harness.run_info(copy_tbps=round(copy_tbps, 3), gemm_tflops=round(tflops, 1),
                           note="bf16; loss + backward; x_first: over the group's first variant")
    harness.write(args.name, harness.device_name(), run, records,
                  out_dirs=[args.out] if args.out else ())


if __name__ == "__main__":
    main()
