import collections
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import h5py
import numpy as np
import pytest
import torch

from slurm_resilience.checkpoint.hdf5_format import (
    FORMAT,
    SKELETON,
    combine_checksums,
    flatten_state,
    read_shard,
    shard_crc32,
    unflatten_state,
    verify_shard,
    write_shard,
)
from slurm_resilience.checkpoint import hdf5_format
from slurm_resilience.errors import CheckpointError


def assert_same(a, b):
    """Structural, bit-exact equality (tensors compared by bytes, dtype, shape)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and b.device.type == "cpu"
        ia = a.contiguous().view(-1).view(torch.uint8) if a.numel() else a
        ib = b.contiguous().view(-1).view(torch.uint8) if b.numel() else b
        assert torch.equal(ia, ib)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def roundtrip(tmp_path, state, **kw):
    path = str(tmp_path / "s.h5")
    info = write_shard(path, state, **kw)
    out, attrs = read_shard(path)
    assert_same(state, out)
    return info, out, attrs


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int8, torch.bool, torch.uint8, torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_roundtrip_bit_exact(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(7, 5, generator=g, dtype=dtype)
        t.view(-1)[3] = float("nan")
        t.view(-1)[4] = float("-inf")
    elif dtype == torch.bool:
        t = torch.randint(0, 2, (7, 5), generator=g).bool()
    else:
        t = torch.randint(-100 if dtype.is_signed else 0, 100, (7, 5), generator=g, dtype=dtype)
    roundtrip(tmp_path, {"t": t, "scalar": t.view(-1)[0].clone(), "empty": t[:0]})


def test_bfloat16_stored_as_int16_view(tmp_path):
    path = str(tmp_path / "s.h5")
    write_shard(path, {"w": torch.ones(3, dtype=torch.bfloat16)})
    with h5py.File(path, "r") as f:
        ds = f["objects/w"]
        assert ds.dtype == np.int16 and ds.attrs["torch_dtype"] == "bfloat16"
        assert ds.chunks is None and ds.compression is None


def test_zero_dim_empty_and_non_contiguous(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "zero_dim": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "empty3": torch.zeros(2, 0, 3, dtype=torch.int64),
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "bf16_t": base.to(torch.bfloat16).t(),
    }
    _, out, _ = roundtrip(tmp_path, state)
    assert out["transposed"].shape == (6, 4)


def test_optimizer_and_rng_state(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    for opt in (sgd, adam):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    random.seed(1)
    np.random.seed(2)
    state = {
        "model": model.state_dict(),
        "sgd": sgd.state_dict(),
        "adam": adam.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        "step": 17,
        "meta": ("run", 1.5, None, [1, 2]),
    }
    info, out, _ = roundtrip(tmp_path, state)
    assert isinstance(out["model"], collections.OrderedDict)
    assert isinstance(out["sgd"]["state"][0]["momentum_buffer"], torch.Tensor)
    torch.set_rng_state(out["rng"]["torch"])
    random.setstate(out["rng"]["python"])
    np.random.set_state(out["rng"]["numpy"])
    # the restored optimizer state loads back into a fresh optimizer
    fresh = torch.optim.Adam(model.parameters(), lr=1e-3)
    fresh.load_state_dict(out["adam"])
    with h5py.File(info.path, "r") as f:
        assert "objects/sgd/state/0/momentum_buffer" in f
        assert "objects/model/0.weight" in f


def test_keys_are_unique_and_hdf5_safe():
    t = torch.zeros(1)
    state = {"a/b": t, "a%2Fb": t, 0: t, "0": t, "": t, ".": t, "..": t, ("x", 1): t, "nul\0": t, "a": {"b": t}}
    tensors, skeleton = flatten_state(state)
    assert len(tensors) == len(state)
    for key in tensors:
        parts = key.split("/")
        assert parts[0] == "objects" and all(p not in ("", ".", "..") and "\0" not in p for p in parts)
    assert "objects/0" in tensors and "objects/a%2Fb" in tensors
    out = unflatten_state(tensors, skeleton)
    assert list(out) == list(state)
    assert_same(state, out)


def test_colliding_keys_roundtrip(tmp_path):
    state = {0: torch.tensor([1]), "0": [torch.tensor([2]), torch.tensor([3])], "x": {"0": torch.tensor([4])}}
    roundtrip(tmp_path, state)


def test_unicode_and_odd_keys_roundtrip(tmp_path):
    t = torch.arange(4.0)
    state = {"größe": t, "模型": {"层/1": t + 1}, "a/b": t + 2, "": t + 3, "nul\0": t + 4, ("x", 1): t + 5}
    roundtrip(tmp_path, state)
    assert verify_shard(str(tmp_path / "s.h5")) == []


Pair = collections.namedtuple("Pair", "a b")


def test_namedtuple_and_opaque_objects(tmp_path):
    dd = collections.defaultdict(list, {"k": [1]})
    state = {"pair": Pair(torch.ones(2), 3), "dd": dd, "arr": np.arange(5, dtype=np.int16), "set": {1, 2}}
    path = str(tmp_path / "s.h5")
    write_shard(path, state)
    out, _ = read_shard(path)
    assert type(out["pair"]) is Pair and torch.equal(out["pair"].a, torch.ones(2))
    assert out["dd"] == dd and out["set"] == {1, 2}
    assert out["arr"].dtype == np.int16


def test_attrs_and_format(tmp_path):
    path = str(tmp_path / "s.h5")
    write_shard(path, {"x": torch.ones(1)}, attrs={"step": 5, "lr": 0.5, "tier": "L2"})
    _, attrs = read_shard(path)
    assert attrs == {"step": 5, "lr": 0.5, "tier": "L2"}
    assert type(attrs["step"]) is int
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == FORMAT
    with pytest.raises(CheckpointError, match="reserved"):
        write_shard(path, {}, attrs={"format": "x"})
    with pytest.raises(CheckpointError, match="int, float or str"):
        write_shard(path, {}, attrs={"bad": [1]})


def test_unpicklable_state_raises(tmp_path):
    with pytest.raises(CheckpointError, match="pickled"):
        write_shard(str(tmp_path / "s.h5"), {"f": lambda: 1})
    assert os.listdir(tmp_path) == []


def test_mode_0600_and_no_temp_left(tmp_path):
    path = tmp_path / "sub" / "s.h5"
    info = write_shard(str(path), {"x": torch.ones(10)})
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.listdir(path.parent) == ["s.h5"]
    assert info.nbytes == os.path.getsize(path)
    assert info.crc32 == shard_crc32(str(path))


def test_overwrite_replaces_file(tmp_path):
    path = str(tmp_path / "s.h5")
    write_shard(path, {"x": torch.ones(3)})
    os.chmod(path, 0o644)
    write_shard(path, {"x": torch.zeros(3)})
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert torch.equal(read_shard(path)[0]["x"], torch.zeros(3))


def test_combined_checksum_depends_on_every_dataset():
    base = {"a": 1, "b": 2}
    assert combine_checksums(base) == combine_checksums(dict(reversed(base.items())))
    assert combine_checksums(base) != combine_checksums({"a": 1, "b": 3})
    assert combine_checksums(base) != combine_checksums({"a": 1, "c": 2})


def _flip_byte_in(path, name, index=5):
    with h5py.File(path, "r") as f:
        offset = f[name].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + index)
        byte = fh.read(1)
        fh.seek(offset + index)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_flipped_byte_names_dataset(tmp_path):
    path = str(tmp_path / "s.h5")
    write_shard(path, {"model": {"w": torch.randn(100), "b": torch.randn(10)}})
    _flip_byte_in(path, "objects/model/w")
    with pytest.raises(CheckpointError, match=r"dataset objects/model/w checksum mismatch") as ei:
        read_shard(path)
    assert path in str(ei.value) and "\n" not in str(ei.value)
    problems = verify_shard(path)
    assert len(problems) == 1 and "objects/model/w" in problems[0]
    out, _ = read_shard(path, verify=False)  # opt-out still reads
    assert out["model"]["w"].shape == (100,)


def test_flipped_skeleton_byte(tmp_path):
    path = str(tmp_path / "s.h5")
    write_shard(path, {"w": torch.randn(4), "meta": "x" * 50})
    _flip_byte_in(path, SKELETON, index=10)
    with pytest.raises(CheckpointError, match=SKELETON):
        read_shard(path)
    assert verify_shard(path)


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.99])
def test_truncated_file(tmp_path, keep):
    path = str(tmp_path / "s.h5")
    write_shard(path, {"w": torch.randn(10000), "v": torch.randn(10)})
    size = os.path.getsize(path)
    os.truncate(path, int(size * keep))
    with pytest.raises(CheckpointError, match="corrupt shard"):
        read_shard(path)
    assert verify_shard(path)


def test_missing_not_hdf5_and_foreign_hdf5(tmp_path):
    missing = str(tmp_path / "nope.h5")
    with pytest.raises(CheckpointError, match="missing shard"):
        read_shard(missing)
    assert verify_shard(missing) == [f"missing shard {missing}"]
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not hdf5 at all" * 100)
    with pytest.raises(CheckpointError, match="not HDF5"):
        read_shard(str(junk))
    foreign = str(tmp_path / "foreign.h5")
    with h5py.File(foreign, "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(CheckpointError, match="format attribute"):
        read_shard(foreign)
    assert len(verify_shard(foreign)) == 1


def test_missing_dataset_named_by_skeleton(tmp_path):
    path = str(tmp_path / "s.h5")
    write_shard(path, {"w": torch.randn(4), "v": torch.randn(4)})
    with h5py.File(path, "r+") as f:
        del f["objects/v"]
    with pytest.raises(CheckpointError, match="objects/v"):
        read_shard(path)
    assert any("objects/v" in p for p in verify_shard(path))


def test_valid_shard_verifies_clean(tmp_path):
    path = str(tmp_path / "s.h5")
    write_shard(path, {"w": torch.randn(4), "e": torch.empty(0), "s": torch.tensor(1)})
    assert verify_shard(path) == []


def _child_env():
    # The child must import this checkout's package, wherever pytest was started.
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(hdf5_format.__file__))))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([repo, *sys.path]))


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from slurm_resilience.checkpoint.hdf5_format import write_shard
    state = {f"t{i}": torch.full((2 * 1024 * 1024,), float(i)) for i in range(64)}  # 512 MiB
    print("start", flush=True)
    write_shard(sys.argv[1], state)
    """
)


