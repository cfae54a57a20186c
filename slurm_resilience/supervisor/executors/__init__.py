"""Executors: carry ``decide``'s actions out (online ``Supervisor``, ``RelaunchExecutor``)."""
