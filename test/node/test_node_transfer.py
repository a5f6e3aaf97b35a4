"""Capsules between node processes in different namespaces over real DDS (~/import_capsule)."""

import array
import contextlib
import glob
import os
import signal
import threading
import time

from action_msgs.msg import GoalStatus
from flashrt_ros.node import transfer
from flashrt_ros.node.transfer import _Answers, _check_export_allowed, CapsuleTransfer
from flashrt_ros.node_process import NodeProcess
from flashrt_ros.runtime.errors import InvalidRequestError
from flashrt_ros.runtime.state.capsule import CapsuleInfo
from flashrt_ros.runtime.state.transfer import DEFAULT_CHUNK_BYTES
from flashrt_ros.srv import ExportManifest
from node_harness import EventLog, HOME, set_parameter, wait_active, wait_until
import pytest

MODEL = {
    'model': 'builtin:bench-hybrid',  # a capsule of a few MiB at a few hundred tokens
    'max_seq_len': 1024,
    'max_new_tokens': 16,
    'system_prompt': 'Robot.',
    'interrupt_timeout': 5.0,
    'transfer_timeout': 3.0,
}
LEFT, RIGHT = '/left_arm/flashrt', '/right_arm/flashrt'
# Room for the home capsule and one imported capsule of the test's size, not two.
RIGHT_PARAMS = dict(MODEL, host_budget_bytes=4 << 20, disk_budget_bytes=1 << 20)
CONTEXT = [(7 * i + 3) % 250 for i in range(700)]  # ~2.7 MiB of state on bench-hybrid


def _start(tmp_path_factory, fqn, params, capsule_dir=None):
    namespace, name = fqn.rsplit('/', 1)
    workdir = str(tmp_path_factory.mktemp(namespace.strip('/') or name))
    params = dict(params, capsule_dir=capsule_dir or os.path.join(workdir, 'capsules'))
    return NodeProcess(workdir, params, name=name, extra_args=['-r', f'__ns:={namespace}'])


def _client(fqn, proc):
    namespace, name = fqn.rsplit('/', 1)
    from flashrt_ros.client import FlashRTClient
    client = FlashRTClient(name, namespace=namespace, timeout=20.0)
    wait_active(client, proc, timeout=180.0)
    return client


@pytest.fixture(scope='module')
def nodes(tmp_path_factory):
    """Start the sender (left) and receiver (right) processes; yield their clients."""
    procs = {LEFT: _start(tmp_path_factory, LEFT, MODEL),
             RIGHT: _start(tmp_path_factory, RIGHT, RIGHT_PARAMS)}
    clients = {}
    try:
        for fqn, proc in procs.items():
            clients[fqn] = _client(fqn, proc)
        yield clients, procs
    finally:
        for c in clients.values():
            c.close()
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope='module')
def context(nodes):
    """Prefill CONTEXT on the left node and snapshot it as 'ctx'; return what follows it."""
    clients, _ = nodes
    left = clients[LEFT]
    assert left.restore(HOME).success
    assert left.generate(token_ids=CONTEXT, max_new_tokens=1, timeout=120.0).result.success
    response = left.snapshot('ctx', tier='host')
    assert response.success, response.message
    digest = left.state_digest()
    continued = left.generate(max_new_tokens=12, timeout=120.0).result
    assert continued.success, continued.message
    return {'digest': digest, 'tokens': list(continued.token_ids),
            'size': response.capsule.size_bytes}


@contextlib.contextmanager
def _dds_chunks(client):
    """Make the client's node read imports as DDS chunks (not the same-host shared memory)."""
    assert set_parameter(client, 'transfer_shared_memory', False).successful
    try:
        yield
    finally:
        assert set_parameter(client, 'transfer_shared_memory', True).successful


def _listing(client):
    response = client.list_capsules()
    assert response.success, response.message
    return {c.name: (c.tier, c.size_bytes, c.checksum, c.position) for c in response.capsules}


