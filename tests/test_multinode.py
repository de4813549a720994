"""Two nodes x one rank on this machine: two `selfdraft train` launchers on loopback, each with its own
node-local run folder, train ONE run together; SLURM's srun variables map to torch.distributed's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from selfdraft.errors import UserError
from selfdraft.training.distributed import slurm_env

ROOT = Path(__file__).resolve().parent.parent


def test_srun_variables_become_torch_distributed_ones():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "MASTER_ADDR": "node0"}
    assert slurm_env(env) == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_PORT": "29500"}
    with pytest.raises(UserError, match="MASTER_ADDR"):
        slurm_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_with_node_local_folders_train_one_run(tmp_path, text_run):
    path = text_run(
        train={"max_steps": 4}, schedule={"save_every": 4, "eval_every": 4, "eval_examples": 4}
    )
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    nodes = []
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "selfdraft.scripts.cli", "train", "--config", str(path), "--nproc", "1",
               "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--output-dir", str(tmp_path / f"node{rank}")]  # fmt: skip
        nodes.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
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
