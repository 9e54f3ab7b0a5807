"""Placement: the Accelerator (DDP, FSDP2, DeepSpeed ZeRO, TP), sharded steps, optimizers, weights out of
shards.

`common.parallel` was, until this release, the module of the process groups (now common.core.process_groups): its
names (`STATE`, `sharded_logits`, ...) are still found here, with a DeprecationWarning, for one release."""


def __getattr__(name):
    import importlib
    import warnings

    groups = importlib.import_module("common.core.process_groups")
    if name.startswith("__") or not hasattr(groups, name):
        raise AttributeError(f"module 'common.parallel' has no attribute {name!r}")
    warnings.warn(f"common.parallel.{name} moved to common.core.process_groups.{name}; this alias goes in the next "
                  "release", DeprecationWarning, 2)  # fmt: skip
    return getattr(groups, name)