@pytest.mark.parametrize('via', ['shared memory', 'DDS chunks'])
def test_capsule_moves_and_continues_token_identically(nodes, context, via):
    clients, _ = nodes
    right = clients[RIGHT]
    assert context['size'] > 2 << 20
    if via == 'shared memory' and not os.access('/dev/shm', os.W_OK):
        pytest.skip('no writable /dev/shm on this machine: imports read DDS chunks')
    events = EventLog(right)
    try:
        with contextlib.nullcontext() if via == 'shared memory' else _dds_chunks(right):
            run = right.start_import(LEFT, 'ctx', name='from_left', tier='host')
            assert run.accepted
            status, result = run.result(120.0)
        assert status == GoalStatus.STATUS_SUCCEEDED and result.success, result.message
        assert f'via {via},' in result.message, result.message
        shared = f'/dev/shm/flashrt-export-{nodes[1][LEFT].pid}-*'
        assert wait_until(lambda: not glob.glob(shared)), 'the export was not closed'
        assert result.transferred_bytes > context['size'] and result.throughput_mib_s > 0
        assert run.feedback and run.feedback[-1].bytes_received == result.transferred_bytes
        assert [f.bytes_received for f in run.feedback] == sorted(
            f.bytes_received for f in run.feedback)
        event = events.wait_for(lambda e: e.operation == 'import' and e.name == 'from_left')
        assert event is not None and event.success
        assert event.size_bytes == result.transferred_bytes and event.latency_ms > 0
        assert 'MiB/s' in event.message
    finally:
        events.close()
    listed = {c.name: c for c in right.list_capsules().capsules}['from_left']
    assert (listed.origin_node, listed.origin_name) == (LEFT, 'ctx')
    assert abs(listed.imported.sec - time.time()) < 120 and listed.tier == 'host'
    assert right.restore('from_left').success
    assert right.state_digest() == context['digest']
    continued = right.generate(max_new_tokens=12, timeout=120.0).result
    assert list(continued.token_ids) == context['tokens']
    # a copy keeps its provenance
    fork = right.fork('from_left', 'from_left_copy', tier='device')
    assert fork.success and fork.capsule.origin_node == LEFT, fork.message
    assert right.delete_capsule('from_left').success
    assert right.delete_capsule('from_left_copy').success


def test_foreign_model_refused_before_any_bytes(nodes, tmp_path_factory):
    clients, _ = nodes
    right = clients[RIGHT]
    proc = _start(tmp_path_factory, '/foreign/flashrt',
                  {'model': 'builtin:tiny-hybrid', 'max_seq_len': 256})
    foreign = None
    try:
        foreign = _client('/foreign/flashrt', proc)
        assert foreign.snapshot('theirs', tier='host').success
        before = _listing(right)
        run = right.start_import('/foreign/flashrt', 'theirs')
        status, result = run.result(60.0)
        assert status == GoalStatus.STATUS_ABORTED and not result.success
        assert 'different model' in result.message and 'nothing was transferred' in \
            result.message, result.message
        assert run.feedback == []  # no chunk was read
        assert _listing(right) == before
    finally:
        if foreign is not None:
            foreign.close()
        proc.stop()


