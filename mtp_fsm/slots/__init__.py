"""The slot table (device truth) and its deterministic allocator."""

from .allocator import SlotAllocator
from .table import ERR_IDENTITY, ERR_ILLEGAL, ERR_SPAN, SlotTable

__all__ = ["SlotAllocator", "SlotTable", "ERR_IDENTITY", "ERR_ILLEGAL", "ERR_SPAN"]
