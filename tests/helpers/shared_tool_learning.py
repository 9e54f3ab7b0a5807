"""What the tests of test_tool_learning.py share (tests/*/test_tool_learning.py: the tiers, and other test modules)."""

import sys
from pathlib import Path

import pytest

from common.core.data import write_rows

REPO = Path(__file__).resolve().parents[2]  # (not conftest's: a launched child imports this module too)

sys.path.insert(0, str(REPO / "algos"))


# ------------------------------------------------------------------ demonstrations (tools.gen_demos)
@pytest.fixture(scope="module")
def tool_prompts(tmp_path_factory):
    """8 train rows of products_3d and 8 of gcd_3d, as prepare_data writes them."""
    from common.core.tasks import split_task_rows

    d = tmp_path_factory.mktemp("tool_tasks")
    files = []
    for task in ("products_3d", "gcd_3d"):
        train, _ = split_task_rows(task, 8, 1, seed=0)
        write_rows(train, d / f"{task}.parquet")
        files.append(str(d / f"{task}.parquet"))
    return files


def _gen_demos(**kw):
    import tools.gen_demos as G

    return G.main(G.Args(**kw))
