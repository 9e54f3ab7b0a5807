"""The GPU paths of issue 64, proven on CPU: what the engines receive (streamed weights, dense for QLoRA), when they
sleep and wake, and the flags and addresses a multi-GPU, multi-node run needs. The FSDP2 half (2 gloo processes)
is tests/*/test_distributed.py::test_fsdp2_weight_stream_equals_unsharded; the memory it saves is
benchmarks/weight_sync.py."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from common.core import chat
from common.core import models as M
from common.parallel.weight_stream import engine_weight_meta, engine_weights, trainable_fingerprint, weights_bytes


def _file_weights(folder) -> dict:
    return load_file(os.path.join(folder, "model.safetensors"))


def test_the_stream_is_the_saved_weights_in_the_engines_dtype(tiny):
    """A plain policy: every saved tensor once (tied lm_head under its own name too), in order of the meta, cast."""
    model = M.load_causal_lm(tiny, chat.load_tokenizer(tiny))
    saved = _file_weights(tiny)
    for dtype in (torch.float32, torch.bfloat16):
        out = dict(engine_weights(model, dtype))
        assert set(saved) <= set(out) and set(out) - set(saved) <= {"lm_head.weight"}
        assert all(torch.equal(out[k], v.to(dtype)) for k, v in saved.items())
        meta = engine_weight_meta(model, dtype)
        assert [(k, v.dtype, tuple(v.shape)) for k, v in out.items()] == meta
        assert weights_bytes(model, dtype) == sum(v.numel() * v.element_size() for v in out.values())


def test_a_lora_policy_streams_merged_weights(tiny):
    """W + (alpha / r) B @ A per adapted layer, computed here by hand from the saved base and the adapter's factors;
    the other tensors are the base's; no lora_ or base_layer names reach the engine; base_only gives the base."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = M.load_causal_lm(tiny, chat.load_tokenizer(tiny))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj"], init_lora_weights=False))
    saved = _file_weights(tiny)
    out = dict(engine_weights(model, torch.float32))
    assert not [k for k in out if "lora_" in k or "base_layer" in k]
    for k, w in saved.items():
        if ".q_proj.weight" in k:
            layer = model.get_submodule("base_model.model." + k[: -len(".weight")])
            a, b = layer.lora_A["default"].weight.detach().numpy(), layer.lora_B["default"].weight.detach().numpy()
            expect = w.numpy() + 4.0 * (b @ a)  # alpha / r = 16 / 4
            assert abs(out[k].numpy() - expect).max() < 1e-6, k
        else:
            assert torch.equal(out[k], w), k
    base = dict(engine_weights(model, torch.float32, base_only=True))
    assert all(torch.equal(base[k], w) for k, w in saved.items())


def _four_bit(tiny):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    pytest.importorskip("bitsandbytes")
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                             bnb_4bit_quant_storage=torch.bfloat16, bnb_4bit_use_double_quant=True)  # fmt: skip
    try:
        return AutoModelForCausalLM.from_pretrained(tiny, quantization_config=cfg, device_map="cpu")
    except Exception as e:  # a bitsandbytes build without its CPU backend
        pytest.skip(f"bitsandbytes 4-bit does not load on this CPU: {e}")


def test_a_qlora_policy_streams_dense_dequantised_weights(tiny):
    """QLoRA (4-bit NF4 base + LoRA): the engine receives dense bf16 weights under the plain names (no packed bytes,
    no quant-state keys), each within NF4's error of the saved float32 weight, the LoRA delta merged on the
    dequantised weight (bitsandbytes' own dequantize_4bit, checked here against the packed tensor)."""
    import bitsandbytes.functional as BF
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(_four_bit(tiny), LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "o_proj"],
                                                       init_lora_weights=False))  # fmt: skip
    saved = _file_weights(tiny)
    out = dict(engine_weights(model, torch.bfloat16))
    assert set(out) == set(saved) | {"lm_head.weight"} and all(v.dtype == torch.bfloat16 for v in out.values())
    assert all(out[k].shape == v.shape for k, v in saved.items())
    for k, w in saved.items():
        if k.endswith("proj.weight"):
            mod = model.get_submodule("base_model.model." + k[: -len(".weight")])
            packed = (mod.base_layer if hasattr(mod, "base_layer") else mod).weight
            base = BF.dequantize_4bit(packed.data, packed.quant_state).float()
            assert (base - w).abs().mean() < 0.15 * w.abs().mean(), k  # NF4 of the saved weight, not another tensor
            dense = base
            if hasattr(mod, "lora_A"):
                a, b = mod.lora_A["default"].weight.detach().float(), mod.lora_B["default"].weight.detach().float()
                dense = base + 2.0 * (b @ a)
            assert (out[k].float() - dense).abs().max() <= 1e-2 * dense.abs().max(), k
    # the trainable fingerprint holds the adapter alone: a frozen 4-bit base is never read for it
    assert trainable_fingerprint(model).shape == (2 * 2 * 2, 2)  # 2 layers x 2 modules x (A, B)


