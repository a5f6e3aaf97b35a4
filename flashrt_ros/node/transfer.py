"""
Capsules between nodes: the export services and the import action.

~/export_manifest and ~/export_chunk serve this node's capsules, the ~/import_capsule
action pulls one from another node (the protocol, which needs no ROS, is
runtime/state/transfer.py).

Concurrency: everything here runs in a reentrant callback group of its own, never in the
node's `ordered` or `state` groups, so a transfer never delays ~/interrupt, ~/reset or a
snapshot. An import only stores a capsule, as ~/fork does: the live state is not touched,
so it may run while the node generates; using the capsule is an ordinary ~/restore, which
waits for a turn boundary like any other. One import runs at a time (another goal is
rejected until it ends); exports are served concurrently.
"""

import array
import collections
import threading
import time
import uuid

from flashrt_ros.action import ImportCapsule
from flashrt_ros.qos import FEEDBACK_QOS
from flashrt_ros.runtime import FlashRTError, InvalidRequestError
from flashrt_ros.runtime.state.capsule import Origin
from flashrt_ros.runtime.state.transfer import host_id, Manifest
from flashrt_ros.srv import ExportChunk, ExportManifest
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup

from . import messages

# Chunk requests in flight at once: the next chunk is on its way while one is copied in.
WINDOW = 4
# A source slower than this after the grace period is given up on: a sender that drips
# chunks just inside transfer_timeout must not hold the import slot and its staging memory.
MIN_RATE_BYTES_S = 64 << 10
RATE_GRACE_S = 5.0
MAX_SOURCES = 16  # cached clients of source nodes; the oldest go beyond this
CLOSE_ANSWER_S = 10.0  # a close of an export left unanswered this long is dropped
# The receiver sends its manifest request once more, with the same request_id, when no
# answer came within this: a node that has not yet discovered the receiver's reply reader
# drops its answer (rmw_fastrtps waits 100 ms for the match), as a freshly started sender
# can. The sender answers the repeat with the export it opened for the first (_Answers).
MANIFEST_RESEND_S = 1.0
ANSWERS_KEPT = 32  # manifest answers a sender keeps by request_id
# A repeat waits this long at most for the first request's answer (the longest
# transfer_timeout); one repeat per request waits, holding a thread of the node's executor.
ANSWER_WAIT_S = 600.0


class TransferFailed(Exception):
    """An import step failed; the message says why and what to do."""


