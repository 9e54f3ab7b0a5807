"""Environments from the hubs (common/integrations/hub_envs.py) against the real libraries: TextArena games played in
process, OpenEnv servers over their own client (an environment made by the real `openenv init`)."""

import json
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.core.envs import Episodes
from common.core.errors import UserError
from common.core.tasks import ENV_TEST_SEED0, default_env_files, env_rows
from common.harness.args import EnvArgs
from common.integrations import hub_envs as H
from shared_hub_envs import row

REPO = Path(__file__).resolve().parents[2]

ta = pytest.importorskip("textarena")  # in requirements.txt: a missing install fails CI's import check below


def _direct(game, seed, actions):
    """The game played with textarena alone: (reward of player 0, game_info)."""
    env = ta.make(game)
    env.reset(num_players=1, seed=seed)
    for a in actions:
        done, _ = env.step(action=a)
        if done:
            break
    rewards, info = env.close()
    r = (rewards or {}).get(0, 0.0)
    return (r if isinstance(r, (int, float)) else -1.0), info  # (ThreeCardMonte's invalid move: its reason)


@pytest.mark.parametrize("game", ["GuessTheNumber-v0", "GuessTheNumber-v0-raw", "ThreeCardMonte-v0-raw"])
def test_a_textarena_game_scores_as_textarena_scores_it(game):
    actions = ["[10]", "oops", *(f"[{k}]" for k in range(1, 21) if k != 10)]  # every game ends within these
    for seed in range(4):
        env = H.TextArenaEnv(game)
        first = env.reset(row(seed))
        assert first[0]["role"] == "user" and "[" in first[0]["content"]
        env.final, total, n = False, 0.0, 0
        for a in actions:
            step = env.step(a, [])
            total, n = total + step.reward, n + 1
            if step.done:
                break
            text = step.observation[0]["content"]
            if game.endswith("-raw"):  # the game's new messages only: the model's own action is not echoed back
                assert a not in text.splitlines()
            else:  # the wrappers' history string: only its new part
                assert "You are playing" not in text
        expected, info = _direct(game, seed, actions[:n])
        assert step.done and total == expected
        assert step.info["invalid_move"] == float(info[0]["invalid_move"]) and step.info["win"] == float(expected >= 1)


def test_the_system_message_is_the_rows_own_else_the_flags():
    game = partial(H.TextArenaEnv, "ThreeCardMonte-v0-train", "", "Answer with [k] only.")
    first = game().reset(row(2))
    assert first[0] == {"role": "system", "content": "Answer with [k] only."} and first[1]["role"] == "user"
    own = SimpleNamespace(extra_info={"seed": 2}, uid=0, messages=[{"role": "system", "content": "mine"},
                                                                  {"role": "user", "content": "seed 2"}])  # fmt: skip
    assert [m["content"] for m in game().reset(own)] == ["mine", first[1]["content"]]
    assert H.TextArenaEnv("ThreeCardMonte-v0-train").reset(row(2)) == first[1:]


def test_a_game_cut_by_the_turn_budget_scores_zero_and_counts_unfinished():
    env = H.TextArenaEnv("GuessTheNumber-v0-raw")
    env.reset(row(0))
    env.final = True
    step = env.step("[1]" if _direct("GuessTheNumber-v0-raw", 0, ["[1]"])[0] != 1 else "[2]", [])
    assert step.done and step.reward == 0.0 and step.info == {"unfinished": 1.0}


def test_a_two_player_game_plays_against_the_fixed_opponent(tmp_path):
    (tmp_path / "opp.py").write_text("def rock(observation):\n    return '[rock]'\n")
    env = H.TextArenaEnv("IteratedRockPaperScissors-v0-raw", f"{tmp_path}/opp.py:rock")
    env.reset(row(1))
    env.final = False
    for _ in range(20):
        step = env.step("[paper]", [])
        if step.done:
            break
    assert step.done and step.reward == 1.0 and step.info["win"] == 1.0
    with pytest.raises(UserError, match="--env-opponent"):
        H.hub_factory("textarena:IteratedRockPaperScissors-v0", EnvArgs())


