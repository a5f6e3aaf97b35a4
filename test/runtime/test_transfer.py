"""Capsule transfer between two runtimes through the protocol module (no ROS)."""

import dataclasses
import json
import os
import stat

from flashrt_ros.runtime.errors import BudgetExceededError, CapsuleNotFoundError
from flashrt_ros.runtime.errors import CorruptCapsuleError, FingerprintMismatchError
from flashrt_ros.runtime.errors import FlashRTError, InvalidRequestError
from flashrt_ros.runtime.state import transfer
from flashrt_ros.runtime.state.capsule import Origin
import pytest
from runtime_harness import greedy, PROMPT

ORIGIN = Origin('/left_arm/flashrt', 'ctx', 1.0e9)


def _pair(make_runtime, tmp_path, **receiver):
    sender = make_runtime(capsule_dir=str(tmp_path / 'sender'))
    return sender, make_runtime(capsule_dir=str(tmp_path / 'receiver'), **receiver)


def _move(sender, receiver, manifest, chunk=1000, name='got', tier='host', tamper=None):
    """Read every chunk of an export into the receiver's staging; store it."""
    staging = receiver.begin_import(manifest, name, tier)
    while not staging.complete:
        data = bytes(sender.exports.chunk(manifest.export_id, staging.received, chunk))
        if tamper is not None:
            data = tamper(staging.received, data)
        staging.add(staging.received, data)
    return receiver.finish_import(staging, name, tier, ORIGIN)


@pytest.mark.parametrize('tier', ['device', 'host', 'disk'])
def test_a_moved_capsule_restores_byte_identically_and_continues(make_runtime, tmp_path, tier):
    sender, receiver = _pair(make_runtime, tmp_path)
    sender.prefill(PROMPT)
    sender.snapshot('ctx', 'host')
    digest = sender.state_digest()
    expected = greedy(sender, 8)
    info = _move(sender, receiver, sender.export_capsule('ctx'), tier=tier)
    assert info.tier == tier and info.origin == ORIGIN and info.position == len(PROMPT)
    assert [i.name for i in receiver.list_capsules()] == ['got']
    receiver.restore('got')
    assert receiver.state_digest() == digest
    assert greedy(receiver, 8) == expected


def test_the_origin_is_kept_on_disk_and_in_forks(make_runtime, tmp_path):
    sender, receiver = _pair(make_runtime, tmp_path)
    sender.snapshot('ctx', 'device')
    _move(sender, receiver, sender.export_capsule('ctx'), tier='disk')
    reader = make_runtime(capsule_dir=str(tmp_path / 'receiver'))  # reads the file afresh
    assert {i.name: i.origin for i in reader.list_capsules()} == {'got': ORIGIN}
    assert receiver.verify_capsule('got').origin == ORIGIN
    assert receiver.fork('got', 'copy', 'host').origin == ORIGIN
    assert sender.list_capsules()[0].origin is None  # a capsule taken here has none


def test_an_export_serves_a_consistent_snapshot(make_runtime, tmp_path):
    sender, receiver = _pair(make_runtime, tmp_path)
    sender.prefill(PROMPT)
    sender.snapshot('ctx', 'host')
    digest = sender.state_digest()
    manifest = sender.export_capsule('ctx')
    sender.prefill(' and more')
    sender.snapshot('ctx', 'host')  # the name is replaced mid-transfer
    sender.delete_capsule('ctx')
    _move(sender, receiver, manifest)
    receiver.restore('got')
    assert receiver.state_digest() == digest


def test_a_foreign_model_or_layout_is_refused_before_any_bytes(make_runtime, tmp_path):
    sender, receiver = _pair(make_runtime, tmp_path, max_seq_len=256)
    sender.snapshot('ctx', 'host')
    manifest = sender.export_capsule('ctx')
    with pytest.raises(FingerprintMismatchError, match='nothing was transferred'):
        receiver.begin_import(manifest, 'got', 'host')
    other = make_runtime('builtin:tiny-lfm2', capsule_dir=str(tmp_path / 'lfm2'))
    with pytest.raises(FingerprintMismatchError, match='different model'):
        other.begin_import(manifest, 'got', 'host')
    assert receiver.list_capsules() == [] and other.list_capsules() == []


