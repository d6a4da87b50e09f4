"""Process groups, device choice and how the drafter is wrapped for data parallelism.

One process per GPU (torchrun), one Python thread doing GPU work. The drafter is sharded with
FSDP2 (``fully_shard``, bf16 compute with fp32 master weights and fp32 gradient reduction) or
replicated with DDP; a single process without torchrun uses the plain module under autocast.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from dflash_train.models.dtypes import parse_device


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def use_expandable_segments() -> None:
    """Expandable CUDA allocator segments unless the user set PYTORCH_CUDA_ALLOC_CONF: the step's
    shapes change with the sequence bucket, and fixed-size segments then fragment memory (a 128K row
    that fails with 9.5 GiB reserved but unallocated). Must run before the first CUDA allocation."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def pick_device(requested: str, local_rank: int = 0) -> torch.device:
    """``auto`` = this rank's GPU when CUDA is present, else CPU."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"train.device={requested} but no CUDA device is visible; use train.device=cpu or auto."
            )
        return (
            torch.device("cuda", local_rank)
            if requested == "cuda"
            else parse_device(requested, "train.device")
        )
    return parse_device(requested, "train.device")


def init_distributed(requested_device: str = "auto", timeout_s: float = 1800.0) -> DistInfo:
    """Join the torchrun job if launched by torchrun (NCCL on GPU, gloo on CPU), else run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(requested_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


def finish_distributed() -> None:
    """Leave the torchrun job this process joined (``init_distributed``), before the interpreter exits.

    Left to the interpreter's teardown, gloo's worker threads can still hold tensors while Python
    is being finalised, and a rank whose run finished dies with SIGABRT ("terminate called without
    an active exception"; torchrun then reports the job failed); NCCL warns that the group was never
    destroyed. The run's modules are collected first: a DDP module collected after its group was
    destroyed once hung a rank in its destructor."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place sum across the ranks of ``group`` (default: all; no-op alone); no host sync."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def wrap_drafter(
    drafter: nn.Module,
    strategy: str,
    dtype: torch.dtype,
    info: DistInfo,
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Apply the data-parallel strategy over ``group`` (default: all ranks); parameters stay fp32.

    ``group`` becomes DDP's process group or FSDP2's device mesh (split placement trains the
    drafter on a subset of the ranks); a group of one rank trains the plain module.
    """
    if not info.distributed:
        return drafter
    if group is not None and dist.get_world_size(group) == 1:
        return drafter  # as a single process would
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(drafter, device_ids=ids, process_group=group)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(group, info.device.type) if group is not None else None
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in drafter.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(drafter, mesh=mesh, mp_policy=policy)
    return drafter


def uses_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unwrap(model: nn.Module) -> nn.Module:
    """The drafter module itself (DDP keeps it in ``.module``; FSDP2 shards it in place)."""
    return getattr(model, "module", model)


def full_model_state(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """The drafter's full fp32 state dict on CPU (gathered from shards; every rank must call).

    Without ``group`` the state lands on global rank 0; with one, on the group's first rank and
    ``{}`` on the others (see ``on_group_leader_cpu``).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=group is None)
    state = get_model_state_dict(unwrap(model) if not uses_fsdp(model) else model, options=options)
    return on_group_leader_cpu(state, group)


def full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None = None
) -> dict:
    """The optimizer's full state keyed by parameter names (every rank must call); ``group`` as above."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=group is None)
    state = get_optimizer_state_dict(
        unwrap(model) if not uses_fsdp(model) else model, optimizer, options=options
    )
    return on_group_leader_cpu(state, group)


def on_group_leader_cpu(state: dict, group: dist.ProcessGroup | None) -> dict:
    """``state`` (gathered on the device) copied to the CPU of ``group``'s first rank; ``{}`` elsewhere.

    ``cpu_offload`` keeps a full state only on *global* rank 0, which need not be in ``group`` (split
    placement's drafter group starts at rank ``target_ranks``), so a group gathers on the device and
    its first rank copies. Without a group the state is returned as it is.
    """
    if group is None:
        return state
    if dist.get_rank(group) != 0:
        return {}
    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, state)


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict
) -> None:
    """Load full state dicts into a (possibly sharded) drafter and its optimizer."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    target = unwrap(model) if not uses_fsdp(model) else model
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    set_model_state_dict(target, model_state, options=options)
    set_optimizer_state_dict(target, optimizer, optim_state, options=options)
