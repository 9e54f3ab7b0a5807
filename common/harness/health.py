"""Training-health warnings for the RL scripts: catch a run going wrong before it wastes a day.

Every logged step, `HealthMonitor.check(metrics)` compares the metrics with the run's first values
and its own thresholds. A firing check returns `health/<name> = 1` (logged to metrics.jsonl and W&B)
and prints one console line with what users usually do about it (docs/experiments.md).
Thresholds are flags of every RL script: `--health.kl-max 0.5`, `--health.clip-frac-max 0.3`, ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class HealthConfig:
    enabled: bool = True
    """print and log health warnings"""
    kl_max: float = 1.0
    """warn when train/kl (per-token KL to the reference) exceeds this"""
    entropy_min_frac: float = 0.1
    """warn when train/entropy falls below this fraction of its first value (collapse)"""
    length_drift: float = 2.0
    """warn when the mean response length grows or shrinks by this factor from its first value"""
    accuracy_drop: float = 0.1
    """warn when eval/accuracy falls this far below its best while train/reward is above its value then"""
    clip_frac_max: float = 0.3
    """warn when train/clip_frac stays above this for --health.patience steps"""
    truncated_max: float = 0.5
    """warn when the fraction of responses cut at max_new_tokens exceeds this (and has grown)"""
    mismatch_max: float = 1.05
    """warn when mismatch/mult_prob_error (mean exp|log pi_old - log pi_sampler| per token: the sampler and the
    trainer disagree) exceeds this (NeMo-RL's alarm level)"""
    patience: int = 3
    """consecutive steps a condition must hold before it warns"""
    reward_abs_max: float = 1e4
    """warn at once when |train/reward| exceeds this, or it or a loss is not finite (a broken reward function)"""


ADVICE = {
    "kl": "the policy is far from the reference: lower the learning rate, raise --kl-coef or set --kl-target",
    "entropy_collapse": "the policy became nearly deterministic: lower the learning rate, add --ent-coef, or raise the temperature",
    "length_drift": "response length moved far from its start: check for length hacking (add a 'length' reward term) or truncation",
    "reward_up_accuracy_down": "train reward rises while eval accuracy falls: likely reward hacking; inspect samples.jsonl",
    "clip_frac": "many ratios are clipped every step: updates are too large; lower the learning rate or the epochs per batch",
    "reward_scale": "the reward (or a loss) is huge or not finite: check the reward function's output range; non-finite updates are skipped (train/skipped_steps)",
    "mismatch": "the sampler's log-probs drift from the trainer's (engine, precision, stale weights): check the weight sync and dtypes, or correct for it (--tis-cap, --tis-level, --tis-mode; docs/rollout.md)",
    "truncated": "many responses hit --max-new-tokens: raise it, or penalise overlong answers (--missing-eos-penalty, --overlong-buffer)",
}


class HealthMonitor:
    def __init__(self, cfg: HealthConfig, print_fn=print):
        self.cfg, self.print = cfg, print_fn
        self.first: dict[str, float] = {}
        self.streak: dict[str, int] = {}
        self.best_acc: float | None = None
        self.reward_at_best: float | None = None
        self.last_reward: float | None = None

    def state_dict(self) -> dict:
        return {
            "first": dict(self.first),
            "streak": dict(self.streak),
            "best_acc": self.best_acc,
            "reward_at_best": self.reward_at_best,
            "last_reward": self.last_reward,
        }

    def load_state_dict(self, s: dict) -> None:  # part of a checkpoint, so a resumed run warns as the original would
        self.first, self.streak = dict(s["first"]), dict(s["streak"])
        self.best_acc, self.reward_at_best, self.last_reward = s["best_acc"], s["reward_at_best"], s["last_reward"]

    def _hold(self, name: str, cond: bool) -> bool:
        self.streak[name] = self.streak.get(name, 0) + 1 if cond else 0
        return self.streak[name] >= self.cfg.patience

    def check(self, m: dict) -> dict:
        """Metrics of one step -> {health/<name>: 1.0} for each firing check (empty when healthy)."""
        if not self.cfg.enabled:
            return {}
        c, fired = self.cfg, []
        for k in ("train/entropy", "train/response_len", "train/truncated"):
            if k in m and k not in self.first:
                self.first[k] = m[k]
        if "train/reward" in m:
            self.last_reward = m["train/reward"]
            if self.best_acc is not None and self.reward_at_best is None:  # best accuracy came before any training
                self.reward_at_best = m["train/reward"]
        watched = [m[k] for k in ("train/reward", "loss/policy", "loss/total") if k in m]
        if any(not math.isfinite(v) for v in watched) or abs(m.get("train/reward", 0.0)) > c.reward_abs_max:
            fired.append("reward_scale")  # at once: no patience for a broken scale
        if "train/kl" in m and self._hold("kl", m["train/kl"] > c.kl_max):
            fired.append("kl")
        if "train/entropy" in m and self._hold(
            "entropy_collapse", m["train/entropy"] < c.entropy_min_frac * self.first["train/entropy"]
        ):
            fired.append("entropy_collapse")
        if "train/response_len" in m and self.first["train/response_len"] > 0:
            ratio = m["train/response_len"] / self.first["train/response_len"]
            if self._hold("length_drift", ratio > c.length_drift or ratio < 1 / c.length_drift):
                fired.append("length_drift")
        if "train/clip_frac" in m and self._hold("clip_frac", m["train/clip_frac"] > c.clip_frac_max):
            fired.append("clip_frac")
        if "train/truncated" in m and self._hold(
            "truncated", m["train/truncated"] > c.truncated_max and m["train/truncated"] > self.first["train/truncated"]
        ):
            fired.append("truncated")
        if "mismatch/mult_prob_error" in m and self._hold("mismatch", m["mismatch/mult_prob_error"] > c.mismatch_max):
            fired.append("mismatch")
        if "eval/accuracy" in m:
            acc = m["eval/accuracy"]
            if self.best_acc is None or acc > self.best_acc:
                self.best_acc, self.reward_at_best = acc, self.last_reward
            elif (
                acc < self.best_acc - c.accuracy_drop
                and self.last_reward is not None
                and self.reward_at_best is not None
                and self.last_reward > self.reward_at_best
            ):
                fired.append("reward_up_accuracy_down")
        for name in fired:
            self.print(f"[health] {name}: {ADVICE[name]}")
        return {f"health/{name}": 1.0 for name in fired}
