"""The capsule store's boundaries: foreign files, links, read-only dirs, other models, keys."""

import fcntl
import json
import os
from pathlib import Path
import shutil
import subprocess
import sys
import threading
import time

from flashrt_ros.runtime import (
    BudgetExceededError,
    CapsuleNotFoundError,
    ConfigError,
    CorruptCapsuleError,
    FingerprintMismatchError,
    FlashRTError,
    InvalidRequestError,
)
from flashrt_ros.runtime.state import disk
import numpy as np
import pytest
from runtime_harness import greedy, PROMPT
from safetensors import safe_open
from safetensors.torch import save
import torch

REPO = Path(__file__).resolve().parents[2]


def _files(directory):
    """Return name -> bytes of every file in directory (links: their target path)."""
    return {p.name: (os.readlink(p) if p.is_symlink() else p.read_bytes())
            for p in sorted(directory.iterdir()) if p.is_symlink() or p.is_file()}


def test_foreign_files_are_never_counted_evicted_deleted_read_or_replaced(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    size = rt.snapshot('mine', tier='disk').nbytes
    directory = rt.config.capsule_path
    # A model checkpoint, a file that is no safetensors at all, a directory and a FIFO.
    (directory / 'model.safetensors').write_bytes(
        save({'w': torch.ones(size)}, metadata={'format': 'pt'}))
    (directory / 'junk.safetensors').write_bytes(b'not a capsule')
    (directory / 'dir.safetensors').mkdir()
    os.mkfifo(directory / 'fifo.safetensors')  # opening it for reading must not block
    before = _files(directory)
    assert rt.stats().tiers['disk'].bytes_used == size
    assert rt.stats().tiers['disk'].count == 1
    foreign, unreadable = [], []
    assert [i.name for i in rt.list_capsules(foreign=foreign, unreadable=unreadable)] == ['mine']
    assert sorted(foreign) == ['dir', 'fifo', 'junk', 'model'] and unreadable == []
    for name in ('model', 'junk', 'dir', 'fifo'):
        for call in (lambda: rt.delete_capsule(name), lambda: rt.restore(name),
                     lambda: rt.fork(name, 'copy'), lambda: rt.snapshot(name),
                     lambda: rt.snapshot(name, tier='disk'), lambda: rt.verify_capsule(name)):
            with pytest.raises(CapsuleNotFoundError, match='not a capsule'):
                call()
    # lru on a budget the foreign files would overflow: only our own capsule goes.
    lru = make_runtime(eviction='lru', disk_budget_bytes=size + size // 2)
    lru.prefill(PROMPT)
    lru.snapshot('next', tier='disk')
    assert [i.name for i in lru.drain_evictions()] == ['mine']
    del before['mine.safetensors']
    after = _files(directory)
    assert {k: after[k] for k in before} == before and 'next.safetensors' in after


def test_a_corrupt_capsule_of_ours_is_unreadable_not_foreign(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    rt.snapshot('c', tier='disk')
    path = rt.config.capsule_path / 'c.safetensors'
    path.write_bytes(path.read_bytes()[:-10])  # our header, a short body
    size = path.stat().st_size
    foreign, unreadable = [], []
    assert rt.list_capsules(foreign=foreign, unreadable=unreadable) == []
    assert (foreign, unreadable) == ([], ['c'])
    assert rt.stats().tiers['disk'].bytes_used == size  # ours: counted
    with pytest.raises(CorruptCapsuleError, match='delete it'):
        rt.restore('c')
    assert rt.delete_capsule('c').nbytes == size
    assert not path.exists()


def test_a_link_under_a_capsule_name_is_never_followed(make_runtime, tmp_path):
    rt = make_runtime()
    rt.prefill(PROMPT)
    rt.snapshot('real', tier='disk')
    directory = rt.config.capsule_path
    outside = tmp_path / 'outside'
    outside.mkdir()
    shutil.copy(directory / 'real.safetensors', outside / 'target.safetensors')
    (outside / 'big.bin').write_bytes(b'x' * 100_000)
    (directory / 'link.safetensors').symlink_to(outside / 'target.safetensors')
    (directory / 'big.safetensors').symlink_to(outside / 'big.bin')
    (directory / 'inside.safetensors').symlink_to(directory / 'real.safetensors')
    before, outside_before = _files(directory), _files(outside)
    used = (directory / 'real.safetensors').stat().st_size
    assert rt.stats().tiers['disk'].bytes_used == used  # no target's size
    foreign = []
    assert [i.name for i in rt.list_capsules(foreign=foreign)] == ['real']
    assert sorted(foreign) == ['big', 'inside', 'link']
    for name in ('link', 'big', 'inside'):
        for call in (lambda: rt.restore(name), lambda: rt.delete_capsule(name),
                     lambda: rt.fork(name, 'copy'), lambda: rt.snapshot(name, tier='disk')):
            with pytest.raises(CapsuleNotFoundError, match='symbolic link'):
                call()
    assert _files(directory) == before and _files(outside) == outside_before


_READ_ONLY_CHILD = r"""
import json, sys
from flashrt_ros.runtime import FlashRTError, Runtime, RuntimeConfig
rt = Runtime(RuntimeConfig(model='builtin:tiny-hybrid', max_seq_len=128, rollback_depth=4,
                           capsule_dir=sys.argv[1]))
out = {}
rt.restore('c')
out['restored'] = rt.state_digest()
rt.fork('c', 'c-dev', tier='device')
rt.reset()
rt.restore('c-dev')
out['forked'] = rt.state_digest()
rt.reset()
rt.restore('c')
out['again'] = rt.state_digest()
out['listed'] = sorted(i.name for i in rt.list_capsules())
for label, call in (('disk', lambda: rt.snapshot('new', tier='disk')),
                    ('delete', lambda: rt.delete_capsule('c')),
                    ('device-over-disk', lambda: rt.snapshot('c')),
                    ('disk-over-disk', lambda: rt.snapshot('c', tier='disk'))):
    try:
        call()
        out[label] = 'no error'
    except FlashRTError as exc:
        out[label] = str(exc)
    except BaseException as exc:
        out[label] = 'raw ' + repr(exc)
out['listed-after'] = sorted(i.name for i in rt.list_capsules())
print(json.dumps(out))
"""


def test_a_read_only_capsule_dir_serves_restores_and_refuses_writes(make_runtime, tmp_path):
    # Root ignores file modes, so the directory is made read-only by a read-only bind mount
    # in a user + mount namespace of the child process.
    if subprocess.run(['unshare', '-rm', 'true'], capture_output=True).returncode != 0:
        pytest.skip('needs unshare -rm (user and mount namespaces) for a read-only mount')
    rt = make_runtime(max_seq_len=128)
    rt.prefill(PROMPT)
    rt.snapshot('c', tier='disk')
    greedy(rt, 3)
    rt.restore('c')
    digest = rt.state_digest()
    directory = str(rt.config.capsule_path)
    files = _files(rt.config.capsule_path)
    script = tmp_path / 'child.py'
    script.write_text(_READ_ONLY_CHILD)
    mount = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$1" "$2" "$0"'
    child = subprocess.run(
        ['unshare', '-rm', 'sh', '-c', mount, directory, sys.executable, str(script)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.splitlines()[-1])
    assert out['restored'] == out['forked'] == out['again'] == digest
    assert out['listed'] == out['listed-after'] == ['c', 'c-dev']
    for label in ('disk', 'delete', 'device-over-disk', 'disk-over-disk'):
        assert 'is read-only' in out[label] and 'nothing was changed' in out[label], out[label]
    assert _files(rt.config.capsule_path) == files


def test_a_capsule_of_another_model_is_never_replaced_or_evicted(make_runtime):
    other = make_runtime('builtin:tiny-qwen3-5')
    other.prefill(PROMPT)
    size = other.snapshot('shared', tier='disk').nbytes
    directory = other.config.capsule_path
    theirs = (directory / 'shared.safetensors').read_bytes()
    rt = make_runtime(eviction='lru', disk_budget_bytes=2 * size)
    rt.prefill(PROMPT)
    for tier in ('disk', 'device', 'host'):
        with pytest.raises(FingerprintMismatchError, match='delete it first or pick another'):
            rt.snapshot('shared', tier=tier)
    with pytest.raises(FingerprintMismatchError, match='different model'):
        rt.fork('shared', 'mine')  # checked before anything is copied
    with pytest.raises(CapsuleNotFoundError):
        rt.restore('mine')
    rt.snapshot('a', tier='disk')
    for name in ('b', 'c'):  # each needs room: only our own 'a', then 'b', may go
        rt.snapshot(name, tier='disk')
    assert [i.name for i in rt.drain_evictions()] == ['a', 'b']
    assert (directory / 'shared.safetensors').read_bytes() == theirs
    rt.snapshot('pinned', tier='disk', pinned=True)  # evicts 'c'
    with pytest.raises(BudgetExceededError, match='other models'):
        rt.snapshot('d', tier='disk')
    rt.delete_capsule('shared')  # an explicit delete may remove it
    rt.snapshot('shared', tier='disk')


def test_listing_reads_each_header_once(make_runtime, monkeypatch):
    rt = make_runtime()
    rt.prefill(PROMPT)
    for i in range(5):
        rt.snapshot(f'c{i}', tier='disk')
    loads = []
    load = disk._load_entry
    monkeypatch.setattr(disk, '_load_entry', lambda name, *a: loads.append(name) or load(name, *a))
    fresh = make_runtime()  # a new index: reads every header once
    assert len(fresh.list_capsules()) == 5 and sorted(loads) == [f'c{i}' for i in range(5)]
    loads.clear()
    fresh.list_capsules()
    fresh.stats()
    assert loads == []
    fresh.snapshot('c5', tier='disk')  # its budget check and the listing read only c5's header
    fresh.list_capsules()
    assert loads == ['c5']
    loads.clear()
    path = fresh.config.capsule_path / 'c1.safetensors'
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))  # changed in place, same size
    os.utime(path, ns=(time.time_ns() + 10**9,) * 2)
    fresh.list_capsules()
    assert loads == ['c1']
    loads.clear()
    fresh.restore('c2')  # a restore moves c2's mtime (its LRU clock): no header re-read
    fresh.list_capsules()
    assert loads == []


def _temp(directory, name, age_s):
    path = directory / name
    path.write_bytes(b'x' * 1000)
    os.utime(path, (time.time() - age_s,) * 2)
    return path


def test_temp_files_are_counted_and_ours_swept_once_unlocked(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    size = rt.snapshot('a', tier='disk').nbytes
    directory = rt.config.capsule_path
    stale = _temp(directory, f'.b{disk.TEMP_MARK}killed.tmp', 2 * disk.UNLOCKED_TEMP_S)
    locked = _temp(directory, f'.c{disk.TEMP_MARK}writing.tmp', 2 * disk.UNLOCKED_TEMP_S)
    young = _temp(directory, f'.d{disk.TEMP_MARK}young.tmp', 0)
    unmarked = _temp(directory, '.e.other.tmp', 2 * disk.UNLOCKED_TEMP_S)  # not provably ours
    stats = rt.stats()
    assert stats.disk_temp_bytes == 4000
    assert stats.tiers['disk'].bytes_used == size + 4000
    assert stats.to_dict()['disk_temp_bytes'] == 4000
    with open(locked, 'rb') as writer:  # a live writer holds its lock
        fcntl.flock(writer, fcntl.LOCK_EX)
        rt.snapshot('b', tier='disk')  # a disk write sweeps first
        assert not stale.exists() and locked.exists() and young.exists() and unmarked.exists()
    assert rt.stats().disk_temp_bytes == 3000


def _key_file(tmp_path, name, key=None):
    path = tmp_path / name
    path.write_bytes(key or os.urandom(32))
    return str(path)


def _resign(path):
    """Rewrite a capsule file with its checksum recomputed (what anyone can do without a key)."""
    with safe_open(str(path), framework='pt') as f:
        meta = f.metadata()
        blob = f.get_tensor('blob').clone()
    blob[-1] ^= 1
    meta = {'flashrt': meta['flashrt'], 'checksum': disk.checksum(blob, meta['flashrt'])}
    path.write_bytes(save({'blob': blob}, metadata=meta))


def test_with_a_capsule_key_only_its_capsules_are_restored(make_runtime, tmp_path, monkeypatch):
    key = _key_file(tmp_path, 'key')

    def make(key_file=None):
        if key_file is None:
            monkeypatch.delenv('FLASHRT_CAPSULE_KEY_FILE', raising=False)
        else:
            monkeypatch.setenv('FLASHRT_CAPSULE_KEY_FILE', key_file)
        return make_runtime()

    keyed = make(key)
    keyed.prefill(PROMPT)
    keyed.snapshot('keyed', tier='disk')
    digest = keyed.state_digest()
    plain = make()
    plain.snapshot('plain', tier='disk')
    plain.restore('keyed')  # without a key: as before, the checksum alone
    assert plain.state_digest() == digest
    other_key = make(_key_file(tmp_path, 'other'))
    live = other_key.state_digest()
    for rt, name in ((keyed, 'plain'), (other_key, 'keyed')):
        with pytest.raises(CorruptCapsuleError, match='not written with this key'):
            rt.restore(name)
    assert other_key.state_digest() == live
    path = keyed.config.capsule_path / 'keyed.safetensors'
    _resign(path)
    plain.restore('keyed')  # a forged capsule passes an unkeyed checksum...
    with pytest.raises(CorruptCapsuleError, match='not written with this key'):
        keyed.restore('keyed')  # ...but not the MAC


def test_a_bad_capsule_key_file_is_a_config_error(make_runtime, tmp_path, monkeypatch):
    monkeypatch.setenv('FLASHRT_CAPSULE_KEY_FILE', str(tmp_path / 'missing'))
    with pytest.raises(ConfigError, match='cannot read the capsule key file'):
        make_runtime()
    monkeypatch.setenv('FLASHRT_CAPSULE_KEY_FILE', _key_file(tmp_path, 'short', b'abc'))
    with pytest.raises(ConfigError, match='at least 16'):
        make_runtime()


@pytest.mark.parametrize('temperature', [1e-45, 1e-5, float('inf'), float('nan'), -1.0, '1'])
def test_temperatures_that_cannot_sample_are_refused(make_runtime, temperature):
    rt = make_runtime()
    rt.prefill(PROMPT)
    before = rt.state_digest()
    with pytest.raises(InvalidRequestError, match='temperature'):
        rt.generate(' and', temperature=temperature)
    assert rt.state_digest() == before and not rt.generating
    assert len(greedy(rt, 2, temperature=1e-4, seed=1)) == 2
    # The documented minimum as a ROS message carries it (float32: 9.9999997e-05).
    assert len(greedy(rt, 2, temperature=float(np.float32(1e-4)), seed=1)) == 2


def test_greedy_decoding_refuses_nan_logits(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    head = rt.adapter.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, a, out: out * float('nan'))
    gen = rt.generate(' and', max_new_tokens=4, stop=(), eos=False)
    with pytest.raises(FlashRTError, match='NaN logits'):
        list(gen)
    handle.remove()
    assert gen.result.stop_reason == 'error' and gen.result.token_ids == []
    assert len(greedy(rt, 3, prompt=' again')) == 3


def _hold_disk_write(monkeypatch, name):
    """Make the file write of capsule `name` wait on a gate; return (writing, go_on) events."""
    writing, go_on = threading.Event(), threading.Event()
    write = disk.write

    def held(directory, capsule, data):
        if capsule == name:
            writing.set()
            assert go_on.wait(30.0)
        return write(directory, capsule, data)

    monkeypatch.setattr(disk, 'write', held)
    return writing, go_on


def _within(seconds, fn):
    """Run fn on a thread; return its result, or fail when it has not returned in time."""
    out = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert out, f'{fn} waited for the disk write'
    return out[0]


def test_a_disk_write_holds_up_no_other_capsule_operation(make_runtime, monkeypatch):
    rt = make_runtime(eviction='lru')
    rt.prefill(PROMPT)
    size = rt.snapshot('old', tier='disk').nbytes
    rt.store.budgets['disk'] = 3 * size + size // 2  # 'old', 'other' and one more
    rt.snapshot('other', tier='disk')
    other = rt.state_digest()
    rt.prefill(' and more')
    big = rt.state_digest()
    writing, go_on = _hold_disk_write(monkeypatch, 'big')
    answers = []
    saver = threading.Thread(target=lambda: answers.append(rt.snapshot('big', tier='disk')))
    saver.start()
    try:
        assert writing.wait(10.0), 'the disk write never started'
        _within(5.0, lambda: rt.restore('other'))  # a disk capsule: read while 'big' writes
        assert rt.state_digest() == other
        names = {i.name for i in _within(5.0, rt.list_capsules)}
        assert names == {'old', 'other'}  # 'big' is not published yet
        tier = rt.stats().tiers['disk']
        assert (tier.count, tier.bytes_used) == (2, 2 * size + rt.store._writing['big'])
        with pytest.raises(InvalidRequestError, match='being written'):
            rt.snapshot('big', tier='device')  # the name is reserved
        with pytest.raises(InvalidRequestError, match='being written'):
            rt.delete_capsule('big')
        # Another disk snapshot counts the reserved bytes: it has to evict 'old' for them.
        _within(5.0, lambda: rt.snapshot('third', tier='disk'))
        assert [i.name for i in rt.drain_evictions()] == ['old']
        assert saver.is_alive(), 'the write was not held meanwhile'
    finally:
        go_on.set()
        saver.join(30.0)
    assert answers and answers[0].name == 'big'
    assert {i.name for i in rt.list_capsules()} == {'other', 'third', 'big'}
    assert rt.drain_evictions() == []  # three files fit
    assert sum(1 for p in rt.config.capsule_path.iterdir() if p.name.startswith('.')) == 0
    rt.restore('big')
    assert rt.state_digest() == big


def test_a_capsule_deleted_during_a_disk_write_is_not_evicted_again(make_runtime, monkeypatch):
    rt = make_runtime(eviction='lru')
    rt.prefill(PROMPT)
    size = rt.snapshot('a', tier='disk').nbytes
    rt.snapshot('b', tier='disk')
    rt.store.budgets['disk'] = 2 * size + size // 2  # 'c' needs 'a' gone
    writing, go_on = _hold_disk_write(monkeypatch, 'c')
    saver = threading.Thread(target=lambda: rt.snapshot('c', tier='disk'))
    saver.start()
    try:
        assert writing.wait(10.0)
        _within(5.0, lambda: rt.delete_capsule('a'))
    finally:
        go_on.set()
        saver.join(30.0)
    assert rt.drain_evictions() == []  # the room was there when the file was published
    assert {i.name for i in rt.list_capsules()} == {'b', 'c'}


def test_reading_or_scanning_disk_capsules_holds_up_no_other_capsule_operation(
        make_runtime, monkeypatch):
    rt = make_runtime(eviction='lru')
    rt.prefill(PROMPT)
    rt.snapshot('on_disk', tier='disk')
    rt.snapshot('home')
    home = rt.state_digest()
    rt.prefill(' and more')
    reading, go_on = threading.Event(), threading.Event()
    read, load_entry = disk.read, disk._load_entry

    def held_read(name, *args, **kwargs):
        if name == 'on_disk':
            reading.set()
            assert go_on.wait(30.0)
        return read(name, *args, **kwargs)

    def held_header(name, *args):
        if name == 'new_file':
            reading.set()
            assert go_on.wait(30.0)
        return load_entry(name, *args)

    monkeypatch.setattr(disk, 'read', held_read)
    monkeypatch.setattr(disk, '_load_entry', held_header)
    # verify() reads and hashes the whole file; a diagnostics tick (usage) scans the
    # directory and reads a new file's header. Neither may hold the store's lock meanwhile.
    shutil.copy(disk.path_of(rt.config.capsule_path, 'on_disk'),
                disk.path_of(rt.config.capsule_path, 'new_file'))
    for slow in (lambda: rt.verify_capsule('on_disk'), rt.stats):
        reading.clear()
        go_on.clear()
        worker = threading.Thread(target=slow)
        worker.start()
        try:
            assert reading.wait(10.0), 'the read never started'
            _within(5.0, lambda: rt.snapshot('during', tier='host'))
            _within(5.0, lambda: rt.restore('home'))
            assert rt.state_digest() == home
            _within(5.0, lambda: rt.delete_capsule('during'))
            assert worker.is_alive(), 'the read was not held meanwhile'
        finally:
            go_on.set()
            worker.join(30.0)
    assert {i.name for i in rt.list_capsules()} == {'on_disk', 'new_file', 'home'}


def test_file_parts_decode_like_encode(make_runtime):
    from flashrt_ros.runtime.state import disk
    rt = make_runtime()
    rt.prefill('héllo 🤖 wörld')
    rt.snapshot('a', tier='host')
    cap = rt.store.get('a')
    for key in (None, b'k' * 32):
        head, blob = disk.file_parts(cap, key)
        whole = head + bytes(blob.numpy())
        assert len(head) % 8 == 0 and len(whole) == len(disk.encode(cap, key))
        back = disk.decode('a', bytearray(whole), key)
        assert back.checksum == cap.checksum and torch.equal(back.blob, cap.blob)
        assert disk.header(back) == disk.header(cap)
