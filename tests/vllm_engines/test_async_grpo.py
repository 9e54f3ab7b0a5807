"""algos/async_grpo.py: the weight mailbox's ordering, the batches a checkpoint keeps, K = 0 equals grpo_llm.py,
K = 1 samples one update behind, resumes exactly with every prompt consumed once, learns the toy task, and a
generator that dies or hangs ends the run in one line with a checkpoint."""

import pytest

from conftest import only_run, read_metrics, run_script
from shared_async_grpo import _flags


@pytest.mark.vllm
def test_vllm_engine_in_the_generator_process(tmp_path_factory, toy_prompts, tmp_path):
    """--rollout-engine vllm: the generator process holds the engine and its copy of the policy; the engine gets
    each pushed version (on the staleness-0 first step, pi_old vs the sampler is the engine's own small gap; after
    that the gap is the staleness, which the --tis-cap weights correct)."""
    pytest.importorskip("vllm")
    from common.core import models as M

    model = M.tiny_model(tmp_path_factory.mktemp("peaky_vllm_async"), heads=1, init_std=0.2)
    run_script("async_grpo.py", *_flags(model, toy_prompts, tmp_path, "--total-steps", 4, "--rollout-engine", "vllm"),
               env={"TOY_MODEL": model})  # fmt: skip
    rows = read_metrics(only_run(tmp_path))
    assert [r["async/staleness"] for r in rows] == [0, 1, 1, 1]
    assert rows[0]["train/sampler_logprob_diff"] < 1e-3 < max(r["train/sampler_logprob_diff"] for r in rows[1:])
