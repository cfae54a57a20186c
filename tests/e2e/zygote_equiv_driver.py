"""Inside an allocation (batch host + 2 nodes): run observe_probe.py cold and warm.

    python zygote_equiv_driver.py OUT_DIR

Cold: the relaunch executor's own srun step (``supervisor.executors.relaunch.step_argv``, 2 ranks
per node). Warm: the same step forked by the zygotes (``supervisor.adapters.warm.ZygotePool``).
Same step name, attempt, master address and port for both; three endings each (exit 0,
exit 3, an uncaught exception). Writes OUT_DIR/codes.json: {"cold-ok": code, ...}.
"""

import json
import os
import subprocess
import sys
import time

from slurm_resilience.slurm.parse import SlurmEnv
from slurm_resilience.slurm.steps import SrunLauncher
from slurm_resilience.supervisor.executors.relaunch import master_node, master_port, step_argv
from slurm_resilience.supervisor.adapters.warm import ZygotePool

out = os.path.abspath(sys.argv[1])
probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "observe_probe.py")
env = SlurmEnv.from_environ(os.environ)
nodes = [n for n in env.nodelist if n != env.node_name][:2]
launcher = SrunLauncher(env.job_id, nodes)
pool = ZygotePool(job_dir=out, nodes=nodes, launcher=launcher)
assert pool.wait_ready(nodes, 180), "zygotes not ready"
codes = {}
for attempt, (case, extra) in enumerate([("ok", []), ("exit3", ["--exit", "3"]), ("raise", ["--raise"])], 1):
    name, master = f"sr-restart-{attempt}", master_node(nodes, env.nodelist)
    for mode in ("cold", "warm"):
        command = [sys.executable, probe, os.path.join(out, f"{mode}-{case}-{{rank}}.json"), *extra]
        log = os.path.join(out, f"{mode}-{case}.log")
        args = dict(name=name, nodes=nodes, command=command, master_addr=launcher.address(master),
                    port=master_port(env.job_id, attempt), attempt=attempt)
        if mode == "cold":
            with open(log, "ab") as f:
                proc = subprocess.run(step_argv(job_id=env.job_id, mpi=False, tasks_per_node=2, **args),
                                      env={**os.environ, "SR_RESTART": str(attempt)}, stdout=f,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            codes[f"{mode}-{case}"] = proc.returncode
        else:
            step = pool.fork_step(tasks_per_node=2, log_path=log, **args)
            assert step is not None, "the zygotes did not fork"
            while (code := step.poll()) is None:
                time.sleep(0.05)
            codes[f"{mode}-{case}"] = code
            codes[f"{mode}-{case}-ranks"] = {str(r): c for r, c in step.codes.items()}
pool.close()
with open(os.path.join(out, "codes.json"), "w") as f:
    json.dump(codes, f)