class _Tamperer:
    """
    A sender that relays the left node's export but flips one byte of the last chunk.

    It serves the same two services under its own node name, so the receiver runs its real
    receive path against bytes that went bad in transit. short=True: it drops the last 3
    bytes of the first chunk instead; delay: it waits that long before each chunk (and
    changes nothing); flip=False: it changes nothing either.
    """

    def __init__(self, short=False, delay=0.0, flip=True):
        self.short, self.delay = short, delay
        self.flip = flip and not (short or delay)
        self.manifests = 0  # manifest requests that reached the relay
        self.export_ids = []  # of the manifest answers it had from the left node
        self.lose_next = ''  # 'request': never forward the next one; 'answer': never return it
        import rclpy
        from flashrt_ros.srv import ExportChunk, ExportManifest
        from rclpy.callback_groups import ReentrantCallbackGroup
        from rclpy.executors import MultiThreadedExecutor
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node('flashrt', namespace='/tamper', context=self.context)
        group = ReentrantCallbackGroup()
        self._manifest = self.node.create_client(ExportManifest, f'{LEFT}/export_manifest',
                                                 callback_group=group)
        self._chunk = self.node.create_client(ExportChunk, f'{LEFT}/export_chunk',
                                              callback_group=group)
        self.node.create_service(ExportManifest, '~/export_manifest', self._relay_manifest,
                                 callback_group=group)
        self.node.create_service(ExportChunk, '~/export_chunk', self._relay_chunk,
                                 callback_group=group)
        self.total = 0
        self.flipped = 0
        self._closed = threading.Event()  # ends a delay early
        # A relayed call holds its thread until the forward's answer, which needs another:
        # more threads than the receiver's chunk requests in flight.
        self._executor = MultiThreadedExecutor(num_threads=12, context=self.context)
        self._executor.add_node(self.node)
        self._thread = threading.Thread(target=self._executor.spin, daemon=True)
        self._thread.start()
        # Discovery of the left node by this new participant must not eat into the
        # receiver's transfer_timeout on a loaded machine.
        for client in (self._manifest, self._chunk):
            assert client.wait_for_service(timeout_sec=30.0), client.srv_name

    def warm(self, receiver):
        """
        Import, by `receiver` through this relay, a capsule LEFT lacks until its refusal comes.

        The receiver's first request can reach the relay before the relay has discovered the
        receiver's reply reader (the node has many endpoints, the relay few), and the reply
        is then dropped ("failed to send response"): the test's import waited out its
        transfer_timeout. Once one reply came back the path is matched both ways.
        """
        assert set_parameter(receiver, 'transfer_timeout', 1.0).successful
        try:
            for _ in range(20):
                result = receiver.import_capsule('/tamper/flashrt', 'absent', name='warm')
                if 'refused the export' in result.message:
                    return
            raise AssertionError(f'the relay never answered: {result.message}')
        finally:
            timeout = MODEL['transfer_timeout']
            assert set_parameter(receiver, 'transfer_timeout', timeout).successful

    def _forward(self, client, request):
        assert client.wait_for_service(timeout_sec=10.0)
        done = threading.Event()
        future = client.call_async(request)
        future.add_done_callback(lambda _: done.set())
        assert done.wait(10.0)
        return future.result()

    def _relay_manifest(self, request, response):
        self.manifests += 1
        lose, self.lose_next = self.lose_next, ''
        if lose != 'request':
            answer = self._forward(self._manifest, request)
            self.export_ids.append(answer.export_id)
            self.total = answer.total_bytes
        if lose:
            self._closed.wait()  # this call's answer never leaves
            return response
        return answer

    def _relay_chunk(self, request, response):
        if self._closed.wait(self.delay):
            return response  # closing: the receiver gave up on this chunk
        answer = self._forward(self._chunk, request)
        end = request.offset + len(answer.data)
        if self.short and answer.success and request.offset == 0:
            answer.data = array.array('B', answer.data)[:-3]
            self.flipped += 1
        elif answer.success and len(answer.data) and end == self.total and self.flip:
            data = array.array('B', answer.data)
            data[-10] ^= 0x01  # one bit of the state bytes, near the end
            answer.data = data
            self.flipped += 1
        return answer

    def close(self):
        import rclpy
        self._closed.set()
        self._executor.shutdown(timeout_sec=2.0)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)


def _import_through(tamperer, right, name):
    """
    Import LEFT's 'ctx' as `name` through the relay over DDS chunks; close the relay.

    Each relayed call is two DDS round trips; they get more than the 3 s the killed-sender
    test relies on. The relay changes chunks, not the sender's shared copy.
    """
    assert set_parameter(right, 'transfer_timeout', 15.0).successful
    try:
        with _dds_chunks(right):
            return right.import_capsule('/tamper/flashrt', 'ctx', name=name, tier='host')
    finally:
        set_parameter(right, 'transfer_timeout', MODEL['transfer_timeout'])
        tamperer.close()


def test_corrupted_chunk_refused_at_the_checksum(nodes, context):
    clients, _ = nodes
    right = clients[RIGHT]
    assert right.restore(HOME).success
    digest, before = right.state_digest(), _listing(right)
    tamperer = _Tamperer()
    tamperer.warm(right)
    result = _import_through(tamperer, right, 'tampered')
    assert tamperer.flipped == 1, result.message
    assert not result.success and 'failed its checksum' in result.message, result.message
    assert 'nothing was stored' in result.message
    assert _listing(right) == before and right.state_digest() == digest
    assert not right.restore('tampered').success


def test_a_chunk_of_the_wrong_length_is_refused_saying_so(nodes, context):
    clients, _ = nodes
    right = clients[RIGHT]
    assert right.restore(HOME).success
    digest, before = right.state_digest(), _listing(right)
    tamperer = _Tamperer(short=True)  # (the receiver's closing call relays offset 0 too)
    tamperer.warm(right)
    result = _import_through(tamperer, right, 'short')
    assert tamperer.flipped >= 1, result.message
    assert not result.success and 'internal error' not in result.message, result.message
    chunk = DEFAULT_CHUNK_BYTES  # the receiver's transfer_chunk_bytes
    assert f'sent {chunk - 3} bytes for the chunk of {chunk} bytes at offset 0' in result.message
    assert _listing(right) == before and right.state_digest() == digest


