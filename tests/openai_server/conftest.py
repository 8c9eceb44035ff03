"""Fixtures for the server tests (the demo server itself is a session fixture in tests/conftest.py)."""

import pytest


@pytest.fixture
def openai_client(demo_server):
    from openai import OpenAI

    return OpenAI(base_url=demo_server.url("/v1"), api_key="unused", max_retries=0, timeout=60)
