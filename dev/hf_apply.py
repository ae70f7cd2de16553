#!/usr/bin/env python3
"""fusedce.transformers.apply on Hugging Face causal LMs, against the unpatched models (GPU).

Tiny randomly initialised models of each supported family (Llama, Mistral, Qwen2, Qwen3, Gemma 2,
Gemma 3), built from configs (no download), on CUDA:

1. correctness, bf16 weights: loss and the gradient of every parameter of the patched model
   against the unpatched one, both measured against a float32 copy of the same (bf16-rounded)
   weights: the patched model passes when its loss is within 0.5 % of the unpatched one's and
   every gradient is within 2 % of the unpatched one's (relative Frobenius norm) or no further
   from float32 than the unpatched one's (x1.5 + 0.002);
2. training: N steps of AdamW (same seed, same batches, two micro-batches a step with the
   Trainer's num_items_in_batch), in pure bf16 and under bf16 autocast with float32 weights
   (the Trainer's bf16=True): the loss trajectories must stay within 1 %;
3. memory: the peak of torch.cuda.max_memory_allocated beyond the model and its inputs
   (parameter gradients included, the same for both) for one forward + backward at vocab
   128256, sequence 4096 (batch 1, hidden 512, 2 layers), and the time of that step, patched
   vs unpatched.

Writes dev/results/hf-apply-<device name>.json and prints a table; exits 1 when a check fails.

    make build BUILD=build-gpu CUDA_ARCHS=90
    FUSEDCE_LIBRARY=build-gpu/libfusedce.so python3 dev/hf_apply.py
    python3 dev/hf_apply.py --device cpu --quick       # a smoke run of the script on CPU
"""

import argparse
import copy
import json
import math
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))

import fusedce  # noqa: E402
import fusedce.transformers as ft  # noqa: E402

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"]
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
           "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}

LOSS_RTOL = 5e-3         # patched vs unpatched loss, bf16
GRAD_RTOL = 2e-2         # patched vs unpatched gradient (relative Frobenius norm), bf16
TRAJ_RTOL = 1e-2         # loss trajectories


def build(family, vocab, hidden, layers, heads, kv_heads, inter, seed, softcap=None):
    """A float32 model on the CPU, initialised from seed, with logits of a trained model's
    size (lm_head scaled so that the logits' standard deviation is about 3)."""
    import transformers
    cfg_name, cls_name = CLASSES[family]
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
              max_position_embeddings=8192, use_cache=False)
    if family in ("qwen3", "gemma2", "gemma3"):
        kw["head_dim"] = hidden // heads
    if family in ("gemma2", "gemma3") and softcap is not None:
        kw["final_logit_softcapping"] = softcap
    cfg = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg)
    with torch.no_grad():
        w = model.lm_head.weight
        w.mul_(3.0 / (float(w.float().std()) * math.sqrt(hidden)))
    return model


