"""exits.py: the process ends with the given code, flushed, without the tear-down."""

import subprocess
import sys
import textwrap


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)


def test_exit_fast_at_exit_unwinds_the_callers_code_then_skips_earlier_atexit_handlers():
    p = _run("""
        import atexit, sys
        from slurm_resilience.exits import exit_fast_at_exit
        atexit.register(lambda: print("earlier handler ran"))
        try:
            try:
                exit_fast_at_exit(7)
                raise SystemExit(7)
            finally:
                print("finally ran", end="")  # unflushed: exit_now flushes it
        finally:
            atexit.register(lambda: print(" later handler ran", end=""))
    """)
    assert p.returncode == 7
    assert p.stdout == "finally ran later handler ran"


def test_exit_now_flushes_streams_and_logging():
    p = _run("""
        import logging, sys
        from slurm_resilience.exits import exit_now
        logging.basicConfig(stream=sys.stderr, format="%(message)s")
        logging.getLogger("x").warning("logged")
        sys.stdout.write("out")
        exit_now(4)
        print("not reached")
    """)
    assert (p.returncode, p.stdout, p.stderr.strip()) == (4, "out", "logged")