def test_a_corrupted_chunk_fails_the_checksum_and_nothing_is_stored(make_runtime, tmp_path):
    sender, receiver = _pair(make_runtime, tmp_path)
    sender.prefill(PROMPT)
    sender.snapshot('ctx', 'host')
    manifest = sender.export_capsule('ctx')
    last = manifest.total_bytes - 5

    def flip(offset, data):
        if offset <= last < offset + len(data):
            data = bytearray(data)
            data[last - offset] ^= 0x40
        return bytes(data)

    digest = receiver.state_digest()
    with pytest.raises(CorruptCapsuleError, match='failed its checksum'):
        _move(sender, receiver, manifest, tamper=flip)
    assert receiver.list_capsules() == [] and receiver.state_digest() == digest
    with pytest.raises(CapsuleNotFoundError):
        receiver.restore('got')


def test_bytes_that_are_not_the_announced_capsule_are_refused(make_runtime, tmp_path):
    sender, receiver = _pair(make_runtime, tmp_path)
    sender.snapshot('a', 'host')
    sender.prefill(PROMPT)
    sender.snapshot('b', 'host')
    a, b = sender.export_capsule('a'), sender.export_capsule('b')
    # b's bytes (a valid capsule of its own) under a's manifest, resized to fit
    lying = dataclasses.replace(a, export_id=b.export_id, total_bytes=b.total_bytes)
    with pytest.raises(CorruptCapsuleError, match='not the capsule its manifest announced'):
        _move(sender, receiver, lying)
    assert receiver.list_capsules() == []


def test_incomplete_or_out_of_order_chunks_are_refused(make_runtime, tmp_path):
    sender, receiver = _pair(make_runtime, tmp_path)
    sender.snapshot('ctx', 'host')
    manifest = sender.export_capsule('ctx')
    staging = receiver.begin_import(manifest, 'got', 'host')
    first = bytes(sender.exports.chunk(manifest.export_id, 0, 100))
    with pytest.raises(CorruptCapsuleError, match='does not continue'):
        staging.add(100, first)
    staging.add(0, first)
    with pytest.raises(CorruptCapsuleError, match='100 of'):
        receiver.finish_import(staging, 'got', 'host', ORIGIN)
    assert receiver.list_capsules() == []


def test_the_receivers_budget_is_checked_before_any_bytes(make_runtime, tmp_path):
    sender, receiver = _pair(make_runtime, tmp_path, host_budget_bytes=1000,
                             disk_budget_bytes=1000)
    sender.prefill(PROMPT)
    sender.snapshot('ctx', 'host')
    manifest = sender.export_capsule('ctx')
    for tier in ('host', 'disk'):
        with pytest.raises(BudgetExceededError, match=f'{tier} budget'):
            receiver.begin_import(manifest, 'got', tier)
    assert receiver.list_capsules() == []


def test_the_manifest_describes_the_capsule(make_runtime, tmp_path):
    sender, _ = _pair(make_runtime, tmp_path)
    sender.prefill(PROMPT)
    info = sender.snapshot('ctx', 'host')
    manifest = sender.export_capsule('ctx')
    head = json.loads(manifest.header_json)
    assert manifest.fingerprint == info.fingerprint == sender.fingerprint
    assert manifest.position == len(PROMPT) and manifest.state_bytes == info.nbytes
    assert head['manifest'] and manifest.total_bytes > info.nbytes
    assert manifest.checksum == sender.verify_capsule('ctx').checksum
    assert 'meta' not in head  # what was said stays out of the manifest


def test_a_conversation_travels_but_not_in_the_manifest(make_runtime, tmp_path):
    # The embedded default has a chat template: the prompt is the conversation's system turn.
    sender = make_runtime('default', capsule_dir=str(tmp_path / 'sender'))
    receiver = make_runtime('default', capsule_dir=str(tmp_path / 'receiver'))
    # A word no checksum, stamp or size in the header can spell by chance (digits can).
    secret = 'The door code is xylophone.'
    sender.prefill(secret)
    sender.snapshot('ctx', 'host')
    conversation = sender.conversation
    manifest = sender.export_capsule('ctx')
    assert 'xylophone' not in manifest.header_json
    _move(sender, receiver, manifest)
    receiver.restore('got')
    assert receiver.conversation == conversation and 'xylophone' in str(conversation)


