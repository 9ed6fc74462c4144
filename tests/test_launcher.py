"""run_sft_multi_node.sh: how many processes it starts per node, where it finds the config, its
--smoke dispatch, and torchrun's failure in one line (its bad inputs: tests/test_bad_inputs.py).

The launcher runs with SPACE_LAUNCH_DRY_RUN=1 (it prints the command instead of running torchrun) and a
fake ``nvidia-smi`` first on PATH that prints what the real one prints on a GPU machine."""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "run_sft_multi_node.sh"
CONFIG = "configs/train/tiny_smoke.yaml"
BASH = shutil.which("bash")

EIGHT_H100 = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-6a3f1c2e-9b7d-4e01-8c5a-{i:012x})\n" for i in range(8))
ONE_A100_THREE_MIG = (
    "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)\n"
    "  MIG 3g.40gb     Device  0: (UUID: MIG-c6d4f1b8-4c1e-5e9a-9f3e-0a1b2c3d4e5f)\n"
    "  MIG 2g.20gb     Device  1: (UUID: MIG-8e2f5a7c-1d3b-5f60-a4c9-1b2c3d4e5f60)\n"
    "  MIG 1g.10gb     Device  2: (UUID: MIG-0f9e8d7c-6b5a-5a49-b3c2-2c3d4e5f6071)\n"
)
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.\n")
# what the launcher may inherit from the caller and that would change the count
CLEARED = ("NPROC_PER_NODE", "CUDA_VISIBLE_DEVICES", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
           "SPACE_LAUNCH_DRY_RUN")


def fake_nvidia_smi(tmp_path, listing, rc=0):
    """A folder holding an ``nvidia-smi`` that prints ``listing`` for ``-L``."""
    bin_dir = tmp_path / "fake_bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "listing.txt").write_text(listing)
    exe = bin_dir / "nvidia-smi"
    exe.write_text(f'#!/bin/sh\n[ "$1" = "-L" ] || exit 6\nwhile IFS= read -r line; do printf "%s\\n" "$line"; done '
                   f'< "{bin_dir / "listing.txt"}"\nexit {rc}\n')
    exe.chmod(0o755)
    return bin_dir


def path_without_nvidia_smi(tmp_path):
    """A PATH of symlinks to the tools the launcher uses, and no nvidia-smi."""
    bin_dir = tmp_path / "bare_bin"
    bin_dir.mkdir()
    for tool in ("bash", "sh", "dirname", "grep", "sed"):
        found = shutil.which(tool)
        assert found, f"{tool} not found"
        (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def launch(env_extra, *args, path=None, config=CONFIG, cwd=ROOT, stderr=None):
    """The command the launcher would run, as words; ``stderr``: a list that gets its stderr lines."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update({"PYTHON": sys.executable, "SPACE_LAUNCH_DRY_RUN": "1", **env_extra})
    if path is not None:
        env["PATH"] = path
    out = subprocess.run([BASH, str(SCRIPT), config, *args], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1, out.stdout
    if stderr is not None:
        stderr += out.stderr.splitlines()
    return shlex.split(lines[0])  # printed with %q: a word with spaces stays one word


def nproc(words):
    assert words[1:4] == ["-m", "space.train.torchrun", "--standalone"], words
    return int(words[words.index("--nproc_per_node") + 1])


def with_gpus(tmp_path, listing, rc=0):
    return str(fake_nvidia_smi(tmp_path, listing, rc)) + os.pathsep + os.environ.get("PATH", "")


def test_launcher_eight_gpus(tmp_path):
    err = []
    words = launch({}, "--max_steps", "2", path=with_gpus(tmp_path, EIGHT_H100), stderr=err)
    assert nproc(words) == 8
    assert words[0] == sys.executable
    assert words[-5:] == ["space.train", "--config", str(ROOT / CONFIG), "--max_steps", "2"]
    assert err == ["run_sft_multi_node.sh: processes per node: 8 (GPUs listed by nvidia-smi -L: 8); nodes: 1"]


def test_launcher_mig_lines_are_not_gpus(tmp_path):
    # nvidia-smi -L | wc -l counted 4 here
    assert nproc(launch({}, path=with_gpus(tmp_path, ONE_A100_THREE_MIG))) == 1


def test_launcher_two_gpus_with_mig_lines(tmp_path):
    listing = ONE_A100_THREE_MIG + ONE_A100_THREE_MIG.replace("GPU 0:", "GPU 1:")
    assert nproc(launch({}, path=with_gpus(tmp_path, listing))) == 2


def test_launcher_without_nvidia_smi(tmp_path):
    path = path_without_nvidia_smi(tmp_path)
    assert nproc(launch({}, path=path)) == 1  # this machine's torch sees no GPU


def test_launcher_without_nvidia_smi_asks_torch(tmp_path):
    """A container without the NVIDIA tools: the count is torch.cuda.device_count()'s (a fake Python
    here, that sees 4), not 1."""
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\n[ "$1" = "-c" ] && case "$2" in *torch.cuda.device_count*) echo 4; exit 0;; esac\n'
                      f'exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    err = []
    words = launch({"PYTHON": str(python)}, path=path_without_nvidia_smi(tmp_path), stderr=err)
    assert nproc(words) == 4
    assert err == ["run_sft_multi_node.sh: processes per node: 4 (GPUs seen by torch.cuda.device_count(): 4); "
                   "nodes: 1"]


def test_launcher_config_relative_to_the_callers_directory(tmp_path):
    """A path relative to where the user stands, not to the launcher's folder (it cds there); a path
    under the launcher's folder still works from anywhere."""
    (tmp_path / "my.yaml").write_text((ROOT / CONFIG).read_text())
    words = launch({}, config="my.yaml", cwd=tmp_path, path=with_gpus(tmp_path, EIGHT_H100))
    assert words[words.index("--config") + 1] == str(tmp_path / "my.yaml")
    words = launch({}, cwd=tmp_path, path=with_gpus(tmp_path, EIGHT_H100))
    assert words[words.index("--config") + 1] == CONFIG


