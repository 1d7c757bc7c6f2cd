"""Rewrites the generated block between two marker lines of a text file (README.md)."""

from __future__ import annotations

import os


class MarkedBlockError(ValueError):
    """The file lacks the begin/end markers (or has them out of order)."""


def replace_marked_block(path: str | os.PathLike, begin: str, end: str, content: str) -> bool:
    """Replace what lies between the first `begin` marker and the next `end` marker of the
    file at `path` with `content` (markers kept, one newline either side of `content`).
    Writes only when the text changes; returns whether it did."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = text.find(begin)
    stop = text.find(end, start + len(begin)) if start >= 0 else -1
    if start < 0 or stop < 0:
        missing = "begin marker" if start < 0 else "end marker after the begin marker"
        raise MarkedBlockError(f"{os.fspath(path)}: no {missing} ({begin!r} ... {end!r}); add both lines to mark the block")
    new = text[: start + len(begin)] + "\n" + content.strip("\n") + "\n" + text[stop:]
    if new == text:
        return False
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)
    return True