def test_exports_expire_when_idle_and_are_bounded(local_dir):
    now = [0.0]
    exports = transfer.Exports(None, clock=lambda: now[0])

    with pytest.raises(CapsuleNotFoundError, match='not open here'):
        exports.chunk('nope', 0, 10)
    shared = local_dir / f'{transfer.LOCAL_PREFIX}{os.getpid()}-x'
    shared.write_bytes(b'abcdef')
    exports._open['x'] = [transfer.Manifest('x', 'n', 6, '', '{}', str(shared)),
                          memoryview(b'abcdef'), now[0], False]
    assert bytes(exports.chunk('x', 4, 10)) == b'ef'
    with pytest.raises(InvalidRequestError, match='outside export'):
        exports.chunk('x', 7, 1)
    with pytest.raises(InvalidRequestError, match='outside export'):
        exports.chunk('x', 0, transfer.MAX_CHUNK_BYTES + 1)
    now[0] += transfer.EXPORT_IDLE_S + 1
    assert len(exports) == 0 and not shared.exists()  # its shared copy went with it
    for i in range(transfer.MAX_EXPORTS):
        exports._open[str(i)] = [transfer.Manifest(str(i), 'n', 1, '', '{}'),
                                 memoryview(b'z'), now[0], False]
    with pytest.raises(InvalidRequestError, match='exports are open'):
        exports.add(object())  # refused before it is encoded
    exports.close('0')
    assert len(exports) == transfer.MAX_EXPORTS - 1
    # Manifests asked for and never read from free their slots sooner than read ones.
    exports.chunk('1', 0, 1)
    now[0] += transfer.UNREAD_IDLE_S + 1
    assert len(exports) == 1 and bytes(exports.chunk('1', 0, 1)) == b'z'
    now[0] += transfer.EXPORT_IDLE_S + 1
    assert len(exports) == 0


@pytest.fixture
def local_dir(tmp_path, monkeypatch):
    """Return a private stand-in for /dev/shm (a directory of this user's files)."""
    path = tmp_path / 'shm'
    path.mkdir()
    monkeypatch.setattr(transfer, 'LOCAL_DIR', path)
    return path


def test_a_local_export_is_read_from_shared_memory_and_verified(make_runtime, tmp_path,
                                                                local_dir):
    sender, receiver = _pair(make_runtime, tmp_path)
    sender.prefill(PROMPT)
    sender.snapshot('ctx', 'host')
    digest = sender.state_digest()
    manifest = sender.export_capsule('ctx', local=True)
    path = local_dir / f'{transfer.LOCAL_PREFIX}{os.getpid()}-{manifest.export_id}'
    assert manifest.local_path == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == bytes(sender.exports.chunk(manifest.export_id, 0,
                                                           manifest.total_bytes))
    staging = receiver.begin_import(manifest, 'got', 'host')
    seen = []
    assert staging.read_local(manifest.local_path, seen.append) is None
    assert staging.complete and seen[-1] == manifest.total_bytes
    receiver.finish_import(staging, 'got', 'host', ORIGIN)
    receiver.restore('got')
    assert receiver.state_digest() == digest
    sender.exports.close(manifest.export_id)
    assert not path.exists()  # the file goes with the export
    assert sender.export_capsule('ctx').local_path == ''  # not asked for: no file
    assert list(local_dir.iterdir()) == []


def test_a_malformed_manifest_is_refused_saying_what_is_wrong(make_runtime, tmp_path):
    sender, receiver = _pair(make_runtime, tmp_path, host_budget_bytes=0)  # unlimited
    sender.snapshot('ctx', 'host')
    good = sender.export_capsule('ctx')
    head = json.loads(good.header_json)
    lying = dict(head, packing=dict(head['packing'], nbytes=10 ** 12))
    cases = [
        ({'header_json': 'not json'}, 'not JSON'),
        ({'header_json': 'null'}, 'not a JSON object'),
        ({'header_json': '[1, 2]'}, 'not a JSON object'),
        ({'header_json': json.dumps({k: v for k, v in head.items() if k != 'packing'})},
         'no state size'),
        # A sender that says its state is huge: staging is bounded by this node's arena.
        ({'header_json': json.dumps(lying), 'total_bytes': 10 ** 12}, "this node's arena"),
    ]
    for change, words in cases:
        with pytest.raises(FlashRTError, match=words):
            receiver.begin_import(dataclasses.replace(good, **change), 'got', 'host')
    assert receiver.list_capsules() == []
    _move(sender, receiver, good)  # the real one still goes through
    assert [c.name for c in receiver.list_capsules()] == ['got']


