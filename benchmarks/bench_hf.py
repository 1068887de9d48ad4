"""End-to-end benchmark of HF transformers MoE models: `experts_implementation="padded_moe"` against
HF's default `grouped_mm` (issue 18).

Models are built from configs written here (`AutoModelForCausalLM.from_config`): real layer widths,
fewer layers, seeded random weights, bf16, random input ids — nothing is downloaded and no
tokenizer is used. Per model, the speedup (grouped_mm time / padded_moe time) in:

- prefill b1×2048 and b8×512: one forward without a cache, logits of the last position only
  (what `generate()` asks for at prefill);
- decode loop b1 / b32: K eager forwards of one token each on a `DynamicCache` after a short
  prefill (the prefill is not timed); fixed random next tokens so both implementations run the
  same inputs;
- generate() b1 / b32: `model.generate(..., do_sample=False, min_new_tokens=max_new_tokens)` so
  both produce the same number of tokens;
- graph decode step b1 / b32: one decode forward on a `StaticCache`, captured in a
  `torch.cuda.CUDAGraph` per implementation, replay time. Where the capture fails the cell is NaN
  and the reason is printed and written to the report (never a substitute measurement).

Both implementations run in the same process, interleaved sample by sample (the order flips every
sample), on the same model: `set_experts_implementation` switches between samples, outside the
timed region. CUDA events time each sample; the median of N samples after warm-up is reported.
GPT-OSS's transposed expert parameters are re-laid in place by padded_moe's first call (docs/
transformers.md), so from then on grouped_mm reads them as it reads the packed models' experts
(the same values, the other arrangement in memory).

Logits check: on one prompt, per-position differences ‖a_t − b_t‖ / ‖b_t‖ of bf16 logits.
padded_moe is "within HF's bf16 spread" when its difference from grouped_mm is within 1.5× (+1e-3)
of HF's own spread, at the median and at the 90th percentile. HF's spread is the larger of two
differences: its eager experts (bf16) against grouped_mm, and grouped_mm against its fp32 result.
The second one matters where HF's two bf16 paths compute the same sums: they then agree exactly,
yet any other bf16 summation order differs by about one bf16 rounding. Two independent roundings
differ by about √2 of one, hence the 1.5. The tail is a percentile, not the maximum, because a
router near-tie can send a token to other experts in any bf16 run and move its logits a lot. Also
reported: every bf16 run (padded_moe, grouped_mm, eager, batched_mm) against an fp32 copy of the
same weights run with HF's eager experts, the median and the max, and the criteria of
tests/test_transformers_parity.py on those (`fp32_criteria`).

One command (GPU): `python benchmarks/bench_hf.py --out results/hf`
Smoke run (CPU, tiny shapes, padded_moe's torch path, seconds): `python benchmarks/bench_hf.py --device cpu --tiny`
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import time
from typing import Callable, Optional, Sequence

import torch

IMPLS = ("grouped_mm", "padded_moe")  # baseline first: speedup = baseline time / ours
BASELINE, OURS = IMPLS

# Stable column ids (the JSON keys; labels carry the shapes of the run).
COLUMNS = ("prefill_b1", "prefill_b8", "decode_b1", "decode_b32", "generate_b1", "generate_b32",
           "graph_b1", "graph_b32")


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Token counts of one run: the full ones are issue 18's table, the tiny ones a CPU smoke run."""

    prefill_b1_len: int  # prefill b1 × this
    prefill_b8_len: int  # prefill b8 × this
    # Prefill before the decode loop, the graph step and generate(); below GPT-OSS's sliding
    # window (128), so the static sliding layers stay on their in-place write path while replaying.
    prompt_len: int
    decode_steps: int  # K forwards per decode-loop sample
    new_tokens: int  # generate(): max_new_tokens = min_new_tokens
    logit_batch: int
    logit_len: int
    iters: int  # timed samples per cell (median)
    warmup: int
    graph_replays: int  # replays per graph sample (back to back, divided)


FULL = Shapes(prefill_b1_len=2048, prefill_b8_len=512, prompt_len=64, decode_steps=32, new_tokens=32,
              logit_batch=2, logit_len=32, iters=10, warmup=3, graph_replays=20)
