"""The per-slot KV cache every attention talker adapter keeps (bind / reset / read), shared by the adapters."""

from __future__ import annotations

import torch

from mtp_fsm.model_api import KVCacheLayout


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

    def bind_slots(self, max_slots: int, device: torch.device,
                   columns: dict[str, torch.Tensor] | None = None) -> None:
        device = torch.device(device)
        if device != self.device:
            raise ValueError(f"model lives on {self.device}, slots requested on {device}")
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
