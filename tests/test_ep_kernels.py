"""The expert-parallel stages of `padded_moe.ep.stages` (spec 04) on one process, without a group.

Each stage runs on the torch path and on the Triton kernels of `padded_moe.kernels.ep` (interpreted
on CPU) and is checked against an independent reference built with Python loops: pack, flat and
batched receive, both combine kernels and the reduction (the R-rank round trip through
`ExpertParallel` is tests/test_ep_engine.py).
Inputs: NaN in padding rows, poisoned outputs, garbage ids (-1, E, 2^31-1, 2^32+1, -2^31),
idle ranks, all tokens to one peer, repeated ids within a token.
"""

from __future__ import annotations

import pytest
import torch

from helpers import fp8_dequant_reference, fp8_reference

from padded_moe import distributed as D
from padded_moe.expert_map import ExpertMap

BAD_IDS = (-1, 2**31 - 1, 2**32 + 1, -2**31)  # plus E, added per test


def _interp_or_skip():
    from padded_moe._platform import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("Triton kernels were compiled for a GPU; the interpreter is not in use")


@pytest.fixture
def triton_on(monkeypatch):
    """Run the stage functions' Triton implementations (interpreted on CPU)."""
    _interp_or_skip()
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def geometry(R, T, E, K, k, dtype=torch.float32, fp8=False):
    return D.EPGeometry(R, T, E, D.WireFormat(K, k, dtype, fp8))


def owner_table(E, R, placement="linear"):
    return D.ExpertParallel._owner_table(E, R, placement)


def random_ids(gen, m, E, k, ids_dtype=torch.int64, *, garbage=0.3, dup=False, only=None):
    """[m, k] distinct valid ids with a fraction replaced by garbage; `only`: draw from these ids."""
    if only is not None:
        ids = only[torch.randint(0, only.numel(), (m, k), generator=gen)]
    else:
        ids = torch.rand(m, E, generator=gen).argsort(1)[:, :k]
    if dup and k > 1:
        ids[:, 1] = ids[:, 0]
    bad = torch.tensor(BAD_IDS + (E,), dtype=torch.int64)
    if ids_dtype == torch.int32:
        bad = bad[(bad >= -2**31) & (bad < 2**31)]
    hit = torch.rand(m, k, generator=gen) < garbage
    ids = torch.where(hit, bad[torch.randint(0, bad.numel(), (m, k), generator=gen)], ids)
    return ids.to(ids_dtype)


def poisoned_wire(geo, fill=0xFF, device="cpu"):
    return torch.full((geo.rows, geo.wire.buffer_row_bytes), fill, dtype=torch.uint8, device=device)


def owner_of(g, owner, E):
    return int(owner[g]) if 0 <= g < E else -1


def expected_chunks(hidden, ids, weights, owner, geo):
    """Python-loop reference of pack: per peer, the list of (token, ids row, weights row)."""
    E, k = geo.num_experts, geo.wire.top_k
    chunks = []
    for r in range(geo.ep_size):
        rows = []
        for t in range(hidden.shape[0]):
            mine = [owner_of(int(ids[t, j]), owner, E) == r for j in range(k)]
            if any(mine):
                rows.append((t, [int(ids[t, j]) if mine[j] else -1 for j in range(k)],
                             [float(weights[t, j]) if mine[j] else 0.0 for j in range(k)]))
        chunks.append(rows)
    return chunks


