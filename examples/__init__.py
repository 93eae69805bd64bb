"""Runnable examples of embedding reservoir (importable from the repository root)."""
