"""Inputs that once gave a wrong answer without an error, or an error from deep inside: each now
gets the right answer or a typed error naming the argument (and, on the command line, one line
and exit status 2)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import rel_err
from padded_moe.activation import ApplyMoEActivationConfig, apply_moe_activation
from padded_moe.cli import main
from padded_moe.experts import batched_experts, fused_experts
from padded_moe.layer import FusedMoE
from padded_moe.layouts import GemmLayout, PermuteScratch, build_layout, permute, unpermute
from padded_moe.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from padded_moe.reference.moe import activation_f64, reference_moe

K, N = 32, 16


def _expert_ref(x, w13, w2):
    return activation_f64("silu", x.double() @ w13.double().T) @ w2.double().T


# ---------------------------------------------------------------------------------------------
# Wrong answers

@pytest.mark.parametrize("count", [2 ** 40, 2 ** 32 + 2, 2 ** 63 - 1])
def test_batched_experts_int64_counts_are_clamped_not_wrapped(cpu_path, count, gen):
    L, T = 3, 4
    x = torch.randn(L, T, K, generator=gen)
    w13 = torch.randn(L, 2 * N, K, generator=gen) * 0.2
    w2 = torch.randn(L, K, N, generator=gen) * 0.2
    x[1, 1:] = float("nan")
    x[2] = float("nan")
    out = torch.full_like(x, float("nan"))
    batched_experts(x, torch.tensor([count, 1, 0]), w13, w2, activation="silu", out=out)
    assert rel_err(out[0], _expert_ref(x[0], w13[0], w2[0])) <= 1e-5  # every row: count clamped to T
    assert rel_err(out[1, :1], _expert_ref(x[1, :1], w13[1], w2[1])) <= 1e-5
    assert torch.isnan(out[1, 1:]).all() and torch.isnan(out[2]).all()


def test_fused_moe_is_usable_after_construction(cpu_path, gen):
    layer = FusedMoE(6, 2, K, N, dtype=torch.float32)
    x = torch.randn(5, K, generator=gen)
    with torch.no_grad():
        out = layer(x)
        weights, ids = layer.route(layer.gate(x))
    assert torch.isfinite(out).all() and out.abs().sum() > 0
    assert rel_err(out, reference_moe(x, layer.w13, layer.w2, weights, ids, activation="silu")) <= 1e-4
    again = FusedMoE(6, 2, K, N, dtype=torch.float32)
    assert torch.equal(again.w13, layer.w13) and torch.equal(again.gate.weight, layer.gate.weight)
    bound = 1 / K ** 0.5
    assert layer.w13.abs().max() <= bound and layer.w2.abs().max() <= 1 / N ** 0.5


def test_fused_moe_from_preset_is_usable_and_meta_skips_init():
    layer = FusedMoE.from_preset("tiny", dtype=torch.float32)
    assert torch.isfinite(layer.w13).all() and layer.w13.abs().sum() > 0
    shape_only = FusedMoE.from_preset("qwen3-30b-a3b", device="meta")
    assert shape_only.w13.device.type == "meta"


def test_fused_moe_refuses_wrong_hidden_size():
    layer = FusedMoE(8, 2, 64, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="hidden_states must be .*hidden_size=64"):
        layer(torch.randn(8, 32))  # 256 elements would reshape to [4, 64] without the check


@pytest.mark.parametrize("kwargs, match", [
    (dict(router="softmax_renorm", num_groups=4, topk_groups=2), "biased_\\* routers only"),
    (dict(router="biased_sigmoid", num_groups=3), "num_groups must divide"),
    (dict(router="biased_sigmoid", num_groups=8, topk_groups=9), "topk_groups"),
    (dict(router="biased_sigmoid", num_groups=4, topk_groups=1), "k must be at most"),
], ids=["not-biased", "not-dividing", "more-kept-than-groups", "k-past-kept"])
def test_fused_moe_expert_groups_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedMoE(8, 3, 64, 32, dtype=torch.float32, **kwargs)


@pytest.mark.parametrize("bad, error", [([3], TypeError), (torch.tensor([3.0]), TypeError),
                                        (torch.tensor([[3]]), ValueError), (torch.tensor([1, 2]), ValueError)],
                         ids=["list", "float", "rank2", "two"])
def test_fused_moe_valid_tokens_must_be_one_index(bad, error):
    layer = FusedMoE(8, 2, 64, 32, dtype=torch.float32)
    with pytest.raises(error, match="valid_tokens"):
        layer(torch.randn(4, 64), valid_tokens=bad)


def test_fused_moe_refuses_router_logits_of_the_wrong_width():
    layer = FusedMoE(8, 2, 64, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="router_logits must be"):
        layer(torch.randn(8, 64), torch.randn(8, 5))
    with pytest.raises(ValueError, match="router_logits must be"):
        layer(torch.randn(8, 64), torch.randn(4, 8))


@pytest.mark.parametrize("router", ["softmax", "softmax_renorm", "topk_softmax", lambda logits, ids: None])
def test_fused_moe_refuses_a_scaling_factor_its_router_would_ignore(router):
    with pytest.raises(ValueError, match="routed_scaling_factor is applied by the biased_\\* routers only"):
        FusedMoE(8, 2, 64, 32, router=router, routed_scaling_factor=2.5, dtype=torch.float32)
    with pytest.raises(TypeError, match="routed_scaling_factor must be a number"):
        FusedMoE(8, 2, 64, 32, router="biased_sigmoid", routed_scaling_factor="2.5", dtype=torch.float32)
    FusedMoE(8, 2, 64, 32, router=router, routed_scaling_factor=1.0, dtype=torch.float32)


@pytest.mark.parametrize("sizes,dtype,name,error", [((16, 2, 64), torch.float32, "num_experts", ValueError),
                                                    ((8, 4, 64), torch.float32, "top_k", ValueError),
                                                    ((8, 2, 128), torch.float32, "hidden_size", ValueError),
                                                    ((8, 2, 64), torch.bfloat16, "dtype", TypeError)])
def test_fused_moe_refuses_an_expert_parallel_of_other_sizes(sizes, dtype, name, error):
    from padded_moe import ExpertParallel
    from padded_moe.ep import InProcessWorld

    def rank_fn(rank, transport):
        ep = ExpertParallel(None, 8, 2, 64, max_tokens_per_rank=4, dtype=torch.float32, transport=transport)
        with pytest.raises(error, match=f"{name}=.* differs from the expert_parallel's {name}="):
            FusedMoE(*sizes, 32, expert_parallel=ep, dtype=dtype)
        return FusedMoE(8, 2, 64, 32, expert_parallel=ep, dtype=torch.float32).num_local

    assert InProcessWorld(1).run(rank_fn) == [8]


def test_grouped_masked_never_drops_tokens_by_default(cpu_path, gen):
    # Duplicate ids in a row: expert 0 receives M*k slots, more than M.
    ids = torch.zeros(3, 2, dtype=torch.int32)
    meta = build_layout(GemmLayout.GROUPED_MASKED, ids, 2)
    assert meta.max_tokens_per_expert == 6 and int(meta.overflow) == 0
    hidden = torch.randn(3, 8, generator=gen)
    out = torch.empty(3, 8)
    unpermute(out, permute(hidden, meta), torch.ones(3, 2), meta)
    assert rel_err(out, 2 * hidden) <= 1e-6
    with pytest.raises(ValueError, match="max_tokens_per_expert=2 .*drop_overflow"):
        build_layout(GemmLayout.GROUPED_MASKED, ids, 2, max_tokens_per_expert=2)
    scratch = PermuteScratch(3, 2, 2, 2, "cpu", max_tokens_per_expert=2)
    with pytest.raises(ValueError, match="drop_overflow"):
        build_layout(GemmLayout.GROUPED_MASKED, ids, 2, scratch=scratch)
    dropped = build_layout(GemmLayout.GROUPED_MASKED, ids, 2, max_tokens_per_expert=2, drop_overflow=True)
    assert int(dropped.overflow) == 4
    with pytest.raises(TypeError, match="drop_overflow"):
        build_layout(GemmLayout.GROUPED_MASKED, ids, 2, drop_overflow="yes")


def test_demo_prints_only_measured_cells(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert main(["demo", "--device", "cpu", "--tokens", "4"]) == 0
    layer_lines = [line for line in capsys.readouterr().out.splitlines() if "layer" in line]
    assert layer_lines and all("yes" not in line for line in layer_lines)
    assert all("n/a" in line for line in layer_lines if "tiny" in line)


# ---------------------------------------------------------------------------------------------
# Errors that name the argument

def test_zero_experts_per_token_is_a_value_error():
    x, w13, w2 = torch.randn(4, K), torch.randn(2, 2 * N, K), torch.randn(2, K, N)
    with pytest.raises(ValueError, match="topk_ids must be .*k >= 1"):
        fused_experts(x, w13, w2, torch.zeros(4, 0), torch.zeros(4, 0, dtype=torch.int32), activation="silu")
    with pytest.raises(ValueError, match="topk_ids"):
        build_layout("indexed", torch.zeros(4, 0, dtype=torch.int64), 2)


def test_a_table_tensor_for_expert_map_names_from_table():
    """vLLM passes expert_map as a tensor; ours takes an ExpertMap and says how to convert."""
    x, w13, w2 = torch.randn(4, K), torch.randn(2, 2 * N, K), torch.randn(2, K, N)
    table = torch.tensor([-1, 0, 1, -1], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"expert_map must be an ExpertMap.*ExpertMap.from_table"):
        fused_experts(x, w13, w2, torch.ones(4, 1), torch.zeros(4, 1, dtype=torch.int32), activation="silu",
                      expert_map=table)


def test_from_preset_refuses_a_non_preset():
    with pytest.raises(TypeError, match="preset must be a preset name or a MoEPreset"):
        FusedMoE.from_preset(123)
    with pytest.raises(ValueError, match="preset must be one of"):
        FusedMoE.from_preset("nope")


@pytest.mark.parametrize("argument", ["w13", "w2", "topk_weights"])
def test_lists_for_tensors_are_type_errors(argument):
    kw = dict(hidden_states=torch.randn(4, K), w13=torch.randn(2, 2 * N, K), w2=torch.randn(2, K, N),
              topk_weights=torch.ones(4, 1), topk_ids=torch.zeros(4, 1, dtype=torch.int32))
    kw[argument] = kw[argument].tolist()
    with pytest.raises(TypeError, match=f"{argument} must be a torch.Tensor"):
        fused_experts(**kw, activation="silu")


def test_activation_parameters_must_be_numbers():
    with pytest.raises(TypeError, match="situ_beta must be a number"):
        ApplyMoEActivationConfig(situ_beta="4")
    with pytest.raises(ValueError, match="clamp_limit must not be NaN"):
        ApplyMoEActivationConfig(clamp_limit=float("nan"))
    assert ApplyMoEActivationConfig(situ_beta=4).situ_beta == 4.0
    out = torch.empty(2, 4)
    apply_moe_activation("situ", out, torch.randn(2, 8), activation_config=ApplyMoEActivationConfig(situ_beta=4))


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_experts=-1, top_k=2), "num_experts"),
    (dict(num_experts=8, top_k=0), "top_k"),
    (dict(num_experts=8, top_k=9), "top_k"),
    (dict(num_experts=8.0, top_k=2), "num_experts"),
    (dict(num_experts=8, top_k=2, hidden_size=0), "hidden_size"),
    (dict(num_experts=8, top_k=2, dtype=torch.int32), "dtype"),
])
def test_fused_moe_constructor_names_the_argument(kwargs, name):
    args = dict(hidden_size=64, intermediate_size=32) | kwargs
    with pytest.raises((TypeError, ValueError), match=name):
        FusedMoE(**args)


@pytest.mark.parametrize("argv, message", [
    (["demo", "--preset", "nope"], "preset must be one of"),
    (["demo", "--tokens", "-5", "--device", "cpu"], "--tokens must be >= 1"),
    (["demo", "--device", "tpu"], "--device must be cpu or cuda"),
    (["plan", "--gpu-mem", "inf"], "gpu_mem_gb must be a finite number"),
    (["plan", "--gpu-mem", "nan"], "gpu_mem_gb must be a finite number"),
])
def test_cli_bad_arguments_print_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 1 and message in captured.out and not captured.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cli_demo_on_cuda_without_cuda(capsys):
    assert main(["demo", "--device", "cuda"]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "sees no CUDA GPU" in out


def test_cli_demo_refuses_a_preset_that_does_not_fit(capsys, monkeypatch):
    from padded_moe import demo

    monkeypatch.setattr(demo, "memory_available", lambda device: 4 << 30)
    assert main(["demo", "--preset", "gpt-oss-120b", "--device", "cpu"]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "needs about" in out and "planner:" in out and "4.00 GiB available" in out


# ---------------------------------------------------------------------------------------------
# Memory

QUANTIZE_PEAK = textwrap.dedent("""
    import sys, threading
    sys.path.insert(0, sys.argv[1])  # the code under test, not an installed copy
    import torch
    from padded_moe.mxfp4 import quantize_mxfp4

    def anon():  # anonymous resident memory: file-backed library pages come and go under pressure
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

    E, rows, K = 48, 256, 2048
    w = torch.empty(E, rows, K, dtype=torch.bfloat16).uniform_(-1, 1)  # no temporary
    quantize_mxfp4(w[:1])  # warm code paths and allocator
    before, peak, done = anon(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            done.wait(0.0005)

    t = threading.Thread(target=sample)
    t.start()
    q = quantize_mxfp4(w)
    done.set()
    t.join()
    peak[0] = max(peak[0], anon())
    print(peak[0] - before, q.nbytes(), rows * K * 8, sys.modules["padded_moe"].__file__)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_quantize_mxfp4_peak_memory():
    """Peak growth below 1.5x the output plus one expert's float64 copy (never the whole weight's)."""
    import padded_moe

    src = os.path.dirname(os.path.dirname(padded_moe.__file__))
    # A fixed mmap threshold makes glibc hand freed blocks back at once, so RSS tracks live memory
    # rather than what the allocator keeps cached.
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    res = subprocess.run([sys.executable, "-c", QUANTIZE_PEAK, src], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    growth, out_bytes, one_expert_f64, *where = res.stdout.split()
    growth, out_bytes, one_expert_f64 = int(growth), int(out_bytes), int(one_expert_f64)
    assert where[-1].startswith(src), where
    assert growth < 1.5 * out_bytes + one_expert_f64, (growth, out_bytes, one_expert_f64)


def test_quantize_mxfp4_expert_by_expert_matches_whole(gen):
    w = torch.randn(3, 4, 64, generator=gen, dtype=torch.float64) * 5
    w[1] = 0.0
    kept = w.clone()
    q = quantize_mxfp4(w)
    assert torch.equal(w, kept), "the input must not be modified"
    dq = dequantize_mxfp4(q, torch.float64)
    assert (dq[1] == 0).all()
    for e in range(3):
        assert torch.equal(quantize_mxfp4(w[e:e + 1]).blocks[0], q.blocks[e])
    with pytest.raises(ValueError, match="expert 2"):
        bad = w.clone()
        bad[2, 0, 0] = float("inf")
        quantize_mxfp4(bad)


def _small_call(gen, M=5, E=4, k=2):
    x = torch.randn(M, K, generator=gen)
    w13 = torch.randn(E, 2 * N, K, generator=gen) * 0.1
    w2 = torch.randn(E, K, N, generator=gen) * 0.1
    ids = torch.randint(0, E, (M, k), generator=gen, dtype=torch.int32)
    return dict(hidden_states=x, w13=w13, w2=w2, topk_weights=torch.rand(M, k, generator=gen), topk_ids=ids)


@pytest.mark.parametrize("case, error, message", [
    ("w13 strided", ValueError, "w13 must have a contiguous last dimension"),
    ("w2 strided", ValueError, "w2 must have a contiguous last dimension"),
    ("w2 bf16", TypeError, "w2 must have hidden_states's dtype"),
    ("w2_bias shape", ValueError, "w2_bias must have shape"),
    ("w13_bias float64", TypeError, "w13_bias must have dtype"),
    ("hidden_states strided", ValueError, "hidden_states must have a contiguous last dimension"),
    ("scratch", TypeError, "scratch must be a PermuteScratch"),
])
def test_fused_experts_refusals_name_the_callers_argument(cpu_path, gen, case, error, message):
    kw = _small_call(gen)
    E = kw["w13"].shape[0]
    over = {"w13 strided": lambda: dict(w13=kw["w13"].transpose(1, 2).contiguous().transpose(1, 2)),
            "w2 strided": lambda: dict(w2=kw["w2"].transpose(1, 2).contiguous().transpose(1, 2)),
            "w2 bf16": lambda: dict(w2=kw["w2"].bfloat16()),
            "w2_bias shape": lambda: dict(w13_bias=torch.zeros(E, 2 * N), w2_bias=torch.zeros(E, N)),
            "w13_bias float64": lambda: dict(w13_bias=torch.zeros(E, 2 * N, dtype=torch.float64)),
            "hidden_states strided": lambda: dict(hidden_states=kw["hidden_states"].t().contiguous().t()),
            "scratch": lambda: dict(scratch=object())}[case]()
    with pytest.raises(error, match=message):
        fused_experts(**{**kw, **over}, activation="silu")


def test_batched_experts_takes_a_permuted_dense_x_without_out(cpu_path, gen):
    """A dense `x` in another dimension order ([T, L, K] storage seen as [L, T, K]) gets a contiguous
    output of its own, not one that copies x's strides and is then refused as `out`."""
    L, T = 3, 4
    x = torch.randn(T, L, K, generator=gen).transpose(0, 1)
    w13 = torch.randn(L, 2 * N, K, generator=gen) * 0.2
    w2 = torch.randn(L, K, N, generator=gen) * 0.2
    out = batched_experts(x, torch.tensor([4, 1, 0]), w13, w2, activation="silu")
    assert out.is_contiguous()
    assert rel_err(out[0], _expert_ref(x[0], w13[0], w2[0])) <= 1e-5
    assert rel_err(out[1, :1], _expert_ref(x[1, :1], w13[1], w2[1])) <= 1e-5


def test_fused_moe_forward_names_a_hidden_states_dtype_mismatch():
    layer = FusedMoE(4, 2, K, N, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="hidden_states must have the layer's dtype torch.bfloat16"):
        layer(torch.randn(3, K))


def test_load_experts_refuses_biases_it_would_drop_or_misread(gen):
    E = 4
    w13, w2 = torch.randn(E, 2 * N, K, generator=gen), torch.randn(E, K, N, generator=gen)
    plain = FusedMoE(E, 2, K, N, dtype=torch.float32)
    with pytest.raises(ValueError, match="w13_bias given, but this layer has no biases"):
        plain.load_experts(w13, w2, w13_bias=torch.zeros(E, 2 * N))
    biased = FusedMoE(E, 2, K, N, dtype=torch.float32, has_bias=True)
    with pytest.raises(ValueError, match=r"w2_bias must be \(4, 32\)"):
        biased.load_experts(w13, w2, w2_bias=torch.zeros(E, N))
    with pytest.raises(TypeError, match="w13_bias"):
        biased.load_experts(w13, w2, w13_bias=[[0.0] * (2 * N)] * E)
    b13, b2 = torch.randn(E, 2 * N, generator=gen), torch.randn(E, K, generator=gen)
    biased.load_experts(w13, w2, w13_bias=b13, w2_bias=b2)
    assert torch.equal(biased.w13_bias, b13) and torch.equal(biased.w2_bias, b2)


@pytest.mark.parametrize("tuning, error", [({"max_block_d": 0}, ValueError), ({"max_block_d": 1000}, ValueError),
                                           ({"num_warps": 0}, ValueError), ({"num_warps": 3}, ValueError),
                                           ({"tile_elems": "big"}, TypeError), ({"tile_elems": 0}, ValueError)])
def test_activation_tuning_values_are_checked(tuning, error):
    x = torch.randn(4, 2 * N)
    with pytest.raises(error, match="tuning"):
        apply_moe_activation("silu", torch.empty(4, N), x, tuning=tuning)


def test_activation_check_counts_must_be_a_bool():
    with pytest.raises(TypeError, match="check_counts must be a bool"):
        apply_moe_activation("silu", torch.empty(4, N), torch.randn(4, 2 * N), check_counts="yes")


def test_expert_parallel_arguments_are_typed():
    """ExpertParallel's flags take bools only (1 and "no" are not), a CUDA device needs CUDA, and
    FusedMoE takes an ExpertParallel or None; a batched one refuses the layouts and biases it
    would ignore, at construction."""
    from padded_moe import ExpertParallel
    from padded_moe.ep import InProcessWorld

    def rank_fn(rank, transport):
        make = lambda **kw: ExpertParallel(None, 8, 2, 64, max_tokens_per_rank=4, dtype=torch.float32,
                                           transport=transport, **kw)
        for kw in (dict(keep_own_chunk=1), dict(keep_own_chunk=0.0), dict(graph_safe="no"), dict(graph_safe=None)):
            with pytest.raises(TypeError, match=f"{next(iter(kw))} must be"):
                make(**kw)
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match="CUDA is not available"):
                make(device="cuda")
        for bad in (object(), True, "ep"):
            with pytest.raises(TypeError, match="expert_parallel must be an ExpertParallel or None"):
                FusedMoE(8, 2, 64, 32, expert_parallel=bad, dtype=torch.float32)
        batched = make(mode="batched")
        with pytest.raises(ValueError, match="not legal for the batched format"):
            FusedMoE(8, 2, 64, 32, expert_parallel=batched, dtype=torch.float32, layout="indexed")
        with pytest.raises(NotImplementedError, match="has_bias=True"):
            FusedMoE(8, 2, 64, 32, expert_parallel=batched, dtype=torch.float32, has_bias=True)
        return FusedMoE(8, 2, 64, 32, expert_parallel=batched, dtype=torch.float32, layout="grouped_masked").num_local

    assert InProcessWorld(1).run(rank_fn) == [8]