# ---------------------------------------------------------------------------------------- pack
@pytest.mark.parametrize("fp8", [False, True], ids=["wire_f32", "wire_fp8"])
@pytest.mark.parametrize("exact", [False, True], ids=["graph_safe", "exact"])
@pytest.mark.parametrize("case", ["random", "idle", "one_peer", "duplicates", "int32_ids", "many_blocks", "skip_own"])
def test_pack_matches_reference(cpu_path, gen, case, exact, fp8):
    R, E, k = 3, 11, 3
    T = 160 if case == "many_blocks" else 21  # many_blocks: the in-program count of earlier blocks loops
    K = 256 if fp8 else 40  # fp8: two 128-channel scale blocks
    geo = geometry(R, T, E, K, k, torch.float32, fp8)
    owner = owner_table(E, R)
    m = {"idle": 0, "random": 19, "many_blocks": 150}.get(case, T)
    skip = 1 if case == "skip_own" else -1  # rank 1 keeps its own chunk (batched, graph-safe)
    only = torch.nonzero(owner == 1).flatten() if case == "one_peer" else None
    ids = random_ids(gen, m, E, k, torch.int32 if case == "int32_ids" else torch.int64,
                     dup=case == "duplicates", only=only)
    hidden = torch.randn(m, K, generator=gen) * 3
    weights = torch.rand(m, k, generator=gen, dtype=torch.float32) + 0.1
    wire = poisoned_wire(geo)
    send = geo.wire.wire_rows(wire, geo.rows)
    token_rows = torch.full((R, T), -7, dtype=torch.int32)
    chunks = expected_chunks(hidden, ids, weights, owner, geo)
    counts = [len(c) for c in chunks]
    base = [sum(counts[:r]) for r in range(R)] if exact else [r * T for r in range(R)]
    send_base = torch.tensor(base, dtype=torch.int32) if exact else None
    zero = torch.full((5,), 9, dtype=torch.int32)
    D.pack_rows(hidden, ids, weights, owner, geo, send, token_rows, send_base, zero_counts=zero, rank=skip)
    x, mi, mf = geo.wire.views(send)
    if fp8:
        q_ref, s_ref = fp8_reference(hidden)
    for r in range(R):
        if r == skip:
            assert (token_rows[r] == -7).all(), "the kept chunk's token rows are local_batched's to write"
            continue
        if not exact:
            assert int(mi[r * T, geo.wire.count_col]) == counts[r], f"count of chunk {r}"
        for pos, (t, row_ids, row_w) in enumerate(chunks[r]):
            row = base[r] + pos
            assert int(token_rows[r, t]) == row
            assert mi[row, :k].tolist() == row_ids
            assert torch.equal(mf[row, k:2 * k], torch.tensor(row_w, dtype=torch.float32))
            if fp8:
                assert torch.equal(geo.wire.x_bytes_view(send)[row], q_ref[t]), f"fp8 bytes of token {t}"
                S = s_ref.shape[1]
                assert torch.equal(mf[row, geo.wire.scale_col:geo.wire.scale_col + S], s_ref[t])
            else:
                assert torch.equal(x[row], hidden[t])
        sent = {t for t, _, _ in chunks[r]}
        for t in range(m):
            if t not in sent:
                assert int(token_rows[r, t]) == R * T, "unsent token must point at the pad value"
    assert (token_rows[:, m:] == -7).all(), "columns past m are not written"
    assert (zero == 0).all()


def test_pack_fp8_rounding_is_torchs(triton_on, gen):
    """The kernel's e4m3 rounding (integer arithmetic; the interpreter's cast would not round to
    nearest) equals torch's on values spread over the whole fp8 range, ties and subnormals included."""
    R, T, E, k, K = 1, 16, 4, 1, 384
    geo = geometry(R, T, E, K, k, torch.float32, fp8=True)
    hidden = torch.randn(T, K, generator=gen) * torch.logspace(-9, 2, K)[None, :]
    hidden[:, 0] = 448.0 * torch.where(torch.rand(T, generator=gen) < 0.5, -1.0, 1.0)  # scale = amax/448 → ±448
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)]
    mid = (grid.sort().values[1:] + grid.sort().values[:-1]) / 2  # exact ties between neighbours
    hidden[0, 1:1 + min(mid.numel(), 127)] = mid[:127]
    hidden[0, 0] = 448.0
    ids = torch.zeros(T, k, dtype=torch.int64)
    w = torch.ones(T, k)
    wire = poisoned_wire(geo)
    send = geo.wire.wire_rows(wire, geo.rows)
    D.pack_rows(hidden, ids, w, owner_table(E, R), geo, send, torch.empty(R, T, dtype=torch.int32))
    q_ref, s_ref = fp8_reference(hidden)
    _, _, mf = geo.wire.views(send)
    assert torch.equal(mf[:, geo.wire.scale_col:geo.wire.scale_col + 3], s_ref)
    got = geo.wire.x_bytes_view(send)
    assert torch.equal(got, q_ref), int((got != q_ref).sum())


