"""End to end on the real local Slurm with real podman containers (docs/containers.md).

Every rank and every warm standby runs in a podman container (``container.runtime:
podman``); a node is lost; the job finishes on the spare, bit-identical to the
fault-free run outside containers, and no container of the job is left.

The image (containers/test-image.sh) holds only a skeleton; the host's /usr, the
interpreter and the repository are bind-mounted (container.mounts), so it builds in
about a second. In the lab every emulated node shares one podman, so "on any node"
is checked by the job's container-name prefix ``sr-<job>-``.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from slurm_resilience import lab
from slurm_resilience.events import read_events
from slurm_resilience.container.argv import container_name, node_prefix

from .conftest import STEPS

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

KILL_AT = 12


@pytest.fixture(scope="session")
def podman_image() -> str:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (scripts/install-deps.sh installs it with runc)")
    return lab.podman_test_image()


def container_config(tmp_path: Path, image: str) -> Path:
    """The lab's settings plus a podman container that sees the host's interpreter."""
    cfg = yaml.safe_load(lab.LOCAL_CONFIG.read_text())
    cfg["container"] = lab.podman_section(image)
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
    assert lab.compare_runs(reference, run.job_dir / "final.pt") == []  # rank 0's final.pt + every rank's digest
    # rank 1 is now the standby that ran in the spare's container from the start: no new
    # step (no new container) was started for the adoption
    standby = status["spares"][0]["worker_id"]
    assert container_name(job_id, spare, standby) in running
    table = json.loads((run.job_dir / "ranktable.json").read_text())
    assert [s["worker_id"] for s in table["ranks"] if s["rank"] == 1] == [standby]
    # no worker launched later but the nodes' own standbys (recovery.local_standbys: one per
    # worker node and one extra on the spare, which is its own now that it is a worker node)
    local = {e["worker_id"] for e in read_events(str(run.job_dir / "events.jsonl"))
             if e["kind"] == "local_standby_started"}
    logs = [p for p in (run.job_dir / "logs").glob("*.log") if p.stem not in local]
    assert len(logs) == len(status["ranks"]) + 1
    # survivors and spares: removed at the end of the job
    assert [w for w in job_containers(job_id) if not w.startswith(node_prefix(job_id, victim))] == []
    # the lost node's record is left (its podman was not reachable when the job ended);
    # back in service, the next job's start removes it (enter --clean-stale on every node)
    lab.cluster("reset")
    nxt = lab.submit(jobs_root / "podman-next", steps=4, config=container_config(tmp_path, podman_image))
    assert nxt.wait() == 0, nxt.output()
    assert job_containers(job_id) == []
    assert job_containers(str(json.loads((nxt.job_dir / "status.json").read_text())["job_id"])) == []
