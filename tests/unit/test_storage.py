import logging
import os
import stat

import pytest

from slurm_resilience.checkpoint import storage as st
from slurm_resilience.checkpoint.storage import (
    LocalDirStorage,
    MemoryStorage,
    Storage,
    get_storage,
    register_storage,
    set_lustre_striping,
    storage_names,
)
from slurm_resilience.errors import CheckpointError, ConfigError


@pytest.fixture(params=["memory", "dir"])
def store(request, tmp_path):
    if request.param == "memory":
        return MemoryStorage()
    return LocalDirStorage(str(tmp_path / "root"))


def test_protocol(store):
    assert isinstance(store, Storage)


def test_roundtrip_and_overwrite(store):
    store.write_bytes("step_1/rank_0.h5", b"abc")
    assert store.read_bytes("step_1/rank_0.h5") == b"abc"
    store.write_bytes("step_1/rank_0.h5", bytearray(b"new"))
    assert store.read_bytes("step_1/rank_0.h5") == b"new"
    store.write_bytes("empty", b"")
    assert store.read_bytes("empty") == b""
    assert store.exists("step_1/rank_0.h5") and not store.exists("step_1/rank_1.h5")
    assert store.exists("./step_1//rank_0.h5")  # normalized keys


def test_list_prefix(store):
    for k in ("b/2", "a/1", "a/0", "ab", "c"):
        store.write_bytes(k, k.encode())
    assert store.list() == ["a/0", "a/1", "ab", "b/2", "c"]
    assert store.list("a/") == ["a/0", "a/1"]
    assert store.list("a") == ["a/0", "a/1", "ab"]
    assert store.list("zz") == []


def test_delete(store):
    store.write_bytes("s/1/x", b"1")
    store.write_bytes("s/2/y", b"2")
    store.delete("s/1/x")
    assert not store.exists("s/1/x")
    assert store.list() == ["s/2/y"]
    with pytest.raises(CheckpointError, match="cannot delete"):
        store.delete("s/1/x")


def test_read_missing(store):
    with pytest.raises(CheckpointError, match="no object 'nope'"):
        store.read_bytes("nope")


@pytest.mark.parametrize("key", ["", "/abs", "../up", "a/../../up", ".", "a\\b", "d/.tmp-x"])
def test_bad_keys(store, key):
    with pytest.raises(CheckpointError):
        store.write_bytes(key, b"x")
    with pytest.raises(CheckpointError):
        store.exists(key)


def test_memory_isolated_and_copies():
    a, b = MemoryStorage(), MemoryStorage()
    buf = bytearray(b"xy")
    a.write_bytes("k", buf)
    buf[0] = 0
    assert a.read_bytes("k") == b"xy"
    assert not b.exists("k")
    assert a.root == "memory://"


def test_local_modes_and_layout(tmp_path):
    root = tmp_path / "ck"
    s = LocalDirStorage(str(root))
    assert s.root == str(root)
    s.write_bytes("a/b/c.bin", b"data")
    for d in (root, root / "a", root / "a" / "b"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root / "a" / "b" / "c.bin").st_mode) == 0o600
    assert (root / "a" / "b" / "c.bin").read_bytes() == b"data"
    # temporaries of interrupted writes are never listed
    (root / "a" / ".tmp-123").write_bytes(b"half")
    assert s.list() == ["a/b/c.bin"]


def test_local_delete_prunes_empty_dirs(tmp_path):
    s = LocalDirStorage(str(tmp_path / "r"))
    s.write_bytes("s1/r0/x", b"1")
    s.write_bytes("s2/y", b"2")
    s.delete("s1/r0/x")
    assert not (tmp_path / "r" / "s1").exists()
    assert (tmp_path / "r").is_dir()
    s.delete("s2/y")
    assert (tmp_path / "r").is_dir() and s.list() == []


def test_local_relative_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = LocalDirStorage("rel")
    assert s.root == str(tmp_path / "rel")
    with pytest.raises(ConfigError):
        LocalDirStorage("")


def test_local_write_error(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    s = LocalDirStorage(str(tmp_path / "file"))
    with pytest.raises(CheckpointError, match="cannot write"):
        s.write_bytes("x", b"1")


def test_registry(tmp_path, monkeypatch):
    monkeypatch.setattr(st, "_REGISTRY", dict(st._REGISTRY))
    assert storage_names() == ["local", "memory", "shared"]
    assert isinstance(get_storage("memory"), MemoryStorage)
    local = get_storage("shared", root=str(tmp_path))
    assert isinstance(local, LocalDirStorage) and local.root == str(tmp_path)
    with pytest.raises(ConfigError, match="unknown storage backend 's3'; known: local, memory, shared"):
        get_storage("s3")
    with pytest.raises(ConfigError, match="already registered"):
        register_storage("memory", MemoryStorage)
    register_storage("fake", MemoryStorage)
    assert isinstance(get_storage("fake"), MemoryStorage)
    register_storage("memory", lambda: "x", replace=True)  # type: ignore[arg-type,return-value]
    assert get_storage("memory") == "x"


# -- lfs -----------------------------------------------------------------------------


def _fake_lfs(tmp_path, monkeypatch, exit_code=0, sleep=0):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "argv"
    script = bindir / "lfs"
    script.write_text(
        f"#!/bin/sh\n[ {sleep} -eq 0 ] || exec sleep {sleep}\n"
        f"echo \"$@\" > {log}\necho 'not a lustre fs' >&2\nexit {exit_code}\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    return log


def test_lustre_absent(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert set_lustre_striping(str(tmp_path)) is False


def test_lustre_runs(tmp_path, monkeypatch):
    log = _fake_lfs(tmp_path, monkeypatch)
    assert set_lustre_striping("/p fs/with space", 8) is True
    assert log.read_text() == "setstripe -c 8 /p fs/with space\n"
    assert set_lustre_striping("/q") is True
    assert log.read_text() == "setstripe -c -1 /q\n"


def test_lustre_failure_is_logged(tmp_path, monkeypatch, caplog):
    _fake_lfs(tmp_path, monkeypatch, exit_code=22)
    with caplog.at_level(logging.WARNING):
        assert set_lustre_striping("/q") is False
    assert "exit 22" in caplog.text and "not a lustre fs" in caplog.text


def test_lustre_timeout(tmp_path, monkeypatch, caplog):
    _fake_lfs(tmp_path, monkeypatch, sleep=5)
    with caplog.at_level(logging.WARNING):
        assert set_lustre_striping("/q", timeout_s=0.2) is False
    assert "timed out" in caplog.text


@pytest.mark.parametrize("n", [0, -2])
def test_lustre_bad_count(n):
    with pytest.raises(ConfigError, match="stripe_count"):
        set_lustre_striping("/q", n)
