import itertools
import os
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_resilience.checkpoint.redundancy import (
    partner_map,
    partner_of,
    partner_sources,
    segment_row,
    xor_groups,
    xor_parity_holder,
)
from slurm_resilience.checkpoint.xor_math import (
    ParityBlock,
    encode_group,
    encode_group_distributed,
    member_rows,
    rebuild,
    rebuild_distributed,
    xor_encode,
)
from slurm_resilience.checkpoint.xor_rebuild import plan_rebuild
from slurm_resilience.errors import CheckpointError

# -- PARTNER --------------------------------------------------------------------


def test_partner_one_rank_per_node():
    nodes = ["n0", "n1", "n2", "n3"]
    assert [partner_of(r, nodes) for r in range(4)] == [1, 2, 3, 0]
    assert [partner_sources(r, nodes) for r in range(4)] == [[3], [0], [1], [2]]


def test_partner_several_ranks_per_node():
    nodes = ["a", "a", "b", "b", "c", "c"]  # same local rank on the next node: one copy per rank
    assert [partner_of(r, nodes) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [partner_sources(r, nodes) for r in range(6)] == [[4], [5], [0], [1], [2], [3]]
    cyclic = ["a", "b", "a", "b"]
    assert [partner_of(r, cyclic) for r in range(4)] == [1, 0, 3, 2]
    uneven = ["a", "a", "a", "b"]  # after an uneven scale-in: still another node, every copy once
    assert [partner_of(r, uneven) for r in range(4)] == [3, 3, 3, 0]


def test_partner_errors():
    with pytest.raises(CheckpointError, match="at least 2 nodes; all 3 ranks are on 'a'"):
        partner_of(0, ["a", "a", "a"])
    with pytest.raises(CheckpointError, match="not in 0..1"):
        partner_of(2, ["a", "b"])
    with pytest.raises(CheckpointError):
        partner_sources(-1, ["a", "b"])


@given(st.lists(st.sampled_from("abcde"), min_size=2, max_size=30).filter(lambda ns: len(set(ns)) >= 2))
def test_partner_invariants(nodes):
    holders = [partner_of(r, nodes) for r in range(len(nodes))]
    for r, p in enumerate(holders):
        assert nodes[p] != nodes[r]
    inverse = sorted(s for r in range(len(nodes)) for s in partner_sources(r, nodes))
    assert inverse == list(range(len(nodes)))  # every rank's copy is held exactly once


# -- XOR groups -------------------------------------------------------------------


def test_groups_one_rank_per_node():
    nodes = [f"n{i}" for i in range(8)]
    assert xor_groups(nodes, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert xor_groups(nodes[:7], 4) == [[0, 1, 2, 3], [4, 5, 6]]
    assert xor_groups(nodes[:6], 4) == [[0, 1, 2, 3], [4, 5]]
    assert xor_groups(nodes[:5], 4) == [[0, 1, 2, 3, 4]]  # remainder 1 merges
    assert xor_groups(nodes[:3], 2) == [[0, 1, 2]]
    assert xor_groups(nodes[:3], 4) == [[0, 1, 2]]  # fewer ranks than a group: one group
    assert xor_groups(nodes[:2], 8) == [[0, 1]]


def test_groups_several_ranks_per_node():
    assert xor_groups(list("aabbccdd"), 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert xor_groups(list("abababab"), 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert xor_groups(list("aaabbbccc"), 3) == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_groups_errors():
    with pytest.raises(CheckpointError, match="group_size=1 must be >= 2"):
        xor_groups(["a", "b"], 1)
    with pytest.raises(CheckpointError, match="at least 2 ranks"):
        xor_groups(["a"], 2)
    with pytest.raises(CheckpointError, match="cannot form XOR groups of 2 ranks on distinct nodes: 2 ranks on 1 node"):
        xor_groups(["a", "a"], 2)
    with pytest.raises(CheckpointError, match="3 on 'a'; lower group_size or use PARTNER"):
        xor_groups(list("aaab"), 2)
    with pytest.raises(CheckpointError, match="cannot form XOR groups of 4"):
        xor_groups(list("aabbcc"), 4)  # 3 nodes cannot hold a 4-member group


def _feasible(nodes, g):
    try:
        return xor_groups(nodes, g)
    except CheckpointError:
        return None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from("abcdefgh"), min_size=2, max_size=40), st.integers(2, 6))
def test_groups_invariants(nodes, g):
    groups = _feasible(nodes, g)
    if groups is None:
        return
    flat = sorted(r for grp in groups for r in grp)
    assert flat == list(range(len(nodes)))  # every rank exactly once
    for grp in groups:
        assert len({nodes[r] for r in grp}) == len(grp)  # distinct nodes
        assert 2 <= len(grp) <= g + 1
        assert grp == sorted(grp)
    assert sum(len(grp) != g for grp in groups) <= 1
    assert groups == xor_groups(list(nodes), g)  # deterministic


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(2, 5), st.integers(2, 5))
def test_groups_balanced_always_feasible(per_node, n_nodes, g):
    nodes = [f"n{i}" for i in range(n_nodes) for _ in range(per_node)]
    if g <= n_nodes and not (len(nodes) % g == 1 and g + 1 > n_nodes):
        assert _feasible(nodes, g) is not None


# -- placement properties: G ranks per node, scale-ins, one node lost ----------------


@st.composite
def clusters(draw, max_nodes=8, max_g=4):
    """A rank table's node list: N >= 1 nodes x G ranks (ranks node_index*G ..), node
    names in any order (a replacement's spare name lands anywhere), then whole nodes
    removed by a scale-in."""
    n, g = draw(st.integers(1, max_nodes)), draw(st.integers(1, max_g))
    names = draw(st.permutations([f"n{i}" for i in range(n + 2)]))[:n]
    removed = draw(st.sets(st.sampled_from(names), max_size=n - 1))
    return [name for name in names if name not in removed for _ in range(g)], g


def _one_line(exc):
    return "\n" not in str(exc.value) and str(exc.value)


@settings(max_examples=400, deadline=None)
@given(clusters())
def test_partner_placement_survives_any_one_node(cluster):
    nodes, g = cluster
    if len(set(nodes)) < 2:
        with pytest.raises(CheckpointError) as exc:
            partner_map(nodes)
        assert _one_line(exc)
        return
    holder = partner_map(nodes)
    assert sorted(holder) == list(range(len(nodes)))  # G on every node: each rank holds exactly one copy
    for r, h in enumerate(holder):
        assert nodes[h] != nodes[r]  # never on the rank's own node
        assert partner_of(r, nodes) == h and r in partner_sources(h, nodes)
    for lost in set(nodes):  # every shard survives as itself or as its copy
        assert all(nodes[r] != lost or nodes[holder[r]] != lost for r in range(len(nodes)))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from("abcdef"), min_size=2, max_size=30).filter(lambda ns: len(set(ns)) >= 2))
