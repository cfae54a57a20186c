"""Containers: every worker, standby and relaunch step of a job runs in one image.

``argv``: pure builders, from (the ``container:`` section, job id, node, the step's
command) to what srun runs — pyxis through srun's own ``--container-*`` flags,
apptainer and podman by wrapping the command; and the cleanup command of a node.
``enter``: the few lines that run inside the step, on the node, before the runtime
starts: they fill in what only the node knows (its name, the step's cgroup, Slurm's
variables) and ``exec`` the runtime; ``--clean`` removes the job's containers there.

Docs: docs/containers.md.
"""
