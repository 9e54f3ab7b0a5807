"""The reliability catalogue as users meet it: the bad inputs and faults, each run in a fresh process
against a checkout of this repository, and what happened, counted.

    python benchmarks/bad_inputs.py                      # this checkout
    git worktree add /tmp/before 95394da                 # the first wave, before the reliability work
    python benchmarks/bad_inputs.py --repo /tmp/before   # the same cases against it

Every case is a mistake a user makes (or a fault: a signal, a crashing reward function, a planted
pickle payload). Outcomes:
    one line     exit code != 0, at most 2 lines on stderr (after the libraries' import warnings), no traceback
    traceback    a Python traceback on stderr
    multi-line   exit code != 0, a message longer than 2 lines but no traceback (e.g. tyro's usage box)
    silent       exit code 0: the mistake was accepted (the run did something else than asked)
    hang         no exit within the time limit
    lost run     a fault left no resumable checkpoint (the work of the run is gone)
    left processes  a process the run started outlived it (any case: each runs with a marker in its environment,
                 looked for in /proc after it ends)
    code ran     a planted pickle payload executed (it creates a marker file)
and, besides, `left a folder`: a failed start that still created a run folder. The tiny model and
files are made here; cases from tests/*/test_bad_inputs.py are reused as they are.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(HERE), str(HERE / "tests"), str(HERE / "tests" / "helpers")]
NOISE = ("gemm_4bit", "real_accelerator", "kernels-community", "FutureWarning", "warnings.warn", "UserWarning")


class Payload:
    """Unpickling this opens (creates) the marker file: proof that a load ran code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def setup(work: Path) -> dict:
    from test_bad_inputs import make_bad_files

    from common.core.models import tiny_model

    f = {"tiny": tiny_model(work / "tiny"), **make_bad_files(work)}
    with open(work / "toy.jsonl", "w") as out:
        for i in range(16):
            out.write(
                json.dumps(
                    {
                        "prompt": [{"role": "user", "content": f"hi {i}"}],
                        "data_source": "toy",
                        "reward_model": {"ground_truth": ""},
                        "extra_info": {"index": i},
                    }
                )
                + "\n"
            )
    f["toy"] = str(work / "toy.jsonl")
    fns = {
        "nan": "return float('nan')",
        "raises": "raise KeyError('no such key')",
        "text": "return 'abc'",
        "crash": "import os; os._exit(3)",
        "hang": "import time; time.sleep(10000)",
        "one": "return 1.0",
        "none": "return None",
        "big": "return 3e38 if len(solution_str) % 2 else -3e38",
        "deaf": "import signal, time; signal.signal(signal.SIGALRM, signal.SIG_IGN); time.sleep(10000)",
        "ctrlc": "raise KeyboardInterrupt",
        "exits": "import sys; sys.exit(3)",
    }
    for name, body in fns.items():
        (work / f"r_{name}.py").write_text(
            f"def score(data_source, solution_str, ground_truth, extra_info=None):\n    {body}\n"
        )
        f[f"r_{name}"] = f"{work}/r_{name}.py:score"
    (work / "r_nofn.py").write_text("x = 1\n")
    f["r_nofn"] = f"{work}/r_nofn.py:score"
    presets = {
        "unknown_key": "learning_rat: 1e-5\n",
        "group_mean": "baseline: group_mean\n",
        "scale_no": "scale_rewards: no\n",
        "lr_text": "learning_rate: fast\n",
        "not_mapping": "- 1\n- 2\n",
        "bad_yaml": "a: [\n",
        "neg_steps": "total_steps: -3\n",
    }
    for name, text in presets.items():
        (work / f"{name}.yaml").write_text(text)
        f[f"y_{name}"] = str(work / f"{name}.yaml")
    envs = {  # issue 54's environments: each step's body
        "deaf": "import signal, time\n        for s in (signal.SIGALRM, signal.SIGRTMIN + 3):\n            "
        "signal.signal(s, signal.SIG_IGN)\n        time.sleep(10000)",
        "catches": "import time\n        while True:\n            try:\n                time.sleep(10000)\n"
        "            except BaseException:\n                pass",
        "exit": "import os; os._exit(3)",
        "fork": "import os; os.fork(); return Step(None, 1.0, True)",
        "tuple": "return ([], 1.0, True, {})",
        "tensor": "import torch; return Step(None, torch.ones(3), True)",
    }
    for name, body in envs.items():
        (work / f"e_{name}.py").write_text(
            "from common.core.envs import Environment, Step\n\n\nclass Env(Environment):\n"
            f"    def step(self, text, ids):\n        {body}\n"
        )
        f[f"e_{name}"] = f"{work}/e_{name}.py:Env"
    (work / "e_huge.py").write_text(
        "from common.core.envs import Environment\n\n\nclass Env(Environment):\n    def reset(self, row):\n"
        "        return [{'role': 'user', 'content': 'word ' * 200_000}]\n"
    )
    f["e_huge"] = f"{work}/e_huge.py:Env"
    (work / "not_parquet.parquet").write_text("this is text\n")
    f["not_parquet"] = str(work / "not_parquet.parquet")
    (work / "empty_sft.jsonl").write_text(json.dumps({"prompt": "q", "response": ""}) + "\n")
    f["empty_sft"] = str(work / "empty_sft.jsonl")
    (work / "same_pair.jsonl").write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": 7}) + "\n")
    f["int_rejected"] = str(work / "same_pair.jsonl")
    return f