def test_partner_placement_any_node_list(nodes):
    holder = partner_map(nodes)
    assert all(nodes[h] != nodes[r] for r, h in enumerate(holder))
    for lost in set(nodes):
        assert all(nodes[r] != lost or nodes[holder[r]] != lost for r in range(len(nodes)))


def _sizes(total, g):
    sizes = [g] * (total // g)
    rest = total % g
    if rest >= 2 or not sizes:
        sizes.append(rest)
    elif rest == 1:
        sizes[-1] += 1
    return sizes


def _partition_exists(nodes, g):
    """Gale-Ryser: groups of these sizes with members on distinct nodes exist iff, for every
    k, the k largest groups fit in what the nodes can give k groups (min(count, k) each)."""
    counts = [nodes.count(n) for n in set(nodes)]
    sizes = sorted(_sizes(len(nodes), g), reverse=True)
    return all(sum(sizes[:k]) <= sum(min(c, k) for c in counts) for k in range(1, len(sizes) + 1))


def _check_groups_survive_one_node(nodes, groups):
    for grp in groups:
        assert len({nodes[r] for r in grp}) == len(grp)  # members on distinct nodes
    for lost in set(nodes):
        gone = [r for r in range(len(nodes)) if nodes[r] == lost]
        held = [[] if nodes[r] == lost else [7] for r in range(len(nodes))]
        plan = plan_rebuild(groups, held)  # at most one member per group lost: recoverable
        assert plan.step == 7 and sorted(plan.lost) == gone


@settings(max_examples=400, deadline=None)
@given(clusters(), st.integers(2, 6))
def test_xor_placement_survives_any_one_node(cluster, g):
    nodes, per_node = cluster  # G on every node: groups exist iff G = 1 or group_size <= nodes
    if len(nodes) < 2 or (per_node > 1 and g > len(set(nodes))):
        with pytest.raises(CheckpointError) as exc:  # a group would need two ranks of one node
            xor_groups(nodes, g)
        assert _one_line(exc)
        return
    groups = xor_groups(nodes, g)
    assert sorted(r for grp in groups for r in grp) == list(range(len(nodes)))
    _check_groups_survive_one_node(nodes, groups)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from("abcdefg"), min_size=2, max_size=30), st.integers(2, 6))
