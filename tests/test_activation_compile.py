"""The count-aware activation kernel compiles for sm_90 on every form its launcher produces
(Triton's own ptxas, no GPU): one row (the row count then arrives as the constant 1), int32 and
int64 counts, flat and batched buffers, gated, interleaved and non-gated activations, float32 and
16-bit outputs, without register spills, 16-bit rows in 16-byte loads; and the row loop's bound, induction and masks in 32 bits
(no 64-bit compare) unless the row count needs 64. The arguments are captured from interpreted calls and
specialised as the launcher's first call would be.
"""

from __future__ import annotations

import json

import torch
from helpers import (captured_launches, compile_for_sm90, launch_signature, launch_stats_script,
                     require_interpreted_kernels)

SCRIPT = launch_stats_script("padded_moe.kernels.activation", "moe_activation_kernel")

# (activation, input shape, count dtype or None, dtype); the output is [..., width / 2] when gated.
CASES = [
    ("silu", (1, 256), None, torch.bfloat16),          # one row: T arrives as a constant
    ("silu", (37, 8192), torch.int32, torch.bfloat16),
    ("swigluoai", (4, 33, 5760), torch.int64, torch.bfloat16),
    ("situ", (3, 20, 1024), torch.int32, torch.float32),
    ("relu2_no_mul", (50, 768), torch.int64, torch.float16),
    ("gelu_tanh", (1, 512), torch.int32, torch.bfloat16),
]


def captured_launch(monkeypatch, act, shape, count_dtype, dtype) -> list:
    from padded_moe.activation import ApplyMoEActivationConfig, apply_moe_activation, resolve_supported

    gated = resolve_supported(act).is_gated
    x = torch.randn(*shape).to(dtype)
    out = torch.empty(*shape[:-1], shape[-1] // 2 if gated else shape[-1], dtype=dtype)
    counts = None
    if count_dtype is not None:
        n = 1 if len(shape) == 2 else shape[0]
        counts = torch.randint(0, shape[-2] + 1, (n,), dtype=count_dtype)
    # situ with its linear-part clamp on (HAS_LAMBDA).
    cfg = ApplyMoEActivationConfig(situ_beta=4.0, situ_linear_beta=8.0) if act == "situ" else None
    (fn, args, constexprs, opt), = captured_launches(
        monkeypatch, lambda: apply_moe_activation(act, out, x, valid_token_counts=counts, activation_config=cfg))
    sig, const, div16 = launch_signature(fn, args, constexprs)
    return [sig, const, div16, opt["num_warps"]]


def test_activation_kernel_compiles_for_sm90_without_spills(monkeypatch):
    require_interpreted_kernels(monkeypatch)
    cases = [captured_launch(monkeypatch, *c) for c in CASES]
    assert cases[0][1]["T"] == 1, "the one-row case must reach the compiler with T as a constant"
    assert cases[2][0]["counts_ptr"] == "*i64" and cases[1][0]["counts_ptr"] == "*i32"
    assert not any(c[1]["ROWS_I64"] for c in cases)
    # A buffer of 2**31 rows or more cannot be allocated here: its launch is the batched case's with T
    # as the launcher would pass it (int64) and the 64-bit row loop.
    sig, const, div16, warps = json.loads(json.dumps(cases[2]))
    sig["T"], const["ROWS_I64"] = "i64", True
    results = compile_for_sm90(SCRIPT, json.dumps(cases + [[sig, const, div16, warps]]))
    assert len(results) == len(CASES) + 1
    for case, res in zip(CASES, results):
        assert res["spills"] == 0 and res["compares64"] == 0, (case, res)
        if case[3] != torch.float32 and case[1][-1] >= 512:
            # 16-bit rows load as 16-byte vectors, interleaved gate/up pairs (swigluoai) included.
            assert res["loads128"] > 0 and res["loads16"] == 0, (case, res)
    assert results[-1]["spills"] == 0 and results[-1]["compares64"] > 0, results[-1]
