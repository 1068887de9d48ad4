"""The decode path (`padded_moe.decode`) against the float64 oracle, under Triton's interpreter.

Calls of at most `DECODE_MAX_SLOTS` slots with the layout left to `fused_experts` run two kernels
that route the slots themselves; every test here checks that the path was taken (or not) and its
result against `reference_moe`, with garbage ids, NaN in rows that must never be read, and
sentinels in rows that must never be written.
"""

import pytest
import torch
import triton
import triton.language as tl

from helpers import SENTINEL, rel_err
from padded_moe import decode as dec
from padded_moe.activation import ApplyMoEActivationConfig, MoEActivation
from padded_moe.expert_map import ExpertMap
from padded_moe.experts import fused_experts
from padded_moe.kernels.decode import _mx4_step, _mx_step, _mxw_step
from padded_moe.layer import dense_weights
from padded_moe.mxfp4 import quantize_mxfp4
from padded_moe.reference.moe import reference_moe

K, N = 96, 48  # neither a multiple of the interpreter's tiles: the masked tails run too
# bf16 under the interpreter: Triton 3.6's interpreter does not round float32 -> bf16 to nearest
# even (half of random values come out one step off torch's cast, biased one way), and each path
# rounds three times (GEMM1 out, activation out, GEMM2 out) before the sum. The float64 reference
# then sees 1.1-1.4% relative L2 error on these shapes (0.7% through torch's casts), so 1.5e-2
# failed now and then; a wrong weight, scale or row is off by O(1).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.5e-2}
GATED = ["silu", "gelu", "gelu_tanh", "swigluoai", "swigluoai_uninterleave", "swiglustep", "situ"]
UNGATED = ["silu_no_mul", "gelu_no_mul", "gelu_tanh_no_mul", "relu2_no_mul"]


@pytest.fixture
def interpreted(monkeypatch):
    from padded_moe._platform import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("Triton kernels were compiled for a GPU; the interpreter is not in use")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(dec.DECODE_ENV, raising=False)
    monkeypatch.delenv("PADDED_MOE_GEMM_LAYOUT", raising=False)


def make(M, k, E, gen, dtype=torch.float32, gated=True, bias=False, scale=0.1):
    x = torch.randn(M, K, generator=gen).to(dtype)
    w13 = (torch.randn(E, (2 if gated else 1) * N, K, generator=gen) * scale).to(dtype)
    w2 = (torch.randn(E, K, N, generator=gen) * scale).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    tw = torch.rand(M, k, generator=gen)
    tw = tw / tw.sum(-1, keepdim=True)
    b13 = (torch.randn(E, w13.shape[1], generator=gen) * 0.5).to(dtype) if bias else None
    b2 = (torch.randn(E, K, generator=gen) * 0.5).to(dtype) if bias else None
    return x, w13, w2, tw, ids, b13, b2


