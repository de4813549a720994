"""Every launch mode starts the same worker: two `selfdraft train` launchers on loopback (two nodes, each
with its own node-local run folder), `accelerate launch` with the shipped configs, and the `deepspeed`
launcher each train ONE 2-rank run; SLURM's srun and MPI variables map to torch.distributed's."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from selfdraft.errors import UserError
from selfdraft.training.data.prepare import prepare_from_config
from selfdraft.training.distributed import rank_env, slurm_env

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE_CONFIGS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_srun_variables_become_torch_distributed_ones():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "MASTER_ADDR": "node0"}
    assert slurm_env(env) == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_PORT": "29500"}
    assert rank_env(env) == slurm_env(env)
    with pytest.raises(UserError, match="MASTER_ADDR"):
        slurm_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


def test_mpi_and_launcher_variables_become_torch_distributed_ones():
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    assert rank_env({**torchrun, "SLURM_PROCID": "5", "PMI_RANK": "5"}) == {}  # a launcher's own win
    expected = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_PORT": "29511"}
    open_mpi = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    hydra = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"}  # MPICH, Intel MPI
    for mpi in (open_mpi, hydra):
        assert rank_env({**mpi, "MASTER_ADDR": "n0", "MASTER_PORT": "29511"}) == expected
        with pytest.raises(UserError, match="export MASTER_ADDR"):
            rank_env(mpi)
        with pytest.raises(UserError, match="fixed MASTER_PORT"):
            rank_env({**mpi, "MASTER_ADDR": "n0", "MASTER_PORT": "0"})
    alone = rank_env({})  # plain `python -m`
    assert (alone["RANK"], alone["WORLD_SIZE"], alone["LOCAL_RANK"]) == ("0", "1", "0")
    assert int(alone["MASTER_PORT"]) > 0
    assert rank_env({"ACCELERATE_USE_CPU": "True"})["WORLD_SIZE"] == "1"  # `accelerate launch --cpu`: one
    # accelerate's MULTI_CPU type without mpirun: several processes asked for, one started
    with pytest.raises(UserError, match="configs/accelerate/cpu.yaml"):
        rank_env({"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})


def test_accelerate_configs_parse_and_leave_deepspeed_to_the_run_config():
    from accelerate.commands.config.config_args import load_config_from_file

    assert {p.name for p in ACCELERATE_CONFIGS} >= {"cpu.yaml", "gpu.yaml", "multi-node.yaml"}
    for path in ACCELERATE_CONFIGS:
        config = load_config_from_file(str(path))
        assert config.distributed_type == "MULTI_GPU" and config.mixed_precision == "no", path
        assert config.deepspeed_config == {} and config.num_processes >= 2, path
        assert set(yaml.safe_load(path.read_text())) <= set(vars(config)), path  # no key accelerate drops


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], timeout: int = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run a launcher in its own session; on a timeout the whole group (launcher and ranks) goes."""
    proc = subprocess.Popen(
        cmd,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kwargs,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def _assert_one_two_rank_run(run: Path) -> None:
    """Two ranks trained one run: one log (rank 0's) of a world of 2, a checkpoint holding each rank's
    optimizer shard, and data-parallel replicas ending with the same parameters."""
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert log[0]["world_size"] == 2 and any(r.get("event") == "done" for r in log)
    reports = [json.loads((run / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in reports] == [2, 2] and reports[0]["step"] == reports[1]["step"] == 2
    assert reports[0]["params_sha256"] == reports[1]["params_sha256"]
    tag = (run / "checkpoints" / "latest").read_text().strip()
    shards = sorted(
        p.name.split("zero_pp_rank_")[1][0] for p in (run / "checkpoints" / tag).glob("*zero_pp_rank_*")
    )
    assert shards == ["0", "1"], shards
    assert (run / "heads" / "config.json").is_file()


def _tiny_two_step_run(text_run) -> Path:
    """A two-step run prepared as `selfdraft prepare` does; its resolved config (what workers read)."""
    config = text_run(train={"max_steps": 2}, schedule={"save_every": 2, "eval_every": 2, "eval_examples": 4})
    return prepare_from_config(config)


@pytest.mark.slow
def test_accelerate_launch_trains_one_two_rank_run(tmp_path, text_run):
    path = _tiny_two_step_run(text_run)
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", str(ROOT / "configs/accelerate/cpu.yaml"),
           "-m", "selfdraft.training.train", "--config", str(path)]  # fmt: skip
    job = _run(cmd)
    assert job.returncode == 0, job.stdout[-3000:]
    _assert_one_two_rank_run(tmp_path / "run")


@pytest.mark.slow
def test_deepspeed_launcher_trains_one_two_rank_run(tmp_path, text_run):
    path = _tiny_two_step_run(text_run)
    # --num_gpus (alias --num_accelerators) is the local rank count; DeepSpeed's CPU accelerator takes it
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_free_port()),
           "--module", "selfdraft.training.train", "--config", str(path)]  # fmt: skip
    job = _run(cmd)
    assert job.returncode == 0, job.stdout[-3000:]
    assert "--local_rank=1" in job.stdout  # the launcher's own flag reached the worker
    _assert_one_two_rank_run(tmp_path / "run")


