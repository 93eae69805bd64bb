"""The release this tree is: one definition, read by the package and by its tracer."""

__version__ = "0.1.0"
