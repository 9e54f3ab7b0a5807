"""Each health warning fires on a stream built to trigger it and stays silent on a healthy one."""

import pytest

from common.harness.health import ADVICE, HealthConfig, HealthMonitor


def healthy(step):
    return {
        "train/reward": 0.1 + 0.01 * step,
        "train/kl": 0.05,
        "train/entropy": 2.0 - 0.01 * step,
        "train/response_len": 30 + (step % 3),
        "train/clip_frac": 0.05,
        "train/truncated": 0.1,
        "mismatch/mult_prob_error": 1.002,
    }


def run(stream, **cfg):
    msgs = []
    mon = HealthMonitor(HealthConfig(**cfg), msgs.append)
    fired = [mon.check(m) for m in stream]
    return fired, msgs


def test_healthy_stream_is_silent():
    stream = [healthy(s) for s in range(20)]
    stream[5]["eval/accuracy"], stream[10]["eval/accuracy"], stream[15]["eval/accuracy"] = 0.3, 0.35, 0.33
    fired, msgs = run(stream)
    assert not any(fired) and not msgs


@pytest.mark.parametrize(
    "name,mutate",
    [
        ("kl", lambda m, s: m.update({"train/kl": 2.0}) if s >= 5 else None),
        ("entropy_collapse", lambda m, s: m.update({"train/entropy": 0.05}) if s >= 5 else None),
        ("length_drift", lambda m, s: m.update({"train/response_len": 100}) if s >= 5 else None),
        ("clip_frac", lambda m, s: m.update({"train/clip_frac": 0.6}) if s >= 5 else None),
        ("truncated", lambda m, s: m.update({"train/truncated": 0.9}) if s >= 5 else None),
        ("mismatch", lambda m, s: m.update({"mismatch/mult_prob_error": 1.08}) if s >= 5 else None),
    ],
)
def test_each_warning_fires(name, mutate):
    stream = []
    for s in range(12):
        m = healthy(s)
        mutate(m, s)
        stream.append(m)
    fired, msgs = run(stream)
    assert not any(fired[:5])
    assert all(f.get(f"health/{name}") == 1.0 for f in fired[7:]) and not fired[6]
    assert fired[7] == {f"health/{name}": 1.0}  # patience 3: steps 5, 6, 7 -> fires at 7
    assert any(ADVICE[name] in msg for msg in msgs)


def test_patience_ignores_spikes():
    stream = [healthy(s) for s in range(10)]
    stream[4]["train/kl"] = 5.0  # one spike
    fired, _ = run(stream)
    assert not any(fired)


def test_reward_up_accuracy_down():
    stream = [healthy(s) for s in range(12)]
    stream[0]["eval/accuracy"] = 0.5  # before training
    stream[5]["eval/accuracy"] = 0.45  # small drop: fine
    stream[10]["eval/accuracy"] = 0.3  # reward went up since, accuracy down by 0.2
    fired, msgs = run(stream)
    assert fired[10] == {"health/reward_up_accuracy_down": 1.0} and not any(fired[:10])
    stream2 = [dict(m, **{"train/reward": 0.5 - 0.01 * i}) for i, m in enumerate(stream)]  # reward falling too
    fired2, _ = run(stream2)
    assert not any(fired2)


def test_disabled():
    fired, msgs = run([dict(healthy(s), **{"train/kl": 9.0}) for s in range(10)], enabled=False)
    assert not any(fired) and not msgs
