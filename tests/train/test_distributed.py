"""run_sft_multi_node.sh with real torchrun + DeepSpeed ZeRO-2 on CPU (gloo), tiny-random-llama."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.distributed


def launch(tmp_path, env_extra, config="configs/train/tiny_deepspeed_cpu.yaml", *args):
    # the rendezvous comes from env_extra only, never from the caller's environment
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env = {**inherited, "PYTHON": sys.executable, **env_extra}
    return subprocess.Popen(["bash", "run_sft_multi_node.sh", config, "--output_dir", str(tmp_path), *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_processes_deepspeed_zero2(tmp_path):
    proc = launch(tmp_path / "ds", {"NPROC_PER_NODE": "2", "MASTER_PORT": "29611"})
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert (tmp_path / "ds" / "final" / "model.safetensors").is_file()
    assert (tmp_path / "ds" / "checkpoint-3" / "global_step3").is_dir(), "DeepSpeed engine checkpoint missing"


def test_two_nodes_one_process_each_on_loopback(tmp_path):
    common = {"NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29623"}
    nodes = [launch(tmp_path / "nodes", {**common, "NODE_RANK": str(r)}, "configs/train/tiny_smoke.yaml",
                    "--max_steps", "2") for r in (0, 1)]
    outs = [n.communicate(timeout=600)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), outs[0][-2000:] + outs[1][-2000:]
    assert (tmp_path / "nodes" / "final" / "adapter_model.safetensors").is_file()


def test_one_node_launch_beside_a_busy_default_port(tmp_path):
    """A one-node run with no MASTER_ADDR / MASTER_PORT must not need port 29500: a second training,
    or the test suite, beside a running one failed with EADDRINUSE before the launcher used torchrun
    --standalone (a free port) there."""
    with socket.socket() as busy:
        try:
            busy.bind(("127.0.0.1", 29500))
            busy.listen()
        except OSError:  # already taken by something else: the case this test is about anyway
            pass
        proc = launch(tmp_path / "run", {"NPROC_PER_NODE": "1"}, "configs/train/tiny_smoke.yaml", "--max_steps", "1")
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").is_file()


def test_launcher_help_and_missing_config():
    help_out = subprocess.run(["bash", "run_sft_multi_node.sh", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert help_out.returncode == 0 and "NNODES" in help_out.stdout
    bad = subprocess.run(["bash", "run_sft_multi_node.sh", "configs/train/nope.yaml"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "config not found" in bad.stderr


def _budget_rank(rank, port, results):
    import time

    import torch.distributed as dist
    from transformers import TrainerControl

    from space.train.callbacks import TimeBudgetCallback

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cb = TimeBudgetCallback(minutes=1.0)
    cb.start = time.monotonic() - (120 if rank == 0 else 0)  # only rank 0 is over its budget
    control = TrainerControl()
    cb.on_step_end(type("Args", (), {"device": "cpu"})(), None, control)
    results[rank] = control.should_training_stop and control.should_save
    dist.destroy_process_group()


def test_time_budget_stops_every_rank_together():
    """Rank clocks differ; if only the rank over budget stopped, the other would hang in its next
    collective. Both must stop at the same step."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_budget_rank, args=(29637, results), nprocs=2, join=True)
    assert dict(results) == {0: True, 1: True}
