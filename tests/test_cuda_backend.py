"""Backend "cuda" (`padded_moe.backends.cuda_backend`) and its kernel's host side
(`padded_moe.kernels.native.grouped`) on the CPU: what it offers, what it refuses and how, and the
arguments a launch passes to the kernel for each layout. The kernel runs in
tests/test_native_grouped_gpu.py."""

import pytest
import torch

from padded_moe.activation import ActivationEpilogue, ApplyMoEActivationConfig
from padded_moe.backends import BACKENDS, get_backend, resolve_backend
from padded_moe.gemm import expert_gemm
from padded_moe.kernels import native
from padded_moe.kernels.native import grouped
from padded_moe.layouts import GemmLayout, build_layout
from padded_moe.mxfp4 import Mxfp4Tensor, quantize_mxfp4


def test_listed_and_not_what_resolve_backend_makes_of_auto():
    assert "cuda" in BACKENDS
    assert get_backend("cuda").name == "cuda"
    assert resolve_backend("auto", torch.device("cpu"), GemmLayout.GROUPED_CONTIGUOUS,
                           torch.zeros(1, 2, 8, dtype=torch.bfloat16)).name != "cuda"


def test_auto_native_decides_from_shapes_weights_and_activation(monkeypatch):
    """`auto_native`: bf16 weights of a listed expert shape, an activation of the epilogue, a device
    the kernel is built for and rows per local expert within that shape's band (low included, high
    excluded); anything else keeps the Triton path."""
    from padded_moe import backends
    from padded_moe.activation import MoEActivation

    monkeypatch.setattr(backends, "AUTO_NATIVE_ROWS", {(32, 24): (128, 256)})
    gpu, rows = torch.device("cuda"), 128
    w13 = torch.zeros(4, 48, 32, dtype=torch.bfloat16)
    w2 = torch.zeros(4, 32, 24, dtype=torch.bfloat16)
    silu = MoEActivation("silu")
    b = get_backend("cuda")
    monkeypatch.setattr(type(b), "available", lambda self, device: None)
    assert backends.auto_native(gpu, w13, w2, silu, rows * 4, 4)
    assert not backends.auto_native(gpu, w13, w2, silu, rows * 4 - 1, 4)  # fewer rows per expert
    assert backends.auto_native(gpu, w13, w2, silu, 256 * 4 - 1, 4)
    assert not backends.auto_native(gpu, w13, w2, silu, 256 * 4, 4)  # the high bound is excluded
    assert not backends.auto_native(gpu, w13, w2, silu, 0, 0)  # no local experts
    # another expert shape (hidden size, intermediate size) than the band's
    assert not backends.auto_native(gpu, torch.zeros(4, 48, 24, dtype=torch.bfloat16),
                                    torch.zeros(4, 24, 24, dtype=torch.bfloat16), silu, rows * 4, 4)
    assert not backends.auto_native(gpu, torch.zeros(4, 64, 32, dtype=torch.bfloat16),
                                    torch.zeros(4, 32, 32, dtype=torch.bfloat16), silu, rows * 4, 4)
    assert not backends.auto_native(torch.device("cpu"), w13, w2, silu, rows * 4, 4)
    assert not backends.auto_native(gpu, w13, w2, MoEActivation("gelu"), rows * 4, 4)  # not in the epilogue
    assert not backends.auto_native(gpu, w13, w2, None, rows * 4, 4)  # a callable activation
    assert not backends.auto_native(gpu, w13.float(), w2.float(), silu, rows * 4, 4)
    q = quantize_mxfp4(torch.randn(4, 48, 32))
    assert not backends.auto_native(gpu, q, w2, silu, rows * 4, 4)
    monkeypatch.setattr(backends, "AUTO_NATIVE_ROWS", {})
    assert not backends.auto_native(gpu, w13, w2, silu, rows * 4, 4)
    monkeypatch.setattr(backends, "AUTO_NATIVE_ROWS", {(32, 24): (128, 256)})
    monkeypatch.setattr(type(b), "available", lambda self, device: "no nvcc")
    assert not backends.auto_native(gpu, w13, w2, silu, rows * 4, 4)


def test_fused_experts_takes_the_native_path_only_when_both_choices_are_its_own(monkeypatch):
    """Where `auto_native` says so, a call without a layout or backend runs GROUPED_CONTIGUOUS on
    backend "cuda"; an explicit layout, backend or environment variable keeps what was asked."""
    from padded_moe import backends, experts
    from padded_moe.layouts import LAYOUT_ENV

    seen = []
    monkeypatch.setattr(backends, "auto_native", lambda *args: True)
    monkeypatch.setattr(experts, "_pipeline", lambda *args, **kw: seen.append((args[7], args[14], kw)) or args[0])
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    monkeypatch.delenv(backends.BACKEND_ENV, raising=False)
    x = torch.randn(4, 32)
    w13, w2 = torch.randn(2, 64, 32), torch.randn(2, 32, 32)
    ids = torch.tensor([[0], [1], [1], [0]], dtype=torch.int32)
    tw = torch.ones(4, 1)

    def call(**kw):
        experts._fused_experts(x, w13, w2, tw, ids, "silu", None, kw.pop("expert_map", None), kw.pop("layout", None),
                               None, None, None, kw.pop("backend", "auto"), None, None)
        return seen[-1][:2]

    assert call() == (GemmLayout.GROUPED_CONTIGUOUS, "cuda") and seen[-1][2]["decode"] is False
    assert call(layout="indexed") == (GemmLayout.INDEXED, "auto")
    assert call(backend="triton") == (GemmLayout.INDEXED, "triton")
    monkeypatch.setenv(backends.BACKEND_ENV, "triton")
    assert call() == (GemmLayout.INDEXED, "auto")
    monkeypatch.delenv(backends.BACKEND_ENV)
    monkeypatch.setenv(LAYOUT_ENV, "indexed")
    assert call() == (GemmLayout.INDEXED, "auto")
    monkeypatch.delenv(LAYOUT_ENV)
    monkeypatch.setattr(backends, "auto_native", lambda *args: False)
    assert call() == (GemmLayout.INDEXED, "auto")


def test_supports_grouped_layouts_with_bf16_and_mxfp4_weights():
    b = get_backend("cuda")
    bf16 = torch.zeros(2, 16, 32, dtype=torch.bfloat16)
    assert b.supports(GemmLayout.GROUPED_CONTIGUOUS, bf16) and b.supports(GemmLayout.GROUPED_MASKED, bf16)
    assert not b.supports(GemmLayout.INDEXED, bf16)
    assert not b.supports(GemmLayout.GROUPED_CONTIGUOUS, bf16.float())
    q = quantize_mxfp4(torch.randn(2, 16, 64))
    assert b.supports(GemmLayout.GROUPED_MASKED, q) and not b.supports(GemmLayout.INDEXED, q)
    assert b.fuses_activation


