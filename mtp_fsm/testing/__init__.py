"""Test support shipped with the package: scripted models, reference drivers, stateful suite."""

from .scripted import ScriptedTalker, ScriptInputs

__all__ = ["ScriptedTalker", "ScriptInputs"]