# ---------------------------------------------------------------------------------------- receive
def received_wire(gen, geo, counts, *, local_ids, exact=False, with_garbage=True, dup=False, dtype=None):
    """A receive buffer as the all_to_all leaves it: chunk r holds counts[r] valid rows (graph-safe:
    at r*T, count in-band; exact: back to back), NaN x / garbage meta everywhere else."""
    R, T, k, K = geo.ep_size, geo.max_tokens, geo.wire.top_k, geo.wire.hidden_size
    wire = geo.wire.wire_rows(poisoned_wire(geo, 0xFF), geo.rows)
    x, mi, mf = geo.wire.views(wire)
    mi[:, :2 * k] = 2**31 - 1  # garbage ids on padding rows must never be read
    rows = []
    start = 0
    for r in range(R):
        base = start if exact else r * T
        if not exact:
            mi[r * T, geo.wire.count_col] = counts[r]
        for p in range(counts[r]):
            row = base + p
            ids = local_ids[torch.randint(0, local_ids.numel(), (k,), generator=gen)].clone()
            drop = torch.rand(k, generator=gen) < 0.4
            ids[drop] = -1
            if with_garbage and p % 3 == 1:  # the receiver range-checks what arrives, too
                ids[0] = (-1, geo.num_experts, 2**31 - 1, -2**31)[p % 4]
            if dup and k > 1:
                ids[1] = ids[0]
            if not (ids >= 0).any():
                ids[k - 1] = local_ids[0]
            mi[row, :k] = ids.to(torch.int32)
            mf[row, k:2 * k] = torch.rand(k, generator=gen) + 0.1
            vals = torch.randn(K, generator=gen)
            if geo.wire.fp8:
                q, s = fp8_reference(vals.view(1, K))
                geo.wire.x_bytes_view(wire)[row] = q[0]
                mf[row, geo.wire.scale_col:geo.wire.scale_col + s.shape[1]] = s[0]
            else:
                x[row] = vals.to(x.dtype)
            rows.append(row)
        start += counts[r]
    return wire, rows


def decoded(geo, wire, row):
    return D._decode_rows_torch(geo, wire, torch.tensor([row]))[0]


