"""MXFP4 storage, quantization, dequantization and checkpoint converters (spec 03)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import rel_err

from padded_moe.mxfp4 import (
    HopperMxfp4,
    Mxfp4Tensor,
    dequantize_mxfp4,
    from_gpt_oss,
    from_transposed,
    prepare_hopper,
    quantize_mxfp4,
    to_gpt_oss,
    unprepare_hopper,
)

# Independent decode table written from the OCP table (not imported from the module under test).
E2M1 = {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0}


def decode_slow(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Element-by-element float64 decode of one expert matrix `[rows, K/2]` / `[rows, K/32]`."""
    rows, half = blocks.shape
    out = torch.empty(rows, half * 2, dtype=torch.float64)
    for r in range(rows):
        for k in range(half * 2):
            byte = int(blocks[r, k // 2])
            nib = (byte >> (4 * (k % 2))) & 0xF
            s = int(scales[r, k // 32])
            mag = E2M1[nib & 7] * (math.nan if s == 255 else 2.0 ** (s - 127))
            out[r, k] = -mag if nib & 8 else mag
    return out


def random_grid_codes(L, rows, K, gen):
    """Codes (no -0) where every 32-group holds a magnitude-4 or -6 element, so the scale chosen by
    floor(log2(amax)) - 2 is exactly the one used to build the values."""
    codes = torch.randint(0, 16, (L, rows, K), generator=gen)
    codes[codes == 8] = 0
    g = codes.view(L, rows, K // 32, 32)
    pos = torch.randint(0, 32, (L, rows, K // 32, 1), generator=gen)
    top = torch.randint(6, 8, (L, rows, K // 32, 1), generator=gen) | (torch.randint(0, 2, pos.shape, generator=gen) << 3)
    g.scatter_(-1, pos, top)
    return codes


def test_exact_on_grid_values(gen):
    L, rows, K = 2, 3, 96
    codes = random_grid_codes(L, rows, K, gen)
    scales = torch.randint(100, 150, (L, rows, K // 32), generator=gen, dtype=torch.uint8)
    mag = torch.tensor([E2M1[i] for i in range(8)], dtype=torch.float64)[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    w = (vals.view(L, rows, K // 32, 32) * torch.pow(2.0, scales.double() - 127).unsqueeze(-1)).view(L, rows, K)
    q = quantize_mxfp4(w.float())
    assert torch.equal(q.scales, scales)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    assert torch.equal(q.blocks, packed)
    for dt in (torch.float32, torch.bfloat16, torch.float64):
        assert torch.equal(dequantize_mxfp4(q, dt), w.to(dt))


def test_round_to_nearest_even_and_saturation():
    # One group with amax 7 -> exponent floor(log2 7) - 2 = 0, so x / 2^0 = x.
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -0.3, 0.2, 5.5, -6.5, 0.74, 0.76]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -0.5, 0.0, 6.0, -6.0, 0.5, 1.0]
    w = torch.zeros(1, 1, 32, dtype=torch.float64)
    w[0, 0, : len(vals)] = torch.tensor(vals, dtype=torch.float64)
    q = quantize_mxfp4(w)
    assert int(q.scales[0, 0, 0]) == 127
    got = dequantize_mxfp4(q, torch.float64)[0, 0, : len(vals)]
    assert got.tolist() == want


def test_scale_rule_and_zero_group():
    w = torch.zeros(1, 2, 64)
    w[0, 0, :32] = 0.01  # amax 0.01 -> floor(log2 0.01) - 2 = -7 - 2 = -9
    w[0, 0, 40] = 1000.0  # floor(log2 1000) - 2 = 7
    q = quantize_mxfp4(w)
    assert q.scales[0, 0].tolist() == [127 - 9, 127 + 7]
    assert q.scales[0, 1].tolist() == [0, 0]  # all-zero groups: smallest scale, value 0
    assert torch.equal(dequantize_mxfp4(q, torch.float32)[0, 1], torch.zeros(64))


def test_random_error_bounds(gen):
    w = torch.randn(3, 8, 128, generator=gen, dtype=torch.float64) * 3
    q = quantize_mxfp4(w)
    dq = dequantize_mxfp4(q, torch.float64)
    step = torch.pow(2.0, q.scales.double() - 127).repeat_interleave(32, dim=-1)
    # Grid spacing at the top of the range is 2 * 2^e (between 4 and 6); saturation of
    # |x| / 2^e in (6, 8) costs at most 2 * 2^e as well.
    assert ((dq - w).abs() <= 2 * step + 1e-12).all()
    assert rel_err(dq, w) < 0.15
    # Each element's code is the nearest grid point (ties aside) below saturation.
    inside = (w.abs() / step) <= 6
    grid = torch.tensor(sorted({v * s for v in E2M1.values() for s in (1, -1)}), dtype=torch.float64)
    nearest = ((w / step).unsqueeze(-1) - grid).abs().min(-1).values
    assert torch.allclose(((dq / step) - (w / step)).abs()[inside], nearest[inside], atol=1e-9)


def test_dequantize_matches_slow_decoder(gen):
    blocks = torch.randint(0, 256, (2, 3, 32), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 256, (2, 3, 2), generator=gen, dtype=torch.uint8)
    scales[0, 0, 0] = 0    # 2^-127: a float32 subnormal
    scales[1, 2, 1] = 255  # NaN
    q = Mxfp4Tensor(blocks, scales)
    got = dequantize_mxfp4(q, torch.float32).double()
    for e in range(2):
        # The float32 output of a float64-exact decode: scale 254 times 6 overflows to inf there.
        want = decode_slow(blocks[e], scales[e]).float().double()
        assert torch.equal(torch.isnan(got[e]), torch.isnan(want))
        ok = ~torch.isnan(want)
        assert torch.equal(got[e][ok], want[ok])
    assert torch.isnan(got[1, 2, 32:]).all()


def test_gpt_oss_round_trip(gen):
    E, N, K = 2, 4, 64
    blocks = torch.randint(0, 256, (E, N, K // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (E, N, K // 32), generator=gen, dtype=torch.uint8)
    q = from_gpt_oss(blocks, scales)
    assert q.shape == (E, N, K)
    b2, s2 = to_gpt_oss(q)
    assert torch.equal(b2, blocks) and torch.equal(s2, scales)
    # GPT-OSS element k of row n: byte k//2 of the flattened group blocks, low nibble for even k.
    dq = dequantize_mxfp4(q, torch.float64)
    flat = blocks.reshape(E, N, K // 2)
    for e, n, k in [(0, 0, 0), (0, 1, 1), (1, 3, 33), (1, 2, 62)]:
        nib = (int(flat[e, n, k // 2]) >> (4 * (k % 2))) & 0xF
        mag = E2M1[nib & 7] * 2.0 ** (int(scales[e, n, k // 32]) - 127)
        assert float(dq[e, n, k]) == (-mag if nib & 8 else mag)


def test_from_transposed(gen):
    w = torch.randn(2, 64, 48, generator=gen)  # [E, K, 2N] as GPT-OSS stores gate_up_proj
    wt = from_transposed(w)
    assert wt.shape == (2, 48, 64) and wt.is_contiguous() and torch.equal(wt, w.transpose(1, 2))
    q = from_transposed(w, quantize=True)
    assert isinstance(q, Mxfp4Tensor) and q.shape == (2, 48, 64)
    assert torch.equal(dequantize_mxfp4(q, torch.float32), dequantize_mxfp4(quantize_mxfp4(wt), torch.float32))


def test_tensor_helpers(gen):
    q = quantize_mxfp4(torch.randn(4, 8, 64, generator=gen))
    assert q.shape == (4, 8, 64) and q.num_experts == 4 and q.device.type == "cpu"
    assert q.nbytes() == 4 * 8 * 32 + 4 * 8 * 2
    sub = q[1:3]
    assert sub.shape == (2, 8, 64) and torch.equal(sub.blocks, q.blocks[1:3])
    one = q[2]
    assert one.shape == (1, 8, 64) and torch.equal(one.scales, q.scales[2:3])
    assert torch.equal(q.to("cpu").blocks, q.blocks)


def test_validation():
    with pytest.raises(TypeError, match="blocks"):
        Mxfp4Tensor(torch.zeros(1, 2, 16), torch.zeros(1, 2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="K/32"):
        Mxfp4Tensor(torch.zeros(1, 2, 16, dtype=torch.uint8), torch.zeros(1, 2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(1, 2, 48))
    with pytest.raises(ValueError, match="finite"):
        quantize_mxfp4(torch.full((1, 1, 32), float("inf")))
    with pytest.raises(TypeError, match="^w must"):
        quantize_mxfp4(torch.zeros(1, 2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="16"):
        from_gpt_oss(torch.zeros(1, 2, 2, 8, dtype=torch.uint8), torch.zeros(1, 2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales"):
        from_gpt_oss(torch.zeros(1, 2, 2, 16, dtype=torch.uint8), torch.zeros(1, 2, 3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="Mxfp4Tensor"):
        dequantize_mxfp4(torch.zeros(1, 2, 16, dtype=torch.uint8))


# The 4-plane arrangement's bit places, written here from the documented layout (not imported):
# plane p of a 16-bit half word -> (sign, e1, e0, m) bit positions.
FOUR_PLANES = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (14, 13, 11, 10))


def decode_hopper_slow(h: HopperMxfp4, e: int) -> torch.Tensor:
    """Float64 decode of one expert straight from the documented prepared layout: in the 64-element
    block starting at k0, byte j holds element k0+j (low nibble) and k0+32+j (high nibble), or
    (4 planes) 32-bit word 4g+c holds element 32g+2c+8p in its low half and 32g+2c+8p+1 in its
    high half, plane p at FOUR_PLANES; scales are [K_pad/32, rows]."""
    rows = h.blocks.shape[1]
    out = torch.empty(rows, h.k, dtype=torch.float64)
    for r in range(rows):
        for k in range(h.k):
            k0, off = (k // 64) * 64, k % 64
            if h.planes == 4:
                g, j = k // 32, k % 32  # j = 8p + 2c + half
                word = int(h.blocks[e, r, 4 * g + (j % 8) // 2]) & 0xFFFFFFFF
                half = 16 * (j % 2)
                nib = sum(((word >> (place + half)) & 1) << bit
                          for bit, place in zip((3, 2, 1, 0), FOUR_PLANES[j // 8]))
            else:
                byte = int(h.blocks[e, r, k0 // 2 + off % 32])
                nib = (byte >> (4 * (off // 32))) & 0xF
            s = int(h.scales[e, k // 32, r])
            if h.folded:  # bf16 bits of 2^(s-1): exponent field s - 1 + 127
                assert s & 0x7F == 0 and 0 < s < 0x7F80, s
                s = (s >> 7) - 126
            mag = E2M1[nib & 7] * (math.nan if s == 255 else 2.0 ** (s - 127))
            out[r, k] = -mag if nib & 8 else mag
    return out


@pytest.mark.parametrize("planes", [2, 4])
@pytest.mark.parametrize("folded", [False, True], ids=["bytes", "folded"])
@pytest.mark.parametrize("K", [32, 64, 96, 128])
def test_hopper_layout_matches_canonical(K, folded, planes, gen):
    L, rows = 2, 3
    blocks = torch.randint(0, 256, (L, rows, K // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 129 if folded else 255, (L, rows, K // 32), generator=gen, dtype=torch.uint8)
    scales[0, 0, 0] = 128 if folded else 255
    q = Mxfp4Tensor(blocks, scales)
    h = prepare_hopper(q, planes=planes)
    assert h.folded == folded and h.scales.dtype == (torch.int16 if folded else torch.uint8)
    assert h.planes == planes and h.blocks.dtype == (torch.int32 if planes == 4 else torch.uint8)
    kp = -(-K // 64) * 64
    assert h.k == K and h.k_padded == kp
    assert tuple(h.blocks.shape) == (L, rows, kp // (8 if planes == 4 else 2)) and tuple(h.scales.shape) == (L, kp // 32, rows)
    assert h.blocks.is_contiguous() and h.scales.is_contiguous()
    for e in range(L):
        want = dequantize_mxfp4(q[e], torch.float64)[0]
        got = decode_hopper_slow(h, e).float().double()  # as float32, like dequantize_mxfp4 (2^129 -> inf)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    if kp > K:  # padding decodes to zeros (code 0 with a finite scale)
        # the last block's columns 32..63 are the padding: high nibbles, or the last group's words
        pad_bits = h.blocks.view(L, rows, kp // 64, 32)[:, :, -1] >> 4 if planes == 2 else h.blocks[..., -4:]
        assert (pad_bits == 0).all()
        assert (h.scales[:, -1] == (253 << 7 if folded else 127)).all()
    back = unprepare_hopper(h)
    assert torch.equal(back.blocks, blocks) and torch.equal(back.scales, scales)


def test_prepare_hopper_fold_argument(gen):
    """fold=None folds when every scale allows it; fold=False keeps bytes; fold=True refuses a
    scale above 128 (2^(s-1) would not be a finite bf16) with a ValueError naming the maximum."""
    q = quantize_mxfp4(torch.randn(2, 4, 64, generator=gen))
    assert prepare_hopper(q).folded and not prepare_hopper(q, fold=False).folded
    assert torch.equal(unprepare_hopper(prepare_hopper(q)).scales, q.scales)
    big = Mxfp4Tensor(q.blocks, torch.full_like(q.scales, 129))
    assert not prepare_hopper(big).folded
    with pytest.raises(ValueError, match="fold=True needs every scale <= 128, got a maximum of 129"):
        prepare_hopper(big, fold=True)
    with pytest.raises(TypeError, match="fold must be a bool or None"):
        prepare_hopper(q, fold=1)
    with pytest.raises(ValueError, match="planes must be 2 or 4, got 3"):
        prepare_hopper(q, planes=3)


def test_prepare_hopper_does_not_read_back_under_tracing(gen):
    """Inside torch.compile tracing the scales' maximum cannot be read back: fold=None keeps the
    bytes (same values) instead of failing or breaking the graph."""
    q = quantize_mxfp4(torch.randn(2, 4, 64, generator=gen))

    def scales_dtype_code(blocks, scales):
        h = prepare_hopper(Mxfp4Tensor(blocks, scales))
        return torch.full((1,), 16 if h.folded else 8)

    compiled = torch.compile(scales_dtype_code, backend="eager", fullgraph=True)
    assert compiled(q.blocks, q.scales).item() == 8
    assert scales_dtype_code(q.blocks, q.scales).item() == 16


def test_prepare_for_caches_and_travels(gen):
    q = quantize_mxfp4(torch.randn(4, 8, 96, generator=gen))
    assert q.hopper is None
    assert q.prepare_for() is q and q.hopper is not None
    h = q.hopper
    assert q.prepare_for("cpu") is q and q.hopper is h  # built once
    sub = q[1:3]
    assert sub.hopper is not None and torch.equal(sub.hopper.blocks, h.blocks[1:3])
    assert torch.equal(q[2].hopper.scales, h.scales[2:3])
    assert torch.equal(q.to("cpu").hopper.blocks, h.blocks)
    assert q.contiguous().hopper is h
    assert torch.equal(dequantize_mxfp4(unprepare_hopper(sub.hopper)), dequantize_mxfp4(sub))
    with pytest.raises(TypeError, match="^q must"):
        prepare_hopper(torch.zeros(1, 2, 16, dtype=torch.uint8))
    with pytest.raises(TypeError, match="^h must"):
        unprepare_hopper(q)
    with pytest.raises(TypeError, match="^hopper must"):
        Mxfp4Tensor(q.blocks, q.scales, q.blocks)
    with pytest.raises(ValueError, match="^hopper must"):
        Mxfp4Tensor(q.blocks[:2], q.scales[:2], h)


def test_prepared_only_tensor_holds_the_same_weights(gen):
    """`prepare_for(keep_canonical=False)`: a new tensor without `blocks` / `scales` whose shape,
    bytes of the format and values are the original's; slicing, `to` and `contiguous` keep it
    prepared-only, and `canonical()` rebuilds the exact canonical bytes."""
    q = quantize_mxfp4(torch.randn(4, 8, 128, generator=gen))
    p = q.prepare_for(keep_canonical=False)
    assert p is not q and p.blocks is None and p.scales is None and not p.holds_canonical
    assert q.holds_canonical and q.hopper is p.hopper  # the original keeps both forms
    assert (p.shape, p.device, p.num_experts, p.nbytes()) == (q.shape, q.device, q.num_experts, q.nbytes())
    c = p.canonical()
    assert c.holds_canonical and torch.equal(c.blocks, q.blocks) and torch.equal(c.scales, q.scales)
    assert q.canonical() is q
    assert torch.equal(p.dequantize(torch.float32), q.dequantize(torch.float32))
    assert all(torch.equal(a, b) for a, b in zip(to_gpt_oss(p), to_gpt_oss(q)))
    for view, want in ((p[1:3], q[1:3]), (p[2], q[2]), (p.to("cpu"), q), (p.contiguous(), q)):
        assert view.blocks is None and view.shape == want.shape
        assert torch.equal(view.canonical().blocks, want.blocks)
    assert p.prepare_for() is p and p.prepare_for(keep_canonical=False) is p
    assert torch.equal(prepare_hopper(p, planes=2).blocks, prepare_hopper(q, planes=2).blocks)
    # Built straight from a tensor without its prepared form, too.
    fresh = quantize_mxfp4(torch.randn(2, 4, 64, generator=gen))
    assert torch.equal(fresh.prepare_for(keep_canonical=False).canonical().blocks, fresh.blocks)


def test_prepared_only_tensor_refuses_what_it_cannot_be(gen):
    q = quantize_mxfp4(torch.randn(2, 4, 96, generator=gen))  # K = 96: the prepared form pads it
    with pytest.raises(ValueError, match="keep_canonical=False needs K a multiple of 64, got K=96"):
        q.prepare_for(keep_canonical=False)
    with pytest.raises(TypeError, match="^keep_canonical must be a bool"):
        q.prepare_for(keep_canonical=0)
    h = prepare_hopper(q)
    with pytest.raises(ValueError, match="needs K a multiple of 64, got K=96"):
        Mxfp4Tensor(None, None, h)
    with pytest.raises(ValueError, match="^blocks and scales must both be"):
        Mxfp4Tensor(None, q.scales, h)
    with pytest.raises(TypeError, match="must hold its prepared form"):
        Mxfp4Tensor(None, None)


@pytest.mark.parametrize("major, warns", [(9, True), (8, False), (10, False)])
def test_unprepared_weights_warn_only_where_the_prepared_kernel_is_tuned(monkeypatch, major, warns):
    """`warn_unprepared` (called by the layout GEMM for an `Mxfp4Tensor` without `prepare_for()`)
    warns on compute capability 9.x with the exported warning class, once per device whatever the
    warning filters, and stays quiet elsewhere."""
    import warnings

    import padded_moe
    from padded_moe import _platform, mxfp4
    from padded_moe.mxfp4 import Mxfp4NotPreparedWarning, warn_unprepared

    assert padded_moe.Mxfp4NotPreparedWarning is Mxfp4NotPreparedWarning
    monkeypatch.setattr(_platform, "capability", lambda index: (major, 0))
    monkeypatch.setattr(mxfp4, "_WARNED_UNPREPARED", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # not the filter that keeps it to one: the module does
        for _ in range(3):
            warn_unprepared(torch.device("cuda", 0))
        warn_unprepared(torch.device("cuda", 1))  # another device warns once more
    hits = [w for w in seen if issubclass(w.category, Mxfp4NotPreparedWarning)]
    assert len(hits) == (2 if warns else 0)
    if warns:
        assert "prepare_for()" in str(hits[0].message)
