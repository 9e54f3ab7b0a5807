"""Two CPU processes over gloo through `accelerate launch`: DDP (configs/accelerate/cpu_2proc.yaml),
FSDP2 (cpu_2proc_fsdp2.yaml: Accelerate's fully_shard path, switched on for CPU processes by
common.parallel.accelerator.make_accelerator) and DeepSpeed ZeRO-2/3 (cpu_2proc_zero{2,3}.yaml: DeepSpeed's
CPU accelerator over gloo)."""

import atexit
import shutil

import torch

from conftest import REPO
from shared_distributed import _SHARED

atexit.register(shutil.rmtree, _SHARED, True)


def test_accelerate_configs_are_consistent():
    import yaml

    for path in sorted((REPO / "configs" / "accelerate").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        assert cfg["distributed_type"] in ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED"), path
        assert cfg["num_processes"] % cfg["num_machines"] == 0, path
        pc = cfg.get("parallelism_config")
        if pc:
            prod = (
                pc["parallelism_config_dp_replicate_size"]
                * pc["parallelism_config_dp_shard_size"]
                * pc["parallelism_config_tp_size"]
                * pc["parallelism_config_cp_size"]
            )
            assert prod == cfg["num_processes"], path


def test_fsdp_param_groups_on_either_torch():
    """FSDP2's per-unit reshard settings are read through private state: a list of parameter groups in torch 2.12+,
    one group or None before (torch 2.11 on a GPU image failed with AttributeError: benchmarks/gpu_check.sh)."""
    from types import SimpleNamespace

    from common.parallel.sharded import _param_groups

    assert _param_groups(SimpleNamespace(_fsdp_param_groups=["a", "b"], _fsdp_param_group="a")) == ["a", "b"]
    assert _param_groups(SimpleNamespace(_fsdp_param_group="a")) == ["a"]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


def test_fsdp2_reduces_gradients_in_float32():
    """Accelerate's `mixed_precision: bf16` gives FSDP2 MixedPrecisionPolicy(reduce_dtype=bf16); make_accelerator
    keeps param_dtype and output_dtype and reduces in float32 (issue 64). No mixed precision: float32 reduction too."""
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from common.parallel.accelerator import _fp32_reduction, _mp_policy

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")  # what accelerate launch --mixed_precision bf16 does
    assert plugin.mixed_precision_policy.reduce_dtype == torch.bfloat16
    _fp32_reduction(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))
    got = plugin.mixed_precision_policy
    assert (got.param_dtype, got.reduce_dtype, got.output_dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    assert _mp_policy(None) == MixedPrecisionPolicy(reduce_dtype=torch.float32)
