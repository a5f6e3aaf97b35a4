"""
A Python client over the flashrt node's services, action and topics.

Every call waits with a timeout and returns the node's answer (or raises TimeoutError);
nothing loops forever. The client spins its own node on a background PoolExecutor (spin.py),
so its methods may be called from any thread, including from inside a token, event or goal
feedback callback (a service call or a goal sent from there does not deadlock). Each
callback sees its messages one at a time, in the order they arrived.

    client = FlashRTClient()                    # talks to /flashrt
    client.wait_until_active(timeout=60.0)
    client.snapshot('home')
    outcome = client.generate('Hello', max_new_tokens=16,
                              feedback_callback=lambda chunk: print(chunk.text, end=''))
    client.restore('home')
    # copy a capsule of another node into this one (then restore it here)
    client.import_capsule('/left_arm/flashrt', 'task-context')
    client.close()

Policy mode: `subscribe_actions(cb)`, then `publish_joint_state(names, position, velocity)`
(or `publish_observation(vector)`) once per control step.
"""

import array
import itertools
import os
import queue
import threading
import time
import uuid

from flashrt_ros.action import Generate, ImportCapsule
from flashrt_ros.msg import ActionChunk, AudioChunk, CapsuleEvent, EndOfUtterance, Interrupt
from flashrt_ros.msg import TokenChunk
from flashrt_ros.qos import AUDIO_QOS, COMMAND_QOS, INTERRUPT_QOS  # noqa: F401 (re-exported)
from flashrt_ros.qos import FEEDBACK_QOS, IMAGE_QOS, INSTRUCTION_QOS, STREAM_QOS
from flashrt_ros.spin import PoolExecutor, spin_until_shutdown, stop_spinning
from flashrt_ros.srv import DeleteCapsule, Fork, ListCapsules, Restore, Rollback, Snapshot
from lifecycle_msgs.srv import ChangeState, GetState
import rclpy
from rclpy.action import ActionClient
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.context import Context
from rclpy.exceptions import InvalidHandle
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Empty, Float32MultiArray, String
from std_srvs.srv import Trigger
from unique_identifier_msgs.msg import UUID

# How long result() waits for the final chunk after the result: it was sent first, and
# only a lost message (a full queue) keeps it away.
FINAL_CHUNK_GRACE_S = 0.5
RESEND_S = 1.0  # a call that changes nothing, unanswered this long, is sent again (_call)
RESENDS = 2
# How long a camera's publisher, made at its first image, waits for a subscriber before
# that image goes out (a message sent before the node has matched the publisher is lost).
IMAGE_MATCH_S = 2.0
# Then this long more: the publisher may see the node's reader before that reader has seen the
# publisher, and a best-effort image sent between the two is dropped by the reader.
IMAGE_SETTLE_S = 0.05
# rclpy's ActionClient for ~/generate subscribes to the feedback too, but the client reads
# its own subscription (GoalFeedback): rclpy's keeps the newest message only, so it adds no
# work per chunk to a stream of thousands of chunks a second.
UNUSED_FEEDBACK_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                                 reliability=ReliabilityPolicy.BEST_EFFORT)
TRANSITIONS = ('configure', 'cleanup', 'activate', 'deactivate', 'shutdown')
_counter = itertools.count()