class CapsuleTransfer:
    """Export services and the import action of one FlashRTNode."""

    def __init__(self, node):
        self._node = node
        self._group = ReentrantCallbackGroup()
        self._clients = collections.OrderedDict()  # source node -> (manifest, chunk) clients
        self._clients_lock = threading.Lock()
        self._closing = collections.deque()  # (sent at, client, future) of export closes
        self._importing = threading.Lock()  # held from goal acceptance to its result
        self._answers = _Answers()
        self._host = host_id()
        node.create_service(ExportManifest, '~/export_manifest', self._manifest_callback,
                            callback_group=self._group)
        node.create_service(ExportChunk, '~/export_chunk', self._chunk_callback,
                            callback_group=self._group)
        self._server = ActionServer(
            node, ImportCapsule, '~/import_capsule', self._execute_callback,
            callback_group=self._group, goal_callback=self._goal_callback,
            cancel_callback=lambda goal_handle: CancelResponse.ACCEPT,
            feedback_pub_qos_profile=FEEDBACK_QOS)

    def _runtime(self, response):
        """Return the active node's runtime, or None with the reason in response."""
        session = self._node.session
        if session is None or not session.active:
            response.success, response.message = False, self._node.not_active_message()
            return None
        return session.runtime

    # ---- the sender --------------------------------------------------------------------

    def _manifest_callback(self, request, response):
        return self._answers.answer(request, response, self._open_export)

    def _open_export(self, request, response):
        rt = self._runtime(response)
        if rt is None:
            return response
        t0 = time.perf_counter()
        local = bool(request.host_id) and request.host_id == self._host
        try:
            info = rt.store.peek(request.name).info()
            _check_export_allowed(self._node.get_parameter('export_allowed').value, info)
            m = rt.export_capsule(request.name, local=local)
        except FlashRTError as exc:
            response.success, response.message = False, str(exc)
            self._node.get_logger().warning(f'export {request.name!r} refused: {exc}')
            return response
        response.export_id, response.total_bytes = m.export_id, m.total_bytes
        response.checksum, response.header_json = m.checksum, m.header_json
        response.fingerprint, response.local_path = m.fingerprint, m.local_path
        messages.info_msg(info, response.capsule)
        response.success = True
        response.message = (f'export {m.export_id} of {m.name!r}: {m.total_bytes} bytes, '
                            f'position {m.position}')
        self._node.outputs.event('export', m.name, info.tier, m.total_bytes,
                                 (time.perf_counter() - t0) * 1e3, True, response.message)
        return response

    def _chunk_callback(self, request, response):
        rt = self._runtime(response)
        if rt is None:
            return response
        try:
            if request.length:
                data = rt.exports.chunk(request.export_id, request.offset, request.length)
                out = array.array('B')
                out.frombytes(data)
                response.data = out  # an array.array: taken as it is, not checked per byte
            if request.close:
                rt.exports.close(request.export_id)
        except FlashRTError as exc:
            response.success, response.message = False, str(exc)
            return response
        response.success = True
        return response

    # ---- the receiver ------------------------------------------------------------------

    def _goal_callback(self, goal):
        if self._node.session is None or not self._node.session.active:
            self._node.get_logger().warning(f'import refused: {self._node.not_active_message()}')
            return GoalResponse.REJECT
        if not self._importing.acquire(blocking=False):
            self._node.get_logger().warning('import refused: another import is running; '
                                            'wait for it to finish')
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def _execute_callback(self, goal_handle):
        try:
            return self._import(goal_handle)
        finally:
            self._importing.release()

    def _import(self, goal_handle):
        goal = goal_handle.request
        name, tier = goal.name or goal.source_name, goal.tier or 'device'
        t0 = time.perf_counter()
        limits = _Limits(t0, float(self._node.get_parameter('transfer_timeout').value),
                         float(self._node.get_parameter('transfer_deadline').value))
        manifest, staging, result = None, None, ImportCapsule.Result()
        source = goal.source_node
        try:
            session = self._node.session
            if session is None or not session.active:
                raise TransferFailed(self._node.not_active_message())
            session.check_import(name)
            manifest_cli, chunk_cli = self._clients_of(source)
            shared = bool(self._node.get_parameter('transfer_shared_memory').value)
            request = ExportManifest.Request(name=goal.source_name,
                                             host_id=self._host if shared else '',
                                             request_id=uuid.uuid4().hex)
            answer = _call(manifest_cli, request, source, limits, MANIFEST_RESEND_S)
            if not answer.success:
                raise TransferFailed(f'{source} refused the export: {answer.message}')
            manifest = Manifest(answer.export_id, goal.source_name, int(answer.total_bytes),
                                answer.checksum, answer.header_json, answer.local_path)
            staging = session.runtime.begin_import(manifest, name, tier)  # before any bytes
            if shared and manifest.local_path:
                via = self._read_local(goal_handle, staging)
                if staging.complete:
                    self._close_export(source, manifest.export_id)
            else:
                via = 'DDS chunks'
            if not staging.complete and not self._receive(goal_handle, chunk_cli, source,
                                                          staging, limits):
                goal_handle.canceled()
                result.message = (f'import of {goal.source_name!r} from {source} cancelled '
                                  f'after {staging.received} of {manifest.total_bytes} bytes; '
                                  'nothing was stored')
                self._report(name, tier, staging.received, t0, False, result.message)
                return result
            info = session.runtime.finish_import(
                staging, name, tier, Origin(source, goal.source_name, time.time()))
        except (FlashRTError, TransferFailed) as exc:
            message = str(exc)
        except Exception as exc:  # a bug, not bad input: report it and keep serving
            message = f'internal error in import: {exc!r}'
        else:
            elapsed = time.perf_counter() - t0
            result.success, result.transferred_bytes = True, manifest.total_bytes
            result.duration_s = elapsed
            result.throughput_mib_s = manifest.total_bytes / elapsed / (1 << 20)
            messages.info_msg(info, result.capsule)
            result.message = (
                f'imported {goal.source_name!r} from {source} as {info.name!r} in {info.tier}: '
                f'{manifest.total_bytes} bytes in {elapsed * 1e3:.1f} ms '
                f'({result.throughput_mib_s:.0f} MiB/s) via {via}, position {info.position}')
            goal_handle.succeed()
            self._report(name, info.tier, manifest.total_bytes, t0, True, result.message)
            self._node.outputs.evictions()
            return result
        if manifest is not None and (staging is None or not staging.complete):
            self._close_export(source, manifest.export_id)
        received = staging.received if staging is not None else 0
        result.message = (f'import of {goal.source_name!r} from {source} failed: {message}'
                          + ('' if 'nothing was' in message else '; nothing was stored'))
        self._node.get_logger().warning(result.message)
        goal_handle.abort()
        self._report(name, tier, received, t0, False, result.message)
        return result

    def _read_local(self, goal_handle, staging) -> str:
        """Read a same-host export from shared memory; say how the bytes came (or will)."""
        total = staging.manifest.total_bytes
        feedback = ImportCapsule.Feedback(bytes_total=total)

        def progress(received):
            feedback.bytes_received = received
            goal_handle.publish_feedback(feedback)

        why = staging.read_local(staging.manifest.local_path, progress)
        if why is None:
            return 'shared memory'
        self._node.get_logger().info(f'import reads the chunks over DDS: {why}')
        return f'DDS chunks ({why})'

    def _receive(self, goal_handle, chunk_cli, source, staging, limits):
        """Read every chunk into staging; return False if the goal was cancelled meanwhile."""
        pending = collections.deque()
        try:
            return self._receive_chunks(goal_handle, chunk_cli, source, staging, limits,
                                        pending)
        finally:  # given up or cancelled: no answer left waiting in the client
            for _, _, future in pending:
                chunk_cli.remove_pending_request(future)

    def _receive_chunks(self, goal_handle, chunk_cli, source, staging, limits, pending):
        m, total = staging.manifest, staging.manifest.total_bytes
        size = int(self._node.get_parameter('transfer_chunk_bytes').value)
        next_offset = 0
        feedback = ImportCapsule.Feedback(bytes_total=total)
        while not staging.complete:
            if goal_handle.is_cancel_requested:
                self._close_export(source, m.export_id)
                return False
            while len(pending) < WINDOW and next_offset < total:
                length = min(size, total - next_offset)
                last = next_offset + length == total
                request = ExportChunk.Request(export_id=m.export_id, offset=next_offset,
                                              length=length, close=last)
                pending.append((next_offset, length, chunk_cli.call_async(request)))
                next_offset += length
            offset, length, future = pending.popleft()
            answer = _wait(chunk_cli, [future], source, limits, staging)
            if not answer.success:
                raise TransferFailed(f'{source} stopped serving the export: {answer.message}')
            if len(answer.data) != length:
                raise TransferFailed(f'{source} sent {len(answer.data)} bytes for the chunk of '
                                     f'{length} bytes at offset {offset}')
            staging.add(offset, answer.data)
            _check_pace(source, staging, limits)
            feedback.bytes_received = staging.received
            goal_handle.publish_feedback(feedback)
        return True

    def _report(self, name, tier, nbytes, t0, success, message):
        self._node.outputs.event('import', name, tier, nbytes,
                                 (time.perf_counter() - t0) * 1e3, success, message)

    def _clients_of(self, source):
        """Return the (manifest, chunk) service clients of node `source` (made once)."""
        if not source.startswith('/') or source.endswith('/'):
            raise TransferFailed(f'source_node {source!r} is not a fully qualified node name; '
                                 'give it like /left_arm/flashrt')
        with self._clients_lock:
            clients = self._clients.get(source)
            if clients is None:
                try:
                    clients = (
                        self._node.create_client(ExportManifest, f'{source}/export_manifest',
                                                 callback_group=self._group),
                        self._node.create_client(ExportChunk, f'{source}/export_chunk',
                                                 callback_group=self._group))
                except Exception as exc:  # rclpy's name validation: InvalidServiceNameException
                    raise TransferFailed(
                        f'source_node {source!r} is not a valid node name ({exc}); give it '
                        'like /left_arm/flashrt') from None
                self._clients[source] = clients
                while len(self._clients) > MAX_SOURCES:
                    for client in self._clients.popitem(last=False)[1]:
                        self._node.destroy_client(client)
            self._clients.move_to_end(source)
            return clients

    def _close_export(self, source, export_id):
        """Ask the source to drop an export we will not finish (no wait: it may be gone)."""
        try:
            _, chunk_cli = self._clients_of(source)
            future = chunk_cli.call_async(ExportChunk.Request(export_id=export_id, close=True))
        except Exception:  # noqa: B902 - best effort; the export expires on its own anyway
            return
        now = time.monotonic()
        with self._clients_lock:  # the closes sent before, answered or given up
            closing = self._closing
            while closing and (closing[0][2].done() or now - closing[0][0] > CLOSE_ANSWER_S):
                _, client, old = closing.popleft()
                client.remove_pending_request(old)  # nothing when it was answered
            closing.append((now, chunk_cli, future))


