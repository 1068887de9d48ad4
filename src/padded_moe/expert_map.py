"""Expert map and the invalid-expert-ID guard.

A routed slot holding global id `g` is invalid (`g < 0` or `g >= E`), non-local (`map[g] == -1`)
or local. Invalid and non-local slots become the sentinel `L` ("dropped"). The range check always
happens before the map is read and before int64 ids are narrowed, so stale garbage in a graph
buffer (`2^31-1`, `2^32+1`, `-2^31`) can never index out of bounds or wrap into range.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from padded_moe._validation import INDEX_DTYPES, require_dtype, require_rank, require_tensor, require_int

PLACEMENTS = ("linear", "round_robin")


def _owned_experts(num_experts: int, ep_rank: int, ep_size: int, placement: str) -> list[int]:
    """Global ids owned by `ep_rank`, in local-index order."""
    if placement == "round_robin":
        return list(range(ep_rank, num_experts, ep_size))
    # linear: contiguous ranges; the first `rem` ranks take one extra expert each.
    base, rem = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, rem)
    return list(range(start, start + base + (1 if ep_rank < rem else 0)))


class ExpertMap:
    """Which global experts this expert-parallel rank owns.

    Attributes: `num_experts` (E), `ep_rank`, `ep_size`, `placement`, `num_local` (L),
    `local_experts` (int64 `[L]`, global ids owned here, on `device`), `map` (int32 `[E]`, local
    index or -1, on `device`). `map_for(device)` returns (and caches) the map on another device so
    a CPU-built map can serve CUDA ids without a copy per call.

    `ExpertMap.from_table(table)` takes any placement as the table itself (vLLM's `expert_map`
    tensor); such a map has `placement == "table"` and no rank (`ep_rank`, `ep_size` None).
    """

    def __init__(self, num_experts: int, ep_rank: int = 0, ep_size: int = 1,
                 placement: str = "linear", *, device: Union[str, torch.device, None] = None):
        self.num_experts = require_int("num_experts", num_experts, 1)
        self.ep_size = require_int("ep_size", ep_size, 1)
        self.ep_rank = require_int("ep_rank", ep_rank, 0)
        if self.ep_rank >= self.ep_size:
            raise ValueError(f"ep_rank must be in [0, ep_size={ep_size}), got {ep_rank}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        self.placement = placement
        self._own(_owned_experts(num_experts, ep_rank, ep_size, placement), device)

    def _own(self, owned: list[int], device: Union[str, torch.device, None]) -> None:
        """Set the map from `owned` (global ids in local-index order) on `device` (CPU if None)."""
        self.num_local = len(owned)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        table = torch.full((self.num_experts,), -1, dtype=torch.int32)
        if owned:
            table[torch.tensor(owned)] = torch.arange(len(owned), dtype=torch.int32)
        self.local_experts = torch.tensor(owned, dtype=torch.int64, device=dev)
        self.map = table.to(dev)
        self._maps = {dev: self.map}
        self._identity = owned == list(range(self.num_experts))

    @classmethod
    def identity(cls, num_experts: int, *, device: Union[str, torch.device, None] = None) -> "ExpertMap":
        """No expert parallelism: every expert is local, local index = global id."""
        return cls(num_experts, 0, 1, "linear", device=device)

    @classmethod
    def from_table(cls, table: torch.Tensor, *, device: Union[str, torch.device, None] = None) -> "ExpertMap":
        """A map of any placement from its table: `table [E]` (int32 or int64) holds, for global
        expert `g`, the index of its weights among this rank's `L` local experts, or -1 where `g`
        lives elsewhere — the `expert_map` tensor vLLM passes to its `fused_experts` (also for
        load-balanced placements). The local indices must be `0 .. L-1`, each exactly once.

        The table is read on the host once, here (a device table costs one synchronisation);
        calls that use the map never read it on the host. `device` defaults to the table's."""
        require_tensor("table", table)
        require_dtype("table", table, INDEX_DTYPES)
        require_rank("table", table, (1,))
        if table.numel() < 1:
            raise ValueError("table must hold one entry per global expert (E >= 1), got an empty tensor")
        values = table.tolist()
        num_experts = len(values)
        for g, v in enumerate(values):
            if v < -1 or v >= num_experts:
                raise ValueError(f"table[{g}] must be -1 (not local) or a local index in [0, E={num_experts}), got {v}")
        local = sorted(v for v in values if v != -1)
        if local != list(range(len(local))):
            shown = f"{local[:16]}{' ...' if len(local) > 16 else ''}"
            raise ValueError(f"table's local indices must be 0 .. L-1 each exactly once (L = {len(local)} local "
                             f"experts), got {shown}")
        owned = [0] * len(local)
        for g, v in enumerate(values):
            if v >= 0:
                owned[v] = g
        emap = cls.__new__(cls)
        emap.num_experts, emap.ep_rank, emap.ep_size, emap.placement = num_experts, None, None, "table"
        emap._own(owned, table.device if device is None else device)
        return emap

    @property
    def device(self) -> torch.device:
        return self.map.device

    @property
    def is_identity(self) -> bool:
        """Every expert local at its own index (the kernels then skip the map read)."""
        return self._identity

    def to(self, device: Union[str, torch.device]) -> "ExpertMap":
        """The same map with its tensors on `device`."""
        if self.placement == "table":
            return ExpertMap.from_table(self.map, device=device)
        return ExpertMap(self.num_experts, self.ep_rank, self.ep_size, self.placement, device=device)

    def map_for(self, device: torch.device) -> torch.Tensor:
        """The int32 map on `device` (copied once, then cached: call it outside graph capture first)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        cached = self._maps.get(device)
        if cached is None:
            cached = self.map.to(device)
            self._maps[device] = cached
        return cached

    def __repr__(self) -> str:
        if self.placement == "table":
            return f"ExpertMap.from_table(num_experts={self.num_experts}, num_local={self.num_local})"
        return (f"ExpertMap(num_experts={self.num_experts}, ep_rank={self.ep_rank}, "
                f"ep_size={self.ep_size}, placement={self.placement!r}, num_local={self.num_local})")


Experts = Union[ExpertMap, int]


def resolve_experts(experts: object) -> tuple[int, int, Optional[ExpertMap]]:
    """`(E, L, map-or-None)` from an ExpertMap or an int E (no EP: all E experts local).

    An identity ExpertMap is returned as None so the kernels skip the map read entirely.
    """
    if isinstance(experts, ExpertMap):
        return experts.num_experts, experts.num_local, (None if experts.is_identity else experts)
    if isinstance(experts, bool) or not isinstance(experts, int):
        raise TypeError(f"experts must be an ExpertMap or an int number of experts, got {type(experts).__name__}")
    if experts < 1:
        raise ValueError(f"experts (number of experts E) must be >= 1, got {experts}")
    return experts, experts, None


def check_topk_ids(topk_ids: object) -> torch.Tensor:
    require_tensor("topk_ids", topk_ids)
    require_dtype("topk_ids", topk_ids, INDEX_DTYPES)
    require_rank("topk_ids", topk_ids, (2,))
    if topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be [M, k] with k >= 1 experts per token, got shape {tuple(topk_ids.shape)}")
    return topk_ids


def check_valid_tokens(valid_tokens: object, ref: torch.Tensor) -> Optional[torch.Tensor]:
    """`valid_tokens` is None or an int32/int64 `[1]` tensor on `topk_ids`' device."""
    if valid_tokens is None:
        return None
    require_tensor("valid_tokens", valid_tokens)
    require_dtype("valid_tokens", valid_tokens, INDEX_DTYPES)
    if tuple(valid_tokens.shape) != (1,):
        raise ValueError(f"valid_tokens must have shape (1,), got {tuple(valid_tokens.shape)}")
    if valid_tokens.device != ref.device:
        raise ValueError(f"valid_tokens must be on topk_ids' device {ref.device}, got {valid_tokens.device}")
    return valid_tokens