def test_refused_on_cpu_naming_why():
    ids = torch.tensor([[0], [1], [1]], dtype=torch.int32)
    meta = build_layout("grouped_contiguous", ids, 2)
    a = torch.randn(3, 32, dtype=torch.bfloat16)
    w = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="backend 'cuda' is not available on cpu: native kernels need a CUDA"):
        expert_gemm(a, w, meta, backend="cuda")


def test_unsupported_combination_is_not_implemented(monkeypatch):
    """On a device where the kernel could run, INDEXED or MXFP4 weights still fail closed."""
    b = get_backend("cuda")
    monkeypatch.setattr(type(b), "available", lambda self, device: None)
    with pytest.raises(NotImplementedError, match="'cuda' does not support layout indexed with bfloat16"):
        resolve_backend("cuda", torch.device("cpu"), GemmLayout.INDEXED, torch.zeros(1, 2, 8, dtype=torch.bfloat16))


def _tensors(L=3, N=16, K=32, rows=10):
    a = torch.randn(rows, K, dtype=torch.bfloat16)
    w = torch.randn(L, N, K, dtype=torch.bfloat16)
    out = torch.empty(rows, N, dtype=torch.bfloat16)
    return a, w, out


@pytest.mark.parametrize("what,change,message", [
    ("a dtype", lambda a, w, o, b: (a.float(), w, o, b), "bf16 a"),
    ("w dtype", lambda a, w, o, b: (a, w.half(), o, b), "bf16 w"),
    ("out dtype", lambda a, w, o, b: (a, w, o.float(), b), "bf16 out"),
    ("w transposed", lambda a, w, o, b: (a, w.transpose(1, 2).contiguous().transpose(1, 2), o, b),
     "w with a contiguous last dimension"),
    ("a row stride", lambda a, w, o, b: (torch.randn(a.shape[0], 36, dtype=a.dtype)[:, :32], w, o, b),
     "a's strides in multiples of 8"),
    ("K", lambda a, w, o, b: (a[:, :12], w[:, :, :12], o, b), "K .* multiple of 8"),
    ("N odd", lambda a, w, o, b: (a, w[:, :15], o[:, :15], b), "even number of output columns"),
    ("bias dtype", lambda a, w, o, b: (a, w, o, torch.zeros(3, 16, dtype=torch.float64)), "float32 or bf16 bias"),
    ("experts", lambda a, w, o, b: (a, w[:1].expand(1025, -1, -1), o, b), "at most 1024 local experts"),
])
def test_check_refuses_what_the_kernel_cannot_take(what, change, message):
    a, w, out = _tensors()
    a, w, out, bias = change(a, w, out, None)
    with pytest.raises(NotImplementedError, match=message):
        grouped.check(a, w, out, bias)


class _Recorder:
    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(native.GROUPED, "entry", lambda name: ("entry", name))
        monkeypatch.setattr(grouped, "launch_native",
                            lambda kernel, grid, args: self.calls.append((kernel, grid, args)))


def test_contiguous_launch_arguments(monkeypatch):
    rec = _Recorder(monkeypatch)
    a, w, out = _tensors(L=3, N=260, K=64, rows=10)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int64)
    bias = torch.zeros(3, 260)
    grouped.launch(a, w, out, offsets=offsets, bias=bias)
    (kernel, grid, args), = rec.calls
    assert kernel == ("entry", "pmoe_grouped_gemm") and grid == ((1 + 3) * 3,)  # (cdiv(10, 256) + 3 chunks) x 3
    (config, a_, s_as, s_ar, slabs, rows, w_, s_we, s_wn, L, w_rows, off, cnt, b_, s_be, bkind, o_, s_os, s_or, K,
     N, *rest) = args
    ep, mx, counter, gather = rest[:6], rest[6:13], rest[13:16], rest[16:]
    assert (config, slabs, rows, s_ar, s_as) == (0, 1, 10, 64, 640)
    assert counter == [None, 1, 3]  # configuration 0: the static walk, A's rows evict-last, both policies carried
    assert gather == [None, 1, 0]  # rows from a's tensor map
    assert a_ is a and w_ is w and o_ is out and off is offsets and cnt is None and b_ is bias
    assert (s_we, s_wn, L, w_rows, s_be, bkind, s_or, K, N) == (260 * 64, 64, 3, 260, 260,
                                                                 native.DTYPE_CODES[torch.float32], 260, 64, 260)
    assert ep == [grouped.PLAIN, -1, 0, 0.0, 1.0, 0.0]
    assert mx == [0, None, None, 0, 0, 0, 0]


def test_masked_launch_arguments(monkeypatch):
    rec = _Recorder(monkeypatch)
    L, T, K, N = 4, 6, 32, 16
    a = torch.randn(L, T, K, dtype=torch.bfloat16)
    w = torch.randn(L, N, K, dtype=torch.bfloat16)
    out = torch.empty(L, T, N, dtype=torch.bfloat16)
    counts = torch.tensor([1, 0, 6, 3], dtype=torch.int32)
    grouped.launch(a, w, out, counts=counts, config=1)
    (_, grid, args), = rec.calls
    assert grid == (4 * 1 * 1,)  # 4 slabs of one chunk, one column tile
    config, _, s_as, s_ar, slabs, rows = args[:6]
    assert (config, s_as, s_ar, slabs, rows) == (1, T * K, K, L, T)
    assert args[11] is None and args[12] is counts and args[13] is None
    assert args[17:19] == (T * N, N)


def test_launch_refuses_bad_metadata_and_config(monkeypatch):
    _Recorder(monkeypatch)
    a, w, out = _tensors()
    offsets = torch.tensor([0, 4, 4, 9])
    with pytest.raises(ValueError, match="exactly one of offsets"):
        grouped.launch(a, w, out)
    with pytest.raises(ValueError, match="exactly one of offsets"):
        grouped.launch(a, w, out, offsets=offsets, counts=offsets.int())
    with pytest.raises(ValueError, match="config must be an int in"):
        grouped.launch(a, w, out, offsets=offsets, config=len(grouped.CONFIGS))
    with pytest.raises(NotImplementedError, match="offsets as contiguous int64"):
        grouped.launch(a, w, out, offsets=offsets.int())
    with pytest.raises(NotImplementedError, match="counts as contiguous int32"):
        grouped.launch(a.view(2, 5, 32), w[:2], out.view(2, 5, 16), counts=offsets[:2])


def test_empty_calls_launch_nothing(monkeypatch):
    rec = _Recorder(monkeypatch)
    a, w, out = _tensors(rows=0)
    grouped.launch(a, w, out, offsets=torch.zeros(4, dtype=torch.int64))
    assert rec.calls == []


