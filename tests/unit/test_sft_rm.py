"""algos/sft_llm.py and algos/rm_llm.py: prompt masking, end to end, learning, normalisation, PPO with the trained
RM."""

import sys

import sft_llm as S  # noqa: E402

from conftest import REPO

sys.path.insert(0, str(REPO / "algos"))


def test_prompt_tokens_are_masked(tiny):
    from common.core.chat import load_tokenizer
    from common.core.data import encode_conversation

    tok = load_tokenizer(tiny)
    row = lambda p, r: dict(zip(("ids", "loss_mask"), encode_conversation(tok, [{"role": "user", "content": p}, {"role": "assistant", "content": r}], prompt_text=p)))  # fmt: skip
    ids, attn, mask = S.encode_examples(tok, [row("Q: one two three", " four"), row("Q:", " a b c d")], 64, "cpu")
    for i, (p, r) in enumerate([("Q: one two three", " four"), ("Q:", " a b c d")]):
        n_p = len(tok(p, add_special_tokens=False)["input_ids"])
        n_r = len(tok(r, add_special_tokens=False)["input_ids"]) + 1  # + EOS
        assert mask[i, :n_p].sum() == 0 and mask[i, n_p : n_p + n_r].eq(1).all() and mask[i, n_p + n_r :].sum() == 0
        assert ids[i, n_p + n_r - 1] == tok.eos_token_id
    # the loss only counts response tokens: changing the prompt's targets does not change the count
    model = __import__("common.core.models", fromlist=["x"]).load_causal_lm(tiny, tok)
    s, n = S.sft_loss_sum(model, ids, attn, mask)
    assert n == mask[:, 1:].sum() and s > 0
    # truncation keeps the response and cuts the prompt's start
    ids2, _, mask2 = S.encode_examples(tok, [row("word " * 50, " end")], 8, "cpu")
    assert ids2.shape[1] == 8 and mask2[0, -2:].eq(1).all() and mask2[0, :-2].eq(0).all()
    # a response longer than max_length: the prompt is cut to nothing, then the response's end
    ids3, _, mask3 = S.encode_examples(tok, [row("Q:", " a" * 20)], 8, "cpu")
    assert (
        ids3.shape[1] == 8 and mask3.eq(1).all() and ids3[0, 0] == tok(" a", add_special_tokens=False)["input_ids"][0]
    )