def drop_rows_past(topk_ids: torch.Tensor, valid_tokens: Optional[torch.Tensor]) -> torch.Tensor:
    """`topk_ids [M, k]` with every id of a row at or past `valid_tokens` replaced by -1 (which the
    expert-id guard drops), for paths that move whole rows before any kernel sees the count
    (expert-parallel dispatch). Graph-safe: the count stays on the device."""
    if valid_tokens is None:
        return topk_ids
    return torch.where(rows_before(topk_ids, valid_tokens), topk_ids,
                       torch.full((), -1, dtype=topk_ids.dtype, device=topk_ids.device))


def rows_before(topk_ids: torch.Tensor, valid_tokens: torch.Tensor) -> torch.Tensor:
    """bool `[M, 1]`: which rows of `topk_ids [M, k]` are before the device-side count (a count
    below 0 keeps none, one above M keeps all)."""
    rows = torch.arange(topk_ids.shape[0], device=topk_ids.device)
    return (rows < valid_tokens.to(topk_ids.device))[:, None]


def guarded_lookup(topk_ids: torch.Tensor, num_experts: int, table: Optional[torch.Tensor],
                   fill: int) -> torch.Tensor:
    """The invalid-id guard of every torch path: `table[id]` where `0 <= id < num_experts`, else
    `fill` (`table` None: the id itself, int32). The comparison runs in the ids' own dtype (an
    int64 id is never narrowed into range), and out-of-range ids are replaced by 0 before they
    index anything. Graph-safe (no host sync). The kernels' twin: `kernels.guard.expert_id_ok`."""
    in_range = (topk_ids >= 0) & (topk_ids < num_experts)
    safe = torch.where(in_range, topk_ids, torch.zeros((), dtype=topk_ids.dtype, device=topk_ids.device))
    safe = safe.to(torch.int32)
    value = table[safe.long()] if table is not None else safe
    return torch.where(in_range, value, torch.full((), fill, dtype=value.dtype, device=value.device))


def sanitize_torch(topk_ids: torch.Tensor, num_experts: int, num_local: int,
                   emap: Optional[torch.Tensor], valid_tokens: Optional[torch.Tensor]) -> torch.Tensor:
    """Torch path of the guard: int32 local ids in [0, L], same shape as `topk_ids`.

    Graph-safe (no host sync); the comparison runs in the ids' own dtype, before narrowing.
    """
    local = guarded_lookup(topk_ids, num_experts, emap, -1)
    keep = local >= 0
    if valid_tokens is not None:
        keep = keep & rows_before(topk_ids, valid_tokens)
    return torch.where(keep, local, torch.full((), num_local, dtype=torch.int32, device=topk_ids.device))


def sanitize_topk_ids(topk_ids: torch.Tensor, experts: Experts, *,
                      valid_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Global routed ids → int32 local ids in `[0, L]`; `L` marks a dropped slot.

    Dropped: `id < 0`, `id >= E`, non-local under the map, or the row is at/after `valid_tokens`
    (an int32 `[1]` device tensor). `experts` is an ExpertMap or an int E (all experts local).
    No host synchronisation; CUDA-graph capturable once the map is on the ids' device.
    """
    check_topk_ids(topk_ids)
    num_experts, num_local, emap = resolve_experts(experts)
    check_valid_tokens(valid_tokens, topk_ids)
    table = emap.map_for(topk_ids.device) if emap is not None else None
    return sanitize_torch(topk_ids, num_experts, num_local, table, valid_tokens)
