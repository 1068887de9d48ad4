"""The MXFP4 upcasts' inline PTX on the CPU: `_four_plane_ptx_asm` (kernels/gemm.py; the GEMM's
`_upcast_pairs` on prepared 4-plane words and the decode kernels) and `_e2m1_ptx_asm` (bytes of two
nibbles: the 2-plane GEMM and the decode kernels on canonical words). Their text is run through a
model of the few PTX instructions they use, and each output is compared bit for bit with the e2m1
value times its scale: the 4-plane one word by word on weights arranged by `prepare_hopper`, against
`dequantize_mxfp4`; both with folded and E8M0 scales, signed zeros, the extreme scales and NaN. The
GPU tests check the kernels' results; this checks the bit placement and the scale handling of the
PTX text where no GPU runs."""

from __future__ import annotations

import re
import struct

import pytest
import torch

from padded_moe.mxfp4 import FOLD_MAX_SCALE, GROUP, Mxfp4Tensor, dequantize_mxfp4, e2m1_lut, prepare_hopper
from test_native_mx_upcast import prmt

pytest.importorskip("triton")
from padded_moe.kernels.gemm import _e2m1_ptx_asm, _four_plane_ptx_asm  # noqa: E402

MASK = 0xFFFFFFFF


def bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def bf16_bits(value: float) -> int:
    """`value` rounded to bf16 (to nearest even, subnormals kept, as mul.rn.bf16x2 does)."""
    return int(torch.tensor([value], dtype=torch.float64).to(torch.bfloat16).view(torch.int16)) & 0xFFFF


def mul_bf16x2(a: int, b: int) -> int:
    # Each product of two bf16 values is exact in float64, so one rounding gives the PTX result.
    halves = [bf16_bits(bf16_value(a >> s) * bf16_value(b >> s)) for s in (0, 16)]
    return halves[0] | (halves[1] << 16)


def operand(token: str, regs: dict) -> int:
    token = token.strip()
    if token.startswith("{"):  # a pair of 16-bit registers packed into 32 bits, low first
        lo, hi = (operand(t, regs) & 0xFFFF for t in token.strip("{}").split(","))
        return lo | (hi << 16)
    if token in regs:
        return regs[token]
    return int(token, 0) & MASK


def run_ptx(text: str, inputs: dict) -> dict:
    """Execute the PTX body `text` with `$n` operands from `inputs`; the registers afterwards."""
    regs = {f"${n}": v for n, v in inputs.items()}
    ops = {
        "mov.b32": lambda a: a,
        "and.b32": lambda a, b: a & b,
        "or.b32": lambda a, b: a | b,
        "shl.b32": lambda a, n: (a << n) & MASK,
        "shr.b32": lambda a, n: a >> n,  # .b32: a logical shift
        "prmt.b32": prmt,
        "mul.rn.bf16x2": mul_bf16x2,
    }
    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}", "") or line.startswith(".reg"):
            continue
        m = re.match(r"(\S+)\s+(\$?\w+),\s*(.*)", line)
        if m is None or m.group(1) not in ops:
            raise AssertionError(f"the model does not know this PTX line: {line!r}")
        args = [operand(t, regs) for t in re.findall(r"\{[^}]*\}|[^,]+", m.group(3))]
        regs[m.group(2)] = ops[m.group(1)](*args) & MASK
    return regs


