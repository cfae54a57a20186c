"""srun's task-exit lines (slurm.parse.parse_task_exits) and the relaunch step's fault
naming its root cause (supervisor.observe.step_output.name_first_exit), on recorded output."""

from slurm_resilience.model import Fault, FaultKind
from slurm_resilience.slurm.parse import TaskExit, parse_task_exits
from slurm_resilience.supervisor.observe.step_output import ProgressTail, name_first_exit, stalled_step

# step-000.log of `slurm-resilience run --mpi` (Slurm 22.05.8, Open MPI 4.1.4), MPI rank 1 SIGKILLed
RECORDED = """restart 0: world 2, from step 0
step 10 loss 0.66975 (snapshot)
srun: error: n3: task 1: Killed
srun: launch/slurm: _step_signal: Terminating StepId=1089.0
slurmstepd-n2: error: *** STEP 1089.0 ON n2 CANCELLED AT 2026-11-27T10:23:41 ***
srun: error: n2: task 0: Terminated
srun: Force Terminated StepId=1089.0
"""


def test_task_exits_in_the_order_srun_wrote_them():
    assert parse_task_exits(RECORDED) == (TaskExit("n3", (1,), "Killed"), TaskExit("n2", (0,), "Terminated"))


def test_task_ranges_exit_codes_and_core_dumps():
    text = ("srun: error: n2: tasks 0-2,5: Exited with exit code 3\n"
            "srun: error: n4: task 7: Segmentation fault (core dumped)\n"
            "step 3 says srun: error: n9: task 1: Killed\n")  # not srun's line: not at the start
    got = parse_task_exits(text)
    assert got == (TaskExit("n2", (0, 1, 2, 5), "Exited with exit code 3"),
                   TaskExit("n4", (7,), "Segmentation fault (core dumped)"))
    assert [e.line() for e in got] == ["n2 tasks 0,1,2,5: Exited with exit code 3",
                                       "n4 task 7: Segmentation fault (core dumped)"]


def test_no_task_exit_in_a_clean_output():
    assert parse_task_exits("restart 0: world 2\nstep 10 loss 0.5\n") == ()


def test_the_step_fault_names_the_first_bad_exit_and_stays_the_steps():
    died = Fault(FaultKind.PROCESS_DIED, None, "n[2-3]", 1.0, "process exited; step exit code 143")
    lost = Fault(FaultKind.NODE_LOST, 1, "n4", 1.0, "slurmd unreachable")
    named = name_first_exit([died, lost], RECORDED.encode())
    assert named[0].detail == "process exited; step exit code 143; first bad exit: n3 task 1: Killed"
    assert (named[0].rank, named[0].node) == (None, "n[2-3]") and named[1] == lost
    assert name_first_exit([died], b"no srun line\n") == [died]


def test_a_quiet_step_is_hung_past_the_hard_step_timeout_only():
    nodes = ["n2", "n3"]
    assert stalled_step(nodes, quiet_s=None, steps=[], hard_s=20.0, factor=10.0, now=1.0) is None  # start-up
    assert stalled_step(nodes, quiet_s=19.9, steps=[0.1], hard_s=20.0, factor=10.0, now=1.0) is None
    hung = stalled_step(nodes, quiet_s=20.5, steps=[0.1, 0.2], hard_s=20.0, factor=10.0, now=1.0)
    assert (hung.kind, hung.rank, hung.node, hung.time) == (FaultKind.PROCESS_HUNG, None, "n[2-3]", 1.0)
    assert "past the hard step timeout 20.0 s" in hung.detail
    # long steps stretch the timeout: 10 x 3 s
    assert stalled_step(nodes, quiet_s=25.0, steps=[3.0], hard_s=20.0, factor=10.0, now=1.0) is None
    assert stalled_step(nodes, quiet_s=31.0, steps=[3.0], hard_s=20.0, factor=10.0, now=1.0) is not None


def test_progress_tail_reads_complete_lines_and_step_times(tmp_path):
    path = tmp_path / "progress-000.log"
    tail = ProgressTail(str(path))
    tail.poll(5.0)
    assert tail.seen_at is None  # no file yet
    path.write_text("11 100.0\n12 100.5\n13 10")  # the last line is not complete
    tail.poll(6.0)
    assert tail.seen_at == 6.0 and list(tail.steps) == [0.5]
    tail.poll(7.0)
    assert tail.seen_at == 6.0  # nothing new
    with open(path, "a") as f:
        f.write("1.75\n")
    tail.poll(8.0)
    assert tail.seen_at == 8.0 and list(tail.steps) == [0.5, 1.25]