def test_xor_groups_exist_exactly_when_a_partition_does(nodes, g):
    if not _partition_exists(nodes, g):
        with pytest.raises(CheckpointError, match="cannot form XOR groups") as exc:
            xor_groups(nodes, g)
        assert _one_line(exc)
        return
    groups = xor_groups(nodes, g)  # the greedy never misses an existing partition
    assert sorted(map(len, groups)) == sorted(_sizes(len(nodes), g))
    _check_groups_survive_one_node(nodes, groups)


def test_g2_layouts_of_the_local_tests():
    nodes = ["local1", "local1", "local2", "local2", "local3", "local3"]
    assert xor_groups(nodes, 3) == [[0, 2, 4], [1, 3, 5]]
    replaced = ["local1", "local1", "local4", "local4", "local3", "local3"]  # the spare took node index 1
    assert xor_groups(replaced, 3) == xor_groups(nodes, 3)  # same groups: the parity headers still match
    assert partner_map(nodes) == partner_map(replaced) == [2, 3, 4, 5, 0, 1]


def test_parity_holder_and_rows():
    assert [xor_parity_holder([4, 9, 11], r) for r in range(3)] == [4, 9, 11]
    with pytest.raises(CheckpointError):
        xor_parity_holder([4, 9], 2)
    for n in range(2, 7):
        for m in range(n):
            rows = [segment_row(m, j, n) for j in range(n - 1)]
            assert sorted(rows + [m]) == list(range(n))  # a member's segments avoid its own row


# -- whole-shard parity --------------------------------------------------------------


def test_xor_encode_basic():
    p = xor_encode([b"\x01\x02\x03", b"\xff"])
    assert p.dtype == np.uint8 and p.tobytes() == b"\xfe\x02\x03"
    assert xor_encode([]).tobytes() == b""
    assert xor_encode([b"", b""]).tobytes() == b""
    arr = np.arange(5, dtype=np.float32)
    assert xor_encode([arr, arr.tobytes()]).tobytes() == bytes(20)


def test_encode_group_accepts_arrays_and_views():
    a = np.arange(10, dtype=np.int64)[::2]  # non-contiguous
    b = bytearray(b"abc")
    blk = encode_group([a, b, memoryview(b"xyz12")])
    assert blk.lengths == (40, 3, 5)
    assert rebuild(blk, {1: b, 2: b"xyz12"}, 0) == np.ascontiguousarray(a).tobytes()


def _chunks(lengths, seed=0):
    rng = random.Random(seed)
    return [bytes(rng.getrandbits(8) for _ in range(n)) for n in lengths]