def poll(predicate, timeout, period=0.05):
    """Call predicate() every `period` s until it is true (True) or `timeout` s pass (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(period)
    return True


class GenerateOutcome:
    """What a ~/generate goal came to: accepted or not, final status, result, chunks."""

    def __init__(self, accepted, status=0, result=None, chunks=None, message=''):
        self.accepted = accepted
        self.status = status              # action_msgs/GoalStatus STATUS_* value
        self.result = result              # Generate.Result, or None when not accepted
        self.chunks = chunks or []        # the TokenChunk feedback received, in order
        self.message = message or (result.message if result is not None else '')

    @property
    def token_ids(self):
        """Return the generated token ids (empty when the goal was not accepted)."""
        return list(self.result.token_ids) if self.result is not None else []

    def __repr__(self):
        reason = self.result.stop_reason if self.result is not None else ''
        return (f'GenerateOutcome(accepted={self.accepted}, status={self.status}, '
                f'tokens={len(self.token_ids)}, stop_reason={reason!r}, '
                f'message={self.message!r})')


def drain(subscription, message, deliver):
    """
    Call deliver(message), then deliver() for every message that waits behind it, in order.

    A subscription's callback: one pass of rclpy's executor per message costs more than a
    chunk of a fast stream takes to arrive, so the callbacks fell behind the stream and,
    past the queue's depth, chunks were lost. subscription None (a message taken before
    create_subscription returned): deliver(message) alone.
    """
    while message is not None:
        deliver(message)
        if subscription is None:
            return
        try:
            with subscription.handle:
                taken = subscription.handle.take_message(subscription.msg_type,
                                                         subscription.raw)
        except InvalidHandle:  # the client is closing
            return
        message = None if taken is None else taken[0]


def drained_subscription(node, msg_type, topic, deliver, qos):
    """Subscribe with deliver(message) as its callback, drained, in a group of its own."""
    made = []  # the subscription, once create_subscription has returned it
    made.append(node.create_subscription(
        msg_type, topic, lambda message: drain(made[0] if made else None, message, deliver),
        qos, callback_group=MutuallyExclusiveCallbackGroup()))
    return made[0]


class GoalFeedback:
    """
    A ~/generate goal's feedback, from a subscription of the client's own.

    rclpy's ActionClient forgets a goal's feedback callback as soon as its result arrives,
    and feedback and result travel on different channels: a chunk sent before the result
    but taken after it would be dropped. Here a goal's callback lives from before the goal
    is sent until its final chunk, or until its run ends it (a final chunk lost).
    """

    def __init__(self, node, name):
        self._callbacks = {}  # goal id bytes -> callback(feedback message)
        self._lock = threading.Lock()  # end() returns only once no callback of it runs
        self.subscription = drained_subscription(
            node, Generate.Impl.FeedbackMessage, f'{name}/_action/feedback', self._deliver,
            FEEDBACK_QOS)

    def add(self, callback):
        """Register callback(feedback message) for a new goal id; return the id."""
        goal_id = UUID(uuid=list(uuid.uuid4().bytes))
        with self._lock:
            self._callbacks[bytes(goal_id.uuid)] = callback
        return goal_id

    def end(self, goal_id):
        """Drop the goal's callback: nothing more of that goal reaches it."""
        with self._lock:
            self._callbacks.pop(bytes(goal_id.uuid), None)

    def _deliver(self, message):
        with self._lock:
            goal = bytes(message.goal_id.uuid)
            callback = self._callbacks.get(goal)
            if callback is not None:
                callback(message)
                if message.feedback.chunk.final:  # the goal's last chunk
                    del self._callbacks[goal]