@pytest.mark.parametrize('lost', ['request', 'answer'])
def test_a_manifest_request_without_answer_is_sent_again(nodes, context, lost):
    clients, _ = nodes
    right = clients[RIGHT]
    tamperer = _Tamperer(flip=False)
    tamperer.warm(right)
    tamperer.manifests, tamperer.export_ids, tamperer.lose_next = 0, [], lost
    result = _import_through(tamperer, right, 'again')
    assert result.success, result.message
    assert tamperer.manifests == 2  # the first one unanswered, sent again after a second
    # The sender answered the repeat with the export it opened for the lost answer.
    assert len(tamperer.export_ids) == {'request': 1, 'answer': 2}[lost]
    assert len(set(tamperer.export_ids)) == 1
    assert right.delete_capsule('again').success


def _manifest_request(request_id='r1'):
    return ExportManifest.Request(name='ctx', host_id='host', request_id=request_id)


def _answer(answers, compute, request_id='r1'):
    return answers.answer(_manifest_request(request_id), ExportManifest.Response(), compute)


def test_a_repeat_gets_the_answer_of_its_first_request():
    answers, computed = _Answers(), []
    started, release = threading.Event(), threading.Event()

    def compute(request, response):
        computed.append(request.request_id)
        started.set()
        assert release.wait(10.0)
        response.success, response.export_id = True, f'export{len(computed)}'
        return response

    out = {}
    first = threading.Thread(target=lambda: out.update(first=_answer(answers, compute)))
    first.start()
    assert started.wait(10.0)
    repeat = threading.Thread(target=lambda: out.update(repeat=_answer(answers, compute)))
    repeat.start()
    assert wait_until(lambda: answers._answers[('r1', 'ctx', 'host')].waiting)
    third = _answer(answers, compute)  # one repeat waits at a time: a thread each
    assert not third.success and 'already waited for' in third.message, third.message
    release.set()
    first.join(10.0)
    repeat.join(10.0)
    assert out['first'].export_id == 'export1' and out['repeat'] is out['first']
    assert _answer(answers, compute) is out['first']  # answered: a late repeat at once
    assert computed == ['r1']
    assert _answer(answers, compute, 'r2').export_id == 'export2'  # another request
    assert answers.answer(ExportManifest.Request(name='ctx'), ExportManifest.Response(),
                          compute).export_id == 'export3'  # no request_id: never kept
    assert answers.answer(ExportManifest.Request(name='ctx'), ExportManifest.Response(),
                          compute).export_id == 'export4'


def test_a_repeat_of_a_failed_request_fails_and_old_answers_go():
    answers = _Answers(size=2)

    def fail(request, response):
        raise RuntimeError('the export failed')

    with pytest.raises(RuntimeError):
        _answer(answers, fail)
    again = _answer(answers, fail)
    assert not again.success and 'failed' in again.message, again.message
    computed = []

    def compute(request, response):
        computed.append(request.request_id)
        response.success = True
        return response

    for request_id in ('a', 'b', 'c', 'a'):  # two kept: 'a' went when 'c' came
        assert _answer(answers, compute, request_id).success
    assert computed == ['a', 'b', 'c', 'a']


