"""Fixtures of the server tests: a tiny served engine for the module and the real `openai` SDK client of it."""

from __future__ import annotations

import pytest

from helpers_server import TIMEOUT, served_engine


@pytest.fixture(scope="module")
def served():
    """(engine, server): a tiny served engine for the module."""
    with served_engine() as (engine, server):
        yield engine, server


@pytest.fixture(scope="module")
def client(served):
    """The real `openai` SDK client of `served`."""
    import openai

    _, server = served
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        yield c
