"""Shared fixtures (tiny random models saved to folders and loaded through the users' code path) and the
test tiers.

Tiers (pytest.ini): a test that launches a script, a tool or a launcher as a process carries a marker:
    smoke        one short run per script (the fast tier's launches: tests/scripts/test_smoke.py)
    bare         a bare interpreter in the fast tier: the standard library and common/integrations/sandbox.py, no torch
    (a
                 venv under /tmp running the Python tool: well under a second)
    e2e          other script or tool runs as processes (resume, learning, pipelines, refusals)
    distributed  `accelerate launch` / torchrun with 2-4 processes
    vllm         the vLLM engine
    slow         the real SmolLM2-135M-Instruct model, or minutes of training
`python -m pytest -q` (the README's test command) runs the unmarked tests and the smoke runs;
`python -m pytest -q -m ""` runs everything, as CI does. The guard below fails an unmarked test that
launches a Python process, so the fast tier cannot grow back into the full suite.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "helpers")]  # the launch helpers (zygote, toy_reward, ...)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A 2-layer, hidden-64 Llama with the SmolLM2 tokenizer (init std 0.02)."""
    from common.core.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_peaky(tmp_path_factory):
    """The same with init std 0.2: peaky next-token distributions, for learning tests."""
    from common.core.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny_peaky"), init_std=0.2)


