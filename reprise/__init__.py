"""Reprise: speculative decoding for AI agents."""

__version__ = "0.1.0"
