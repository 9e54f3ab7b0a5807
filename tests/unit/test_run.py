"""Run plumbing: config presets, run folder, checkpoints (atomic, resumable), RNG state round trip."""

import json
import os
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator

from common.core import errors as E
from common.harness import checkpoint as C
from common.harness import cli as CLI
from common.harness import run as R
from common.harness import tracking
from common.harness.args import Group, RunArgs, group


@dataclass
class ToyArgs:
    lr: float = 0.1
    """learning rate"""
    run: Group[RunArgs] = group(RunArgs, exp_name="toy")
    """the shared run flags, flat (--seed, --output-dir, ...)"""


class _Wrap(torch.nn.Module):
    """A minimal savable model for checkpoint tests."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def save_pretrained(self, path, state_dict=None, safe_serialization=True):
        Path(path).mkdir(parents=True)
        torch.save(state_dict, Path(path) / "w.pt")


def test_config_preset_then_cli_overrides(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 0.5\nexp-name: from_yaml\n")
    a = CLI.parse_args(ToyArgs, ["--config", str(cfg)])
    assert (a.lr, a.run.exp_name, a.run.config) == (0.5, "from_yaml", str(cfg))
    b = CLI.parse_args(ToyArgs, ["--config", str(cfg), "--lr", "0.25"])
    assert (b.lr, b.run.exp_name) == (0.25, "from_yaml")
    cfg.write_text("learning_rate: 1\n")
    with pytest.raises(SystemExit) as e:
        CLI.parse_args(ToyArgs, ["--config", str(cfg)])
    assert e.value.code == 2 and "unknown key 'learning_rate'" in capsys.readouterr().err


def test_run_dir_and_args_json(tmp_path):
    args = ToyArgs(run=RunArgs(exp_name="toy", output_dir=str(tmp_path)))
    d = tracking.make_run_dir(Accelerator(cpu=True), "toyalgo", args)
    assert d.name.startswith("toyalgo__toy__1__")
    rec = json.loads((d / "args.json").read_text())
    assert rec["lr"] == 0.1 and rec["world_size"] == 1 and "git_commit" in rec and "git_dirty" in rec
    assert rec["seed"] == 1 and rec["exp_name"] == "toy" and "run" not in rec  # flat: keyed as the flags are
    assert rec["versions"]["torch"] == torch.__version__.split("+")[0] or rec["versions"]["torch"].startswith(
        torch.__version__[:4]
    )


def test_rng_state_round_trip(tmp_path):
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    state = C.rng_state()
    torch.save(state, tmp_path / "s.pt")
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    C.set_rng_state(torch.load(tmp_path / "s.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


def test_keep_last_and_resume_errors(tmp_path):
    acc = Accelerator(cpu=True)
    for step in (1, 2, 3):
        C.save_checkpoint(acc, tmp_path, step, {"m": _Wrap()}, {}, keep_last=2)
    assert sorted(p.name for p in C.list_checkpoints(tmp_path)) == ["step_2", "step_3"]
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        C.resolve_checkpoint(str(tmp_path / "nothing"))


def test_optimizer_state_is_keyed_by_name_and_loads_old_checkpoints(tiny):
    """Single process: common.parallel.sharded.optimizer_state keys Adam's moments by parameter name and
    load_optimizer_state restores them exactly; a plain opt.state_dict() (checkpoints written before the
    name-keyed format) still loads."""
    from types import SimpleNamespace

    from common.core import chat
    from common.core import models as M
    from common.parallel.sharded import load_optimizer_state, optimizer_state

    acc = SimpleNamespace(distributed_type="DistributedType.NO", num_processes=1)
    tok = chat.load_tokenizer(tiny)

    def trained():
        model = M.load_causal_lm(tiny, tok)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 100, (2, 6))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        return model, opt

    model, opt = trained()
    full = optimizer_state(acc, model, opt)
    assert "model.layers.0.self_attn.q_proj.weight" in full["state"]
    for state in (full, opt.state_dict()):  # name-keyed, and the older plain format
        fresh = M.load_causal_lm(tiny, tok)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        load_optimizer_state(acc, fresh, fresh_opt, state, Path("unused"))
        for (_, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
            assert torch.equal(opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"])
            assert opt.state[p]["step"] == fresh_opt.state[q]["step"]


def test_disk_full_during_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    import errno

    acc = Accelerator(cpu=True)
    C.save_checkpoint(acc, tmp_path, 1, {"m": _Wrap()}, {})
    mask = os.umask(0o022)
    os.umask(mask)
    assert (tmp_path / "checkpoints/step_1").stat().st_mode & 0o777 == 0o777 & ~mask  # not mkdtemp's 0700
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        if str(f).endswith("trainer_state.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(E.UserError, match=r"no space left on .* while writing checkpoint step_2; step_1 is intact"):
        C.save_checkpoint(acc, tmp_path, 2, {"m": _Wrap()}, {})
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_1"]  # no half checkpoint, no temp folder left behind
    (tmp_path / "checkpoints" / ".step_3.tmp-abc").mkdir()  # what a SIGKILL mid-save leaves
    assert C.remove_stale_temp_checkpoints(tmp_path) == [".step_3.tmp-abc"]


def test_save_best_with_a_metric_the_run_never_logs_says_so_once():
    """--save-best with a name that is not a metric of the run would never save: a warning, once (issue 38)."""
    import types

    lines, logged = [], []
    run = R.Run.__new__(R.Run)
    run.cfg = types.SimpleNamespace(
        save_best="eval/acuracy", eval_every=1, log_every=1, total_steps=9, num_samples_logged=4
    )
    run.log_line, run.health, run.best, run.evaluate, run._last, run._warned_best = (
        lines.append,
        None,
        C.BestKeeper("eval/acuracy"),
        lambda: {"eval/accuracy": 0.5},
        False,
        False,
    )
    run.tracker = types.SimpleNamespace(log=lambda step, m: logged.append(m), samples=lambda step, rows: None)
    for step in (1, 2):
        run._last = None
        run.stop = types.SimpleNamespace(out_of_time=lambda minutes: False)
        run.cfg.max_wall_minutes = 0
        run.log(step, {"train/reward": 1.0})
    assert len(lines) == 1 and "--save-best eval/acuracy: not a metric of this run" in lines[0], lines
    assert "eval/accuracy" in lines[0] and logged[0]["eval/accuracy"] == 0.5


def test_a_checkpoint_of_non_finite_weights_is_never_written(tmp_path):
    acc = Accelerator(cpu=True)
    model = _Wrap()
    C.save_checkpoint(acc, tmp_path, 1, {"m": model}, {})
    with torch.no_grad():
        model.lin.weight[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match=r"step 2: m has non-finite weights .* step_1 is intact"):
        C.save_checkpoint(acc, tmp_path, 2, {"m": model}, {})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]


def test_torch_save_on_a_full_disk_is_named_and_cleans_up(tmp_path, monkeypatch):
    """torch.save on a full filesystem raises RuntimeError ('unexpected pos'), not OSError: still the one-line
    no-space error, and no temp folder left behind to keep the disk full (issue 38)."""
    acc = Accelerator(cpu=True)
    C.save_checkpoint(acc, tmp_path, 1, {"m": _Wrap()}, {})
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        if str(f).endswith("trainer_state.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 3200 vs 3104")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(E.UserError, match="no space left on .* step_1 is intact"):
        C.save_checkpoint(acc, tmp_path, 2, {"m": _Wrap()}, {})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]


def test_damaged_foreign_or_non_finite_weights_are_one_line(tiny, tmp_path):
    """load_weights (what --resume runs): a truncated safetensors file, weights of another model and non-finite
    weights are each a UserError naming the folder or file (issue 38)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from common.core import models as M

    model = M.load_causal_lm(tiny, None)
    good = tmp_path / "good"
    shutil.copytree(tiny, good)
    C.load_weights(model, good)  # the same model: fine
    torn = tmp_path / "torn"
    shutil.copytree(tiny, torn)
    data = (torn / "model.safetensors").read_bytes()
    (torn / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(E.UserError, match="model.safetensors: damaged weights file"):
        C.load_weights(model, torn)
    sd = load_file(good / "model.safetensors")
    other = tmp_path / "other"
    other.mkdir()
    save_file(
        {k: torch.zeros(3, *v.shape[1:]) if v.dim() > 1 else v for k, v in sd.items()}, other / "model.safetensors"
    )
    with pytest.raises(E.UserError, match="weights are of another model"):
        C.load_weights(model, other)
    nan = tmp_path / "nan"
    nan.mkdir()
    sd = {k: v.clone() for k, v in sd.items()}
    next(iter(sd.values()))[0] = float("nan")
    save_file(sd, nan / "model.safetensors")
    with pytest.raises(E.UserError, match="weight tensors are not finite"):
        C.load_weights(model, nan)


def test_a_run_folder_takes_one_run_at_a_time(tmp_path):
    """Two resumes of one run folder at once would write each step twice: the second is refused by name, before
    it touches the folder's files (issue 38). The lock is flock's, so it goes with its process."""
    import fcntl
    import types

    run = tmp_path / "ppo_llm__x__1__1"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    held = open(run / ".lock", "a+")  # another process's lock (flock: per open file, so this stands in for it)
    held.write("pid 4242\n"), held.flush()
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    acc = types.SimpleNamespace(is_main_process=True, print=print, wait_for_everyone=lambda: None)
    with pytest.raises(E.UserError, match="in use by pid 4242"):
        tracking.make_run_dir(acc, "ppo_llm", None, run / "checkpoints" / "step_1")
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'  # untouched
    held.close()  # the other run ended: its lock went with it
    tracking.lock_run_dir(run)
    assert "pid" in (run / ".lock").read_text()


def test_a_real_full_disk_keeps_the_previous_checkpoint(tiny, tmp_path):
    """A full filesystem for real (a small tmpfs, issue 38; the test above fakes torch's error): the checkpoint
    that does not fit is the no-space error naming the intact one, its temp folder is gone (the disk is not left
    full), and the earlier checkpoint still loads."""

    from common.core import chat
    from common.core import models as M

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        acc, tok = Accelerator(cpu=True), chat.load_tokenizer(tiny)
        model = M.load_causal_lm(tiny, tok)
        run = disk / "run"
        C.save_checkpoint(acc, run, 1, {"policy": model}, {}, tokenizer=tok)
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(b"\0" * (free - 2 * 2**20))  # 2 MiB left: less than a checkpoint
        with pytest.raises(E.UserError, match=r"no space left on .* while writing checkpoint step_2; step_1 is intact"):
            C.save_checkpoint(acc, run, 2, {"policy": model}, {}, tokenizer=tok)
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1"]  # no temp folder left
        assert os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize >= 2 * 2**20 - 2**20  # its space came back
        reloaded = M.load_causal_lm(str(run / "checkpoints/step_1/policy"), tok)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))
    finally:
        # lazy: the reloaded model still maps its safetensors file, so a plain umount fails as busy
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_sharded_checkpoint_restores_weights_and_optimizer_and_loads_as_a_model(tiny, tmp_path, monkeypatch):
    """--checkpoint-format sharded on one process: step_1/sharded/ (torch.distributed.checkpoint), no weights in the
    model folder; restored into a fresh model and optimizer, both equal the saved ones; the policy folder loads as a
    model (converted once into the cache); a save that fails midway leaves step_1 as the only checkpoint."""
    import torch.distributed.checkpoint as dcp

    from common.core import chat
    from common.core import models as M

    acc, tok = Accelerator(cpu=True), chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.mean().backward()
    opt.step()
    C.save_checkpoint(acc, tmp_path, 1, {"policy": model}, {}, tokenizer=tok, optimizers={"opt": ("policy", opt)},
                      sharded=True)  # fmt: skip
    ckpt = tmp_path / "checkpoints" / "step_1"
    assert (ckpt / "sharded" / ".metadata").is_file() and not list(ckpt.glob("policy/*.safetensors"))
    fresh = M.load_causal_lm(tiny, tok)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert C.restore_checkpoint(acc, ckpt, {"policy": fresh}, {}, {"opt": ("policy", fresh_opt)}) == 1
    for (n, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), n
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"]), n
    loaded = M.load_causal_lm(str(ckpt / "policy"), tok)  # converted once into the cache, then a plain folder
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), loaded.parameters()))

    def killed(*a, **k):
        raise RuntimeError("killed mid-save")

    monkeypatch.setattr(dcp, "save", killed)
    with pytest.raises(RuntimeError, match="killed mid-save"):
        C.save_checkpoint(acc, tmp_path, 2, {"policy": model}, {}, tokenizer=tok, sharded=True)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]


