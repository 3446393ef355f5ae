"""The trainer's ranks under `torchrun`: process group set-up and the collectives one step needs.

Data parallel as torch DDP does it (gradients all-reduced after backward, every rank then takes
the same optimizer step), written out with `torch.distributed` collectives because a TTT step
calls the draft's `ttt_forward`, not `forward` (DDP's hooks hang off `forward`), and a rank's
share of a global batch may hold nothing to learn while another's does (DDP would wait for its
gradients forever). Backend: gloo on CPU, nccl on CUDA (`torchrun` sets RANK, WORLD_SIZE,
MASTER_ADDR/PORT; see https://pytorch.org/docs/stable/elastic/run.html).
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def torchrun_argv(nproc_per_node: int, nnodes: int, max_restarts: int, endpoint: str, run_id: str, tail: list[str],
                  node_rank: int | None = None) -> list[str]:
    """`python -m torch.distributed.run` (torchrun) for `tail` (`-m module args...`): c10d
    rendezvous at `endpoint` (host:port) under `run_id`, ranks numbered as nodes join; with
    `node_rank`, a static rendezvous instead (`endpoint` is node 0, the master; this node's ranks
    are node_rank·nproc_per_node + local rank, so global rank 0 is on node 0)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc_per_node),
           "--nnodes", str(nnodes), "--max-restarts", str(max_restarts)]
    if node_rank is None:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]
    else:
        host, port = endpoint.rsplit(":", 1)
        cmd += ["--node-rank", str(node_rank), "--master-addr", host, "--master-port", port]
    return cmd + tail


# how long a rank waits in a collective: rank 0 alone prepares the validation set and evaluates,
# saves and measures at the end while the others wait (torch's defaults: 10 min nccl, 30 min gloo)
COLLECTIVE_TIMEOUT = timedelta(hours=2)


def world() -> tuple[int, int]:
    """(rank, world size) of this process: from an initialised process group, else from
    torchrun's RANK / WORLD_SIZE, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init(device: torch.device) -> tuple[int, int]:
    """Join torchrun's process group when WORLD_SIZE > 1 (gloo on CPU, nccl on CUDA, the rank's
    GPU = LOCAL_RANK); a no-op for one process. Returns (rank, world size)."""
    rank, size = world()
    if size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        store, r, n = next(dist.rendezvous("env://"))
        # torchrun keeps one store across restarts: a restarted rank must not read the addresses
        # its dead predecessors published (gloo would connect to a dead port), so each attempt
        # keys its own namespace
        store = dist.PrefixStore(f"tidespec/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=r, world_size=n,
                                timeout=COLLECTIVE_TIMEOUT)
    return world()


def rank_device(device: torch.device) -> torch.device:
    """The device of this rank: `cuda` resolves to cuda:LOCAL_RANK under torchrun (one GPU per
    rank, as torchrun's --nproc-per-node counts them); CPU as is."""
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return device


def place(device: torch.device) -> tuple[torch.device, int, int]:
    """(this rank's device, rank, world size) on the resolved train `device`
    (`models.device.resolve_training`): `rank_device`, after joining the process group (`init`)."""
    dev = rank_device(device)
    return (dev, *init(dev))


def sum_(t: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) `t` in place across ranks; returns it (as is for one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def sum_grads(params: list[torch.Tensor]) -> None:
    """Sum every parameter's gradient across ranks (a missing gradient counts as zeros), in one
    flat buffer: each rank's loss is already divided by the global batch's token count, so the
    sum is the gradient one process would take over the whole batch."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    i = 0
    for p in params:
        n = p.numel()
        p.grad = flat[i:i + n].view_as(p).clone()
        i += n


def gather(obj) -> list:
    """Every rank's `obj` (picklable), in rank order; [obj] for one process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj):
    """Rank 0's `obj` (picklable) on every rank; `obj` as is for one process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait for every rank (no-op for one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def close() -> None:
    """Leave the process group (no-op when none)."""
    if dist.is_initialized():
        dist.destroy_process_group()
