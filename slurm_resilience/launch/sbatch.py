"""Render the sbatch script that runs the supervisor as the batch step.

The allocation holds 1 + nodes + spares nodes: the batch host (first node) runs
only the supervisor and the store, so losing a worker node never loses the job's
brain; workers and standbys are ``srun --no-kill`` steps on the others.

``hetjob=True`` renders the same job as a heterogeneous job (docs/hetjob.md):
component 0 is the supervisor's one node, component 1 the nodes + spares.

Every node of the allocation gets ``--ntasks-per-node=job.tasks_per_node`` (G
ranks, one per GPU; a spare holds G standbys); in a hetjob only component 1 does.

Site options (docs/site-options.md): ``job.sbatch_options`` become ``#SBATCH`` lines
of the allocation; in a hetjob component 1 (workers) gets them all, component 0
(the supervisor) only the job-wide ones (account, qos, reservation ...: not the
per-node resources of ``slurm.options.HETJOB_WORKER_ONLY``) plus
``job.supervisor_sbatch_options`` and ``job.supervisor_partition``. ``job.setup``
lines run before the supervisor, verbatim.
"""

from __future__ import annotations

import os
import re
import shlex
import string
import sys
from importlib import resources
from pathlib import Path
from typing import Sequence

from ..config import ResilienceConfig
from ..errors import ConfigError
from ..run_identity import RUN_ID_ENV, check_run_id
from ..slurm.options import HETJOB_WORKER_ONLY, sbatch_lines


__all__ = ["TEMPLATE_DIR", "TEMPLATES", "render"]


_PARTITION = re.compile(r"[A-Za-z0-9_.,-]+")
# The templates ship inside the package (``package_data``), so a wheel or a
# non-editable install finds them as well as a checkout; SR_TEMPLATE_DIR overrides.
TEMPLATE_DIR = Path(os.environ.get("SR_TEMPLATE_DIR") or str(resources.files("slurm_resilience") / "templates"))


TEMPLATES = {False: "resilient.sbatch.tmpl", True: "hetjob.sbatch.tmpl"}


def render(cfg: ResilienceConfig, *, command: Sequence[str], config_path: str, job_dir: str,
           job_name: str = "resilient", python: str = sys.executable,
           hetjob: bool = False, template: str | None = None,
           extra: dict[str, str] | None = None, run_id: str | None = None) -> str:
    """Pure: the sbatch script text. Every user value is shell-quoted.

    ``hetjob``: component 0 = the supervisor's node, component 1 = nodes + spares
    (template ``hetjob.sbatch.tmpl`` unless ``template`` names another).
    ``run_id``: the submission's run id (``run_identity``), exported as ``SR_RUN_ID``
    for the batch step; a requeue reruns the script, a resubmission submits it again,
    so every start of the job is the same run.

    Raises:
        ConfigError: empty command, missing template, a line break in a value, a bad
            partition name, ``hetjob`` with ``job.supervisor_node`` false, or supervisor
            options without ``hetjob``, a ``run_id`` that is not one.
    """
    if hetjob and not cfg.job.supervisor_node:
        raise ConfigError("job.supervisor_node=false contradicts --hetjob: a heterogeneous job "
                          "always gives the supervisor a component of its own")
    job = cfg.job
    if not hetjob and (job.supervisor_partition or job.supervisor_sbatch_options):
        key = "supervisor_partition" if job.supervisor_partition else "supervisor_sbatch_options"
        raise ConfigError(f"job.{key} needs --hetjob: only a heterogeneous job gives the supervisor "
                          "a component (partition, size, options) of its own")
    template = template or TEMPLATES[hetjob]
    if not command:
        raise ConfigError("no training command given: add `-- python train.py ...`")
    path = TEMPLATE_DIR / template
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"sbatch template not found: {path} (set SR_TEMPLATE_DIR)") from None
    for what, value in (("job name", job_name), ("job dir", job_dir), ("config path", config_path),
                        ("partition", cfg.job.partition or "")):
        if "\n" in value or "\r" in value:
            raise ConfigError(f"{what} contains a line break: not allowed in an sbatch script")
    if cfg.job.partition and not _PARTITION.fullmatch(cfg.job.partition):
        raise ConfigError(f"job.partition={cfg.job.partition!r} is not a valid partition name "
                          "(letters, digits, _ . , -)")
    sup_node = 1 if cfg.job.supervisor_node else 0
    partition = f"#SBATCH --partition={cfg.job.partition}" if cfg.job.partition else ""
    signal = f"#SBATCH --signal=B:{cfg.job.preempt_signal}" if cfg.job.preempt_signal else ""
    sup_partition = job.supervisor_partition or job.partition
    job_wide = {k: v for k, v in job.sbatch_options.items()
                if k not in HETJOB_WORKER_ONLY and k not in job.supervisor_sbatch_options}
    return _fill(text, dict(
        job_name=shlex.quote(job_name),
        total_nodes=cfg.job.nodes + cfg.job.spares + sup_node,
        worker_nodes=cfg.job.nodes + cfg.job.spares,
        tasks_per_node=cfg.job.tasks_per_node,
        time_limit=cfg.job.time_limit,
        output=shlex.quote(os.path.join(job_dir, "supervisor.log")),
        partition_line=partition,
        supervisor_partition_line=f"#SBATCH --partition={sup_partition}" if sup_partition else "",
        site_lines="\n".join(sbatch_lines(job.sbatch_options)),
        supervisor_site_lines="\n".join(sbatch_lines({**job_wide, **job.supervisor_sbatch_options})),
        setup="\n".join(job.setup),
        signal_line=signal,
        python=shlex.quote(python),
        config=shlex.quote(config_path),
        job_dir=shlex.quote(job_dir),
        command=" ".join(shlex.quote(a) for a in command),
        run_id_line=f"export {RUN_ID_ENV}={check_run_id(run_id)}" if run_id else "",
        **(extra or {}),
    ))


def _fill(text: str, values: dict[str, object]) -> str:
    """Substitute ``values``; a template line that is only ``${name}`` of an empty
    value (no partition, no site option, no setup) is left out, not left blank."""
    lines = [ln for ln in text.splitlines(keepends=True)
             if not (ln.strip().startswith("${") and ln.strip().endswith("}")
                     and values.get(ln.strip()[2:-1]) == "")]
    return string.Template("".join(lines)).substitute(values)
