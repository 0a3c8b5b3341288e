"""Compatibility home of the module-injection API; the engine lives in passes/rewrite.py."""

from ..rewrite import Builder, Injection, NoMatchError, describe_candidates, inject_modules, set_module, swap_module

__all__ = ["Builder", "Injection", "NoMatchError", "describe_candidates", "inject_modules", "set_module",
           "swap_module"]
