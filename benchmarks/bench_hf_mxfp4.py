"""GPT-OSS MXFP4 checkpoints through HF transformers: loaded as MXFP4 under
`experts_implementation="padded_moe"`, against the same checkpoint dequantized to bf16
(`Mxfp4Config(dequantize=True)`) run by HF's `grouped_mm` and by padded_moe's bf16 path.

The checkpoint is written here, in the published format (`*_blocks` / `*_scales`, quant_method
"mxfp4"), with GPT-OSS-120B's layer widths (transformers' default `GptOssConfig`: 128 experts, top-4,
H = N = 2880), `--layers` layers and random weights (E8M0 scales around 2^-5, so values stay in a
normal range); nothing is downloaded. Columns, per model as loaded:

- experts GiB: the bytes of every experts module's tensors after loading (and the first forward,
  which turns nothing further: the MXFP4 model holds the prepared form from the load on);
- prefill b1x2048 / b8x512, ms: one forward without a cache, logits of the last position;
- decode b1 / b32, ms per step: eager one-token forwards on a `DynamicCache` after a 32-token
  prefill (not timed).

Samples interleave the three runs (order flipped every sample); medians of `--iters` samples
after warm-up, CUDA events. Also printed: each bf16 run's logits against the MXFP4 run's on one
prompt (per-position ‖a − b‖ / ‖b‖, median and max): the weights are the same values (e2m1 times
a power of two is exact in bf16), so only the order of the sums differs.

GPU: `python benchmarks/bench_hf_mxfp4.py --out results/hf-mxfp4`
CPU smoke run (tiny widths, seconds): `python benchmarks/bench_hf_mxfp4.py --device cpu --tiny`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_hf import decode_pair, random_ids, time_ms  # noqa: E402

RUNS = ("mxfp4_padded_moe", "bf16_grouped_mm", "bf16_padded_moe")
COLUMNS = ("prefill_b1", "prefill_b8", "decode_b1", "decode_b32")


def gpt_oss_config(layers: int, tiny: bool):
    from transformers import GptOssConfig

    layer_types = (["sliding_attention", "full_attention"] * layers)[:layers]
    if tiny:
        return GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_local_experts=8,
                            num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, sliding_window=16, layer_types=layer_types)
    return GptOssConfig(num_hidden_layers=layers, layer_types=layer_types)


def write_checkpoint(config, path: str, seed: int) -> None:
    """Random weights for `config` in GPT-OSS's MXFP4 checkpoint format, written to `path`."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in
                  AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, (shape, dtype) in shapes.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, inner, outer = shape  # GPT-OSS keeps these transposed: [E, in, out]
            tensors[f"{key}_blocks"] = torch.randint(0, 256, (experts, outer, inner // 32, 16), generator=gen,
                                                     dtype=torch.uint8)
            tensors[f"{key}_scales"] = torch.randint(120, 125, (experts, outer, inner // 32), generator=gen,
                                                     dtype=torch.uint8)
        elif "norm" in key and len(shape) == 1:
            tensors[key] = torch.ones(shape, dtype=dtype)
        else:
            tensors[key] = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    saved["quantization_config"] = {"quant_method": "mxfp4"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f, indent=1)


def experts_gib(model) -> float:
    total = 0
    for m in model.modules():
        if type(m).__name__ == "GptOssExperts":
            total += sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
    return total / 2**30


def load(path: str, device: torch.device, implementation: str, dequantize: bool):
    """The checkpoint on `device`: through `device_map` where accelerate is installed (transformers
    needs it for that), else loaded on the CPU and moved."""
    import importlib.util

    from transformers import AutoModelForCausalLM, Mxfp4Config

    kwargs = {"quantization_config": Mxfp4Config(dequantize=True)} if dequantize else {}
    if importlib.util.find_spec("accelerate") is not None:
        kwargs["device_map"] = str(device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation=implementation,
                                                 **kwargs)
    return model.to(device).eval()


def interleaved(cases: dict, device: torch.device, iters: int, warmup: int, per: int) -> dict:
    """Median ms of each run's (prepare, run), samples interleaved, order flipped every sample."""
    samples = {name: [] for name in cases}
    order = list(cases)
    for i in range(warmup + iters):
        for name in (order if i % 2 == 0 else order[::-1]):
            prepare, run = cases[name]
            state = prepare()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time_ms(lambda: run(state), device)
            if i >= warmup:
                samples[name].append(t / per)
    return {name: statistics.median(v) for name, v in samples.items()}


def position_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    out, ref = out.double().flatten(0, -2), ref.double().flatten(0, -2)
    return (out - ref).norm(dim=-1) / ref.norm(dim=-1)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny widths (a CPU smoke run)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--work", default=None, help="where the checkpoint is written (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for report.md / report.json")
    args = p.parse_args(argv)

    from padded_moe.integrations.transformers import register

    register()
    device = torch.device(args.device)
    config = gpt_oss_config(args.layers, args.tiny)
    work = args.work or tempfile.mkdtemp(prefix="bench_hf_mxfp4_")
    write_checkpoint(config, work, args.seed)
    mx = load(work, device, "padded_moe", dequantize=False)
    bf = load(work, device, "grouped_mm", dequantize=True)
    gib = {"mxfp4_padded_moe": experts_gib(mx), "bf16_grouped_mm": experts_gib(bf)}
    gib["bf16_padded_moe"] = gib["bf16_grouped_mm"]
    vocab = config.vocab_size
    prefill = [(1, 2048), (8, 512)] if not args.tiny else [(1, 64), (4, 16)]
    results: dict = {name: {} for name in RUNS}

    def on(model, implementation):
        def switch():
            model.set_experts_implementation(implementation)
        return switch

    runs = {"mxfp4_padded_moe": (mx, on(mx, "padded_moe")), "bf16_grouped_mm": (bf, on(bf, "grouped_mm")),
            "bf16_padded_moe": (bf, on(bf, "padded_moe"))}
    with torch.no_grad():
        for column, (batch, length) in zip(COLUMNS[:2], prefill):
            ids = random_ids(batch, length, vocab, args.seed + length, device)
            cases = {}
            for name, (model, switch) in runs.items():
                def prepare(model=model, switch=switch):
                    switch()

                def run(_, model=model, ids=ids):
                    model(input_ids=ids, use_cache=False, logits_to_keep=1)

                cases[name] = (prepare, run)
            for name, ms in interleaved(cases, device, args.iters, args.warmup, 1).items():
                results[name][column] = ms
        for column, batch in zip(COLUMNS[2:], (1, 32)):
            prompt = random_ids(batch, 32, vocab, args.seed + 7 * batch, device)
            steps = random_ids(batch, args.decode_steps, vocab, args.seed + 11 * batch, device)
            cases = {}
            for name, (model, switch) in runs.items():
                prep, run = decode_pair(model, prompt, steps)

                def prepare(prep=prep, switch=switch):
                    switch()
                    return prep()

                cases[name] = (prepare, run)
            for name, ms in interleaved(cases, device, args.iters, args.warmup, args.decode_steps).items():
                results[name][column] = ms
        check_ids = random_ids(2, 64 if not args.tiny else 16, vocab, args.seed + 99, device)
        runs["mxfp4_padded_moe"][1]()
        ref = mx(input_ids=check_ids).logits
        errors = {}
        for name in ("bf16_grouped_mm", "bf16_padded_moe"):
            runs[name][1]()
            e = position_errors(bf(input_ids=check_ids).logits, ref)
            errors[name] = (e.median().item(), e.max().item())

    label = {"prefill_b1": f"prefill b{prefill[0][0]}x{prefill[0][1]}",
             "prefill_b8": f"prefill b{prefill[1][0]}x{prefill[1][1]}", "decode_b1": "decode b1 (per step)",
             "decode_b32": "decode b32 (per step)"}
    lines = [f"GPT-OSS MXFP4 checkpoint, {'tiny' if args.tiny else 'GPT-OSS-120B'} widths, {args.layers} layers, "
             f"{device}, torch {torch.__version__}", "",
             "| run | experts GiB | " + " | ".join(label[c] + " ms" for c in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for name in RUNS:
        lines.append(f"| {name} | {gib[name]:.2f} | " + " | ".join(f"{results[name][c]:.3f}" for c in COLUMNS) + " |")
    base = results["bf16_grouped_mm"]
    lines += ["", "bf16_grouped_mm time / run time: " + "; ".join(
        f"{name}: " + ", ".join(f"{label[c]} {base[c] / results[name][c]:.2f}" for c in COLUMNS)
        for name in ("mxfp4_padded_moe", "bf16_padded_moe"))]
    lines += [f"logits against mxfp4_padded_moe, {name}: median {m:.2e}, max {x:.2e}" for name, (m, x) in errors.items()]
    report = "\n".join(lines)
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "report.md"), "w") as f:
            f.write(report + "\n")
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump({"results": results, "experts_gib": gib, "logit_errors": errors}, f, indent=1)
    return {"results": results, "experts_gib": gib, "logit_errors": errors}


if __name__ == "__main__":
    main()
