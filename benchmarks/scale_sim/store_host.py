"""The job's TCPStore alone in a process, as the batch step (``keeper.py``) hosts it:
its CPU share is this process's. Prints the port; serves until stdin closes."""

from __future__ import annotations

import sys
from datetime import timedelta

from .common import HOST, raise_fd_limit


def main() -> int:
    raise_fd_limit()
    import torch.distributed as dist

    store = dist.TCPStore(HOST, 0, None, True, timedelta(seconds=300), wait_for_workers=False)
    print(store.port, flush=True)
    sys.stdin.read()  # the orchestrator closes it (or dies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
