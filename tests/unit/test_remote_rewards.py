"""Rewards as services (issue 37.3): the --reward-url client against servers started here (threads in this
process), tools.serve_rm against the same reward model in process, the LLM judge against a stub OpenAI-compatible
server, retries, a dead service, the fallback, and mixes with rule rewards."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from common.core.data import PromptRow
from common.core.errors import UserError
from common.core.rewards import Reward
from common.integrations.remote_rewards import JudgeScorer, RemoteScorer, ServiceConfig, ServiceError, parse_judge_score
from shared_remote_rewards import Stub

ROWS = [PromptRow(f"q{i}", "match", str(i), {"i": i}, uid=i, messages=f"what is {i}?") for i in range(7)]

RESPONSES = [f"<answer>{i if i % 2 else i + 1}</answer>" for i in range(7)]  # odd rows right


def length_scores(body, n):
    return 200, {"scores": [float(len(r)) for r in body["responses"]]}


# ------------------------------------------------------------------ reward calls overlap the decoding (37.3)
def _early_ending(tiny):
    """The tiny model and a tokenizer whose EOS is the token row 0 samples third: rows end at different steps."""
    from common.core import chat
    from common.core import models as M
    from common.core.generation import generate, tokenize_queries

    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok).eval()
    rows = [PromptRow(f"count {i}", "toy", str(i), {"i": i}, uid=i) for i in range(12)]
    q, qm = tokenize_queries(tok, [r.text for r in rows])
    sampling = dict(max_new_tokens=40, temperature=1.0, seeds=list(range(12)))
    first = generate(model, tok, q, qm, **sampling)
    tok.eos_token = tok.convert_ids_to_tokens(int(first.responses[0, 2]))
    return tok, model, rows, q, qm, sampling


def test_remote_scores_in_chunks_and_mix_with_rule_rewards():
    stub = Stub(length_scores)
    try:
        cfg = ServiceConfig(stub.url, batch_size=3, concurrency=2)
        reward = Reward("rule:1.0,remote:0.5", remote=RemoteScorer(cfg))
        scores, comps, _ = reward(ROWS, RESPONSES, torch.full((7,), 5))
        assert comps["remote"].tolist() == [float(len(r)) for r in RESPONSES]
        assert torch.allclose(scores, comps["rule"] + 0.5 * comps["remote"])
        assert comps["rule"].tolist() == [float(i % 2) for i in range(7)]
        assert len(stub.bodies) == 3 and sorted(len(b["responses"]) for b in stub.bodies) == [1, 3, 3]
        body = next(b for b in stub.bodies if b["responses"][0] == RESPONSES[0])
        assert body["prompts"][0] == "what is 0?" and body["ground_truths"][0] == "0" and body["is_eos"][0] is False
    finally:
        stub.close()


def test_a_flaky_service_is_retried_with_backoff():
    stub = Stub(lambda body, n: (503, {"error": "busy"}) if n <= 2 else length_scores(body, n))
    try:
        t = time.time()
        scores, failed = RemoteScorer(ServiceConfig(stub.url, backoff=0.05, retries=3))(ROWS[:2], RESPONSES[:2])
        assert scores == [float(len(r)) for r in RESPONSES[:2]] and failed == 0 and len(stub.bodies) == 3
        assert time.time() - t >= 0.05 + 0.1  # two backoffs: 0.05 s, then 0.1 s
    finally:
        stub.close()


def test_a_dead_slow_or_wrong_service_is_one_line_or_the_fallback():
    dead = ServiceConfig("http://127.0.0.1:9/score", retries=1, backoff=0.01, timeout=2)
    with pytest.raises(ServiceError, match=r"http://127.0.0.1:9/score: no valid answer after 2 tries"):
        RemoteScorer(dead)(ROWS, RESPONSES)
    reward = Reward("remote:1.0", remote=RemoteScorer(dead), fallback=-1.0)
    scores, _, _ = reward(ROWS, RESPONSES, torch.full((7,), 5))
    assert scores.tolist() == [-1.0] * 7 and reward.errors == 7
    slow = Stub(length_scores, delay=1.0)
    wrong = Stub(lambda body, n: (200, {"scores": [1.0]}))
    refuses = Stub(lambda body, n: (400, {"error": "no"}))
    try:
        with pytest.raises(ServiceError, match="TimeoutError|timed out"):
            RemoteScorer(ServiceConfig(slow.url, timeout=0.2, retries=1, backoff=0.01))(ROWS[:2], RESPONSES[:2])
        with pytest.raises(ServiceError, match=r"not \{'scores': \[2 numbers\]\}"):
            RemoteScorer(ServiceConfig(wrong.url))(ROWS[:2], RESPONSES[:2])
        with pytest.raises(ServiceError, match="refused the request"):
            RemoteScorer(ServiceConfig(refuses.url, retries=3))(ROWS[:2], RESPONSES[:2])
        assert len(refuses.bodies) == 1  # a 4xx is not retried
    finally:
        for s in (slow, wrong, refuses):
            s.close()


def test_terms_and_services_go_together():
    with pytest.raises(UserError, match="--reward includes 'remote' but no --reward-url"):
        Reward("rule:1.0,remote:0.5")
    with pytest.raises(UserError, match="--judge-url was given but --reward has no 'judge' term"):
        Reward("rule:1.0", judge=JudgeScorer(ServiceConfig("http://x/v1"), "m"))


def test_serve_rm_scores_as_the_reward_model_in_process(tiny, tmp_path):
    """tools.serve_rm over HTTP = --reward-model in process, to 1e-5 (the same encoding, the same normalisation)."""
    from common.core import chat
    from common.core import models as M
    from tools.serve_rm import make_server

    rm_dir = tmp_path / "rm"
    rm = M.load_reward_model(tiny)
    torch.manual_seed(0)
    torch.nn.init.normal_(rm.score.weight, std=0.5)
    rm.save_pretrained(rm_dir)
    chat.load_tokenizer(tiny).save_pretrained(rm_dir)
    server = make_server(str(rm_dir))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        is_eos = torch.tensor([True, False] * 3 + [True])
        remote = Reward("remote:1.0", remote=RemoteScorer(ServiceConfig(url, batch_size=4)))
        tok = chat.load_reward_tokenizer(str(rm_dir))
        local = Reward("model:1.0", reward_model=M.load_reward_model(str(rm_dir), tok).eval(), reward_tok=tok)
        a = remote(ROWS, RESPONSES, torch.full((7,), 5), is_eos=is_eos)[0]
        b = local(ROWS, RESPONSES, torch.full((7,), 5), is_eos=is_eos)[0]
        assert torch.allclose(a, b, atol=1e-5) and b.std() > 0, (a, b)
    finally:
        server.shutdown()
        server.server_close()


def test_serve_rm_refuses_a_causal_lm_a_busy_port_and_an_oversized_request(tiny, tmp_path):
    """tools.serve_rm (and --reward-model) on a folder that is not a reward model: one line (a causal LM would load
    with a random score head and serve noise); a port in use: one line naming it; a body over MAX_REQUEST_BYTES:
    413 without reading it, and the server goes on serving."""
    import urllib.error
    import urllib.request

    from common.core import chat
    from common.core import models as M
    from tools import serve_rm

    with pytest.raises(UserError, match="not a reward model .*ForCausalLM"):
        serve_rm.make_server(tiny)
    rm_dir = tmp_path / "rm"
    M.load_reward_model(tiny).save_pretrained(rm_dir)
    chat.load_tokenizer(tiny).save_pretrained(rm_dir)
    server = serve_rm.make_server(str(rm_dir))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        with pytest.raises(UserError, match=f"--port {port}: cannot listen there"):
            serve_rm.make_server(str(rm_dir), port=port)
        big = urllib.request.Request(f"http://127.0.0.1:{port}/score", b"{}",
                                     {"Content-Length": str(serve_rm.MAX_REQUEST_BYTES + 1)})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError, match="413"):
            urllib.request.urlopen(big, timeout=10)
        scores, failed = RemoteScorer(ServiceConfig(f"http://127.0.0.1:{port}/score"))(ROWS[:2], RESPONSES[:2])
        assert len(scores) == 2 and failed == 0
    finally:
        server.shutdown()
        server.server_close()


def test_the_judge_renders_its_template_and_parses_the_grade(tmp_path):
    def grade(body, n):  # an OpenAI-compatible chat completion: the grade is the response's length mod 11
        content = body["messages"][0]["content"]
        answer = content.split("ANSWER[")[1].split("]")[0]
        reply = "I cannot tell" if "GT: 3 " in content else f"Score: {len(answer) % 11}"
        return 200, {"choices": [{"message": {"role": "assistant", "content": reply}}]}

    stub = Stub(grade)
    try:
        judge = JudgeScorer(ServiceConfig(stub.url.replace("/score", "/v1"), retries=1, backoff=0.01), "judge-m",
                            template="Q: {prompt} GT: {ground_truth} ANSWER[{response}]")  # fmt: skip
        scores, failed = judge(ROWS[:3], RESPONSES[:3])
        assert scores == [len(r) % 11 / 10 for r in RESPONSES[:3]] and failed == 0
        body = stub.bodies[0]
        assert body["model"] == "judge-m" and body["temperature"] == 0.0 and "GT: " in body["messages"][0]["content"]
        assert judge.unparsed == 0
        with pytest.raises(ServiceError, match="no score in the judge's answer after 2 tries"):
            judge(ROWS[3:4], RESPONSES[3:4])  # "I cannot tell": no number
        assert judge.unparsed == 2  # each try's reply counted
        reward = Reward("judge:1.0", judge=judge, fallback=0.0)
        assert reward.counts() == {"reward/judge_unparsed": 2}  # the same judge: its count so far
        scores, _, _ = reward(ROWS[2:4], RESPONSES[2:4], torch.full((2,), 5))
        assert scores.tolist() == pytest.approx([len(RESPONSES[2]) % 11 / 10, 0.0])  # the unreadable one: fallback
        assert reward.counts() == {"reward/errors": 1, "reward/judge_unparsed": 4}  # what the scripts log
    finally:
        stub.close()
    assert parse_judge_score("Score: 7/10") == 7 and parse_judge_score("none") is None


@pytest.mark.parametrize(
    "reply, grade",
    [("Score: 7", 7), ("**Score:** 7/10", 7), ("Score (0-10): 7", 7), ("score = 7.5", 7.5), ("The score is 6", 6),
     ("Final score: 9 out of 10", 9), ("7", 7), ("8/10.", 8), ("Score: 85", 10), ("Score: 1000000", 10),
     ("Score: -3", 0), ("In 2024 the answer was", None), ("it is 8", None), ("I cannot tell", None)],
)  # fmt: skip
def test_the_judge_grade_is_parsed_in_the_common_formats_and_kept_in_range(reply, grade):
    """The grade after "Score" (a "(0-10)" range, markdown, "=", "is" allowed between), or a reply that is a number
    alone; clamped to [0, scale]; a number elsewhere in a sentence is not a grade (a year would be 202.4)."""
    assert parse_judge_score(reply) == grade


@pytest.mark.parametrize(
    "answer",
    [{"scores": ["high", 1.0]}, {"scores": [None, 1.0]}, {"scores": [{"s": 1}, 1.0]}, {"scores": [float("nan"), 1.0]},
     {"scores": [float("inf"), 1.0]}, {"scores": [True, 1.0]}, b'{"scores": [1.0, ', b"<html>busy</html>"],
    ids=["string", "null", "dict", "nan", "inf", "bool", "cut", "html"],
)  # fmt: skip
def test_a_malformed_or_non_finite_answer_is_a_failed_request(answer):
    """Scores that are not finite numbers, or an answer cut mid-way: retried like a failed request, then one line
    naming the URL, or the fallback (counted), never a traceback and never a NaN reward."""
    data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()  # json.dumps writes NaN, Infinity
    stub = Stub(lambda body, n: (200, data))
    try:
        cfg = ServiceConfig(stub.url, retries=1, backoff=0.01)
        with pytest.raises(
            ServiceError, match=r"/score: no valid answer after 2 tries \(last: (ValueError|JSONDecodeError)"
        ):
            RemoteScorer(cfg)(ROWS[:2], RESPONSES[:2])
        assert len(stub.bodies) == 2  # retried once
        reward = Reward("remote:1.0", remote=RemoteScorer(cfg), fallback=-1.0)
        scores, _, _ = reward(ROWS[:2], RESPONSES[:2], torch.full((2,), 5))
        assert scores.tolist() == [-1.0, -1.0] and reward.errors == 2
    finally:
        stub.close()


def test_an_answer_dripped_a_byte_at_a_time_is_bounded_by_the_timeout_in_all():
    """urlopen's timeout bounds each read; a service sending a byte every 0.1 s would never time out. The whole
    answer must arrive within --reward-timeout (here 1 s): the try ends after ~1 s, then the next."""

    class Drip(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps({"scores": [1.0, 1.0]}).encode() + b" " * 200
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                for i in range(len(data)):
                    self.wfile.write(data[i : i + 1])
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:  # the client gave up
                pass

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        t = time.time()
        cfg = ServiceConfig(f"http://127.0.0.1:{server.server_address[1]}/score", timeout=1.0, retries=1, backoff=0.01)
        with pytest.raises(ServiceError, match="did not arrive whole within the timeout"):
            RemoteScorer(cfg)(ROWS[:2], RESPONSES[:2])
        assert time.time() - t < 5  # two tries of ~1 s, not 2 x 27 s of drips
    finally:
        server.shutdown()
        server.server_close()


def test_a_redirect_is_refused_and_the_key_never_reaches_its_target(monkeypatch):
    """A judge endpoint answering 307 to another address: refused in one line naming the target; the target never
    sees the request (urllib would have re-sent it with its Authorization header)."""
    target = Stub(lambda body, n: (200, {"choices": [{"message": {"content": "Score: 7"}}]}))

    class Redirect(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(307)
            self.send_header("Location", target.url.replace("/score", "/v1/chat/completions"))
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    try:
        judge = JudgeScorer(ServiceConfig(f"http://127.0.0.1:{server.server_address[1]}/v1", retries=1), "m")
        with pytest.raises(ServiceError, match="answered with a redirect \\(307\\) to http://127.0.0.1:.*refusing"):
            judge(ROWS[:1], RESPONSES[:1])
        assert target.bodies == []
    finally:
        server.shutdown()
        server.server_close()
        target.close()


def test_scores_as_rows_finish_equal_the_batch_scores(tiny, tmp_path):
    """sample_and_score (the worker pool and a service called on groups of finished rows while the rest decode)
    gives exactly generate() then Reward on the whole batch; the service sees more than one group."""
    from common.core.generation import generate
    from common.core.sampling import sample_and_score

    tok, model, rows, q, qm, sampling = _early_ending(tiny)
    (tmp_path / "fn.py").write_text(
        "def score(ds, s, gt, extra_info=None):\n    return {'score': len(s) % 5 / 5, 'acc': len(s) % 2}\n"
    )
    stub = Stub(length_scores)
    try:
        reward = Reward("rule:1.0,remote:0.5,length:0.1", reward_fn=f"{tmp_path}/fn.py:score", workers=2,
                        max_new_tokens=40, remote=RemoteScorer(ServiceConfig(stub.url, batch_size=4)))  # fmt: skip
        assert reward.outside
        rollout, texts, (scores, comps, extras) = sample_and_score(model, tok, q, qm, rows, reward, "cpu", **sampling)
        streamed_requests = len(stub.bodies)
        plain = generate(model, tok, q, qm, **sampling)
        assert torch.equal(plain.responses, rollout.responses)
        lens = rollout.response_mask.sum(1)
        assert 0 < int((lens < 40).sum()) < 12  # some rows ended early, some ran to the limit
        want = reward(rows, tok.batch_decode(plain.responses, skip_special_tokens=True), lens, "cpu", plain.is_eos)
        assert torch.equal(scores, want[0]) and comps.keys() == want[1].keys() and extras.keys() == want[2].keys()
        assert all(torch.equal(comps[k], want[1][k]) for k in comps) and torch.equal(extras["acc"], want[2]["acc"])
        assert streamed_requests > 3  # 12 rows in requests of 4: more than 3 because groups formed as rows ended
    finally:
        stub.close()
        reward.pool.close()


def test_a_service_is_called_while_the_batch_still_decodes_and_its_failure_is_raised_here(tiny):
    from common.core.sampling import sample_and_score

    tok, model, rows, q, qm, sampling = _early_ending(tiny)
    hook = model.register_forward_hook(lambda *a: time.sleep(0.05))  # a slow decoding step: ~2 s for 40 tokens
    stub = Stub(length_scores)
    stamps = []
    try:
        reward = Reward("remote:1.0", remote=RemoteScorer(ServiceConfig(stub.url)))
        import common.core.sampling

        real = common.core.sampling.generate
        common.core.sampling.generate = lambda *a, **k: (real(*a, **k), stamps.append(time.time()))[0]
        try:
            sample_and_score(model, tok, q, qm, rows, reward, "cpu", **sampling)
        finally:
            common.core.sampling.generate = real
        assert stub.times[0] < stamps[0] - 0.5  # the first group was scored while decoding went on
        dead = Reward("remote:1.0", remote=RemoteScorer(ServiceConfig("http://127.0.0.1:9/s", retries=0, timeout=2)))
        with pytest.raises(ServiceError, match="http://127.0.0.1:9/s"):
            sample_and_score(model, tok, q, qm, rows, dead, "cpu", **sampling)
    finally:
        hook.remove()
        stub.close()
