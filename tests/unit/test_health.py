"""The spare health check's parts (the node-side module), with no GPU and no Slurm."""

import collections
import sys

from slurm_resilience import health
from slurm_resilience.config import load_config

Usage = collections.namedtuple("Usage", "total used free")


def test_local_dir_is_created_writable_and_needs_free_space(tmp_path):
    d = tmp_path / "n1" / "ckpt"
    assert health.check_local_dir(str(d), 1.0, usage=lambda p: Usage(0, 0, 2 << 30)) is None
    assert d.is_dir() and list(d.iterdir()) == []  # the probe file is gone
    why = health.check_local_dir(str(d), 3.0, usage=lambda p: Usage(0, 0, 2 << 30))
    assert why == f"node-local checkpoint directory {d} has 2.00 GiB free, checkpoint.local_min_free_gb is 3"


def test_an_unwritable_local_dir_fails(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert "is not writable" in health.check_local_dir(str(f / "ckpt"), 0.0)


def test_gpu_query_counts_gpus_and_pending_retired_pages():
    assert health.parse_gpu_query("0, No\n1, No\n", 2) is None
    assert health.parse_gpu_query("0, No\n", 2) == "nvidia-smi sees 1 GPU(s), expected 2"
    assert health.parse_gpu_query("0, No\n1, Yes\n", 2) == "GPU(s) 1 have retired pages pending (reset needed)"


def test_user_command_exit_code_output_and_timeout():
    assert health.check_command([sys.executable, "-c", "pass"], 10) is None
    why = health.check_command([sys.executable, "-c", "print('disk 3 degraded'); raise SystemExit(4)"], 10)
    assert why.endswith("exited 4: disk 3 degraded")
    assert "did not finish within 0.5s" in health.check_command([sys.executable, "-c", "import time; time.sleep(5)"],
                                                                0.5)
    assert health.check_command(["/nonexistent/probe"], 1) == "health_check command not found: /nonexistent/probe"


def test_main_prints_one_line_and_exits_1_on_failure(tmp_path, capsys):
    code = health.main(["--local-dir", str(tmp_path), "--min-free-gb", "0", "--", sys.executable, "-c",
                        "raise SystemExit(2)"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 1 and len(out) == 1 and "exited 2" in out[0]
    assert health.main(["--local-dir", str(tmp_path)]) == 0


def test_argv_for_a_node_follows_the_config():
    cfg = load_config({"checkpoint": {"local_dir": "/scratch/{job_id}/{node}/ckpt", "local_min_free_gb": 5},
                       "recovery": {"health_check": ["/site/probe", "--quick"], "health_check_timeout_s": 7},
                       "reconnect": {"backend": "nccl"}, "job": {"tasks_per_node": 4}})
    argv = health.health_argv(cfg, job_id="42", run_id="0" * 32, job_dir="/j", node="gpu7", python="py")
    assert argv == ["py", "-m", "slurm_resilience.health", "--local-dir", "/scratch/42/gpu7/ckpt", "--min-free-gb",
                    "5.0", "--gpus", "4", "--timeout-s", "7.0", "--", "/site/probe", "--quick"]