def small(f):
    """A GRPO run small enough for seconds on the tiny model."""
    return [
        "--model-name-or-path",
        f["tiny"],
        "--train-files",
        f["toy"],
        "--num-prompts",
        "2",
        "--group-size",
        "2",
        "--mini-batch-size",
        "4",
        "--micro-batch-size",
        "4",
        "--max-new-tokens",
        "4",
        "--eval-every",
        "0",
    ]


def cases(f) -> list[dict]:
    """name, argv (after `python`), and `kind`: error (a mistake to refuse) or a fault with its own check."""
    from test_bad_inputs import CASES, TOY_REWARD

    out = []
    for script, flags, _ in CASES:
        flags = [x.format(**f) if any(f"{{{k}}}" in x for k in f) else x for x in flags]
        # a short run in case the mistake is accepted (the case's own flags come after, so they win)
        base = ["--total-steps", "2", "--eval-every", "0"] + (
            [] if "--model-name-or-path" in flags else ["--model-name-or-path", f["tiny"]]
        )
        out.append(
            {"name": f"{script} {' '.join(flags)}"[:90], "argv": [f"algos/{script}", *base, *flags], "kind": "error"}
        )
    tiny, run = f["tiny"], small(f)
    more = [
        # tools
        ("-m tools.evaluate --model (not --models)", ["-m", "tools.evaluate", "--model", tiny]),
        ("-m tools.evaluate --models ./missing", ["-m", "tools.evaluate", "--models", "./missing"]),
        (
            "-m tools.evaluate --data missing.parquet",
            ["-m", "tools.evaluate", "--models", tiny, "--data", "missing.parquet"],
        ),
        ("-m tools.evaluate --n -1", ["-m", "tools.evaluate", "--models", tiny, "--n", "-1"]),
        (
            "-m tools.evaluate --sample-temperature 0",
            ["-m", "tools.evaluate", "--models", tiny, "--n", "2", "--sample-temperature", "0"],
        ),
        (
            "-m tools.gen_preferences --prompts missing",
            ["-m", "tools.gen_preferences", "--model", tiny, "--prompts", "missing.parquet", "--out", "p.parquet"],
        ),
        (
            "-m tools.gen_preferences --group-size 1",
            [
                "-m",
                "tools.gen_preferences",
                "--model",
                tiny,
                "--prompts",
                f["toy"],
                "--group-size",
                "1",
                "--out",
                "p.parquet",
            ],
        ),
        ("-m tools.inspect_data missing.jsonl", ["-m", "tools.inspect_data", "missing.jsonl"]),
        ("-m tools.inspect_data latin-1 file", ["-m", "tools.inspect_data", f["latin1"]]),
        ("-m tools.compare no_runs/", ["-m", "tools.compare", "no_runs/"]),
        ("-m tools.export missing checkpoint", ["-m", "tools.export", "runs/none/checkpoints/step_3", "--out", "exp"]),
        (
            "-m tools.prepare_data --tasks no_such_task",
            ["-m", "tools.prepare_data", "--tasks", "no_such_task", "--out", "d"],
        ),
        (
            "-m tools.prepare_data --test-fraction 1.5",
            ["-m", "tools.prepare_data", "--test-fraction", "1.5", "--out", "d"],
        ),
        # presets
        ("--config unknown key", ["algos/ppo_llm.py", "--config", f["y_unknown_key"]]),
        ("--config baseline: group_mean", ["algos/grpo_llm.py", "--config", f["y_group_mean"]]),
        ("--config scale_rewards: no", ["algos/grpo_llm.py", "--config", f["y_scale_no"]]),
        ("--config learning_rate: fast", ["algos/ppo_llm.py", "--config", f["y_lr_text"]]),
        ("--config a list", ["algos/dpo_llm.py", "--config", f["y_not_mapping"]]),
        ("--config invalid YAML", ["algos/sft_llm.py", "--config", f["y_bad_yaml"]]),
        ("--config total_steps: -3", ["algos/grpo_llm.py", "--config", f["y_neg_steps"]]),
        # reward functions (no fallback: the run must stop with the row named)
        ("reward fn returns NaN", ["algos/grpo_llm.py", *run, "--total-steps", "1", "--reward-fn", f["r_nan"]]),
        ("reward fn raises", ["algos/grpo_llm.py", *run, "--total-steps", "1", "--reward-fn", f["r_raises"]]),
        ("reward fn returns text", ["algos/grpo_llm.py", *run, "--total-steps", "1", "--reward-fn", f["r_text"]]),
        ("reward fn returns None", ["algos/grpo_llm.py", *run, "--total-steps", "1", "--reward-fn", f["r_none"]]),
        ("reward fn file has no such function", ["algos/grpo_llm.py", *run, "--reward-fn", f["r_nofn"]]),
        ("reward fn kills its process", ["algos/grpo_llm.py", *run, "--total-steps", "1", "--reward-fn", f["r_crash"]]),
        # data
        ("a .parquet file that is text", ["algos/grpo_llm.py", *run[:2], "--train-files", f["not_parquet"]]),
        ("--val-files missing", ["algos/grpo_llm.py", *run, "--val-files", "missing.jsonl"]),
        ("SFT response empty", ["algos/sft_llm.py", "--model-name-or-path", tiny, "--train-files", f["empty_sft"]]),
        (
            "DPO rejected is a number",
            ["algos/dpo_llm.py", "--model-name-or-path", tiny, "--train-files", f["int_rejected"]],
        ),
    ]
    out += [
        {"name": n, "argv": a, "kind": "error", "started": n.startswith("reward fn") and "no such function" not in n}
        for n, a in more
    ]
    out += [
        {
            "name": "reward fn hangs (default timeout)",
            "argv": ["algos/grpo_llm.py", *run, "--total-steps", "1", "--reward-fn", f["r_hang"]],
            "kind": "error",
            "timeout": 150,
            "started": True,
        },
        {
            "name": "SIGTERM at step 2 of 6",
            "argv": ["algos/grpo_llm.py", *run, "--total-steps", "6", "--reward-fn", f["r_one"]],
            "kind": "signal",
        },
        {
            "name": "reward fn kills its process, --reward-fallback 0",
            "kind": "survive",
            "argv": [
                "algos/grpo_llm.py",
                *run,
                "--total-steps",
                "2",
                "--save-every",
                "2",
                "--reward-fn",
                f["r_crash"],
                "--reward-fallback",
                "0",
            ],
        },
        {
            "name": "overflowing rewards: weights saved finite",
            "kind": "finite",
            "argv": [
                "algos/grpo_llm.py",
                *run,
                "--total-steps",
                "2",
                "--save-every",
                "2",
                "--reward-fn",
                f["r_big"],
                "--scale-rewards",
                "none",
                "--loss-agg",
                "token-mean",
            ],
        },
        {
            "name": "resume a run with a pickle payload in trainer_state.pt",
            "kind": "payload",
            "argv": ["algos/grpo_llm.py", *run, "--total-steps", "3", "--reward-fn", TOY_REWARD],
        },
        {
            "name": "resume a GRPO run with ppo_llm.py",
            "kind": "resume_error",
            "resume_with": "algos/ppo_llm.py",
            "resume_flags": ["--model-name-or-path", tiny, "--train-files", f["toy"], "--total-steps", "3"],
            "argv": ["algos/grpo_llm.py", *run, "--total-steps", "2", "--save-every", "2", "--reward-fn", f["r_one"]],
        },
        {
            "name": "resume with a different --learning-rate",
            "kind": "resume_error",
            "extra": ["--total-steps", "3", "--learning-rate", "0.1"],
            "argv": ["algos/grpo_llm.py", *run, "--total-steps", "2", "--save-every", "2", "--reward-fn", f["r_one"]],
        },
        # issue 38, second part: functions that ignore SIGALRM, raise KeyboardInterrupt or exit, in-process too
        *[
            {
                "name": f"reward fn {fn}, --reward-workers {w}, --reward-fallback 0",
                "kind": "survive",
                "timeout": 120,
                "argv": [
                    "algos/grpo_llm.py",
                    *run,
                    "--total-steps",
                    "1",
                    "--save-every",
                    "1",
                    "--reward-fn",
                    f[f"r_{fn}"],
                    "--reward-fallback",
                    "0",
                    "--reward-timeout",
                    "2",
                    "--reward-workers",
                    str(w),
                ],
            }  # fmt: skip
            for fn in ("deaf", "ctrlc", "exits")
            for w in (0, 2)
        ],
        # issue 54: environments that misbehave (each a counted failure in env/errors, and the run goes on)
        *[
            {
                "name": f"--env that {what}{' (--no-env-workers)' if not workers else ''}",
                "kind": "survive",
                "timeout": 150,
                "argv": [
                    "algos/grpo_llm.py",
                    *run,
                    "--total-steps",
                    "1",
                    "--save-every",
                    "1",
                    "--reward-fn",
                    f["r_one"],
                    "--env",
                    f[f"e_{what}"],
                    "--env-timeout",
                    "3",
                    "--max-turns",
                    "2",
                    *([] if workers else ["--no-env-workers"]),
                ],
            }  # fmt: skip
            for what, workers in (
                ("deaf", True),
                ("catches", True),
                ("exit", True),
                ("fork", True),
                ("fork", False),
                ("tuple", True),
                ("tensor", True),
                ("huge", True),
            )  # fmt: skip
        ],
        # a resume of a run folder that was tampered with: damaged files, a foreign or linked step, no args.json
        *[
            {
                "name": f"resume after: {what}",
                "kind": "tamper",
                "tamper": what,
                "argv": [
                    "algos/grpo_llm.py",
                    *run,
                    "--total-steps",
                    "2",
                    "--save-every",
                    "1",
                    "--reward-fn",
                    f["r_one"],
                ],
            }
            for what in (
                "cut trainer_state.pt",
                "cut model.safetensors",
                "args.json deleted, new --learning-rate",
                "step_N copied from another run",
                "step_N linked to another run",
            )  # fmt: skip
        ],
        # issue 54: async_grpo.py's generator and trainer under faults (every process gone at the end: no helper
        # outlives the run); and a /dev/shm too small for its weight mailbox (a 1 MB tmpfs in a mount namespace)
        *[
            {
                "name": f"async: {what}",
                "kind": "async_fault",
                "target": target,
                "signals": sigs,
                "checkpoint": ckpt,
                "argv": [
                    "algos/async_grpo.py",
                    *run,
                    "--total-steps",
                    "30",
                    "--reward-fn",
                    f["r_one"],
                    "--generator-timeout",
                    "30",
                    "--reward-workers",
                    "2",
                ],
            }  # fmt: skip
            for what, target, sigs, ckpt in (
                ("generator frozen (SIGSTOP) at step 3, --generator-timeout 30", "generator", ["SIGSTOP"], True),
                ("generator killed (SIGKILL) at step 3", "generator", ["SIGKILL"], True),
                ("trainer killed (SIGKILL) at step 3", "trainer", ["SIGKILL"], False),
                ("trainer stopped (SIGTERM) at step 3", "trainer", ["SIGTERM"], True),
                ("trainer stopped by Ctrl-C twice at step 3", "trainer", ["SIGINT", "SIGINT"], False),
            )  # fmt: skip
        ],
        {
            "name": "async: /dev/shm of 1 MB (the weight mailbox does not fit)",
            "kind": "error",
            "prefix": [
                "unshare",
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"',
                "sh",
            ],  # fmt: skip
            "argv": ["algos/async_grpo.py", *run, "--total-steps", "2", "--reward-fn", f["r_one"]],
            "started": True,
        },
        {
            "name": "resume with --total-steps <= the checkpoint's step",
            "kind": "resume_error",
            "extra": ["--total-steps", "2"],
            "argv": ["algos/grpo_llm.py", *run, "--total-steps", "2", "--save-every", "2", "--reward-fn", f["r_one"]],
        },
    ]
    return out


