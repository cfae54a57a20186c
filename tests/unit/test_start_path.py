"""A job's (re)start: the keeper's store port is known before its store serves, and the
supervisor's store client connects only at its first use (after the workers' launches)."""

import json
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from slurm_resilience.config import load_config
from slurm_resilience.protocol import StoreKey
from slurm_resilience.supervisor.executors.keeper import STORE_FILE, bind_store, host_store, read_store_address
from slurm_resilience.supervisor.executors.online import StoreLink, Supervisor


def test_the_store_port_is_written_before_the_store_serves_and_an_early_client_is_served(tmp_path):
    sock = bind_store("127.0.0.1", str(tmp_path), started=12.5)
    host, port = read_store_address(str(tmp_path), keeper_pid=os.getpid(), timeout_s=1)
    assert (host, port) == ("127.0.0.1", sock.getsockname()[1])
    assert "t" not in json.loads((tmp_path / STORE_FILE).read_text())  # not serving yet
    assert (tmp_path / STORE_FILE).stat().st_mode & 0o777 == 0o600
    got: dict = {}

    def early_client() -> None:  # a worker whose start beat the keeper's import of torch
        client = dist.TCPStore(host, port, None, False, timedelta(seconds=30))
        client.set("early", "1")
        got["value"] = client.get("early")

    t = threading.Thread(target=early_client)
    t.start()
    time.sleep(0.3)  # the client is queued on the bound socket before the store serves
    store = host_store(host, str(tmp_path), 12.5, sock)
    t.join(timeout=30)
    assert got == {"value": b"1"}
    assert store.port == port and store.get("early") == b"1"
    record = json.loads((tmp_path / STORE_FILE).read_text())
    assert record["port"] == port and record["started"] == 12.5 and record["t"] >= 12.5


def test_store_link_connects_once_at_first_use():
    calls = []

    class Fake:
        def check(self, keys):
            return keys == ["k"]

        def get(self, key):  # the store's own get: forwarded, not shadowed by the link
            return b"v:" + key.encode()

    link = StoreLink(lambda: calls.append(1) or Fake())
    assert calls == []
    assert link.check(["k"]) and link.connect() is link.connect()
    assert link.get("x") == b"v:x"
    assert calls == [1]


class Launcher:  # what Supervisor._setup touches of a launcher
    def run_check(self, node, argv, timeout_s):
        return 0, ""


def _supervisor(tmp_path, store_port):
    cfg = load_config({"job": {"nodes": 1, "spares": 0}})
    return Supervisor(config=cfg, command=["true"], job_dir=str(tmp_path), nodes=["a"], launcher=Launcher(),
                      store_host="127.0.0.1", store_port=store_port, run_id="0" * 32)


def test_with_the_keepers_store_the_supervisor_connects_only_at_its_first_store_use(tmp_path):
    store = host_store("127.0.0.1", str(tmp_path), None, bind_store("127.0.0.1", str(tmp_path)))
    sup = _supervisor(tmp_path, store.port)
    try:
        sup._setup()
        assert sup.store._store is None  # generation 0's launches need the port, not a client
        assert sup.store_port == store.port and sup.liveness.port
        sup.store.set("x", "1")  # the first use (plan 0's Publish) connects
        prefixed = dist.PrefixStore(sup.token + "/", store)
        assert prefixed.get("x") == b"1" and sup.store.get("x") == b"1"
        assert sup.store.add("n", 2) == 2 and sup.store.check(["x"])
        assert prefixed.get(StoreKey.LIVENESS_PORT.value) == str(sup.liveness.port).encode()
    finally:
        sup.liveness.close()
        sup.events.close()


def test_a_store_hosted_by_the_supervisor_is_up_before_any_launch(tmp_path):
    sup = _supervisor(tmp_path, None)  # `slurm-resilience local` without a keeper, tests
    try:
        sup._setup()
        assert sup.store._store is not None and sup.store_port
    finally:
        sup.liveness.close()
        sup.events.close()