def test_sigkilled_writer_leaves_previous_shard_intact(tmp_path):
    path = str(tmp_path / "s.h5")
    write_shard(path, {"old": torch.arange(10)})
    env = _child_env()
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, path], env=env, stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        tmp = None
        while time.monotonic() < deadline and proc.poll() is None:
            temps = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
            if temps and os.path.getsize(tmp_path / temps[0]) > 1 << 20:  # data is flowing
                tmp = temps[0]
                break
            time.sleep(0.005)
        assert tmp is not None, "writer never started writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    out, _ = read_shard(path)
    assert_same(out, {"old": torch.arange(10)})
    assert sorted(os.listdir(tmp_path)) == sorted(["s.h5", tmp])  # only litter under a temp name
    assert os.stat(tmp_path / tmp).st_mode & 0o777 == 0o600


def test_sigkilled_first_write_leaves_no_final_file(tmp_path):
    path = str(tmp_path / "fresh.h5")
    env = _child_env()
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, path], env=env, stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(n.endswith(".tmp") for n in os.listdir(tmp_path)):
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not os.path.exists(path)


# -- bulk I/O past h5py (shard_io) ------------------------------------------------------------


def test_bulk_layout_contiguous_allocated_and_checksummed(tmp_path, monkeypatch):
    from slurm_resilience.checkpoint import shard_io

    monkeypatch.setattr(shard_io, "CHUNK", 4096)  # many chunks per dataset: CRCs are combined
    g = torch.Generator().manual_seed(1)
    state = {"big": torch.randn(50_001, generator=g), "bf": torch.randn(3000, generator=g).to(torch.bfloat16),
             "small": torch.arange(3), "empty": torch.empty(0)}
    path = str(tmp_path / "s.h5")
    info, out, _ = roundtrip(tmp_path, state)
    with h5py.File(path, "r") as f:
        for name in ("objects/big", "objects/bf", "objects/small"):
            ds = f[name]
            assert ds.chunks is None and ds.compression is None and ds.id.get_offset() is not None
            assert int(ds.attrs["crc32"]) == zlib_crc(ds[()])
    assert verify_shard(path) == [] and shard_crc32(path) == info.crc32


