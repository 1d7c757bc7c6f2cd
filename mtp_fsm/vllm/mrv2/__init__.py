"""vLLM Model Runner V2 (GPU) adapter: FsmModelState + its stand-in model, and a CPU hook harness (imports vLLM lazily)."""

from .bridge import MRV2Bridge, MRV2EventError, Row, StepResult

__all__ = ["MRV2Bridge", "MRV2EventError", "Row", "StepResult"]
