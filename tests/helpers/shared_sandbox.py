"""What the tests of test_sandbox.py share (tests/*/test_sandbox.py: the tiers, and other test modules)."""


def _accept(server):
    try:
        return server.accept()
    except OSError:
        return None
