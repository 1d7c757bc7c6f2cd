"""The KV memory attention talker adapters keep (bind / reset / read): paged blocks (PagedKVCache) or per-slot rows (SlotKVCache)."""

from __future__ import annotations

import torch

from mtp_fsm.model_api import KVCacheLayout

from models.paged_kv import DEFAULT_BLOCK_SIZE, BlockPool, StepKV


class SlotKVCache:
    """Mixin for a TalkerModel adapter: one (K, V) pair per layer, each
    [max_slots + 1, max_context, kv_heads, head_dim]; the extra row is scratch that padding
    tokens write into and read from. The adapter sets `self._cache = None`, `self.device`,
    `self.dtype`, and says its layout in `_kv_layout()`."""

    _cache: list[tuple[torch.Tensor, torch.Tensor]] | None

    def _kv_layout(self) -> tuple[int, int, int, int]:
        """(layers, max_context, kv_heads, head_dim)."""
        raise NotImplementedError

    def kv_cache_layout(self) -> KVCacheLayout:
        layers, _, kv_heads, head_dim = self._kv_layout()
        return KVCacheLayout(layers, kv_heads, head_dim, self.dtype)

    def _slot_device(self, device: torch.device) -> torch.device:
        device = torch.device(device)
        if device != self.device:
            raise ValueError(f"model lives on {self.device}, slots requested on {device}")
        return device

    def bind_slots(self, max_slots: int, device: torch.device,
                   columns: dict[str, torch.Tensor] | None = None) -> None:
        device = self._slot_device(device)
        layers, max_context, kv_heads, head_dim = self._kv_layout()
        shape = (max_slots + 1, max_context, kv_heads, head_dim)
        self._cache = [
            (torch.zeros(shape, dtype=self.dtype, device=device), torch.zeros(shape, dtype=self.dtype, device=device))
            for _ in range(layers)
        ]

    @property
    def max_slots(self) -> int:
        return 0 if self._cache is None else self._cache[0][0].shape[0] - 1

    @torch.no_grad()
    def reset_slots(self, slots: torch.Tensor) -> None:
        cache = self._require_cache()
        scratch = cache[0][0].shape[0] - 1
        rows = torch.where(slots >= 0, slots, torch.full_like(slots, scratch)).long()
        for cache_k, cache_v in cache:
            cache_k.index_fill_(0, rows, 0)
            cache_v.index_fill_(0, rows, 0)

    def _require_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._cache is None:
            raise RuntimeError("bind_slots() must be called before the model runs")
        return self._cache


class PagedKV:
    """A run of layers of one BlockPool, what the adapters pass down as their "cache":
    `cache[a:b]` selects layers, `plan(positions, slots)` plans a forward, `layers()` gives the
    (K, V) pools of the selected layers (read after planning: a growing pool replaces them)."""

    def __init__(self, pool: BlockPool, layers: range):
        self.pool, self._layers = pool, layers

    def __getitem__(self, index: slice) -> "PagedKV":
        if not isinstance(index, slice):
            raise TypeError("select layers of a PagedKV with a slice")
        return PagedKV(self.pool, self._layers[index])

    def __len__(self) -> int:
        return len(self._layers)

    def plan(self, positions: torch.Tensor, token_slots: torch.Tensor) -> StepKV:
        # A captured CUDA graph cannot read the host: it replays the reserved, whole-row plan.
        if positions.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.pool.plan_static(positions, token_slots)
        return self.pool.plan(positions, token_slots)

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.pool.k[i], self.pool.v[i]) for i in self._layers]


class PagedKVCache(SlotKVCache):
    """SlotKVCache's contract with the KV in blocks (models.paged_kv.BlockPool): a slot holds
    blocks for the positions it has written, and gives them back on reset, so memory follows
    the tokens in use. `_require_cache()` returns a PagedKV over every layer.

    `configure_kv(block_size, num_blocks, reserve)` before the engine binds: a fixed pool of
    `num_blocks` (a host that budgets blocks, vLLM), or `reserve=True` (every slot's blocks at
    bind: the slot layout's memory, what the engine's own CUDA graphs need, since a replayed
    step cannot take blocks). By default a CUDA model reserves and a CPU model grows on demand.
    """

    _pool: BlockPool | None = None
    _kv_options: dict | None = None

    def configure_kv(self, *, block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int | None = None,
                     reserve: bool | None = None) -> None:
        self._kv_options = {"block_size": block_size, "num_blocks": num_blocks, "reserve": reserve}

    def bind_slots(self, max_slots: int, device: torch.device,
                   columns: dict[str, torch.Tensor] | None = None) -> None:
        device = self._slot_device(device)
        layers, max_context, kv_heads, head_dim = self._kv_layout()
        options = self._kv_options or {}
        pool = BlockPool(layers, kv_heads, head_dim, self.dtype, device, max_slots, max_context,
                         block_size=options.get("block_size", DEFAULT_BLOCK_SIZE),
                         num_blocks=options.get("num_blocks"))
        reserve = options.get("reserve")
        if reserve or (reserve is None and device.type == "cuda"):
            pool.reserve()
        self._pool = pool
        self._cache = PagedKV(pool, range(layers))  # type: ignore[assignment]

    @property
    def max_slots(self) -> int:
        return 0 if self._pool is None else self._pool.max_slots

    @property
    def kv_pool(self) -> BlockPool:
        self._require_cache()
        return self._pool  # type: ignore[return-value]

    @torch.no_grad()
    def reset_slots(self, slots: torch.Tensor) -> None:
        pool = self.kv_pool
        rows = [s for s in slots.tolist() if 0 <= s < pool.max_slots]
        if pool.reserved:
            pool.zero_slots(rows)
        else:
            pool.release(rows)

    def dense_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (K, V) as the slot layout would hold them, [max_slots + 1, max_context,
        KV, D], zeros where no block is held (checks and debugging only)."""
        pool = self.kv_pool
        return [pool.dense(i) for i in range(len(pool.k))]