@pytest.mark.parametrize("lengths", [(0, 0), (1, 0), (8, 8, 8), (7, 9, 16, 1), (100, 37, 0, 64, 3), (1, 2, 3, 4, 5, 6, 7, 8)])
def test_rebuild_every_single_loss(lengths):
    chunks = _chunks(lengths)
    blk = encode_group(chunks)
    for x in range(len(chunks)):
        assert rebuild(blk, {m: c for m, c in enumerate(chunks) if m != x}, x) == chunks[x]


def test_rebuild_two_lost_raises():
    chunks = _chunks((5, 6, 7, 8))
    blk = encode_group(chunks)
    for x, y in itertools.combinations(range(4), 2):
        with pytest.raises(CheckpointError, match=r"members \[\d\] of the group are lost too"):
            rebuild(blk, {m: c for m, c in enumerate(chunks) if m not in (x, y)}, x)


def test_rebuild_detects_bad_inputs():
    chunks = _chunks((5, 6, 7))
    blk = encode_group(chunks)
    with pytest.raises(CheckpointError, match="survivor 1 has 5 bytes, parity recorded 6"):
        rebuild(blk, {1: chunks[0], 2: chunks[2]}, 0)
    with pytest.raises(CheckpointError, match="not other members"):
        rebuild(blk, {0: chunks[0], 1: chunks[1], 2: chunks[2]}, 0)
    with pytest.raises(CheckpointError, match="not in 0..2"):
        rebuild(blk, {0: chunks[0], 1: chunks[1]}, 3)
    corrupt = bytearray(chunks[2])
    corrupt[6] ^= 1  # beyond member 0's length: padding must come back zero
    with pytest.raises(CheckpointError, match="parity does not match"):
        rebuild(blk, {1: chunks[1], 2: bytes(corrupt)}, 0)
    with pytest.raises(CheckpointError, match="parity has"):
        rebuild(ParityBlock(parity=blk.parity[:3], lengths=blk.lengths), {1: chunks[1], 2: chunks[2]}, 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=2, max_size=8), st.data())
def test_rebuild_hypothesis(chunks, data):
    x = data.draw(st.integers(0, len(chunks) - 1))
    blk = encode_group(chunks)
    blk = ParityBlock.from_bytes(blk.to_bytes())
    assert rebuild(blk, {m: c for m, c in enumerate(chunks) if m != x}, x) == chunks[x]


# -- distributed (RAID-5) parity -----------------------------------------------------------


def _all_single_losses(chunks):
    rows = encode_group_distributed(chunks)
    for x in range(len(chunks)):
        got = rebuild_distributed(
            {r: p for r, p in enumerate(rows) if r != x}, {m: c for m, c in enumerate(chunks) if m != x}, x
        )
        assert got == chunks[x]
        # the lost member's own parity row is recomputed from the rebuilt group
        again = encode_group_distributed([got if m == x else c for m, c in enumerate(chunks)])
        assert again[x].parity.tobytes() == rows[x].parity.tobytes()


@pytest.mark.parametrize(
    "lengths", [(0, 0), (3, 0), (8, 8), (16, 16, 16), (7, 9, 16, 1), (100, 37, 0, 64, 3), (1000, 999, 1001, 5, 0, 64)]
)
def test_distributed_every_single_loss(lengths):
    _all_single_losses(_chunks(lengths))


def test_distributed_storage_cost():
    chunks = _chunks((1200, 1200, 1200, 1200))
    rows = encode_group_distributed(chunks)
    assert [len(r.parity) for r in rows] == [400] * 4  # shard / (n - 1)
    rows = encode_group_distributed(_chunks((10, 3)))
    assert len(rows[0].parity) == 16  # rounded up to 8 bytes
    # group of 2: each member's parity is the other member's shard (PARTNER)
    a, b = _chunks((16, 16))
    r0, r1 = encode_group_distributed([a, b])
    assert r0.parity.tobytes() == b and r1.parity.tobytes() == a


