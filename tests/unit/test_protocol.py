import json
import os
import stat

import pytest
from hypothesis import given, settings, strategies as st

from slurm_resilience.errors import ConfigError
from slurm_resilience.model import RankSlot, RankTable
from slurm_resilience.protocol import (
    TOKEN_FILE, EventKind, Plan, PlanAction, RecoveryPhase, Role, StoreKey, WorkerEnv, WorkerEvent,
    read_token, write_token,
)
from slurm_resilience.supervisor.decide.ranktable import initial_table

ADDR = {f"n{i}": f"10.0.0.{i}" for i in range(8)}


def _table(n=3, gen=0):
    t = initial_table([f"n{i}" for i in range(n)], [f"w{i}" for i in range(n)], ADDR)
    return RankTable(generation=gen, slots=t.slots)


@pytest.mark.parametrize("action", list(PlanAction))
def test_plan_roundtrip(action):
    p = Plan(generation=4, action=action, table=_table(3, 4), joining=(1, 2), reason="rank 1 lost; node n1")
    back = Plan.from_json(p.to_json())
    assert back == p
    assert Plan.from_json(p.to_json().encode()) == p  # bytes, as from store.get
    assert json.loads(p.to_json())["action"] == action.value


def test_plan_defaults_and_missing_reason():
    p = Plan(generation=0, action=PlanAction.RUN, table=_table())
    assert Plan.from_json(p.to_json()) == p
    d = json.loads(p.to_json())
    del d["reason"]
    assert Plan.from_json(json.dumps(d)).reason == ""


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 8), gen=st.integers(0, 10**6), reason=st.text(max_size=40),
       joining=st.lists(st.integers(0, 7), max_size=8, unique=True))
def test_plan_roundtrip_property(n, gen, reason, joining):
    slots = tuple(RankSlot(rank=i, node=f"node-{i}", worker_id=f"node-{i}.{gen}", local_rank=0,
                           device="cuda", address=f"h{i}") for i in range(n))
    p = Plan(generation=gen, action=PlanAction.RUN, table=RankTable(gen, slots),
             joining=tuple(joining), reason=reason)
    assert Plan.from_json(p.to_json()) == p


def test_store_keys_distinct():
    keys = [StoreKey.PLAN.of(1), StoreKey.PLAN.of(2), StoreKey.HEARTBEAT.of("a"), StoreKey.DONE.of(1),
            StoreKey.EVENT.of(1), StoreKey.PG_PREFIX.of(1)]
    assert len(set(keys)) == len(keys)
    assert StoreKey.PG_PREFIX.of(1) != StoreKey.PG_PREFIX.of(2)


def _env(job_dir, **kw):
    base = dict(store_addr="10.1.2.3", store_port=29500, liveness_port=40001, token="s3cr3t",
                job_dir=str(job_dir), worker_id="n1.7", node="n1", role=Role.STANDBY,
                generation=3, config_path="/x/config.yaml", job_id="12345", run_id="ab" * 16)
    base.update(kw)
    return WorkerEnv(**base)


@pytest.mark.parametrize("role", list(Role))
def test_worker_env_roundtrip_through_token_file(tmp_path, role):
    env = _env(tmp_path, role=role)
    write_token(str(tmp_path), env.token)
    environ = env.to_environ()
    assert all(k.startswith("SR_") and isinstance(v, str) for k, v in environ.items())
    assert environ["SR_ROLE"] == role.value
    assert env.token not in environ.values()  # the secret never travels in the environment
    assert WorkerEnv.from_environ(environ) == env


def test_token_file_is_0600(tmp_path):
    write_token(str(tmp_path), "abc")
    mode = stat.S_IMODE(os.stat(tmp_path / TOKEN_FILE).st_mode)
    assert mode == 0o600
    assert read_token(str(tmp_path)) == "abc"


def test_token_file_0600_even_with_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        write_token(str(tmp_path), "abc")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / TOKEN_FILE).st_mode) == 0o600


