"""Layouts of spec 02 on CPU: torch path and interpreted Triton kernels vs a loop-over-experts reference.

The reference below is written from the spec with python lists only; it shares no code with
`padded_moe.layouts` or its kernels.
"""

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import SENTINEL
from padded_moe.expert_map import ExpertMap
from padded_moe.layouts import (BLOCK_128_MEAN_ROWS, GemmLayout, GroupedContiguousMeta,
                                GroupedMaskedMeta, IndexedMeta, PermuteScratch, build_layout, build_layout_resolved,
                                default_block_m, permute, select_gemm_layout, unpermute)

LAYOUTS = list(GemmLayout)


# ----------------------------------------------------------------------------------------------
# Independent reference
# ----------------------------------------------------------------------------------------------

def ref_local(ids, E, emap, L, vt):
    """Per slot (t*k+j): local expert or L (dropped)."""
    out = []
    for t, row in enumerate(ids):
        for g in row:
            if t >= vt or g < 0 or g >= E:
                out.append(L)
            else:
                loc = emap[g] if emap is not None else g
                out.append(loc if loc >= 0 else L)
    return out


def ref_layout(layout, ids, E, emap, L, vt, bm, T):
    """Every metadata field as python lists, by looping over experts."""
    M = len(ids)
    k = len(ids[0]) if ids else 0
    S = M * k
    local = ref_local(ids, E, emap, L, vt)
    slots_of = [[s for s in range(S) if local[s] == e] for e in range(L)]
    r = {"slot_expert": local}
    if layout == GemmLayout.GROUPED_CONTIGUOUS:
        offsets = [0]
        for e in range(L):
            offsets.append(offsets[-1] + len(slots_of[e]))
        inv = [S] * S
        src = []
        for e in range(L):
            for i, s in enumerate(slots_of[e]):
                inv[s] = offsets[e] + i
                src.append(s)
        r.update(offsets=offsets, inv=inv, src=src + [S] * (S - len(src)), activation_counts=[offsets[L]])
    elif layout == GemmLayout.INDEXED:
        sorted_ids, block_expert = [], []
        for e in range(L):
            n = len(slots_of[e])
            padded = math.ceil(n / bm) * bm
            sorted_ids += slots_of[e] + [S] * (padded - n)
            block_expert += [e] * (padded // bm)
        cap = math.ceil((S + L * (bm - 1)) / bm) * bm
        r.update(num_padded=[len(sorted_ids)], sorted_ids=sorted_ids + [S] * (cap - len(sorted_ids)),
                 block_expert=block_expert + [-1] * (cap // bm - len(block_expert)),
                 activation_counts=[max(0, min(vt, M)) * k])
    else:
        inv = [L * T] * S
        for e in range(L):
            for i, s in enumerate(slots_of[e][:T]):
                inv[s] = e * T + i
        counts = [min(len(x), T) for x in slots_of]
        r.update(counts=counts, inv=inv, overflow=[sum(max(len(x) - T, 0) for x in slots_of)],
                 activation_counts=counts)
    r["slots_of"] = slots_of
    return r


def check_meta(meta, ref):
    for name, want in ref.items():
        if name == "slots_of":
            continue
        got = getattr(meta, name)
        assert got.tolist() == want, f"{name}: got {got.tolist()} want {want}"


def ref_unpermute(hidden_y_rows, weights, ref, layout, M, k, L, T, vt):
    """float64: Σ over kept slots of w · Y[row]; None rows (t >= vt) stay untouched."""
    out = []
    row_of = {}
    for e in range(L):
        for i, s in enumerate(ref["slots_of"][e]):
            if layout == GemmLayout.GROUPED_MASKED:
                if i < T:
                    row_of[s] = e * T + i
            elif layout == GemmLayout.GROUPED_CONTIGUOUS:
                row_of[s] = ref["inv"][s]
            else:
                row_of[s] = s
    for t in range(M):
        if t >= vt:
            out.append(None)
            continue
        acc = torch.zeros(hidden_y_rows.shape[1], dtype=torch.float64)
        for j in range(k):
            s = t * k + j
            if s in row_of:
                acc += float(weights[t, j]) * hidden_y_rows[row_of[s]].double()
        out.append(acc)
    return out, row_of


# ----------------------------------------------------------------------------------------------
# One full round: build → permute → fake expert output → unpermute, everything checked
# ----------------------------------------------------------------------------------------------

def run_round(layout, ids, experts, *, gen, vt=None, bm=None, T=None, scratch=None, K=8,
              dtype=torch.float32, id_dtype=torch.int32):
    M = len(ids)
    k = len(ids[0]) if ids else 2
    if isinstance(experts, ExpertMap):
        E, emap, L = experts.num_experts, experts.map.tolist(), experts.num_local
    else:
        E, emap, L = experts, None, experts
    ids_t = torch.tensor(ids, dtype=id_dtype).reshape(M, k)
    vt_t = None if vt is None else torch.tensor([vt], dtype=torch.int32)
    meta = build_layout(layout, ids_t, experts, block_m=bm, max_tokens_per_expert=T, valid_tokens=vt_t,
                        scratch=scratch, drop_overflow=True)
    n_valid = M if vt is None else vt
    T_eff = meta.max_tokens_per_expert if layout == GemmLayout.GROUPED_MASKED else None
    bm_eff = meta.block_m if layout == GemmLayout.INDEXED else 1
    ref = ref_layout(layout, [list(r) for r in ids], E, emap, L, n_valid, bm_eff, T_eff)
    check_meta(meta, ref)

    hidden = torch.randn(M, K, generator=gen).to(dtype)
    hidden[max(0, n_valid):] = float("nan")  # padding rows: must never be read
    S = M * k
    if layout == GemmLayout.INDEXED:
        assert permute(hidden, meta) is hidden
        y = torch.randn(S, K, generator=gen).to(dtype)
    else:
        shape = (L, T_eff, K) if layout == GemmLayout.GROUPED_MASKED else (S, K)
        out_p = torch.full(shape, SENTINEL, dtype=dtype)
        assert permute(hidden, meta, out=out_p) is out_p
        flat = out_p.reshape(-1, K)
        written = set()
        for e in range(L):
            for i, s in enumerate(ref["slots_of"][e]):
                row = (e * T_eff + i) if T_eff is not None else ref["inv"][s]
                if T_eff is not None and i >= T_eff:
                    continue
                assert torch.equal(flat[row], hidden[s // k]), f"permuted row {row} (slot {s})"
                written.add(row)
        untouched = [r for r in range(flat.shape[0]) if r not in written]
        assert bool((flat[untouched] == SENTINEL).all()), "permute wrote a row it does not own"
        # Also the allocating form (or the scratch buffer) gives the same rows.
        again = permute(hidden, meta)
        assert torch.equal(again.reshape(-1, K)[sorted(written)], flat[sorted(written)])
        y = torch.randn(*shape, generator=gen).to(dtype)
    y_rows = y.reshape(-1, K)
    weights = torch.rand(M, k, generator=gen) + 0.1
    want, row_of = ref_unpermute(y_rows, weights, ref, layout, M, k, L, T_eff, n_valid)
    kept_rows = set(row_of.values())
    for r in range(y_rows.shape[0]):
        if r not in kept_rows:
            y_rows[r] = float("nan")  # rows the GEMMs never computed
    out = torch.full((M, K), SENTINEL, dtype=dtype)
    assert unpermute(out, y, weights, meta) is out
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for t in range(M):
        if want[t] is None:
            assert bool((out[t] == SENTINEL).all()), f"row {t} at/after valid_tokens was written"
        elif all((t * k + j) not in row_of for j in range(k)):
            assert bool((out[t] == 0).all()), f"token {t} with every slot dropped must be zero"
        else:
            assert torch.allclose(out[t].double(), want[t], rtol=tol, atol=tol), f"token {t}"
    return meta


# ----------------------------------------------------------------------------------------------
# The seed regression
# ----------------------------------------------------------------------------------------------

SEED_IDS = [[0], [-1], [1], [4], [2]]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("with_scratch", [False, True])
def test_seed_regression_with_map(cpu_path, layout, with_scratch, gen):
    m = ExpertMap(4, 0, 2)
    assert m.map.tolist() == [0, 1, -1, -1]
    scratch = PermuteScratch(8, 1, 4, 2, "cpu") if with_scratch else None
    meta = run_round(layout, SEED_IDS, m, gen=gen, scratch=scratch)
    assert meta.slot_expert.tolist() == [0, 2, 1, 2, 2]
    if layout == GemmLayout.GROUPED_CONTIGUOUS:
        assert meta.offsets.tolist() == [0, 1, 2]
    if layout == GemmLayout.GROUPED_MASKED:
        assert meta.counts.tolist() == [1, 1]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("with_scratch", [False, True])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_seed_regression_no_map_garbage(cpu_path, layout, with_scratch, id_dtype, gen):
    E = 4
    ids = [[0], [-1], [1], [E], [2**31 - 1], [-(2**31)], [3]]
    if id_dtype == torch.int64:
        ids += [[2**32 + 1], [2**32], [-(2**32) + 2]]  # would wrap to 1, 0, 2 if narrowed first
    scratch = PermuteScratch(len(ids), 1, E, E, "cpu") if with_scratch else None
    meta = run_round(layout, ids, E, gen=gen, scratch=scratch, id_dtype=id_dtype)
    want = [0, E, 1, E, E, E, 3] + [E] * (len(ids) - 7)
    assert meta.slot_expert.tolist() == want


# ----------------------------------------------------------------------------------------------
# Randomised comparison
# ----------------------------------------------------------------------------------------------

id_values = st.one_of(st.integers(-2, 9), st.sampled_from([2**31 - 1, -(2**31)]))


@st.composite
def routing_case(draw):
    E = draw(st.integers(1, 9))
    R = draw(st.integers(1, 3))
    experts = ExpertMap(E, draw(st.integers(0, R - 1)), R, draw(st.sampled_from(["linear", "round_robin"])))
    if draw(st.booleans()) or experts.num_local == 0:
        experts = E
    k = draw(st.integers(1, 3))
    M = draw(st.integers(0, 9))
    ids = [draw(st.lists(id_values, min_size=k, max_size=k)) for _ in range(M)]
    vt = draw(st.one_of(st.none(), st.integers(0, M + 1)))
    return experts, ids, k, vt


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=routing_case(), layout=st.sampled_from(LAYOUTS), bm=st.sampled_from([None, 1, 2, 4]),
       T=st.one_of(st.none(), st.integers(0, 4)), seed=st.integers(0, 2**31))
def test_random_layouts_match_reference(cpu_path, case, layout, bm, T, seed):
    experts, ids, k, vt = case
    if not ids:
        ids = []
    gen = torch.Generator().manual_seed(seed)
    run_round(layout, ids if ids else [], experts, gen=gen, vt=vt, bm=bm, T=T)


def test_idle_rank_m_zero(cpu_path, gen):
    m = ExpertMap(8, 1, 2)
    for layout in LAYOUTS:
        ids = torch.empty(0, 4, dtype=torch.int32)
        meta = build_layout(layout, ids, m, block_m=4)
        assert meta.slot_expert.numel() == 0
        hidden = torch.empty(0, 16)
        y = permute(hidden, meta)
        out = torch.empty(0, 16)
        assert unpermute(out, y if layout != GemmLayout.INDEXED else torch.empty(0, 16),
                         torch.empty(0, 4), meta) is out
        if layout == GemmLayout.GROUPED_CONTIGUOUS:
            assert meta.offsets.tolist() == [0] * 5 and meta.activation_counts.tolist() == [0]
        elif layout == GemmLayout.INDEXED:
            assert meta.num_padded.tolist() == [0] and set(meta.block_expert.tolist()) == {-1}
            assert set(meta.sorted_ids.tolist()) <= {0}
        else:
            assert meta.counts.tolist() == [0] * 4 and tuple(y.shape) == (4, 0, 16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_valid_tokens_with_garbage_padding_rows(cpu_path, layout, gen):
    """The EP flat receive buffer: real rows first, padding rows with stale in-range ids."""
    m = ExpertMap(12, 1, 3, "round_robin")  # owns 1, 4, 7, 10
    M, k, vt = 10, 3, 6
    ids = torch.randint(0, 12, (M, k), generator=gen)
    ids[:vt, 0] = 4  # at least one local slot in the real rows
    ids[vt:] = torch.tensor([1, 4, 7])  # garbage that would be local if the rows were real
    meta = run_round(layout, ids.tolist(), m, gen=gen, vt=vt, bm=2)
    assert (meta.slot_expert.view(M, k)[vt:] == m.num_local).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_experts_with_zero_tokens_and_half_precision(cpu_path, layout, gen):
    ids = [[5, 0], [5, 2], [0, 5], [2, 5], [5, 0]]  # experts 1, 3, 4, 6, 7 get nothing
    run_round(layout, ids, 8, gen=gen, bm=4, dtype=torch.bfloat16, K=32)


def test_masked_overflow_counts_and_drops(cpu_path, gen):
    ids = [[1], [1], [1], [0], [1]]
    meta = run_round(GemmLayout.GROUPED_MASKED, ids, 2, gen=gen, T=2)
    assert meta.counts.tolist() == [1, 2] and meta.overflow.tolist() == [2]


def test_masked_rows_per_expert_is_the_expected_count_within_capacity():
    """What picks GROUPED_MASKED's GEMM tile: the mean of a layout built from slots (at most the
    capacity), a batched buffer's `expected_m` (at most the capacity), else the capacity."""
    from padded_moe.experts import masked_meta_from_counts

    ids = torch.tensor([[0, 1], [0, 2], [3, 0]], dtype=torch.int32)  # 6 slots on 4 experts
    assert build_layout(GemmLayout.GROUPED_MASKED, ids, 4).rows_per_expert() == 1.5
    tight = build_layout(GemmLayout.GROUPED_MASKED, ids, 4, max_tokens_per_expert=1, drop_overflow=True)
    assert tight.rows_per_expert() == 1.0
    counts = torch.tensor([3, 0, 7], dtype=torch.int32)
    assert masked_meta_from_counts(counts, 64).rows_per_expert() == 64.0
    assert masked_meta_from_counts(counts, 64, expected_m=5).rows_per_expert() == 5.0
    assert masked_meta_from_counts(counts, 64, expected_m=0).rows_per_expert() == 0.0
    assert masked_meta_from_counts(counts, 64, expected_m=100).rows_per_expert() == 64.0


def test_paths_give_bitwise_identical_metadata(monkeypatch):
    """Many chunks (CHUNK=256 above 16384 slots) and a multi-tile scan, torch vs interpreted kernels."""
    from padded_moe._platform import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("interpreter not in use")
    gen = torch.Generator().manual_seed(1234)
    M, k, E = 4200, 4, 600
    m = ExpertMap(E, 1, 2, "round_robin")  # L = 300 → a 512-wide histogram, 16-row scan tiles
    ids = torch.randint(-3, E + 3, (M, k), generator=gen)
    ids[::7, 1] = 2**31 - 1
    vt = torch.tensor([M - 37], dtype=torch.int32)
    metas = {}
    for path in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", path)
        metas[path] = [build_layout(lay, ids, m, valid_tokens=vt, block_m=8, max_tokens_per_expert=40,
                                drop_overflow=True)
                       for lay in LAYOUTS]
    for a, b in zip(metas["0"], metas["1"]):
        for name in ("slot_expert", "activation_counts", "sorted_ids", "block_expert", "num_padded",
                     "offsets", "inv", "src", "counts", "overflow"):
            if hasattr(a, name):
                assert torch.equal(getattr(a, name), getattr(b, name)), f"{a.layout} {name}"
    ref = ref_layout(GemmLayout.GROUPED_CONTIGUOUS, ids.tolist(), E, m.map.tolist(), m.num_local,
                     M - 37, 1, None)
    check_meta(metas["1"][1], ref)


@pytest.mark.parametrize("M,k,E,R,bm", [(1, 8, 128, 1, 4), (3, 6, 256, 2, 4), (16, 8, 128, 1, 4), (40, 3, 9, 1, 4),
                                        (1, 8, 128, 1, 16), (3, 6, 256, 1, 16)])
def test_one_program_build_equals_three_launches(monkeypatch, M, k, E, R, bm):
    """Up to ONE_PROGRAM_SLOTS slots the interpreted kernels build in one program; forcing the
    three-launch path on the same input gives bitwise identical metadata, and both match the
    reference. (40, 3) has 120 slots: the largest one-program chunk, with a 128-wide rank tile.
    block_m 16 on 128 / 256 experts: an INDEXED capacity of several 1024-position tiles, all but
    the first past the last expert's rows (filled without the owner search)."""
    from padded_moe import layouts as layouts_module
    from padded_moe._platform import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("interpreter not in use")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(M * 1000 + k)
    m = ExpertMap(E, R - 1, R, "round_robin")
    ids = torch.randint(-2, E + 2, (M, k), generator=gen)
    vt = torch.tensor([max(M - 1, 0)], dtype=torch.int32)
    assert M * k <= layouts_module.ONE_PROGRAM_SLOTS
    metas = {}
    for limit in (layouts_module.ONE_PROGRAM_SLOTS, 0):
        monkeypatch.setattr(layouts_module, "ONE_PROGRAM_SLOTS", limit)
        metas[limit] = [build_layout(lay, ids, m, valid_tokens=vt, block_m=bm, max_tokens_per_expert=2,
                                     drop_overflow=True) for lay in LAYOUTS]
    one, three = metas.values()
    for a, b in zip(one, three):
        for name in ("slot_expert", "activation_counts", "sorted_ids", "block_expert", "num_padded",
                     "offsets", "inv", "src", "counts", "overflow"):
            if hasattr(a, name):
                assert torch.equal(getattr(a, name), getattr(b, name)), f"{a.layout} {name}"
    for lay, meta in zip(LAYOUTS, one):
        check_meta(meta, ref_layout(lay, ids.tolist(), E, m.map.tolist(), m.num_local, M - 1, bm,
                                    2 if lay == GemmLayout.GROUPED_MASKED else None))


# ----------------------------------------------------------------------------------------------
# Scratch
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_scratch_reuses_its_buffers(cpu_path, layout, gen):
    s = PermuteScratch(16, 2, 6, 6, "cpu", block_m=4, hidden_size=8, dtype=torch.float32)
    ptrs = None
    for M in (16, 16, 9):
        ids = torch.randint(0, 6, (M, 2), generator=gen, dtype=torch.int32)
        meta = build_layout(layout, ids, 6, scratch=s)
        check_meta(meta, ref_layout(layout, ids.tolist(), 6, None, 6, M, 4, s.max_tokens_per_expert))
        h = torch.randn(M, 8, generator=gen)
        p = permute(h, meta)
        now = [meta.slot_expert.data_ptr(), p.data_ptr() if layout != GemmLayout.INDEXED else 0]
        if M == 16:
            assert ptrs is None or now == ptrs  # the same memory on every steady-state call
            ptrs = now


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("with_scratch", [False, True])
def test_metadata_tensors_are_16_byte_aligned(layout, with_scratch, gen):
    """Other backends read metadata with vector loads (humming's INDEXED kernel faulted on a
    misaligned `sorted_ids` view of the arena)."""
    for M, L in ((7, 5), (33, 3), (1, 9)):  # odd sizes shift every later view of the arena
        ids = torch.randint(-1, L + 1, (M, 3), generator=gen, dtype=torch.int32)
        scratch = PermuteScratch(40, 3, L, L, "cpu", block_m=16) if with_scratch else None
        meta = build_layout(layout, ids, L, scratch=scratch)
        for name, t in vars(meta).items():
            # GROUPED_CONTIGUOUS's activation count is by definition the view offsets[L:].
            if isinstance(t, torch.Tensor) and not (name == "activation_counts" and layout == GemmLayout.GROUPED_CONTIGUOUS):
                assert t.data_ptr() % 16 == 0, f"{name} starts at {t.data_ptr() % 16} mod 16"


def test_default_block_m_grows_with_mean_rows_and_never_shrinks():
    L = 8
    picks = [default_block_m(S, L) for S in range(0, 300 * L)]
    # mean + sqrt(mean) rows: 12 + 3.5 fit 16 rows, 13 + 3.6 do not; 26 + 5.1 fit 32, 27 + 5.2 do not
    assert picks[12 * L] == 16 and picks[13 * L] == 32 and picks[26 * L] == 32 and picks[27 * L] == 64
    assert picks[BLOCK_128_MEAN_ROWS * L - 1] == 64 and picks[BLOCK_128_MEAN_ROWS * L] == 128
    assert all(a <= b for a, b in zip(picks, picks[1:]))


def test_scratch_reserves_its_largest_block(gen):
    """A scratch without a fixed block reserves the largest block a call up to its size gets, and
    a smaller call in it takes its own (smaller) default block."""
    L, k = 4, 1
    s = PermuteScratch(200 * L, k, L, L, "cpu")  # 200 mean rows at full size: 128-row blocks
    assert s.block_m == 128
    for M, bm in ((200 * L, 128), (40 * L, 64)):
        ids = torch.randint(0, L, (M, k), generator=gen, dtype=torch.int32)
        meta = build_layout_resolved(GemmLayout.INDEXED, ids, L, L, None, scratch=s)
        fresh = build_layout(GemmLayout.INDEXED, ids, L, block_m=bm)
        assert meta.block_m == bm and torch.equal(meta.sorted_ids, fresh.sorted_ids)


def test_scratch_refuses_a_block_whose_metadata_does_not_fit():
    """A scratch fixed at 128-row blocks has room for 128-row metadata; an explicit smaller block on
    a full-size call needs more block entries than that: a typed error, not a short view."""
    s = PermuteScratch(4096, 1, 1, 1, "cpu", block_m=128)
    with pytest.raises(ValueError, match=r"int32 metadata entries \(block_m=128\) but block_m=16 with 4096 rows needs"):
        build_layout(GemmLayout.INDEXED, torch.zeros(4096, 1, dtype=torch.int32), 1, scratch=s, block_m=16)


@pytest.mark.parametrize("fixed", [None, 64])
def test_scratch_block_is_the_calls_own_unless_fixed(fixed, gen):
    """A scratch sized for prefill gives a small call the block that call would get without it
    (`default_block_m` of its own slots); a block_m given to the scratch holds for every call.
    Results are the same either way."""
    L, k = 4, 2
    s = PermuteScratch(600, k, L, L, "cpu", block_m=fixed)
    assert s.block_m == (fixed or 128)
    for M in (3, 40, 600):
        ids = torch.randint(-1, L + 1, (M, k), generator=gen, dtype=torch.int32)
        meta = build_layout(GemmLayout.INDEXED, ids, L, scratch=s)
        assert meta.block_m == (fixed or default_block_m(M * k, L))
        fresh = build_layout(GemmLayout.INDEXED, ids, L, block_m=meta.block_m)
        assert torch.equal(meta.sorted_ids, fresh.sorted_ids) and torch.equal(meta.block_expert, fresh.block_expert)


def test_scratch_too_small_names_the_numbers():
    s = PermuteScratch(4, 2, 8, 8, "cpu", block_m=16)
    with pytest.raises(ValueError, match=r"4 tokens \(8 rows.*5 tokens \(10 rows"):
        build_layout(GemmLayout.INDEXED, torch.zeros(5, 2, dtype=torch.int32), 8, scratch=s)
    with pytest.raises(ValueError, match="k=2"):
        build_layout(GemmLayout.INDEXED, torch.zeros(2, 3, dtype=torch.int32), 8, scratch=s)
    with pytest.raises(ValueError, match="block_m=64"):
        build_layout(GemmLayout.INDEXED, torch.zeros(4, 2, dtype=torch.int32), 8, scratch=s, block_m=64)
    with pytest.raises(TypeError, match="scratch"):
        build_layout(GemmLayout.INDEXED, torch.zeros(4, 2, dtype=torch.int32), 8, scratch=object())


# ----------------------------------------------------------------------------------------------
# Argument errors
# ----------------------------------------------------------------------------------------------

IDS = torch.zeros(3, 2, dtype=torch.int32)


@pytest.mark.parametrize("call,exc,words", [
    (lambda: build_layout("auto", IDS, 4), TypeError, "layout"),
    (lambda: build_layout(3, IDS, 4), TypeError, "layout"),
    (lambda: build_layout(GemmLayout.INDEXED, IDS.float(), 4), TypeError, "topk_ids"),
    (lambda: build_layout(GemmLayout.INDEXED, IDS[0], 4), ValueError, "topk_ids"),
    (lambda: build_layout(GemmLayout.INDEXED, IDS, 0), ValueError, "experts"),
    (lambda: build_layout(GemmLayout.INDEXED, IDS, 4, block_m=3), ValueError, "block_m"),
    (lambda: build_layout(GemmLayout.INDEXED, IDS, 4, block_m=0), ValueError, "block_m"),
    (lambda: build_layout(GemmLayout.GROUPED_MASKED, IDS, 4, max_tokens_per_expert=-1), ValueError,
     "max_tokens_per_expert"),
    (lambda: build_layout(GemmLayout.INDEXED, IDS, 4, valid_tokens=torch.tensor(2)), ValueError,
     "valid_tokens"),
])
def test_build_layout_rejects_bad_arguments(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


def test_permute_unpermute_reject_bad_arguments():
    meta = build_layout(GemmLayout.GROUPED_CONTIGUOUS, IDS, 4)
    with pytest.raises(ValueError, match="hidden"):
        permute(torch.randn(4, 8), meta)
    with pytest.raises(TypeError, match="layout_meta"):
        permute(torch.randn(3, 8), "meta")
    with pytest.raises(ValueError, match="out"):
        permute(torch.randn(3, 8), meta, out=torch.empty(5, 8))
    with pytest.raises(ValueError, match="expert_out"):
        unpermute(torch.empty(3, 8), torch.randn(5, 8), torch.rand(3, 2), meta)
    with pytest.raises(ValueError, match="topk_weights"):
        unpermute(torch.empty(3, 8), torch.randn(6, 8), torch.rand(3, 3), meta)
    masked = build_layout(GemmLayout.GROUPED_MASKED, IDS, 4, max_tokens_per_expert=2, drop_overflow=True)
    with pytest.raises(ValueError, match=r"\(4, 2, 8\)"):
        unpermute(torch.empty(3, 8), torch.randn(4, 3, 8), torch.rand(3, 2), masked)


def test_metadata_types():
    assert isinstance(build_layout("indexed", IDS, 4), IndexedMeta)
    assert isinstance(build_layout("grouped", IDS, 4), GroupedContiguousMeta)
    assert isinstance(build_layout("batched", IDS, 4), GroupedMaskedMeta)


# ----------------------------------------------------------------------------------------------
# Layout selection
# ----------------------------------------------------------------------------------------------

@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("PADDED_MOE_GEMM_LAYOUT", raising=False)


@pytest.mark.parametrize("ep,batched,want", [
    (False, False, GemmLayout.INDEXED), (True, False, GemmLayout.GROUPED_CONTIGUOUS),
    (False, True, GemmLayout.GROUPED_MASKED), (True, True, GemmLayout.GROUPED_MASKED),
])
def test_select_auto(no_env, ep, batched, want):
    assert select_gemm_layout(expert_parallel=ep, batched_format=batched) == want
    assert select_gemm_layout(expert_parallel=ep, batched_format=batched, override="AUTO") == want


LEGAL = [
    ("indexed", False, GemmLayout.INDEXED), ("Indexed ", False, GemmLayout.INDEXED),
    ("grouped_contiguous", False, GemmLayout.GROUPED_CONTIGUOUS), ("GROUPED", False, GemmLayout.GROUPED_CONTIGUOUS),
    ("grouped_masked", True, GemmLayout.GROUPED_MASKED), ("Batched", True, GemmLayout.GROUPED_MASKED),
    (GemmLayout.INDEXED, False, GemmLayout.INDEXED),
]
ILLEGAL = [("indexed", True), ("grouped_contiguous", True), ("grouped", True),
           ("grouped_masked", False), ("batched", False), (GemmLayout.GROUPED_MASKED, False)]


@pytest.mark.parametrize("value,batched,want", LEGAL)
@pytest.mark.parametrize("ep", [False, True])
def test_select_override_and_env(monkeypatch, value, batched, want, ep):
    monkeypatch.delenv("PADDED_MOE_GEMM_LAYOUT", raising=False)
    assert select_gemm_layout(expert_parallel=ep, batched_format=batched, override=value) == want
    if isinstance(value, str):
        monkeypatch.setenv("PADDED_MOE_GEMM_LAYOUT", value)
        assert select_gemm_layout(expert_parallel=ep, batched_format=batched) == want


@pytest.mark.parametrize("value,batched", ILLEGAL)
def test_select_illegal_for_format(monkeypatch, value, batched):
    monkeypatch.delenv("PADDED_MOE_GEMM_LAYOUT", raising=False)
    fmt = "batched" if batched else "standard"
    with pytest.raises(ValueError, match=f"{fmt} format") as err:
        select_gemm_layout(expert_parallel=True, batched_format=batched, override=value)
    assert "legal choices" in str(err.value)
    if isinstance(value, str):
        monkeypatch.setenv("PADDED_MOE_GEMM_LAYOUT", value)
        with pytest.raises(ValueError, match=value):
            select_gemm_layout(expert_parallel=True, batched_format=batched)


@pytest.mark.parametrize("value", ["grouped-contiguous", "masked", "", "deepgemm"])
def test_select_unknown_value(monkeypatch, value):
    monkeypatch.delenv("PADDED_MOE_GEMM_LAYOUT", raising=False)
    with pytest.raises(ValueError, match="standard.*auto, indexed, grouped_contiguous"):
        select_gemm_layout(expert_parallel=False, batched_format=False, override=value)
    if value:
        monkeypatch.setenv("PADDED_MOE_GEMM_LAYOUT", value)
        with pytest.raises(ValueError, match="PADDED_MOE_GEMM_LAYOUT"):
            select_gemm_layout(expert_parallel=False, batched_format=False)


def test_select_override_beats_env_and_empty_env_is_auto(monkeypatch):
    monkeypatch.setenv("PADDED_MOE_GEMM_LAYOUT", "grouped_masked")
    assert select_gemm_layout(expert_parallel=False, batched_format=False, override="indexed") == GemmLayout.INDEXED
    monkeypatch.setenv("PADDED_MOE_GEMM_LAYOUT", "")
    assert select_gemm_layout(expert_parallel=True, batched_format=False) == GemmLayout.GROUPED_CONTIGUOUS


def test_select_type_errors(no_env):
    with pytest.raises(TypeError, match="expert_parallel"):
        select_gemm_layout(expert_parallel=1, batched_format=False)
    with pytest.raises(TypeError, match="override"):
        select_gemm_layout(expert_parallel=False, batched_format=False, override=3)
