"""Transfer fuzz: malformed manifests and chunks, a hostile shared file; nothing else gives way."""

import dataclasses
import json
import os
import random

from flashrt_ros.runtime import FlashRTError, Runtime, RuntimeConfig
from flashrt_ros.runtime.state import transfer
from flashrt_ros.runtime.state.capsule import Origin
import pytest

ROUNDS = 400
SEED = 29
ORIGIN = Origin('/fuzz/flashrt', 'ctx', 1.0e9)


def _runtime(directory):
    rt = Runtime(RuntimeConfig(model='builtin:tiny-hybrid', max_seq_len=256,
                               capsule_dir=str(directory)))
    rt.warmup()
    return rt


def _header(rng, good):
    """Return a header JSON: the real one broken, or with one field changed."""
    head = json.loads(good)
    choice = rng.randrange(6)
    if choice == 0:
        return good[:rng.randrange(len(good))]  # cut short: not JSON
    if choice == 1:
        return rng.choice(['null', '[]', '7', '"x"', '{}', '{"packing": 3}'])
    key = rng.choice(sorted(head))
    head[key] = rng.choice([None, -1, 10 ** 15, 'x', [], {}, {'nbytes': 10 ** 12}])
    return json.dumps(head)


def _chunks(rng, data):
    """Yield the export's bytes in chunks, some short, long, flipped or out of order."""
    offset = 0
    while offset < len(data):
        size = rng.choice([1, 7, 1000, 65536])
        chunk = bytearray(data[offset:offset + size])
        fault = rng.randrange(12)
        if fault == 0 and chunk:
            chunk[rng.randrange(len(chunk))] ^= 1 << rng.randrange(8)
        elif fault == 1:
            chunk = chunk[:-1]
        elif fault == 2:
            chunk += b'\0'
        at = offset + (rng.choice([-1, 1]) if fault == 3 else 0)
        yield at, bytes(chunk)
        offset += size


def test_fuzzed_imports_refuse_cleanly_and_change_nothing(tmp_path):
    rng = random.Random(SEED)
    sender, receiver = _runtime(tmp_path / 'sender'), _runtime(tmp_path / 'receiver')
    sender.prefill('Fuzz the transfer path.')
    sender.snapshot('ctx', 'host')
    receiver.prefill('The receiver has a state of its own.')
    receiver.snapshot('mine', 'host')
    digest, listing = receiver.state_digest(), receiver.list_capsules()
    good = sender.export_capsule('ctx')
    data = bytes(sender.exports.chunk(good.export_id, 0, good.total_bytes))
    outcomes = {'refused': 0, 'stored': 0}
    for i in range(ROUNDS):
        manifest = good
        if rng.random() < 0.4:
            manifest = dataclasses.replace(
                good, header_json=_header(rng, good.header_json),
                total_bytes=rng.choice([good.total_bytes, 0, -5, 1, 10 ** 12]))
        name = f'got{i}'
        try:
            staging = receiver.begin_import(manifest, name, 'host')
            for at, chunk in _chunks(rng, data[:manifest.total_bytes]):
                staging.add(at, chunk)
            receiver.finish_import(staging, name, 'host', ORIGIN)
        except FlashRTError as exc:
            assert str(exc) and 'internal error' not in str(exc)
            outcomes['refused'] += 1
        else:  # only the untouched capsule is ever stored
            outcomes['stored'] += 1
            receiver.restore(name)
            assert receiver.state_digest() == sender.state_digest()
            receiver.delete_capsule(name)
            receiver.restore('mine')
        assert receiver.state_digest() == digest
    assert outcomes['refused'] > ROUNDS // 2 and outcomes['stored'] > 0, outcomes
    assert [i.name for i in receiver.list_capsules()] == [i.name for i in listing]


def test_a_hostile_shared_file_is_refused_or_read_whole(tmp_path, monkeypatch):
    local = tmp_path / 'shm'
    local.mkdir()
    monkeypatch.setattr(transfer, 'LOCAL_DIR', local)
    sender, receiver = _runtime(tmp_path / 'sender'), _runtime(tmp_path / 'receiver')
    sender.prefill('A shared file to tamper with.')
    sender.snapshot('ctx', 'host')
    receiver.prefill('The receiver has a state of its own.')
    receiver.snapshot('mine', 'host')
    digest, expected = receiver.state_digest(), sender.state_digest()
    rng = random.Random(SEED)
    stored = 0
    for i in range(40):
        manifest = sender.export_capsule('ctx', local=True)
        path = manifest.local_path
        action = i % 4
        if action == 0:
            os.truncate(path, rng.randrange(manifest.total_bytes))
        elif action == 1:
            with open(path, 'r+b') as f:
                f.seek(rng.randrange(manifest.total_bytes))
                f.write(b'\xff')
        elif action == 2:
            os.unlink(path)
            os.symlink('/etc/hostname', path)
        staging = receiver.begin_import(manifest, f'shared{i}', 'host')
        why = staging.read_local(path)
        try:
            if why is not None:  # refused: the chunks come over the protocol instead
                while not staging.complete:
                    staging.add(staging.received, bytes(sender.exports.chunk(
                        manifest.export_id, staging.received, 65536)))
            receiver.finish_import(staging, f'shared{i}', 'host', ORIGIN)
        except FlashRTError as exc:  # a flipped byte (the checksum) or a cut file (a short read)
            assert action in (0, 1) and 'internal error' not in str(exc), exc
            assert receiver.state_digest() == digest
            continue
        finally:
            sender.exports.close(manifest.export_id)
        assert action in (2, 3), 'a changed file was stored'  # relinked, or untouched
        assert receiver.state_digest() == digest  # storing touches no live state
        receiver.restore(f'shared{i}')
        assert receiver.state_digest() == expected  # the sender's state, byte for byte
        receiver.delete_capsule(f'shared{i}')
        receiver.restore('mine')
        stored += 1
    assert stored >= 20 and receiver.state_digest() == digest
    assert [c.name for c in receiver.list_capsules()] == ['mine']


if __name__ == '__main__':
    pytest.main([__file__])
