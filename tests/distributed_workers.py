"""Training under PyTorch's data-parallel engines, run in processes that
torch.multiprocessing spawns (so this module must stay importable by name, and light).

Every process trains the tiny example GPT with fusednorm's modules on its share of each
batch; the test compares the parameters they end with to one process trained on the
whole batches.
"""
from __future__ import annotations

import faulthandler
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpt_example import TINY, build_model, token_batch

SEED = 0
LR = 0.1


def training_batches(steps: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [token_batch(batch_size, TINY, seed=step) for step in range(steps)]


def make_model_and_optimizer(norm: str = "fused"):
    model = build_model(TINY, norm, SEED)
    # SGD with momentum: updates proportional to the gradients, so parameters compare
    # tightly (Adam would magnify rounding in gradients that are nearly zero).
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def train(model, optimizer, batches, rank: int = 0, world_size: int = 1) -> None:
    """One step per batch, on this rank's equal share of it (mean loss)."""
    for x, y in batches:
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_rank(rank: int, world_size: int, port: int, backend: str, body) -> None:
    """One spawned rank: joins the process group, runs `body()`, meets its peers, leaves.

    Every rank is done with every collective before any closes its connections (the
    barrier). The process then ends without interpreter finalization: gloo's worker
    threads can still hold tensors whose release takes the GIL of a finalizing
    interpreter, which aborts the process ("terminate called without an active
    exception"; pytorch/pytorch#179291). An exception still ends the rank with an error.
    """
    faulthandler.enable()  # a rank that crashes prints its Python stack to the test's output
    torch.set_num_threads(1)  # the processes share the machine's cores
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        body()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _train_rank(rank: int, world_size: int, engine: str, batches, out_dir: str) -> None:
    model, _ = make_model_and_optimizer()
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    elif engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
        assert all(isinstance(p, DTensor) for p in model.parameters()), "not sharded"
    else:
        raise ValueError(f"unknown engine {engine!r}")
    # The optimizer is built after wrapping: FSDP2 replaces the parameters by shards.
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR, momentum=0.9)
    train(wrapped, optimizer, batches, rank, world_size)
    state = {
        name: value.full_tensor() if hasattr(value, "full_tensor") else value
        for name, value in model.state_dict().items()
    }
    torch.save(state, Path(out_dir) / f"rank{rank}.pt")


def _worker(rank: int, world_size: int, port: int, engine: str, batches, out_dir: str) -> None:
    run_rank(rank, world_size, port, "gloo",
             lambda: _train_rank(rank, world_size, engine, batches, out_dir))


def train_distributed(engine: str, batches, world_size: int = 2) -> list[dict[str, torch.Tensor]]:
    """Trains under `engine` ("ddp" or "fsdp2") in `world_size` processes on gloo and
    returns each rank's final state dict (full tensors)."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, _free_port(), engine, batches, out_dir),
                 nprocs=world_size, join=True)
        return [torch.load(Path(out_dir) / f"rank{rank}.pt") for rank in range(world_size)]