TINY = Shapes(prefill_b1_len=32, prefill_b8_len=16, prompt_len=8, decode_steps=4, new_tokens=4,
              logit_batch=2, logit_len=8, iters=3, warmup=1, graph_replays=2)


def column_labels(s: Shapes) -> dict:
    return {
        "prefill_b1": f"prefill b1×{s.prefill_b1_len}", "prefill_b8": f"prefill b8×{s.prefill_b8_len}",
        "decode_b1": "decode loop b1", "decode_b32": "decode loop b32",
        "generate_b1": "generate() b1", "generate_b32": "generate() b32",
        "graph_b1": "graph decode step b1", "graph_b32": "graph decode step b32",
    }


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

def _qwen3_moe(tiny: bool):
    from transformers import Qwen3MoeConfig

    if tiny:
        return Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_experts=16, num_experts_per_tok=4, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, norm_topk_prob=True)
    # Qwen3-30B-A3B's layer: 128 experts, top-8, H=2048, N=768, 32 query / 4 KV heads of 128.
    return Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          norm_topk_prob=True)


def _mixtral(tiny: bool):
    from transformers import MixtralConfig

    if tiny:
        return MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_local_experts=8,
                             num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2)
    # Mixtral-8x7B's layer: 8 experts, top-2, H=4096, N=14336.
    return MixtralConfig(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                         num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8)


def _gpt_oss(tiny: bool):
    from transformers import GptOssConfig

    # Two layers: one sliding-window and one full-attention layer, as in the real model.
    layer_types = ["sliding_attention", "full_attention"]
    if tiny:
        return GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_local_experts=8,
                            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, sliding_window=16, layer_types=layer_types)
    # transformers' default GptOssConfig (gpt-oss-120b's layer: 128 experts, top-4, H=N=2880) in
    # bf16 weights rather than the checkpoint's MXFP4, so both implementations read the same bytes.
    return GptOssConfig(num_hidden_layers=2, layer_types=layer_types)


def _deepseek_v3(tiny: bool):
    from transformers import DeepseekV3Config

    # MoE layers only (no dense first layers), one shared expert, the router's group limit. One layer at
    # full width: its experts are 22.5 GB in bf16, and the logits check adds a float32 copy of the model.
    common = dict(first_k_dense_replace=0, n_shared_experts=1, num_hidden_layers=1)
    if tiny:
        return DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **common)
    # transformers' default DeepseekV3Config is DeepSeek-V3's (and Kimi-K2's) layer: 256 experts,
    # top-8 in 4 of 8 groups, H=7168, N=2048, multi-head latent attention.
    return DeepseekV3Config(**common)


