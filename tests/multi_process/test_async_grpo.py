"""algos/async_grpo.py: the weight mailbox's ordering, the batches a checkpoint keeps, K = 0 equals grpo_llm.py,
K = 1 samples one update behind, resumes exactly with every prompt consumed once, learns the toy task, and a
generator that dies or hangs ends the run in one line with a checkpoint."""

import json
import shutil

import pytest

from conftest import only_run, read_metrics
from shared_async_grpo import _flags, _strip


@pytest.mark.distributed
def test_ddp_trainer_with_a_generator_per_process_resumes_exactly(tiny_peaky, toy_prompts, tmp_path):
    """2 DDP processes, each with its generator (K = 1): 4 steps straight = stopped at the step-2 checkpoint (each
    rank's batch of step 3 in it, gathered) and resumed; both ranks' prompts are disjoint and each drawn once. Then
    FSDP2 is refused in one line."""
    from shared_distributed import assert_ran, launch

    env = {"TOY_MODEL": tiny_peaky}
    flags = lambda out: _flags(tiny_peaky, toy_prompts, out, "--total-steps", 4, "--num-prompts", 4)  # noqa: E731
    launch("async_grpo.py", *flags(tmp_path / "a"), "--save-every", 2, env=env)
    straight = only_run(tmp_path / "a")
    assert_ran(straight, "DDP")
    copy = tmp_path / "b" / straight.name
    shutil.copytree(straight, copy)
    launch(
        "async_grpo.py",
        *flags(tmp_path / "b"),
        "--resume",
        copy / "checkpoints" / "step_2",
        "--weight-sync",
        "broadcast",
        env=env,
    )  # each rank and its generator: a gloo group of their own
    a, b = read_metrics(straight), read_metrics(copy)
    assert _strip(a) == _strip(b) and [r["async/staleness"] for r in a] == [0, 1, 1, 1]
    ids = [i for x in (copy / "batches.jsonl").read_text().splitlines() for i in json.loads(x)["prompt_ids"]]
    assert len(ids) == 16 == len(set(ids))  # 4 steps x 4 prompts (2 per rank), none twice
    with pytest.raises(AssertionError, match="async_grpo.py runs one process or DDP"):
        launch("async_grpo.py", *flags(tmp_path / "c"), env=env, config="cpu_2proc_fsdp2")
