"""algos/distill_llm.py: each divergence against numpy over the vocabulary, the sampled-token estimator's
expectation, the tokenizer check, and (e2e) resume identity and a learning test."""

import sys

import distill_llm as D  # noqa: E402
import numpy as np
import pytest
import torch

from conftest import REPO, only_run, read_metrics, run_script
from shared_distill import _flags

sys.path.insert(0, str(REPO / "algos"))


@pytest.mark.vllm
def test_a_teacher_served_by_vllm_grades_as_the_one_in_process(tmp_path_factory, tiny, toy_prompts, tmp_path):
    """--teacher-engine vllm: the engine's prompt log-probs of sampled tokens and its top-k equal the in-process
    teacher's (VLLMEngine.score against a forward here), and 2 steps of topk-fkl with either teacher log the same
    losses; gkd, which needs the whole vocabulary, is refused in one line."""
    pytest.importorskip("vllm")
    from common.core import chat
    from common.core import models as M
    from common.core.generation import generate, tokenize_queries
    from common.integrations.vllm_engine import VLLMEngine

    teacher = M.tiny_model(tmp_path_factory.mktemp("teacher_vllm"), heads=1, init_std=0.2)  # head size 64: vLLM CPU
    tok = chat.load_tokenizer(teacher)
    model = M.load_causal_lm(teacher, tok)
    q, qm = tokenize_queries(tok, ["<|im_start|>user\nhi<|im_end|>\n", "count to three"], "cpu")
    ro = generate(model, tok, q, qm, max_new_tokens=6, seeds=[1, 2])
    engine = VLLMEngine(teacher, tok, max_model_len=128, seed=0)
    token_lp, top_lp, top_ids = engine.score(q, qm, ro.responses, ro.response_mask, 4)
    with torch.no_grad():
        lp = D.response_logits(model, ro.query_responses, torch.cat([qm, ro.response_mask], 1), q.shape[1], 1.0)
        lp = torch.log_softmax(lp, -1)  # (B, T, V)
    m = ro.response_mask.bool()
    want_top, want_ids = lp.topk(4, -1)
    assert torch.allclose(token_lp[m], lp.gather(-1, ro.responses[..., None])[..., 0][m], atol=1e-4)
    assert torch.allclose(top_lp[m], want_top[m], atol=1e-4) and (top_ids[m] == want_ids[m]).float().mean() > 0.99
    del engine
    losses = {}
    for engine_name in ("hf", "vllm"):
        run_script("distill_llm.py", *_flags(tiny, teacher, toy_prompts, tmp_path / engine_name, "--total-steps", 2,
                   "--loss", "topk-fkl", "--teacher-top-k", 4, "--teacher-engine", engine_name, "--eval-every", 0),
                   env={"TOY_MODEL": teacher})  # fmt: skip
        losses[engine_name] = [r["loss/policy"] for r in read_metrics(only_run(tmp_path / engine_name))]
    assert np.allclose(losses["hf"], losses["vllm"], rtol=1e-3), losses
    with pytest.raises(AssertionError, match="need the whole vocabulary"):
        run_script("distill_llm.py", *_flags(tiny, teacher, toy_prompts, tmp_path / "g", "--teacher-engine", "vllm"))
