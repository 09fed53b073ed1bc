"""statlib: tiny descriptive statistics helpers (Sandman SWE-style demo task)."""

from .stats import mean, median

__all__ = ["mean", "median"]
