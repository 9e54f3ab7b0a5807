"""algos/dpo_llm.py: losses by hand, offline and online end to end, learning a toy preference, resume;
tools.gen_preferences."""

import math
import sys

import dpo_llm as D  # noqa: E402
import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "algos"))


def test_losses_when_policy_equals_reference():
    x = torch.tensor([-3.0, -7.5])
    for beta in (0.1, 0.5):
        assert D.dpo_loss(x, x - 1, x, x - 1, "sigmoid", beta).tolist() == pytest.approx([0.693147] * 2, abs=1e-6)
        assert D.dpo_loss(x, x, x, x, "sigmoid", beta, 0.2).tolist() == pytest.approx([0.693147] * 2, abs=1e-6)
        assert D.dpo_loss(x, x, x, x, "ipo", beta).tolist() == pytest.approx([(1 / (2 * beta)) ** 2] * 2)
        assert D.dpo_loss(x, x, x, x, "hinge", beta).tolist() == pytest.approx([1.0, 1.0])


def test_losses_at_chosen_values():
    # z = (pi_c - ref_c) - (pi_r - ref_r) = (-1 - -2) - (-4 - -3) = 2
    pc, pr, rc, rr = map(torch.tensor, ([-1.0], [-4.0], [-2.0], [-3.0]))
    beta, eps = 0.5, 0.1
    sig = lambda v: 1 / (1 + math.exp(-v))
    assert D.dpo_loss(pc, pr, rc, rr, "sigmoid", beta).item() == pytest.approx(-math.log(sig(1.0)))
    assert D.dpo_loss(pc, pr, rc, rr, "sigmoid", beta, eps).item() == pytest.approx(
        -(1 - eps) * math.log(sig(1.0)) - eps * math.log(sig(-1.0))
    )
    assert D.dpo_loss(pc, pr, rc, rr, "ipo", beta).item() == pytest.approx((2 - 1) ** 2)
    assert D.dpo_loss(pc, pr, rc, rr, "hinge", beta).item() == pytest.approx(0.0)  # 1 - 0.5*2 = 0
    assert D.dpo_loss(pc, pr, rc, rr, "hinge", 0.25).item() == pytest.approx(0.5)
    assert D.dpo_loss(pc, pr, rc, rr, "robust", beta, eps).item() == pytest.approx(
        (-(1 - eps) * math.log(sig(1.0)) + eps * math.log(sig(-1.0))) / (1 - 2 * eps)
    )


def test_encode_pairs_masks_completions(tiny):
    from common.core.chat import load_tokenizer

    tok = load_tokenizer(tiny)
    ids, attn, comp = D.encode_pairs(
        tok, [{"prompt": "Q: hi", "chosen": " yes", "rejected": " no no no"}], 64, 64, "cpu"
    )
    assert ids.shape[0] == 2 and comp.shape == ids.shape
    n_prompt = len(tok("Q: hi", add_special_tokens=False)["input_ids"])
    assert comp[:, :n_prompt].sum() == 0  # prompt tokens never scored
    assert comp[0].sum() == len(tok(" yes", add_special_tokens=False)["input_ids"]) + 1  # + EOS
    last = int(attn[1].sum()) - 1
    assert ids[1, last] == tok.eos_token_id and comp[1, last] == 1
