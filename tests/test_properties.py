"""Property tests of every public entry: drawn shapes, dtypes, counts of any integer dtype and
adversarial expert ids. Each call must either raise a typed error (TypeError, ValueError,
NotImplementedError) for input the contract refuses, or agree with the float64 reference.

Examples are few and small: the point is the breadth of inputs (dtype, sign, magnitude, layout),
not the size, and the suite runs on two CPU cores. Padding rows are NaN so a read of one shows up.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import REL_TOL, rel_err
from padded_moe.activation import ApplyMoEActivationConfig, MoEActivation, apply_moe_activation
from padded_moe.experts import batched_experts, fused_experts
from padded_moe.layer import FusedMoE
from padded_moe.layouts import GemmLayout, build_layout, permute, unpermute
from padded_moe.reference.moe import activation_f64, reference_moe

INT_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
ACCEPTED_INT = (torch.int32, torch.int64)
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
# Tolerance of the whole pipeline (two GEMMs and an activation) against float64, per dtype.
PIPE_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# Triton 3.6's interpreter truncates float32 -> bf16 instead of rounding to nearest even (as
# tests/test_distributed.py notes), all in one direction, at each of the pipeline's bf16 roundings
# (GEMM1 out, activation out, GEMM2 out, the sum). On these small problems (1-6 tokens, K = 32)
# that puts the interpreted bf16 error against float64 at 1.4% median and up to 2.5%: 2e-2 failed
# about one interpreted bf16 example in 150. The torch path stays within 1% (its bound stays
# 2e-2); a wrong row, slot, weight or expert is off by O(1).
PIPE_TOL_INTERPRETED = {**PIPE_TOL, torch.bfloat16: 4e-2}


def pipe_tol(cpu_path, dtype) -> float:
    return (PIPE_TOL_INTERPRETED if cpu_path == "triton_interpret" else PIPE_TOL)[dtype]


EDGES = [-(2 ** 63), -(2 ** 40), -(2 ** 31), -129, 127, 255, 2 ** 31 - 1, 2 ** 32 + 2, 2 ** 40, 2 ** 63 - 1]


def adversarial(bound: int, dtype: torch.dtype):
    """Integers of `dtype` around a bound: in range, just outside, negative, and at the edges of
    int8 ... int64 (only values `dtype` can hold, so the test itself never wraps)."""
    info = torch.iinfo(dtype)
    near = st.integers(max(-2, info.min), min(bound + 2, info.max))
    edges = [v for v in EDGES if info.min <= v <= info.max]
    return st.one_of(near, st.sampled_from(edges))


def int_tensor(values, shape, dtype):
    return torch.tensor(values, dtype=torch.int64).to(dtype).reshape(shape)


def run_examples(cpu_path, body, torch_examples: int, interpreted_examples: int):
    """Run the @given `body` with a budget that depends on the CPU path (the interpreter is slow)."""
    n = torch_examples if cpu_path == "torch" else interpreted_examples
    settings(max_examples=n, deadline=None, database=None,
             suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])(body)()


GELU_FAMILY = frozenset({MoEActivation.GELU, MoEActivation.GELU_TANH, MoEActivation.GELU_NO_MUL,
                         MoEActivation.GELU_TANH_NO_MUL})


def gelu_cancellation(act: MoEActivation, x: torch.Tensor) -> float:
    """Where a float32 GELU loses relative accuracy: the norm of |g| / 2 * |u| (u = 1 ungated) for
    the GELU family, 0 for the others. GELU is g / 2 * (1 + erf(g / sqrt 2)) (tanh for gelu_tanh);
    for g far below zero the sum cancels, so a float32 evaluation (torch's own F.gelu, and ours,
    which computes the same formula) is exact to a few ulps of g / 2, not of its tiny result: at
    g = -3.92 the float32 GELU is off by 1.9e-4 of its value."""
    if act not in GELU_FAMILY:
        return 0.0
    x = x.double()
    if not act.is_gated:
        return (x.abs() / 2).norm().item()
    d = x.shape[-1] // 2
    return (x[..., :d].abs() / 2 * x[..., d:].abs()).norm().item()


# ---------------------------------------------------------------------------------------------

def test_apply_moe_activation_property(cpu_path):
    @given(st.sampled_from(list(MoEActivation)), st.sampled_from(FLOATS), st.booleans(),
           st.integers(1, 3), st.integers(0, 6), st.integers(1, 5), st.sampled_from(INT_DTYPES), st.data())
    def body(act, dtype, batched, E, T, d, count_dtype, data):
        width = 2 * d if act.is_gated else d
        # situ has no default beta; every other activation runs on its defaults.
        cfg = ApplyMoEActivationConfig(situ_beta=4.0) if act == MoEActivation.SITU else None
        ref_kw = {"situ_beta": 4.0} if act == MoEActivation.SITU else {}
        shape = (E, T) if batched else (T,)
        n_counts = E if batched else 1
        counts = data.draw(st.lists(adversarial(T, count_dtype), min_size=n_counts, max_size=n_counts))
        counts_t = int_tensor(counts, (n_counts,), count_dtype)
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31)))
        x = (torch.randn(*shape, width, generator=gen) * 2).to(dtype)
        clamped = [max(0, min(c, T)) for c in counts]
        for i, c in enumerate(clamped):
            (x[i] if batched else x)[c:] = float("nan")  # never read
        out = torch.full((*shape, d), float("nan"), dtype=dtype)
        try:
            apply_moe_activation(act, out, x, valid_token_counts=counts_t, activation_config=cfg)
        except NotImplementedError:
            assert act == MoEActivation.RELU2
            return
        except TypeError as exc:
            assert count_dtype not in ACCEPTED_INT and "valid_token_counts" in str(exc)
            return
        assert act != MoEActivation.RELU2 and count_dtype in ACCEPTED_INT
        for i, c in enumerate(clamped):
            o, xi = (out[i], x[i]) if batched else (out, x)
            assert torch.isnan(o[c:]).all(), "rows past the count must stay untouched"
            if c:
                ref = activation_f64(act.value, xi[:c], **ref_kw)
                ref_norm = ref.norm().item()
                # rel_err's bound as an absolute one, plus 16 float32 ulps of the GELU family's
                # cancelling term (`gelu_cancellation`).
                slack = 16 * 2.0 ** -23 * gelu_cancellation(act, xi[:c])
                assert rel_err(o[:c], ref) * (ref_norm or 1.0) <= REL_TOL[dtype] * 4 * (ref_norm or 1.0) + slack

    run_examples(cpu_path, body, 40, 15)


def test_fused_experts_property(cpu_path):
    @given(st.sampled_from(["silu", "gelu_tanh", "swigluoai", "relu2_no_mul", "relu2"]),
           st.sampled_from(FLOATS), st.integers(1, 6), st.integers(1, 5), st.integers(1, 3),
           st.sampled_from([None, "indexed", "grouped_contiguous"]), st.sampled_from(INT_DTYPES),
           st.one_of(st.none(), st.integers(-2, 8)), st.data())
    def body(activation, dtype, M, E, k, layout, id_dtype, vt, data):
        K, N = 32, 16
        ids = data.draw(st.lists(adversarial(E, id_dtype), min_size=M * k, max_size=M * k))
        ids_t = int_tensor(ids, (M, k), id_dtype)
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31)))
        gated = not activation.endswith("_no_mul")
        x = torch.randn(M, K, generator=gen).to(dtype)
        w13 = (torch.randn(E, (2 if gated else 1) * N, K, generator=gen) * 0.2).to(dtype)
        w2 = (torch.randn(E, K, N, generator=gen) * 0.2).to(dtype)
        tw = torch.rand(M, k, generator=gen)
        n_valid = M if vt is None else max(0, min(vt, M))
        x[n_valid:] = float("nan")
        vt_t = None if vt is None else torch.tensor([vt], dtype=torch.int32)
        try:
            out = fused_experts(x, w13, w2, tw, ids_t, activation=activation, layout=layout, valid_tokens=vt_t)
        except NotImplementedError:
            assert activation == "relu2"
            return
        except TypeError as exc:
            assert id_dtype not in ACCEPTED_INT and "topk_ids" in str(exc)
            return
        assert activation != "relu2" and id_dtype in ACCEPTED_INT
        ref = reference_moe(x, w13, w2, tw, ids_t, activation=activation, valid_tokens=n_valid)
        assert out.shape == (M, K) and out.dtype == dtype
        assert rel_err(out[:n_valid], ref[:n_valid]) <= pipe_tol(cpu_path, dtype)

    run_examples(cpu_path, body, 30, 8)


def test_batched_experts_property(cpu_path):
    @given(st.sampled_from(FLOATS), st.integers(1, 4), st.integers(1, 5), st.sampled_from(INT_DTYPES), st.data())
    def body(dtype, L, T, count_dtype, data):
        K, N = 32, 16
        counts = data.draw(st.lists(adversarial(T, count_dtype), min_size=L, max_size=L))
        counts_t = int_tensor(counts, (L,), count_dtype)
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31)))
        x = torch.randn(L, T, K, generator=gen).to(dtype)
        w13 = (torch.randn(L, 2 * N, K, generator=gen) * 0.2).to(dtype)
        w2 = (torch.randn(L, K, N, generator=gen) * 0.2).to(dtype)
        clamped = [max(0, min(c, T)) for c in counts]
        for e, c in enumerate(clamped):
            x[e, c:] = float("nan")
        out = torch.full_like(x, float("nan"))
        try:
            batched_experts(x, counts_t, w13, w2, activation="silu", out=out)
        except TypeError as exc:
            assert count_dtype not in ACCEPTED_INT and "counts" in str(exc)
            return
        assert count_dtype in ACCEPTED_INT
        for e, c in enumerate(clamped):
            assert torch.isnan(out[e, c:]).all(), "rows past the count must stay untouched"
            if c:
                h = x[e, :c].double() @ w13[e].double().T
                ref = activation_f64("silu", h) @ w2[e].double().T
                assert rel_err(out[e, :c], ref) <= pipe_tol(cpu_path, dtype)

    run_examples(cpu_path, body, 30, 10)


def _kept_slots(ids, E, n_valid, t_max):
    """Which (token, slot) pairs the layout keeps: ids in [0, E), rows before n_valid, and (with a
    capacity) the first t_max slots of each expert in slot order."""
    M, k = len(ids), len(ids[0])
    seen = [0] * E
    kept = [[False] * k for _ in range(M)]
    for t in range(M):
        for j in range(k):
            e = ids[t][j]
            if t < n_valid and 0 <= e < E:
                if t_max is None or seen[e] < t_max:
                    kept[t][j] = True
                seen[e] += 1
    return kept, sum(max(0, s - t_max) for s in seen) if t_max is not None else 0


def test_layout_roundtrip_property(cpu_path):
    @given(st.sampled_from(list(GemmLayout)), st.integers(1, 6), st.integers(1, 5), st.integers(1, 3),
           st.sampled_from(INT_DTYPES), st.one_of(st.none(), st.integers(-1, 7)),
           st.one_of(st.none(), st.integers(0, 6)), st.booleans(), st.data())
    def body(layout, M, E, k, id_dtype, vt, t_max, drop, data):
        K = 8
        ids = data.draw(st.lists(adversarial(E, id_dtype), min_size=M * k, max_size=M * k))
        ids_t = int_tensor(ids, (M, k), id_dtype)
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31)))
        n_valid = M if vt is None else max(0, min(vt, M))
        vt_t = None if vt is None else torch.tensor([vt], dtype=torch.int32)
        masked = layout == GemmLayout.GROUPED_MASKED
        try:
            meta = build_layout(layout, ids_t, E, valid_tokens=vt_t, max_tokens_per_expert=t_max,
                                drop_overflow=drop)
        except TypeError as exc:
            assert id_dtype not in ACCEPTED_INT and "topk_ids" in str(exc)
            return
        except ValueError as exc:
            # Losing tokens is opt-in: a capacity below M*k needs drop_overflow=True.
            assert masked and t_max is not None and t_max < M * k and not drop
            assert "max_tokens_per_expert" in str(exc) and "drop_overflow" in str(exc)
            return
        assert id_dtype in ACCEPTED_INT
        hidden = torch.randn(M, K, generator=gen)
        hidden[n_valid:] = float("nan")
        weights = torch.rand(M, k, generator=gen)
        # The identity expert: each slot's row is its token's row.
        y = hidden.repeat_interleave(k, 0) if layout == GemmLayout.INDEXED else permute(hidden, meta)
        out = torch.full((M, K), float("nan"))
        unpermute(out, y, weights, meta)
        rows = ids_t.long().tolist()
        kept, overflow = _kept_slots(rows, E, n_valid, t_max if masked else None)
        if masked:
            assert int(meta.overflow) == overflow
            if not drop:
                assert overflow == 0, "no tokens may be lost without drop_overflow=True"
        keep = torch.tensor(kept, dtype=torch.float64).reshape(M, k)
        ref = (weights.double() * keep).sum(1, keepdim=True) * hidden.double()
        assert rel_err(out[:n_valid], ref[:n_valid]) <= 1e-6

    run_examples(cpu_path, body, 40, 15)


def test_fused_moe_property(cpu_path):
    @given(st.integers(1, 6), st.integers(1, 3), st.sampled_from([torch.float32, torch.bfloat16]),
           st.sampled_from([(5,), (2, 3), (1, 1, 4)]), st.integers(-1, 1), st.booleans(), st.data())
    def body(E, k, dtype, lead, width_delta, give_logits, data):
        if k > E:
            with pytest.raises(ValueError, match="top_k"):
                FusedMoE(E, k, 32, 16, dtype=dtype)
            return
        layer = FusedMoE(E, k, 32, 16, dtype=dtype, router="softmax_renorm")
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31)))
        x = torch.randn(*lead, 32 + width_delta, generator=gen).to(dtype)
        tokens = x.numel() // x.shape[-1]
        logits = torch.randn(tokens, E + data.draw(st.integers(-1, 1)), generator=gen) if give_logits else None
        bad_logits = give_logits and logits.shape[1] != E
        with torch.no_grad():
            if width_delta:
                with pytest.raises(ValueError, match="hidden_states"):
                    layer(x, logits)
                return
            if bad_logits:
                with pytest.raises(ValueError, match="router_logits"):
                    layer(x, logits)
                return
            out = layer(x, logits)
            flat = x.reshape(-1, 32)
            weights, ids = layer.route(layer.gate(flat) if logits is None else logits)
        ref = reference_moe(flat, layer.w13, layer.w2, weights, ids, activation="silu")
        assert out.shape == x.shape and torch.isfinite(out).all()
        assert rel_err(out.reshape(-1, 32), ref) <= pipe_tol(cpu_path, dtype)

    run_examples(cpu_path, body, 25, 8)
