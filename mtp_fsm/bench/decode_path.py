"""How much code one steady decode step runs through: the files and lines a reader must follow."""

from __future__ import annotations

import os
import sys
from collections import Counter

from ..engine import LockstepEngine
from .drivers import make_requests
from .null_model import NullInputs, NullTalker, lifecycle_config
from .timing import PROMPT_LEN

# What counts: the library's own code (the engine side), not the bench's NullTalker or its drivers.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_EXCLUDED = (os.path.join(_PACKAGE, "bench") + os.sep,)


def decode_path(batch: int = 4, warm_steps: int = 3) -> dict:
    """Python calls into mtp_fsm during one `engine.step()` of a steady decode batch (the
    built-in policy plans it; torch kernels on the CPU), by file: call counts, the file's
    length, and the totals. A sys.setprofile hook sees Python frames only (aten ops are not
    files to read)."""
    engine = LockstepEngine(NullTalker(lifecycle_config(max_context=64)), batch, kernels="torch")
    for request in make_requests(batch, NullInputs(PROMPT_LEN)):
        engine.add_request(request.to_new())
    for _ in range(warm_steps):  # admission, prefill, then decode rows held as loaded
        engine.step()
    calls: Counter = Counter()

    def profile(frame, event, arg) -> None:
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(_PACKAGE) and not path.startswith(_EXCLUDED):
                calls[path] += 1

    sys.setprofile(profile)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    files = {}
    for path in sorted(calls):
        with open(path) as f:
            files[os.path.relpath(path, os.path.dirname(_PACKAGE))] = {"lines": sum(1 for _ in f), "calls": calls[path]}
    return {"batch": batch, "files": files, "num_files": len(files), "lines": sum(f["lines"] for f in files.values())}
