"""The slot table (device truth) and its deterministic allocator."""

from .allocator import SlotAllocator
from .table import ERR_IDENTITY, ERR_ILLEGAL, ERR_SPAN, WORD_ERROR, WORD_FAULT, WORD_REASON, WORD_STATE, SlotTable
from .table import PROGRESS_COMPUTED, PROGRESS_FRAMES, PROGRESS_MAX_FRAMES, PROGRESS_PROMPT_LEN, PROGRESS_SERIAL

__all__ = ["SlotAllocator", "SlotTable", "ERR_IDENTITY", "ERR_ILLEGAL", "ERR_SPAN", "WORD_STATE", "WORD_REASON", "WORD_ERROR", "WORD_FAULT",
           "PROGRESS_SERIAL", "PROGRESS_PROMPT_LEN", "PROGRESS_COMPUTED", "PROGRESS_FRAMES", "PROGRESS_MAX_FRAMES"]