PROBE = """
import os, torch, torch.distributed as dist
from selfdraft.training.distributed import init_distributed
rank, world, _ = init_distributed()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print("PROBE", rank, world, int(total), flush=True)
dist.destroy_process_group()
"""


def _node_command(launcher: str, rank: int, port: int, probe: Path) -> list[str]:
    """One node's launch of `probe` in a world of two nodes x one process on loopback."""
    if launcher == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch",
                "--config_file", str(ROOT / "configs/accelerate/multi-node.yaml"), "--num_processes", "2",
                "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                str(probe)]  # fmt: skip
    hostfile = probe.with_name("hostfile")  # two names for this machine: two "hosts" of one slot each
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
            "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port), str(probe)]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["accelerate", "deepspeed"])
def test_multi_node_launchers_join_one_world_on_loopback(tmp_path, launcher):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    port = _free_port()
    nodes = [
        subprocess.Popen(
            _node_command(launcher, rank, port, probe),
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    lines = sorted(line for out in outputs for line in out.splitlines() if line.startswith("PROBE"))
    assert lines == ["PROBE 0 2 3", "PROBE 1 2 3"]  # ranks 0 and 1 of one world summed 1 + 2


@pytest.mark.slow
def test_two_nodes_with_node_local_folders_train_one_run(tmp_path, text_run):
    path = text_run(train={"max_steps": 4}, schedule={"save_every": 4, "eval_every": 4, "eval_examples": 4})
    port = _free_port()
    nodes = []
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "selfdraft.scripts.cli", "train", "--config", str(path), "--nproc", "1",
               "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--output-dir", str(tmp_path / f"node{rank}")]  # fmt: skip
        nodes.append(
            subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    # c10d rendezvous hands out global ranks in join order, so either node may hold rank 0 (the log)
    folders = [tmp_path / "node0", tmp_path / "node1"]
    (first,) = [f for f in folders if (f / "log.jsonl").is_file()]
    log = [json.loads(x) for x in (first / "log.jsonl").read_text().splitlines()]
    assert log[0]["world_size"] == 2 and any(r.get("event") == "done" for r in log)
    owned = set()
    for folder in folders:  # each node built its own splits and wrote its own rank's checkpoint part
        assert (folder / "data" / "splits.json").is_file()
        shards = [p.name for p in (folder / "checkpoints").glob("step-*/*zero_pp_rank_*")]
        assert len(shards) == 1, shards
        owned.add(shards[0].split("zero_pp_rank_")[1][0])
    assert owned == {"0", "1"}
    # both nodes rendered the same data, so the ranks trained one run on one split
    ids = [json.loads((tmp_path / f"node{r}" / "heldout_ids.json").read_text()) for r in (0, 1)]
    assert ids[0] == ids[1]
