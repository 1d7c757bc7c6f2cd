"""The slot table (device truth) and its deterministic allocator."""

from .allocator import SlotAllocator
from .table import ERR_IDENTITY, ERR_ILLEGAL, ERR_SPAN, WORD_ERROR, WORD_FAULT, WORD_REASON, WORD_STATE, SlotTable

__all__ = ["SlotAllocator", "SlotTable", "ERR_IDENTITY", "ERR_ILLEGAL", "ERR_SPAN", "WORD_STATE", "WORD_REASON", "WORD_ERROR", "WORD_FAULT"]
