"""What the tests of test_sandbox_service.py share (tests/*/test_sandbox_service.py: the tiers, and other test modules)."""

import pytest

from sandbox_fusion_server import FusionServer


@pytest.fixture
def fusion():
    server = FusionServer()
    yield server
    server.close()
