"""XOR tier, pure parts: rebuild pieces, the rebuild plan, the parity file, partial reads."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_resilience.checkpoint.redundancy import rebuild_sources, segment_in_row, segment_row, xor_groups
from slurm_resilience.checkpoint.xor_math import encode_group_distributed, segment_size, xor_into
from slurm_resilience.checkpoint.xor_rebuild import plan_rebuild
from slurm_resilience.checkpoint.xor_tier import ParityHeader, pread_into, read_parity, rounds, write_parity
from slurm_resilience.errors import CheckpointError


def _chunks(lengths, seed=0):
    rng = random.Random(seed)
    return [bytes(rng.getrandbits(8) for _ in range(n)) for n in lengths]


def _segments(chunk: bytes, seg: int, n: int) -> list[np.ndarray]:
    padded = np.zeros((n - 1) * seg, dtype=np.uint8)
    padded[: len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
    return [padded[j * seg:(j + 1) * seg] for j in range(n - 1)]


def _simulate_rebuild(chunks, missing):
    """What the lost member accumulates from every survivor's ``rebuild_sources`` pieces."""
    n, lengths = len(chunks), [len(c) for c in chunks]
    seg = segment_size(lengths)
    rows = encode_group_distributed(chunks)
    acc = np.zeros((n, seg), dtype=np.uint8)
    for m in range(n):
        if m == missing:
            continue
        segs = _segments(chunks[m], seg, n)
        for i, src in enumerate(rebuild_sources(m, missing, n)):
            xor_into(acc[i], rows[m].parity if src is None else segs[src])
    return acc, rows


@pytest.mark.parametrize("lengths", [(8, 8), (3, 0), (16, 16, 16), (7, 9, 16, 1), (100, 37, 0, 64, 3),
                                     (1000, 999, 1001, 5, 0, 64)])
def test_rebuild_sources_give_back_shard_and_parity_row(lengths):
    chunks = _chunks(lengths)
    n = len(chunks)
    for x in range(n):
        acc, rows = _simulate_rebuild(chunks, x)
        shard = acc[: n - 1].reshape(-1)
        assert shard[: lengths[x]].tobytes() == chunks[x]
        assert not shard[lengths[x]:].any()  # the padding comes back zero
        assert acc[n - 1].tobytes() == rows[x].parity.tobytes()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=2, max_size=7), st.data())
def test_rebuild_sources_hypothesis(chunks, data):
    x = data.draw(st.integers(0, len(chunks) - 1))
    acc, rows = _simulate_rebuild(chunks, x)
    assert acc[:-1].reshape(-1)[: len(chunks[x])].tobytes() == chunks[x]
    assert acc[-1].tobytes() == rows[x].parity.tobytes()


def test_segment_in_row_inverts_segment_row():
    for n in range(2, 8):
        for m in range(n):
            for j in range(n - 1):
                assert segment_in_row(m, segment_row(m, j, n), n) == j
            with pytest.raises(CheckpointError, match="own parity row"):
                segment_in_row(m, m, n)


def test_rebuild_sources_errors_and_shape():
    assert rebuild_sources(0, 1, 2) == [None, 0]  # group of 2: send our row (= its shard) and our shard
    src = rebuild_sources(2, 0, 4)
    assert len(src) == 4 and src.count(None) == 1
    with pytest.raises(CheckpointError, match="at least 2"):
        rebuild_sources(0, 0, 1)
    with pytest.raises(CheckpointError, match="must differ"):
        rebuild_sources(1, 1, 3)
    with pytest.raises(CheckpointError, match="must differ"):
        rebuild_sources(3, 0, 3)


# -- plan -------------------------------------------------------------------------------


def test_plan_nothing_lost():
    plan = plan_rebuild([[0, 1, 2], [3, 4]], [[3, 2]] * 5)
    assert plan.step == 3 and plan.lost == {} and "nothing lost" in plan.why