@pytest.mark.parametrize("activation,config,mode", [
    ("silu", None, "GATED_SPLIT"),
    ("swigluoai", None, "GATED_PAIRS"),
    ("silu", ApplyMoEActivationConfig(clamp_limit=10.0), "GATED_SPLIT"),
    ("silu", ApplyMoEActivationConfig(alpha=1.702, beta=1.0), "GATED_SPLIT"),
])
def test_epilogue_launch_arguments(monkeypatch, activation, config, mode):
    """The activation's kernel id, limit and parameters reach the kernel, with its mode and the
    tile count of its output width (64 activation columns per gated tile)."""
    from padded_moe.activation import ActivationEpilogue

    rec = _Recorder(monkeypatch)
    ep = ActivationEpilogue.of(activation, config)
    a, w, _ = _tensors(L=2, N=260, K=32, rows=6)
    out = torch.empty(6, 130, dtype=torch.bfloat16)
    grouped.launch(a, w, out, offsets=torch.tensor([0, 2, 6]), epilogue=ep)
    (_, grid, args), = rec.calls
    assert grid == ((1 + 2) * 3,)  # (cdiv(6, 256) + 2 chunks) x cdiv(130, 64)
    (limit, alpha, beta, _, _), flags = ep.kernel_args(fast=True)
    assert args[20] == 130
    assert list(args[21:27]) == [getattr(grouped, mode), flags["ACT"], int(flags["HAS_LIMIT"]), limit, alpha, beta]
    assert config is None or config.clamp_limit is None or args[24] == 10.0


def test_only_the_silu_family_is_fused():
    """Other activations are not offered to the epilogue (the pipeline runs them as a second
    step), and a direct launch with one is refused."""
    from padded_moe.activation import ActivationEpilogue, MoEActivation

    b = get_backend("cuda")
    assert [a.value for a in MoEActivation if b.fuses(a)] == sorted(grouped.EPILOGUE_ACTIVATIONS,
                                                                     key=[m.value for m in MoEActivation].index)
    a, w, _ = _tensors(L=2, N=16, K=32, rows=6)
    with pytest.raises(NotImplementedError, match="only .* in its epilogue, got gelu"):
        grouped.launch(a, w, torch.empty(6, 8, dtype=torch.bfloat16), offsets=torch.tensor([0, 2, 6]),
                       epilogue=ActivationEpilogue.of("gelu"))


def test_epilogue_width_must_match(monkeypatch):
    from padded_moe.activation import ActivationEpilogue

    _Recorder(monkeypatch)
    a, w, out = _tensors(L=2, N=16, K=32, rows=6)
    with pytest.raises(ValueError, match="out has 16 columns, the weight's 16 rows give 8"):
        grouped.launch(a, w, out, offsets=torch.tensor([0, 2, 6]), epilogue=ActivationEpilogue.of("silu"))


def test_mxfp4_launch_arguments(monkeypatch):
    """MXFP4 weights reach the kernel as their canonical codes and scales with byte strides; no
    bf16 weight pointer."""
    from padded_moe.activation import ActivationEpilogue

    rec = _Recorder(monkeypatch)
    q = quantize_mxfp4(torch.randn(3, 16, 64))
    a = torch.randn(10, 64, dtype=torch.bfloat16)
    out = torch.empty(10, 8, dtype=torch.bfloat16)
    grouped.launch(a, q, out, offsets=torch.tensor([0, 4, 4, 9]), epilogue=ActivationEpilogue.of("swigluoai"))
    (_, grid, args), = rec.calls
    assert args[6:11] == (None, 0, 0, 3, 16) and (args[19], args[20]) == (64, 8)
    assert args[21] == grouped.GATED_PAIRS
    assert args[27:] == (1, q.blocks, q.scales, 16 * 32, 32, 16 * 2, 2, None, 1, 3, None, 1, 0)  # no tile counter


def test_backend_env_turns_auto_into_the_named_backend(monkeypatch):
    """PADDED_MOE_GEMM_BACKEND: "auto" calls take the named backend (and its refusals); explicit
    names are untouched; an unknown value names the variable."""
    from padded_moe.backends import BACKEND_ENV, effective_backend

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert effective_backend("auto") == "auto"
    for value, expected in (("cuda", "cuda"), (" Torch ", "torch"), ("auto", "auto"), ("", "auto")):
        monkeypatch.setenv(BACKEND_ENV, value)
        assert effective_backend("auto") == expected and effective_backend("triton") == "triton"
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match="PADDED_MOE_GEMM_BACKEND must be one of"):
        effective_backend("auto")
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    w = torch.zeros(1, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="backend 'cuda' is not available on cpu"):
        resolve_backend("auto", torch.device("cpu"), GemmLayout.GROUPED_CONTIGUOUS, w)
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert resolve_backend("auto", torch.device("cpu"), GemmLayout.INDEXED, w).name == "torch"


def test_backend_env_keeps_auto_calls_off_the_decode_path(monkeypatch):
    """The decode path runs Triton kernels: an "auto" call that the variable sends to another
    backend does not take it."""
    from padded_moe import _platform
    from padded_moe import decode as dec
    from padded_moe.backends import BACKEND_ENV

    monkeypatch.setattr(_platform, "use_triton", lambda device: True)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    w13 = torch.randn(4, 32, 64, dtype=torch.bfloat16)
    w2 = torch.randn(4, 64, 16, dtype=torch.bfloat16)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert dec.decode_allowed(x, w13, w2, "auto")
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    assert not dec.decode_allowed(x, w13, w2, "auto")
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert dec.decode_allowed(x, w13, w2, "auto")


def test_the_wide_configuration_is_chosen_by_rows_per_expert(monkeypatch):
    """Configuration 3 (256 weight rows, two consumers over 128-row chunks) where a call's buffer
    holds at least 128 rows per expert on average and the weights are bf16, configuration 0
    otherwise; an explicit config wins."""
    rec = _Recorder(monkeypatch)
    monkeypatch.setattr(grouped, "WIDE_TILE_ROWS", 128)
    assert grouped.CONFIGS[3] == (4, True, 256, 2) and grouped.chunk_rows(3) == 128
    a, w, out = _tensors(L=3, N=260, K=64, rows=10)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int64)
    grouped.launch(a, w, out, offsets=offsets)
    assert rec.calls[-1][2][0] == 0
    a, w, out = _tensors(L=3, N=260, K=64, rows=384)
    offsets = torch.tensor([0, 200, 200, 384], dtype=torch.int64)
    grouped.launch(a, w, out, offsets=offsets)
    # (cdiv(384, 128) + 3 chunks) x cdiv(260, 256) column tiles
    assert rec.calls[-1][2][0] == 3 and rec.calls[-1][1] == ((3 + 3) * 2,)
    grouped.launch(a, w, out, offsets=offsets, config=1)
    assert rec.calls[-1][2][0] == 1
    q = quantize_mxfp4(torch.randn(3, 260, 64))
    grouped.launch(a, q, out, offsets=offsets)
    assert rec.calls[-1][2][0] == 0  # MXFP4: the 128-row tiles
    with pytest.raises(NotImplementedError, match="MXFP4 weights in 128-row tiles only"):
        grouped.launch(a, q, out, offsets=offsets, config=3)
    counts = torch.tensor([128, 0, 5], dtype=torch.int32)
    a3 = torch.randn(3, 128, 64, dtype=torch.bfloat16)
    out3 = torch.empty(3, 128, 130, dtype=torch.bfloat16)
    grouped.launch(a3, w[:, :260], out3, counts=counts, epilogue=ActivationEpilogue.of("silu"))
    # slabs of 128 rows: 3 x 1 chunk, x cdiv(130, 128) gated column tiles
    assert rec.calls[-1][2][0] == 3 and rec.calls[-1][1] == (3 * 2,)


