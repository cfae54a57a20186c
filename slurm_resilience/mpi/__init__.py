"""MPI programs repaired in place (ULFM): spare ranks inside the world.

``Session`` (``mpi/ulfm.py``) is what an mpi4py program uses; ``plan.py`` decides a
repair (pure), ``snapshot.py`` packs the registered state, ``launch.py`` builds the
``mpirun --with-ft ulfm`` line. For ``slurm-resilience run --mpi``: ``probe.py``
gathers the facts about the program's MPI, ``choose.py`` picks in-place repair or
relaunch (pure), ``supervise.py`` runs the in-place path and ``fallback.py`` decides
what follows ``mpirun``'s end (pure: a lost node means a relaunch). Nothing here is imported by ``import
slurm_resilience``; ``Session`` imports mpi4py only when it is constructed.
See docs/mpi-ulfm.md.
"""

from .errors import StateLostError, StateMismatchError, UlfmUnavailableError

__all__ = ["Session", "StateLostError", "StateMismatchError", "UlfmUnavailableError"]


def __getattr__(name):  # lazy: numpy and mpi4py load with the session, not the package
    if name == "Session":
        from .ulfm import Session
        return Session
    raise AttributeError(name)
