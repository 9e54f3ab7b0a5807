"""What the tests of test_hub_envs.py share (tests/*/test_hub_envs.py: the tiers, and other test modules)."""

from types import SimpleNamespace


def row(seed):
    return SimpleNamespace(extra_info={"seed": seed}, uid=0)
