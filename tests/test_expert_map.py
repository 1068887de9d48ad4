"""ExpertMap placement and the invalid-expert-ID guard `sanitize_topk_ids` (spec 02)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from padded_moe.expert_map import ExpertMap, sanitize_topk_ids

# Ids that must always be dropped, whatever the map (E is added per test).
GARBAGE32 = [-1, 2**31 - 1, -(2**31), -7]
GARBAGE64 = GARBAGE32 + [2**32, 2**32 + 1, -(2**32) + 1, 2**63 - 1, -(2**63), 2**31]


def owner_ranges(E, R):
    """Independent statement of linear placement: sizes differ by at most one, larger ones first."""
    sizes = [E // R + (1 if r < E % R else 0) for r in range(R)]
    starts = [sum(sizes[:r]) for r in range(R)]
    return [list(range(starts[r], starts[r] + sizes[r])) for r in range(R)]


@pytest.mark.parametrize("E,R", [(10, 4), (8, 2), (3, 5), (128, 3), (1, 1)])
def test_linear_placement_spreads_remainder_over_first_ranks(E, R):
    expected = owner_ranges(E, R)
    owned = []
    for r in range(R):
        m = ExpertMap(E, r, R, "linear")
        assert m.local_experts.tolist() == expected[r]
        assert m.num_local == len(expected[r])
        want = [-1] * E
        for i, g in enumerate(expected[r]):
            want[g] = i
        assert m.map.dtype == torch.int32 and m.map.tolist() == want
        owned += m.local_experts.tolist()
    assert sorted(owned) == list(range(E))  # every expert on exactly one rank


@pytest.mark.parametrize("E,R", [(10, 4), (7, 3), (2, 4)])
def test_round_robin_placement(E, R):
    owned = []
    for r in range(R):
        m = ExpertMap(E, r, R, placement="round_robin")
        assert m.local_experts.tolist() == [g for g in range(E) if g % R == r]
        assert [m.map[g].item() for g in m.local_experts.tolist()] == list(range(m.num_local))
        assert all(m.map[g].item() == -1 for g in range(E) if g % R != r)
        owned += m.local_experts.tolist()
    assert sorted(owned) == list(range(E))


def test_identity_and_to():
    m = ExpertMap.identity(6)
    assert m.num_local == 6 and m.is_identity
    assert m.map.tolist() == list(range(6)) and m.local_experts.tolist() == list(range(6))
    moved = ExpertMap(9, 1, 2).to("cpu")
    assert moved.map.tolist() == ExpertMap(9, 1, 2).map.tolist() and moved.device.type == "cpu"
    assert "num_local=4" in repr(moved)


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(num_experts=0, ep_rank=0, ep_size=1), ValueError, "num_experts"),
    (dict(num_experts=4.0, ep_rank=0, ep_size=1), TypeError, "num_experts"),
    (dict(num_experts=True, ep_rank=0, ep_size=1), TypeError, "num_experts"),
    (dict(num_experts=4, ep_rank=2, ep_size=2), ValueError, "ep_rank"),
    (dict(num_experts=4, ep_rank=-1, ep_size=2), ValueError, "ep_rank"),
    (dict(num_experts=4, ep_rank=0, ep_size=0), ValueError, "ep_size"),
    (dict(num_experts=4, ep_rank=0, ep_size=2, placement="striped"), ValueError, "placement"),
])
def test_expert_map_rejects_bad_arguments(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        ExpertMap(**kwargs)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_from_table_any_placement(dtype):
    """vLLM's expert_map tensor: local indices in any order over any set of global experts."""
    table = torch.tensor([-1, 2, -1, 0, 1, -1], dtype=dtype)
    m = ExpertMap.from_table(table)
    assert m.num_experts == 6 and m.num_local == 3 and m.placement == "table"
    assert m.ep_rank is None and m.ep_size is None
    assert m.map.dtype == torch.int32 and m.map.tolist() == table.tolist()
    assert m.local_experts.tolist() == [3, 4, 1]  # global id of local index 0, 1, 2
    assert not m.is_identity
    moved = m.to("cpu")
    assert moved.map.tolist() == table.tolist() and moved.local_experts.tolist() == [3, 4, 1]
    assert "from_table" in repr(m) and "num_local=3" in repr(m)
    # The same placement as a linear map gives the same map.
    linear = ExpertMap(10, 1, 3)
    assert ExpertMap.from_table(linear.map).local_experts.tolist() == linear.local_experts.tolist()


def test_from_table_identity_only_when_every_expert_sits_at_its_own_index():
    assert ExpertMap.from_table(torch.arange(5)).is_identity
    # All experts local but permuted: the map must still be read (not skipped as an identity).
    swapped = ExpertMap.from_table(torch.tensor([1, 0, 2]))
    assert swapped.num_local == swapped.num_experts == 3 and not swapped.is_identity
    ids = torch.tensor([[0, 1], [2, 5]], dtype=torch.int32)
    assert sanitize_topk_ids(ids, swapped).tolist() == [[1, 0], [2, 3]]


