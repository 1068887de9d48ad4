"""Shared benchmark plumbing: timing, the two ceilings, and the report files.

Every benchmark measures its ceilings in the same run (device copy bandwidth, dense bf16 matmul
rate) so ratios are against this card as it is now, prints a table, and writes
`<out>/<name>.md`, `<out>/<name>.json` and `<out>/<name>.png`.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Callable, Optional, Sequence

import torch


def bench_us(fn: Callable[[], object], *, warmup_ms: int = 50, rep_ms: int = 200) -> float:
    """Median time of `fn` in microseconds (CUDA events through triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def captured(fn: Callable[[], object]) -> tuple:
    """(a CUDA graph holding `fn`, what the captured call returned), warmed up on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def random_layer(preset: str, weight_format: Optional[str] = None, **kwargs):
    """`FusedMoE.from_preset(preset)` in bf16 on the GPU with the benchmarks' random weights
    (`randomize(seed=0, std=0.02)`: every benchmark times the same layer), its expert weights in
    the form the kernels read (MXFP4: quantized and prepared) made here, outside any timing.
    `weight_format` None: the preset's own; `kwargs` go to `from_preset`."""
    from padded_moe.layer import FusedMoE  # after the caller has set up its import path

    layer = FusedMoE.from_preset(preset, weight_format=weight_format, device="cuda", dtype=torch.bfloat16, **kwargs)
    layer.randomize(seed=0, std=0.02)
    layer.expert_weights()
    return layer


def bench_graph_us(fn: Callable[[], object], *, replays: int = 20) -> float:
    """Median time of one replay of a CUDA graph holding `fn` (launch gaps removed)."""
    return bench_us(captured(fn)[0].replay)


def copy_bandwidth_gbs(num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy rate counting bytes read plus written (the memory ceiling)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = bench_us(lambda: dst.copy_(src))
    return 2 * num_bytes / (t * 1e-6) / 1e9


def matmul_tflops(n: int = 8192) -> float:
    """Dense bf16 matmul rate on random data (the compute ceiling)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = bench_us(lambda: a @ b)
    return 2 * n**3 / (t * 1e-6) / 1e12


def device_line() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    import triton

    return (f"{name}, torch {torch.__version__}, triton {triton.__version__}, "
            f"{datetime.date.today().isoformat()}")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for h in headers:
        table.add_column(h)
    for row in rows:
        table.add_row(*[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row])
    Console(width=200).print(table)


def write_json(path: str, obj: object) -> None:
    """`obj` as indented JSON at `path` (its folder created), and a line saying so."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    print("wrote", path)


def write_report(out_dir: str, name: str, title: str, notes: str, headers: Sequence[str],
                 rows: Sequence[Sequence[object]], extra: dict | None = None) -> None:
    os.makedirs(out_dir, exist_ok=True)
    md = f"## {title}\n\nDevice: {device_line()}\n\n{notes}\n\n{markdown_table(headers, rows)}\n\n![{name}]({name}.png)\n"
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"device": device_line(), "headers": list(headers), "rows": [list(r) for r in rows],
                   **(extra or {})}, f, indent=1, default=str)


def bar_plot(out_dir: str, name: str, title: str, labels: Sequence[str], series: dict, ylabel: str) -> None:
    """Grouped bars: one group per label, one bar per series entry (name -> values)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    x = np.arange(len(labels))
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.9), 4.5))
    for i, (sname, values) in enumerate(series.items()):
        ax.bar(x + i * width, values, width, label=sname)
    ax.set_xticks(x + width * (len(series) - 1) / 2)
    ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=110)
    plt.close(fig)