class GoalRun:
    """A ~/generate goal in flight: wait for its result or cancel it."""

    def __init__(self, client, goal_handle, chunks, timeout, on_chunk, end_feedback):
        self._client = client
        self._goal_handle = goal_handle
        self.chunks = chunks
        self._on_feedback_chunk = on_chunk
        self._end_feedback = end_feedback
        self._timeout = timeout
        self._result_future = goal_handle.get_result_async() if goal_handle.accepted else None
        if not goal_handle.accepted:
            end_feedback()

    @property
    def accepted(self):
        """Return True when the node accepted the goal."""
        return self._goal_handle.accepted

    def cancel(self, timeout=None):
        """Ask the node to stop at the next decode step; return the CancelGoal response."""
        timeout = self._client.timeout if timeout is None else timeout
        return self._client._wait(self._goal_handle.cancel_goal_async(), timeout, 'cancel')

    def result(self, timeout=None):
        """Wait for the turn to end and return a GenerateOutcome (TimeoutError if it does not)."""
        if not self.accepted:
            return GenerateOutcome(False, message='goal rejected by the node (a generation is '
                                   'running and goal_policy is reject, or the node is not active)')
        timeout = self._timeout if timeout is None else timeout
        wrapped = self._client._wait(self._result_future, timeout, 'generate result')
        # Feedback and result travel on different channels: the chunks still on their way
        # come (GoalFeedback); a final chunk that was lost is rebuilt from the result, so
        # `chunks` (and the feedback callback) always end with final=True.
        deadline = time.monotonic() + FINAL_CHUNK_GRACE_S  # the node sends one per goal
        while not (self.chunks and self.chunks[-1].final) and time.monotonic() < deadline:
            time.sleep(0.002)
        self._end_feedback()
        if not self.chunks or not self.chunks[-1].final:
            self._on_feedback_chunk(self._final_chunk(wrapped.result))
        self._client._feedback_drained(timeout)  # the callbacks of every chunk have run
        return GenerateOutcome(True, wrapped.status, wrapped.result, list(self.chunks))

    def _final_chunk(self, result):
        seen = [t for c in self.chunks for t in c.token_ids]
        text = ''.join(c.text for c in self.chunks)
        rest = result.text[len(text):] if result.text.startswith(text) else ''
        return TokenChunk(turn_id=self.chunks[0].turn_id if self.chunks else 0,
                          index=len(seen), token_ids=list(result.token_ids)[len(seen):],
                          text=rest, final=True, stop_reason=result.stop_reason)


class ImportRun(GoalRun):
    """A ~/import_capsule goal in flight: wait for its result or cancel it (nothing stored)."""

    def __init__(self, client, goal_handle, feedback):
        self._client, self._goal_handle = client, goal_handle
        self.feedback = feedback  # ImportCapsule.Feedback messages received so far
        self._result_future = goal_handle.get_result_async() if goal_handle.accepted else None

    def result(self, timeout=None):
        """Wait for the import to end; return (GoalStatus value, ImportCapsule.Result)."""
        if not self.accepted:
            return 0, ImportCapsule.Result(
                success=False, message='import rejected by the node (another import is '
                'running, or the node is not active)')
        timeout = self._client.timeout if timeout is None else timeout
        wrapped = self._client._wait(self._result_future, timeout, 'import result')
        return wrapped.status, wrapped.result


def refuse_nul(msg):
    r"""
    Raise ValueError if a string field of `msg` holds a NUL byte.

    The middleware's C layer ends a string at its first NUL, so the node would act on the
    name before it ('nul\0trunc' on 'nul'): such a request is refused here, unsent.
    """
    for field, kind in msg.get_fields_and_field_types().items():
        value = getattr(msg, field)
        values = value if kind.startswith('sequence<string') else [value]
        if kind.startswith(('string', 'sequence<string')) and any('\0' in v for v in values):
            raise ValueError(f'{type(msg).__name__}.{field} holds a NUL byte, which the '
                             'middleware would cut the string at; remove it')