def zlib_crc(arr):
    import zlib

    return zlib.crc32(np.ascontiguousarray(arr))


def test_flipped_byte_in_a_bulk_chunk_is_found(tmp_path, monkeypatch):
    from slurm_resilience.checkpoint import shard_io

    monkeypatch.setattr(shard_io, "CHUNK", 4096)
    path = str(tmp_path / "s.h5")
    write_shard(path, {"w": torch.randn(40_000), "v": torch.randn(100)})
    with h5py.File(path, "r") as f:
        offset = f["objects/w"].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + 100_001)
        b = fh.read(1)
        fh.seek(offset + 100_001)
        fh.write(bytes([b[0] ^ 1]))
    problems = verify_shard(path)
    assert problems == [f"corrupt shard {path}: dataset objects/w checksum mismatch"]
    with pytest.raises(CheckpointError, match="objects/w checksum mismatch"):
        read_shard(path)
    assert read_shard(path, verify=False)[0]["v"].shape == (100,)


def test_chunked_or_compressed_datasets_are_read_through_h5py(tmp_path):
    """A shard whose datasets are not plain contiguous runs (another writer) still reads and verifies."""
    path = str(tmp_path / "s.h5")
    write_shard(path, {"w": torch.arange(1000, dtype=torch.float32)})
    with h5py.File(path, "r+") as f:
        data, crc = f["objects/w"][()], f["objects/w"].attrs["crc32"]
        del f["objects/w"]
        ds = f.create_dataset("objects/w", data=data, chunks=(100,), compression="gzip")
        ds.attrs["crc32"] = crc
    out, _ = read_shard(path)
    assert torch.equal(out["w"], torch.arange(1000, dtype=torch.float32))
    assert verify_shard(path) == []