def test_a_close_left_unanswered_is_dropped_from_its_client(monkeypatch):
    import rclpy
    from rclpy.signals import SignalHandlerOptions
    context = rclpy.Context()
    rclpy.init(context=context, signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node('closer', context=context)
    try:
        sender = CapsuleTransfer(node)
        monkeypatch.setattr(transfer, 'CLOSE_ANSWER_S', 0.0)
        _, chunk = sender._clients_of('/nobody/flashrt')  # no such node: no answer ever
        sender._close_export('/nobody/flashrt', 'e1')
        assert len(chunk._pending_requests) == 1
        sender._close_export('/nobody/flashrt', 'e2')  # e1 given up, e2 waits
        assert len(chunk._pending_requests) == 1
    finally:
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def test_a_dripping_sender_is_given_up_at_the_deadline(nodes, context):
    clients, _ = nodes
    right = clients[RIGHT]
    assert right.restore(HOME).success
    digest, before = right.state_digest(), _listing(right)
    tamperer = _Tamperer(delay=30.0)  # each chunk well inside transfer_timeout
    tamperer.warm(right)
    assert set_parameter(right, 'transfer_deadline', 0.5).successful
    assert set_parameter(right, 'transfer_timeout', 60.0).successful
    t0 = time.monotonic()
    try:
        with _dds_chunks(right):
            result = right.import_capsule('/tamper/flashrt', 'ctx', name='drip', tier='host')
    finally:
        set_parameter(right, 'transfer_deadline', 120.0)
        set_parameter(right, 'transfer_timeout', MODEL['transfer_timeout'])
        tamperer.close()
    if result.success:  # leave no capsule behind for the tests after this one
        right.delete_capsule('drip')
    assert not result.success and 'transfer_deadline (0.5 s)' in result.message, result.message
    assert time.monotonic() - t0 < 15.0  # given up at the deadline, not when a chunk came
    assert _listing(right) == before and right.state_digest() == digest


def test_a_sender_under_the_rate_floor_is_given_up_after_the_grace(nodes, context):
    clients, _ = nodes
    right = clients[RIGHT]
    assert right.restore(HOME).success
    digest, before = right.state_digest(), _listing(right)
    # 4 KiB chunks, four in flight, each held 0.5 s: at most 32 KiB/s, under the 64 KiB/s
    # floor, with the deadline far away.
    tamperer = _Tamperer(delay=0.5)
    tamperer.warm(right)
    for name, value in (('transfer_chunk_bytes', 4096), ('transfer_timeout', 15.0)):
        assert set_parameter(right, name, value).successful
    t0 = time.monotonic()
    try:
        with _dds_chunks(right):
            result = right.import_capsule('/tamper/flashrt', 'ctx', name='slow', tier='host')
    finally:
        set_parameter(right, 'transfer_chunk_bytes', DEFAULT_CHUNK_BYTES)
        set_parameter(right, 'transfer_timeout', MODEL['transfer_timeout'])
        tamperer.close()
    if result.success:
        right.delete_capsule('slow')
    assert not result.success and 'under the floor of 64 KiB/s' in result.message, result.message
    assert time.monotonic() - t0 < 60.0  # given up after the 5 s grace, not at the deadline
    assert _listing(right) == before and right.state_digest() == digest


def test_sender_killed_mid_transfer_leaves_receiver_unchanged(nodes, tmp_path_factory):
    clients, _ = nodes
    right = clients[RIGHT]
    proc = _start(tmp_path_factory, '/victim/flashrt', MODEL)
    victim = None
    try:
        victim = _client('/victim/flashrt', proc)
        assert victim.generate(token_ids=CONTEXT, max_new_tokens=1, timeout=120.0).result.success
        assert victim.snapshot('ctx', tier='host').success
        assert set_parameter(right, 'transfer_chunk_bytes', 4096).successful
        assert right.restore(HOME).success
        digest, before = right.state_digest(), _listing(right)
        started = threading.Event()
        with _dds_chunks(right):  # a shared-memory read is over before the kill lands
            run = right.start_import('/victim/flashrt', 'ctx', name='half', tier='host',
                                     feedback_callback=lambda fb: started.set())
            assert started.wait(60.0)
            os.kill(proc.pid, signal.SIGKILL)
            status, result = run.result(60.0)
        assert status == GoalStatus.STATUS_ABORTED and not result.success
        assert 'did not answer' in result.message and 'nothing was stored' in result.message
    finally:
        set_parameter(right, 'transfer_chunk_bytes', 256 << 10)
        if victim is not None:
            victim.close()
        proc.stop()
    assert _listing(right) == before and right.state_digest() == digest
    assert not right.restore('half').success
    assert right.generate('Still here.', max_new_tokens=3).result.success  # and serving


def test_cancel_leaves_nothing(nodes, context):
    clients, _ = nodes
    right = clients[RIGHT]
    assert set_parameter(right, 'transfer_chunk_bytes', 4096).successful
    try:
        before = _listing(right)
        started = threading.Event()
        with _dds_chunks(right):
            run = right.start_import(LEFT, 'ctx', name='cancelled', tier='host',
                                     feedback_callback=lambda fb: started.set())
            assert started.wait(60.0)
            run.cancel()
            status, result = run.result(60.0)
        assert status == GoalStatus.STATUS_CANCELED and not result.success
        assert 'nothing was stored' in result.message
        assert _listing(right) == before
    finally:
        set_parameter(right, 'transfer_chunk_bytes', 256 << 10)


def test_receiver_budgets_are_honoured(nodes, context):
    clients, _ = nodes
    right = clients[RIGHT]
    before = _listing(right)
    run = right.start_import(LEFT, 'ctx', name='too_big', tier='disk')  # disk budget 1 MiB
    status, result = run.result(60.0)
    assert not result.success and 'disk budget' in result.message, result.message
    assert run.feedback == []  # refused before any bytes moved
    assert _listing(right) == before
    # the host tier has room for one more capsule of this size, not two
    first = right.import_capsule(LEFT, 'ctx', name='one', tier='host')
    assert first.success, first.message
    second = right.import_capsule(LEFT, 'ctx', name='two', tier='host')
    assert not second.success and 'host tier is full' in second.message, second.message
    assert set(_listing(right)) == set(before) | {'one'}
    assert right.delete_capsule('one').success


def test_import_while_generating_keeps_the_turn_intact(nodes, context):
    clients, _ = nodes
    right = clients[RIGHT]
    assert right.restore(HOME).success
    reference = right.generate('Count on.', max_new_tokens=40, timeout=120.0).result
    assert right.restore(HOME).success
    run = right.start_generate('Count on.', max_new_tokens=40)
    imported = right.import_capsule(LEFT, 'ctx', name='during_turn', tier='host')
    outcome = run.result(120.0)
    assert imported.success, imported.message
    assert list(outcome.result.token_ids) == list(reference.token_ids)
    assert right.delete_capsule('during_turn').success


def test_a_pinned_capsule_is_not_exported_by_default(nodes, context):
    clients, _ = nodes
    right = clients[RIGHT]
    before = _listing(right)
    result = right.import_capsule(LEFT, HOME, name='their_home', tier='host')
    assert not result.success and 'export_allowed: unpinned' in result.message, result.message
    assert 'pinned' in result.message and _listing(right) == before
    left = clients[LEFT]
    assert not set_parameter(left, 'export_allowed', 'all').successful  # read-only


@pytest.mark.parametrize('policy, pinned, allowed', [
    ('unpinned', False, True), ('unpinned', True, False), ('all', False, True),
    ('all', True, True), ('none', False, False), ('none', True, False)])
def test_export_allowed_lets_out_what_it_names(policy, pinned, allowed):
    info = CapsuleInfo('c', 'host', 1, 0, 0.0, '', 'fp', ('kv',), pinned=pinned)
    if allowed:
        _check_export_allowed(policy, info)
    else:
        with pytest.raises(InvalidRequestError, match=f'export_allowed: {policy}'):
            _check_export_allowed(policy, info)


def test_import_refused_onto_the_home_capsule(nodes, context):
    clients, _ = nodes
    right = clients[RIGHT]
    result = right.import_capsule(LEFT, 'ctx', name=HOME)
    assert not result.success and 'home capsule' in result.message, result.message


@pytest.mark.parametrize('source', ['/bad name!/flashrt', '/left//flashrt', '/9lives/x'])
def test_a_source_node_that_is_no_node_name_is_refused_saying_so(nodes, source):
    clients, _ = nodes
    result = clients[RIGHT].import_capsule(source, 'ctx', name='nowhere')
    assert not result.success and 'internal error' not in result.message, result.message
    assert 'source_node' in result.message and 'nothing was stored' in result.message


def test_a_source_no_node_serves_is_given_up_at_the_first_limit(nodes):
    """The wait for the source's services ends at transfer_timeout or the deadline."""
    clients, _ = nodes
    right = clients[RIGHT]
    before = _listing(right)
    try:
        assert set_parameter(right, 'transfer_timeout', 1.0).successful
        result = right.import_capsule('/absent/flashrt', 'ctx', name='absent')
        assert not result.success and 'no node /absent/flashrt serves' in result.message, (
            result.message)
        assert set_parameter(right, 'transfer_timeout', 60.0).successful
        assert set_parameter(right, 'transfer_deadline', 1.0).successful
        t0 = time.monotonic()
        result = right.import_capsule('/absent/flashrt', 'ctx', name='absent')
        assert time.monotonic() - t0 < 15.0  # the deadline, not transfer_timeout
        assert not result.success and 'transfer_deadline (1 s): no manifest' in result.message, (
            result.message)
    finally:
        set_parameter(right, 'transfer_deadline', 120.0)
        set_parameter(right, 'transfer_timeout', MODEL['transfer_timeout'])
    assert _listing(right) == before