def descendants(pid: int) -> set[int]:
    """The live processes below `pid` (each process's parent, from /proc)."""
    parents = {q: parent_of(q) for q in map(int, filter(str.isdigit, os.listdir("/proc"))) if alive(q)}
    found, frontier = set(), {pid}
    while frontier:
        frontier = {q for q, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _stat(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return ["X", "0"]


def parent_of(pid: int) -> int:
    return int(_stat(pid)[1])


def alive(pid: int) -> bool:
    return _stat(pid)[0] not in ("Z", "X")


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def significant(stderr: str) -> list[str]:
    return [ln for ln in stderr.strip().splitlines() if ln.strip() and not any(n in ln for n in NOISE)]


def classify_error(proc, cwd: Path) -> str:
    if proc is None:  # still running at the time limit: training on (silently accepted), or stuck
        return "silent" if list((cwd / "out").glob("*/metrics.jsonl")) else "hang"
    if "Traceback (most recent call last)" in proc.stderr:
        return "traceback"
    if proc.returncode == 0:
        return "silent"
    return "one line" if len(significant(proc.stderr)) <= 2 else "multi-line"


def for_revision(repo: Path, argv: list[str]) -> list[str]:
    """The same mistake in an older checkout's vocabulary: before the tools moved to tools/ and the
    sample counts were renamed, `python -m common.X`, dpo's --num-samples and gen_preferences' --k."""
    if (repo / "tools").is_dir():
        return argv
    out = [a.replace("tools.", "common.", 1) if a.startswith("tools.") else a for a in argv]
    script = next((a for a in out if a.endswith(".py") or a.startswith("common.")), "")
    renamed = {"dpo_llm.py": "--num-samples", "common.gen_preferences": "--k"}
    for key, old in renamed.items():
        if script.endswith(key):
            out = [old if a == "--group-size" else a for a in out]
    return out


def marked(marker: str) -> list[int]:
    """The processes whose environment holds `marker` (each case's processes inherit it): what a case left."""
    found = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if marker.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") and alive(pid):
                found.append(pid)
        except OSError:
            pass
    return found


def run_case(repo: Path, case: dict, cwd: Path, env: dict) -> dict:
    marker = f"CLEANRLHF_BAD_INPUT_CASE={cwd}"
    result = _run_case(repo, case, cwd, {**env, "CLEANRLHF_BAD_INPUT_CASE": str(cwd)})
    time.sleep(1)  # what dies with the run (PR_SET_PDEATHSIG, a pool's shutdown) has a second
    left = marked(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    if left:  # (a hang stays a hang: its processes were killed at the time limit's end, not by the run)
        outcome = result["outcome"] if result["outcome"] == "hang" else "left processes"
        result |= {"outcome": outcome, "detail": f"{len(left)} processes left: {result['detail']}"}
    return result


def _run_case(repo: Path, case: dict, cwd: Path, env: dict) -> dict:
    case = {**case, "argv": for_revision(repo, case["argv"])}

    def call(argv, timeout=case.get("timeout", 150)):
        try:
            return subprocess.run(
                [*case.get("prefix", []), sys.executable, *argv, "--output-dir", str(cwd / "out")],
                cwd=cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return None

    argv = [str(repo / a) if a.startswith("algos/") else a for a in case["argv"]]
    if argv[0] == "-m":
        argv = argv[:]  # tools take no --output-dir: run them without it
    kind, start, leftover = case["kind"], time.time(), False
    if kind == "error":
        if argv[0] == "-m":
            try:
                proc = subprocess.run(
                    [sys.executable, *argv],
                    cwd=cwd,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=case.get("timeout", 150),
                )
            except subprocess.TimeoutExpired:
                proc = None
        else:
            proc = call(argv)
        outcome = classify_error(proc, cwd)
        leftover = (
            outcome != "silent" and not case.get("started") and (cwd / "out").exists() and any((cwd / "out").iterdir())
        )
        detail = (significant(proc.stderr) or [""])[-1][:160] if proc else ""
    elif kind == "signal":
        p = subprocess.Popen(
            [sys.executable, *argv, "--output-dir", str(cwd / "out")],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for line in p.stdout:
            if line.startswith("step 2:"):
                p.send_signal(signal.SIGTERM)
                break
        try:
            p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
        ckpts = list((cwd / "out").glob("*/checkpoints/step_*"))
        outcome = "ok" if ckpts and p.returncode != 0 else "lost run" if not ckpts else "silent"
        detail = f"exit {p.returncode}, checkpoints {sorted(c.name for c in ckpts)}"
    elif kind == "survive":
        proc = call(argv)
        ckpts = list((cwd / "out").glob("*/checkpoints/step_*"))
        outcome = "hang" if proc is None else "ok" if proc.returncode == 0 and ckpts else "lost run"
        detail = "" if proc is None else f"exit {proc.returncode}: {(significant(proc.stderr) or [''])[-1][:120]}"
    elif kind == "finite":
        proc = call(argv)
        import torch
        from safetensors.torch import load_file

        files = list((cwd / "out").glob("*/checkpoints/step_*/policy/model.safetensors"))
        finite = all(torch.isfinite(t).all() for fl in files for t in load_file(fl).values())
        outcome = "lost run" if not files else "ok" if finite else "silent"
        detail = f"{len(files)} checkpoint(s), finite: {finite}"
    elif kind == "payload":
        import torch

        proc = call([*argv[:-2], "--total-steps", "2", "--save-every", "2", *argv[-2:]])
        states = list((cwd / "out").glob("*/checkpoints/step_2/trainer_state.pt"))
        marker = cwd / "PWNED"
        if not states:
            outcome, detail = "lost run", "no checkpoint to plant into"
        else:
            torch.save({"payload": Payload(str(marker))}, states[0])
            proc = call([*argv, "--resume", str(states[0].parents[2])])
            outcome = "code ran" if marker.exists() else classify_error(proc, cwd)
            outcome = "one line" if outcome == "one line" else outcome
            detail = (significant(proc.stderr) or [""])[-1][:160] if proc else ""
    elif kind == "resume_error":
        call(argv)
        runs = list((cwd / "out").glob("*/checkpoints/step_2"))
        if not runs:
            outcome, detail = "lost run", "no checkpoint"
        else:
            script = str(repo / case.get("resume_with", case["argv"][0]))
            flags = case.get("resume_flags", argv[1:])
            proc = call([script, *flags, *case.get("extra", []), "--resume", str(runs[0].parents[1])])
            outcome = classify_error(proc, cwd)
            detail = (significant(proc.stderr) or [""])[-1][:160] if proc else ""
    elif kind == "async_fault":  # a signal to the generator (the trainer's multiprocessing child) or the trainer
        p = subprocess.Popen([sys.executable, *argv, "--output-dir", str(cwd / "out")], cwd=cwd, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        for line in p.stdout:
            if line.startswith("step 3:"):
                break
        started = descendants(p.pid)
        generator = next((q for q in started if parent_of(q) == p.pid and b"spawn_main" in cmdline(q)), None)
        target = p.pid if case["target"] == "trainer" else generator
        for i, name in enumerate(case["signals"]):
            if target is not None:
                time.sleep(0.3 if i else 0)
                os.kill(target, getattr(signal, name))
        try:
            _, err = p.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            p.kill()
            err = None
        time.sleep(2)  # what dies with the trainer (PR_SET_PDEATHSIG) has 2 s
        left = sorted(q for q in started if alive(q))
        for q in left:
            os.kill(q, signal.SIGKILL)
        ckpts = list((cwd / "out").glob("*/checkpoints/step_*"))
        if err is None:
            outcome = "hang"
        elif left:
            outcome = "left processes"
        elif case["checkpoint"] and not ckpts:
            outcome = "lost run"
        elif case["target"] == "generator":  # the trainer reports it: one line
            outcome = "ok" if classify_error(subprocess.CompletedProcess([], p.returncode, "", err), cwd) == "one line" else "traceback" if "Traceback" in err else "multi-line"  # fmt: skip
        else:
            outcome = "traceback" if "Traceback" in err else "ok"
        detail = f"generator {generator}, exit {p.returncode}, {len(started)} processes, left {left}, " + (
            f"checkpoints {sorted(c.name for c in ckpts)}: {(significant(err or '') or [''])[-1][:100]}"
        )
    elif kind == "tamper":  # two runs of 2 steps (a checkpoint each step); the first is tampered with, then resumed
        import shutil

        call(argv)
        call(argv)
        runs = sorted((cwd / "out").glob("*/checkpoints"), key=lambda p: p.stat().st_mtime)
        if len(runs) < 2:
            outcome, detail = "lost run", "no checkpoints"
        else:
            mine, other, what, extra = runs[0], runs[1], case["tamper"], []
            cut = lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            if what.startswith("cut trainer_state"):
                cut(mine / "step_2/trainer_state.pt")
            elif what.startswith("cut model"):
                cut(mine / "step_2/policy/model.safetensors")
            elif what.startswith("args.json"):
                (mine.parent / "args.json").unlink()
                extra = ["--learning-rate", "0.1"]
            elif "copied" in what:
                shutil.copytree(other / "step_2", mine / "step_3")
            else:
                (mine / "step_3").symlink_to(other / "step_2")
            proc = call(
                [*argv[:-4], "--reward-fn", argv[-1], "--total-steps", "4", *extra, "--resume", str(mine.parent)]
            )
            outcome = classify_error(proc, cwd)
            detail = (significant(proc.stderr) or [""])[-1][:160] if proc else ""
    return {
        "case": case["name"],
        "kind": kind,
        "outcome": outcome,
        "left_folder": leftover,
        "seconds": round(time.time() - start, 1),
        "detail": detail,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", default=str(HERE), help="the checkout to test (default: this one)")
    p.add_argument("--out", default=None, help="write the per-case results here as JSON lines")
    p.add_argument("--only", default=None, help="run the cases whose name contains this text")
    p.add_argument("--start", type=int, default=0, help="skip the first N cases (continue an interrupted run)")
    a = p.parse_args()
    repo = Path(a.repo).resolve()
    work = Path(tempfile.mkdtemp(prefix="bad_inputs_"))
    f = setup(work)
    env = {**os.environ, "PYTHONPATH": str(repo), "TOY_MODEL": f["tiny"], "WANDB_MODE": "disabled"}
    env.pop("CLEANRLHF_DEBUG", None)
    todo = [c for c in cases(f) if not a.only or a.only in c["name"]][a.start :]
    results = []
    for i, case in enumerate(todo):
        cwd = work / f"case_{i:03d}"
        cwd.mkdir()
        r = run_case(repo, case, cwd, env)
        results.append(r)
        print(
            f"{i + 1:3d}/{len(todo)} {r['outcome']:<10} {r['seconds']:6.1f}s  {r['case']}  | {r['detail']}", flush=True
        )
        if a.out:
            with open(a.out, "a") as out:
                out.write(json.dumps(r) + "\n")
    counts = Counter(r["outcome"] for r in results)
    print(f"\n{repo} ({len(results)} cases)\n\n| outcome | cases |\n|---|---|")
    for k in ("one line", "ok", "multi-line", "traceback", "silent", "hang", "lost run", "left processes", "code ran"):
        print(f"| {k} | {counts.get(k, 0)} |")
    print(f"| (failed start left a run folder) | {sum(r['left_folder'] for r in results)} |")


if __name__ == "__main__":
    main()