def test_the_64_row_configuration(monkeypatch):
    """Configuration 2 tiles 64 weight rows: twice the column tiles of the default; MXFP4 weights
    are refused there (their producer fills 128-row tiles)."""
    rec = _Recorder(monkeypatch)
    assert grouped.CONFIGS[2] == (5, True, 64, 4)
    a, w, out = _tensors(L=3, N=260, K=64, rows=10)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int64)
    grouped.launch(a, w, out, offsets=offsets, config=2)
    assert rec.calls[0][1] == ((1 + 3) * 5,) and rec.calls[0][2][0] == 2  # cdiv(260, 64) column tiles
    q = quantize_mxfp4(torch.randn(3, 16, 64))
    with pytest.raises(NotImplementedError, match="MXFP4 weights in 128-row tiles only"):
        grouped.launch(a, q, torch.empty(10, 16, dtype=torch.bfloat16), offsets=offsets, config=2)


def test_the_dynamic_walk_passes_a_fresh_zeroed_counter(monkeypatch):
    """Persistent configurations with bf16 weights walk their tiles from a zeroed int32 counter,
    one per launch, where `dynamic` (or `DYNAMIC_WALK`) asks; the static walk passes none; one CTA
    per tile and MXFP4 weights refuse an explicit dynamic walk and ignore `DYNAMIC_WALK`."""
    rec = _Recorder(monkeypatch)
    a, w, out = _tensors(L=3, N=260, K=64, rows=10)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int64)
    q = quantize_mxfp4(torch.randn(3, 260, 64))
    assert grouped.DYNAMIC_WALK is None and grouped.DYNAMIC_CONFIGS == (grouped.WIDE_CONFIG,)
    grouped.launch(a, w, out, offsets=offsets, config=grouped.WIDE_CONFIG)  # by default: from the counter
    assert rec.calls[-1][2][-6] is not None
    grouped.launch(a, w, out, offsets=offsets, config=0)
    assert rec.calls[-1][2][-6] is None
    monkeypatch.setattr(grouped, "DYNAMIC_WALK", False)
    grouped.launch(a, w, out, offsets=offsets, config=grouped.WIDE_CONFIG)
    assert rec.calls[-1][2][-6] is None
    grouped.launch(a, w, out, offsets=offsets, config=0)
    assert rec.calls[-1][2][-6] is None
    for config in (0, 2, 3):
        grouped.launch(a, w, out, offsets=offsets, config=config, dynamic=True)
        counter = rec.calls[-1][2][-6]
        assert counter.dtype == torch.int32 and counter.shape == (1,) and int(counter) == 0
    first = rec.calls[-1][2][-6]
    grouped.launch(a, w, out, offsets=offsets, config=3, dynamic=True)
    assert rec.calls[-1][2][-6] is not first  # never shared between launches
    monkeypatch.setattr(grouped, "DYNAMIC_WALK", True)
    grouped.launch(a, w, out, offsets=offsets)
    assert rec.calls[-1][2][-6] is not None
    grouped.launch(a, w, out, offsets=offsets, dynamic=False)
    assert rec.calls[-1][2][-6] is None
    grouped.launch(a, w, out, offsets=offsets, config=1)  # one CTA per tile: nothing to walk
    assert rec.calls[-1][2][-6] is None
    grouped.launch(a, q, out, offsets=offsets)  # MXFP4: the producer warps walk statically
    assert rec.calls[-1][2][-6] is None
    with pytest.raises(NotImplementedError, match="one CTA per tile with bf16"):
        grouped.launch(a, w, out, offsets=offsets, config=1, dynamic=True)
    with pytest.raises(NotImplementedError, match="persistent with MXFP4"):
        grouped.launch(a, q, out, offsets=offsets, config=0, dynamic=True)


def test_rows_l2_policy_follows_the_setting(monkeypatch):
    rec = _Recorder(monkeypatch)
    a, w, out = _tensors(L=3, N=260, K=64, rows=10)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int64)
    grouped.launch(a, w, out, offsets=offsets)
    assert rec.calls[-1][2][-5] == 1
    monkeypatch.setattr(grouped, "ROWS_EVICT_LAST", False)
    grouped.launch(a, w, out, offsets=offsets)
    assert rec.calls[-1][2][-5] == 0


def test_load_policies_per_configuration(monkeypatch):
    """Configuration 3 loads without policy operands (open to L2's request coalescer), the others
    carry both; a changed table reaches the launch."""
    rec = _Recorder(monkeypatch)
    a, w, out = _tensors(L=3, N=260, K=64, rows=10)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int64)
    both = grouped.POLICY_WEIGHTS | grouped.POLICY_ROWS
    assert (grouped.POLICY_WEIGHTS, grouped.POLICY_ROWS) == (1, 2)
    assert [grouped.load_policies(c) for c in range(len(grouped.CONFIGS))] == [both, both, both, 0]
    for config in range(len(grouped.CONFIGS)):
        grouped.launch(a, w, out, offsets=offsets, config=config)
        assert rec.calls[-1][2][-4] == grouped.load_policies(config)
    monkeypatch.setitem(grouped.LOAD_POLICIES, 0, grouped.POLICY_ROWS)
    grouped.launch(a, w, out, offsets=offsets, config=0)
    assert rec.calls[-1][2][-4] == grouped.POLICY_ROWS


def test_the_measured_defaults():
    """The wide tiles from 512 rows per expert with bf16 weights (the 128-row tiles below that and for
    MXFP4); "auto" on the native kernel for the measured expert shapes of the presets, in their bands,
    and never for Qwen3-MoE's."""
    from padded_moe import backends
    from padded_moe.presets import PRESETS

    assert grouped.WIDE_TILE_ROWS == 512 and grouped.ROWS_EVICT_LAST is True
    assert grouped.default_config(512, False) == grouped.WIDE_CONFIG == 3
    assert grouped.default_config(511.5, False) == grouped.DEFAULT_CONFIG == 0
    assert grouped.default_config(4096, True) == 0
    bands = {name: backends.AUTO_NATIVE_ROWS.get((p.hidden_size, p.intermediate_size)) for name, p in PRESETS.items()}
    assert bands["dsv4-flash"] == (64, 256) and bands["gpt-oss-120b"] == (112, 160)
    assert bands["mixtral-8x7b"] == (64, 80) and bands["qwen3-30b-a3b"] is None


# ---- the RS kernel: MXFP4 weights in their prepared form (4 planes, folded scales) ----

def _rs_weight(L=3, N=16, K=64, scale=1.0, **prepare):
    return quantize_mxfp4(torch.randn(L, N, K) * scale).prepare_for(**prepare)


