"""The expert-parallel stages of `padded_moe.distributed` (spec 04) on one process, without a group.

Each stage runs on the torch path and on the Triton kernels of `padded_moe.kernels.ep` (interpreted
on CPU) and is checked against an independent reference built with Python loops: pack, flat and
batched receive, both combine kernels, the reduction, and a simulated R-rank round trip (the
all_to_all done by copying chunks) for both modes, graph-safe and exact splits, fp8 wire.
Inputs: NaN in padding rows, poisoned outputs, garbage ids (-1, E, 2^31-1, 2^32+1, -2^31),
idle ranks, all tokens to one peer, repeated ids within a token.
"""

from __future__ import annotations

import pytest
import torch

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


def fp8_reference(x):
    """Per-block (128 or whole row) amax/448 scales and e4m3 values (torch's rounding)."""
    q, scales = D._quantize_fp8(x)
    return q, scales


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
    D.pack_rows(hidden, ids, weights, owner, geo, send, token_rows, send_base, zero_counts=zero, skip_peer=skip)
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
                q, s = D._quantize_fp8(vals.view(1, K))
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
    D.receive_flat(geo, wire, cc, not exact, rb_x, rb_ids, rb_w, rb_valid, own=own)
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
                skip_peer=me, block_counts=block_counts)
    rb_x = torch.full((geo.rows, K), float("nan"))
    rb_ids = torch.full((geo.rows, k), 77, dtype=torch.int32)
    rb_w = torch.full((geo.rows, k), float("nan"))
    cc = torch.full((R,), -5, dtype=torch.int32)
    D.local_flat(hidden, ids, weights, owner, geo, me, rb_x, rb_ids, rb_w, token_rows, cc, block_counts)
    x = hidden
    if fp8 and m:
        q, sc = D._quantize_fp8(hidden)
        x = D._dequantize_fp8(q, sc, torch.float32)
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
    D.receive_batched(geo, wire, cc, not exact, emap.map, L, slab, cnt, slot_rows, slot_w, skip_peer=skip)
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
        q, sc = D._quantize_fp8(hidden)
        x = D._dequantize_fp8(q, sc, torch.float32)
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
    D.combine_flat_rows(geo, torch.tensor(counts, dtype=torch.int32), y, out, own=own)
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
    D.combine_batched_rows(geo, cc, not exact, slot_rows, slot_w, y, out, skip_peer=skip, only_peer=only)
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
    D.reduce_partials(geo, comb_recv, token_rows, m, out, self_rank=self_rank,
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
                          self_rank=0)