def _deepseek_v4(tiny: bool):
    from transformers import DeepseekV4Config

    # One hash-routed and one top-k-routed MoE layer, as the real model's first layers.
    layers = dict(num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"])
    if tiny:
        return DeepseekV4Config(vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=16, q_lora_rank=16, num_experts_per_tok=2,
                                n_routed_experts=8, hc_mult=2, sliding_window=8, o_groups=2, o_lora_rank=8,
                                index_n_heads=2, index_head_dim=8, index_topk=4, partial_rotary_factor=0.5, **layers)
    # transformers' default DeepseekV4Config is DeepSeek-V4-Flash's layer: 256 experts, top-6, H=4096,
    # N=2048, sqrt(softplus) routing.
    return DeepseekV4Config(**layers)


MODELS: dict = {
    "qwen3_moe": ("Qwen3-MoE", _qwen3_moe),
    "mixtral": ("Mixtral", _mixtral),
    "gpt_oss": ("GPT-OSS-like", _gpt_oss),
    "deepseek_v3": ("DeepSeek-V3-like", _deepseek_v3),
    "deepseek_v4": ("DeepSeek-V4-Flash-like", _deepseek_v4),
}


def describe(config) -> str:
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return (f"{config.num_hidden_layers} layers; {experts} experts, top-{config.num_experts_per_tok}, "
            f"H={config.hidden_size}, N={width}")


def build_model(config, device: torch.device, dtype: torch.dtype, seed: int,
                implementation: str = BASELINE) -> torch.nn.Module:
    """Random weights from HF's own initialisation, seeded; built directly on `device`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=implementation)
    return model.eval()


def random_ids(batch: int, length: int, vocab: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Ids >= 2: 0 and 1 can be special tokens (pad / eos) in some configs.
    return torch.randint(2, vocab, (batch, length), generator=gen).to(device)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """One sample of `fn`, in ms: CUDA events on a GPU, the wall clock on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def interleaved(model, cases: dict, device: torch.device, iters: int, warmup: int, per: int = 1) -> dict:
    """Median ms of each implementation's case, samples interleaved.

    `cases[impl] = (prepare, run)`: `prepare()` (untimed, e.g. a prefill into a fresh cache)
    returns the state `run(state)` consumes; `per` divides a sample (steps or replays in it).
    The order of the implementations flips every sample so neither always runs on a GPU just
    warmed (or throttled) by the other.
    """
    samples: dict = {impl: [] for impl in cases}
    order = list(cases)
    for i in range(warmup + iters):
        for impl in (order if i % 2 == 0 else order[::-1]):
            prepare, run = cases[impl]
            model.set_experts_implementation(impl)
            state = prepare()
            _sync(device)
            t = time_ms(lambda: run(state), device)
            if i >= warmup:
                samples[impl].append(t / per)
    return {impl: statistics.median(v) for impl, v in samples.items()}


# ---------------------------------------------------------------------------------------------
# The columns
# ---------------------------------------------------------------------------------------------

def _nothing():
    return None


def prefill_cases(model, ids: torch.Tensor) -> dict:
    def run(_):
        return model(input_ids=ids, use_cache=False, logits_to_keep=1)

    return {impl: (_nothing, run) for impl in IMPLS}


def decode_pair(model, prompt: torch.Tensor, steps: torch.Tensor) -> tuple:
    """`(prepare, run)` of the decode loop: a prefill of `prompt` into a fresh DynamicCache (not
    timed), then one eager forward per column of `steps`."""
    from transformers import DynamicCache

    def prepare():
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
        return cache

    def run(cache):
        for s in range(steps.shape[1]):
            model(input_ids=steps[:, s:s + 1], cache=cache, use_cache=True, logits_to_keep=1)

    return prepare, run


def decode_cases(model, prompt: torch.Tensor, steps: torch.Tensor) -> dict:
    pair = decode_pair(model, prompt, steps)
    return {impl: pair for impl in IMPLS}


def generate_cases(model, prompt: torch.Tensor, new_tokens: int) -> dict:
    def run(_):
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
        # Same work on both sides, or the ratio means nothing.
        if out.shape[1] != prompt.shape[1] + new_tokens:
            raise RuntimeError(f"generate() made {out.shape[1] - prompt.shape[1]} tokens, asked {new_tokens}")
        return out

    return {impl: (_nothing, run) for impl in IMPLS}


class StaticStep:
    """Decode forwards of one token on a `StaticCache`, for one implementation.

    transformers 5.24's static layers keep their write position in a device tensor
    (`cumulative_length`, advanced in place, so a captured step advances it on every replay) and,
    for sliding-window layers, a Python int as well (frozen at capture). `reset()` puts both back
    to their values after the prefill, so every sample replays the same positions P, P+1, ...
    and never runs past the cache.

    On CUDA `capture()` records one step in a CUDA graph (after warm-up steps on a side stream, so
    lazy allocations and kernel compilation happen outside the capture); on the CPU there are no
    graphs and `run` takes the eager static-cache step (the smoke run checks the plumbing only).
    """

    WARMUP = 3

    def __init__(self, model, prompt: torch.Tensor, next_ids: torch.Tensor, device: torch.device, replays: int):
        from transformers import StaticCache

        self.model, self.device = model, device
        self.cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + replays + self.WARMUP + 8)
        model(input_ids=prompt, cache=self.cache, use_cache=True, logits_to_keep=1)
        self.saved = [(layer, name, value.clone() if isinstance(value, torch.Tensor) else value)
                      for layer in self.cache.layers
                      for name in ("cumulative_length", "cumulative_length_int")
                      if (value := getattr(layer, name, None)) is not None]
        self.ids = next_ids.clone()
        self.graph: Optional[torch.cuda.CUDAGraph] = None

    def reset(self) -> None:
        for layer, name, value in self.saved:
            if isinstance(value, torch.Tensor):
                getattr(layer, name).copy_(value)  # in place: the graph holds this tensor's address
            else:
                setattr(layer, name, value)

    def step(self):
        return self.model(input_ids=self.ids, cache=self.cache, use_cache=True, logits_to_keep=1)

    def capture(self) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP):
                self.reset()
                self.step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self.reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        self.graph = graph
        self.reset()

    def run(self, replays: int) -> None:
        for _ in range(replays):
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()