def test_takes_rs_only_prepared_four_plane_folded_weights():
    q = _rs_weight()
    assert grouped.takes_rs(q) and grouped.takes_rs(_rs_weight(keep_canonical=False))
    assert not grouped.takes_rs(Mxfp4Tensor(q.blocks, q.scales))  # no prepared form
    assert not grouped.takes_rs(_rs_weight(planes=2))
    big = _rs_weight(scale=2.0**12)  # scales past mxfp4.FOLD_MAX_SCALE: stored unfolded
    assert not big.hopper.folded and not grouped.takes_rs(big)
    assert not grouped.takes_rs(torch.zeros(3, 16, 64, dtype=torch.bfloat16)) and not grouped.takes_rs(None)


def test_supports_and_fuses_with_rs_weights():
    """Prepared-only MXFP4 weights are offered where the RS kernel takes them; the RS kernel has no
    activation epilogue, so `fuses` says no for its weights (callers run GEMM1, then the activation op)."""
    from padded_moe.activation import MoEActivation

    b = get_backend("cuda")
    rs_only = _rs_weight(keep_canonical=False)
    assert b.supports(GemmLayout.GROUPED_CONTIGUOUS, rs_only) and b.supports(GemmLayout.GROUPED_MASKED, rs_only)
    assert not b.supports(GemmLayout.INDEXED, rs_only)
    assert not b.supports(GemmLayout.GROUPED_CONTIGUOUS, _rs_weight(scale=2.0**12, keep_canonical=False))
    silu = MoEActivation("silu")
    assert not b.fuses(silu, rs_only) and not b.fuses(silu, _rs_weight())
    assert b.fuses(silu, quantize_mxfp4(torch.randn(3, 16, 64))) and b.fuses(silu)
    assert b.fuses(silu, torch.zeros(3, 16, 64, dtype=torch.bfloat16))


def test_rs_contiguous_launch_arguments(monkeypatch):
    rec = _Recorder(monkeypatch)
    q = _rs_weight(L=3, N=264, K=64, keep_canonical=False)
    a = torch.randn(10, 64, dtype=torch.bfloat16)
    out = torch.empty(10, 264, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int64)
    bias = torch.zeros(3, 264, dtype=torch.bfloat16)
    grouped.launch(a, q, out, offsets=offsets, bias=bias)
    (kernel, grid, args), = rec.calls
    assert kernel == ("entry", "pmoe_mx_rs_gemm")
    assert grid == ((1 + 3) * 3,)  # (cdiv(10, 256) + 3 experts) chunks x cdiv(264, 128) weight tiles
    h = q.hopper
    assert args[:-4] == (grouped.RS_STAGES, a, 640, 64, 1, 10, 64, h.blocks, 264 * 8, 8, h.scales, 2 * 264, 264, 3,
                         264, 64, offsets, None, bias, 264, native.DTYPE_CODES[torch.bfloat16], out, 0, 264,
                         int(grouped.RS_COLUMNS_FIRST), int(grouped.RS_PERSISTENT), 4, grouped.PLAIN, -1, 0, 0.0, 1.0,
                         0.0, int(grouped.RS_TAIL_PIECES))
    counter = args[-4]  # the tile counter of the dynamic walk (RS_DYNAMIC), else None
    assert counter is None if not grouped.RS_DYNAMIC else counter.tolist() == [0]
    assert args[-3:] == (None, 1, 0)  # rows from a's tensor map, not gathered


def test_rs_tail_pieces_and_dynamic_walk_arguments(monkeypatch):
    """RS_TAIL_PIECES reaches the kernel as 0 / 1; RS_DYNAMIC passes a fresh zeroed int32 counter to
    persistent launches (one CTA per tile, RS_PERSISTENT off, walks nothing: no counter)."""
    rec = _Recorder(monkeypatch)
    q = _rs_weight(L=3, N=264, K=64, keep_canonical=False)
    a = torch.randn(10, 64, dtype=torch.bfloat16)
    out = torch.empty(10, 264, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int64)
    monkeypatch.setattr(grouped, "RS_TAIL_PIECES", False)
    monkeypatch.setattr(grouped, "RS_DYNAMIC", True)
    grouped.launch_rs(a, q, out, offsets=offsets)
    (_, _, args), = rec.calls
    tail, counter = args[-5:-3]
    assert tail == 0 and counter.dtype == torch.int32 and counter.tolist() == [0]
    monkeypatch.setattr(grouped, "RS_PERSISTENT", False)
    grouped.launch_rs(a, q, out, offsets=offsets)
    assert rec.calls[1][2][-4] is None and rec.calls[1][2][25] == 0
    monkeypatch.setattr(grouped, "RS_PERSISTENT", True)
    monkeypatch.setattr(grouped, "RS_DYNAMIC", False)
    grouped.launch_rs(a, q, out, offsets=offsets)
    assert rec.calls[2][2][-4] is None and rec.calls[2][2][25] == 1


def test_rs_masked_launch_arguments(monkeypatch):
    rec = _Recorder(monkeypatch)
    L, T, K, N = 4, 300, 64, 16
    q = _rs_weight(L=L, N=N, K=K)
    a = torch.randn(L, T, K, dtype=torch.bfloat16)
    out = torch.empty(L, T, N, dtype=torch.bfloat16)
    counts = torch.tensor([1, 0, 300, 3], dtype=torch.int32)
    monkeypatch.setattr(grouped, "RS_COLUMNS_FIRST", False)
    monkeypatch.setattr(grouped, "RS_PERSISTENT", False)
    monkeypatch.setattr(grouped, "RS_WIDE", False)
    grouped.launch_rs(a, q, out, counts=counts, stages=3)
    (_, grid, args), = rec.calls
    assert grid == (4 * 2 * 1,)  # 4 slabs of two 256-row chunks, one weight tile
    assert args[:7] == (3, a, T * K, K, L, T, K)
    assert args[16:19] == (None, counts, None) and args[21:24] == (out, T * N, N)
    assert args[24:27] == (0, 0, 4)  # chunks first, one CTA per tile, 4-box chunks