def test_token_file_0600_when_overwriting_a_readable_file(tmp_path):
    path = tmp_path / TOKEN_FILE
    path.write_text("old")
    os.chmod(path, 0o644)
    write_token(str(tmp_path), "new")
    assert read_token(str(tmp_path)) == "new"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_missing_vars_one_line_naming_them(tmp_path):
    environ = _env(tmp_path).to_environ()
    del environ["SR_STORE_PORT"], environ["SR_JOB_ID"]
    with pytest.raises(ConfigError) as ei:
        WorkerEnv.from_environ(environ)
    msg = str(ei.value)
    assert "\n" not in msg
    assert "SR_STORE_PORT" in msg and "SR_JOB_ID" in msg
    assert "SR_NODE" not in msg


def test_empty_environment(tmp_path):
    with pytest.raises(ConfigError) as ei:
        WorkerEnv.from_environ({})
    msg = str(ei.value)
    assert "\n" not in msg
    for var in ("SR_STORE_ADDR", "SR_STORE_PORT", "SR_LIVENESS_PORT", "SR_JOB_DIR", "SR_WORKER_ID",
                "SR_NODE", "SR_ROLE", "SR_GENERATION", "SR_CONFIG", "SR_JOB_ID", "SR_RUN_ID"):
        assert var in msg


def test_extra_vars_ignored(tmp_path):
    env = _env(tmp_path)
    write_token(str(tmp_path), env.token)
    environ = {**os.environ, **env.to_environ(), "SR_UNRELATED": "x"}
    assert WorkerEnv.from_environ(environ) == env


@pytest.mark.parametrize("key", [k for k in StoreKey if "{}" in k.value])
def test_store_key_family_fills_every_part(key):
    n = key.value.count("{}")
    filled = key.of(*range(7, 7 + n))
    assert "{}" not in filled and filled.startswith(key.value.split("{}")[0])
    for wrong in (n - 1, n + 1):
        with pytest.raises(ValueError, match=f"{key.name} takes {n} part"):
            key.of(*range(wrong))


@pytest.mark.parametrize("key", [k for k in StoreKey if "{}" not in k.value])
def test_fixed_store_key_takes_no_parts(key):
    with pytest.raises(ValueError, match="takes 0 part"):
        key.of(1)
    with pytest.raises(ValueError):
        key.of()


def test_store_key_families_format_their_parts():
    assert StoreKey.RESHARD_HELD.of(3, 1) == "reshard/3/held/1"
    assert StoreKey.PLAN.of(3) == "plan/3" and StoreKey.HEARTBEAT.of("n1.7") == "hb/n1.7"
    assert StoreKey.EVENT.of(5) == "ev/5" and StoreKey.DONE.of(2) == "done/2" and StoreKey.PG_PREFIX.of(4) == "gen4/"


def test_store_key_families_do_not_swallow_fixed_keys():
    # ev/count sits beside ev/{n}: a worker event number never reads as the counter
    assert StoreKey.EVENT.of(0) != StoreKey.EVENT_COUNTER
    assert len({k.value for k in StoreKey}) == len(StoreKey)


def test_worker_event_logged_name():
    assert WorkerEvent.RESTORED.logged == "rank_restored"
    assert WorkerEvent.CHECKPOINT_DURABLE.logged == "rank_checkpoint_durable"
    logged = {w.logged for w in WorkerEvent}
    assert len(logged) == len(WorkerEvent)
    assert not logged & {k.value for k in EventKind}  # the log's two vocabularies never clash


@pytest.mark.parametrize("member", [*EventKind, *WorkerEvent, *RecoveryPhase, *StoreKey])
def test_names_are_the_strings_on_the_wire(member):
    # readers compare events.jsonl's plain strings with the enums and look them up in dicts
    plain = member.value
    assert member == plain and hash(member) == hash(plain)
    assert {plain: 1}[member] == 1 and {member: 1}[plain] == 1
    assert str(member) == f"{member}" == plain
    assert json.loads(json.dumps({"kind": member})) == {"kind": plain}


def test_recovery_phases_in_order():
    assert [p.value for p in RecoveryPhase] == [
        "classify", "replace", "ranktable", "reconnect", "restore", "first_step"]