def test_seed_rows_hold_test_games_out_and_are_what_scripts_read(tmp_path, monkeypatch):
    monkeypatch.setenv("CLEANRLHF_CACHE", str(tmp_path))
    train, test = (
        env_rows("textarena:ThreeCardMonte-v0", 5, "train"),
        env_rows("textarena:ThreeCardMonte-v0", 3, "test"),
    )
    assert [r["extra_info"]["seed"] for r in train] == [0, 1, 2, 3, 4]
    assert [r["extra_info"]["seed"] for r in test] == [ENV_TEST_SEED0 + i for i in range(3)]
    assert {r["data_source"] for r in train + test} == {"textarena/ThreeCardMonte-v0"}
    a, b = default_env_files("textarena:ThreeCardMonte-v0", 5, 3)
    assert Path(a).exists() and Path(b).exists() and default_env_files("textarena:ThreeCardMonte-v0", 5, 3) == (a, b)


@pytest.mark.parametrize(
    "spec, says",
    [
        ("textarena:NoSuchGame-v0", "no such TextArena game"),
        ("textarena:GuessTheNumber-v9", "did you mean"),
        ("textarena:", "name the environment"),
        ("verifiers:gsm8k", "not built yet"),
        ("openenv:http://127.0.0.1:9", "no OpenEnv server answers"),
        ("openenv:/no/such/folder", "not an OpenEnv environment folder"),
    ],
)
def test_bad_hub_envs_are_one_line(spec, says):
    with pytest.raises(UserError, match=says) as e:
        H.hub_factory(spec, EnvArgs())
    assert "\n" not in str(e.value)


def test_a_missing_library_names_the_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)  # import textarena -> ImportError
    with pytest.raises(UserError, match=r"pip install textarena==0\.7\.4"):
        H.TextArenaEnv("GuessTheNumber-v0")


def test_an_openenv_action_needs_one_text_field():
    assert H.action_field({"properties": {"message": {"type": "string"}}, "required": ["message"]}, "x") == "message"
    two = {"properties": {"a": {"type": "string"}, "b": {"type": "string"}, "n": {"type": "integer"}}}
    with pytest.raises(UserError, match="no single text field"):
        H.action_field(two, "http://host")
    assert H.observation_text({"echoed_message": "hi", "reward": 1}) == "hi"
    assert json.loads(H.observation_text({"board": [1, 2], "done": False})) == {"board": [1, 2]}


def test_textarena_trajectories_mask_the_game_and_score_as_the_game(tiny):
    """Token in, token out through a real game: the game's messages get mask 0, the score of each trajectory is
    what textarena gives its model turns replayed alone."""
    from common.core import chat
    from common.core import models as M

    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok).eval()
    game = "GuessTheNumber-v0-raw"
    episodes = Episodes(partial(H.TextArenaEnv, game), tok, lambda r, t: 0.0, 3, 96, 30.0, max_prompt_tokens=None)
    rows = [SimpleNamespace(extra_info={"seed": s}, uid=s, messages=None, text="", data_source="textarena/x")
            for s in range(4)]  # fmt: skip
    ro = episodes.run(model, rows, [11, 12, 13, 14], max_new_tokens=8)
    assert ro.stats["env/errors"].sum() == 0
    for i, r in enumerate(rows):
        turns = [m["content"] for m in ro.messages[i] if m["role"] == "assistant"]
        expected = _direct(game, r.extra_info["seed"], turns)[0]
        finished = not bool(ro.stats["env/unfinished"][i])
        assert float(ro.scores[i]) == (expected if finished else 0.0)
        n_obs = len(ro.messages[i]) - 1 - len(turns)  # the game's messages after the first
        assert (ro.response_mask[i] == 0).any() == (n_obs > 0)