# ---------------------------------------------------------------------------------------- round trip
def simulate(geo, owner, placement, mode, graph_safe, hiddens, ids, weights, scale, keep_own=None):
    """R ranks on one process, in ExpertParallel's order: pack, all_to_all by chunk copies,
    receive, experts (expert e multiplies its rows by scale[e]; rows past counts / valid NaN),
    combine, reduce. `keep_own` (default: graph_safe) keeps each rank's own chunk out of the
    exchange (its tokens go through local_batched / local_flat; the own chunk of every receive
    buffer stays poisoned). Runs on the inputs' device."""
    R, T, E, K, k = geo.ep_size, geo.max_tokens, geo.num_experts, geo.wire.hidden_size, geo.wire.top_k
    dtype, rows, dev = geo.wire.dtype, geo.rows, hiddens[0].device
    keep_own = graph_safe if keep_own is None else keep_own
    owner, scale = owner.to(dev), scale.to(dev)
    send = [poisoned_wire(geo, device=dev) for _ in range(R)]
    recv = [poisoned_wire(geo, device=dev) for _ in range(R)]
    wires_s = [geo.wire.wire_rows(b, rows) for b in send]
    wires_r = [geo.wire.wire_rows(b, rows) for b in recv]
    token_rows = [torch.full((R, T), -2, dtype=torch.int32, device=dev) for _ in range(R)]
    cc = [torch.full((R,), -4, dtype=torch.int32, device=dev) for _ in range(R)]
    maps = [ExpertMap(E, r, R, placement, device=dev) for r in range(R)]
    counts_l = [torch.full((maps[r].num_local,), 99, dtype=torch.int32, device=dev) for r in range(R)]
    send_counts = [D.peer_counts(ids[s], owner, geo).tolist() for s in range(R)]
    route = [torch.full((R, D.route_block_columns(T)), -9, dtype=torch.int32, device=dev) for _ in range(R)]
    for s in range(R):
        base = None
        if not graph_safe:
            base = torch.tensor([sum(send_counts[s][:r]) for r in range(R)], dtype=torch.int32, device=dev)
            cc[s].copy_(torch.tensor([send_counts[q][s] for q in range(R)], dtype=torch.int32))
        D.pack_rows(hiddens[s], ids[s], weights[s], owner, geo, wires_s[s], token_rows[s], base,
                    zero_counts=counts_l[s] if mode == "batched" else None, skip_peer=s if keep_own else -1,
                    block_counts=route[s])

    def all_to_all(src, dst, sizes):
        """sizes[s][r]: rows rank s sends to rank r (graph-safe: fixed T-row chunks, garbage too)."""
        for r in range(R):
            off = 0
            for s in range(R):
                if graph_safe:
                    if not (keep_own and s == r):
                        dst[r][s * T:(s + 1) * T] = src[s][r * T:(r + 1) * T]
                else:
                    n, start = sizes[s][r], sum(sizes[s][:r])
                    dst[r][off:off + n] = src[s][start:start + n]
                    off += n

    full = [[T] * R for _ in range(R)]
    all_to_all(wires_s, wires_r, full if graph_safe else send_counts)
    outs, ys = [], []
    comb_send = [geo.wire.combine_rows(b, rows) for b in send]
    comb_recv = [geo.wire.combine_rows(b, rows) for b in recv]
    for r in range(R):
        L = maps[r].num_local
        sc = scale[maps[r].local_experts]
        if mode == "flat":
            rb_x = torch.full((rows, K), float("nan"), dtype=dtype, device=dev)
            rb_ids = torch.full((rows, k), 5, dtype=torch.int32, device=dev)
            rb_w = torch.full((rows, k), float("nan"), device=dev)
            rb_v = torch.zeros(1, dtype=torch.int32, device=dev)
            if keep_own:
                D.local_flat(hiddens[r], ids[r], weights[r], owner, geo, r, rb_x, rb_ids, rb_w, token_rows[r], cc[r],
                             route[r])
            D.receive_flat(geo, wires_r[r], cc[r], graph_safe, rb_x, rb_ids, rb_w, rb_v, own=r if keep_own else -1)
            v = int(rb_v)
            y = torch.full((rows, K), float("nan"), dtype=dtype, device=dev)
            g = rb_ids[:v].long()
            keep = g >= 0
            f = torch.where(keep, rb_w[:v].double() * scale[g.clamp(min=0)],
                            torch.zeros((), dtype=torch.float64, device=dev))
            y[:v] = (rb_x[:v].double() * f.sum(1, keepdim=True)).to(dtype)
            ys.append(y)
            if graph_safe:
                D.combine_flat_rows(geo, cc[r], y, comb_send[r], own=r if keep_own else -1)
            else:
                comb_send[r][:v] = y[:v]
        else:
            slab = torch.full((L * rows + 1, K), float("nan"), dtype=dtype, device=dev)
            slot_rows = torch.full((rows, k), 3, dtype=torch.int32, device=dev)
            slot_w = torch.full((rows, k), float("nan"), device=dev)
            if keep_own:
                D.local_batched(hiddens[r], ids[r], weights[r], geo, r, maps[r].map, L, slab, counts_l[r],
                                slot_rows, slot_w, token_rows[r], cc[r])
            D.receive_batched(geo, wires_r[r], cc[r], graph_safe, maps[r].map, L, slab, counts_l[r], slot_rows,
                              slot_w, skip_peer=r if keep_own else -1)
            y = torch.full((L, rows, K), float("nan"), dtype=dtype, device=dev)
            for e in range(L):
                c = int(counts_l[r][e])
                y[e, :c] = (slab[e * rows:e * rows + c].double() * float(sc[e])).to(dtype)
            D.combine_batched_rows(geo, cc[r], graph_safe, slot_rows, slot_w, y, comb_send[r],
                                   skip_peer=r if keep_own else -1)
            if keep_own:
                D.combine_batched_rows(geo, cc[r], True, slot_rows, slot_w, y, comb_send[r], only_peer=r)
    back = full if graph_safe else [[send_counts[s][r] for s in range(R)] for r in range(R)]
    all_to_all(comb_send, comb_recv, back)
    for s in range(R):
        m = hiddens[s].shape[0]
        out = torch.full((m, K), -1.0, dtype=dtype, device=dev)
        own_rows = (ys[s] if mode == "flat" else comb_send[s]) if keep_own else None
        D.reduce_partials(geo, comb_recv[s], token_rows[s], m, out, self_rank=s if keep_own else -1,
                          own_rows=own_rows)
        outs.append(out)
    return outs


@pytest.mark.parametrize("mode", ["flat", "batched"])
@pytest.mark.parametrize("graph_safe,keep_own", [(True, True), (True, False), (False, False)],
                         ids=["graph_safe_own_kept", "graph_safe", "exact"])
@pytest.mark.parametrize("wire,ms,routing", [("f32", (5, 0, 7), "random"), ("bf16", (6, 6, 6), "last_rank"),
                                             ("fp8", (4, 6, 2), "duplicate"), ("bf16", (0, 0, 0), "random")],
                         ids=str)