def test_rs_wide_chunks_by_rows_per_expert(monkeypatch):
    """Chunks of 5 boxes (320 rows, 3 stages) where the rows per expert lie in RS_WIDE_ROWS: a flat
    buffer's rows over its experts, a slab's rows; the grid's bound counts 320-row chunks."""
    rec = _Recorder(monkeypatch)
    monkeypatch.setattr(grouped, "RS_WIDE", None)
    lo, hi = grouped.RS_WIDE_ROWS
    L, K, N = 4, 64, 16
    q = _rs_weight(L=L, N=N, K=K)
    for per_expert, wide in ((lo - 1, False), (lo, True), (hi - 1, True), (hi, False)):
        rec.calls.clear()
        a = torch.randn(L * per_expert, K, dtype=torch.bfloat16)
        out = torch.empty(L * per_expert, N, dtype=torch.bfloat16)
        offsets = torch.arange(L + 1, dtype=torch.int64) * per_expert
        grouped.launch_rs(a, q, out, offsets=offsets)
        (_, grid, args), = rec.calls
        chunk = grouped.RS_WIDE_CHUNK_ROWS if wide else grouped.RS_CHUNK_ROWS
        assert args[26] == (5 if wide else 4) and args[0] == (grouped.RS_WIDE_STAGES if wide else grouped.RS_STAGES)
        assert grid == (-(-L * per_expert // chunk) + L,)
        rec.calls.clear()
        slabs = torch.randn(L, per_expert, K, dtype=torch.bfloat16)
        grouped.launch_rs(slabs, q, torch.empty(L, per_expert, N, dtype=torch.bfloat16),
                          counts=torch.full((L,), per_expert, dtype=torch.int32))
        assert rec.calls[0][2][26] == (5 if wide else 4) and rec.calls[0][1] == (L * -(-per_expert // chunk),)
    rec.calls.clear()
    a = torch.randn(L * lo, K, dtype=torch.bfloat16)
    out = torch.empty(L * lo, N, dtype=torch.bfloat16)
    offsets = torch.arange(L + 1, dtype=torch.int64) * lo
    grouped.launch_rs(a, q, out, offsets=offsets, wide=False, stages=4)
    monkeypatch.setattr(grouped, "RS_WIDE", False)
    grouped.launch_rs(a, q, out, offsets=offsets)
    assert [call[2][26] for call in rec.calls] == [4, 4] and rec.calls[0][2][0] == 4
    monkeypatch.setattr(grouped, "RS_WIDE", True)
    with pytest.raises(ValueError, match="stages must be 3 with wide chunks .* chosen by RS_WIDE"):
        grouped.launch_rs(a[:8], q, out[:8], offsets=offsets.clamp(max=8), stages=4)
    with pytest.raises(ValueError, match="3 with wide chunks .*, got 4; wide chunks asked for"):
        grouped.launch_rs(a, q, out, offsets=offsets, stages=4, wide=True)


def test_rs_launch_refuses_what_the_kernel_cannot_take(monkeypatch):
    _Recorder(monkeypatch)
    q = _rs_weight(L=3, N=16, K=64)
    a = torch.randn(10, 64, dtype=torch.bfloat16)
    out = torch.empty(10, 16, dtype=torch.bfloat16)
    off = torch.tensor([0, 4, 4, 9])
    with pytest.raises(ValueError, match="stages must be 3 or 4"):
        grouped.launch_rs(a, q, out, offsets=off, stages=2)
    with pytest.raises(ValueError, match="exactly one of offsets"):
        grouped.launch_rs(a, q, out)
    with pytest.raises(NotImplementedError, match="prepared form with 4 planes and folded scales"):
        grouped.launch_rs(a, _rs_weight(planes=2), out, offsets=off)
    with pytest.raises(NotImplementedError, match="bf16 a"):
        grouped.launch_rs(a.float(), q, out, offsets=off)
    with pytest.raises(NotImplementedError, match="out with a contiguous last dimension, other strides in multiples"):
        grouped.launch_rs(a, q, torch.empty(10, 20, dtype=torch.bfloat16)[:, :16], offsets=off)
    with pytest.raises(NotImplementedError, match="output columns a multiple of 8"):
        grouped.launch_rs(a, _rs_weight(N=12), torch.empty(10, 16, dtype=torch.bfloat16)[:, :12], offsets=off)
    with pytest.raises(ValueError, match="out has 16 columns, the weight's 24 rows give 24"):
        grouped.launch_rs(a, _rs_weight(N=24), out, offsets=off)
    with pytest.raises(NotImplementedError, match="float32 or bf16 bias"):
        grouped.launch_rs(a, q, out, offsets=off, bias=torch.zeros(3, 16, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="offsets as contiguous int64"):
        grouped.launch_rs(a, q, out, offsets=off.int())


def test_rs_gated_launch_arguments(monkeypatch):
    """swigluoai (interleaved gate / up rows) and silu (gate / up halves) in the RS kernel's epilogue:
    half the weight's rows as output columns, tiles of 64 of them, the activation's parameters."""
    rec = _Recorder(monkeypatch)
    q = _rs_weight(L=3, N=272, K=64, keep_canonical=False)
    a = torch.randn(10, 64, dtype=torch.bfloat16)
    out = torch.empty(10, 136, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int64)
    ep = ActivationEpilogue.of("swigluoai")
    grouped.launch_rs(a, q, out, offsets=offsets, epilogue=ep)
    (kernel, grid, args), = rec.calls
    assert kernel == ("entry", "pmoe_mx_rs_gemm") and grid == ((1 + 3) * 3,)  # cdiv(136, 64) column tiles
    (limit, alpha, beta, _, _), flags = ep.kernel_args(fast=True)
    assert args[-11:-5] == (grouped.GATED_PAIRS, flags["ACT"], int(flags["HAS_LIMIT"]), limit, alpha, beta)
    with pytest.raises(ValueError, match="out has 272 columns, the weight's 272 rows give 136"):
        grouped.launch_rs(a, q, torch.empty(10, 272, dtype=torch.bfloat16), offsets=offsets, epilogue=ep)
    rec.calls.clear()
    silu = ActivationEpilogue.of("silu")  # gate / up halves: the same tiles, gate rows j and up rows 136 + j
    grouped.launch_rs(a, q, out, offsets=offsets, epilogue=silu)
    (kernel, grid, args), = rec.calls
    (limit, alpha, beta, _, _), flags = silu.kernel_args(fast=True)
    assert grid == ((1 + 3) * 3,) and args[-11:-5] == (grouped.GATED_SPLIT, flags["ACT"], int(flags["HAS_LIMIT"]),
                                                     limit, alpha, beta)


def test_rs_epilogue_is_offered_only_when_enabled(monkeypatch):
    """`fuses` with an RS weight: only with `RS_EPILOGUE` on, gate / up halves only with
    `RS_EPILOGUE_SPLIT` too; `launch` with an epilogue takes the RS kernel then, else (a weight with
    canonical bytes) the producer-upcast kernel, which applies it."""
    from padded_moe.activation import MoEActivation

    rec = _Recorder(monkeypatch)
    b = get_backend("cuda")
    q = _rs_weight(L=3, N=16, K=64)
    swiglu, silu = MoEActivation("swigluoai"), MoEActivation("silu")
    monkeypatch.setattr(grouped, "RS_EPILOGUE", False)
    assert not b.fuses(swiglu, q) and not b.fuses(silu, q)
    a, out, off = torch.randn(10, 64, dtype=torch.bfloat16), torch.empty(10, 8, dtype=torch.bfloat16), \
        torch.tensor([0, 4, 4, 9])
    grouped.launch(a, q, out, offsets=off, epilogue=ActivationEpilogue.of("swigluoai"))
    monkeypatch.setattr(grouped, "RS_EPILOGUE", True)
    monkeypatch.setattr(grouped, "RS_EPILOGUE_SPLIT", False)
    assert b.fuses(swiglu, q) and not b.fuses(silu, q)
    grouped.launch(a, q, out, offsets=off, epilogue=ActivationEpilogue.of("swigluoai"))
    assert [kernel for kernel, _, _ in rec.calls] == [("entry", "pmoe_grouped_gemm"), ("entry", "pmoe_mx_rs_gemm")]
    monkeypatch.setattr(grouped, "RS_EPILOGUE_SPLIT", True)
    assert b.fuses(swiglu, q) and b.fuses(silu, q)


def test_unfolded_prepared_weights_need_their_canonical_bytes(monkeypatch):
    """A prepared weight the RS kernel cannot take (unfolded scales) goes to the producer-upcast
    kernel, which reads the canonical bytes: without them, a refusal that says so."""
    _Recorder(monkeypatch)
    q = _rs_weight(scale=2.0**12, keep_canonical=False)
    with pytest.raises(NotImplementedError, match="canonical bytes"):
        grouped.launch(torch.randn(10, 64, dtype=torch.bfloat16), q, torch.empty(10, 16, dtype=torch.bfloat16),
                       offsets=torch.tensor([0, 4, 4, 9]))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the activation reads the unfilled GEMM1 buffer
def test_rs_weights_run_gemm1_then_the_activation_op(monkeypatch):
    """GEMM1 with an activation on backend "cuda" and an RS weight: the RS kernel fills a buffer of
    the weight's width, then the activation op runs (no epilogue launch)."""
    rec = _Recorder(monkeypatch)
    b = get_backend("cuda")
    monkeypatch.setattr(type(b), "available", lambda self, device: None)
    ids = torch.tensor([[0], [1], [1]], dtype=torch.int32)
    meta = build_layout("grouped_contiguous", ids, 2)
    q = _rs_weight(L=2, N=32, K=64, keep_canonical=False)
    monkeypatch.setattr(grouped, "RS_EPILOGUE_SPLIT", False)
    out = expert_gemm(torch.randn(3, 64, dtype=torch.bfloat16), q, meta, backend="cuda", activation="silu")
    (kernel, _, args), = rec.calls
    assert kernel == ("entry", "pmoe_mx_rs_gemm") and args[21].shape == (3, 32) and out.shape == (3, 16)


def test_auto_native_takes_rs_weights_of_the_listed_shapes_and_rows(monkeypatch):
    """`auto_native` with MXFP4 weights: both must run the RS kernel, their expert shape must be in
    `AUTO_RS_ROWS` and the rows per local expert within its band (low included, high excluded), any
    activation of spec 01, on a device the kernel is built for."""
    from padded_moe import backends
    from padded_moe.activation import MoEActivation

    b = get_backend("cuda")
    monkeypatch.setattr(type(b), "available", lambda self, device: None)
    monkeypatch.setattr(backends, "AUTO_RS_ROWS", {(64, 32): (128, 256)})
    gpu, gelu = torch.device("cuda"), MoEActivation("gelu")
    w13, w2 = _rs_weight(L=4, N=64, K=64), _rs_weight(L=4, N=64, K=32)
    assert backends.auto_native(gpu, w13, w2, gelu, 128 * 4, 4)
    assert backends.auto_native(gpu, w13, w2, gelu, 256 * 4 - 1, 4)
    assert not backends.auto_native(gpu, w13, w2, gelu, 128 * 4 - 1, 4)
    assert not backends.auto_native(gpu, w13, w2, gelu, 256 * 4, 4)  # the high bound is excluded
    assert not backends.auto_native(gpu, w13, w2, None, 128 * 4, 4)  # a callable activation
    assert not backends.auto_native(torch.device("cpu"), w13, w2, gelu, 128 * 4, 4)
    assert not backends.auto_native(gpu, Mxfp4Tensor(w13.blocks, w13.scales), w2, gelu, 128 * 4, 4)  # not prepared
    assert not backends.auto_native(gpu, w13, _rs_weight(L=4, N=64, K=32, planes=2), gelu, 128 * 4, 4)
    assert not backends.auto_native(gpu, _rs_weight(L=4, N=128, K=64), _rs_weight(L=4, N=64, K=64), gelu,
                                    128 * 4, 4)  # another expert shape
    monkeypatch.setattr(type(b), "available", lambda self, device: "no nvcc")
    assert not backends.auto_native(gpu, w13, w2, gelu, 128 * 4, 4)


# ---- GEMM1 gathering its rows from the tokens (`launch_rs`'s gather_src, `CudaBackend.gathers`) ----

def test_rs_gather_launch_arguments(monkeypatch):
    """Gathered rows: `a` the token rows (one slab of T rows, its own row stride), `rows` the flat
    buffer's (out's, at most the slots `gather_src` holds), and the slots, top_k and T last."""
    rec = _Recorder(monkeypatch)
    q = _rs_weight(L=3, N=264, K=64, keep_canonical=False)
    x = torch.randn(5, 72, dtype=torch.bfloat16)[:, :64]  # a row stride wider than K
    src = torch.tensor([0, 4, 7, 9, 1, 2, 3, 5, 6, 8], dtype=torch.int32)
    out = torch.empty(12, 264, dtype=torch.bfloat16)  # a capacity buffer: more rows than slots
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int64)
    grouped.launch_rs(x, q, out, offsets=offsets, gather_src=src, top_k=2)
    (_, grid, args), = rec.calls
    assert args[1:7] == (x, 5 * 72, 72, 1, 10, 64)  # a, slab / row strides, one slab, rows = the 10 slots, K
    assert args[21:24] == (out, 0, 264) and args[-3:] == (src, 2, 5)
    assert grid == ((1 + 3) * 3,)  # the bound counts the flat buffer's 10 rows
    rec.calls.clear()
    grouped.launch(x, q, out, offsets=offsets, gather_src=src, top_k=2)  # `launch` passes them on
    assert rec.calls[0][2][-3:] == (src, 2, 5)
    grouped.launch_rs(x[:0], q, out, offsets=offsets, gather_src=src, top_k=2)  # no tokens: nothing to launch
    assert len(rec.calls) == 1


def test_rs_gather_refusals(monkeypatch):
    _Recorder(monkeypatch)
    q = _rs_weight(L=3, N=16, K=64)
    x, out = torch.randn(5, 64, dtype=torch.bfloat16), torch.empty(10, 16, dtype=torch.bfloat16)
    off, src = torch.tensor([0, 4, 4, 9]), torch.arange(10, dtype=torch.int32)
    with pytest.raises(ValueError, match="rows of a flat GROUPED_CONTIGUOUS buffer: give offsets"):
        grouped.launch_rs(x.view(1, 5, 64), q, out.view(1, 10, 16), counts=torch.tensor([3, 0, 1], dtype=torch.int32),
                          gather_src=src, top_k=2)
    with pytest.raises(ValueError, match="contiguous 1-D int32 tensor .* got torch.int64"):
        grouped.launch_rs(x, q, out, offsets=off, gather_src=src.long(), top_k=2)
    with pytest.raises(ValueError, match="top_k must be a positive int, got 0"):
        grouped.launch_rs(x, q, out, offsets=off, gather_src=src, top_k=0)
    with pytest.raises(ValueError, match="token rows .* got shape"):
        grouped.launch_rs(x.view(1, 5, 64), q, out, offsets=off, gather_src=src, top_k=2)
    with pytest.raises(NotImplementedError, match="gathers rows with bf16 weights, or with MXFP4 weights in the RS"):
        grouped.launch(x, q, out, offsets=off, gather_src=src, top_k=2, config=0)


def test_gathers_rs_and_bf16_weights_on_the_contiguous_layout(monkeypatch):
    """`gathers`: GROUPED_CONTIGUOUS only, RS weights while `RS_GATHER` is on, bf16 weights while
    `GATHER_BF16` is; never MXFP4 weights the producer warps upcast."""
    b = get_backend("cuda")
    q, bf16 = _rs_weight(), torch.zeros(3, 16, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(grouped, "RS_GATHER", True)
    monkeypatch.setattr(grouped, "GATHER_BF16", False)
    assert b.gathers(GemmLayout.GROUPED_CONTIGUOUS, q) and not b.gathers(GemmLayout.GROUPED_CONTIGUOUS, bf16)
    assert not b.gathers(GemmLayout.GROUPED_MASKED, q) and not b.gathers(GemmLayout.INDEXED, q)
    assert not b.gathers(GemmLayout.GROUPED_CONTIGUOUS, Mxfp4Tensor(q.blocks, q.scales))
    assert not get_backend("triton").gathers(GemmLayout.GROUPED_CONTIGUOUS, q)
    monkeypatch.setattr(grouped, "RS_GATHER", False)
    monkeypatch.setattr(grouped, "GATHER_BF16", True)
    assert not b.gathers(GemmLayout.GROUPED_CONTIGUOUS, q) and b.gathers(GemmLayout.GROUPED_CONTIGUOUS, bf16)
    assert not b.gathers(GemmLayout.GROUPED_MASKED, bf16)
    assert not b.gathers(GemmLayout.GROUPED_CONTIGUOUS, bf16.float())
    assert not b.gathers(GemmLayout.GROUPED_CONTIGUOUS, Mxfp4Tensor(q.blocks, q.scales))


def test_bf16_gather_launch_arguments(monkeypatch):
    """bf16 weights gathering: the token rows as `a` (one slab), the flat buffer's rows from `out`
    (which also pick the configuration), the slots, top_k and T last."""
    rec = _Recorder(monkeypatch)
    w = torch.randn(3, 260, 64, dtype=torch.bfloat16)
    x = torch.randn(5, 72, dtype=torch.bfloat16)[:, :64]
    src = torch.arange(10, dtype=torch.int32)
    out = torch.empty(10, 260, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int64)
    grouped.launch(x, w, out, offsets=offsets, gather_src=src, top_k=2)
    (kernel, grid, args), = rec.calls
    assert kernel == ("entry", "pmoe_grouped_gemm") and grid == ((1 + 3) * 3,)
    assert args[:6] == (grouped.default_config(10 / 3, False), x, 5 * 72, 72, 1, 10) and args[-3:] == (src, 2, 5)
    grouped.launch(torch.randn(10, 64, dtype=torch.bfloat16), w, out, offsets=offsets)
    assert rec.calls[1][2][-3:] == (None, 1, 0)
    with pytest.raises(NotImplementedError, match="gathers rows with bf16 weights"):
        grouped.launch(x, quantize_mxfp4(torch.randn(3, 260, 64)), out, offsets=offsets, gather_src=src, top_k=2)


def test_expert_gemm_gather(monkeypatch):
    """`expert_gemm(gather=True)`: the token rows go to the kernel with the layout's slots; GEMM1 of
    a grouped_contiguous layout only, `a` the M token rows, a backend that gathers."""
    rec = _Recorder(monkeypatch)
    b = get_backend("cuda")
    monkeypatch.setattr(type(b), "available", lambda self, device: None)
    monkeypatch.setattr(grouped, "RS_GATHER", True)
    ids = torch.tensor([[0, 1], [1, -1], [1, 0]], dtype=torch.int32)
    meta = build_layout("grouped_contiguous", ids, 2)
    q = _rs_weight(L=2, N=32, K=64, keep_canonical=False)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    out = expert_gemm(x, q, meta, backend="cuda", gather=True)
    (kernel, _, args), = rec.calls
    assert kernel == ("entry", "pmoe_mx_rs_gemm") and args[1] is x and args[-3:] == (meta.src, 2, 3)
    assert out.shape == (6, 32) and args[21] is out
    with pytest.raises(TypeError, match="gather must be a bool"):
        expert_gemm(x, q, meta, backend="cuda", gather=1)
    with pytest.raises(ValueError, match="GEMM1's rows .* got stage 'w2'"):
        expert_gemm(torch.randn(3, 32, dtype=torch.bfloat16), _rs_weight(L=2, N=64, K=32), meta, stage="w2",
                    backend="cuda", gather=True)
    with pytest.raises(ValueError, match=r"token rows \[M = 3, K\] when gathering, got \(6, 64\)"):
        expert_gemm(torch.randn(6, 64, dtype=torch.bfloat16), q, meta, backend="cuda", gather=True)
    masked = build_layout("grouped_masked", ids, 2)
    with pytest.raises(ValueError, match="grouped_contiguous layout .* got grouped_masked"):
        expert_gemm(x, q, masked, backend="cuda", gather=True)
    monkeypatch.setattr(grouped, "RS_GATHER", False)
    with pytest.raises(NotImplementedError, match="backend 'cuda' does not read GEMM1's rows from their tokens"):
        expert_gemm(x, q, meta, backend="cuda", gather=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the kernels are not run: buffers hold garbage
def test_fused_experts_skips_the_permuted_copy_where_gemm1_gathers(monkeypatch):
    """With `RS_GATHER`, `fused_experts` on backend "cuda" hands GEMM1 the hidden states themselves
    and the layout's slots, and makes no permuted copy; without it, GEMM1 reads the permuted rows."""
    from padded_moe import experts, fused_experts

    rec = _Recorder(monkeypatch)
    b = get_backend("cuda")
    monkeypatch.setattr(type(b), "available", lambda self, device: None)
    permutes = []
    real = experts.permute
    monkeypatch.setattr(experts, "permute", lambda *a, **kw: permutes.append(1) or real(*a, **kw))
    w13, w2 = _rs_weight(L=2, N=128, K=64, keep_canonical=False), _rs_weight(L=2, N=64, K=64, keep_canonical=False)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, -1], [1, 0]], dtype=torch.int32)
    tw = torch.full((3, 2), 0.5)
    for gather in (True, False):
        monkeypatch.setattr(grouped, "RS_GATHER", gather)
        rec.calls.clear()
        permutes.clear()
        fused_experts(x, w13, w2, tw, ids, activation="swigluoai", layout="grouped_contiguous", backend="cuda")
        gemm1, gemm2 = (args for _, _, args in rec.calls)
        assert (gemm1[1] is x) == gather and len(permutes) == (0 if gather else 1)
        assert (gemm1[-3] is not None) == gather and gemm2[-3] is None