@triton.jit
def _probe_mx_step(b_ptr, s_ptr, v_ptr, out_ptr, K, ROWS: tl.constexpr, G: tl.constexpr):
    """One `_mx_step` over K = 32*G columns of ROWS rows, all meeting the vector at `v_ptr`."""
    r = tl.arange(0, ROWS)[:, None]
    part = _mx_step(b_ptr + r * (K // 2), s_ptr + r * (K // 32), 1, v_ptr + r * 0, 0, K, r < ROWS, r >= 0, G)
    tl.store(out_ptr + r * G + tl.arange(0, G)[None, :], part)


@triton.jit
def _probe_mxw_step(w_ptr, s_ptr, v_ptr, out_ptr, K, ROWS: tl.constexpr, G: tl.constexpr):
    """One `_mxw_step` (portable upcast) over K = 32*G columns of ROWS rows of canonical bytes
    read as int32 words."""
    r = tl.arange(0, ROWS)[:, None]
    part = _mxw_step(w_ptr + r * (K // 8), s_ptr + r * (K // 32), 1, v_ptr, 0, K, K // 2, r < ROWS, True, G, False)
    tl.store(out_ptr + r * G + tl.arange(0, G)[None, :], part)


@triton.jit
def _probe_mx4_step(w_ptr, s_ptr, v_ptr, out_ptr, K, KW, ROWS: tl.constexpr, G: tl.constexpr,
                    FOLDED: tl.constexpr):
    """One `_mx4_step` (portable upcast) over columns [0, 32*G) of ROWS prepared rows (scales
    `[KW/4, ROWS]`), all meeting the vector at `v_ptr`."""
    r = tl.arange(0, ROWS)[:, None]
    part = _mx4_step(w_ptr + r * KW, s_ptr + r, ROWS, v_ptr, 0, K, KW * 4, r < ROWS, True, G, False, FOLDED, False)
    tl.store(out_ptr + r * G + tl.arange(0, G)[None, :], part)


def every_code_everywhere(rows: int, K: int) -> torch.Tensor:
    """Packed bytes `[1, rows, K/2]` in which row r holds code (r + c) % 16 at column c: every
    code at every position, in both nibbles."""
    codes = torch.arange(16, dtype=torch.uint8)
    col = torch.arange(K // 2)
    lo = codes[(torch.arange(rows)[:, None] + 2 * col) % 16]
    hi = codes[(torch.arange(rows)[:, None] + 2 * col + 1) % 16]
    return (lo | (hi << 4)).reshape(1, rows, K // 2)


def act_config(act):
    return ApplyMoEActivationConfig(situ_beta=4.0, situ_linear_beta=3.0) if act == "situ" else None


def ref_kwargs(act):
    return dict(situ_beta=4.0, situ_lambda=3.0) if act == "situ" else {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", GATED + UNGATED)
def test_every_activation_matches_reference(interpreted, decode_calls, act, dtype, gen):
    M, k, E = 3, 4, 9
    x, w13, w2, tw, ids, b13, b2 = make(M, k, E, gen, dtype, gated=MoEActivation(act).is_gated, bias=True)
    out = fused_experts(x, w13, w2, tw, ids, activation=act, activation_config=act_config(act),
                        w13_bias=b13, w2_bias=b2)
    assert decode_calls == [M]
    ref = reference_moe(x, w13, w2, tw, ids, activation=act, activation_kwargs=ref_kwargs(act),
                        w13_bias=b13, w2_bias=b2)
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("read", dec.W13_READS)
@pytest.mark.parametrize("act", ["silu", "swigluoai", "relu2_no_mul"])
def test_w13_reads_match_reference(interpreted, decode_calls, monkeypatch, act, read, gen):
    """Both GEMM1 weight reads (TMA tiles on the MMA's M side, per-thread copies) on gate-first,
    interleaved and non-gated rows, with a dropped slot, an expert repeated across tokens, an
    expert map and valid_tokens (the NaN row past it never read)."""
    monkeypatch.setattr(dec, "W13_READ", read)
    taken, real = [], dec._w13_descriptor
    monkeypatch.setattr(dec, "_w13_descriptor", lambda *a: taken.append(real(*a)) or taken[-1])
    M, k, E = 4, 3, 10
    x, w13, w2, tw, ids, b13, b2 = make(M, k, E, gen, torch.bfloat16, gated=MoEActivation(act).is_gated, bias=True)
    emap = ExpertMap(E, ep_rank=0, ep_size=2)
    local = lambda t: t[:emap.num_local].contiguous()  # noqa: E731
    ids[0, 1] = -1
    ids[1, 0] = ids[0, 0] = 2
    x[M - 1] = float("nan")
    vt = torch.tensor([M - 1], dtype=torch.int32)
    out = fused_experts(x, local(w13), local(w2), tw, ids, activation=act, expert_map=emap, valid_tokens=vt,
                        w13_bias=local(b13), w2_bias=local(b2))
    assert decode_calls == [M]
    assert (taken[0] is not None) == (read == "tma")
    ref = reference_moe(x, local(w13), local(w2), tw, ids, activation=act, expert_map=emap.map, num_experts=E,
                        w13_bias=local(b13), w2_bias=local(b2), valid_tokens=M - 1)
    assert rel_err(out[:M - 1], ref[:M - 1]) <= TOL[torch.bfloat16]


def test_w13_read_setting_and_weights_the_tma_read_refuses(interpreted, monkeypatch, gen):
    x, w13, *_ = make(2, 2, 4, gen, torch.bfloat16)
    tiles = dec.INTERPRET_TILES
    silu = MoEActivation("silu")
    assert dec._w13_descriptor(w13, x, silu, tiles)[1:] == (32, True)  # BN raised to 32: 64 weight rows
    assert dec._w13_descriptor(w13, x, MoEActivation("swigluoai"), tiles)[1:] == (32, False)
    assert dec._w13_descriptor(w13[:, :48].contiguous(), x, MoEActivation("relu2_no_mul"), tiles)[1:] == (64, False)
    assert dec._w13_descriptor(w13[::2], x, silu, tiles) is None  # experts not one run of rows
    assert dec._w13_descriptor(w13.float(), x.float(), silu, tiles) is None  # fp32: the exact FMA dot
    monkeypatch.setattr(dec, "W13_READ", "pointer")
    assert dec._w13_descriptor(w13, x, silu, tiles) is None
    monkeypatch.setattr(dec, "W13_READ", "ldg")
    with pytest.raises(ValueError, match="W13_READ must be one of tma, pointer"):
        dec._w13_descriptor(w13, x, silu, tiles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_the_layout_path(interpreted, decode_calls, monkeypatch, dtype, gen):
    """Same roundings as the layout path (GEMM outputs rounded to the activation dtype, fp32
    weighted sum in slot order): the two agree to the GEMMs' summation order."""
    x, w13, w2, tw, ids, b13, b2 = make(4, 4, 16, gen, dtype, bias=True)
    fast = fused_experts(x, w13, w2, tw, ids, activation="swigluoai", w13_bias=b13, w2_bias=b2)
    monkeypatch.setenv(dec.DECODE_ENV, "off")
    slow = fused_experts(x, w13, w2, tw, ids, activation="swigluoai", w13_bias=b13, w2_bias=b2)
    assert decode_calls == [4]
    assert rel_err(fast, slow) <= {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]


def test_garbage_and_repeated_ids(interpreted, decode_calls, gen):
    """Invalid ids are dropped, a token with nothing kept gets zeros, and an expert routed from
    several slots (repeats inside a token, across tokens) is computed for all of them at once."""
    M, k, E = 4, 4, 6
    x, w13, w2, tw, ids, _, _ = make(M, k, E, gen)
    ids = ids.to(torch.int64)
    ids[0] = torch.tensor([2, 2, -1, E])  # a repeat inside a token, padding, one past the end
    ids[1] = torch.tensor([-1, 2**31 - 1, 2**40, -(2**33)])  # nothing kept (int64 ids past int32)
    ids[2] = torch.tensor([2, 5, 0, 2])
    out = fused_experts(x, w13, w2, tw, ids, activation="silu")
    assert decode_calls == [M]
    ref = reference_moe(x, w13, w2, tw, ids, activation="silu")
    assert rel_err(out, ref) <= TOL[torch.float32]
    assert (out[1] == 0).all()


def test_expert_map_and_valid_tokens(interpreted, decode_calls, gen):
    """EP's flat buffer: global ids, other ranks' experts dropped, NaN hidden rows and garbage ids
    past `valid_tokens` never read, and output rows past it never written."""
    M, k, E = 4, 3, 10
    emap = ExpertMap(E, ep_rank=1, ep_size=2)
    x, w13, w2, tw, ids, b13, b2 = make(M, k, E, gen, bias=True)
    w13, w2, b13, b2 = w13[: emap.num_local], w2[: emap.num_local], b13[: emap.num_local], b2[: emap.num_local]
    valid = 3
    x[valid:] = float("nan")
    ids[valid:] = torch.tensor([[-1, E + 7, 3]] * (M - valid), dtype=torch.int32)
    vt = torch.tensor([valid], dtype=torch.int32)
    out = fused_experts(x, w13, w2, tw, ids, activation="gelu", expert_map=emap, valid_tokens=vt,
                        w13_bias=b13, w2_bias=b2)
    assert decode_calls == [M]
    ref = reference_moe(x, w13, w2, tw, ids, activation="gelu", expert_map=emap.map, w13_bias=b13, w2_bias=b2,
                        valid_tokens=valid)
    assert rel_err(out[:valid], ref[:valid]) <= TOL[torch.float32]


def test_unread_and_unwritten_rows(interpreted, gen):
    """Called directly: `h` rows of dropped slots stay NaN (never computed, never read), output rows
    at/after `valid_tokens` keep their sentinel."""
    M, k, E = 4, 2, 5
    x, w13, w2, tw, ids, _, _ = make(M, k, E, gen)
    ids[0, 1] = -1
    vt = torch.tensor([3], dtype=torch.int32)
    x[3] = float("nan")
    h = torch.full((M * k, N), float("nan"))
    out = torch.full((M, K), SENTINEL)
    dec.decode_experts(x, w13, w2, tw, ids, MoEActivation.SILU, ApplyMoEActivationConfig(), E, None, None, None,
                       vt, h, out)
    ref = reference_moe(x, w13, w2, tw, ids, activation="silu", valid_tokens=3)
    assert rel_err(out[:3], ref[:3]) <= TOL[torch.float32]
    assert (out[3] == SENTINEL).all()
    assert torch.isnan(h[1]).all() and torch.isnan(h[6:]).all()  # dropped slot; slots of token 3
    assert torch.isfinite(h[[0, 2, 3, 4, 5]]).all()


def test_when_the_path_is_taken(interpreted, decode_calls, monkeypatch, gen):
    x, w13, w2, tw, ids, _, _ = make(4, 4, 8, gen)
    fused_experts(x, w13, w2, tw, ids, activation="silu")  # 16 slots: the limit
    assert decode_calls == [4]
    x5, _, _, tw5, ids5, _, _ = make(5, 4, 8, gen)
    fused_experts(x5, w13, w2, tw5, ids5, activation="silu")  # 20 slots
    fused_experts(x5, w13, w2, tw5[:, :2].contiguous(), ids5[:, :2].contiguous(), activation="silu")  # 5 tokens
    fused_experts(x, w13, w2, tw, ids, activation="silu", layout="indexed")  # the caller chose a layout
    monkeypatch.setenv("PADDED_MOE_GEMM_LAYOUT", "grouped")
    fused_experts(x, w13, w2, tw, ids, activation="silu")  # ... or the variable did
    monkeypatch.setenv("PADDED_MOE_GEMM_LAYOUT", "auto")
    fused_experts(x, w13, w2, tw, ids, activation="silu", backend="torch")  # another backend
    fused_experts(x, w13, w2, tw, ids, activation=lambda h: torch.nn.functional.silu(h[:, :N]) * h[:, N:])
    w13m = quantize_mxfp4(torch.randn(8, 128, K, generator=gen))
    w2m = quantize_mxfp4(torch.randn(8, K, 64, generator=gen))
    fused_experts(x, w13m, w2m, tw, ids, activation="silu")  # MXFP4 weights: taken too
    assert decode_calls == [4, 4]
    decode_calls.pop()
    monkeypatch.setenv(dec.DECODE_ENV, "off")
    fused_experts(x, w13, w2, tw, ids, activation="silu")
    assert decode_calls == [4]
    monkeypatch.setenv(dec.DECODE_ENV, "AUTO")
    fused_experts(x, w13, w2, tw, ids, activation="silu")
    assert decode_calls == [4, 4]


def test_bad_setting_is_refused(interpreted, monkeypatch, gen):
    x, w13, w2, tw, ids, _, _ = make(1, 2, 4, gen)
    monkeypatch.setenv(dec.DECODE_ENV, "fast")
    with pytest.raises(ValueError, match="PADDED_MOE_DECODE must be one of auto, off, got 'fast'"):
        fused_experts(x, w13, w2, tw, ids, activation="silu")


def test_bad_bias_gets_the_layout_paths_error(interpreted, gen):
    x, w13, w2, tw, ids, b13, _ = make(1, 2, 4, gen, bias=True)
    with pytest.raises(ValueError, match="bias"):
        fused_experts(x, w13, w2, tw, ids, activation="silu", w13_bias=b13[:, :N])


@pytest.mark.parametrize("prepared,step", [(False, "bytes"), (True, "bytes"), (False, "words"), (True, "words"),
                                           (True, "prepared"), (False, "prepared")])
def test_mxfp4_weights(interpreted, decode_calls, monkeypatch, prepared, step, gen):
    """MXFP4 experts, every way the decode kernels read them (`MX_STEP`: the canonical bytes, also
    when the weight carries its prepared form; the same bytes as words; the prepared 4-plane
    words, or the canonical words where there are none), with biases, the interleaved swigluoai, a repeated expert and garbage ids; K and N
    multiples of 32 but of no tile, nor of the prepared form's 64-column blocks (words past K are
    the padding). The values are exact MXFP4 (codes times E8M0 scales), so the kernels' decoding
    is checked against `dense_weights`' own."""
    monkeypatch.setattr(dec, "MX_STEP", step)
    M, k, E, Km, Nm = 3, 4, 6, 96, 160
    x = torch.randn(M, Km, generator=gen).to(torch.bfloat16)
    w13 = quantize_mxfp4(torch.randn(E, 2 * Nm, Km, generator=gen) * 0.1)
    w2 = quantize_mxfp4(torch.randn(E, Km, Nm, generator=gen) * 0.1)
    if prepared:
        w13, w2 = w13.prepare_for(), w2.prepare_for()
    b13 = torch.randn(E, 2 * Nm, generator=gen).to(torch.bfloat16)
    b2 = torch.randn(E, Km, generator=gen).to(torch.bfloat16)
    tw = torch.rand(M, k, generator=gen)
    ids = torch.tensor([[1, 1, -1, 5], [0, E, 3, 2], [4, 5, 1, 2**31 - 1]], dtype=torch.int32)
    out = fused_experts(x, w13, w2, tw, ids, activation="swigluoai", w13_bias=b13, w2_bias=b2)
    assert decode_calls == [M]
    ref = reference_moe(x, dense_weights(w13), dense_weights(w2), tw, ids, activation="swigluoai",
                        w13_bias=b13, w2_bias=b2)
    assert rel_err(out, ref) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("act", ["silu", "relu2_no_mul"])
def test_mxfp4_expert_map_and_valid_tokens(interpreted, decode_calls, monkeypatch, act, gen):
    """MXFP4 experts behind an expert map with valid_tokens: the NaN hidden row past it is never
    read, non-local and invalid ids contribute nothing; GEMM1's scales span five decades."""
    M, k, E, Km, Nm = 2, 2, 8, 64, 96
    emap = ExpertMap(E, ep_rank=1, ep_size=2)
    L = emap.num_local
    gated = act == "silu"
    x = torch.randn(M, Km, generator=gen).to(torch.bfloat16)
    x[1] = float("nan")
    spread = torch.logspace(-4, 1, Km)  # per-column magnitudes: scales far apart
    w13 = quantize_mxfp4(torch.randn(L, (2 if gated else 1) * Nm, Km, generator=gen) * spread)
    w2 = quantize_mxfp4(torch.randn(L, Km, Nm, generator=gen) * 0.1)
    tw = torch.rand(M, k, generator=gen)
    ids = torch.tensor([[4, 0], [5, 7]], dtype=torch.int32)  # 0: not local
    vt = torch.tensor([1], dtype=torch.int32)
    out = fused_experts(x, w13, w2, tw, ids, activation=act, expert_map=emap, valid_tokens=vt)
    assert decode_calls == [M]
    ref = reference_moe(x, dense_weights(w13), dense_weights(w2), tw, ids, activation=act, expert_map=emap.map,
                        num_experts=E, valid_tokens=1)
    assert torch.isfinite(out[:1]).all()
    # Wide scales make bf16's roundings of GEMM1's output the main error (~1.5% on both paths):
    # within the layout path's own error of the oracle, and a bound that no wrong decode meets.
    monkeypatch.setenv(dec.DECODE_ENV, "off")
    layout_path = fused_experts(x, w13, w2, tw, ids, activation=act, expert_map=emap, valid_tokens=vt)
    assert rel_err(out[:1], ref[:1]) <= max(TOL[torch.bfloat16], 1.25 * rel_err(layout_path[:1], ref[:1])) <= 0.04


@pytest.mark.parametrize("fold", [False, True], ids=["byte-scales", "folded-scales"])
def test_mxfp4_prepared_words_read_by_the_decode_kernels(interpreted, decode_calls, monkeypatch, fold, gen):
    """With `MX_STEP = "prepared"`, both decode kernels read the prepared 4-plane words and
    transposed scales (folded or E8M0 bytes) and give the canonical bytes' result: same decoded
    values, products summed in another order."""
    from padded_moe.mxfp4 import prepare_hopper

    M, k, E, Km, Nm = 2, 3, 5, 160, 96
    x = torch.randn(M, Km, generator=gen).to(torch.bfloat16)
    w13 = quantize_mxfp4(torch.randn(E, 2 * Nm, Km, generator=gen) * 0.1)
    w2 = quantize_mxfp4(torch.randn(E, Km, Nm, generator=gen) * 0.1)
    for w in (w13, w2):
        object.__setattr__(w, "hopper", prepare_hopper(w, fold=fold))
        assert w.hopper.folded == fold and w.hopper.planes == 4
    tw = torch.rand(M, k, generator=gen)
    ids = torch.tensor([[1, 4, -1], [0, 4, 3]], dtype=torch.int32)
    monkeypatch.setattr(dec, "MX_STEP", "prepared")
    out = fused_experts(x, w13, w2, tw, ids, activation="silu")
    monkeypatch.setattr(dec, "MX_STEP", "bytes")
    canonical = fused_experts(x, w13, w2, tw, ids, activation="silu")
    assert decode_calls == [M, M]
    torch.testing.assert_close(out, canonical, rtol=1e-2, atol=1e-3)
    # Both are bounded by bf16's rounding of GEMM1's output; a wrong decode is far past this.
    ref = reference_moe(x, dense_weights(w13), dense_weights(w2), tw, ids, activation="silu")
    assert rel_err(out, ref) <= 1.25 * max(TOL[torch.bfloat16], rel_err(canonical, ref)) <= 0.04


@pytest.mark.parametrize("fold", [False, True], ids=["byte-scales", "folded-scales"])
@pytest.mark.parametrize("act", ["silu", "swigluoai", "relu2_no_mul"])
def test_mxfp4_gemm1_as_an_mma(interpreted, decode_calls, monkeypatch, act, fold, gen):
    """`MX_W13 = "dot"` (the default for one token): MXFP4 GEMM1 as the prepared-MXFP4 GEMM's tile over the expert's slots
    (`_decode_w13_mx_dot_kernel`) on gate-first, interleaved and non-gated rows, folded and byte
    scales, with biases, an expert shared by two tokens, dropped and garbage ids, a NaN hidden row
    past `valid_tokens`; K a multiple of 32 but of no 64-column block or step. The kernel must be
    the one launched, and the result that of the GEMV route within bf16's rounding of GEMM1's
    output (a wrong row, scale or slot is off by O(1))."""
    from padded_moe.kernels import _launch
    from padded_moe.kernels.decode import _decode_w13_mx_dot_kernel, _decode_w13_mx_kernel
    from padded_moe.mxfp4 import prepare_hopper

    M, k, E, Km, Nm = 3, 3, 6, 96, 96
    gated = MoEActivation(act).is_gated
    x = torch.randn(M, Km, generator=gen).to(torch.bfloat16)
    x[2] = float("nan")  # past valid_tokens: never read
    w13 = quantize_mxfp4(torch.randn(E, (2 if gated else 1) * Nm, Km, generator=gen) * 0.1)
    w2 = quantize_mxfp4(torch.randn(E, Km, Nm, generator=gen) * 0.1)
    for w in (w13, w2):
        object.__setattr__(w, "hopper", prepare_hopper(w, fold=fold))
    b13 = torch.randn(E, w13.shape[1], generator=gen).to(torch.bfloat16)
    b2 = torch.randn(E, Km, generator=gen).to(torch.bfloat16)
    tw = torch.rand(M, k, generator=gen)
    ids = torch.tensor([[1, -1, 5], [5, E, 2], [0, 1, 2]], dtype=torch.int32)
    vt = torch.tensor([2], dtype=torch.int32)
    launched = []
    real = _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda fn, *a, **kw: launched.append(fn) or real(fn, *a, **kw))
    runs = {}
    for route in ("gemv", "dot"):
        monkeypatch.setattr(dec, "MX_W13", route)
        runs[route] = fused_experts(x, w13, w2, tw, ids, activation=act, w13_bias=b13, w2_bias=b2,
                                    valid_tokens=vt)
    assert decode_calls == [M, M]
    assert launched[0] is _decode_w13_mx_kernel and launched[2] is _decode_w13_mx_dot_kernel
    monkeypatch.setattr(dec, "MX_W13", "auto")  # the MMA for one token, the GEMV for more
    fused_experts(x, w13, w2, tw, ids, activation=act)
    fused_experts(x[:1], w13, w2, tw[:1], ids[:1], activation=act)
    assert launched[4] is _decode_w13_mx_kernel and launched[6] is _decode_w13_mx_dot_kernel
    ref = reference_moe(x, dense_weights(w13), dense_weights(w2), tw, ids, activation=act, w13_bias=b13,
                        w2_bias=b2, valid_tokens=2)
    assert torch.isfinite(runs["dot"][:2]).all()
    assert rel_err(runs["dot"][:2], ref[:2]) <= 1.25 * max(TOL[torch.bfloat16], rel_err(runs["gemv"][:2], ref[:2]))
    monkeypatch.setattr(dec, "MX_W13", "mma")
    with pytest.raises(ValueError, match="MX_W13"):
        fused_experts(x, w13, w2, tw, ids, activation=act)


@pytest.mark.parametrize("fold", [False, True], ids=["byte-scales", "folded-scales"])
def test_mxfp4_prepared_step_decodes_every_code_exactly(interpreted, fold):
    """`_mx4_step` against `dequantize_mxfp4` in float32, bit for bit, through the prepared
    arrangement: every code at every position of the 4-plane words, scales across the range a
    folded arrangement allows (and beyond it for E8M0 bytes). A one-hot vector at column c makes
    c's scale group equal to the weight itself."""
    from padded_moe.mxfp4 import FOLD_MAX_SCALE, Mxfp4Tensor, dequantize_mxfp4, prepare_hopper

    rows, K = 16, 64
    blocks = every_code_everywhere(rows, K)
    top = FOLD_MAX_SCALE if fold else 254
    scales = torch.tensor([1, 2, 60, 100, 126, 127, 128, top, 3, 90, 120, 125, 127, 126, top, top - 1] * 2,
                          dtype=torch.uint8).reshape(1, rows, K // 32)
    q = Mxfp4Tensor(blocks.contiguous(), scales.contiguous())
    h = prepare_hopper(q, fold=fold)
    dense = dequantize_mxfp4(q, torch.float32)[0]
    words, hs = h.blocks[0].contiguous(), h.scales[0].contiguous()  # [rows, KW], [KW/4, rows]
    for c in range(K):
        v = torch.zeros(K)
        v[c] = 1.0
        out = torch.full((rows, K // 32), 7.0)
        _probe_mx4_step[(1,)](words, hs, v, out, K, words.shape[1], ROWS=rows, G=K // 32, FOLDED=fold)
        torch.testing.assert_close(out[:, c // 32], dense[:, c], rtol=0, atol=0)
        assert (out[:, 1 - c // 32] == 0).all()


@pytest.mark.parametrize("route", ["bytes", "words"])
def test_mxfp4_step_decodes_every_code_and_scale_exactly(interpreted, route):
    """`_mx_step` (both MXFP4 decode kernels' inner step on the canonical bytes), and `_mxw_step`
    (the same bytes read as int32 words), against `dequantize_mxfp4` in float32, bit
    for bit: every code in every nibble position, scales from the subnormal 2^-127 (0) through
    overflow to inf (254 with code 6) and NaN (255). A one-hot vector at column c makes c's scale
    group equal to the weight itself (one exact product), every other group 0 (NaN where its
    scale is NaN)."""
    from padded_moe.mxfp4 import Mxfp4Tensor, dequantize_mxfp4

    rows, K = 16, 64
    blocks = every_code_everywhere(rows, K)
    scales = torch.tensor([0, 1, 100, 126, 127, 128, 200, 254, 255, 3, 60, 140, 180, 220, 250, 127] * 2,
                          dtype=torch.uint8).reshape(1, rows, K // 32)
    q = Mxfp4Tensor(blocks.contiguous(), scales.contiguous())
    dense = dequantize_mxfp4(q, torch.float32)[0]
    nan_scale = scales[0] == 255
    for c in range(K):
        v = torch.zeros(K)
        v[c] = 1.0
        out = torch.full((rows, K // 32), 7.0)
        _probe_mx_step[(1,)](q.blocks, q.scales, v, out, K, ROWS=rows, G=K // 32)
        torch.testing.assert_close(out[:, c // 32], dense[:, c], rtol=0, atol=0, equal_nan=True)
        other = 1 - c // 32
        assert torch.equal(torch.isnan(out[:, other]), nan_scale[:, other])
        assert (out[:, other][~nan_scale[:, other]] == 0).all()
