"""cleanrlhf's library, in four folders, each importing only from itself and the folders before it
(docs/architecture.md draws the house; tests/*/test_house.py checks it):

    core/          what every RL script reads: errors and seeds, tensor ops, models and tokenizers, data and tasks,
                   generation, forwards, rewards, the environment contract, a step's `Rollout`
    parallel/      placement: the Accelerator (DDP, FSDP2, DeepSpeed ZeRO, TP), sharded steps, optimizers,
                   weights streamed out of shards
    integrations/  what talks to another system: vLLM (colocated and server), HTTP services, the Python tool's
                   sandbox, the built-in and hub environments, async GRPO's generator process, the flag-built inputs
    harness/       the run's life: flags, presets, the run folder, trackers, checkpoints, health, perf, evaluation

The flat module names of earlier releases (`common.models`, `common.rollout`, `common.envs`, ...) still import for
one release: each is an alias that finds its names in the modules they moved to (MOVED) and warns once
(`common.parallel`, now a folder, finds the process groups' names in its __init__.py). This file
needs the standard library only (the Python tool's sandbox imports common.integrations.sandbox with no torch).
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

# old module -> the modules its names live in now, the main one first
MOVED = {
    "args": ["common.harness.args"],
    "async_rollout": ["common.integrations.async_generator", "common.integrations.weight_mailbox"],
    "attention": ["common.core.attention"],
    "checkpoint": ["common.harness.checkpoint"],
    "cli": ["common.harness.cli"],
    "data": ["common.core.data"],
    "defaults": ["common.core.defaults"],
    "distributed": ["common.parallel.accelerator", "common.parallel.sharded"],
    "engines": ["common.integrations.engines"],
    "envs": ["common.core.envs", "common.integrations.builtin_envs", "common.core.chat"],
    "errors": ["common.core.errors"],
    "eval": ["common.harness.eval"],
    "health": ["common.harness.health"],
    "hub_envs": ["common.integrations.hub_envs", "common.integrations.inputs"],
    "models": ["common.core.models", "common.core.chat", "common.core.hub"],
    "ops": ["common.core.ops"],
    "optim": ["common.parallel.optim"],
    "perf": ["common.harness.perf"],
    "remote_rewards": ["common.integrations.remote_rewards"],
    "rewards": [
        "common.core.rewards",
        "common.core.scorers",
        "common.core.reward_workers",
        "common.integrations.inputs",
    ],
    "rollout": ["common.core.generation", "common.core.forwards"],
    "run": ["common.harness.run", "common.harness.tracking"],
    "sampling": ["common.core.sampling", "common.integrations.inputs"],
    "sandbox": ["common.integrations.sandbox"],
    "sandbox_service": ["common.integrations.sandbox_service"],
    "tasks": ["common.core.tasks"],
    "vllm_engine": ["common.integrations.vllm_engine"],
    "vllm_server": ["common.integrations.vllm_server", "common.integrations.http"],
    "weight_stream": ["common.parallel.weight_stream"],
}


class _MovedModule(types.ModuleType):
    """`common.<old>`: each name read from the first of its new modules that has it."""

    def __getattr__(self, name):
        targets = MOVED[self.__name__.rpartition(".")[2]]
        for target in targets:
            module = importlib.import_module(target)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {self.__name__!r} (moved to {', '.join(targets)}) has no attribute {name!r}")

    def __dir__(self):
        return sorted({n for t in MOVED[self.__name__.rpartition(".")[2]] for n in dir(importlib.import_module(t))})


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `common.<old>` (after the normal finders, so a real module of that name would win)."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package == __name__ and name in MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return _MovedModule(spec.name)

    def exec_module(self, module):
        new = ", ".join(MOVED[module.__name__.rpartition(".")[2]])
        warnings.warn(f"{module.__name__} moved to {new}; this alias goes in the next release", DeprecationWarning, 2)


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