class FlashRTClient:
    """Client for one flashrt node (services, generate action, control topics)."""

    def __init__(self, node='flashrt', namespace='', *, context=None, timeout=10.0,
                 enclave=''):
        """
        Create the client node and start spinning it.

        :param node: name of the flashrt node; `namespace` is the node's namespace.
        :param context: an initialized rclpy Context; None makes (and later shuts down) one.
        :param timeout: default seconds each call waits.
        :param enclave: the SROS2 enclave of the context this client makes (docs/security.md).
        """
        self.timeout = timeout
        self._own_context = context is None
        if context is None:
            context = Context()
            rclpy.init(context=context,
                       args=['--ros-args', '--enclave', enclave] if enclave else None)
        self.context = context
        base = '/'.join(p for p in (namespace.strip('/'), node.strip('/')) if p)
        self.base = '/' + base
        self.node = rclpy.create_node(f'flashrt_client_{os.getpid()}_{next(_counter)}',
                                      context=context)
        # Service clients are reentrant, so a call made from inside a callback is answered
        # on another thread. Each subscription and the action client get a group of their
        # own: their callbacks run one at a time, in the order the messages arrived. Goal
        # feedback callbacks run on a thread of their own (see _deliver_feedback).
        group = ReentrantCallbackGroup()
        n = self.node

        def service(kind, name):
            return n.create_client(kind, f'{self.base}/{name}', callback_group=group)

        self._snapshot = service(Snapshot, 'snapshot')
        self._restore = service(Restore, 'restore')
        self._fork = service(Fork, 'fork')
        self._rollback = service(Rollback, 'rollback')
        self._list = service(ListCapsules, 'list_capsules')
        self._delete = service(DeleteCapsule, 'delete_capsule')
        self._digest = service(Trigger, 'state_digest')
        self._get_state = service(GetState, 'get_state')
        self._change_state = service(ChangeState, 'change_state')
        self._generate = ActionClient(n, Generate, f'{self.base}/generate',
                                      callback_group=MutuallyExclusiveCallbackGroup(),
                                      feedback_sub_qos_profile=UNUSED_FEEDBACK_QOS)
        # The action's name as rcl resolves it (remappings applied): the feedback topic is
        # that name's, not the name's as written.
        self._generate_feedback = GoalFeedback(n, n.resolve_topic_name(f'{self.base}/generate'))
        self._import = ActionClient(n, ImportCapsule, f'{self.base}/import_capsule',
                                    callback_group=MutuallyExclusiveCallbackGroup(),
                                    feedback_sub_qos_profile=FEEDBACK_QOS)
        self._prompt_pub = n.create_publisher(String, f'{self.base}/prompt', COMMAND_QOS)
        self._interrupt_pub = n.create_publisher(Interrupt, f'{self.base}/interrupt',
                                                 INTERRUPT_QOS)
        self._reset_pub = n.create_publisher(Empty, f'{self.base}/reset', COMMAND_QOS)
        self._joint_state_pub = n.create_publisher(JointState, f'{self.base}/observation',
                                                   COMMAND_QOS)
        self._vector_pub = n.create_publisher(Float32MultiArray,
                                              f'{self.base}/observation_vector', COMMAND_QOS)
        self._audio_pub = n.create_publisher(AudioChunk, f'{self.base}/audio', AUDIO_QOS)
        self._flush_pub = n.create_publisher(Empty, f'{self.base}/flush', COMMAND_QOS)
        self._image_pubs = {}  # topic -> publisher, made at the first image for a camera
        self._instruction_pub = n.create_publisher(String, f'{self.base}/instruction',
                                                   INSTRUCTION_QOS)

        self._answered = set()  # service clients that got an answer (_call resends no more)
        self._feedback = queue.SimpleQueue()  # (feedback_callback, chunk), in arrival order
        self._feedback_thread = threading.Thread(target=self._deliver_feedback,
                                                 name='flashrt-client-feedback', daemon=True)
        self._feedback_thread.start()
        self._executor = PoolExecutor(num_threads=4, context=context)
        self._executor.add_node(n)
        self._closing = False
        self._spinner = threading.Thread(target=self._spin, name='flashrt-client', daemon=True)
        self._spinner.start()

    def _spin(self):
        spin_until_shutdown(self._executor, self.node.get_logger(),
                            lambda: self._closing or not self.context.ok())

    def _deliver_feedback(self):
        """
        Run goal feedback callbacks in order until None arrives (the feedback thread).

        Not on the executor: the action client answers goals, cancels and results one
        callback at a time, so a feedback callback that sent the next goal or a cancel from
        there would wait for an answer that could only come after it returned.
        """
        while (item := self._feedback.get()) is not None:
            if isinstance(item, threading.Event):  # a marker: everything before it has run
                item.set()
                continue
            callback, chunk = item
            try:
                callback(chunk)
            except Exception as exc:
                self.node.get_logger().error(f'feedback callback failed: {exc!r}')

    def _feedback_drained(self, timeout):
        """Wait until the feedback callbacks queued so far have run (not from one of them)."""
        if threading.current_thread() is self._feedback_thread:
            return
        marker = threading.Event()
        self._feedback.put(marker)
        marker.wait(timeout)

    # ---- waiting -----------------------------------------------------------------------

    @staticmethod
    def _wait(future, timeout, what):
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        if not done.wait(timeout):
            raise TimeoutError(f'{what}: no answer within {timeout:.1f} s; is the node running?')
        return future.result()

    def _call(self, client, request, timeout=None, resend=False):
        """
        Call one service; return its response or raise TimeoutError.

        resend (a call that changes nothing): until the service has answered this client
        once, a call unanswered after RESEND_S is sent again, up to RESENDS times. The server
        drops its reply when its reply writer has not yet discovered this client's reader (a
        new client's first calls); a call that changes state is never sent twice.
        """
        refuse_nul(request)
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if not client.wait_for_service(timeout_sec=timeout):
            raise TimeoutError(f'service {client.srv_name} is not available after '
                               f'{timeout:.1f} s; is the node running?')
        sends = 1 + (RESENDS if resend and client not in self._answered else 0)
        while True:
            sends -= 1
            future = client.call_async(request)
            left = max(0.0, deadline - time.monotonic())
            try:
                response = self._wait(future, min(left, RESEND_S) if sends else left,
                                      client.srv_name)
            except TimeoutError:
                client.remove_pending_request(future)
                if not sends or time.monotonic() >= deadline:
                    raise TimeoutError(f'{client.srv_name}: no answer within {timeout:.1f} s; '
                                       'is the node running?') from None
                continue
            self._answered.add(client)
            return response

    def wait_until_active(self, timeout=60.0):
        """Wait until the node reports lifecycle state 'active'; return True if it does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.get_state(timeout=max(0.1, min(2.0, deadline - time.monotonic()))) \
                        == 'active':
                    return self._generate.wait_for_server(
                        timeout_sec=max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                pass
            time.sleep(0.1)
        return False

    # ---- lifecycle ---------------------------------------------------------------------

    def get_state(self, timeout=None):
        """Return the node's lifecycle state label (e.g. 'active')."""
        return self._call(self._get_state, GetState.Request(), timeout,
                          resend=True).current_state.label

    def change_state(self, transition, timeout=None):
        """Trigger a lifecycle transition by name (configure, activate, ...); return success."""
        if transition not in TRANSITIONS:
            raise ValueError(f'transition {transition!r} is not one of {", ".join(TRANSITIONS)}')
        request = ChangeState.Request()
        request.transition.label = transition  # the node picks the one valid from its state
        return self._call(self._change_state, request, timeout).success

    # ---- capsule services --------------------------------------------------------------

    def snapshot(self, name, tier='device', pinned=False, timeout=None):
        """Snapshot the live state as capsule `name`; return the Snapshot response."""
        return self._call(self._snapshot,
                          Snapshot.Request(name=name, tier=tier, pinned=pinned), timeout)

    def restore(self, name, mode='full', timeout=None):
        """Make capsule `name` the live state; return the Restore response."""
        return self._call(self._restore, Restore.Request(name=name, mode=mode), timeout)

    def fork(self, source, target, tier='', timeout=None):
        """Copy capsule `source` to `target`; return the Fork response."""
        return self._call(self._fork, Fork.Request(source=source, target=target, tier=tier),
                          timeout)

    def rollback(self, boundaries=1, timeout=None):
        """Go back `boundaries` committed boundaries; return the Rollback response."""
        return self._call(self._rollback, Rollback.Request(boundaries=boundaries), timeout)

    def list_capsules(self, tier='', timeout=None):
        """Return the ListCapsules response (capsules of `tier`, or all)."""
        return self._call(self._list, ListCapsules.Request(tier=tier), timeout, resend=True)

    def delete_capsule(self, name, timeout=None):
        """Delete capsule `name`; return the DeleteCapsule response."""
        return self._call(self._delete, DeleteCapsule.Request(name=name), timeout)

    def state_digest(self, timeout=None):
        """Return the sha256 hex digest of the node's live state (RuntimeError if refused)."""
        response = self._call(self._digest, Trigger.Request(), timeout, resend=True)
        if not response.success:
            raise RuntimeError(response.message)
        return response.message

    # ---- transfer between nodes ----------------------------------------------------------

    def start_import(self, source_node, source_name, name='', tier='', feedback_callback=None,
                     timeout=None):
        """
        Have this client's node import capsule `source_name` from node `source_node`.

        source_node is fully qualified (e.g. '/left_arm/flashrt'). Returns an ImportRun;
        feedback_callback(ImportCapsule.Feedback) runs on the client's executor per chunk.
        """
        timeout = self.timeout if timeout is None else timeout
        if not self._import.wait_for_server(timeout_sec=timeout):
            raise TimeoutError(f'action {self.base}/import_capsule is not available after '
                               f'{timeout:.1f} s; is the node running?')
        feedback = []

        def on_feedback(message):
            feedback.append(message.feedback)
            if feedback_callback is not None:
                feedback_callback(message.feedback)

        goal = ImportCapsule.Goal(source_node=source_node, source_name=source_name, name=name,
                                  tier=tier)
        refuse_nul(goal)
        future = self._import.send_goal_async(goal, feedback_callback=on_feedback)
        return ImportRun(self, self._wait(future, timeout, 'import goal'), feedback)

    def import_capsule(self, source_node, source_name, name='', tier='', timeout=60.0):
        """
        Copy capsule `source_name` of node `source_node` into this client's node.

        Returns the ImportCapsule.Result (success, message, capsule with its origin,
        transferred_bytes, duration_s, throughput_mib_s).
        """
        run = self.start_import(source_node, source_name, name, tier,
                                timeout=min(timeout, self.timeout))
        return run.result(timeout)[1]

    # ---- generation --------------------------------------------------------------------

    def start_generate(self, prompt='', *, token_ids=(), raw=False, max_new_tokens=0,
                       temperature=-1.0, top_k=-1, top_p=-1.0, seed=-1, stop=(),
                       start_from='', save_as='', save_tier='', feedback_callback=None,
                       timeout=None):
        """
        Send a ~/generate goal and return a GoalRun once the node accepted or rejected it.

        Fields as in Generate.action: raw=True appends the prompt without the chat template;
        a negative temperature, top_k or top_p is the checkpoint's default.

        feedback_callback(TokenChunk) runs for every chunk, in order, on the client's feedback
        thread (it may call any method, start_generate included); the last one has final=True
        (rebuilt from the result when the middleware dropped it). result() returns once the
        callbacks of every chunk have run.
        """
        timeout = self.timeout if timeout is None else timeout
        # rclpy's wait covers its own feedback subscription; the chunks come on the client's.
        feedback = self._generate_feedback.subscription
        if not self._generate.wait_for_server(timeout_sec=timeout):
            raise TimeoutError(f'action {self.base}/generate is not available after '
                               f'{timeout:.1f} s; is the node running?')
        if not poll(lambda: feedback.get_publisher_count() > 0, timeout, 0.005):
            raise TimeoutError(f'action {self.base}/generate is up, but its feedback topic '
                               f'{feedback.topic_name} matched no publisher in {timeout:.1f} s '
                               '(a publisher with other QoS is logged as incompatible)')
        goal = Generate.Goal(prompt=prompt, token_ids=list(token_ids), raw=bool(raw),
                             max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k, top_p=top_p, seed=seed, stop=list(stop),
                             start_from=start_from, save_as=save_as, save_tier=save_tier)
        chunks = []

        def on_chunk(chunk):
            chunks.append(chunk)
            if feedback_callback is not None:
                self._feedback.put((feedback_callback, chunk))

        refuse_nul(goal)
        goal_id = self._generate_feedback.add(lambda message: on_chunk(message.feedback.chunk))
        try:
            goal_handle = self._wait(self._generate.send_goal_async(goal, goal_uuid=goal_id),
                                     timeout, 'generate goal')
        except BaseException:
            self._generate_feedback.end(goal_id)
            raise
        return GoalRun(self, goal_handle, chunks, timeout, on_chunk,
                       lambda: self._generate_feedback.end(goal_id))

    def generate(self, prompt='', *, timeout=60.0, **kwargs):
        """Run one turn and return its GenerateOutcome (keywords as in start_generate)."""
        run = self.start_generate(prompt, timeout=min(timeout, self.timeout), **kwargs)
        return run.result(timeout)

    # ---- topics ------------------------------------------------------------------------

    def publish_prompt(self, text):
        """Start a turn through ~/prompt (no feedback; watch ~/tokens)."""
        msg = String(data=text)
        refuse_nul(msg)  # the node would read the prompt up to the NUL
        self._prompt_pub.publish(msg)

    def interrupt(self, mode=Interrupt.POLICY, boundaries=0, capsule='', reason=''):
        """Publish an Interrupt message: mode POLICY, STOP, ROLLBACK or RESTORE."""
        msg = Interrupt(mode=mode, boundaries=boundaries, capsule=capsule, reason=reason)
        refuse_nul(msg)  # a RESTORE of 'a\0b' would restore 'a'
        self._interrupt_pub.publish(msg)

    def reset(self):
        """Publish ~/reset: the node stops and restores its home capsule."""
        self._reset_pub.publish(Empty())

    def publish_observation(self, values):
        """Publish a raw observation vector on ~/observation_vector (policy mode)."""
        self._vector_pub.publish(Float32MultiArray(data=[float(v) for v in values]))

    def publish_joint_state(self, names, position=(), velocity=(), effort=(), stamp=None):
        """Publish a sensor_msgs/JointState on ~/observation (policy mode; stamp: now)."""
        msg = JointState(name=list(names), position=[float(v) for v in position],
                         velocity=[float(v) for v in velocity],
                         effort=[float(v) for v in effort])
        msg.header.stamp = stamp or self.node.get_clock().now().to_msg()
        refuse_nul(msg)  # joint names are matched by name
        self._joint_state_pub.publish(msg)

    def publish_image(self, camera, pixels, height, width, encoding='rgb8', stamp=None,
                      topic=None):
        """
        Publish an 8-bit image (bytes, rows packed) on ~/image/<camera> (or `topic`).

        A camera policy matches it with the joint state of the same stamp (sync_slop); give
        both the same `stamp` (builtin_interfaces/Time; default now). The first image of a
        camera waits up to IMAGE_MATCH_S for the node to subscribe to it (and IMAGE_SETTLE_S
        more once it has).
        """
        topic = topic or f'{self.base}/image/{camera}'
        if topic not in self._image_pubs:
            pub = self.node.create_publisher(Image, topic, IMAGE_QOS)
            if poll(lambda: pub.get_subscription_count() > 0, IMAGE_MATCH_S, 0.01):
                time.sleep(IMAGE_SETTLE_S)
            self._image_pubs[topic] = pub
        msg = Image(height=int(height), width=int(width), encoding=encoding,
                    step=len(pixels) // max(int(height), 1), data=bytes(pixels))
        msg.header.stamp = stamp or self.node.get_clock().now().to_msg()
        self._image_pubs[topic].publish(msg)

    def publish_instruction(self, text):
        """Publish a VLA policy's instruction on ~/instruction (transient local: it stays)."""
        msg = String(data=str(text))
        refuse_nul(msg)
        self._instruction_pub.publish(msg)

    def now(self):
        """Return the client node's clock now, as a builtin_interfaces/Time (for stamps)."""
        return self.node.get_clock().now().to_msg()

    def publish_audio(self, samples, sample_rate=24000, first_sample=-1, stamp=None):
        """
        Publish mono samples (int16 or float32 values) as one AudioChunk on ~/audio.

        stamp: when its first sample was captured (builtin_interfaces/Time; default now): the
        transcript chunks it completes are stamped from it.
        """
        msg = AudioChunk(sample_rate=int(sample_rate), channels=1,
                         first_sample=int(first_sample))
        if str(getattr(samples, 'dtype', '')) == 'int16':
            msg.sample_format = AudioChunk.FORMAT_INT16
            msg.int16_samples = array.array('h', samples.tobytes())
        else:
            msg.sample_format = AudioChunk.FORMAT_FLOAT32
            msg.float32_samples = array.array('f', [float(v) for v in samples])
        msg.header.stamp = self.now() if stamp is None else stamp
        self._audio_pub.publish(msg)

    def flush(self):
        """Ask a speech node for the words its text delay holds back (on ~/transcript)."""
        self._flush_pub.publish(Empty())

    def subscribe_transcript(self, callback):
        """Call callback(TokenChunk) for every ~/transcript chunk of a speech node."""
        return self.node.create_subscription(TokenChunk, f'{self.base}/transcript', callback,
                                             STREAM_QOS)

    def subscribe_end_of_utterance(self, callback):
        """Call callback(EndOfUtterance) when a speech node hears the speaker stop."""
        return self.node.create_subscription(EndOfUtterance, f'{self.base}/end_of_utterance',
                                             callback, STREAM_QOS)

    def subscribe_actions(self, callback):
        """Call callback(ActionChunk) for every message on ~/actions; return the subscription."""
        return self.node.create_subscription(ActionChunk, f'{self.base}/actions', callback,
                                             COMMAND_QOS,
                                             callback_group=MutuallyExclusiveCallbackGroup())

    def subscribe_tokens(self, callback):
        """Call callback(TokenChunk) for every chunk on ~/tokens; return the subscription."""
        return drained_subscription(self.node, TokenChunk, f'{self.base}/tokens', callback,
                                    STREAM_QOS)

    def subscribe_events(self, callback):
        """Call callback(CapsuleEvent) for every event on ~/events; return the subscription."""
        return self.node.create_subscription(CapsuleEvent, f'{self.base}/events', callback,
                                             STREAM_QOS,
                                             callback_group=MutuallyExclusiveCallbackGroup())

    def wait_for_subscribers(self, timeout=5.0, inputs=''):
        """
        Wait until the node subscribes to its command topics and to `inputs`.

        inputs: '' (an LM node takes no input topics), 'observation' (a policy node's
        ~/observation and ~/observation_vector) or 'audio' (a speech node's ~/audio). A
        node subscribes to its mode's inputs only once configured.
        """
        pubs = (self._interrupt_pub, self._reset_pub, self._prompt_pub) + {
            '': (), 'observation': (self._joint_state_pub, self._vector_pub),
            'audio': (self._audio_pub,)}[inputs]
        return poll(lambda: all(p.get_subscription_count() > 0 for p in pubs), timeout)

    def wait_for_publishers(self, *subscriptions, timeout=10.0):
        """
        Wait until each of `subscriptions` (e.g. from subscribe_events) has a publisher.

        What a node publishes before its publisher matches a subscription is lost to it.
        """
        return poll(lambda: all(s.get_publisher_count() > 0 for s in subscriptions), timeout)

    def close(self):
        """Stop spinning and destroy the client node (and its context if it made one)."""
        self._closing = True
        stop_spinning(self._executor, self._spinner, self.node.get_logger())
        self._feedback.put(None)
        if threading.current_thread() is not self._feedback_thread:  # not from a callback
            self._feedback_thread.join(timeout=2.0)
        self.node.destroy_node()
        if self._own_context:
            rclpy.try_shutdown(context=self.context)

    def __enter__(self):
        """Return self (use as a context manager to close automatically)."""
        return self

    def __exit__(self, *exc):
        """Close the client."""
        self.close()