def test_crc32_is_zlibs():
    import zlib

    from slurm_resilience.checkpoint.shard_io import CRC32_IMPL, crc32, crc32_combine

    data = os.urandom(100_000)
    assert crc32(data) == zlib.crc32(data) and CRC32_IMPL in ("isal", "zlib")
    rng = random.Random(0)
    for _ in range(200):
        a, b = os.urandom(rng.randint(0, 2000)), os.urandom(rng.randint(0, 2000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert crc32_combine(123, 0, 0) == 123


def test_extents_write_read_and_short_file(tmp_path):
    from slurm_resilience.checkpoint.shard_io import crc_extents, read_extents, write_extents
    import zlib

    path = tmp_path / "f"
    bufs = [os.urandom(n) for n in (10_000, 1, 0, 7_777)]
    offsets = [0, 20_000, 20_001, 30_000]
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        crcs = write_extents(fd, [(o, memoryview(b)) for o, b in zip(offsets, bufs)], threads=3, chunk=1000)
        assert crcs == [zlib.crc32(b) for b in bufs]
        back = [bytearray(len(b)) for b in bufs]
        assert read_extents(fd, [(o, memoryview(b)) for o, b in zip(offsets, back)], chunk=999) == crcs
        assert [bytes(b) for b in back] == bufs
        assert crc_extents(fd, [(o, len(b)) for o, b in zip(offsets, bufs)], threads=1, chunk=4096) == crcs
        with pytest.raises(OSError, match="bytes short"):
            crc_extents(fd, [(30_000, 8_000)])
    finally:
        os.close(fd)


def test_read_into_given_tensors_where_they_fit(tmp_path):
    """``into``: datasets land in the caller's tensors (the very objects, no new memory) where
    shape and dtype fit; elsewhere (wrong shape or dtype, non-contiguous, a storage already
    used: tied weights) new tensors, as without it. Bit-exact either way."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3000, generator=g)
    state = {"w": w, "tied": w, "bf": torch.randn(500, generator=g).to(torch.bfloat16),
             "shape": torch.randn(4, 6, generator=g), "dtype": torch.arange(10), "t": torch.randn(5, 7, generator=g)}
    path = str(tmp_path / "s.h5")
    write_shard(path, state)
    keys = flatten_state(state)[0]
    name = {k: next(n for n, t in keys.items() if t is state[k] and (k != "tied" or n.endswith("tied")))
            for k in ("w", "bf", "shape", "dtype", "t")}
    name["tied"] = next(n for n in keys if n.endswith("tied"))
    shared = torch.zeros(3000)
    into = {name["w"]: shared, name["tied"]: shared, name["bf"]: torch.zeros(500, dtype=torch.bfloat16),
            name["shape"]: torch.zeros(6, 4), name["dtype"]: torch.zeros(10, dtype=torch.int32),
            name["t"]: torch.zeros(7, 5).t()}
    out, _ = read_shard(path, into=into)
    assert_same(state, out)
    assert out["bf"] is into[name["bf"]]
    assert [out["w"] is shared, out["tied"] is shared].count(True) == 1  # one of the tied pair got it
    assert out["w"].data_ptr() != out["tied"].data_ptr()
    for k in ("shape", "dtype", "t"):
        assert out[k] is not into[name[k]] and not into[name[k]].any()  # did not fit: untouched


def test_read_into_a_corrupt_shard_still_raises(tmp_path):
    path = str(tmp_path / "s.h5")
    write_shard(path, {"w": torch.randn(40_000)})
    with h5py.File(path, "r") as f:
        offset = f["objects/w"].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + 7)
        b = fh.read(1)
        fh.seek(offset + 7)
        fh.write(bytes([b[0] ^ 1]))
    key = next(iter(flatten_state({"w": torch.zeros(1)})[0]))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_shard(path, into={key: torch.zeros(40_000)})


# -- direct (O_DIRECT) writes -------------------------------------------------------------------


def test_direct_writes_aligned_chunks_and_the_rest_buffered(tmp_path, monkeypatch):
    """Chunks aligned in the file and in memory go through the O_DIRECT descriptor (all but
    an unaligned tail); unaligned buffers go buffered; the bytes and CRCs are the same."""
    import zlib

    from slurm_resilience.checkpoint import shard_io
    from slurm_resilience.checkpoint.hdf5_extents import aligned_empty

    path = str(tmp_path / "f.bin")
    open(path, "wb").close()
    fd = os.open(path, os.O_WRONLY)
    dfd = shard_io.open_direct(path, os.O_WRONLY)
    if dfd is None:
        pytest.skip("this filesystem has no O_DIRECT")
    used = []
    real = shard_io._pwrite_all
    monkeypatch.setattr(shard_io, "_pwrite_all", lambda f, v, o: (used.append((f, o, len(v))), real(f, v, o)))
    a = aligned_empty((3 * 4096 + 100,), torch.uint8)
    a.copy_(torch.randint(0, 255, a.shape, dtype=torch.uint8))
    b = torch.randint(0, 255, (5000,), dtype=torch.uint8)
    assert a.data_ptr() % shard_io.ALIGN == 0
    unaligned = memoryview(b.numpy())[1:]  # memory off by one: buffered
    try:
        crcs = shard_io.write_extents(fd, [(8192, memoryview(a.numpy())), (65536, unaligned)],
                                      chunk=8192, threads=2, direct_fd=dfd)
    finally:
        os.close(fd)
        os.close(dfd)
    data = open(path, "rb").read()
    assert data[8192:8192 + a.numel()] == a.numpy().tobytes() and data[65536:65536 + 4999] == bytes(unaligned)
    assert crcs == [zlib.crc32(a.numpy()), zlib.crc32(unaligned)]
    direct = sorted((o, n) for f, o, n in used if f == dfd)
    assert direct == [(8192, 8192), (16384, 4096)]  # two chunks' aligned bodies; the 100-byte tail buffered
    assert all(f == fd for f, o, n in used if o >= 65536)


def test_a_refused_direct_write_falls_back_to_buffered(tmp_path, monkeypatch):
    import errno

    from slurm_resilience.checkpoint import shard_io
    from slurm_resilience.checkpoint.hdf5_extents import aligned_empty

    path = str(tmp_path / "f.bin")
    open(path, "wb").close()
    fd = os.open(path, os.O_WRONLY)
    dfd = os.open(path, os.O_WRONLY)  # stands in for the O_DIRECT descriptor; its writes are refused
    real = shard_io._pwrite_all

    def pwrite_all(f, v, o):
        if f == dfd:
            raise OSError(errno.EINVAL, "Invalid argument")
        real(f, v, o)

    monkeypatch.setattr(shard_io, "_pwrite_all", pwrite_all)
    a = aligned_empty((4, 4096), torch.uint8)
    a.copy_(torch.randint(0, 255, a.shape, dtype=torch.uint8))
    try:
        shard_io.write_extents(fd, [(4096, memoryview(a.numpy()).cast("B"))], chunk=4096, threads=3, direct_fd=dfd)
    finally:
        os.close(fd)
        os.close(dfd)
    assert open(path, "rb").read()[4096:] == a.numpy().tobytes()


def test_engine_buffers_and_shard_datasets_are_aligned_for_direct_io(tmp_path):
    from slurm_resilience.checkpoint.hdf5_extents import ALIGN_ABOVE, aligned_empty
    from slurm_resilience.checkpoint.shard_io import ALIGN

    for shape, dtype in (((1000, 3), torch.float32), ((7,), torch.bfloat16), ((0,), torch.int64)):
        t = aligned_empty(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.data_ptr() % ALIGN == 0 and t.is_contiguous()
    path = str(tmp_path / "s.h5")
    state = {"a": torch.randn(ALIGN_ABOVE // 4 + 3), "b": torch.randn(3), "c": torch.randn(ALIGN_ABOVE)}
    for direct in (False, True):  # direct: the aligned tensors' bytes go O_DIRECT; the same file either way
        aligned = {k: aligned_empty(tuple(v.shape), v.dtype).copy_(v) for k, v in state.items()}
        write_shard(path, aligned, direct=direct)
        with h5py.File(path, "r") as f:
            for name in ("objects/a", "objects/c"):
                assert f[name].id.get_offset() % ALIGN == 0
        assert_same(state, read_shard(path)[0])
        assert verify_shard(path) == []
