"""`padded_moe._platform.programs_per_sm`: resident programs per SM from a kernel's resources."""

from types import SimpleNamespace

import pytest
import torch

from padded_moe import _platform

H200 = SimpleNamespace(warp_size=32, max_threads_per_multi_processor=2048, shared_memory_per_multiprocessor=233472)


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: H200)
    _platform.programs_per_sm.cache_clear()
    yield
    _platform.programs_per_sm.cache_clear()


@pytest.mark.parametrize("warps,regs,shared,want", [
    (4, 45, 0, 10),  # Nsight Compute on an H200: 62.5% theoretical occupancy (40 of 64 warps)
    (8, 48, 0, 5),  # the same 62.5% for the unpermute kernel of 8 warps
    (4, 32, 0, 16),  # 32 registers: the threads limit (2048 per SM)
    (4, 24, 0, 16),  # fewer registers do not add programs past the threads limit
    (1, 16, 0, 32),  # the 32-programs limit
    (4, 32, 80 * 1024, 2),  # shared memory: 228 KB over 80 KB + 1 KB reserved per program
    (4, 255, 0, 2),  # 255 registers: 8192 per warp (rounded up to 256), 2 programs of 4 warps
])
def test_programs_per_sm_from_registers_threads_and_shared_memory(h200, warps, regs, shared, want):
    assert _platform.programs_per_sm(0, warps, regs, shared) == want


def test_at_least_one_program(h200):
    assert _platform.programs_per_sm(0, 32, 255, 200 * 1024) == 1


@pytest.mark.parametrize("items,cap,want", [(24576, 1056, 1024), (12288, 1056, 1024), (10, 4, 4), (9, 4, 3),
                                            (3, 8, 3), (5, 0, 1), (7, 1, 1)])
def test_even_split_gives_each_part_the_same_rounds(items, cap, want):
    from padded_moe._util import cdiv, even_split

    parts = even_split(items, cap)
    assert parts == want and parts <= max(1, cap)
    assert cdiv(items, parts) == cdiv(items, max(1, cap))  # no more rounds than `cap` parts would take
