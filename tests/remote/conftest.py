"""One real `lingls serve` (embedded ling-nano, CPU) shared by the tests that do not kill it."""

from __future__ import annotations

import pytest

from .harness import Serve


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    serve = Serve(tmp_path_factory.mktemp("serve") / "serve.log").start()
    yield serve
    serve.stop()


@pytest.fixture
def own_server(tmp_path):
    """A server this test may kill and restart (same port)."""
    serve = Serve(tmp_path / "serve.log").start()
    yield serve
    serve.stop()
