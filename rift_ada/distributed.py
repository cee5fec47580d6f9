"""Data parallelism under ``torchrun``: every process decodes (or labels, or precomputes) a shard of the prompts and
the results are gathered; the compressibility trainer also sums its LoRA gradients across processes.

    torchrun --nproc-per-node 2 -m rift_ada.evaluate --json ...
    torchrun --nproc-per-node 2 experiments/train_compressibility.py --grad-accum 4 ...

``init(device)`` joins the process group torchrun describes in its environment (gloo on CPU, nccl on CUDA, where
process ``LOCAL_RANK`` takes ``cuda:LOCAL_RANK``, see :func:`local_device`); without torchrun it does nothing and the
world is one process. :func:`shard` and :func:`gather` are then the identity, so code written with them runs
unchanged in a single process, and so are :func:`broadcast` and :func:`all_reduce_sum_`. ``rift_ada.evaluate.evaluate``,
``trainers/compressibility.py`` and ``rift_ada.replay.build.build_tables`` use them; nothing here patches torch or anything
else.
"""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from typing import Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# Processes meet once, at the gather after their shards: a shard that takes long (long prompts on one process) must
# not time the others out, as torch's defaults (30 min gloo, 10 min nccl) would.
TIMEOUT = datetime.timedelta(hours=24)


class RankError(RuntimeError):
    """An error one process hit on its own shard (the others may not have): every process prints its own, unlike
    errors in the identical setup before the shards, which rank 0 alone reports."""


def launched() -> bool:
    """True in a process started by torchrun (it sets ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` ...)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def launched_world_size() -> int:
    """The number of processes torchrun started (its ``WORLD_SIZE``; 1 outside torchrun), known before :func:`init`."""
    return _env_int("WORLD_SIZE", 1) if launched() else 1


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"torchrun's {name}={os.environ[name]!r} is not an integer") from None


def local_device(device: str) -> str:
    """The device this process decodes on: ``cuda`` becomes ``cuda:LOCAL_RANK`` under torchrun; anything else is
    kept. ValueError (the same on every process) for more processes on this node than CUDA devices, or for one
    ``cuda:N`` shared by several processes."""
    if not launched() or torch.device(device).type != "cuda":
        return device
    local, per_node = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    if torch.device(device).index is not None:
        if per_node > 1:
            raise ValueError(f"--device {device}: under torchrun give --device cuda (process LOCAL_RANK takes "
                             f"cuda:LOCAL_RANK), not one device for all {per_node} processes")
        return device
    n = torch.cuda.device_count()
    if per_node > n:
        raise ValueError(f"torchrun started {per_node} processes on this node but it has {n} CUDA device(s); use "
                         f"--nproc-per-node {n} or fewer")
    return f"cuda:{local}"


def init(device: str = "cpu") -> int:
    """Join torchrun's process group (once; later calls only return the size) and return the world size: 1, and
    nothing done, outside torchrun. ``device`` is this process's device (:func:`local_device`): a CUDA device picks
    nccl and becomes the current device, anything else gloo."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if not launched():
        return 1
    if not dist.is_available():
        raise RuntimeError(f"torchrun set WORLD_SIZE but this torch ({torch.__version__}) has no torch.distributed")
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # nccl's object collectives run on the current device
        dist.init_process_group("nccl", timeout=TIMEOUT, device_id=dev)
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)
    return dist.get_world_size()


def destroy(meet: bool = True) -> None:
    """Leave the process group (no-op when none was joined), once every process has come here (``meet=False``: at
    once, for a process leaving on an error its peers may not share, which must not wait for them).

    The processes meet on torchrun's TCP store, not over gloo: a process that tears down its gloo pairs while a peer
    still drains the last collective's writes makes that peer abort ("terminate called without an active
    exception", pytorch/gloo#155), and a gloo barrier right before the teardown has the same race. On the store, all
    processes are past their last collective before any one of them closes a pair."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if meet and dist.get_world_size() > 1:
        store = dist.distributed_c10d._get_default_store()
        if store.add("rift_ada/leaving", 1) == dist.get_world_size():
            store.set("rift_ada/all_left", "1")
        store.wait(["rift_ada/all_left"])
    dist.destroy_process_group()


@contextmanager
def leaving():
    """Around a job's body: :func:`destroy` on the way out, meeting the other processes when the body ended normally
    and not when it raised (a process failing alone must not wait for peers stuck in a collective)."""
    try:
        yield
    except BaseException:
        destroy(meet=False)
        raise
    destroy()


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    """Whether this process prints: rank 0 (torchrun's ``RANK`` before :func:`init` and after :func:`destroy`), or
    the only process there is."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return not launched() or os.environ["RANK"] == "0"


def shard(items: Sequence[T]) -> list[tuple[int, T]]:
    """This process's share of ``items`` with their indices: strided (rank r gets r, r + W, r + 2W ...), so prompts
    of growing length spread evenly. All of them, in order, in a single process; empty when there are fewer items
    than processes."""
    return [(i, items[i]) for i in range(rank(), len(items), world_size())]


def gather(indexed: list[tuple[int, T]]) -> list[T]:
    """Every process's ``(index, item)`` pairs (from :func:`shard`), as one list of items in index order, returned to
    every process (``all_gather_object``, a collective: each process must call it). The items are pickled. In a single
    process: the items, in order."""
    if world_size() == 1:
        pairs = list(indexed)
    else:
        parts: list = [None] * world_size()
        dist.all_gather_object(parts, list(indexed))
        pairs = [pair for part in parts for pair in part]
    pairs.sort(key=lambda pair: pair[0])
    if [i for i, _ in pairs] != list(range(len(pairs))):
        raise RuntimeError(f"gathered indices {[i for i, _ in pairs]} are not 0..{len(pairs) - 1}: the processes "
                           "sharded different lists")
    return [item for _, item in pairs]


def broadcast(obj: T) -> T:
    """Rank 0's ``obj`` on every process (``broadcast_object_list``, a collective: each process must call it; it is
    also a barrier). The object is pickled. In a single process: ``obj``."""
    if world_size() == 1:
        return obj
    box = [obj if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait until every process comes here (no-op in a single process)."""
    broadcast(None)


def _flat_groups(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def all_reduce_sum_(tensors: Sequence[torch.Tensor]) -> None:
    """Sum each tensor over the processes, in place (one flat ``all_reduce`` per device and dtype). Every process
    gets the very same sums. No-op in a single process."""
    if world_size() == 1:
        return
    for group in _flat_groups(tensors):
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for t, part in zip(group, flat.split([t.numel() for t in group])):
            t.copy_(part.view_as(t))


def broadcast_(tensors: Sequence[torch.Tensor]) -> None:
    """Overwrite each tensor with rank 0's, in place (one flat ``broadcast`` per device and dtype). No-op in a
    single process."""
    if world_size() == 1:
        return
    for group in _flat_groups(tensors):
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.broadcast(flat, src=0)
        for t, part in zip(group, flat.split([t.numel() for t in group])):
            t.copy_(part.view_as(t))


@contextmanager
def on_shard(index: int):
    """Around one item of this process's shard: under torchrun a ValueError / RuntimeError becomes a
    :class:`RankError` naming the process and the item; in a single process errors pass unchanged."""
    try:
        yield
    except (ValueError, RuntimeError) as e:
        if world_size() == 1 or isinstance(e, RankError):
            raise
        raise RankError(f"rank {rank()}, item {index}: {e}") from e
