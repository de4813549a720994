"""Process-group setup shared by every launch mode. The worker reads torch.distributed's variables
(RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT); `rank_env` supplies them where a launcher
sets others:

- torchrun (`selfdraft train`), the `deepspeed` launcher, `accelerate launch` with a MULTI_GPU config
  (accelerate runs torchrun, on CPU too): set them already;
- SLURM's `srun` without a launcher: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; MASTER_ADDR must name
  the first node, e.g. `export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)`;
- `mpirun` (accelerate's MULTI_CPU config with `mpirun_hostfile`, or DeepSpeed's MPI launchers):
  Open MPI's, MVAPICH's or the PMI (MPICH, Intel MPI) rank variables, with MASTER_ADDR exported;
- plain `python -m`: a world of one.
"""

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


# What MPI implementations set for each process: (rank, world size, local rank) variable names.
MPI_VARIABLES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),  # Open MPI
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),  # MVAPICH
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),  # MPICH and Intel MPI (Hydra)
)
ACCELERATE_SIMPLE_LAUNCHER = "ACCELERATE_USE_CPU"  # set by accelerate's one-process launcher only


def mpi_env(env) -> dict[str, str] | None:
    """torch.distributed's variables from an `mpirun` process's, or None outside MPI."""
    for rank, size, local in MPI_VARIABLES:
        if rank not in env:
            continue
        if "MASTER_ADDR" not in env:
            raise UserError(
                "mpirun without torchrun: export MASTER_ADDR (the first host's address) to every process, "
                "e.g. mpirun -x MASTER_ADDR=host0 (accelerate sets it from main_process_ip)"
            )
        if env.get("MASTER_PORT") == "0":  # each process would pick its own port and never meet
            raise UserError("mpirun needs a fixed MASTER_PORT, got 0; set main_process_port, e.g. 29500")
        return {
            "RANK": env[rank],
            "WORLD_SIZE": env.get(size, "1"),
            "LOCAL_RANK": env.get(local, "0"),
            "MASTER_PORT": env.get("MASTER_PORT", "29500"),
        }
    return None


def rank_env(env) -> dict[str, str]:
    """The variables to add to `env` so this process joins its launcher's world (see the module doc)."""
    if "RANK" in env:
        return {}
    if "SLURM_PROCID" in env:
        return slurm_env(env)
    mpi = mpi_env(env)
    if mpi is not None:
        return mpi
    if ACCELERATE_SIMPLE_LAUNCHER in env and "MASTER_ADDR" in env:
        # accelerate exports MASTER_ADDR only when asked for several processes, yet its simple launcher
        # starts one (MULTI_CPU without mpirun); that one would train alone as a world of one
        raise UserError(
            "accelerate launch started one process for a multi-process CPU config (MULTI_CPU runs its "
            "processes only under mpirun); use configs/accelerate/cpu.yaml, or set mpirun_hostfile"
        )
    env_port = env.get("MASTER_PORT")
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": env_port or str(_free_port()),
    }


def init_distributed() -> tuple[int, int, torch.device]:
    """Initialise DeepSpeed's process group (gloo on CPU, nccl on GPU). Returns (rank, world, device)."""
    import deepspeed

    os.environ.update(rank_env(os.environ))
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


def shutdown_distributed() -> None:
    """Destroy the process groups while the interpreter is still whole. Left to interpreter shutdown,
    gloo's worker threads can abort a rank (SIGABRT, "terminate called without an active exception")
    after its run has finished, which fails the job. Only for a rank that finished: a rank stopping on
    an error must not wait in a teardown on peers that may be gone."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
