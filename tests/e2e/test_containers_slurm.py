"""End to end on the real local Slurm with real podman containers (docs/containers.md).

Every rank and every warm standby runs in a podman container (``container.runtime:
podman``); a node is lost; the job finishes on the spare, bit-identical to the
fault-free run outside containers, and no container of the job is left.

The image (containers/test-image.sh) holds only a skeleton; the host's /usr, the
interpreter and the repository are bind-mounted (container.mounts), so it builds in
about a second. In the lab every emulated node shares one podman, so "on any node"
is checked by the job's container-name prefix ``sr-<job>-``.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slurm_resilience import lab
from slurm_resilience.container.argv import node_prefix

from .conftest import STEPS

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

KILL_AT = 12
IMAGE_SCRIPT = lab.REPO / "containers" / "test-image.sh"


@pytest.fixture(scope="session")
def podman_image() -> str:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (scripts/install-deps.sh installs it with runc)")
    out = subprocess.run([str(IMAGE_SCRIPT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def container_config(tmp_path: Path, image: str) -> Path:
    """The lab's settings plus a podman container that sees the host's interpreter."""
    cfg = yaml.safe_load(lab.LOCAL_CONFIG.read_text())
    prefix = Path(sys.prefix).resolve()
    mounts = ["/usr:/usr:ro", "/etc/passwd:/etc/passwd:ro", "/etc/group:/etc/group:ro", "/tmp:/tmp",
              f"{lab.REPO}:{lab.REPO}:ro"]
    if not str(prefix).startswith("/usr/"):
        mounts.append(f"{prefix}:{prefix}:ro")
    cfg["container"] = {"runtime": "podman", "image": image, "mounts": mounts, "env": ["PYTHONPATH", "USER"]}
    path = tmp_path / "podman.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def job_containers(job_id: str) -> list[str]:
    out = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True,
                         timeout=60, check=True)
    return sorted(n for n in out.stdout.split() if n.startswith(f"sr-{job_id}-"))


def test_ranks_and_spares_in_podman_lose_a_node_finish_bit_identical_and_clean_up(
        cluster, jobs_root, reference, podman_image, tmp_path):
    run = lab.submit(jobs_root / "podman-node-loss", steps=STEPS, config=container_config(tmp_path, podman_image))
    status = run.wait_for_step(KILL_AT)
    job_id = str(status["job_id"])
    victim, spare = status["ranks"][1]["node"], status["spares"][0]["node"]
    running = job_containers(job_id)
    for node in [r["node"] for r in status["ranks"]] + [spare]:
        assert any(n.startswith(node_prefix(job_id, node)) for n in running), (node, running)
    lab.kill_node(victim)
    assert run.wait() == 0, run.output()
    assert lab.compare_states(reference, run.job_dir / "final.pt") == []
    # the standby that was adopted ran in its container from the start: no new step on the spare
    assert [w for w in job_containers(job_id) if not w.startswith(node_prefix(job_id, victim))] == []
    # the lost node's record is left (its podman was not reachable); back in service, the
    # node's epilog line (docs/containers.md) removes it, and nothing of the job is left
    lab.cluster("reset")
    clean = subprocess.run(["srun", "-N1", "-w", victim, sys.executable, "-m", "slurm_resilience.container.enter",
                            "--clean", "podman", node_prefix(job_id, "{node}")],
                           capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert job_containers(job_id) == []
