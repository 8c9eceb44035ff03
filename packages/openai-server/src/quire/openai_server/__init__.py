"""Quire's OpenAI-compatible HTTP server: ``python -m quire.openai_server`` or ``build_app(engine, settings)``
over any ``quire.core.EngineClient``."""

__version__ = "0.1.0"
