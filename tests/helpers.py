"""Helpers shared by tests (import as `from helpers import ...`; tests/ is on sys.path)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Tolerances for ‖out − ref‖ / ‖ref‖ against a float64 reference, by compute dtype.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

SENTINEL = -12345.0

# Expert-parallel transports the multi-GPU tests run on (one process per GPU).
GPU_TRANSPORTS = ["nccl", "symm_mem"]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN or Inf anywhere in `out` is an infinite error."""
    out64, ref64 = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def devices():
    """CPU always; CUDA when present."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def extreme_mxfp4_weight(gen, K=96, finite=True, device="cpu", max_scale=254):
    """Rows at scale exponents 0..3 (float32/bf16 subnormal products), around 127, and up to
    `max_scale` (at most 254), each with every code that stays finite at its scale (finite=True),
    or rows at 254/255 holding codes that overflow to inf and NaN scales (finite=False).
    max_scale=128 gives weights whose prepared scales fold (`HopperMxfp4.folded`)."""
    lut = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    scales = ([s for s in (0, 1, 2, 3, 100, 126, 127, 128, 200, 252, 253, 254) if s <= max_scale] if finite
              else [254, 255, 254, 127])
    rows_codes, rows_scales = [], []
    for i, s in enumerate(scales):
        ok = [c for c in range(16) if lut[c & 7] * 2.0 ** (s - 127) < 2.0**128] if finite else list(range(16))
        if not finite and i == 3:
            ok = [5]  # a finite row next to the non-finite ones
        codes = torch.tensor(ok)[torch.randint(len(ok), (K,), generator=gen)]
        rows_codes.append(codes)
        rows_scales.append(torch.full((K // 32,), s))
    codes = torch.stack(rows_codes).to(torch.uint8)
    blocks = (codes[:, 0::2] | (codes[:, 1::2] << 4)).unsqueeze(0)
    from padded_moe.mxfp4 import Mxfp4Tensor

    scales = torch.stack(rows_scales).to(torch.uint8).unsqueeze(0)
    return Mxfp4Tensor(blocks.contiguous(), scales).to(device)


# fp8 wire oracle, written here (not taken from the library): see spec 04's per-128-channel scaling.
def fp8_reference(x):
    """Written here, not taken from the library: per-block amax / 448 scales (blocks of 128 channels,
    or the whole row when K is not a multiple of 128) and the values divided by them, rounded to
    e4m3 by torch; (uint8 bytes [n, K], float32 scales [n, blocks])."""
    n, K = x.shape
    g = 128 if K % 128 == 0 else K
    blocks = x.float().view(n, K // g, g)
    scales = blocks.abs().amax(-1).clamp(min=1e-12) / 448.0
    q = (blocks / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).view(n, K).view(torch.uint8)
    return q, scales


def fp8_dequant_reference(q, scales, dtype):
    n, K = q.shape
    vals = q.view(torch.float8_e4m3fn).float().view(n, scales.shape[1], K // scales.shape[1]) * scales.unsqueeze(-1)
    return vals.view(n, K).to(dtype)


# For `compile_for_sm90` scripts (prepend it): `ptxas_log(ptx)`, the output of Triton's bundled
# ptxas -v assembling `ptx` for sm_90a (registers, spills, advisories such as C7515).
PTXAS_LOG = r"""
def ptxas_log(ptx):
    import subprocess, tempfile
    from pathlib import Path
    import triton
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as d:
        Path(d, "k.ptx").write_text(ptx)
        r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(Path(d, "k.ptx")), "-o", str(Path(d, "k.cubin"))],
                           capture_output=True, text=True)
    return r.stdout + r.stderr
"""


def launch_stats_script(module: str, kernel: str) -> str:
    """A `compile_for_sm90` script (PTXAS_LOG prepended) that compiles `module.kernel` for each
    `[signature, constexprs, ints divisible by 16, num_warps]` of its argument (`launch_signature`
    plus the warps) and prints, per case, ptxas's spill stores and registers, the PTX's 64-bit
    compares and its global loads of 128 bits (`loads128`) and of one 16-bit element (`loads16`)."""
    return PTXAS_LOG + rf"""
import json, os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from {module} import {kernel} as fn

out = []
for sig, const, div16, warps in json.loads(sys.argv[1]):
    names = fn.arg_names
    attrs = {{(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n in div16}}
    src = ASTSource(fn=fn, signature=sig, constexprs={{(names.index(k),): v for k, v in const.items()}}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    log = ptxas_log(k.asm["ptx"])
    out.append(dict(spills=sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log)),
                    regs=int(re.search(r"Used (\d+) registers", log).group(1)),
                    compares64=len(re.findall(r"setp\.\w+\.[su]64", k.asm["ptx"])),
                    loads128=len(re.findall(r"ld\.global[\w.]*\.v4\.b32", k.asm["ptx"])),
                    loads16=len(re.findall(r"ld\.global[\w.]*\.b16\b", k.asm["ptx"]))))
print(json.dumps(out))
"""


def require_interpreted_kernels(monkeypatch) -> None:
    """Skip unless Triton kernels run interpreted here (a launch captured from an interpreted call
    is what the sm_90 compile checks specialise), and switch this test to the interpreter."""
    pytest.importorskip("triton")
    from padded_moe._platform import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("captures the launch from an interpreted call")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def captured_launches(monkeypatch, call) -> list:
    """`call()` with `padded_moe.kernels._launch.launch` recording each launch (still launched):
    a list of `(kernel, args, constexprs, options)`."""
    from padded_moe.kernels import _launch

    seen, real = [], _launch.launch

    def spy(fn, grid, key, args, constexprs, **opt):
        seen.append((fn, args, constexprs, opt))
        return real(fn, grid, key, args, constexprs, **opt)

    monkeypatch.setattr(_launch, "launch", spy)
    call()
    monkeypatch.setattr(_launch, "launch", real)
    return seen


def launch_signature(fn, args, constexprs) -> tuple[dict, dict, list]:
    """(signature, constexprs, ints divisible by 16) of a launch of Triton kernel `fn` with `args`,
    specialised as Triton's launcher would (ints equal to 1 and None made constants, ints past
    int32 i64; TMA descriptors as `tensordesc<dtype[block]>`)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    dtypes = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
              torch.int64: "i64", torch.uint8: "u8"}
    sig, const, div16 = {}, {c: getattr(v, "value", v) for c, v in constexprs.items()}, []
    for name, a in zip(fn.arg_names, args):
        if isinstance(a, TensorDescriptor):
            sig[name] = f"tensordesc<{dtypes[a.base.dtype]}[{', '.join(str(b) for b in a.block_shape)}]>"
        elif isinstance(a, torch.Tensor):
            sig[name] = "*" + dtypes[a.dtype]
        elif isinstance(a, float):
            sig[name] = "fp32"
        elif a is None:
            sig[name], const[name] = "constexpr", None
        elif a == 1:
            sig[name], const[name] = "constexpr", 1
        else:
            sig[name] = "i32" if -2 ** 31 <= a < 2 ** 31 else "i64"
            if a % 16 == 0:
                div16.append(name)
    sig.update({c: "constexpr" for c in constexprs})
    return sig, const, div16


def compile_for_sm90(script: str, arg: str) -> list:
    """Run `script` (which compiles kernels with `triton.compile` for sm_90 and prints a JSON list
    as its last line) in a subprocess with the kernels compiled, not interpreted; the list. Skips
    where Triton or its bundled ptxas is missing (no GPU needed)."""
    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's bundled ptxas is not installed")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    print("\n".join(str(r) for r in results))
    return results
