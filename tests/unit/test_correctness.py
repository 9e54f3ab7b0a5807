"""What the numbers mean: each test here failed on the code before the correctness pass (issue 15).

Reward models scored as trained; the model's own generation_config kept out of rollouts; pi_old
and the sampler gap; temperature after the float32 cast; dynamic-KL beta after the update; clamps;
online DPO on generated ids; no dropout; real lengths in gen_preferences; splits by problem.
"""

import json
import sys

import dpo_llm as DPO  # noqa: E402
import dynamic_kl_ppo as DKL  # noqa: E402
import grpo_llm as GRPO  # noqa: E402
import ppo_llm as PPO  # noqa: E402
import pytest
import torch

from common.core import chat
from common.core import models as M  # noqa: E402
from common.core.data import PromptRow, encode_prompt_response  # noqa: E402
from common.core.errors import UserError
from common.core.forwards import forward_logprobs  # noqa: E402
from common.core.generation import generate, sequence_attention_mask, tokenize_queries
from common.core.ops import kl_estimate, selective_log_softmax  # noqa: E402
from common.core.rewards import Reward  # noqa: E402
from conftest import REPO

sys.path.insert(0, str(REPO / "algos"))


def _other_tokenizer(folder):
    """A byte-level BPE tokenizer unlike SmolLM2's (other vocabulary, other chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["[UNK]", "[PAD]", "[EOS]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(["What is 3 + 4? The answer is 7. yes no maybe user assistant"] * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    tok.chat_template = (
        "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<<assistant>> {% endif %}"
    )
    tok.save_pretrained(folder)
    return tok


def test_rm_with_its_own_tokenizer_and_absolute_positions(tmp_path):
    """A GPT-2-style RM (absolute positions) with another tokenizer and template scores text through
    its own tokenizer, whatever the batch's padding: each score equals the single unpadded sequence's."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    rm_tok = _other_tokenizer(tmp_path)
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=len(rm_tok),
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=128,
        num_labels=1,
        pad_token_id=rm_tok.pad_token_id,
        eos_token_id=rm_tok.eos_token_id,
        resid_pdrop=0.3,
    )
    GPT2ForSequenceClassification(cfg).save_pretrained(tmp_path)
    tok = chat.load_tokenizer(str(tmp_path))
    rm = M.load_reward_model(str(tmp_path), tok).eval()
    messages = [[{"role": "user", "content": "What is 3 + 4?"}], [{"role": "user", "content": "yes"}]]
    rows = [PromptRow("<policy-templated text>", "x", None, {}, i, m) for i, m in enumerate(messages)]
    responses, eos = ["The answer is 7.", "no"], [True, False]
    scores, _, _ = Reward("model:1.0", reward_model=rm, reward_tok=tok)(rows, responses, torch.ones(2), is_eos=eos)
    for i in range(2):
        text = rm_tok.apply_chat_template(messages[i], tokenize=False, add_generation_prompt=True)
        ids = (
            rm_tok(text, add_special_tokens=False)["input_ids"]
            + rm_tok(responses[i], add_special_tokens=False)["input_ids"]
        )
        ids += [rm_tok.eos_token_id] if eos[i] else []
        with torch.no_grad():
            direct = rm(input_ids=torch.tensor([ids])).logits[0, 0]
        assert scores[i].item() == pytest.approx(direct.item(), abs=1e-5)