@pytest.fixture(scope="session")
def tiny_agent(tmp_path_factory):
    """A peaky tiny model (one head of 64: vLLM's CPU attention takes it) fine-tuned in-process (~15 s) to answer the
    toy prompts with short turns that end with EOS: half of them a calculator call `<tool_call>{...}</tool_call>`,
    half a number. A random model never ends a turn within a few tokens, so multi-turn end-to-end runs
    (tests/*/test_envs.py) need it to see more than one turn."""
    from types import SimpleNamespace

    import torch

    from common.core import chat
    from common.core import models as M
    from common.integrations.builtin_envs import ToolEnv

    src = M.tiny_model(tmp_path_factory.mktemp("tiny_agent_init"), heads=1, init_std=0.2)
    tok = chat.load_tokenizer(src)
    model = M.load_causal_lm(src, tok)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    words = ["hi", "hello", "count", "go", "yes", "no", "up", "down"]
    seqs = []
    for i in range(16):  # each prompt plain (--env feedback) and with the calculator's protocol (--env tools)
        user = SimpleNamespace(messages=[{"role": "user", "content": f"{words[i % 8]} {i}"}], text="")
        for messages in (user.messages, ToolEnv(("calculator",)).reset(user)):
            p = tok(chat.apply_chat(tok, messages), add_special_tokens=False)["input_ids"]
            seqs.append((p, tok(call if i % 2 else str(i), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
    L = max(len(p) + len(r) for p, r in seqs)
    x = torch.full((len(seqs), L), tok.pad_token_id)
    attn, target = torch.zeros(len(seqs), L, dtype=torch.long), torch.full((len(seqs), L), -100)
    for k, (p, r) in enumerate(seqs):
        x[k, : len(p) + len(r)], attn[k, : len(p) + len(r)] = torch.tensor(p + r), 1
        target[k, len(p) - 1 : len(p) + len(r) - 1] = torch.tensor(r)  # position t predicts token t + 1
    pick = target != -100
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(30):  # the vocabulary projection only where a response token is predicted
        hidden = model.model(input_ids=x, attention_mask=attn).last_hidden_state  # (16, L, H)
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[pick]), target[pick])
        loss.backward()
        opt.step()
        opt.zero_grad()
    out = tmp_path_factory.mktemp("tiny_agent")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def toy_prompts(tmp_path_factory):
    """32 short prompts in verl's schema with data_source 'toy' (scored by tests/helpers/toy_reward.py)."""
    path = tmp_path_factory.mktemp("toy") / "toy.jsonl"
    words = ["hi", "hello", "count", "go", "yes", "no", "up", "down"]
    with open(path, "w") as f:
        for i in range(32):
            f.write(
                json.dumps(
                    {
                        "prompt": [{"role": "user", "content": f"{words[i % 8]} {i}"}],
                        "data_source": "toy",
                        "reward_model": {"style": "rule", "ground_truth": ""},
                        "extra_info": {"index": i},
                    }
                )
                + "\n"
            )
    return str(path)


@pytest.fixture(scope="session")
def grpo_toy_teacher(tiny_peaky, toy_prompts, tmp_path_factory):
    """grpo_llm.py on the toy task, 15 steps (float32): its run folder, whose last checkpoint is test_distill's
    teacher (both of its learning tests). One run per session: under xdist the tests that use it share a group."""
    out = tmp_path_factory.mktemp("grpo_toy")
    run_script(
        "grpo_llm.py", "--model-name-or-path", tiny_peaky, "--train-files", toy_prompts,
        "--reward-fn", f"{REPO}/tests/helpers/toy_reward.py:compute_score", "--output-dir", out, "--total-steps", 15,
        "--num-prompts", 8, "--group-size", 4, "--mini-batch-size", 16, "--micro-batch-size", 16,
        "--max-new-tokens", 6, "--learning-rate", 3e-3, "--update-epochs", 2, "--eval-every", 0,
        env={"TOY_MODEL": tiny_peaky},
    )  # fmt: skip
    return only_run(out)


def accelerate_launch(config="cpu_2proc", processes=None) -> list[str]:
    """`accelerate launch --config_file configs/accelerate/CONFIG.yaml` with a free rendezvous port (accelerate's
    `--main_process_port 0`): launchers default to port 29500, and under xdist two tests that launch processes can
    run at once (a vLLM test on one worker, a distributed one on the other: CI failed with EADDRINUSE)."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / f"configs/accelerate/{config}.yaml"),
    ]
    return [*cmd, "--main_process_port", "0", *(["--num_processes", str(processes)] if processes else [])]


def accelerate_ranks(config="cpu_2proc", processes=None, env=None) -> list[dict]:
    """The environment of each process `accelerate launch` (accelerate_launch's command) would start: accelerate's
    own launch_command, up to the call that hands the environment it made to torchrun, then the variables torchrun's
    agent adds per rank (rank, world size, rendezvous address; the store hosted by rank 0, as no agent runs).
    tests/*/test_house.py checks this against a real launch for every CPU config."""
    from unittest import mock

    import torch.distributed.run as distrib_run
    from accelerate.commands.launch import launch_command, launch_command_parser

    seen = {}

    def torchrun(args):  # the environment and the flags accelerate hands torchrun
        seen.update(env=dict(os.environ), n=int(args.nproc_per_node), port=args.master_port)

    argv = [*accelerate_launch(config, processes)[3:], str(REPO / "algos" / "x.py")]
    with mock.patch.dict(os.environ, env or {}), mock.patch.object(distrib_run, "run", torchrun):
        launch_command(launch_command_parser().parse_args(argv))
    n, base = seen["n"], seen["env"]
    agent = dict(GROUP_RANK="0", ROLE_NAME="default", LOCAL_WORLD_SIZE=str(n), WORLD_SIZE=str(n), GROUP_WORLD_SIZE="1",
                 ROLE_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(seen["port"]),
                 TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none",
                 TORCHELASTIC_USE_AGENT_STORE="False", TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                 TORCH_NCCL_ASYNC_ERROR_HANDLING=base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))  # fmt: skip
    return [{**base, **agent, "RANK": str(r), "ROLE_RANK": str(r), "LOCAL_RANK": str(r)} for r in range(n)]


def launch_ranks(script, *flags, env=None, config="cpu_2proc", processes=None, timeout=600):
    """`accelerate launch --config_file configs/accelerate/CONFIG.yaml algos/SCRIPT flags`, its processes forked from
    the test zygote (tests/helpers/zygote.py: the imports done once, and no launcher process) with the environment the launch
    would give each (accelerate_ranks); a fresh `accelerate launch` where the zygote cannot serve it (an import-time
    variable differs; CLEANRLHF_TEST_ZYGOTE=0). Returns the CompletedProcess (every rank's output; the first
    failure's code). A 2-process launch of the tests spent ~16 of its ~27 CPU seconds starting: the launcher's
    imports and each worker's."""
    cmd = [*accelerate_launch(config, processes), str(REPO / "algos" / script), *map(str, flags)]
    full = {**os.environ, **(env or {})}
    if _UNTIERED:
        _UNTIERED[0](cmd)
    deepspeed = "DEEPSPEED" in (REPO / f"configs/accelerate/{config}.yaml").read_text()  # its launcher adds PYTHONPATH
    if os.environ.get("CLEANRLHF_TEST_ZYGOTE", "1") != "0" and not deepspeed:
        from zygote import Zygote, import_env

        ranks = accelerate_ranks(config, processes, env)
        key = import_env(full)
        if key not in _ZYGOTE and len(_ZYGOTE) < 3:
            import atexit
            import tempfile

            _ZYGOTE[key] = Zygote(Path(tempfile.mkdtemp(prefix="zygote-")), full)
            atexit.register(_ZYGOTE[key].close)
        z = _ZYGOTE.get(key)
        argv = [sys.executable, str(REPO / "algos" / script), *map(str, flags)]
        if z is not None and all(z.serves(argv, r, Path.cwd()) for r in ranks):
            if os.environ.get("CLEANRLHF_ZYGOTE_LOG"):
                with open(os.environ["CLEANRLHF_ZYGOTE_LOG"], "a") as f:
                    f.write(f"served {script} ranks={len(ranks)}\n")
            return z.run_ranks(argv, ranks, timeout, Path.cwd())
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full)


TIERS = ("smoke", "bare", "e2e", "distributed", "vllm", "slow")
# each tier's folder and the markers its tests carry (one at least, bare or none in unit/): tests/README.md
FOLDERS = {
    "unit": ("", "bare"),
    "scripts": ("smoke", "e2e", "slow"),
    "multi_process": ("distributed",),
    "vllm_engines": ("vllm",),
}
# fixtures that tests of two tiers share, in tests/helpers/
pytest_plugins = ["shared_sandbox_service", "shared_tool_learning"]


PARITY_FIXTURES = ("ppo_ddp_run",)  # module fixtures of runs several tests compare with (test_distributed.py)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`, as .ci/run runs the tiers beyond the fast one), tests that share
    a run run on one worker, one after another: the vLLM tests (module fixtures holding an engine; an engine each;
    those of test_vllm_server.py, a group of their own around their module's server),
    the real-model tests, the parity tests (test_distributed.one_process_run's reference runs and the module's DDP
    run) and the users of the GRPO toy teacher. Everything else, multi-process launches included (free ports; one
    torch thread per process: _one_thread_per_launched_process), is balanced over the workers. Without xdist the
    marks do nothing. And each test sits in its tier's folder (FOLDERS)."""
    misplaced = []
    for item in items:
        folder = item.path.parent.name
        marks = [m for m in TIERS if item.get_closest_marker(m)]
        if folder not in FOLDERS or not (set(marks) & set(FOLDERS[folder]) or ("" in FOLDERS[folder] and not marks)):
            misplaced.append(f"{item.nodeid} (markers: {', '.join(marks) or 'none'})")
        names = set(getattr(item, "fixturenames", ()))
        if "served" in names:  # test_vllm_server.py: its module's server (a process of its own, beside the engines)
            item.add_marker(pytest.mark.xdist_group("vllm_server"))
            continue
        for marker, group in (("vllm", "vllm"), ("slow", "smollm2"), ("smoke", "smoke")):
            if item.get_closest_marker(marker):
                item.add_marker(pytest.mark.xdist_group(group))
                break
        else:
            if item.get_closest_marker("parity") or names & set(PARITY_FIXTURES):
                item.add_marker(pytest.mark.xdist_group("parity"))
            elif "grpo_toy_teacher" in names:  # one worker trains it once for them all
                item.add_marker(pytest.mark.xdist_group("grpo_toy"))
    if misplaced:
        raise pytest.UsageError(
            "tests outside their tier's folder (tests/conftest.py FOLDERS: unit/ in-process, scripts/ smoke, e2e, slow; "
            "multi_process/ distributed; vllm_engines/ vllm): " + "; ".join(misplaced[:5])
        )


@pytest.fixture(scope="session", autouse=True)
def _one_thread_per_launched_process():
    """Every script, launcher and tool a test launches runs torch on one thread (OMP_NUM_THREADS=1, set after
    collection: this process's own torch keeps its threads). The same numbers on any machine and any number of
    xdist workers (a learning curve depends on the thread count: float sums in another order), and two workers'
    launches share 2 cores without oversubscribing them (a bf16 learning test: 244 s with 2 threads per process
    beside the other worker's, 52 s with one)."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    if old is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = old


def _launches_python(cmd) -> bool:
    argv = [cmd] if isinstance(cmd, (str, os.PathLike)) else list(cmd)
    if argv[1:3] == [
        "-I",
        "-S",
    ]:  # the Python tool's child (common/integrations/sandbox.py): a bare interpreter, milliseconds
        return False
    words = " ".join(map(str, argv)).split()
    first = Path(words[0]).name if words else ""
    return first.startswith("python") or first in ("accelerate", "torchrun") or str(words[0]) == sys.executable


_UNTIERED = []  # the running test's id while it carries no tier marker (for run_script's zygote launches)


@pytest.fixture(autouse=True)
def _fast_tier_guard(request, monkeypatch):
    """An unmarked test may not launch a Python process (a script, a tool, a launcher): mark it (TIERS)."""
    if any(request.node.get_closest_marker(m) for m in TIERS):
        yield
        return
    real_init = subprocess.Popen.__init__

    def refuse(args):
        pytest.fail(
            f"{request.node.nodeid} launches {' '.join(map(str, args))[:120]!r} but carries no tier marker: "
            "mark it e2e (or distributed, vllm, slow), or test in-process"
        )

    def guarded(self, args, *a, **kw):
        if _launches_python(args):
            refuse(args)
        return real_init(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
    _UNTIERED[:] = [refuse]
    yield
    _UNTIERED.clear()


# this process's tests/zygote.Zygote per import-time environment (an in-process vLLM import sets LD_PRELOAD and
# more: the launches after it get a zygote started with them), started at the first launch that needs it
_ZYGOTE = {}


def run_script(script: str, *flags, env=None, timeout=600, check=True, fresh=False):
    """Run algos/<script> as a process (as users do: `python algos/<script> flags`); returns the CompletedProcess.
    A child of the test zygote (tests/helpers/zygote.py: the imports done once) where it runs the script as a fresh process
    would, else (or `fresh`: a start's own output checked) a new interpreter."""
    return launch_python([str(REPO / "algos" / script), *map(str, flags)], env, timeout, check, fresh)


def run_tool(module: str, *flags, env=None, timeout=600, check=True):
    """`python -m tools.X flags` from the repository, as run_script runs a script."""
    return launch_python(["-m", module, *map(str, flags)], env, timeout, check, cwd=REPO)


def launch_python(args: list[str], env=None, timeout=600, check=True, fresh=False, cwd=None):
    cmd, env, cwd = [sys.executable, *args], {**os.environ, **(env or {})}, Path(cwd or os.getcwd())
    if _UNTIERED:
        _UNTIERED[0](cmd)
    proc = None
    if not fresh and os.environ.get("CLEANRLHF_TEST_ZYGOTE", "1") != "0":
        from zygote import Zygote, import_env

        key = import_env(env)
        if key not in _ZYGOTE and len(_ZYGOTE) < 3:  # at most 3 warm processes (~0.5 GB each) per test process
            import atexit
            import tempfile

            _ZYGOTE[key] = Zygote(Path(tempfile.mkdtemp(prefix="zygote-")), env)
            atexit.register(_ZYGOTE[key].close)
        z = _ZYGOTE.get(key)
        served = z is not None and z.serves(cmd, env, cwd)
        if os.environ.get("CLEANRLHF_ZYGOTE_LOG"):  # which launches a zygote served, which started fresh
            with open(os.environ["CLEANRLHF_ZYGOTE_LOG"], "a") as f:
                f.write(f"{'served' if served else 'fresh'} {Path(args[0]).name} zygotes={len(_ZYGOTE)}\n")
        if served:
            proc = z.run(cmd, env, timeout, cwd)
    if proc is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


def only_run(output_dir) -> Path:
    runs = [p for p in Path(output_dir).iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]