def test_distributed_two_lost_raises():
    chunks = _chunks((50, 60, 70, 80))
    rows = encode_group_distributed(chunks)
    for x, y in itertools.permutations(range(4), 2):
        parities = {r: p for r, p in enumerate(rows) if r not in (x, y)}
        with pytest.raises(CheckpointError, match="lost too"):
            rebuild_distributed(parities, {m: c for m, c in enumerate(chunks) if m not in (x, y)}, x)
        # y's shard survives but its parity row is lost: x cannot be rebuilt either
        with pytest.raises(CheckpointError, match=r"parity rows \[\d\] are lost too"):
            rebuild_distributed(parities, {m: c for m, c in enumerate(chunks) if m != x}, x)


def test_distributed_bad_inputs():
    chunks = _chunks((50, 60, 70))
    rows = encode_group_distributed(chunks)
    with pytest.raises(CheckpointError, match="no parity row survives"):
        rebuild_distributed({0: rows[0]}, {1: chunks[1], 2: chunks[2]}, 0)
    other = encode_group_distributed(_chunks((50, 60, 71)))
    with pytest.raises(CheckpointError, match="same group encoding"):
        rebuild_distributed({1: rows[1], 2: other[2]}, {1: chunks[1], 2: chunks[2]}, 0)
    with pytest.raises(CheckpointError, match="at least 2 members"):
        encode_group_distributed([b"x"])
    # S = 40: member 1's byte 20 is in row 2 beside member 0's segment 1 (bytes 40..79),
    # whose offset 20 is member 0's byte 60, i.e. padding: the corruption is detected
    corrupt = bytearray(chunks[1])
    corrupt[20] ^= 0x80
    with pytest.raises(CheckpointError, match="parity does not match"):
        rebuild_distributed({1: rows[1], 2: rows[2]}, {1: bytes(corrupt), 2: chunks[2]}, 0)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(max_size=300), min_size=2, max_size=7))
def test_distributed_hypothesis(chunks):
    rows = [ParityBlock.from_bytes(p.to_bytes()) for p in encode_group_distributed(chunks)]
    x = len(chunks) // 2
    got = rebuild_distributed({r: p for r, p in enumerate(rows) if r != x}, {m: c for m, c in enumerate(chunks) if m != x}, x)
    assert got == chunks[x]


def test_parity_block_serialization_errors():
    blk = encode_group([b"abc", b"de"])
    data = blk.to_bytes()
    with pytest.raises(CheckpointError, match="bad magic"):
        ParityBlock.from_bytes(b"nope" + data)
    with pytest.raises(CheckpointError, match="truncated"):
        ParityBlock.from_bytes(data[:20])
    with pytest.raises(CheckpointError, match="header says 3"):
        ParityBlock.from_bytes(data[:-1])


def test_large_shards_fast():
    chunks = [os.urandom(8 * 1024 * 1024 + k) for k in (0, 3, 5, 1)]
    rows = encode_group_distributed(chunks)
    assert rebuild_distributed({r: p for r, p in enumerate(rows) if r != 2}, {m: c for m, c in enumerate(chunks) if m != 2}, 2) == chunks[2]
    blk = encode_group(chunks)
    assert rebuild(blk, {m: c for m, c in enumerate(chunks) if m != 1}, 1) == chunks[1]


@pytest.mark.parametrize("lengths", [(0, 0), (10, 3), (100, 37, 0, 64, 3), (24, 24, 24)])
def test_member_rows_reduce_to_parity(lengths):
    chunks = _chunks(lengths, seed=3)
    total = np.bitwise_xor.reduce([member_rows(c, m, lengths) for m, c in enumerate(chunks)])
    rows = encode_group_distributed(chunks)
    for r, p in enumerate(rows):
        assert total[r].tobytes() == p.parity.tobytes()
    for m, c in enumerate(chunks):
        assert not member_rows(c, m, lengths)[m].any()


def test_member_rows_errors():
    with pytest.raises(CheckpointError, match="at least 2 members"):
        member_rows(b"x", 0, (1,))
    with pytest.raises(CheckpointError, match="member 2 is not in 0..1"):
        member_rows(b"x", 2, (1, 1))
    with pytest.raises(CheckpointError, match="member 0 has 1 bytes, lengths say 2"):
        member_rows(b"x", 0, (2, 1))
