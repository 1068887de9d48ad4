"""`programs_per_sm` against the CUDA driver's own occupancy calculator, on the kernels whose grids
it sizes (the activation, permute and unpermute stride over rows with one wave of programs)."""

import ctypes
import math

import pytest
import torch

from padded_moe import _platform
from padded_moe.activation import ApplyMoEActivationConfig, apply_moe_activation
from padded_moe.kernels import _launch
from padded_moe.layouts import GemmLayout, build_layout, permute, unpermute

pytestmark = pytest.mark.gpu


def driver_programs_per_sm(kernel) -> int:
    """cuOccupancyMaxActiveBlocksPerMultiprocessor for the loaded kernel (its dynamic shared memory
    is Triton's `metadata.shared`)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    n = ctypes.c_int()
    threads = kernel.metadata.num_warps * 32
    rc = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), ctypes.c_void_p(kernel.function),
                                                          ctypes.c_int(threads), ctypes.c_size_t(kernel.metadata.shared))
    assert rc == 0, rc
    return n.value


@pytest.fixture
def launches(monkeypatch):
    seen = []
    real = _launch.launch

    def spy(fn, grid, key, args, constexprs, **kw):
        real(fn, grid, key, args, constexprs, **kw)
        seen.append((fn, tuple(grid), _launch._CACHE[_launch.cache_key(fn, torch.cuda.current_device(), key, constexprs,
                                                                     kw["num_warps"], kw.get("num_stages"),
                                                                     kw.get("maxnreg"))]))

    monkeypatch.setattr(_launch, "launch", spy)
    return seen


def test_striding_grids_are_one_wave_of_what_the_driver_says_fits(launches):
    torch.manual_seed(0)
    for act, width in (("silu", 4096), ("situ", 4096), ("gelu_tanh_no_mul", 2048)):
        x = torch.randn(4096, width, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(4096, 2048, device="cuda", dtype=torch.bfloat16)
        cfg = ApplyMoEActivationConfig(situ_beta=4.0, situ_linear_beta=25.0) if act == "situ" else None
        apply_moe_activation(act, out, x, activation_config=cfg,
                             valid_token_counts=torch.tensor([3000], device="cuda", dtype=torch.int32))
    M, k, E, K = 2048, 8, 64, 2048
    ids = torch.rand(M, E, device="cuda").topk(k, dim=1).indices.to(torch.int32)
    hidden = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    for layout in (GemmLayout.INDEXED, GemmLayout.GROUPED_CONTIGUOUS):
        meta = build_layout(layout, ids, E)
        y = permute(hidden, meta) if layout != GemmLayout.INDEXED else torch.randn(M * k, K, device="cuda",
                                                                                  dtype=torch.bfloat16)
        unpermute(torch.empty(M, K, device="cuda", dtype=torch.bfloat16), y, torch.rand(M, k, device="cuda"), meta)
    torch.cuda.synchronize()
    sms = _platform.num_sms(torch.cuda.current_device())
    names = set()
    for fn, grid, kernel in launches:
        name = fn.__name__
        if name not in ("moe_activation_kernel", "_permute_kernel", "_unpermute_kernel"):
            continue
        names.add(name)
        kernel._init_handles()
        ours = _platform.programs_per_sm(torch.cuda.current_device(), kernel.metadata.num_warps, kernel.n_regs,
                                         kernel.metadata.shared)
        assert ours == driver_programs_per_sm(kernel), (name, kernel.n_regs, kernel.metadata.shared)
        assert math.prod(grid) <= sms * ours, (name, grid)
    assert names == {"moe_activation_kernel", "_permute_kernel", "_unpermute_kernel"}