def random_weight(seed: int, rows: int, k: int, scale_range: tuple, extremes: tuple) -> Mxfp4Tensor:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (1, rows, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(scale_range[0], scale_range[1] + 1, (1, rows, k // GROUP), generator=g,
                           dtype=torch.int32).to(torch.uint8)
    flat = scales.view(-1)
    flat[: len(extremes)] = torch.tensor(extremes, dtype=torch.uint8)
    blocks[0, 0, :GROUP // 2] = 0x88  # -0 in both nibbles: signed zeros through every plane
    return Mxfp4Tensor(blocks, scales)


def upcast_factor(scale_entry: int, folded: bool) -> int:
    """The 16-bit factor bits `_upcast_pairs` hands the PTX: folded scales as stored (bf16 2^(s-1)),
    else `_scale_bf16`'s 2^(s-127) (s = 0: the bf16 subnormal 2^-127; 255: NaN)."""
    if folded:
        return scale_entry & 0xFFFF
    s = scale_entry & 0xFF
    return 0x40 if s == 0 else 0x7FC0 if s == 255 else s << 7


@pytest.mark.parametrize("folded", [True, False])
def test_four_plane_ptx_matches_dequantize(folded):
    rows, k = 4, 128
    if folded:  # every scale a folded form can hold, its two ends included
        q = random_weight(1, rows, k, (0, FOLD_MAX_SCALE), (0, 1, 127, FOLD_MAX_SCALE))
    else:
        q = random_weight(2, rows, k, (0, 254), (0, 1, 127, 254, 255))
    h = prepare_hopper(q, fold=folded, planes=4)
    assert h.folded == folded
    ref = dequantize_mxfp4(q, torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF  # [1, rows, k]
    text = _four_plane_ptx_asm(folded)
    words = h.blocks[0].to(torch.int64) & MASK  # [rows, k/8]
    for r in range(rows):
        for w in range(k // 8):
            g, c = divmod(w, 4)
            factor = upcast_factor(int(h.scales[0, g, r]), folded)
            regs = run_ptx(text, {4: int(words[r, w]), 5: factor})
            for p in range(4):
                for half in (0, 1):
                    got = (regs[f"${p}"] >> (16 * half)) & 0xFFFF
                    want = int(ref[0, r, GROUP * g + 8 * p + 2 * c + half])
                    if (want & 0x7FFF) > 0x7F80:  # NaN: any NaN bits
                        assert (got & 0x7FFF) > 0x7F80, (r, w, p, half, hex(got))
                    else:
                        assert got == want, (r, w, p, half, hex(got), hex(want))


@pytest.mark.parametrize("folded", [True, False])
def test_two_plane_ptx_matches_the_codes(folded):
    """`_e2m1_ptx_asm`: four bytes ($4) -> the low nibbles' values times the scales $5 / $6 (a bf16
    pair each: bytes 0-1, 2-3) into $0 / $1, the high nibbles' times $7 / $8 into $2 / $3."""
    lut = e2m1_lut(dtype=torch.float64).tolist()
    text = _e2m1_ptx_asm(folded)
    g = torch.Generator().manual_seed(3)
    scales = [0, 1, 127, FOLD_MAX_SCALE] if folded else [0, 1, 127, 254, 255]
    for trial in range(600):
        data = torch.randint(0, 256, (4,), generator=g).tolist()
        if trial < 16:  # every code in both nibbles, -0 among them
            data = [trial * 0x11] * 4
        s = [scales[(trial + i) % len(scales)] if trial < 64 else
             int(torch.randint(0, (FOLD_MAX_SCALE if folded else 255) + 1, (1,), generator=g)) for i in range(8)]
        factors = [((v + 126) << 7) & 0xFFFF if folded else upcast_factor(v, False) for v in s]
        word = sum(b << (8 * i) for i, b in enumerate(data))
        pairs = [factors[0] | factors[1] << 16, factors[2] | factors[3] << 16,
                 factors[4] | factors[5] << 16, factors[6] | factors[7] << 16]
        regs = run_ptx(text, {4: word, 5: pairs[0], 6: pairs[1], 7: pairs[2], 8: pairs[3]})
        for out in range(4):
            for half in (0, 1):
                byte = data[2 * (out % 2) + half]
                code = byte & 0xF if out < 2 else byte >> 4
                scale = s[4 * (out // 2) + 2 * (out % 2) + half]
                got = (regs[f"${out}"] >> (16 * half)) & 0xFFFF
                if not folded and scale == 255:
                    assert (got & 0x7FFF) > 0x7F80, (trial, out, half, hex(got))
                    continue
                value = (-1.0 if code & 8 else 1.0) * lut[code & 7] * 2.0 ** (scale - 127)
                want = bf16_bits(value) if value != 0 else (0x8000 if code & 8 else 0)
                assert got == want, (trial, out, half, hex(got), hex(want))


def test_the_model_runs_every_line_it_is_given():
    regs = run_ptx("{\n.reg .b32 u;\nmov.b32 u, {$4, $5};\nprmt.b32 $0, u, 0, 0x1010;\n}", {4: 0x1234, 5: 0xABCD})
    assert regs["u"] == 0xABCD1234 and regs["$0"] == 0x12341234
    with pytest.raises(AssertionError, match="does not know"):
        run_ptx("cvt.rn.bf16x2.f32 $0, $1, $2;", {1: 0, 2: 0})
    assert mul_bf16x2(0x3F804000, 0x40003F00) == 0x40003F80  # low halves 2 * 0.5, high halves 1 * 2