def test_qlora_loads_on_cpu_with_the_quant_storage_sharding_needs(tiny):
    """--load-in-4bit on a CPU machine loads (bitsandbytes' CPU backend), and its config stores the packed weights
    in the compute dtype (bnb_4bit_quant_storage): FSDP2 and ZeRO-3 shard a tensor of one dtype per unit."""
    pytest.importorskip("bitsandbytes")
    cfg = M._quantization_config(True, torch.bfloat16)
    assert cfg.bnb_4bit_quant_storage == torch.bfloat16 and cfg.bnb_4bit_compute_dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# The colocated engine's phases, against a stand-in vLLM LLM
# ---------------------------------------------------------------------------------------------
class _StubLLM:
    """Records what the engine asks of vLLM's LLM: sleep, wake_up, the weights reloaded, generate."""

    def __init__(self):
        self.calls, self.loaded = [], {}
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=SimpleNamespace()))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, name, kwargs):
        n = 0
        for k, v in kwargs["weights_iterator"]:
            self.loaded[k] = v.clone()
            n += 1
        self.calls.append((name, n))

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, params, **kw):
        self.calls.append(("generate", len(prompts)))
        done = SimpleNamespace(token_ids=[5, 2], logprobs=[{5: SimpleNamespace(logprob=-1.0)},
                                                             {2: SimpleNamespace(logprob=-0.5)}], stop_reason=None)  # fmt: skip
        return [SimpleNamespace(outputs=[done]) for _ in prompts]


def _stub_engine(monkeypatch, sleep: bool):
    from common.integrations.vllm_engine import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))  # no 13 s import
    engine = object.__new__(VLLMEngine)
    engine.tok, engine.dtype, engine.llm = SimpleNamespace(eos_token_id=2, pad_token_id=0), torch.bfloat16, _StubLLM()
    engine.fingerprint, engine.in_phase, engine.wakes, engine.sleep, engine.asleep = None, False, 0, sleep, set()
    engine.adapters, engine.lora_request = None, None
    engine._sleep()  # as __init__ ends
    return engine


@pytest.mark.parametrize("sleep", [True, False], ids=["vllm-sleep", "awake"])
def test_one_wake_and_one_push_per_rollout_phase(monkeypatch, sleep):
    """A phase with three generate calls (a multi-turn rollout's turns): --vllm-sleep wakes the weights, pushes,
    wakes the KV cache, generates three times, and sleeps once at the end (TRL's order); perf/vllm_wakes counts 1 a
    phase. Awake: a phase whose weights did not change pushes nothing."""
    from common.integrations.engines import engine_perf
    from common.parallel.sharded import unwrap_for_generation

    engine, model = _stub_engine(monkeypatch, sleep), torch.nn.Linear(3, 2)
    q, qm = torch.tensor([[0, 7, 8]]), torch.tensor([[0, 1, 1]])
    for phase in range(2):
        engine.llm.calls.clear()
        with unwrap_for_generation(None, model, engine) as gen_model:
            assert gen_model is model
            for _ in range(3):
                engine.generate(q, qm, 4, seeds=[1])
        gens = [("generate", 1)] * 3
        if sleep:  # level 2 discards the weights: each phase pushes them again
            assert engine.llm.calls == [("wake_up", ("weights",)), ("reload_weights", 2),
                                        ("wake_up", ("kv_cache",)), *gens, ("sleep", 2)]  # fmt: skip
            assert engine_perf(engine) == {"perf/vllm_wakes": 1}
        else:
            assert engine.llm.calls == ([("reload_weights", 2)] if phase == 0 else []) + gens
            assert engine_perf(engine) == {}
    assert torch.equal(engine.llm.loaded["weight"], model.weight.detach().to(torch.bfloat16))
    with torch.no_grad():
        model.weight.add_(1.0)  # an update: the next phase pushes
    with unwrap_for_generation(None, model, engine):
        pass
    assert torch.equal(engine.llm.loaded["weight"], model.weight.detach().to(torch.bfloat16))


def test_a_sleeping_engine_called_outside_a_phase_says_so(monkeypatch):
    engine = _stub_engine(monkeypatch, sleep=True)
    with pytest.raises(RuntimeError, match="begin_phase"):
        engine.generate(torch.tensor([[7]]), torch.tensor([[1]]), 4, seeds=[1])


