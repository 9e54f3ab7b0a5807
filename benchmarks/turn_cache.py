"""A multi-turn rollout's time with and without the KV cache kept across turns (hf engine, common.core.envs.Episodes).

SmolLM2-135M-Instruct, the feedback environment (a wrong answer gets "incorrect, try again" and another turn) on
chain_sum_4d, which it gets wrong: nearly every trajectory takes all --max-turns turns. The same rows and seeds with
`Episodes.kv_cache` on (a turn prefills only the EOS and the observation) and off (each turn prefills the prompt and
every earlier turn again); the ids must agree. Median of --repeats after a warm-up. Run it alone on the machine.

    python benchmarks/turn_cache.py --turns 3 --rows 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    import torch

    from common.core import chat, hub
    from common.core import models as M
    from common.core.data import load_prompts
    from common.core.envs import Episodes
    from common.core.rewards import Reward
    from common.core.tasks import default_task_files
    from common.integrations.builtin_envs import FeedbackEnv

    torch.set_num_threads(torch.get_num_threads())
    tok = chat.load_tokenizer(a.model)
    model = M.load_causal_lm(hub.resolve_model_path(a.model), tok).eval()
    rows = load_prompts([default_task_files("chain_sum_4d", 64, 64)[1]], tok)[: a.rows]
    reward = Reward("rule:1.0", max_new_tokens=a.max_new_tokens)
    score = lambda row, text: float(reward([row], [text], torch.tensor([1]), "cpu", None)[0][0])
    eps = Episodes(FeedbackEnv, tok, score, a.turns, a.turns * (a.max_new_tokens + 32), 60, lambda *x: None)
    seeds = list(range(a.rows))
    times, outs = {True: [], False: []}, {}
    for rep in range(a.repeats + 1):
        for cached in (True, False):
            eps.kv_cache = cached
            t0 = time.time()
            outs[cached] = eps.run(model, rows, seeds, None, a.max_new_tokens)
            if rep:  # the first round warms up
                times[cached].append(time.time() - t0)
    same = torch.equal(outs[True].responses, outs[False].responses)
    turns = outs[True].stats["env/turns"].mean().item()
    tokens = int((outs[True].responses != tok.pad_token_id).sum())
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"{a.rows} trajectories, {turns:.2f} turns each on average, {tokens} tokens after the prompts; ids equal: {same}"
    )
    print("| kv cache across turns | rollout s (median) | speed-up |\n|---|---|---|")
    print(f"| off (full prefill each turn) | {off:.2f} | 1.00x |\n| on | {on:.2f} | {off / on:.2f}x |")


if __name__ == "__main__":
    main()
