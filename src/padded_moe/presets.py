"""Model shapes used by the CLI, the planner, tests and benchmarks: the preset table `PRESETS`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict


@dataclass(frozen=True)
class MoEPreset:
    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str
    activation_config: Dict[str, Any] = field(default_factory=dict)
    routing: str = "softmax"
    routing_config: Dict[str, Any] = field(default_factory=dict)
    weight_format: str = "bf16"
    has_bias: bool = False

    @property
    def gated(self) -> bool:
        return not self.activation.endswith("_no_mul")

    @property
    def w13_rows(self) -> int:
        return 2 * self.intermediate_size if self.gated else self.intermediate_size


PRESETS: Dict[str, MoEPreset] = {
    p.name: p
    for p in (
        MoEPreset("dsv4-flash", 256, 6, 4096, 2048, "silu", {"clamp_limit": 10.0},
                  routing="biased_sqrtsoftplus", routing_config={"routed_scaling_factor": 1.5},
                  weight_format="mxfp4"),
        MoEPreset("kimi-k3-like", 384, 8, 3584, 3072, "situ",
                  {"situ_beta": 4.0, "situ_linear_beta": 25.0},
                  routing="biased_sigmoid", routing_config={"routed_scaling_factor": 2.5}),
        MoEPreset("gpt-oss-120b", 128, 4, 2880, 2880, "swigluoai", {},
                  routing="topk_softmax", weight_format="mxfp4", has_bias=True),
        MoEPreset("qwen3-30b-a3b", 128, 8, 2048, 768, "silu", {},
                  routing="softmax_renorm"),
        MoEPreset("mixtral-8x7b", 8, 2, 4096, 14336, "silu", {}, routing="softmax_renorm"),
        MoEPreset("tiny", 8, 2, 64, 32, "silu", {}, routing="softmax"),
    )
}


def get_preset(name: str) -> MoEPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}") from None