# ---------------------------------------------------------------------------------------------
# Flags and addresses
# ---------------------------------------------------------------------------------------------
def test_enforce_eager_is_a_flag_off_on_gpus_by_default(tmp_path, monkeypatch):
    """--vllm-enforce-eager auto|on|off; the started server's command line carries --enforce-eager only when eager
    (auto: on CPU). The process itself is not started (Popen replaced)."""
    import subprocess

    from common.harness.args import GenerationArgs
    from common.integrations.vllm_server import ServerProcess

    assert [GenerationArgs(vllm_enforce_eager=v).enforce_eager() for v in ("auto", "on", "off")] == [None, True, False]
    monkeypatch.setattr(
        subprocess, "Popen", lambda *a, **k: SimpleNamespace(poll=lambda: 0)
    )  # "exited": stop() at exit does nothing
    cmd = lambda eager, cuda: (  # noqa: E731
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda),
        ServerProcess("m", 1, torch.bfloat16, None, 0, log_path=tmp_path / "l.log", enforce_eager=eager).cmd,
    )[1]
    assert "--enforce-eager" in cmd(None, False) and "--enforce-eager" not in cmd(None, True)
    assert "--enforce-eager" in cmd(True, True) and "--enforce-eager" not in cmd(False, False)
    assert cmd(None, True)[cmd(None, True).index("--host") + 1] == "127.0.0.1"


def test_the_nccl_address_is_the_route_not_the_hosts_file(monkeypatch):
    """The address another node reaches: the source address of the route (here: loopback for loopback, a real
    interface's address for another host, never Debian's 127.0.1.1); NO_PROXY gains the server's host."""
    import socket

    from common.integrations.http import no_proxy, route_address

    assert route_address("127.0.0.1") == "127.0.0.1"
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # what Debian's /etc/hosts says

    class Routed:  # the kernel's choice of source address for a route to 10.0.0.7
        def __init__(self, *a):
            self.peer = None

        def __enter__(self):
            return self

        def __exit__(self, *a):
            pass

        def connect(self, addr):
            self.peer = addr

        def getsockname(self):
            return ("10.0.0.5", 40000) if self.peer == ("10.0.0.7", 9) else ("0.0.0.0", 0)

    monkeypatch.setattr(socket, "socket", Routed)
    assert route_address("10.0.0.7") == "10.0.0.5"
    monkeypatch.setenv("NO_PROXY", "example.org")
    monkeypatch.delenv("no_proxy", raising=False)
    no_proxy("10.0.0.7")
    assert os.environ["NO_PROXY"] == "example.org,10.0.0.7" and os.environ["no_proxy"] == "10.0.0.7"
    no_proxy("10.0.0.7")
    assert os.environ["NO_PROXY"] == "example.org,10.0.0.7"


def test_a_push_leaves_dev_shm_when_it_has_no_room(tmp_path, monkeypatch):
    """/dev/shm is chosen by the push's size (twice: the version read and the one written), not by a fixed margin."""
    import tempfile
    from pathlib import Path

    from common.integrations import vllm_server as S

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    engine = object.__new__(S.ServerEngine)  # the folder logic alone (the constructor contacts the server)
    engine._own_dir, engine.adapters = True, None
    engine.weights_dir = Path(tempfile.mkdtemp(prefix="cleanrlhf-weights-", dir="/dev/shm"))
    monkeypatch.setattr(S, "_shm", lambda need: None)  # a 15 GB push into a 4 GB /dev/shm
    moved = engine._folder(15 << 30)
    assert not str(moved).startswith("/dev/shm") and moved.is_dir()


def test_the_lm_head_chunk_follows_the_devices_memory(monkeypatch):
    """32 MB of (chunk, V) float32 temporaries on CPU; on a GPU 1/64 of its memory, capped at 2 GiB: an 80 GB card at
    Qwen's 151,936 vocabulary takes 2,056 positions per chunk (the CPU's budget gave 55); the result is unchanged."""
    from common.core.ops import head_chunk, head_logprobs

    assert head_chunk(151_936, torch.device("cpu")) == 2**25 // (4 * 151_936) == 55
    assert head_chunk(10**9, "cpu") == 1  # never zero
    props = SimpleNamespace(total_memory=80 * 10**9)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert head_chunk(151_936, torch.device("cuda:0")) == (80 * 10**9 // 64) // (4 * 151_936) == 2056
    props.total_memory = 200 * 2**30  # a budget over 2 GiB is capped
    assert head_chunk(151_936, "cuda") == 2**31 // (4 * 151_936)
    torch.manual_seed(0)
    h, w, idx = torch.randn(2, 9, 16), torch.randn(50, 16), torch.randint(0, 50, (2, 9))
    full = torch.log_softmax(h @ w.T, -1).gather(-1, idx[..., None])[..., 0]
    assert torch.allclose(head_logprobs(h, w, idx, 1.0)[0], full, atol=1e-5)  # chunk from the budget: all 18 at once
    assert torch.allclose(head_logprobs(h, w, idx, 1.0, chunk=4)[0], full, atol=1e-5)
