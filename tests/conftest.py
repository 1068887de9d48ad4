"""Test setup: Triton's interpreter on machines without CUDA, the `gpu` marker, path switching.

`TRITON_INTERPRET=1` must be set before any `@triton.jit` runs (Triton picks interpreter or
compiler at decoration time), so this file sets it before padded_moe's kernels are imported.
"""

import datetime
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Import Triton now, while the variable is set: Triton patches its language helpers for the
    # interpreter at first import, and a torch-path test that imported it with the variable at 0
    # would leave every later interpreted kernel broken.
    import triton  # noqa: F401


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and torch.cuda.device_count() < 2:
            item.add_marker(skip_multi)


# The ways a CPU test can run our code: the torch path, or the Triton kernels interpreted.
CPU_PATHS = ["torch", "triton_interpret"]


@pytest.fixture(params=CPU_PATHS)
def cpu_path(request, monkeypatch):
    """Run the test once on the torch path and once on the interpreted Triton kernels."""
    if request.param == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    else:
        from padded_moe._platform import kernels_interpreted

        if not kernels_interpreted():
            pytest.skip("Triton kernels were compiled for a GPU; the interpreter is not in use")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


@pytest.fixture
def gen():
    """A fresh, per-test seeded generator. The seed is printed (pytest shows a failing test's
    captured output), so a failure can be replayed with PADDED_MOE_SEED=<seed>."""
    seed = int(os.environ.get("PADDED_MOE_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"generator seed: {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def one_rank_group():
    """A world of one (gloo, in-memory store) for argument checks and the trivial EP."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.fixture
def decode_calls(monkeypatch):
    """The token counts of the `fused_experts` calls that took the decode path (`padded_moe.decode`)."""
    from padded_moe import experts

    calls = []
    real = experts.decode_experts

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(experts, "decode_experts", spy)
    return calls
