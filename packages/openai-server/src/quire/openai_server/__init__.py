"""Quire's OpenAI-compatible HTTP server (the routes arrive with the server issue)."""

__version__ = "0.1.0"