def test_launcher_multi_node_command(tmp_path):
    env = {"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "node0", "NPROC_PER_NODE": "8"}
    words = launch(env, path=with_gpus(tmp_path, EIGHT_H100))
    assert words[3:15] == ["--nnodes", "4", "--node_rank", "3", "--master_addr", "node0", "--master_port", "29500",
                           "--nproc_per_node", "8", "-m", "space.train"], words


def test_torchrun_failure_is_one_line():
    """A worker that fails (json.tool's argparse exits 2 on an unknown option; a missing file is a
    traceback and exit 1 from Python 3.13): its own output, then one line and its exit code, not
    torchrun's 30-line ChildFailedError report."""
    out = subprocess.run([sys.executable, "-m", "space.train.torchrun", "--standalone", "--nproc_per_node", "1",
                          "-m", "json.tool", "--no-such-option"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "unrecognized arguments: --no-such-option" in out.stderr, out.stderr
    assert lines[-1] == "run_sft_multi_node.sh: training failed: rank 0 exited 2 (its output is above)", lines
    assert not any(word in out.stderr for word in ("Traceback", "ChildFailedError", "failed (exitcode")), out.stderr


def test_a_node_that_never_comes_is_one_line():
    """The multi-node launch uses torchrun's static rendezvous, whose TCP store times out with a
    DistStoreError (node 0 waiting) or DistNetworkError (another node), not a RendezvousError: one
    line and exit 1 too, not a Python traceback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "space.train.torchrun", "--nnodes", "2", "--node_rank", "0",
                          "--master_addr", "127.0.0.1", "--master_port", str(port), "--rdzv_conf", "timeout=2",
                          "--nproc_per_node", "1", "-m", "json.tool", "/dev/null"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and lines[-1].startswith("run_sft_multi_node.sh: the nodes did not meet: Dist"), lines
    assert "Traceback" not in out.stderr, out.stderr

def test_launcher_nvidia_smi_without_driver(tmp_path):
    # the error message is one line on stdout: wc -l counted it as a GPU
    path = with_gpus(tmp_path, NO_DRIVER, rc=9)
    assert count_gpus({}, path) == "0"
    assert nproc(launch({}, path=path)) == 1


def test_launcher_cuda_visible_devices_subset(tmp_path):
    assert nproc(launch({"CUDA_VISIBLE_DEVICES": "0,1"}, path=with_gpus(tmp_path, EIGHT_H100))) == 2


def test_launcher_cuda_visible_devices_empty_means_no_gpu(tmp_path):
    assert nproc(launch({"CUDA_VISIBLE_DEVICES": ""}, path=with_gpus(tmp_path, EIGHT_H100))) == 1


def test_launcher_cuda_visible_devices_one_mig(tmp_path):
    mig = {"CUDA_VISIBLE_DEVICES": "MIG-c6d4f1b8-4c1e-5e9a-9f3e-0a1b2c3d4e5f"}
    assert nproc(launch(mig, path=with_gpus(tmp_path, ONE_A100_THREE_MIG))) == 1


def test_launcher_nproc_per_node_overrides(tmp_path):
    env = {"NPROC_PER_NODE": "3", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert nproc(launch(env, path=with_gpus(tmp_path, EIGHT_H100))) == 3


def count_gpus(env_extra, path):
    """count_gpus's number (its first word)."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(env_extra, PATH=path)
    out = subprocess.run([BASH, "-c", f'source "{SCRIPT}" && count_gpus "{sys.executable}"'], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[0]


@pytest.mark.parametrize("visible, expected", [
    ("", 0), (" ", 0), ("-1", 0), ("NoDevFiles", 0), ("0", 1), ("0,1", 2), ("3, 5,7", 3), ("0,1,", 2),
    ("0,-1,1", 1), ("abc,0", 0), ("GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77", 1),
    ("MIG-c6d4f1b8-4c1e-5e9a-9f3e-0a1b2c3d4e5f,MIG-8e2f5a7c-1d3b-5f60-a4c9-1b2c3d4e5f60", 2),
])
def test_launcher_count_gpus_cuda_visible_devices(tmp_path, visible, expected):
    """Entries counted as CUDA reads them: up to the first that is no index and no GPU-/MIG- UUID."""
    assert count_gpus({"CUDA_VISIBLE_DEVICES": visible}, with_gpus(tmp_path, EIGHT_H100)) == str(expected)


def test_launcher_smoke_dispatch(tmp_path):
    words = launch({}, "--max_steps", "2", "--smoke", "--output_dir", str(tmp_path / "out"),
                   path=with_gpus(tmp_path, EIGHT_H100))
    assert words == [sys.executable, "-m", "space.train.smoke", str(ROOT / CONFIG), "--max_steps", "2",
                     "--output_dir", str(tmp_path / "out")]


def test_launcher_help_shows_whole_header():
    out = subprocess.run([BASH, str(SCRIPT), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    header = []
    for line in SCRIPT.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        header.append(line)
    assert out.stdout.splitlines() == header
    for word in ("--smoke", "CUDA_VISIBLE_DEVICES", "SPACE_LAUNCH_DRY_RUN", "NPROC_PER_NODE", "MIG"):
        assert word in out.stdout


def test_a_killed_worker_is_a_failure(tmp_path):
    """A worker killed by a signal (the kernel's OOM killer sends SIGKILL): one line naming the
    signal and exit 128 + 9, never 0 (a launcher script would then take the run for a success)."""
    script = tmp_path / "killed.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    out = subprocess.run([sys.executable, "-m", "space.train.torchrun", "--standalone", "--nproc_per_node", "1",
                          str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 137, out.stderr
    want = "run_sft_multi_node.sh: training failed: rank 0 was killed by SIGKILL (its output is above)"
    assert lines[-1] == want, lines


def test_the_printed_command_reruns_with_a_config_path_that_has_spaces(tmp_path):
    """SPACE_LAUNCH_DRY_RUN=1 prints the command to copy and run. Catches printing the words
    joined by spaces: a config under a folder with a space in its name split into two words."""
    folder = tmp_path / "my configs"
    folder.mkdir()
    config = folder / "tiny smoke.yaml"
    config.write_text((ROOT / CONFIG).read_text())
    words = launch({}, "--run_name", "a b", config=str(config))
    assert words[-4:] == ["--config", str(config), "--run_name", "a b"]


def test_paths_given_to_the_launcher_are_read_from_where_it_runs(tmp_path):
    """Training runs in the repository (the configs' own paths are repo-relative), but a path on
    the command line is the caller's: outputs always, inputs when they exist there (else the
    repository's, like CONFIG). Catches --datasets rows.jsonl refused as unknown and --output_dir
    out written inside the repository when run from another folder (run_eval.sh had the same)."""
    (tmp_path / "rows.jsonl").write_text('{"prompt": "q", "response": "a"}\n')
    (tmp_path / "ds.json").write_text("{}")
    words = launch({}, "--datasets", "rows.jsonl,mbpp", "--output_dir", "out", "--deepspeed", "configs/deepspeed/zero2.json",
                   "--init_adapter=ds.json", "--logging_dir=/abs/logs", "--max_steps", "1", cwd=tmp_path)
    given = words[words.index(CONFIG) + 1:]
    assert given == ["--datasets", f"{tmp_path}/rows.jsonl,mbpp", "--output_dir", f"{tmp_path}/out",
                     "--deepspeed", "configs/deepspeed/zero2.json", f"--init_adapter={tmp_path}/ds.json",
                     "--logging_dir=/abs/logs", "--max_steps", "1"], given
    smoke = launch({}, "--smoke", "--output_dir", "out", cwd=tmp_path)
    assert smoke[-2:] == ["--output_dir", f"{tmp_path}/out"]
    # the other spelling; a folder named like a registered dataset is not it; values like echo's options
    (tmp_path / "mbpp").mkdir()
    words = launch({}, "--output-dir", "out", "--datasets", "mbpp", "--run_name", "-n", "--seed", "-e", cwd=tmp_path)
    assert words[words.index(CONFIG) + 1:] == ["--output-dir", f"{tmp_path}/out", "--datasets", "mbpp",
                                                "--run_name", "-n", "--seed", "-e"]
    # a model folder of the caller's (read from the repository, a folder of that name there was loaded
    # instead); a model name that is no folder here stays a name
    (tmp_path / "mymodel").mkdir()
    words = launch({}, "--model_name_or_path", "mymodel", cwd=tmp_path)
    assert words[-2:] == ["--model_name_or_path", f"{tmp_path}/mymodel"]
    assert launch({}, "--model_name_or_path", "tiny-random-llama", cwd=tmp_path)[-1] == "tiny-random-llama"
