"""Side-by-side benchmarks: a no-lifecycle floor, the lockstep engine, naive per-request designs; counts, e2e."""

from .null_model import NullConfig, NullInputs, NullTalker, lifecycle_config, qwen3_tts_sizes
from .report import markdown_report, markdown_table, plot_step_time
from .run import main

__all__ = [
    "NullConfig", "NullInputs", "NullTalker", "lifecycle_config", "qwen3_tts_sizes",
    "markdown_report", "markdown_table", "plot_step_time", "main",
]