def test_encoder_truncation_and_eos_rules(tiny):
    tok = chat.load_tokenizer(tiny)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    p_ids = tok("one two three four", add_special_tokens=False)["input_ids"]
    c_ids = tok(" five six", add_special_tokens=False)["input_ids"]
    ids, attn, comp = encode_prompt_response(
        tok, ["one two three four", "one"], [" five six", [7, 8]], eos=[True, True]
    )
    assert ids[0, : len(p_ids) + len(c_ids) + 1].tolist() == p_ids + c_ids + [eos]
    n1 = len(tok("one", add_special_tokens=False)["input_ids"])
    assert (
        ids[1, : n1 + 2].tolist()[-2:] == [7, 8] and (ids[1, n1 + 2 :] == pad).all()
    )  # ids kept as generated: no EOS added
    assert comp[0].sum() == len(c_ids) + 1 and comp[1].sum() == 2 and attn[1].sum() == n1 + 2
    # past max_length the prompt's start goes first; a completion cut by max_completion_length loses its EOS
    ids, _, comp = encode_prompt_response(tok, ["one two three four"], [" five six"], max_length=len(c_ids) + 2)
    assert ids[0].tolist() == p_ids[-1:] + c_ids + [eos]
    ids, _, _ = encode_prompt_response(tok, ["one"], [" five six"], max_completion_length=1)
    assert ids[0].tolist()[-1] == c_ids[0]


# ---------------------------------------------------------------------------------------------
# 2. the model's own generation_config stays out of rollouts
# ---------------------------------------------------------------------------------------------
def test_generation_config_penalties_do_not_change_sampling(tiny_peaky, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_peaky)
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.no_repeat_ngram_size = 2
    model.generation_config.suppress_tokens = list(range(1000, 20000))
    model.save_pretrained(tmp_path)
    chat.load_tokenizer(tiny_peaky).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text())["repetition_penalty"] == 1.3
    tok = chat.load_tokenizer(str(tmp_path))
    policy = M.load_causal_lm(str(tmp_path), tok).eval()
    q, qm = tokenize_queries(tok, ["hello there", "count to ten please"])
    ro = generate(policy, tok, q, qm, 24, temperature=1.0, seeds=[1, 2])
    attn = sequence_attention_mask(qm, ro.responses.shape[1])
    with torch.no_grad():
        recomputed = forward_logprobs(policy, ro.query_responses, attn, q.shape[1]) * ro.response_mask
    assert (recomputed - ro.logprobs).abs().max() < 1e-4
    assert policy.generation_config.repetition_penalty == 1.3  # the model's own config is left as it was
    # the penalties are real: transformers' own generate, which merges the model's config in, decodes
    # differently from our loop (greedy both)
    ours = generate(policy, tok, q, qm, 24)
    with torch.no_grad():
        theirs = policy.generate(input_ids=q, attention_mask=qm, max_new_tokens=24, do_sample=False)[:, q.shape[1] :]
    n = min(ours.responses.shape[1], theirs.shape[1])
    assert not torch.equal(ours.responses[:, :n], theirs[:, :n])


# ---------------------------------------------------------------------------------------------
# 3. pi_old, the sampler gap, --tis-cap, temperature after the cast
# ---------------------------------------------------------------------------------------------
def test_temperature_divides_after_the_float32_cast():
    torch.manual_seed(0)
    logits = (torch.randn(2, 5, 300) * 4).to(torch.bfloat16)
    index = torch.randint(0, 300, (2, 5))
    want = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, index[..., None])[..., 0]
    assert torch.allclose(selective_log_softmax(logits, index, temperature=0.7), want, atol=1e-6)
    before = torch.log_softmax((logits / 0.7).float(), -1).gather(-1, index[..., None])[..., 0]
    assert (before - want).abs().max() > 1e-3  # what dividing the bf16 logits first cost


def test_tis_weights_multiply_the_token_loss():
    lp, old, adv = torch.tensor([[0.1, -0.2]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, -1.0]])
    mask, w = torch.ones(1, 2), torch.tensor([[2.0, 0.5]])
    plain = PPO.policy_loss(lp, old, adv, mask, 2.0, 0.2)[0]
    weighted = PPO.policy_loss(lp, old, adv, mask, 2.0, 0.2, tis_weights=w)[0]
    r1, r2 = torch.exp(torch.tensor(0.1)).item(), torch.exp(torch.tensor(-0.2)).item()  # both inside [0.8, 1.2]
    per_token = [max(-r1, -min(max(r1, 0.8), 1.2)), max(r2, min(max(r2, 0.8), 1.2))]
    assert plain.item() == pytest.approx(sum(per_token) / 2, abs=1e-6)
    assert weighted.item() == pytest.approx((2.0 * per_token[0] + 0.5 * per_token[1]) / 2, abs=1e-6)


