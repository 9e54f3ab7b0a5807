"""The seed's workflow from checkpoint paths alone: SFT (LoRA) -> PPO -> self-generated preferences -> DPO
-> side-by-side evaluation; checkpoints are models; resume continues the same run folder; presets parse
like the CLI; export makes a clean model folder."""

import json
import sys

import pandas as pd
import pytest

from conftest import REPO, only_run, read_metrics, run_script, run_tool

TOY_REWARD = f"{REPO}/tests/helpers/toy_reward.py:compute_score"


def tool(module, *flags, env=None, check=True):
    return run_tool(module, *flags, env=env, check=check)


def assert_is_model(folder):
    """Plain transformers loads it: model and tokenizer (chat template included)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template and tok.pad_token_id != tok.eos_token_id
    AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.e2e
def test_sft_ppo_preferences_dpo_evaluate_from_checkpoints(tiny, toy_prompts, tmp_path):
    env = {"TOY_MODEL": tiny}
    rows = [
        {"messages": [{"role": "user", "content": f"say something {i}"}, {"role": "assistant", "content": "go go go"}]}
        for i in range(16)
    ]
    pd.DataFrame(rows).to_json(tmp_path / "sft.jsonl", orient="records", lines=True)
    small = ["--max-new-tokens", 6, "--eval-every", 0]
    # 1. SFT with LoRA: the checkpoint is an adapter folder (+ tokenizer), and a merged full model next to it
    run_script(
        "sft_llm.py",
        "--model-name-or-path",
        tiny,
        "--train-files",
        tmp_path / "sft.jsonl",
        "--total-steps",
        2,
        "--batch-size",
        4,
        "--micro-batch-size",
        2,
        "--lora-r",
        4,
        "--save-merged",
        "--eval-every",
        0,
        "--output-dir",
        tmp_path / "sft",
    )
    sft = only_run(tmp_path / "sft") / "checkpoints/step_2/policy"
    assert (sft / "adapter_config.json").exists() and (sft / "tokenizer_config.json").exists()
    assert_is_model(sft.parent / "policy_merged")
    # 2. PPO from the SFT checkpoint (the adapter folder itself: merged onto its base on load)
    run_script(
        "ppo_llm.py",
        "--model-name-or-path",
        sft,
        "--train-files",
        toy_prompts,
        "--reward-fn",
        TOY_REWARD,
        "--total-steps",
        2,
        "--batch-size",
        4,
        "--mini-batch-size",
        2,
        "--micro-batch-size",
        2,
        *small,
        "--output-dir",
        tmp_path / "ppo",
        env=env,
    )
    ppo = only_run(tmp_path / "ppo") / "checkpoints/step_2/policy"
    assert_is_model(ppo)
    # 3. preferences sampled from the PPO checkpoint
    tool(
        "tools.gen_preferences",
        "--model",
        ppo,
        "--prompts",
        toy_prompts,
        "--group-size",
        3,
        "--num-prompts",
        8,
        "--max-new-tokens",
        6,
        "--reward-fn",
        TOY_REWARD,
        "--out",
        tmp_path / "pairs.parquet",
        env=env,
    )
    # 4. DPO from the PPO checkpoint on those pairs
    run_script(
        "dpo_llm.py",
        "--model-name-or-path",
        ppo,
        "--train-files",
        tmp_path / "pairs.parquet",
        "--total-steps",
        2,
        "--batch-size",
        2,
        "--micro-batch-size",
        1,
        "--eval-every",
        0,
        "--output-dir",
        tmp_path / "dpo",
        env=env,
    )
    dpo = only_run(tmp_path / "dpo") / "checkpoints/step_2/policy"
    assert_is_model(dpo)
    # 5. everything side by side, a checkpoint first (its tokenizer is used for the prompts)
    out = tool(
        "tools.evaluate",
        "--models",
        dpo,
        tiny,
        sft,
        ppo,
        sft.parent / "policy_merged",
        "--data",
        toy_prompts,
        "--num-prompts",
        4,
        "--max-new-tokens",
        4,
        "--reward-fn",
        TOY_REWARD,
        "--json-out",
        tmp_path / "eval.json",
        env=env,
    )
    results = json.loads((tmp_path / "eval.json").read_text())
    assert len(results) == 5 and all(r["all"]["n"] == 4 for r in results.values()), out.stdout
    # merged adapter == merged folder: the same answers, so the same reward
    assert results[str(sft)]["all"]["reward"] == pytest.approx(
        results[str(sft.parent / "policy_merged")]["all"]["reward"]
    )
    # 6. export: a clean folder with a model card of the run
    tool("tools.export", ppo.parent.parent.parent, "--out", tmp_path / "exported")
    assert_is_model(tmp_path / "exported")
    card = (tmp_path / "exported" / "README.md").read_text()
    assert "ppo_llm" in card and "`total_steps`" in card and "train/reward" in card
    proc = tool(
        "tools.export",
        ppo,
        "--out",
        tmp_path / "exported2",
        "--push-to-hub",
        "me/x",
        env={"HF_HUB_OFFLINE": "1"},
        check=False,
    )
    assert (
        proc.returncode != 0 and "HF_HUB_OFFLINE" in proc.stderr and (tmp_path / "exported2" / "config.json").exists()
    )


@pytest.mark.e2e
def test_resume_continues_the_same_run_folder(tiny_peaky, toy_prompts, tmp_path):
    env = {"TOY_MODEL": tiny_peaky}
    flags = [
        "--model-name-or-path",
        tiny_peaky,
        "--train-files",
        toy_prompts,
        "--reward-fn",
        TOY_REWARD,
        "--num-prompts",
        2,
        "--group-size",
        2,
        "--mini-batch-size",
        4,
        "--micro-batch-size",
        2,
        "--max-new-tokens",
        6,
        "--eval-every",
        2,
        "--num-eval-prompts",
        2,
        "--save-every",
        1,
    ]
    run_script("grpo_llm.py", *flags, "--total-steps", 4, "--output-dir", tmp_path / "a", env=env)
    run_script("grpo_llm.py", *flags, "--total-steps", 3, "--output-dir", tmp_path / "b", env=env)
    run = only_run(tmp_path / "b")
    # a crash after step 3's metrics but before its checkpoint: rows past the checkpoint are recomputed
    import shutil

    shutil.rmtree(run / "checkpoints/step_3")
    run_script("grpo_llm.py", *flags, "--total-steps", 4, "--output-dir", tmp_path / "b", "--resume", "auto", env=env)
    assert only_run(tmp_path / "b") == run  # one folder
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rs]
    assert strip(read_metrics(run)) == strip(read_metrics(only_run(tmp_path / "a")))
    record = json.loads((run / "args.json").read_text())
    assert record["total_steps"] == 4 and record["resumes"][0]["from_step"] == 2
    assert record["resumes"][0]["changed"]["total_steps"] == [3, 4]
    # --resume auto with nothing to resume starts fresh
    run_script(
        "grpo_llm.py", *flags, "--total-steps", 1, "--output-dir", tmp_path / "fresh", "--resume", "auto", env=env
    )
    assert [r["step"] for r in read_metrics(only_run(tmp_path / "fresh"))] == [1]
    # refused: another algorithm, a step count not past the checkpoint, a changed learning rate
    for extra, script, msg in (
        (["--total-steps", 9], "ppo_llm.py", "grpo_llm checkpoint"),
        (["--total-steps", 4], "grpo_llm.py", "must be larger"),
        (["--total-steps", 9, "--learning-rate", 0.5], "grpo_llm.py", "--learning-rate"),
    ):
        extra_flags = flags if script == "grpo_llm.py" else ["--model-name-or-path", tiny_peaky]
        proc = run_script(script, *extra_flags, *extra, "--output-dir", tmp_path / "b", "--resume", run, check=False)
        assert proc.returncode != 0 and msg in proc.stderr, proc.stderr[-2000:]
    assert strip(read_metrics(run)) == strip(read_metrics(only_run(tmp_path / "a")))  # nothing written by the refusals


@pytest.mark.e2e
def test_yaml_preset_values_parse_like_the_cli(tmp_path):
    sys.path.insert(0, str(REPO / "algos"))
    import grpo_llm as G

    from common.harness.cli import parse_args

    (tmp_path / "p.yaml").write_text(
        "learning_rate: 1e-5\nscale_rewards: none\nhealth:\n  kl_max: 2\nmask_truncated: true\n"
    )
    args = parse_args(G.Args, ["--config", str(tmp_path / "p.yaml"), "--kl-coef", "0.1"])
    assert args.optim.learning_rate == 1e-5 and isinstance(args.optim.learning_rate, float)
    assert args.scale_rewards == "none" and args.health.kl_max == 2.0 and args.mask_truncated and args.kl_coef == 0.1
    # a value outside a Literal's choices, and an unknown key: errors naming them (YAML 1.1 reads `no` as False)
    for text, msg in (
        ("baseline: group_mean\n", "--baseline"),
        ("scale_rewards: no\n", "--scale-rewards"),
        ("learning_rat: 1e-5\n", "unknown key 'learning_rat'"),
    ):
        (tmp_path / "bad.yaml").write_text(text)
        proc = run_script("grpo_llm.py", "--config", tmp_path / "bad.yaml", check=False)
        assert proc.returncode != 0 and msg in proc.stderr and "bad.yaml" in proc.stderr, proc.stderr[-1500:]


@pytest.mark.e2e
def test_flags_users_bring_from_trl(tiny, toy_prompts, tmp_path):
    # exact equivalents are aliases; the rendered prompt and --system-prompt show at start-up
    proc = run_script(
        "grpo_llm.py",
        "--model-name-or-path",
        tiny,
        "--train-files",
        toy_prompts,
        "--reward-fn",
        TOY_REWARD,
        "--num-prompts",
        2,
        "--num-generations",
        2,
        "--beta",
        0.05,
        "--max-completion-length",
        3,
        "--mini-batch-size",
        4,
        "--micro-batch-size",
        2,
        "--total-steps",
        1,
        "--eval-every",
        0,
        "--system-prompt",
        "Be brief.",
        "--output-dir",
        tmp_path,
        env={"TOY_MODEL": tiny},
    )
    args = json.loads((only_run(tmp_path) / "args.json").read_text())
    assert args["group_size"] == 2 and args["kl_coef"] == 0.05 and args["max_new_tokens"] == 3
    assert "[prompt] the first training prompt" in proc.stdout and "Be brief." in proc.stdout
    # no exact equivalent: one line naming ours, exit 2, nothing written
    proc = run_script("grpo_llm.py", "--per-device-train-batch-size", 4, "--output-dir", tmp_path / "x", check=False)
    assert proc.returncode == 2 and "--micro-batch-size" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
    helptext = run_script("ppo_llm.py", "--help").stdout
    assert "PPO for language models" in helptext.split("╭")[0]  # --help starts with the script's summary