def test_a_local_export_truncated_by_another_process_fails_alone(make_runtime, tmp_path,
                                                                 local_dir):
    # Any process of this user can truncate the shared file; serving it from a map would kill
    # the sender (SIGBUS) at its next chunk. Only this export fails, saying why.
    sender = make_runtime(capsule_dir=str(tmp_path / 'sender'))
    sender.prefill(PROMPT)
    sender.snapshot('ctx', 'host')
    digest = sender.state_digest()
    manifest = sender.export_capsule('ctx', local=True)
    whole = bytes(sender.exports.chunk(manifest.export_id, 0, manifest.total_bytes))
    os.truncate(manifest.local_path, 100)
    assert bytes(sender.exports.chunk(manifest.export_id, 0, 100)) == whole[:100]
    with pytest.raises(InvalidRequestError, match='changed by another process'):
        sender.exports.chunk(manifest.export_id, 64, 4096)
    again = sender.export_capsule('ctx')  # the runtime goes on serving
    served = sender.exports.chunk(again.export_id, 0, again.total_bytes)
    assert len(served) == again.total_bytes == len(whole)
    sender.prefill(' more')
    sender.restore('ctx')
    assert sender.state_digest() == digest


def test_a_tampered_local_export_fails_the_checksum(make_runtime, tmp_path, local_dir):
    sender, receiver = _pair(make_runtime, tmp_path)
    sender.prefill(PROMPT)
    sender.snapshot('ctx', 'host')
    manifest = sender.export_capsule('ctx', local=True)
    data = bytearray(open(manifest.local_path, 'rb').read())
    data[-7] ^= 0x10
    with open(manifest.local_path, 'r+b') as f:
        f.write(data)
    staging = receiver.begin_import(manifest, 'got', 'host')
    assert staging.read_local(manifest.local_path) is None
    with pytest.raises(CorruptCapsuleError, match='failed its checksum'):
        receiver.finish_import(staging, 'got', 'host', ORIGIN)
    assert receiver.list_capsules() == []


def test_a_local_path_that_is_not_an_export_is_not_read(make_runtime, tmp_path, local_dir):
    sender, receiver = _pair(make_runtime, tmp_path)
    sender.snapshot('ctx', 'host')
    manifest = sender.export_capsule('ctx', local=True)
    outside = tmp_path / 'model.safetensors'
    outside.write_bytes(b'x' * manifest.total_bytes)
    fifo = local_dir / f'{transfer.LOCAL_PREFIX}1-fifo'
    os.mkfifo(fifo)
    short = local_dir / f'{transfer.LOCAL_PREFIX}1-short'
    short.write_bytes(b'x')
    staging = receiver.begin_import(manifest, 'got', 'host')
    assert 'not a local export path' in staging.read_local(str(outside))
    assert 'not a file' in staging.read_local(str(fifo))  # and the open did not hang
    assert 'holds 1 bytes' in staging.read_local(str(short))
    assert 'cannot open' in staging.read_local(str(local_dir / f'{transfer.LOCAL_PREFIX}9-x'))
    assert staging.received == 0  # the chunks can still be read from the start


def test_local_exports_of_a_dead_process_are_swept(make_runtime, tmp_path, local_dir):
    gone = _dead_pid()
    stale = local_dir / f'{transfer.LOCAL_PREFIX}{gone}-abc'
    alive = local_dir / f'{transfer.LOCAL_PREFIX}{os.getpid()}-def'
    stale.write_bytes(b'old')
    alive.write_bytes(b'new')
    make_runtime(capsule_dir=str(tmp_path / 'c'))  # a new runtime sweeps at start
    assert not stale.exists() and alive.exists()


def _dead_pid():
    """Return the pid of a process that has exited (and been reaped)."""
    import subprocess
    proc = subprocess.Popen(['true'])
    proc.wait()
    return proc.pid