@pytest.mark.parametrize("table,exc,words", [
    ([0, 1], TypeError, "table"),  # a list, not a tensor
    (torch.tensor([0.0, 1.0]), TypeError, "table"),
    (torch.zeros(2, 2, dtype=torch.int32), ValueError, "table"),
    (torch.zeros(0, dtype=torch.int32), ValueError, "empty"),
    (torch.tensor([0, -2], dtype=torch.int32), ValueError, r"table\[1\]"),
    (torch.tensor([0, 3, -1], dtype=torch.int32), ValueError, r"table\[1\]"),
    (torch.tensor([0, 0, -1], dtype=torch.int32), ValueError, "exactly once"),
    (torch.tensor([1, 2, -1], dtype=torch.int32), ValueError, "exactly once"),
])
def test_from_table_rejects_bad_tables(table, exc, words):
    with pytest.raises(exc, match=words):
        ExpertMap.from_table(table)


def ref_sanitize(ids, E, emap, L, valid_tokens):
    """Python-int loop: the guard as the spec states it."""
    out = []
    for t, row in enumerate(ids):
        r = []
        for g in row:
            if t >= valid_tokens or g < 0 or g >= E:
                r.append(L)
            else:
                loc = emap[g] if emap is not None else g
                r.append(loc if loc >= 0 else L)
        out.append(r)
    return out


@pytest.mark.parametrize("dtype,garbage", [(torch.int32, GARBAGE32), (torch.int64, GARBAGE64)])
def test_sanitize_drops_every_invalid_id_with_and_without_map(dtype, garbage):
    E = 4
    bad = garbage + [E, E + 1]
    ids = torch.tensor([[g, 0] for g in bad] + [[1, 3], [2, 0]], dtype=dtype)
    no_map = sanitize_topk_ids(ids, E)
    assert no_map.dtype == torch.int32
    assert no_map.tolist() == [[E, 0]] * len(bad) + [[1, 3], [2, 0]]
    m = ExpertMap(E, 0, 2)  # owns 0, 1 → L = 2
    with_map = sanitize_topk_ids(ids, m)
    assert with_map.tolist() == [[2, 0]] * len(bad) + [[1, 2], [2, 0]]


def test_sanitize_seed_regression():
    ids = torch.tensor([[0], [-1], [1], [4], [2]], dtype=torch.int32)
    m = ExpertMap(4, 0, 2)
    assert m.map.tolist() == [0, 1, -1, -1]
    assert sanitize_topk_ids(ids, m).flatten().tolist() == [0, 2, 1, 2, 2]


id_values = st.one_of(st.integers(-3, 12), st.sampled_from([2**31 - 1, -(2**31), 2**32 + 1, 2**40]))


@settings(max_examples=60, deadline=None)
@given(E=st.integers(1, 10), R=st.integers(1, 3), rank_seed=st.integers(0, 99),
       placement=st.sampled_from(["linear", "round_robin"]), use_map=st.booleans(),
       rows=st.lists(st.lists(id_values, min_size=3, max_size=3), min_size=0, max_size=7),
       vt=st.one_of(st.none(), st.integers(-1, 9)))
def test_sanitize_matches_loop_reference(E, R, rank_seed, placement, use_map, rows, vt):
    m = ExpertMap(E, rank_seed % R, R, placement)
    if placement == "round_robin" and rank_seed % 2:
        m = ExpertMap.from_table(m.map)  # the same placement given as its table
    ids = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 3)
    experts = m if use_map else E
    emap = m.map.tolist() if use_map else None
    L = m.num_local if use_map else E
    vt_t = None if vt is None else torch.tensor([vt], dtype=torch.int32)
    got = sanitize_topk_ids(ids, experts, valid_tokens=vt_t)
    want = ref_sanitize(rows, E, emap, L, len(rows) if vt is None else vt)
    assert got.tolist() == (want if rows else [])
    # int32 inputs give the same answer when the values fit.
    if all(-(2**31) <= g < 2**31 for r in rows for g in r):
        assert sanitize_topk_ids(ids.to(torch.int32), experts, valid_tokens=vt_t).tolist() == got.tolist()


@pytest.mark.parametrize("ids,experts,vt,exc,words", [
    (torch.zeros(2, 2), 4, None, TypeError, "topk_ids"),
    (torch.zeros(4, dtype=torch.int32), 4, None, ValueError, "topk_ids"),
    (torch.zeros(2, 2, dtype=torch.int32), 0, None, ValueError, "experts"),
    (torch.zeros(2, 2, dtype=torch.int32), "4", None, TypeError, "experts"),
    (torch.zeros(2, 2, dtype=torch.int32), 4, torch.tensor([1, 2], dtype=torch.int32), ValueError, "valid_tokens"),
    (torch.zeros(2, 2, dtype=torch.int32), 4, torch.tensor([1.0]), TypeError, "valid_tokens"),
    (torch.zeros(2, 2, dtype=torch.int32), 4, 3, TypeError, "valid_tokens"),
])
def test_sanitize_rejects_bad_arguments(ids, experts, vt, exc, words):
    with pytest.raises(exc, match=words):
        sanitize_topk_ids(ids, experts, valid_tokens=vt)
