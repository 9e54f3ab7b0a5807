"""Model loading: by path and alias, tokenizer hygiene, LoRA, value head, QLoRA on CPU."""

import time

import pytest

from common.core import chat, defaults, hub
from common.core import models as M


@pytest.mark.slow
def test_default_alias_loads_offline_and_answers(tmp_path, monkeypatch):
    monkeypatch.setenv("CLEANRLHF_CACHE", str(tmp_path))
    t0 = time.time()
    path = hub.resolve_model_path(defaults.DEFAULT_MODEL)  # converts the GGUF into tmp_path
    first = time.time() - t0
    assert (tmp_path / "SmolLM2-135M-Instruct" / "model.safetensors").exists()
    t0 = time.time()
    tok = chat.load_tokenizer(defaults.DEFAULT_MODEL)
    model = M.load_causal_lm(defaults.DEFAULT_MODEL, tok)
    cached = time.time() - t0
    assert path.endswith("SmolLM2-135M-Instruct") and cached < first
    enc = tok(chat.apply_chat(tok, "What is 2+3?"), return_tensors="pt", add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert "5" in tok.decode(out[0, enc["input_ids"].shape[1] :])