def batch(vocab, b, t, seed, device, learnable=None):
    """input_ids and labels (a masked prompt of a few tokens per row, as SFT data). learnable:
    a permutation of the vocabulary: each next token is perm[token] 90 % of the time."""
    g = torch.Generator().manual_seed(seed)
    if learnable is None:
        x = torch.randint(0, vocab, (b, t), generator=g)
    else:
        x = torch.empty(b, t, dtype=torch.int64)
        x[:, 0] = torch.randint(0, vocab, (b,), generator=g)
        noise = torch.rand(b, t, generator=g) < 0.1
        rand = torch.randint(0, vocab, (b, t), generator=g)
        for i in range(1, t):
            x[:, i] = torch.where(noise[:, i], rand[:, i], learnable[x[:, i - 1]])
    y = x.clone()
    prompt = torch.randint(1, max(2, t // 8), (b,), generator=g)
    for r in range(b):
        y[r, :int(prompt[r])] = -100
    return x.to(device), y.to(device)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------ 1. correctness ----
def correctness(family, device, sizes):
    base = build(family, sizes["vocab"], sizes["hidden"], 2, 4, 2, 2 * sizes["hidden"], seed=0,
                 softcap=30.0)
    bf = base.to(torch.bfloat16)
    ref = copy.deepcopy(bf).to(device)
    fused = copy.deepcopy(bf).to(device)
    f32 = copy.deepcopy(bf).float().to(device)   # the same bf16-rounded weights, in float32
    ft.apply(fused)
    x, y = batch(sizes["vocab"], sizes["b"], sizes["t"], 1, device)
    out = {}
    for name, m in (("hf", ref), ("fused", fused), ("f32", f32)):
        m.train()
        r = m(input_ids=x, labels=y)
        r.loss.backward()
        out[name] = (r.loss.detach().item(), r.logits is None,
                     {n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    loss_rel = abs(out["fused"][0] - out["hf"][0]) / abs(out["hf"][0])
    worst = {"fused_vs_hf": (0.0, ""), "fused_vs_f32": (0.0, ""), "hf_vs_f32": (0.0, "")}
    grads_ok, failing = True, []
    for n, g_hf in out["hf"][2].items():
        g_f, g_32 = out["fused"][2][n], out["f32"][2][n]
        e_fh, e_f, e_h = rel(g_f, g_hf), rel(g_f, g_32), rel(g_hf, g_32)
        for key, e in (("fused_vs_hf", e_fh), ("fused_vs_f32", e_f), ("hf_vs_f32", e_h)):
            if e > worst[key][0]:
                worst[key] = (e, n)
        if not (e_fh <= GRAD_RTOL or e_f <= 1.5 * e_h + 2e-3):
            grads_ok = False
            failing.append(n)
    return {
        "family": family, "loss_hf": out["hf"][0], "loss_fused": out["fused"][0],
        "loss_f32": out["f32"][0], "loss_rel_diff": loss_rel,
        "logits_skipped": out["fused"][1], "n_params": len(out["hf"][2]),
        "grad_rel_fused_vs_hf_max": worst["fused_vs_hf"][0],
        "grad_rel_fused_vs_hf_param": worst["fused_vs_hf"][1],
        "grad_rel_fused_vs_f32_max": worst["fused_vs_f32"][0],
        "grad_rel_hf_vs_f32_max": worst["hf_vs_f32"][0],
        "grads_failing": failing,
        "pass": bool(loss_rel <= LOSS_RTOL and grads_ok and out["fused"][1]),
    }


# ---------------------------------------------------------------------- 2. training ----
def training(family, device, sizes, steps, mode):
    base = build(family, sizes["vocab"], sizes["hidden"], 2, 4, 2, 2 * sizes["hidden"], seed=0,
                 softcap=30.0)
    if mode == "bf16":
        base = base.to(torch.bfloat16)
    perm = torch.randperm(sizes["vocab"], generator=torch.Generator().manual_seed(7))
    batches = [[batch(sizes["vocab"], sizes["b"], sizes["t"], 100 + 2 * s + k, device, perm)
                for k in range(2)] for s in range(steps)]
    curves = {}
    for name in ("hf", "fused"):
        model = copy.deepcopy(base).to(device)
        if name == "fused":
            ft.apply(model)
        model.train()
        torch.manual_seed(1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        losses = []
        for micro in batches:
            n = sum(int((yy[:, 1:] != -100).sum()) for _, yy in micro)
            total = 0.0
            for x, y in micro:
                with torch.autocast(device, dtype=torch.bfloat16, enabled=(mode == "autocast")):
                    loss = model(input_ids=x, labels=y,
                                 num_items_in_batch=torch.tensor(n, device=device)).loss
                loss.backward()
                total += loss.detach().item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total)
        curves[name] = losses
        del model, opt
    diffs = [abs(a - b) / abs(b) for a, b in zip(curves["fused"], curves["hf"])]
    return {"family": family, "mode": mode, "steps": steps, "loss_hf": curves["hf"],
            "loss_fused": curves["fused"], "max_rel_diff": max(diffs),
            "pass": bool(max(diffs) <= TRAJ_RTOL)}


# ------------------------------------------------------------------------ 3. memory ----
def memory(family, device, vocab, seq, hidden, layers, reps):
    heads = max(4, hidden // 64)
    base = build(family, vocab, hidden, layers, heads, max(1, heads // 2), 2 * hidden, seed=0,
                 softcap=30.0).to(torch.bfloat16)
    res = {"family": family, "vocab": vocab, "seq": seq, "batch": 1, "hidden": hidden,
           "layers": layers}
    x, y = batch(vocab, 1, seq, 3, device)
    for name in ("hf", "fused"):
        model = copy.deepcopy(base).to(device)
        if name == "fused":
            ft.apply(model)
        model.train()
        res["param_mib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20

        def step(m=model):
            m.zero_grad(set_to_none=True)
            out = m(input_ids=x, labels=y)
            out.loss.backward()
            return out

        try:
            step()  # warm-up (cuBLAS workspace, caches)
            model.zero_grad(set_to_none=True)
            sync(device)
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
            out = step()
            sync(device)
            if device == "cuda":
                res[f"peak_mib_{name}"] = (torch.cuda.max_memory_allocated() - start) / 2**20
            res[f"logits_{name}"] = None if out.logits is None else list(out.logits.shape)
            del out
            times = []
            for _ in range(reps):
                sync(device)
                t0 = time.perf_counter()
                step()
                sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
            res[f"step_ms_{name}"] = sorted(times)[len(times) // 2]
        except torch.cuda.OutOfMemoryError as e:  # noqa: PERF203
            res[f"peak_mib_{name}"] = None
            res[f"error_{name}"] = f"out of memory: {str(e).splitlines()[0]}"
        model.zero_grad(set_to_none=True)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return res


def device_name(device):
    if device == "cuda":
        return torch.cuda.get_device_name().replace(" ", "-")
    return "cpu-" + platform.machine()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=32768, help="vocab of the correctness and "
                    "training models")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mem-vocab", type=int, default=128256)
    ap.add_argument("--mem-seq", type=int, default=4096)
    ap.add_argument("--mem-hidden", type=int, default=512)
    ap.add_argument("--mem-layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="timed steps in the memory part")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --device cpu --quick for a smoke run)")
    if args.quick:
        args.vocab, args.hidden, args.batch, args.seq = 512, 64, 2, 32
        args.mem_vocab, args.mem_seq, args.mem_hidden, args.reps = 4096, 256, 64, 1
        args.steps = min(args.steps, 5)
    families = [f for f in args.families.split(",") if f]

    import transformers
    env = {
        "device": device_name(args.device), "torch": torch.__version__,
        "transformers": transformers.__version__,
        "transformers_supported": ft.SUPPORTED_TRANSFORMERS,
        "fusedce_binding": fusedce.__version__,
        "fusedce_library": "%d.%d.%d" % fusedce.library_version(),
        "library_path": fusedce.library_path(), "cuda_backend": fusedce.cuda_available(),
        "python": platform.python_version(),
        "workspace_bytes": os.environ.get("FUSEDCE_WORKSPACE_BYTES") or "default (1 GiB)",
    }
    for k, v in env.items():
        print(f"{k:24s} {v}")
    ft.check_version()
    if args.device == "cuda" and not fusedce.cuda_available():
        sys.exit("libfusedce has no CUDA backend here (FUSEDCE_LIBRARY=<a CUDA build>)")
    sizes = {"vocab": args.vocab, "hidden": args.hidden, "b": args.batch, "t": args.seq}

    t_start = time.time()
    correct = []
    print(f"\n1. correctness, bf16 weights (vocab {args.vocab}, hidden {args.hidden}, 2 layers, "
          f"batch {args.batch} x {args.seq}); gradients: relative Frobenius norm, worst parameter")
    print(f"{'family':8s} {'loss hf':>9s} {'loss fce':>9s} {'loss f32':>9s} {'rel':>8s} "
          f"{'fce~hf':>8s} {'fce~f32':>8s} {'hf~f32':>8s}  ok")
    for fam in families:
        r = correctness(fam, args.device, sizes)
        correct.append(r)
        print(f"{fam:8s} {r['loss_hf']:9.5f} {r['loss_fused']:9.5f} {r['loss_f32']:9.5f} "
              f"{r['loss_rel_diff']:8.1e} {r['grad_rel_fused_vs_hf_max']:8.1e} "
              f"{r['grad_rel_fused_vs_f32_max']:8.1e} {r['grad_rel_hf_vs_f32_max']:8.1e}  "
              f"{'yes' if r['pass'] else 'NO ' + ','.join(r['grads_failing'][:3])}")

    train = []
    print(f"\n2. training, {args.steps} AdamW steps x 2 micro-batches (num_items_in_batch), same "
          "seed and batches; max relative difference of the step losses")
    print(f"{'family':8s} {'mode':9s} {'first':>8s} {'last hf':>8s} {'last fce':>8s} "
          f"{'max rel':>8s}  ok")
    for fam in families:
        for mode in ("bf16", "autocast"):
            r = training(fam, args.device, sizes, args.steps, mode)
            train.append(r)
            print(f"{fam:8s} {mode:9s} {r['loss_hf'][0]:8.4f} {r['loss_hf'][-1]:8.4f} "
                  f"{r['loss_fused'][-1]:8.4f} {r['max_rel_diff']:8.1e}  "
                  f"{'yes' if r['pass'] else 'NO'}")

    mem = []
    if not args.skip_memory:
        print(f"\n3. memory and time of one forward + backward, bf16, vocab {args.mem_vocab}, "
              f"sequence {args.mem_seq}, batch 1, hidden {args.mem_hidden}, {args.mem_layers} "
              "layers: peak allocated beyond the model and inputs (parameter gradients included)")
        print(f"{'family':8s} {'params':>8s} {'peak hf':>9s} {'peak fce':>9s} {'saved':>9s} "
              f"{'ms hf':>8s} {'ms fce':>8s}")
        for fam in families:
            r = memory(fam, args.device, args.mem_vocab, args.mem_seq, args.mem_hidden,
                       args.mem_layers, args.reps)
            mem.append(r)

            def f(v, fmt, unit=""):
                return format(v, fmt) + unit if isinstance(v, (int, float)) else "-".rjust(
                    len(format(0.0, fmt)) + len(unit))
            ph, pf = r.get("peak_mib_hf"), r.get("peak_mib_fused")
            if isinstance(ph, float) and isinstance(pf, float):
                r["saved_mib"] = ph - pf
            print(f"{fam:8s} {r['param_mib']:7.0f}M {f(ph, '8.0f', 'M')} {f(pf, '8.0f', 'M')} "
                  f"{f(r.get('saved_mib'), '8.0f', 'M')} {f(r.get('step_ms_hf'), '8.2f')} "
                  f"{f(r.get('step_ms_fused'), '8.2f')}")
            for k in ("error_hf", "error_fused"):
                if k in r:
                    print(f"         {k}: {r[k]}")

    ok = all(r["pass"] for r in correct) and all(r["pass"] for r in train)
    record = {"env": env, "args": vars(args), "tolerances": {
        "loss_rel": LOSS_RTOL, "grad_rel": GRAD_RTOL, "trajectory_rel": TRAJ_RTOL},
        "correctness": correct, "training": train, "memory": mem, "pass": ok,
        "seconds": round(time.time() - t_start, 1)}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"hf-apply-{env['device']}.json")
    with open(path, "w") as fh:
        json.dump(record, fh, indent=1)
    print(f"\n{'PASS' if ok else 'FAIL'}: wrote {path} ({record['seconds']} s)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