def _call(client, request, source, limits, resend_after=None):
    """
    Call a source's service within the import's limits; return its answer.

    resend_after: send the request once more when no answer came within that many seconds,
    and take the first successful answer of the two (the request must be safe to repeat).
    """
    wait, by_deadline = limits.next_wait()
    if not client.wait_for_service(timeout_sec=wait):
        if by_deadline:
            raise _past_deadline(source, None, limits.deadline)
        raise TransferFailed(f'no node {source} serves {client.srv_name} (waited '
                             f'{wait:.1f} s): check the name, the namespace and that '
                             'both nodes share a ROS domain')
    sent = time.monotonic()
    futures = [client.call_async(request)]
    if resend_after is not None and limits.next_wait()[0] > resend_after and _answer_of(
            futures, time.monotonic() + resend_after) is None:
        futures.append(client.call_async(request))
    return _wait(client, futures, source, limits, since=sent)


def _wait(client, futures, source, limits, staging=None, since=None):
    """
    Return the first successful answer of `futures` (or, all failed, the first failure).

    Waits at most transfer_timeout from `since` (default: now), not past the deadline; the
    futures left unanswered are dropped from the client (an answer to them is ignored).
    """
    wait, by_deadline = limits.next_wait()
    answer = _answer_of(futures, (since or time.monotonic()) + wait)
    for future in futures:
        if not future.done():
            client.remove_pending_request(future)
    if answer is not None:
        return answer
    if by_deadline:
        raise _past_deadline(source, staging, limits.deadline)
    raise TransferFailed(f'{source} did not answer within {wait:.1f} s (the node '
                         'stopped or the network is gone)')


