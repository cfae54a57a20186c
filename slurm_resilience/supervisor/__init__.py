"""The supervisor: one per job; watches, decides, acts.

By role (each layer imports only those below it; ``tests/unit/test_layering.py``):

- ``decide/``: pure decisions: state, observations and actions, the recovery ladder.
- ``observe/``: turns sockets, the store and Slurm into observations for ``decide``.
- ``executors/``: carry the actions out (online and relaunch), the loop, the keeper.
- ``adapters/``: thin wrappers over what acts: steps, node isolation, zygotes, the plan.
"""