def test_a_damaged_shard_is_one_line_naming_it_and_the_intact_step_before(tiny, tmp_path, monkeypatch):
    """A sharded checkpoint whose shard file is cut, deleted or has a flipped byte, or lost its .metadata
    (torch.distributed.checkpoint keeps no checksum: the save records each file's size and CRC-32): restoring it,
    converting its policy folder (export, --model-name-or-path) and `damage` (what --resume auto skips) name the
    file; the restore also names the newest intact earlier step. A full disk during the sharded save is one line."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from common.core import chat
    from common.core import models as M

    monkeypatch.setenv("CLEANRLHF_CACHE", str(tmp_path / "cache"))
    acc, tok = Accelerator(cpu=True), chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok)
    saved = tmp_path / "saved"
    for step in (1, 2):
        C.save_checkpoint(acc, saved, step, {"policy": model}, {}, tokenizer=tok, sharded=True)
    assert C.damage(saved / "checkpoints" / "step_2") is None
    assert json.loads((saved / "checkpoints" / "step_2" / "sharded" / "files.json").read_text())
    for how in ("cut", "deleted", "flipped", "no-metadata"):
        run = tmp_path / how
        shutil.copytree(saved, run)
        shards = run / "checkpoints" / "step_2" / "sharded"
        victim = shards / ".metadata" if how == "no-metadata" else sorted(shards.glob("*.distcp"))[0]
        data = bytearray(victim.read_bytes())
        if how == "cut":
            victim.write_bytes(bytes(data[:-100]))
        elif how == "flipped":
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
        else:
            victim.unlink()
        assert victim.name in C.damage(shards.parent), how
        with pytest.raises(E.UserError, match=f"{victim.name}.*step_1 is intact: --resume"):
            C.restore_checkpoint(acc, shards.parent, {"policy": M.load_causal_lm(tiny, tok)}, {}, {})
        with pytest.raises(E.UserError, match=victim.name):
            M.load_causal_lm(str(shards.parent / "policy"), tok)
        assert C.damage(run / "checkpoints" / "step_1") is None

    def full(*a, **k):  # what torch.distributed.checkpoint raises around the writer's ENOSPC
        raise dcp.api.CheckpointException("save", {0: (OSError(28, "No space left on device"), None)})

    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(E.UserError, match="no space left on .* while writing checkpoint step_3; step_2 is intact"):
        C.save_checkpoint(acc, saved, 3, {"policy": model}, {}, tokenizer=tok, sharded=True)


def test_a_signal_landing_while_the_stop_flag_is_read_is_kept_for_the_next_step():
    """CI lost a SIGTERM: it arrived after `requested()` had read the flag and was overwritten with the
    (older) agreed value, so the run went on to --total-steps and exited 0. Now it stops at the next step."""
    import signal as S

    class Accelerator:  # the device is read after the flag's value: the signal lands in between
        state = type("State", (), {"num_processes": 1})()

        @property
        def device(self):
            if not fired:
                fired.append(1), stop._handle(S.SIGTERM, None)
            return "cpu"

    fired = []
    old = {s: S.getsignal(s) for s in (S.SIGINT, S.SIGTERM)}
    try:
        stop = R.StopSignal(Accelerator())
        assert stop.requested() is False  # read before the signal: this step goes on (as every rank agreed)
        assert stop.requested() is True and stop.signum == S.SIGTERM  # the next step stops
    finally:
        for s, h in old.items():
            S.signal(s, h)