# ---------------------------------------------------------------------------------------------
# 4. dynamic-KL beta
# ---------------------------------------------------------------------------------------------
def test_update_beta_always_clamps():
    assert DKL.update_beta(2.0, 0.1, 0.1, 0.01, 1.0) == 1.0  # inside the band, but above beta_max
    assert DKL.update_beta(0.001, 0.1, 0.1, 0.01, 1.0) == 0.01  # inside the band, but below beta_min


# ---------------------------------------------------------------------------------------------
# 5. numerical guards
# ---------------------------------------------------------------------------------------------
def test_exploded_log_ratio_gives_a_finite_loss():
    lp, old, adv, mask = torch.tensor([[100.0]]), torch.tensor([[0.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1)
    assert torch.isfinite(PPO.policy_loss(lp, old, adv, mask, 1.0, 0.2)[0])
    assert torch.isfinite(DKL.policy_loss(lp, old, adv, mask, 1.0, 0.2)[0])
    assert torch.isfinite(GRPO.grpo_loss(lp, old, adv, mask, 0.2, 0.2)[0]).all()


def test_k3_is_clamped_so_one_token_cannot_dominate():
    d = torch.tensor([[-10.0, 0.1, -0.1]])
    k3 = kl_estimate(d, torch.zeros_like(d), "k3")
    assert k3[0, 0].item() == 10.0  # exp(10) - 11 = 22015 before the clamp
    assert k3[0, 1].item() == pytest.approx(torch.exp(torch.tensor(-0.1)).item() - 1 + 0.1, abs=1e-7)


# ---------------------------------------------------------------------------------------------
# 6. online DPO ids, dropout, gen_preferences lengths
# ---------------------------------------------------------------------------------------------
def test_online_dpo_pairs_keep_generated_ids(tiny):
    tok = chat.load_tokenizer(tiny)
    ids, _, comp = DPO.encode_pairs(
        tok, [{"prompt": "hi", "chosen": [11, 12, 13], "rejected": [14, 15]}], 64, 64, "cpu"
    )
    chosen, rejected = ids[0][comp[0].bool()].tolist(), ids[1][comp[1].bool()].tolist()
    assert chosen == [11, 12, 13] and rejected == [14, 15]  # a truncated sample gains no EOS


def test_dropout_is_off_in_train_mode(tmp_path, tiny):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = chat.load_tokenizer(tiny)
    GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)
    ).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model = M.load_causal_lm(str(tmp_path), tok, gradient_checkpointing=True)
    assert model.training
    x = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, model(input_ids=x).logits)


def test_gen_preferences_scores_real_lengths(tiny_peaky, toy_prompts, tmp_path, monkeypatch):
    from tools import gen_preferences as GP

    seen = []

    class Recording(GP.Reward):
        def __call__(self, rows, responses, response_lens, device="cpu", is_eos=None):
            seen.append((response_lens.tolist(), list(is_eos)))
            return super().__call__(rows, responses, response_lens, device, is_eos)

    monkeypatch.setattr(GP, "Reward", Recording)
    try:
        GP.main(
            GP.Args(
                model=tiny_peaky,
                prompts=[toy_prompts],
                out=str(tmp_path / "p.jsonl"),
                group_size=2,
                num_prompts=4,
                max_new_tokens=8,
                reward="length:1.0",
            )
        )
    except UserError:  # every sample of this random model runs to the limit: all tied, fine here
        pass
    assert len(seen) == 2
    for lens, eos in seen:  # the response token counts (the old code passed 1 for every response)
        assert all(1 <= n <= 8 for n in lens) and all(n == 8 for n, e in zip(lens, eos) if not e)
