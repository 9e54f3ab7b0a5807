"""The process groups of this process, in one place: set once by common.parallel.accelerator.make_accelerator (under
--tp-size), read by the tensor functions (common.core.ops) and the loaders (common.core.models). Nothing else writes
them.

Without tensor parallelism everything is None: batch statistics reduce over every process (the default
group), models load whole and the LM head's logits are whole rows.
"""

import contextlib
from dataclasses import dataclass


@dataclass
class ParallelState:
    tp_mesh: object = None  # the 1-D tensor-parallel DeviceMesh (--tp-size > 1), else None
    tp_group: object = None  # its process group: the vocabulary-parallel log-softmax reduces over it
    dp_group: object = None  # one rank per TP group: "the whole batch" statistics reduce over it (None: all)
    dp_size: int = 1  # data-parallel ranks (> 1 under TP: FSDP2 over them, TP x FSDP2)
    logits_sharded: bool = False  # inside sharded_logits(): the head keeps this rank's vocabulary block


STATE = ParallelState()


def set_tensor_parallel(tp_mesh, tp_group, dp_group, dp_size: int) -> None:
    """Under --tp-size: shard every model loaded from now on over tp_mesh (and FSDP2 over dp_size ranks),
    reduce batch statistics over dp_group, log-softmax over tp_group. (None, None, None, 1): back to none."""
    STATE.tp_mesh, STATE.tp_group, STATE.dp_group, STATE.dp_size = tp_mesh, tp_group, dp_group, dp_size


def tensor_parallel_active() -> bool:
    """--tp-size > 1 in this process."""
    return STATE.tp_group is not None


@contextlib.contextmanager
def sharded_logits():
    """Forwards of the policy inside the block return this rank's vocabulary block of the logits under
    --tp-size, and common.core.ops.selective_log_softmax / logprobs_and_entropy take such blocks. No-op without
    TP. Only for log-probs: sampling (the rollout) needs whole rows and runs outside the block."""
    before = STATE.logits_sharded
    STATE.logits_sharded = STATE.tp_group is not None
    try:
        yield
    finally:
        STATE.logits_sharded = before
