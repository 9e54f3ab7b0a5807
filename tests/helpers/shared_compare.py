"""What the tests of test_compare.py share (tests/*/test_compare.py: the tiers, and other test modules)."""

import json


def fake_run(root, name, exp, seed, values):
    d = root / name
    d.mkdir(parents=True)
    (d / "args.json").write_text(json.dumps({"exp_name": exp, "seed": seed}))
    with open(d / "metrics.jsonl", "w") as f:
        for i, v in enumerate(values, 1):
            f.write(
                json.dumps(
                    {"step": i, "train/reward": v, "train/kl": 0.1 * i, "perf/step_s": 2.0, "train/episodes": 8 * i}
                )
                + "\n"
            )
    return d
