"""The native grouped GEMM's e2m1 -> bf16 upcast (`mx_upcast8` in grouped_gemm.cu) on the CPU: the
function's statements are read from the source and evaluated with a model of PTX's `prmt.b32`
(default mode), for every byte value at every position of the 32-bit word, against the bf16 bits of
the e2m1 values (signed zeros included). The GPU tests check the kernel's results; this checks the
byte tables and selectors where no GPU runs."""

from __future__ import annotations

import random
import re
import struct
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "padded_moe" / "kernels" / "native" / "grouped_gemm.cu"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
ONE_PAIR = 0x3F803F80  # the bf16 pair (1.0, 1.0): a scale factor of one
MASK = 0xFFFFFFFF


def prmt(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32, default mode: result byte n is byte (selector nibble n) & 7 of {b, a} (a's
    bytes 0-3, b's 4-7), or that byte's top bit copied to all eight bits where the nibble's bit 3
    is set."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for n in range(4):
        nibble = (selector >> (4 * n)) & 0xF
        byte = src[nibble & 7]
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * n)
    return out


def mul_bf16x2(pair: int, factor: int) -> int:
    if factor != ONE_PAIR:
        raise AssertionError("the model multiplies by one only")
    return pair


def top_level_split(text: str) -> list:
    """`text` split at commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def source_function() -> tuple:
    """(the constants the upcast names, its statements as `name = expression` strings)."""
    src = SRC.read_text()
    consts = {name: int(value, 16) for name, value in re.findall(r"\b(kMx\w+) = (0x[0-9a-fA-F]+)u", src)}
    body = re.search(r"uint4 mx_upcast8\(uint32_t word, uint32_t factor\) \{(.*?)\n  return v;", src, re.S)
    if body is None:
        raise AssertionError("mx_upcast8 not found in grouped_gemm.cu")
    statements = []
    for stmt in body.group(1).split(";"):
        stmt = re.sub(r"(0x[0-9a-fA-F]+)u\b", r"\1", " ".join(stmt.split()))
        stmt = re.sub(r"^const uint32_t ", "", stmt)
        if not stmt or stmt == "uint4 v":
            continue
        statements += [s.strip().replace("v.", "v_") for s in top_level_split(stmt)]
    return consts, statements


def upcast8(word: int, consts: dict, statements: list) -> list:
    """The eight bf16 bit patterns the source computes for `word` (factor one)."""
    env = dict(consts, prmt=prmt, mul_bf16x2=mul_bf16x2, word=word, factor=ONE_PAIR)
    for stmt in statements:
        name, expr = (s.strip() for s in stmt.split("=", 1))
        env[name] = eval(expr, {"__builtins__": {}}, env) & MASK  # noqa: S307 - our own source text
    return [half for key in ("v_x", "v_y", "v_z", "v_w") for half in (env[key] & 0xFFFF, env[key] >> 16)]


def bf16_bits(value: float, negative: bool) -> int:
    bits = struct.unpack("<I", struct.pack("<f", value))[0] >> 16
    return bits | (0x8000 if negative else 0)


def expected(word: int) -> list:
    codes = [(word >> (4 * i)) & 0xF for i in range(8)]  # byte j: codes 2j (low nibble) and 2j + 1
    return [bf16_bits(E2M1[c & 7], bool(c & 8)) for c in codes]


def test_the_source_names_four_byte_tables():
    consts, statements = source_function()
    assert sorted(consts) == ["kMxHi0", "kMxHi1", "kMxLo0", "kMxLo1"]
    assert [s.split("=")[0].strip() for s in statements][-4:] == ["v_x", "v_y", "v_z", "v_w"]


@pytest.mark.parametrize("position", range(4))
def test_every_byte_at_every_position(position):
    consts, statements = source_function()
    rng = random.Random(position)
    for byte in range(256):
        word = (rng.getrandbits(32) & ~(0xFF << (8 * position)) & MASK) | (byte << (8 * position))
        assert upcast8(word, consts, statements) == expected(word), hex(word)


def test_signed_zeros_and_extremes():
    consts, statements = source_function()
    assert upcast8(0x88888888, consts, statements) == [0x8000] * 8  # code 8 is -0
    assert upcast8(0x00000000, consts, statements) == [0x0000] * 8
    assert upcast8(0xFFFFFFFF, consts, statements) == [0xC0C0] * 8  # -6
    assert upcast8(0x76543210, consts, statements) == [bf16_bits(v, False) for v in E2M1]


def test_the_prmt_model():
    assert prmt(0x33221100, 0x77665544, 0x3210) == 0x33221100
    assert prmt(0x33221100, 0x77665544, 0x7654) == 0x77665544
    # nibble 9: byte 1's top bit replicated (set, then clear); nibbles 4: b's byte 0 (zero)
    assert prmt(0x000080FF, 0, 0x4449) == 0x000000FF
    assert prmt(0x00007FFF, 0, 0x4449) == 0x00000000