def _answer_of(futures, until):
    """
    Return the first successful answer of `futures`, else the first failure once all are done.

    None when time.monotonic() reaches `until` before either.
    """
    changed = threading.Event()
    for future in futures:
        if not future.done():
            future.add_done_callback(lambda _: changed.set())
    expired = False
    while True:
        changed.clear()  # before the look: a future done after it sets it again
        answers = [future.result() for future in futures if future.done()]
        best = next((answer for answer in answers if answer.success), None)
        if best is not None or len(answers) == len(futures):
            return best or answers[0]
        if expired:
            return None
        left = until - time.monotonic()
        expired = left <= 0 or not changed.wait(left)


class _Answers:
    """A sender's answers to recent manifest requests, found again by their request_id."""

    def __init__(self, size=ANSWERS_KEPT):
        self._size = size
        self._lock = threading.Lock()
        self._answers = collections.OrderedDict()  # (request_id, name, host_id) -> _Answer

    def answer(self, request, response, compute):
        """
        Return compute(request, response), or for a repeat the answer its first request got.

        A request without request_id is always computed. A repeat that comes while the first
        is still computed waits for it (one repeat at a time; another is refused at once).
        """
        if not request.request_id:
            return compute(request, response)
        key = (request.request_id, request.name, request.host_id)
        with self._lock:
            answer = self._answers.get(key)
            first = answer is None
            if first:
                answer = self._answers[key] = _Answer()
                while len(self._answers) > self._size:
                    self._answers.popitem(last=False)
            elif not answer.done.is_set():
                if answer.waiting:
                    return _refused(response, request, 'is already waited for')
                answer.waiting = True
        if first:
            try:
                answer.response = compute(request, response)
            finally:
                answer.done.set()
            return answer.response
        try:
            answer.done.wait(ANSWER_WAIT_S)
        finally:
            answer.waiting = False
        if answer.response is None:
            return _refused(response, request, 'failed or is still being answered')
        return answer.response


