"""lingls: inline code completion from a resident batch-1 Ling-3.0 runtime."""

__version__ = "0.1.0"
