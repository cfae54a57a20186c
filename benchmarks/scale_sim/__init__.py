"""The scale harness's parts (``benchmarks/scale.py``): the real supervisor and store,
thousands of simulated ranks.

Four kinds of process, all on 127.0.0.1::

    scale.py (orchestrator) ── control ──► supervisor_host.py: the real online Supervisor
       │                                   (watch, detect, liveness server, decide, stop)
       │                                   with SimLauncher (launcher.py) as its adapter
       ├── control ──► rank_host.py × P: simulated ranks (ranks.py), many per thread
       └── starts ────► store_host.py: the job's TCPStore, alone in its process (the keeper's)

The simulated ranks speak the real protocol through the real worker-side functions:
the liveness hello (``heartbeat.connect_liveness``), the pulse lines (``pulse_link.connect``,
``pulse._send``), ``hb/{worker}`` heartbeats as ``Heartbeat._beat`` writes them, events
through ``EventSink``, the plan read from ``plan/{g}`` and admitted as ``membership``
does. No torch compute, no process group.
"""
