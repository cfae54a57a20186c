"""files.write_private: atomic 0600 files; fsynced unless ``durable=False`` (the
supervisor's state, status and metrics, written at every decision)."""

import os

from slurm_resilience import files


def _count_fsyncs(monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(files.os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    return calls


def test_durable_by_default_and_not_when_asked(tmp_path, monkeypatch):
    calls = _count_fsyncs(monkeypatch)
    path = tmp_path / "d" / "f.json"
    files.write_private(str(path), "one")
    assert len(calls) == 2  # the file, then its directory
    path.chmod(0o644)  # an existing world-readable file is replaced, never kept
    files.write_private(str(path), b"two", durable=False)
    assert len(calls) == 2 and path.read_text() == "two" and path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["f.json"]  # no temporary left


def test_the_supervisors_state_and_status_skip_fsync(tmp_path, monkeypatch):
    from slurm_resilience.supervisor.executors import reattach
    from slurm_resilience.supervisor.adapters.status import write_status
    from test_local_standbys import started

    state, _ = started()
    calls = _count_fsyncs(monkeypatch)
    reattach.save(str(tmp_path), state, 3)
    write_status(str(tmp_path), {"phase": "RUNNING"})
    assert calls == [] and reattach.load(str(tmp_path))[0].local_standbys == state.local_standbys