def test_plan_one_per_group():
    held = [[3, 2], [], [3, 2], [3, 2], [-1, -1]]
    plan = plan_rebuild([[0, 1, 2], [3, 4]], held)
    assert plan.step == 3 and plan.lost == {1: (0, 1, 2), 4: (3, 4)}


def test_plan_skips_a_step_a_group_lacks_twice():
    # step 3 lacks ranks 1 and 2 of group [0, 1, 2]; step 2 lacks only rank 1
    held = [[3, 2], [-1, -1], [2, -1], [3, 2]]
    plan = plan_rebuild([[0, 1, 2, 3]], held)
    assert plan.step == 2 and plan.lost == {1: (0, 1, 2, 3)}


def test_plan_nothing_possible():
    assert plan_rebuild([[0, 1]], [[-1], [-1]]).step is None
    plan = plan_rebuild([[0, 1, 2]], [[5], [], []])
    assert plan.step is None and "newest 5 lacks two members" in plan.why


def test_plan_uses_groups_on_distinct_nodes():
    nodes = ["a", "b", "c", "d", "e", "f"]
    groups = xor_groups(nodes, 3)
    held = [[7]] * 6
    held = [h if r not in (0, 4) else [] for r, h in enumerate(held)]
    assert plan_rebuild(groups, held).lost == {0: (0, 1, 2), 4: (3, 4, 5)}


# -- parity file ---------------------------------------------------------------------------


def _header(**kw):
    base = dict(step=7, world_size=5, group=(0, 1, 2), member=1, lengths=(10, 20, 15),
                shard_crc32=(1, 2, 3), parity_crc32=0)
    base.update(kw)
    return ParityHeader(**base)


def test_parity_file_round_trip(tmp_path):
    import zlib

    row = np.arange(16, dtype=np.uint8)
    hdr = _header(parity_crc32=zlib.crc32(row))
    assert hdr.segment == 16
    path = str(tmp_path / "xor-00001.bin")
    size = write_parity(path, hdr, row)
    assert os.path.getsize(path) == size and os.stat(path).st_mode & 0o777 == 0o600
    got, offset, data = read_parity(path)
    assert got == hdr and data.tobytes() == row.tobytes()
    assert read_parity(path, data=False)[:2] == (hdr, offset)

    blob = bytearray(open(path, "rb").read())
    blob[-1] ^= 1
    open(path, "wb").write(bytes(blob))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_parity(path)
    open(path, "wb").write(bytes(blob[:-3]))
    with pytest.raises(CheckpointError, match="13 parity bytes, expected 16"):
        read_parity(path)


def test_parity_header_errors(tmp_path):
    with pytest.raises(CheckpointError, match="bad magic"):
        ParityHeader.parse(b"nope" * 10)
    good = _header().to_bytes()
    with pytest.raises(CheckpointError, match="malformed"):
        ParityHeader.parse(good[:20] + b"}" + good[21:])
    with pytest.raises(CheckpointError, match="disagree"):
        ParityHeader.parse(_header(lengths=(1, 2)).to_bytes())
    with pytest.raises(CheckpointError, match="cannot read parity file"):
        read_parity(str(tmp_path / "missing.bin"))


def test_pread_into_pads_past_limit(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(10)))
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(b"\xff" * 8)
        pread_into(fd, memoryview(buf), 6, 10)
        assert bytes(buf) == bytes([6, 7, 8, 9, 0, 0, 0, 0])
        buf = bytearray(b"\xff" * 4)
        pread_into(fd, memoryview(buf), 12, 10)  # entirely past the shard: zeros
        assert bytes(buf) == bytes(4)
        with pytest.raises(OSError, match="short read"):
            pread_into(fd, memoryview(bytearray(8)), 6, 20)  # the file is shorter than its record
    finally:
        os.close(fd)


def test_rounds():
    assert [rounds(s, 4) for s in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
