"""Environments from the ecosystem's hubs behind the one `Environment` contract (common.core.envs): `--env
textarena:GAME` (a TextArena game, played in process) and `--env openenv:URL` (an OpenEnv environment server over its
own client's WebSocket session; `openenv:path/to/env` starts the server of an environment folder made by `openenv
init`).

Token in, token out as for every environment: the model's turn goes to the game as its action text, the game's new
messages come back as a user message (masked: no loss on them), and the reward is the environment's own score (the
TextArena reward of player 0 when the game ends; the sum of OpenEnv's step rewards), never the run's --reward. The
rows a run trains and evaluates on are seeds (`common.core.tasks.env_rows`): train seeds 0.., test seeds from 1,000,000,
so a held-out game is never one trained on. A game cut by --max-turns before it ends scores 0 and counts in
env/unfinished.

Each adapter imports its library only when used: a missing package is one line naming the `pip install` to run.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

from common.core.envs import Environment, Step
from common.core.errors import UserError
from common.core.tasks import HUB_PREFIXES, is_hub_spec  # noqa: F401  (the rows: common.core.tasks.env_rows)


def _system(row, default: str) -> list[dict]:
    """The system message a hub environment's first message follows: the row's own (a prompt of messages), else
    --env-system-prompt, else none."""
    messages = getattr(row, "messages", None)
    own = [dict(m) for m in messages if m.get("role") == "system"] if isinstance(messages, list) else []
    return own or ([{"role": "system", "content": default}] if default else [])


def _need(module: str, pip: str, spec: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UserError(f"--env {spec}: the package {module!r} is not installed ({e}); pip install {pip}") from None


# ---------------------------------------------------------------------------------------------
# TextArena
# ---------------------------------------------------------------------------------------------
class TextArenaEnv(Environment):
    """One TextArena game (`textarena.make(game)`) per trajectory, seeded by the row. The model is player 0; in a
    two-player game the other player is `opponent` (path/to/file.py:fn, fn(observation text) -> action text), a
    fixed policy. Observations: the game's messages since the model's last turn (raw ids give a list of (sender,
    message, type); the default wrappers give the whole history as one string, of which only the new part is sent).
    info: win (reward >= 1: TextArena's full reward), invalid_move (the game ended on the model's invalid move),
    unfinished (cut by the turn budget before the game ended)."""

    info_keys = ("win", "invalid_move", "unfinished")

    def __init__(self, game: str, opponent: str = "", system: str = ""):
        self.game, self.opponent_spec, self._opponent, self.system = game, opponent, None, system
        self.ta = _need("textarena", "textarena==0.7.4", f"textarena:{game}")
        if game not in self.ta.envs.registration.ENV_REGISTRY:
            near = sorted(k for k in self.ta.envs.registration.ENV_REGISTRY if k.split("-")[0] == game.split("-")[0])
            raise UserError(f"--env textarena:{game}: no such TextArena game" + (f" (did you mean {near[:4]}?)" if near
                            else "; `python -c 'import textarena; print(list(textarena.envs.registration.ENV_REGISTRY))'` lists them"))  # fmt: skip
        self.env, self._seen = None, ""

    def _new_text(self, obs) -> str:
        """What player 0 has not seen yet of `obs`: its own action echoes left out."""
        if isinstance(obs, str):  # a wrapper's whole-history string
            new = obs[len(self._seen) :] if obs.startswith(self._seen) else obs
            self._seen = obs
            return new.strip()
        kind = getattr(self.ta, "ObservationType", None)
        mine = getattr(kind, "PLAYER_ACTION", None)
        return "\n".join(m for sender, m, t in obs if not (sender == 0 and t == mine)).strip()

    def _play_opponent(self) -> tuple[bool, str]:
        """Until it is player 0's turn or the game is over -> (done, the text player 0 gets)."""
        pid, obs = self.env.get_observation()
        while pid != 0:
            if self._opponent is None:
                from common.core.errors import load_from_file

                self._opponent = load_from_file(self.opponent_spec, "--env-opponent", "function")
            text = obs if isinstance(obs, str) else "\n".join(m for _, m, _ in obs)
            done, _ = self.env.step(action=str(self._opponent(text)))
            if done:
                return True, ""
            pid, obs = self.env.get_observation()
        return False, self._new_text(obs)

    def reset(self, row):
        seed = int(row.extra_info.get("seed", row.uid))
        self.env, self._seen = self.ta.make(self.game), ""
        try:
            self.env.reset(num_players=1, seed=seed)
        except (AssertionError, ValueError, TypeError, KeyError):  # a game of two players
            if not self.opponent_spec:
                raise UserError(f"--env textarena:{self.game} is a game of two players: name the other one with "
                                "--env-opponent path/to/file.py:fn (fn(observation) -> action)") from None  # fmt: skip
            self.env = self.ta.make(self.game)
            self.env.reset(num_players=2, seed=seed)
        done, text = self._play_opponent()
        return _system(row, self.system) + [{"role": "user", "content": text or f"TextArena {self.game}"}]

    def _end(self) -> Step:
        rewards, info = self.env.close()
        r = (rewards or {}).get(0, 0.0)
        # a reward that is not a number: textarena 0.7.4's ThreeCardMonte passes an invalid move's reason in its place;
        # the single-player invalid-move reward (SinglePlayerState.set_invalid_move's default) stands for it
        r = float(r) if isinstance(r, (int, float)) else -1.0
        bad = float(bool((info or {}).get(0, {}).get("invalid_move", False)))
        self.env = None
        # a win is TextArena's full reward (1: solved, or beaten the opponent); single-player games pay a share below
        # it for a partial result (GuessTheNumber: how close the last guess was), two-player ones 0 or -1
        return Step(None, r, True, {"win": float(r >= 1), "invalid_move": bad, "unfinished": 0.0})

    def step(self, text, ids):
        done, _ = self.env.step(action=text)
        if not done:
            done, new = self._play_opponent()
        if done:
            return self._end()
        if self.final:  # out of turns or tokens before the game ended: no score
            return Step(None, 0.0, True, {"unfinished": 1.0})
        return Step([{"role": "user", "content": new}], 0.0, False)

    def close(self):
        self.env = None