def test_round_trip_matches_reference(cpu_path, gen, mode, graph_safe, keep_own, wire, ms, routing):
    R, T, E, k = 3, 7, 10, 3
    K = 256 if wire == "fp8" else 40
    dtype = torch.bfloat16 if wire in ("bf16", "fp8") else torch.float32
    placement = "round_robin" if routing == "duplicate" else "linear"
    geo = geometry(R, T, E, K, k, dtype, wire == "fp8")
    owner = owner_table(E, R, placement)
    only = ExpertMap(E, R - 1, R, placement).local_experts if routing == "last_rank" else None
    hiddens = [torch.randn(m, K, generator=gen).to(dtype) for m in ms]
    ids = [random_ids(gen, m, E, k, dup=routing == "duplicate", only=only) for m in ms]
    weights = [torch.rand(m, k, generator=gen) + 0.1 for m in ms]
    scale = torch.rand(E, generator=gen, dtype=torch.float64) + 0.5
    outs = simulate(geo, owner, placement, mode, graph_safe, hiddens, ids, weights, scale, keep_own)
    for s, m in enumerate(ms):
        x = hiddens[s].float()
        if wire == "fp8":
            q, sc = D._quantize_fp8(x)
            x = D._dequantize_fp8(q, sc, torch.float32)
        g = ids[s]
        ok = (g >= 0) & (g < E)
        f = torch.where(ok, weights[s].double() * scale[g.clamp(0, E - 1)], torch.zeros((), dtype=torch.float64))
        ref = x.double() * f.sum(1, keepdim=True)
        assert outs[s].shape == (m, K)
        if m:
            err = ((outs[s].double() - ref).norm() / ref.norm()).item()
            tol = 1e-6 if dtype == torch.float32 else 2e-2
            assert err <= tol, (s, err)


@pytest.mark.parametrize("mode", ["flat", "batched"])
def test_round_trip_with_capped_grids(triton_on, gen, monkeypatch, mode):
    """The kernels that overlap the all_to_all (local_batched / local_flat, the own chunk's
    combine) run on a grid capped below the machine and loop over the row blocks: with 2
    programs for 3-4 blocks the round trip still equals the reference."""
    monkeypatch.setattr(D, "_capped_grid", lambda device, rows, k_programs=1: min(rows, 2))
    R, T, E, k, K = 2, 40, 12, 3, 32
    geo = geometry(R, T, E, K, k)
    owner = owner_table(E, R)
    ms = (40, 33)
    hiddens = [torch.randn(m, K, generator=gen) for m in ms]
    ids = [random_ids(gen, m, E, k, dup=True) for m in ms]
    weights = [torch.rand(m, k, generator=gen) + 0.1 for m in ms]
    scale = torch.rand(E, generator=gen, dtype=torch.float64) + 0.5
    outs = simulate(geo, owner, "linear", mode, True, hiddens, ids, weights, scale)
    for s, m in enumerate(ms):
        g = ids[s]
        ok = (g >= 0) & (g < E)
        f = torch.where(ok, weights[s].double() * scale[g.clamp(0, E - 1)], torch.zeros((), dtype=torch.float64))
        ref = hiddens[s].double() * f.sum(1, keepdim=True)
        assert torch.allclose(outs[s].double(), ref, rtol=1e-5, atol=1e-5), s


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
@pytest.mark.parametrize("mode", ["flat", "batched"])
@pytest.mark.parametrize("graph_safe", [True, False], ids=["graph_safe", "exact"])
@pytest.mark.parametrize("wire,K", [("f32", 4096), ("bf16", 4096), ("fp8", 4096), ("fp8", 200),
                                    ("bf16", 200)])
def test_round_trip_cuda_equals_torch_path(monkeypatch, mode, graph_safe, wire, K):
    """dsv4-like routing (E=256, k=6) on one GPU through the compiled kernels equals the CPU torch
    path (to float32 / one bf16 rounding: the GPU may fuse multiply-adds)."""
    R, T, E, k = 2, 40, 256, 6
    dtype = torch.float32 if wire == "f32" else torch.bfloat16
    geo = geometry(R, T, E, K, k, dtype, wire == "fp8")
    gen = torch.Generator().manual_seed(K + T)
    owner = owner_table(E, R)
    ms = (T, 17)
    hiddens = [torch.randn(m, K, generator=gen).to(dtype) for m in ms]
    ids = [random_ids(gen, m, E, k, garbage=0.05, dup=(i == 1)) for i, m in enumerate(ms)]
    weights = [torch.rand(m, k, generator=gen) + 0.1 for m in ms]
    scale = torch.rand(E, generator=gen, dtype=torch.float64) + 0.5
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = simulate(geo, owner, "linear", mode, graph_safe, hiddens, ids, weights, scale)
    cuda = lambda ts: [t.cuda() for t in ts]  # noqa: E731
    gpu = simulate(geo, owner, "linear", mode, graph_safe, cuda(hiddens), cuda(ids), cuda(weights), scale)
    for a, b in zip(cpu, gpu):
        b = b.cpu()
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol), (a - b).abs().max()


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
