"""Transfer fuzz: malformed manifests and chunks, a hostile shared file; nothing else gives way."""

import array
import dataclasses
import json
import os
import random
import threading
import time

from flashrt_ros.runtime import FlashRTError, Runtime, RuntimeConfig
from flashrt_ros.runtime.state import transfer
from flashrt_ros.runtime.state.capsule import Origin
import pytest
from reliability_harness import NODE_PARAMS, running_node, wait_restore_home
from test_soak import report

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


# What a hostile sender does to one import ('honest' serves the capsule as it is) and what
# the receiver's refusal says (any of).
FAULTS = {'honest': (), 'refuse': ('refused the export: no',), 'huge': ('announced as',),
          'null header': ('not a JSON object',), 'cut header': ('is not JSON',),
          'half announced': ('cannot be read',),
          'wrong checksum': ('not the capsule its manifest announced',),
          'drip': ('within transfer_deadline (2 s)',), 'stall': ('did not answer within',),
          'flip': ('garbled in transit', 'cannot be read', 'failed its checksum'),
          'short chunk': ('sent 4095 bytes',), 'long chunk': ('sent 4097 bytes',),
          'fail midway': ('stopped serving the export: gone',), 'empty chunk': ('sent 0 bytes',)}
RECEIVER = {'transfer_timeout': 1.0, 'transfer_deadline': 2.0, 'transfer_chunk_bytes': 4096,
            'transfer_shared_memory': False}


class HostileSender:
    """
    A node that serves ~/export_manifest and ~/export_chunk from a real capsule's bytes.

    It answers the receiver's real protocol over DDS, with the fault `self.fault` in the
    manifest or the chunks: malformed, lying, slow, silent or corrupt.
    """

    def __init__(self, manifest, data, wait_s):
        import rclpy
        from flashrt_ros.srv import ExportChunk, ExportManifest
        from rclpy.callback_groups import ReentrantCallbackGroup
        from rclpy.executors import MultiThreadedExecutor
        self.good, self.data, self.wait_s, self.fault = manifest, data, wait_s, 'honest'
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node('flashrt', namespace='/hostile', context=self.context)
        group = ReentrantCallbackGroup()
        self.node.create_service(ExportManifest, '~/export_manifest', self._manifest,
                                 callback_group=group)
        self.node.create_service(ExportChunk, '~/export_chunk', self._chunk,
                                 callback_group=group)
        self._executor = MultiThreadedExecutor(num_threads=16, context=self.context)
        self._executor.add_node(self.node)
        self._thread = threading.Thread(target=self._executor.spin, daemon=True)
        self._thread.start()

    def _manifest(self, request, response):
        good, fault = self.good, self.fault
        response.success, response.message = fault != 'refuse', 'no'
        response.export_id, response.checksum = 'hostile', good.checksum
        response.total_bytes, response.header_json = len(self.data), good.header_json
        response.fingerprint = good.fingerprint
        if fault == 'huge':
            response.total_bytes = 10 ** 12
        elif fault == 'null header':
            response.header_json = 'null'
        elif fault == 'cut header':
            response.header_json = good.header_json[:len(good.header_json) // 2]
        elif fault == 'half announced':
            response.total_bytes = len(self.data) // 2
        elif fault == 'wrong checksum':
            response.checksum = '0' * 64
        return response

    def _chunk(self, request, response):
        fault, start = self.fault, request.offset
        response.success = True
        if not request.length:
            return response
        data = bytearray(self.data[start:start + request.length])
        if fault == 'drip':
            time.sleep(self.wait_s / 2)  # each answer in time, the whole far too slow
        elif fault == 'stall' and start > 0:
            time.sleep(self.wait_s + 0.5)
        elif fault == 'flip' and start == 0:
            data[len(data) // 2] ^= 0x10
        elif fault == 'short chunk':
            data = data[:-1]
        elif fault == 'long chunk':
            data += b'\0'
        elif fault == 'fail midway' and start > 0:
            response.success, response.message = False, 'gone'
        elif fault == 'empty chunk' and start > 0:
            data = bytearray()
        response.data = array.array('B', bytes(data))
        return response

    def close(self):
        import rclpy
        self._executor.shutdown(timeout_sec=5.0)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)


def test_a_hostile_sender_over_dds_is_refused_and_changes_nothing(tmp_path):
    """The receiver's real import path against lying, dripping and silent senders."""
    sender = _runtime(tmp_path / 'sender')
    sender.prefill('A capsule a hostile sender will serve, in many small chunks.')
    sender.snapshot('ctx', 'host')
    expected = sender.state_digest()
    good = sender.export_capsule('ctx')
    data = bytes(sender.exports.chunk(good.export_id, 0, good.total_bytes))
    assert len(data) > 8 * RECEIVER['transfer_chunk_bytes'], 'too few chunks to drip'
    hostile = HostileSender(good, data, RECEIVER['transfer_timeout'])
    rng = random.Random(SEED)
    rounds = [f for f in FAULTS for _ in range(3)]
    rng.shuffle(rounds)
    tally = {}
    params = dict(NODE_PARAMS, **RECEIVER)
    try:
        with running_node(tmp_path / 'receiver', tmp_path / 'capsules', params) as (_, client):
            digest = wait_restore_home(client)
            listing = sorted(c.name for c in client.list_capsules().capsules)
            for i, fault in enumerate(rounds):
                hostile.fault = fault
                result = client.import_capsule('/hostile/flashrt', 'ctx', name=f'in{i}',
                                               tier='host', timeout=30.0)
                tally[fault, result.success] = tally.get((fault, result.success), 0) + 1
                assert result.success == (fault == 'honest'), (fault, result.message)
                assert client.state_digest() == digest, fault  # the live state, untouched
                if result.success:
                    assert client.restore(f'in{i}').success
                    assert client.state_digest() == expected  # the sender's bytes, exactly
                    assert client.delete_capsule(f'in{i}').success
                    digest = wait_restore_home(client)
                else:
                    assert 'internal error' not in result.message, result.message
                    assert any(why in result.message for why in FAULTS[fault]), result.message
                    assert 'nothing was' in result.message, result.message  # stored/transferred
                    assert 'delete it' not in result.message, result.message  # nothing to delete
                assert sorted(c.name for c in client.list_capsules().capsules) == listing
    finally:
        hostile.close()
    report('hostile_sender', rounds=len(rounds), tally={f'{f}:{ok}': n
                                                        for (f, ok), n in tally.items()})


if __name__ == '__main__':
    pytest.main([__file__])