# ---------------------------------------------------------------------------------------------
# OpenEnv
# ---------------------------------------------------------------------------------------------
OBS_KEYS = ("prompt", "text", "message", "observation", "content", "output", "echoed_message", "feedback")


def observation_text(obs: dict) -> str:
    """An OpenEnv observation (a dict) as the user message: its `messages` (chat) last content, its first text field
    of OBS_KEYS, else its other fields as JSON."""
    if isinstance(obs.get("messages"), list) and obs["messages"]:
        return str(obs["messages"][-1].get("content", ""))
    for k in OBS_KEYS:
        if isinstance(obs.get(k), str):
            return obs[k]
    rest = {k: v for k, v in obs.items() if k not in ("reward", "done", "metadata")}
    return json.dumps(rest, default=str)


def action_field(schema: dict, where: str) -> str:
    """The one text field of an OpenEnv action schema (GET /schema's "action"): its only required string field, or
    its only string field; anything else is a protocol this adapter cannot serve (one line)."""
    props = schema.get("properties", {})
    strings = [k for k, v in props.items() if v.get("type") == "string" and k != "metadata"]
    required = [k for k in schema.get("required", []) if k in strings]
    pick = required if len(required) == 1 else strings
    if len(pick) != 1:
        raise UserError(f"--env openenv:{where}: its action ({sorted(props)}) has no single text field to put the "
                        "model's turn in; this adapter serves environments whose action is one string")  # fmt: skip
    return pick[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SERVERS: list = []


def start_openenv_server(folder: Path, log=print, timeout: float = 60.0) -> str:
    """`uvicorn server.app:app` in an OpenEnv environment folder (as `openenv init` makes it), on a free local port,
    stopped when this process exits -> its URL."""
    if not (folder / "server" / "app.py").is_file():
        raise UserError(f"--env openenv:{folder}: not an OpenEnv environment folder (no server/app.py) nor a URL")
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(folder), str(folder.parent), os.environ.get("PYTHONPATH", "")]),
    }
    logf = open(folder / f"openenv_server_{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "server.app:app", "--host", "127.0.0.1", "--port",
                             str(port)], cwd=folder, env=env, stdout=logf, stderr=subprocess.STDOUT)  # fmt: skip
    _SERVERS.append(proc)
    atexit.register(proc.kill)
    url, t0 = f"http://127.0.0.1:{port}", time.time()
    import urllib.request

    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise UserError(f"--env openenv:{folder}: its server exited ({proc.returncode}); see {logf.name}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).read()
            log(f"[cleanrlhf] OpenEnv server of {folder} at {url} (log: {logf.name})")
            return url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise UserError(f"--env openenv:{folder}: its server did not answer in {timeout:.0f} s; see {logf.name}")


def openenv_schema(url: str) -> dict:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/schema", timeout=30) as r:
            return json.loads(r.read())
    except (OSError, ValueError) as e:
        raise UserError(f"--env openenv:{url}: no OpenEnv server answers there (GET /schema: {e})") from None


class OpenEnvEnv(Environment):
    """One WebSocket session of an OpenEnv server (openenv's own GenericEnvClient) per trajectory: reset(seed=the
    row's seed), then each model turn as the action's text field (`action_key`, read from /schema). The reward is the
    sum of the steps' rewards; the trajectory ends when the server says done or the turns run out."""

    info_keys = ("unfinished",)

    def __init__(self, url: str, action_key: str, timeout: float = 60.0, system: str = ""):
        self.url, self.action_key, self.timeout, self.client, self.system = url, action_key, timeout, None, system
        _need("openenv.core", "openenv-core==0.3.0", f"openenv:{url}")

    def reset(self, row):
        from openenv.core.generic_client import GenericEnvClient

        self.client = GenericEnvClient(base_url=self.url, message_timeout_s=self.timeout).sync()
        self.client.connect()
        try:
            result = self.client.reset(seed=int(row.extra_info.get("seed", row.uid)))
        except Exception as e:  # each trajectory of a batch holds a session at once; past its capacity the server
            # answers CAPACITY_REACHED and closes the socket (the client raises either, depending on timing)
            if "CAPACITY_REACHED" not in str(e) and not type(e).__name__.startswith("ConnectionClosed"):
                raise
            raise RuntimeError(f"the OpenEnv server at {self.url} refused a session ({type(e).__name__}: {e}); it "
                               "may serve fewer sessions at once than a batch has trajectories: raise "
                               "max_concurrent_envs in its server/app.py") from None  # fmt: skip
        first = observation_text(result.observation) or "(the environment is ready)"
        return _system(row, self.system) + [{"role": "user", "content": first}]

    def step(self, text, ids):
        result = self.client.step({self.action_key: text})
        r = float(result.reward or 0.0)
        if result.done:
            return Step(None, r, True, {"unfinished": 0.0})
        if self.final:
            return Step(None, r, True, {"unfinished": 1.0})
        return Step([{"role": "user", "content": observation_text(result.observation)}], r, False)

    def close(self):
        if self.client is not None:
            self.client.close()
            self.client = None


# ---------------------------------------------------------------------------------------------
# --env textarena:GAME / openenv:URL -> a factory; the seed rows a run trains and evaluates on
# ---------------------------------------------------------------------------------------------
def hub_factory(spec: str, env_args, log=print):
    """The environment factory of a hub --env (a picklable functools.partial: env workers build their own)."""

    kind, _, name = spec.partition(":")
    if not name:
        raise UserError(f"--env {spec}: name the environment after the colon (e.g. textarena:GuessTheNumber-v0)")
    if kind == "textarena":
        factory = partial(TextArenaEnv, name, env_args.env_opponent, env_args.env_system_prompt)
        probe = factory()  # an unknown game, a missing package, a two-player game without --env-opponent: one line
        probe.reset(SimpleNamespace(extra_info={"seed": 0}, uid=0, messages=None))
        probe.close()
        return factory
    if kind == "openenv":
        url = name if name.startswith(("http://", "https://")) else start_openenv_server(Path(name).resolve(), log)
        key = action_field(openenv_schema(url).get("action", {}), name)  # (before the client's slow import)
        _need("openenv.core", "openenv-core==0.3.0", spec)
        return partial(OpenEnvEnv, url, key, env_args.env_timeout, env_args.env_system_prompt)
    raise UserError(f"--env {spec}: the verifiers adapter is not built yet (issue 67); textarena: and openenv: are")