class _Answer:
    """One manifest request's response, once `done` is set (None: computing it failed)."""

    def __init__(self):
        self.done = threading.Event()
        self.waiting = False  # a repeat waits for done
        self.response = None


def _refused(response, request, why):
    """Return `response` saying that the repeat `request` gets no answer, and why."""
    response.success = False
    response.message = (f'the first request {request.request_id!r} for {request.name!r} {why}; '
                        'start the import again')
    return response


class _Limits:
    """An import's transfer_timeout and transfer_deadline, read once at its start t0."""

    def __init__(self, t0, timeout, deadline):
        self.t0, self.timeout, self.deadline = t0, timeout, deadline

    def elapsed(self):
        return time.perf_counter() - self.t0

    def next_wait(self):
        """Return (seconds the next wait may take, whether the deadline ends it first)."""
        left = self.deadline - self.elapsed()
        return max(0.0, min(self.timeout, left)), left <= self.timeout


def _check_pace(source, staging, limits):
    """Raise TransferFailed when an import is past its deadline or under the rate floor."""
    received, total = staging.received, staging.manifest.total_bytes
    if staging.complete:
        return
    elapsed, deadline = limits.elapsed(), limits.deadline
    if elapsed > deadline:
        raise _past_deadline(source, staging, deadline)
    if elapsed > RATE_GRACE_S and received / elapsed < MIN_RATE_BYTES_S:
        raise TransferFailed(f'{source} sends {received / elapsed / 1024:.1f} KiB/s, under the '
                             f'floor of {MIN_RATE_BYTES_S >> 10} KiB/s ({received} of {total} '
                             'bytes)')


def _past_deadline(source, staging, deadline):
    """Return the error of an import past transfer_deadline (staging None: no manifest yet)."""
    got = ('no manifest' if staging is None else
           f'{staging.received} of {staging.manifest.total_bytes} bytes')
    return TransferFailed(f'the import did not finish within transfer_deadline ({deadline:g} s): '
                          f'{got} came from {source}')


def _check_export_allowed(policy, info):
    """Raise InvalidRequestError unless `policy` (export_allowed) lets capsule `info` out."""
    if policy == 'all' or (policy == 'unpinned' and not info.pinned):
        return
    why = ('exports are off on this node' if policy == 'none' else
           f'capsule {info.name!r} is pinned (the home capsule is), and only unpinned capsules '
           'are exported')
    raise InvalidRequestError(f'{why} (export_allowed: {policy}); start the sender with '
                              'another export_allowed to allow it')
