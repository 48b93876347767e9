"""Strata: a memory-frugal LLM inference engine and server."""

__version__ = "0.1.0"