@pytest.mark.parametrize("exact,own", [(False, -1), (True, -1), (False, 1)], ids=["graph_safe", "exact", "own_first"])
@pytest.mark.parametrize("counts", [(5, 0, 7), (0, 0, 0), (8, 8, 8), (0, 8, 1), (33, 0, 40)], ids=str)
@pytest.mark.parametrize("fp8", [False, True], ids=["wire_f32", "wire_fp8"])
def test_receive_flat_compacts_valid_rows(cpu_path, gen, counts, exact, own, fp8):
    R, E, k = 3, 12, 3
    T = max(8, *counts)  # (33, 0, 40): several row blocks per chunk
    K = 128 if fp8 else 24
    geo = geometry(R, T, E, K, k, torch.float32, fp8)
    local = ExpertMap(E, 1, R).local_experts
    wire, rows = received_wire(gen, geo, counts, local_ids=local, exact=exact)
    cc = torch.tensor(counts, dtype=torch.int32) if exact else torch.full((R,), -5, dtype=torch.int32)
    rb_x = torch.full((geo.rows, K), float("nan"))
    rb_ids = torch.full((geo.rows, k), 77, dtype=torch.int32)
    rb_w = torch.full((geo.rows, k), float("nan"))
    rb_valid = torch.full((1,), -3, dtype=torch.int32)
    n_own = 0
    if own >= 0:
        # local_flat's rows: the own chunk (count 3) already at the front; its wire rows never arrived.
        n_own = 3
        cc[own] = n_own
        rows = [i for i in rows if i // T != own]
        rb_x[:n_own], rb_ids[:n_own], rb_w[:n_own] = 1.5, 4, 0.25
    D.receive_flat(geo, wire, cc, not exact, rb_x, rb_ids, rb_w, rb_valid, rank=own)
    _, mi, mf = geo.wire.views(wire)
    V = n_own + len(rows)
    assert int(rb_valid) == V
    expect_cc = list(counts) if own < 0 else [n_own if r == own else counts[r] for r in range(R)]
    assert cc.tolist() == expect_cc
    assert (rb_x[:n_own] == 1.5).all() and (rb_ids[:n_own] == 4).all() and (rb_w[:n_own] == 0.25).all(), \
        "the own chunk's rows are local_flat's"
    for d, row in enumerate(rows, start=n_own):
        assert torch.equal(rb_ids[d], mi[row, :k]), d
        assert torch.equal(rb_w[d], mf[row, k:2 * k]), d
        assert torch.equal(rb_x[d], decoded(geo, wire, row)), d
    assert (rb_ids[V:] == -1).all() and (rb_w[V:] == 0).all()
    assert torch.isnan(rb_x[V:]).all(), "padding rows of x are not written"


@pytest.mark.parametrize("fp8,K", [(False, 40), (True, 256), (True, 200)], ids=["wire_f32", "wire_fp8", "fp8_row_scale"])
@pytest.mark.parametrize("m", [0, 7, 40])  # 40 > PACK_ONE_BLOCK_TOKENS: route counts from pack_rows
def test_local_flat_matches_reference(cpu_path, gen, m, fp8, K):
    """Own tokens straight into the front of the receive rows, in token order: loop reference."""
    R, E, k, me, T = 3, 12, 3, 2, 40
    geo = geometry(R, T, E, K, k, torch.float32, fp8)
    owner = owner_table(E, R)
    ids = random_ids(gen, m, E, k, dup=True)
    hidden = torch.randn(m, K, generator=gen) * 3
    weights = torch.rand(m, k, generator=gen) + 0.1
    token_rows = torch.full((R, T), -7, dtype=torch.int32)
    block_counts = torch.full((R, D.route_block_columns(T)), -9, dtype=torch.int32)
    # The route counts come from the pack of the same call (which skips this rank's chunk).
    D.pack_rows(hidden, ids, weights, owner, geo, geo.wire.wire_rows(poisoned_wire(geo), geo.rows), token_rows,
                rank=me, block_counts=block_counts)
    rb_x = torch.full((geo.rows, K), float("nan"))
    rb_ids = torch.full((geo.rows, k), 77, dtype=torch.int32)
    rb_w = torch.full((geo.rows, k), float("nan"))
    cc = torch.full((R,), -5, dtype=torch.int32)
    D.local_flat(hidden, ids, weights, owner, geo, me, rb_x, rb_ids, rb_w, token_rows, cc, block_counts)
    x = hidden
    if fp8 and m:
        q, sc = fp8_reference(hidden)
        x = fp8_dequant_reference(q, sc, torch.float32)
    row = 0
    for t in range(m):
        mine = [owner_of(int(ids[t, j]), owner, E) == me for j in range(k)]
        if not any(mine):
            assert int(token_rows[me, t]) == R * T, t
            continue
        assert int(token_rows[me, t]) == row, t
        assert rb_ids[row].tolist() == [int(ids[t, j]) if mine[j] else -1 for j in range(k)], t
        assert rb_w[row].tolist() == [float(weights[t, j]) if mine[j] else 0.0 for j in range(k)], t
        assert torch.equal(rb_x[row], x[t]), t
        row += 1
    assert int(cc[me]) == row and int((cc == -5).sum()) == R - 1
    assert (rb_ids[row:] == 77).all() and torch.isnan(rb_x[row:]).all(), "rows past the own count are not written"
    assert (token_rows[me, m:] == -7).all()


def check_scattered_row(row, ids, wts, x, emap, geo, slab, slot_rows, slot_w, used, expect_cnt, start) -> dict:
    """One row's slots after a slab scatter (receive_batched or local_batched): -1 / 0 for
    non-local slots; each local expert's first slot owns a fresh slab row past `start` holding `x`,
    a repeated id shares it; every slot keeps its own router weight. Returns {expert: slab row}."""
    E, k = geo.num_experts, geo.wire.top_k
    seen = {}
    for j in range(k):
        g = int(ids[j])
        e = int(emap.map[g]) if 0 <= g < E else -1
        s = int(slot_rows[row, j])
        if e < 0:
            assert s == -1 and float(slot_w[row, j]) == 0.0, (row, j, g)
            continue
        assert float(slot_w[row, j]) == float(wts[j]) and s // geo.rows == e, (row, j)
        if e in seen:
            assert s == seen[e], "a repeated id shares its first occurrence's row"
            continue
        seen[e] = s
        expect_cnt[e] += 1
        assert s not in used and int(start[e]) <= s % geo.rows, (row, j)
        used.add(s)
        assert torch.equal(slab[s], x), (row, j)
    return seen


@pytest.mark.parametrize("exact,skip", [(False, -1), (True, -1), (False, 0)], ids=["graph_safe", "exact", "skip_own"])
@pytest.mark.parametrize("counts", [(5, 0, 7), (0, 0, 0), (8, 8, 8), (21, 3, 40)], ids=str)
@pytest.mark.parametrize("fp8", [False, True], ids=["wire_f32", "wire_fp8"])
@pytest.mark.parametrize("dup", [False, True], ids=["distinct", "repeated_ids"])
def test_receive_batched_scatters_pairs(cpu_path, gen, counts, exact, skip, fp8, dup):
    R, E, k = 3, 12, 3
    T = max(8, *counts)
    K = 128 if fp8 else 24
    geo = geometry(R, T, E, K, k, torch.float32, fp8)
    emap = ExpertMap(E, 2, R)
    L = emap.num_local
    wire, rows = received_wire(gen, geo, counts, local_ids=torch.arange(E), exact=exact, dup=dup)
    cc = torch.tensor(counts, dtype=torch.int32) if exact else torch.full((R,), -5, dtype=torch.int32)
    if skip >= 0:  # the kept chunk: its count comes from local_batched, its rows are never read
        cc[skip] = 4
        rows = [i for i in rows if i // T != skip]
    slab = torch.full((L * geo.rows + 1, K), float("nan"))
    start = torch.randint(0, 3, (L,), generator=gen, dtype=torch.int32)  # rows an earlier writer took
    cnt = start.clone()
    slot_rows = torch.full((geo.rows, k), 55, dtype=torch.int32)
    slot_w = torch.full((geo.rows, k), float("nan"))
    D.receive_batched(geo, wire, cc, not exact, emap.map, L, slab, cnt, slot_rows, slot_w, rank=skip)
    _, mi, mf = geo.wire.views(wire)
    expect_cnt = start.tolist()
    used = set()
    for row in rows:
        check_scattered_row(row, mi[row, :k], mf[row, k:2 * k], decoded(geo, wire, row), emap, geo, slab, slot_rows,
                            slot_w, used, expect_cnt, start)
    assert cnt.tolist() == expect_cnt
    for s in used:
        assert int(start[s // geo.rows]) <= s % geo.rows < expect_cnt[s // geo.rows], "counting goes on from counts"
    untouched = [i for i in range(L * geo.rows) if i not in used]
    assert torch.isnan(slab[untouched]).all() if untouched else True
    valid_rows = set(rows)
    for i in range(geo.rows):
        if i not in valid_rows:
            assert (slot_rows[i] == 55).all(), "padding rows (and a kept chunk's) are not written"
    if skip >= 0:
        assert int(cc[skip]) == 4, "the kept chunk's count is local_batched's"


@pytest.mark.parametrize("fp8,K", [(False, 40), (True, 256), (True, 200)], ids=["wire_f32", "wire_fp8", "fp8_row_scale"])
@pytest.mark.parametrize("case", ["random", "idle", "duplicates", "full"])
def test_local_batched_matches_reference(cpu_path, gen, case, fp8, K):
    """Own tokens straight into the slabs, as received rows me*T + t would be: loop reference."""
    R, E, k, me = 3, 12, 3, 1
    T = 9
    geo = geometry(R, T, E, K, k, torch.float32, fp8)
    emap = ExpertMap(E, me, R)
    L = emap.num_local
    m = {"idle": 0, "full": T}.get(case, 7)
    ids = random_ids(gen, m, E, k, dup=case == "duplicates")
    hidden = torch.randn(m, K, generator=gen) * 3
    weights = torch.rand(m, k, generator=gen) + 0.1
    slab = torch.full((L * geo.rows + 1, K), float("nan"))
    start = torch.randint(0, 3, (L,), generator=gen, dtype=torch.int32)
    cnt = start.clone()
    slot_rows = torch.full((geo.rows, k), 55, dtype=torch.int32)
    slot_w = torch.full((geo.rows, k), float("nan"))
    token_rows = torch.full((R, T), -7, dtype=torch.int32)
    cc = torch.full((R,), -5, dtype=torch.int32)
    D.local_batched(hidden, ids, weights, geo, me, emap.map, L, slab, cnt, slot_rows, slot_w, token_rows, cc)
    x = hidden
    if fp8:
        q, sc = fp8_reference(hidden)
        x = fp8_dequant_reference(q, sc, torch.float32)
    expect_cnt = start.tolist()
    used = set()
    for t in range(m):
        row = me * T + t
        seen = check_scattered_row(row, ids[t], weights[t], x[t], emap, geo, slab, slot_rows, slot_w, used,
                                   expect_cnt, start)
        assert int(token_rows[me, t]) == (row if seen else R * T), t
    assert cnt.tolist() == expect_cnt
    assert int(cc[me]) == m and int((cc == -5).sum()) == R - 1, "only the own chunk's count is written"
    assert (token_rows[me, m:] == -7).all() and (token_rows[[0, 2]] == -7).all()
    others = [i for i in range(geo.rows) if not me * T <= i < me * T + m]
    assert (slot_rows[others] == 55).all(), "rows of other chunks are not written"
    untouched = [i for i in range(L * geo.rows) if i not in used]
    assert torch.isnan(slab[untouched]).all() if untouched else True


# ---------------------------------------------------------------------------------------- combine
@pytest.mark.parametrize("counts", [(3, 0, 8), (0, 0, 0), (8, 8, 8)], ids=str)
@pytest.mark.parametrize("own", [-1, 1])
def test_combine_flat_rows(cpu_path, gen, counts, own):
    R, T, E, k, K = 3, 8, 9, 2, 40
    geo = geometry(R, T, E, K, k)
    V = sum(counts)
    y = torch.randn(geo.rows, K, generator=gen)
    y[V:] = float("nan")
    out = torch.full((geo.rows, K), -3.0)
    D.combine_flat_rows(geo, torch.tensor(counts, dtype=torch.int32), y, out, rank=own)
    order = ([own] if own >= 0 else []) + [r for r in range(R) if r != own]  # compaction order
    start = {r: sum(counts[q] for q in order[:order.index(r)]) for r in range(R)}
    for r in range(R):
        for p in range(T):
            if p < counts[r] and r != own:
                assert torch.equal(out[r * T + p], y[start[r] + p])
            else:
                assert (out[r * T + p] == -3.0).all(), "padding and the own chunk's rows are not written"


@pytest.mark.parametrize("exact,subset", [(False, "all"), (True, "all"), (False, "skip0"), (False, "only0")],
                         ids=["graph_safe", "exact", "skip_own", "only_own"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_batched_rows(cpu_path, gen, exact, subset, dtype):
    R, T, E, k, K = 2, 8, 10, 3, 48
    geo = geometry(R, T, E, K, k, dtype)
    emap = ExpertMap(E, 0, R)
    L = emap.num_local
    counts = (6, 3)
    wire, rows = received_wire(gen, geo, counts, local_ids=torch.arange(E), exact=exact, dup=True)
    cc = torch.tensor(counts, dtype=torch.int32)
    slab = torch.full((L * geo.rows + 1, K), float("nan"), dtype=dtype)
    cnt = torch.zeros(L, dtype=torch.int32)
    slot_rows = torch.full((geo.rows, k), -1, dtype=torch.int32)
    slot_w = torch.full((geo.rows, k), float("nan"))
    D._receive_batched_torch(geo, wire, cc.clone(), not exact, emap.map, L, slab, cnt, slot_rows, slot_w)
    y = torch.full((L, geo.rows, K), float("nan"), dtype=dtype)  # rows past a count: NaN
    for e in range(L):
        y[e, : int(cnt[e])] = torch.randn(int(cnt[e]), K, generator=gen).to(dtype)
    out = torch.full((geo.rows, K), -9.0, dtype=dtype)
    skip, only = {"skip0": (0, -1), "only0": (-1, 0)}.get(subset, (-1, -1))
    D.combine_batched_rows(geo, cc, not exact, slot_rows, slot_w, y, out, rank=max(skip, only), own_only=only >= 0)
    _, _, mf = geo.wire.views(wire)
    flat = y.reshape(-1, K)
    chosen = [i for i in rows if (skip < 0 or i // T != skip) and (only < 0 or i // T == only)]
    for row in chosen:
        ref = torch.zeros(K, dtype=torch.float64)
        for j in range(k):
            s = int(slot_rows[row, j])
            if s >= 0:
                ref += float(mf[row, k + j]) * flat[s].double()
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert torch.allclose(out[row].double(), ref, rtol=tol, atol=tol), row
    others = [i for i in range(geo.rows) if i not in set(chosen)]
    assert (out[others] == -9.0).all(), "rows of padding (and of chunks not chosen) are not written"


@pytest.mark.parametrize("m", [0, 1, 13])
@pytest.mark.parametrize("self_rank", [-1, 1])
def test_reduce_partials(cpu_path, gen, m, self_rank):
    R, T, E, k, K = 3, 13, 9, 2, 33
    geo = geometry(R, T, E, K, k)
    comb_recv = torch.randn(geo.rows, K, generator=gen)
    comb_send = torch.randn(geo.rows, K + 5, generator=gen)[:, :K]  # own rows: a row stride of their own
    token_rows = torch.full((R, T), geo.rows, dtype=torch.int32)
    referenced = {"recv": set(), "send": set()}
    for r in range(R):
        for t in range(m):
            if torch.rand((), generator=gen) < 0.6:
                token_rows[r, t] = r * T + t
                referenced["send" if r == self_rank else "recv"].add(r * T + t)
    for buf, name in ((comb_recv, "recv"), (comb_send, "send")):  # rows never referenced: NaN
        buf[[i for i in range(geo.rows) if i not in referenced[name]]] = float("nan")
    out = torch.full((m, K), -1.0)
    D.reduce_partials(geo, comb_recv, token_rows, m, out, rank=self_rank,
                      own_rows=comb_send if self_rank >= 0 else None)
    for t in range(m):
        ref = torch.zeros(K, dtype=torch.float64)
        for r in range(R):
            if int(token_rows[r, t]) < geo.rows:
                ref += (comb_send if r == self_rank else comb_recv)[int(token_rows[r, t])].double()
        assert torch.allclose(out[t].double(), ref, atol=1e-6), t


def test_reduce_partials_own_rank_needs_send_rows():
    geo = geometry(2, 4, 4, 8, 1)
    with pytest.raises(ValueError, match="own_rows"):
        D.reduce_partials(geo, torch.zeros(8, 8), torch.zeros(2, 4, dtype=torch.int32), 2, torch.zeros(2, 8),
                          rank=0)


def test_wire_format_alignment():
    """Every view's row stride is a multiple of 16 elements (vector loads), meta starts 16-aligned."""
    for K, k, dtype, fp8 in [(4096, 6, torch.bfloat16, False), (4096, 6, torch.bfloat16, True),
                             (33, 3, torch.float32, False), (7, 1, torch.float16, False), (200, 8, torch.bfloat16, True)]:
        w = D.WireFormat(K, k, dtype, fp8)
        assert w.row_bytes % 64 == 0 and w.x_bytes % 16 == 0
        assert w.row_bytes >= w.x_bytes + 4 * D.meta_columns(k, K, fp8)
        buf = torch.zeros(4, w.buffer_row_bytes, dtype=torch.uint8)
        x, mi, mf = w.views(w.wire_rows(buf, 4))
        assert x.shape == (4, K) and x.dtype == w.wire_dtype and mi.shape[1] >= 2 * k + 1
        assert w.combine_rows(buf, 4).shape == (4, K) and w.combine_rows(buf, 4).is_contiguous()


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_pack_fp8_bytes_on_cuda_equal_torch():
    """The compiled fp8 quantization (IEEE divisions + integer rounding) gives torch's bytes."""
    R, T, E, k, K = 2, 64, 8, 2, 4096
    geo = geometry(R, T, E, K, k, torch.bfloat16, fp8=True)
    gen = torch.Generator().manual_seed(3)
    hidden = (torch.randn(T, K, generator=gen) * torch.logspace(-6, 2, K)[None, :]).to(torch.bfloat16)
    ids = torch.zeros(T, k, dtype=torch.int64)  # every token to rank 0
    w = torch.ones(T, k)
    wire = poisoned_wire(geo, device="cuda")
    send = geo.wire.wire_rows(wire, geo.rows)
    D.pack_rows(hidden.cuda(), ids.cuda(), w.cuda(), owner_table(E, R).cuda(), geo, send,
                torch.empty(R, T, dtype=torch.int32, device="cuda"))
    q_ref, s_ref = fp8_reference(hidden)
    _, _, mf = geo.wire.views(send)
    S = s_ref.shape[1]
    assert torch.equal(mf[:T, geo.wire.scale_col:geo.wire.scale_col + S].cpu(), s_ref)
    assert torch.equal(geo.wire.x_bytes_view(send)[:T].cpu(), q_ref)
