"""Process-group setup shared by every launch mode: one process, torchrun (`selfdraft train`), the
`deepspeed` launcher, and SLURM's `srun` without a launcher (SLURM_PROCID / SLURM_NTASKS /
SLURM_LOCALID become RANK / WORLD_SIZE / LOCAL_RANK; MASTER_ADDR must name the first node, e.g.
`export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)`)."""

from __future__ import annotations

import importlib
import os
import socket

import torch

from selfdraft.errors import UserError

DEEPSPEED_SHM_HOOK = "build_shm_op"  # private deepspeed.comm.torch function, checked by a test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _skip_shm_op() -> None:
    """DeepSpeed compiles a C++ shared-memory op on CPU init; it only serves inference all-reduce.

    `import deepspeed.comm.torch as m` yields torch itself (name clash), hence importlib.
    """
    module = importlib.import_module("deepspeed.comm.torch")
    if not hasattr(module, DEEPSPEED_SHM_HOOK):
        raise RuntimeError(
            f"deepspeed.comm.torch.{DEEPSPEED_SHM_HOOK} is gone in this DeepSpeed version; pin deepspeed"
        )
    setattr(module, DEEPSPEED_SHM_HOOK, lambda: None)


def slurm_env(env) -> dict[str, str]:
    """torch.distributed's variables from an `srun` task's SLURM ones (every task then joins one run
    instead of training alone into the same folder)."""
    if "MASTER_ADDR" not in env:
        raise UserError(
            "srun without torchrun: set MASTER_ADDR to the first node's address "
            "(export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1))"
        )
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env.get("SLURM_NTASKS", "1"),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "MASTER_PORT": env.get("MASTER_PORT", "29500"),
    }


def init_distributed() -> tuple[int, int, torch.device]:
    """Initialise DeepSpeed's process group (gloo on CPU, nccl on GPU). Returns (rank, world, device)."""
    import deepspeed

    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ.update(slurm_env(os.environ))
    if "RANK" not in os.environ:  # plain `python -m ...`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    cuda = torch.cuda.is_available()
    if not cuda:
        _skip_shm_op()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return rank, world, device