def graph_cases(model, prompt: torch.Tensor, next_ids: torch.Tensor, device: torch.device,
                replays: int, notes: list, label: str) -> Optional[dict]:
    """Captured static-cache decode steps of both implementations, or None (reason in `notes`)."""
    steps = {}
    for impl in IMPLS:
        model.set_experts_implementation(impl)
        try:
            steps[impl] = StaticStep(model, prompt, next_ids, device, replays)
            if device.type == "cuda":
                steps[impl].capture()
        except Exception as exc:  # reported in the output and the docs, never replaced by another timing
            if device.type == "cuda":
                try:  # a failed capture can leave an error pending on the stream; surface it here
                    torch.cuda.synchronize(device)
                except Exception as sync_exc:  # noqa: BLE001 - the capture error is the one to report
                    exc = sync_exc if not str(exc) else exc
            notes.append(f"{label}, {impl}: static-cache decode step not capturable in transformers "
                         f"{_tf_version()}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return None
    return {impl: (st.reset, lambda _, st=st: st.run(replays)) for impl, st in steps.items()}


# ---------------------------------------------------------------------------------------------
# Logits check
# ---------------------------------------------------------------------------------------------

def position_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """‖out_t − ref_t‖ / ‖ref_t‖ per (prompt, position), flattened."""
    diff = (out.double() - ref.double()).norm(dim=-1)
    return (diff / ref.double().norm(dim=-1).clamp_min(1e-30)).flatten()


def _count_padded_calls(model, ids: torch.Tensor) -> int:
    """Calls into padded_moe's experts forward during one forward (guards against benchmarking
    grouped_mm against itself when the switch silently does nothing)."""
    from transformers.integrations.moe import ExpertsInterface

    from padded_moe.integrations import transformers as plug

    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return plug.padded_moe_experts_forward(*args, **kwargs)

    ExpertsInterface.register(plug.IMPLEMENTATION, counting)
    try:
        model.set_experts_implementation(plug.IMPLEMENTATION)
        model(input_ids=ids, use_cache=False)
    finally:
        ExpertsInterface.register(plug.IMPLEMENTATION, plug.padded_moe_experts_forward)
    return calls[0]


def logits_check(model, config, ids: torch.Tensor, device: torch.device, seed: int, notes: list,
                 label: str) -> dict:
    """Per-position logit differences: padded_moe and HF's eager experts against grouped_mm (all
    bf16), and every bf16 run against an fp32 copy of the same weights (HF's eager experts)."""
    result: dict = {}
    logits = {}
    tokens = ids.numel()
    for impl in ("grouped_mm", "eager", "batched_mm", "padded_moe"):
        if impl == "batched_mm":
            # batched_mm gathers one weight matrix per routed slot; skip it where that is too big.
            experts = [m for m in model.modules() if hasattr(m, "gate_up_proj") and m.gate_up_proj.dim() == 3]
            per_slot = experts[0].gate_up_proj[0].numel() * experts[0].gate_up_proj.element_size() if experts else 0
            if tokens * config.num_experts_per_tok * per_slot > 40e9:
                notes.append(f"{label}: batched_mm left out of the logits check (gathered weights > 40 GB)")
                continue
        model.set_experts_implementation(impl)
        logits[impl] = model(input_ids=ids, use_cache=False).logits.float()
    calls = _count_padded_calls(model, ids)
    moe_layers = sum(1 for m in model.modules() if isinstance(getattr(m, "down_proj", None), torch.Tensor)
                     and m.down_proj.dim() == 3)
    if calls != moe_layers:  # the switch did not reach every experts module: the timings would lie
        raise RuntimeError(f"{label}: padded_moe ran in {calls} of {moe_layers} experts modules")
    result["padded_moe_calls_per_forward"] = calls
    ref_model = build_model(config, device, torch.float32, seed, implementation="eager")
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ref = ref_model(input_ids=ids, use_cache=False).logits.float()
    del ref_model
    errs = {impl: position_errors(out, ref) for impl, out in logits.items()}
    for impl, e in errs.items():
        result[f"{impl}_vs_fp32_median"] = e.median().item()
        result[f"{impl}_vs_fp32_max"] = e.max().item()
    result["padded_moe_vs_grouped_mm_max"] = position_errors(logits["padded_moe"], logits["grouped_mm"]).max().item()
    if "batched_mm" in logits:
        result["batched_mm_vs_grouped_mm_max"] = position_errors(logits["batched_mm"], logits["grouped_mm"]).max().item()
    # Greedy agreement with grouped_mm (all positions; near-ties flip in either bf16 run).
    top = {impl: out.argmax(-1) for impl, out in logits.items()}
    result["argmax_agree_padded_moe"] = (top["padded_moe"] == top["grouped_mm"]).double().mean().item()
    if "batched_mm" in top:
        result["argmax_agree_batched_mm"] = (top["batched_mm"] == top["grouped_mm"]).double().mean().item()
    ours, hf = errs["padded_moe"], errs["grouped_mm"]
    hf_median = hf.median().item()
    result["fp32_criteria"] = bool(ours.median().item() <= 1.5 * hf_median + 1e-3
                                   and (ours > 10 * hf_median).double().mean().item() <= 0.05)
    # HF's own spread (see the module docstring) against padded_moe's difference from grouped_mm.
    diffs = {"eager_vs_grouped_mm": position_errors(logits["eager"], logits["grouped_mm"]),
             "grouped_mm_vs_fp32": hf,
             "padded_moe_vs_grouped_mm": position_errors(logits["padded_moe"], logits["grouped_mm"])}
    for name, e in diffs.items():
        result[f"{name}_median"] = e.median().item()
        result[f"{name}_p90"] = torch.quantile(e.double(), 0.9).item()
    within = True
    for stat in ("median", "p90"):
        spread = max(result[f"eager_vs_grouped_mm_{stat}"], result[f"grouped_mm_vs_fp32_{stat}"])
        result[f"hf_spread_{stat}"] = spread
        within &= result[f"padded_moe_vs_grouped_mm_{stat}"] <= 1.5 * spread + 1e-3
    result["within_spread"] = bool(within)
    return result


def logit_summary(check: dict) -> str:
    ok = "ok" if check["within_spread"] else "OUTSIDE"
    return (f"{ok}: vs grouped_mm median / p90 {check['padded_moe_vs_grouped_mm_median']:.2e} / "
            f"{check['padded_moe_vs_grouped_mm_p90']:.2e}, HF's spread {check['hf_spread_median']:.2e} / "
            f"{check['hf_spread_p90']:.2e}; vs fp32 median {check['padded_moe_vs_fp32_median']:.2e} "
            f"(grouped_mm {check['grouped_mm_vs_fp32_median']:.2e})")


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

def _tf_version() -> str:
    import transformers

    return transformers.__version__


@torch.no_grad()
def bench_model(key: str, shapes: Shapes, device: torch.device, tiny: bool, seed: int,
                columns: Sequence[str], notes: list) -> dict:
    name, make = MODELS[key]
    config = make(tiny)
    label = f"{name} ({describe(config)})"
    model = build_model(config, device, torch.bfloat16, seed)
    vocab = config.vocab_size
    row: dict = {"model": name, "key": key, "config": describe(config), "times_ms": {}, "speedup": {}}

    row["logits"] = logits_check(model, config, random_ids(shapes.logit_batch, shapes.logit_len, vocab, seed + 1,
                                                           device), device, seed, notes, label)
    print(f"{label}: logits {logit_summary(row['logits'])}", flush=True)

    def ids(batch, length, salt):
        return random_ids(batch, length, vocab, seed + salt, device)

    for col in columns:
        kind, batch = col.rsplit("_b", 1)
        batch = int(batch)
        per = 1
        if kind == "prefill":
            cases = prefill_cases(model, ids(batch, shapes.prefill_b1_len if batch == 1 else shapes.prefill_b8_len, 10))
        elif kind == "decode":
            cases = decode_cases(model, ids(batch, shapes.prompt_len, 20), ids(batch, shapes.decode_steps, 21))
            per = shapes.decode_steps
        elif kind == "generate":
            cases = generate_cases(model, ids(batch, shapes.prompt_len, 30), shapes.new_tokens)
        else:
            cases = graph_cases(model, ids(batch, shapes.prompt_len, 40), ids(batch, 1, 41), device,
                                shapes.graph_replays, notes, label)
            per = shapes.graph_replays
        if cases is None:
            times = {impl: float("nan") for impl in IMPLS}
        else:
            times = interleaved(model, cases, device, shapes.iters, shapes.warmup, per)
        row["times_ms"][col] = times
        row["speedup"][col] = times[BASELINE] / times[OURS]
        print(f"{label}: {col}: grouped_mm {times[BASELINE]:.4g} ms, padded_moe {times[OURS]:.4g} ms, "
              f"speedup {row['speedup'][col]:.3f}", flush=True)
        del cases
        if device.type == "cuda":
            torch.cuda.empty_cache()
    model.set_experts_implementation(BASELINE)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _fmt(v: float) -> str:
    return "nan" if v != v else f"{v:.2f}"


def speedup_table(rows: list, columns: Sequence[str], shapes: Shapes) -> tuple:
    labels = column_labels(shapes)
    headers = ["model", *(labels[c] for c in columns),
               "logits vs grouped_mm, median / p90 (ours; HF's spread)"]
    body = []
    for r in rows:
        lg = r["logits"]
        body.append([f"{r['model']} ({r['config']})", *(_fmt(r["speedup"][c]) for c in columns),
                     f"{'ok' if lg['within_spread'] else 'OUTSIDE'} {lg['padded_moe_vs_grouped_mm_median']:.1e} / "
                     f"{lg['padded_moe_vs_grouped_mm_p90']:.1e}; {lg['hf_spread_median']:.1e} / "
                     f"{lg['hf_spread_p90']:.1e}"])
    return headers, body


def times_table(rows: list, columns: Sequence[str], shapes: Shapes) -> tuple:
    labels = column_labels(shapes)
    headers = ["model", "column", "grouped_mm ms", "padded_moe ms", "speedup"]
    body = [[r["model"], labels[c], f"{r['times_ms'][c][BASELINE]:.4g}", f"{r['times_ms'][c][OURS]:.4g}",
             _fmt(r["speedup"][c])] for r in rows for c in columns]
    return headers, body


def markdown(headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def print_rich(title: str, headers: Sequence[str], body: Sequence[Sequence[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is optional here: the markdown table says the same
        print(title)
        print(markdown(headers, body))
        return
    table = Table(title=title)
    for h in headers:
        table.add_column(h)
    for row in body:
        table.add_row(*row)
    Console(width=220).print(table)


def _json_safe(value):
    """NaN (a cell not measured) as null: strict JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def device_line(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return (f"{name}, torch {torch.__version__}, transformers {_tf_version()}, "
            f"{datetime.date.today().isoformat()}")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (use with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and few samples: a smoke run")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--columns", default=",".join(COLUMNS), help=f"comma-separated, of {', '.join(COLUMNS)}")
    parser.add_argument("--iters", type=int, default=None, help="timed samples per cell (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for hf_e2e.json and hf_e2e.md")
    parser.add_argument("--decode", action="append", default=[], metavar="NAME=VALUE",
                        help="set a string setting of padded_moe.decode for the run (e.g. MX_W2=cuda); repeatable")
    return parser.parse_args(argv)


def validate(args: argparse.Namespace) -> tuple:
    """Typed errors for bad arguments (ValueError), before any model is built."""
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if not models or unknown:
        raise ValueError(f"--models: unknown or empty {unknown or models!r}; choose from {list(MODELS)}")
    columns = [c.strip() for c in args.columns.split(",") if c.strip()]
    bad = [c for c in columns if c not in COLUMNS]
    if not columns or bad:
        raise ValueError(f"--columns: unknown or empty {bad or columns!r}; choose from {list(COLUMNS)}")
    if args.device not in ("cuda", "cpu") and not args.device.startswith("cuda:"):
        raise ValueError(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here; use --device cpu --tiny for a smoke run")
    if device.type == "cpu" and not args.tiny:
        raise ValueError("--device cpu runs the tiny shapes only (pass --tiny): the real widths take hours on a CPU")
    from padded_moe import decode as dec

    settings = [item.partition("=") for item in args.decode]
    for (name, sep, _), item in zip(settings, args.decode):
        if not sep or not name.isupper() or not isinstance(getattr(dec, name, None), str):
            raise ValueError(f"--decode: expected NAME=VALUE naming a string setting of padded_moe.decode, got {item!r}")
    shapes = TINY if args.tiny else FULL
    if args.iters is not None:
        if args.iters < 1:
            raise ValueError(f"--iters must be >= 1, got {args.iters}")
        shapes = dataclasses.replace(shapes, iters=args.iters)
    for name, _, value in settings:  # applied once every argument is known to be good
        setattr(dec, name, value)
    return models, columns, device, shapes


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the benchmark; returns the report (also written under --out as JSON and markdown)."""
    args = parse_args(argv)
    models, columns, device, shapes = validate(args)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        # Interpreted Triton kernels would make the padded_moe side minutes slower than its torch path.
        print("note: TRITON_INTERPRET=1 — padded_moe runs interpreted Triton kernels on the CPU (slow)")
    from padded_moe.integrations import transformers as plug

    plug.register()
    notes: list = []
    if args.decode:
        notes.append(f"padded_moe.decode settings for this run: {', '.join(args.decode)}")
    if device.type == "cpu":
        notes.append("CPU smoke run: tiny shapes, padded_moe's torch path, wall-clock timing; the graph "
                     "columns time the eager static-cache step (no CUDA graphs on a CPU). Not a measurement.")
    rows: list = []
    for m in models:
        rows.append(bench_model(m, shapes, device, args.tiny, args.seed, columns, notes))
        # Written after every model, so a run cut short by a time limit keeps what it measured.
        report = write_report(args.out, device, shapes, columns, rows, notes)
    headers, body = speedup_table(rows, columns, shapes)
    t_headers, t_body = times_table(rows, columns, shapes)
    print_rich(TITLE, headers, body)
    print_rich("times (median ms; decode loop per step, graph per replay)", t_headers, t_body)
    for n in notes:
        print("note:", n)
    return report


TITLE = "HF end to end: speedup of padded_moe over grouped_mm (grouped_mm time / padded_moe time)"


def write_report(out: Optional[str], device: torch.device, shapes: Shapes, columns: Sequence[str],
                 rows: list, notes: list) -> dict:
    report = {"device": device_line(device), "shapes": dataclasses.asdict(shapes), "columns": list(columns),
              "labels": column_labels(shapes), "rows": rows, "notes": list(notes)}
    if out:
        headers, body = speedup_table(rows, columns, shapes)
        t_headers, t_body = times_table(rows, columns, shapes)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "hf_e2e.json"), "w") as f:
            json.dump(_json_safe(report), f, indent=1)
        md = (f"## {TITLE}\n\nDevice: {report['device']}\n\n{markdown(headers, body)}\n\n"
              f"{markdown(t_headers, t_body)}\n\n" + "".join(f"- {n}\n" for n in notes))
        with open(os.path.join(out, "hf_e2e.md"), "w") as f:
            f.write(md)
    return report


if __name__ == "__main__":
    main()
