"""
The `flashrt` lifecycle node: ROS 2 services, an action and topics over flashrt_ros.runtime.

The node only translates between ROS and the runtime; every state rule (commit boundaries,
all-or-nothing restore, fingerprints, budgets) lives in the runtime.

Concurrency
  * One generation thread (not an executor thread) runs every turn, from ~/generate goals
    and ~/prompt messages, one at a time, from a queue.
  * Callbacks that change the live state (capsule services, ~/interrupt, ~/reset, ~/prompt)
    share one MutuallyExclusiveCallbackGroup: one writer. Cheap queries (list, state
    digest, diagnostics) use a separate reentrant group and never wait for the writers.
  * A restore or rollback *service* never waits for a generation: while one runs it answers
    success=false (a service must not block for an unbounded turn). ~/interrupt and ~/reset
    end the generation (STOP at its next step boundary, ROLLBACK/RESTORE mid-step: see
    _stop_and_apply) and publish their event once the turn is over.
  * The generation thread never waits on the executor, so a client that calls a service from
    inside its token callback cannot deadlock the node.

Policy mode (parameter `mode: policy`, a policy model such as builtin:tiny-policy)
  * In: ~/observation (sensor_msgs/JointState, mapped through the policy's
    observation_names) and ~/observation_vector (std_msgs/Float32MultiArray, the raw vector).
  * stepping=observation: each observation is one control step (Runtime.act, a committed
    boundary) and its whole chunk goes out on ~/actions (flashrt_ros/ActionChunk) and,
    if publish_joint_trajectory, ~/joint_trajectory. stepping=timer: a control_rate timer
    steps on the newest observation (if one arrived) and publishes ONE queued action per
    tick, so the runtime's action queue is what the robot executes.
  * Observation, timer, interrupt, reset and capsule callbacks share the state group, so a
    control step never interleaves with a capsule operation. An interrupt or reset drops
    the action queue after applying its mode, and observations received before it are
    discarded: no action of an interrupted chunk is published after the interrupt.
  * A bad observation (wrong size, NaN/Inf, a joint missing) is a CapsuleEvent
    (operation 'observation', success false) and a log line; the state is untouched.
"""

import collections
import contextlib
import functools
import gc
import queue
import signal
import sys
import threading
import time

from builtin_interfaces.msg import Duration, Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from flashrt_ros.action import Generate
from flashrt_ros.msg import ActionChunk, CapsuleEvent, CapsuleInfo, Interrupt, TokenChunk
from flashrt_ros.runtime import BusyError, FlashRTError, InvalidRequestError, Runtime
from flashrt_ros.runtime import RuntimeConfig
from flashrt_ros.spin import spin_until_shutdown
from flashrt_ros.srv import DeleteCapsule, Fork, ListCapsules, Restore, Rollback, Snapshot
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rcl_interfaces.msg import ParameterType, SetParametersResult
import rclpy
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
try:
    from rclpy.event_handler import PublisherEventCallbacks, SubscriptionEventCallbacks
except ImportError:  # Humble: the same classes before their module was renamed in Iron
    from rclpy.qos_event import PublisherEventCallbacks, SubscriptionEventCallbacks
from rclpy.executors import MultiThreadedExecutor
from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn
from rclpy.qos import DurabilityPolicy, HistoryPolicy, qos_policy_name_from_kind
from rclpy.qos import QoSProfile, ReliabilityPolicy
from rclpy.signals import SignalHandlerOptions
from rclpy.subscription import Subscription
from sensor_msgs.msg import JointState
from std_msgs.msg import Empty, Float32MultiArray, String
from std_srvs.srv import Trigger
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

NODE_NAME = 'flashrt'
BUSY_MESSAGE = 'a generation is running; cancel it or publish ~/interrupt'
INTERRUPT_POLICIES = ('stop', 'rollback', 'restore_home')
GOAL_POLICIES = ('reject', 'queue')
CHOICES = {
    'mode': ('lm', 'policy'),
    'stepping': ('observation', 'timer'),
    'trajectory_field': ('positions', 'velocities', 'accelerations', 'effort'),
    'dtype': ('float32', 'bfloat16', 'float16'),
    'eviction': ('refuse', 'lru'),
    'interrupt_policy': INTERRUPT_POLICIES,
    'goal_policy': GOAL_POLICIES,
}
# Parameters that build the Runtime; a change takes effect at the next configure.
RUNTIME_PARAMS = ('model', 'device', 'dtype', 'max_seq_len', 'device_budget_bytes',
                  'host_budget_bytes', 'disk_budget_bytes', 'capsule_dir', 'eviction',
                  'cuda_graphs', 'rollback_depth', 'seed')
_MAX_INT = 2 ** 62

# QoS, chosen on purpose:
# - ~/tokens and ~/events: RELIABLE so a speech or UI consumer sees every chunk and every
#   capsule operation in order; KEEP_LAST 100 bounds what a stalled subscriber can pile up;
#   VOLATILE because a late joiner has no use for old tokens.
STREAM_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100,
                        reliability=ReliabilityPolicy.RELIABLE,
                        durability=DurabilityPolicy.VOLATILE)
# - ~/interrupt: RELIABLE with a deep queue (1000): an interrupt (e-stop, barge-in) must never
#   be dropped, even in a burst while the state group is busy. Publishers must be RELIABLE too.
INTERRUPT_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1000,
                           reliability=ReliabilityPolicy.RELIABLE,
                           durability=DurabilityPolicy.VOLATILE)
# - ~/prompt and ~/reset: RELIABLE commands, a short queue is enough.
COMMAND_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10,
                         reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.VOLATILE)
# - /diagnostics: the system default (reliable, depth 10), what diagnostic_aggregator expects.
DIAGNOSTICS_QOS = 10
# - ~/observation*: BEST_EFFORT matches sensor publishers of either reliability; depth 1
#   because a control step should act on the newest observation, never on a backlog.
OBSERVATION_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                             reliability=ReliabilityPolicy.BEST_EFFORT,
                             durability=DurabilityPolicy.VOLATILE)
# - ~/actions and ~/joint_trajectory: RELIABLE, a short queue: a controller needs every
#   chunk in order, and a stalled one should not pile up stale actions.
ACTIONS_QOS = COMMAND_QOS
# No QoS event handlers on the node's topics (including rclpy's own /parameter_events
# publisher) except ~/interrupt: rclpy adds two per publisher and subscription by default
# (incompatible QoS, incompatible type), each a waitable that the executor walks on every
# wake-up - 20 of the node's 46 entities, about 0.2 ms per service call. The peer's own
# default handlers still report a mismatch on its side.
NO_PUB_EVENTS = PublisherEventCallbacks(use_default_callbacks=False)
NO_SUB_EVENTS = SubscriptionEventCallbacks(use_default_callbacks=False)
# The executor, the generation thread and torch share the GIL; Python's default 5 ms switch
# interval would let a callback wait several intervals for a decoding thread to let go. The
# executable (main) switches between two intervals: 0.1 ms while a turn decodes, so that an
# interrupt is dispatched and preempts quickly (fig5: p99 about 2 ms lower than at 0.5 ms),
# and 0.5 ms otherwise, because with nothing decoding a shorter interval makes the executor
# thread and a service callback trade the GIL back and forth (about 0.3 ms more per call).
SWITCH_INTERVAL_DECODING_S = 0.0001
SWITCH_INTERVAL_IDLE_S = 0.0005


def _descriptor(description, *, read_only=False, integer=None, floating=None, ptype=None,
                constraints=''):
    """Build a ParameterDescriptor with an optional integer or floating-point range."""
    d = ParameterDescriptor(description=description, read_only=read_only,
                            additional_constraints=constraints)
    if ptype is not None:
        d.type = ptype
    if integer is not None:
        d.integer_range = [IntegerRange(from_value=integer[0], to_value=integer[1], step=1)]
    if floating is not None:
        d.floating_point_range = [FloatingPointRange(from_value=floating[0],
                                                     to_value=floating[1], step=0.0)]
    return d


def _stamp(seconds):
    """Convert unix seconds (float) to builtin_interfaces/Time."""
    sec = int(seconds)
    return Time(sec=sec, nanosec=int((seconds - sec) * 1e9))


def _duration(seconds):
    """Convert seconds (float) to builtin_interfaces/Duration."""
    sec = int(seconds)
    return Duration(sec=sec, nanosec=int((seconds - sec) * 1e9))


def _joint_state_vector(msg, names):
    """
    Return the observation vector named by `names` ('<joint>/position|velocity|effort').

    Raise ValueError naming what is missing.
    """
    if not names:
        raise ValueError('the policy declares no observation_names, so a JointState cannot be '
                         'mapped; publish the raw vector on ~/observation_vector')
    index = {joint: i for i, joint in enumerate(msg.name)}
    values = []
    for name in names:
        joint, _, field = name.rpartition('/')
        data = getattr(msg, field, None) if field in ('position', 'velocity', 'effort') else None
        if data is None or joint not in index or index[joint] >= len(data):
            raise ValueError(f'JointState has no {field or "value"} for {joint or name!r} '
                             f'(the policy needs {list(names)})')
        values.append(float(data[index[joint]]))
    return values


def _info_msg(info, msg=None):
    """Fill msg (a new CapsuleInfo message by default) from a runtime CapsuleInfo."""
    msg = CapsuleInfo() if msg is None else msg
    msg.name, msg.tier, msg.size_bytes = info.name, info.tier, int(info.nbytes)
    msg.position, msg.created = int(info.position), _stamp(info.created)
    msg.checksum, msg.fingerprint = info.checksum, info.fingerprint
    msg.components, msg.pinned = list(info.components), bool(info.pinned)
    return msg


# rclpy passes a MessageInfo (the middleware's receipt time) to two-argument subscription
# callbacks from Iron on; Humble calls callback(msg), and the node then uses its own clock.
_MESSAGE_INFO = hasattr(Subscription, 'CallbackType')


def _without_info(callback, msg):
    callback(msg, None)


class _Turn:
    """One generation turn waiting for, or running on, the generation thread."""

    def __init__(self, goal, goal_handle=None):
        self.goal = goal                  # Generate.Goal (a ~/prompt message becomes one too)
        self.goal_handle = goal_handle    # None for ~/prompt turns
        self.cancel_requested = False     # set by the action's cancel callback
        self.settled = False              # outcome fixed: a cancel is refused (under _cv)
        self.replaced = ''                # set when an interrupt or reset replaced the state
        self.result = Generate.Result()
        self.done = threading.Event()
        self.turn_id = 0                  # set when the generation thread starts it
        self.streamed = 0                 # tokens published in non-final chunks
        self.final = None                 # (ids, text, stop_reason) of the last chunk


class FlashRTNode(LifecycleNode):
    """Managed node serving capsule services, the generate action and the control topics."""

    def __init__(self, **kwargs):
        super().__init__(NODE_NAME, **kwargs)
        self._declare_parameters()
        self.add_on_set_parameters_callback(self._validate_parameters)

        self._runtime = None
        self._active = False
        self._home_ready = False
        # Generation thread bookkeeping, all guarded by _cv.
        self._cv = threading.Condition()
        self._queue = collections.deque()   # turns not started yet
        self._current = None                # the turn on the generation thread
        self._ending = None                 # a turn counted out, its final chunk not yet sent
        self._holds = 0                     # state operations that keep new turns from starting
        self._reserved = 0                  # accepted turns not finished (queued + running)
        self._worker = None
        self._worker_stop = False
        self.tune_switch_interval = False  # main() sets it: see SWITCH_INTERVAL_DECODING_S
        self._turns_by_goal = {}            # guarded by _cv
        self._early_cancels = set()         # goal ids cancelled before their turn existed
        self._start_lock = threading.Lock()  # a turn's start_from restore vs an interrupt
        self._turn_id = 0
        self._event_queue = queue.SimpleQueue()
        self._event_thread = threading.Thread(target=self._event_loop, name='flashrt-events',
                                              daemon=True)
        # Policy mode, touched only from the state group.
        self._latest_observation = None     # newest valid observation (timer stepping)
        self._interrupted_at = 0.0          # receipt time of the last interrupt/reset
        self._control_timer = None

        self._state_group = MutuallyExclusiveCallbackGroup()
        self._query_group = ReentrantCallbackGroup()
        self._action_group = ReentrantCallbackGroup()

        # Lifecycle publishers only publish while the node is active.
        self._tokens_pub = self.create_lifecycle_publisher(TokenChunk, '~/tokens', STREAM_QOS)
        self._events_pub = self.create_lifecycle_publisher(CapsuleEvent, '~/events', STREAM_QOS)
        self._actions_pub = self.create_lifecycle_publisher(ActionChunk, '~/actions',
                                                            ACTIONS_QOS)
        self._trajectory_pub = None
        if self.get_parameter('publish_joint_trajectory').value:
            self._trajectory_pub = self.create_lifecycle_publisher(
                JointTrajectory, '~/joint_trajectory', ACTIONS_QOS)
        # Diagnostics report in every state (also why the node is not active).
        self._diag_pub = self.create_publisher(DiagnosticArray, '/diagnostics', DIAGNOSTICS_QOS)

        state, query = self._state_group, self._query_group
        self.create_service(Snapshot, '~/snapshot', self._snapshot_callback, callback_group=state)
        self.create_service(Restore, '~/restore', self._restore_callback, callback_group=state)
        self.create_service(Fork, '~/fork', self._fork_callback, callback_group=state)
        self.create_service(Rollback, '~/rollback', self._rollback_callback, callback_group=state)
        self.create_service(DeleteCapsule, '~/delete_capsule', self._delete_callback,
                            callback_group=state)
        self.create_service(ListCapsules, '~/list_capsules', self._list_callback,
                            callback_group=query)
        self.create_service(Trigger, '~/state_digest', self._digest_callback,
                            callback_group=query)

        self._action_server = ActionServer(
            self, Generate, '~/generate', self._execute_callback,
            callback_group=self._action_group,
            goal_callback=self._goal_callback,
            handle_accepted_callback=self._handle_accepted_callback,
            cancel_callback=self._cancel_callback)

        # A silent QoS mismatch on ~/interrupt would lose every interrupt: it is reported.
        interrupt_events = SubscriptionEventCallbacks(
            incompatible_qos=self._interrupt_qos_mismatch, use_default_callbacks=False)
        subscriptions = (
            (String, '~/prompt', self._prompt_callback, COMMAND_QOS, None),
            (Interrupt, '~/interrupt', self._interrupt_callback, INTERRUPT_QOS, interrupt_events),
            (Empty, '~/reset', self._reset_callback, COMMAND_QOS, None),
            (JointState, '~/observation', self._joint_state_callback, OBSERVATION_QOS, None),
            (Float32MultiArray, '~/observation_vector', self._vector_callback, OBSERVATION_QOS,
             None),
        )
        for msg_type, topic, callback, qos, events in subscriptions:
            if not _MESSAGE_INFO and callback.__code__.co_argcount == 3:  # (self, msg, info)
                callback = functools.partial(_without_info, callback)
            self.create_subscription(msg_type, topic, callback, qos, callback_group=state,
                                     event_callbacks=events)
        period = self.get_parameter('diagnostics_period').value
        self.create_timer(period, self._diagnostics_callback, callback_group=query)
        self._event_thread.start()

    def create_publisher(self, *args, event_callbacks=None, **kwargs):
        """Create a publisher with no QoS event handlers unless given (see NO_PUB_EVENTS)."""
        return super().create_publisher(*args, event_callbacks=event_callbacks or NO_PUB_EVENTS,
                                        **kwargs)

    def create_lifecycle_publisher(self, *args, event_callbacks=None, **kwargs):
        """Create a lifecycle publisher with no QoS event handlers unless given."""
        return super().create_lifecycle_publisher(
            *args, event_callbacks=event_callbacks or NO_PUB_EVENTS, **kwargs)

    def create_subscription(self, *args, event_callbacks=None, **kwargs):
        """Create a subscription with no QoS event handlers unless given (NO_SUB_EVENTS)."""
        return super().create_subscription(
            *args, event_callbacks=event_callbacks or NO_SUB_EVENTS, **kwargs)

    # ---- parameters ------------------------------------------------------------------

    def _declare_parameters(self):
        rebuild = ' Takes effect at the next configure.'
        string_array = ParameterType.PARAMETER_STRING_ARRAY
        params = [
            ('autostart', True, _descriptor(
                'Walk through configure and activate at startup, so a plain `ros2 run` serves.')),
            ('mode', 'lm', _descriptor(
                'lm: a language model (~/generate, ~/prompt); policy: a robot policy '
                '(~/observation -> ~/actions). Must match the model.' + rebuild,
                constraints='lm | policy')),
            ('model', 'builtin:tiny-hybrid', _descriptor(
                'Model: builtin:<id> (random weights, no download) or a local checkpoint '
                'directory (save_pretrained folder with its tokenizer).' + rebuild)),
            ('device', 'cpu', _descriptor('Device: cpu, cuda or cuda:N.' + rebuild,
                                          constraints='cpu | cuda | cuda:N')),
            ('dtype', 'float32', _descriptor('Weight and state dtype.' + rebuild,
                                             constraints='float32 | bfloat16 | float16')),
            ('max_seq_len', 4096, _descriptor(
                'KV capacity in tokens; the state arena is sized for it.' + rebuild,
                integer=(8, 1 << 20))),
            ('device_budget_bytes', 256 << 20, _descriptor(
                'Byte budget of the device capsule tier (0 = unlimited).' + rebuild,
                integer=(0, _MAX_INT))),
            ('host_budget_bytes', 1 << 30, _descriptor(
                'Byte budget of the host-memory capsule tier (0 = unlimited).' + rebuild,
                integer=(0, _MAX_INT))),
            ('disk_budget_bytes', 4 << 30, _descriptor(
                'Byte budget of the capsule directory (0 = unlimited).' + rebuild,
                integer=(0, _MAX_INT))),
            ('capsule_dir', '~/.cache/flashrt_ros/capsules', _descriptor(
                'Directory of the disk tier; capsules there outlive the node.' + rebuild)),
            ('eviction', 'refuse', _descriptor(
                'When a tier is full: refuse the snapshot, or evict least-recently-used '
                'unpinned capsules.' + rebuild, constraints='refuse | lru')),
            ('cuda_graphs', True, _descriptor(
                'Capture the decode step as a CUDA graph at activation (ignored on CPU).'
                + rebuild)),
            ('rollback_depth', 8, _descriptor(
                'Committed boundaries kept for ~/rollback.' + rebuild, integer=(0, 1024))),
            ('seed', 0, _descriptor('Initial sampler seed.' + rebuild,
                                    integer=(0, 2 ** 31 - 1))),
            ('home_capsule', 'home', _descriptor(
                'Name of the capsule taken at activation (system prompt prefilled); '
                '~/reset and the restore_home policy restore it.')),
            ('system_prompt', 'You are a helpful robot.', _descriptor(
                'Text prefilled at activation before the home capsule is taken (may be empty; '
                'ignored in policy mode).')),
            ('interrupt_policy', 'stop', _descriptor(
                'What an interrupt (or a goal cancel) does after stopping at the step '
                'boundary: stop (keep that state), rollback (one committed boundary back) or '
                'restore_home.', constraints='stop | rollback | restore_home')),
            ('goal_policy', 'reject', _descriptor(
                'A generation request while one is running or queued: reject it, or queue it.',
                constraints='reject | queue')),
            ('max_new_tokens', 64, _descriptor(
                'Token limit of a turn when the goal says 0 (and for ~/prompt).',
                integer=(1, 1 << 20))),
            ('token_chunk', 1, _descriptor(
                'Tokens per TokenChunk on ~/tokens and in the action feedback.',
                integer=(1, 4096))),
            ('stop_strings', [], _descriptor(
                'Stop strings used when a goal gives none (and for ~/prompt).',
                ptype=string_array)),
            ('interrupt_timeout', 5.0, _descriptor(
                'Seconds ~/interrupt, ~/reset and deactivate wait for the generation to reach '
                'a step boundary.', floating=(0.01, 600.0))),
            ('stepping', 'observation', _descriptor(
                'Policy mode. observation: one control step per observation message, whole '
                'chunk published; timer: control_rate timer steps on the newest observation '
                'and publishes one queued action per tick.' + rebuild,
                constraints='observation | timer')),
            ('control_rate', 10.0, _descriptor(
                'Policy mode: control steps per second of the timer, and the spacing of '
                'JointTrajectory points.' + rebuild, floating=(0.1, 1000.0))),
            ('publish_joint_trajectory', False, _descriptor(
                'Policy mode: also publish actions as trajectory_msgs/JointTrajectory on '
                '~/joint_trajectory (read at startup).')),
            ('trajectory_field', 'positions', _descriptor(
                'JointTrajectoryPoint field the actions fill.',
                constraints='positions | velocities | accelerations | effort')),
            ('diagnostics_period', 1.0, _descriptor(
                'Seconds between /diagnostics messages (read at startup).',
                floating=(0.05, 3600.0))),
        ]
        for name, default, descriptor in params:
            self.declare_parameter(name, default, descriptor)
        for parameter in self.get_parameters(list(CHOICES)):
            problem = self._choice_problem(parameter.name, parameter.value)
            if problem:
                self.get_logger().error(problem)

    @staticmethod
    def _choice_problem(name, value):
        allowed = CHOICES.get(name)
        if allowed is not None and value not in allowed:
            return f'parameter {name}={value!r} is not valid; use one of {", ".join(allowed)}'
        return ''

    def _validate_parameters(self, parameters):
        for parameter in parameters:
            problem = self._choice_problem(parameter.name, parameter.value)
            if problem:
                return SetParametersResult(successful=False, reason=problem)
        return SetParametersResult(successful=True)

    def _param(self, name):
        return self.get_parameter(name).value

    # ---- lifecycle -------------------------------------------------------------------

    def on_configure(self, state):
        """Load the model and allocate the state arena."""
        try:
            for name in CHOICES:
                problem = self._choice_problem(name, self._param(name))
                if problem:
                    raise FlashRTError(problem)
            values = {name: self._param(name) for name in RUNTIME_PARAMS}
            t0 = time.perf_counter()
            self._runtime = Runtime(RuntimeConfig.from_dict(values))
            policy = self._param('mode') == 'policy'
            if self._runtime.is_policy != policy:
                kind = 'a robot policy' if self._runtime.is_policy else 'a language model'
                raise FlashRTError(f'model {values["model"]!r} is {kind}; set mode to '
                                   f'{"policy" if self._runtime.is_policy else "lm"}')
        except Exception as exc:  # FlashRTError, or an import/OS error loading the model
            self.get_logger().error(f'configure failed: {exc}; fix the parameters and configure '
                                    'again (lifecycle ~/change_state)')
            if self._runtime is not None:
                self._runtime.close()
            self._runtime = None
            return TransitionCallbackReturn.FAILURE
        rt = self._runtime
        self.get_logger().info(
            f'configured {values["model"]} on {values["device"]} ({values["dtype"]}): state '
            f'{rt.state_nbytes} bytes {list(rt.components)} in {time.perf_counter() - t0:.1f} s')
        if rt.is_policy and self._param('stepping') == 'timer':
            self._control_timer = self.create_timer(1.0 / self._param('control_rate'),
                                                    self._control_tick,
                                                    callback_group=self._state_group)
        self._start_worker()
        return super().on_configure(state)

    def on_activate(self, state):
        """Warm up, prefill the system prompt and snapshot the home capsule."""
        rt = self._runtime
        home = self._param('home_capsule')
        info = None
        try:
            rt.warmup()
            if not self._home_ready:
                rt.reset()
                prompt = self._param('system_prompt')
                if prompt and not rt.is_policy:
                    rt.prefill(prompt)
                info = rt.snapshot(home, 'device', pinned=True)
                self._home_ready = True
        except Exception as exc:
            self.get_logger().error(f'activate failed: {exc}')
            return TransitionCallbackReturn.FAILURE
        result = super().on_activate(state)  # activates the lifecycle publishers
        with self._cv:
            self._active = True
        if info is not None:
            self._publish_event('snapshot', info.name, info.tier, info.nbytes,
                                info.latency_s * 1e3, True,
                                f'home capsule at position {info.position}')
        # The model, arena and warm-up left many long-lived objects; a full collection over
        # them takes ~175 ms on a small CPU and could land in the middle of a decode step or
        # an interrupt. Move them out of the collector's reach.
        gc.collect()
        gc.freeze()
        self.get_logger().info(f'active: home capsule {home!r} at position {rt.position}')
        return result

    def on_deactivate(self, state):
        """Stop the running generation at its next step and drop queued turns."""
        with self._cv:
            self._active = False
        self._forget_observations()  # an observation pending now is stale after activate
        self._drop_queued('the node was deactivated before the turn started')
        with self._generation_stopped() as stopped:
            if not stopped:
                self.get_logger().warning('the generation did not stop within interrupt_timeout')
        self._flush_events()  # events of the active phase go out before ~/events is disabled
        return super().on_deactivate(state)

    def on_cleanup(self, state):
        """Free the model, arena and memory capsules (disk capsules stay)."""
        self._release_runtime()
        return super().on_cleanup(state)

    def on_shutdown(self, state):
        """Stop everything, from any state."""
        with self._cv:
            self._active = False
        self._drop_queued('the node is shutting down')
        with self._generation_stopped():
            pass
        self._release_runtime()
        return super().on_shutdown(state)

    def on_error(self, state):
        """Free what is left; the node goes back to unconfigured."""
        self.get_logger().error(f'lifecycle error in state {state.label}; cleaning up')
        with self._cv:
            self._active = False
        self._release_runtime()
        return TransitionCallbackReturn.SUCCESS

    def _release_runtime(self):
        self._stop_worker()
        if self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = None
        self._latest_observation = None
        if self._runtime is not None:
            try:
                self._runtime.close()
            except Exception as exc:
                self.get_logger().warning(f'closing the runtime: {exc}')
        self._runtime = None
        self._home_ready = False

    def _state_label(self):
        if self._active:
            return 'active'
        return 'inactive' if self._runtime is not None else 'unconfigured'

    def _not_active_message(self):
        return (f'the node is {self._state_label()}; configure and activate it '
                '(lifecycle ~/change_state) first')

    # ---- events and errors -----------------------------------------------------------

    def _publish_event(self, operation, name, tier, size_bytes, latency_ms, success, message,
                       stamp=None):
        """Queue a CapsuleEvent, stamped now (or `stamp`), for the events thread to publish."""
        if not self._active:
            return
        rt = self._runtime
        fields = {'operation': operation, 'name': name or '', 'tier': tier or '',
                  'size_bytes': max(0, int(size_bytes)), 'latency_ms': float(latency_ms),
                  'position': int(rt.position) if rt is not None else 0,
                  'success': bool(success), 'message': message}
        self._event_queue.put((fields, stamp or self.get_clock().now()))

    def _event_loop(self):
        """
        Publish queued events until None arrives (the events thread).

        Building and publishing a CapsuleEvent takes 50-150 us; done here, it is off the
        path of the service response that reports the same operation.
        """
        while (item := self._event_queue.get()) is not None:
            if isinstance(item, threading.Event):  # a flush marker: all before it is out
                item.set()
                continue
            try:
                fields, stamp = item
                event = CapsuleEvent(**fields)
                event.header.stamp = stamp.to_msg()
                self._events_pub.publish(event)
            except Exception as exc:  # e.g. the context shut down under us; keep the thread
                self.get_logger().warning(f'could not publish a capsule event: {exc!r}')

    def _flush_events(self, timeout=1.0):
        """Wait until the events queued so far are published."""
        marker = threading.Event()
        self._event_queue.put(marker)
        marker.wait(timeout)

    def destroy_node(self):
        """Stop the events thread, then destroy the node."""
        self._event_queue.put(None)
        self._event_thread.join(timeout=2.0)
        super().destroy_node()

    def _serve(self, operation, name, tier, response, op):
        """Run op() -> (info, message) and fill response; every failure -> success=false."""
        if not self._active:
            response.success, response.message = False, self._not_active_message()
            return response
        try:
            info, message = op()
        except FlashRTError as exc:
            message = BUSY_MESSAGE if isinstance(exc, BusyError) else str(exc)
            self.get_logger().warning(f'{operation} {name!r} failed: {message}')
            self._publish_event(operation, name, tier, 0, 0.0, False, message)
            response.success, response.message = False, message
            return response
        except Exception as exc:  # a bug, not bad input: report it and keep serving
            message = f'internal error in {operation}: {exc!r}'
            self.get_logger().error(message)
            self._publish_event(operation, name, tier, 0, 0.0, False, message)
            response.success, response.message = False, message
            return response
        response.success, response.message = True, message
        if info is not None:
            self._publish_event(operation, info.name, info.tier, info.nbytes,
                                info.latency_s * 1e3, True, message)
        self._publish_evictions()
        return response

    def _publish_evictions(self):
        """Report capsules the lru budget policy evicted to make room."""
        if self._runtime is None:
            return
        for info in self._runtime.drain_evictions():
            self.get_logger().info(f'evicted capsule {info.name!r} ({info.tier}, '
                                   f'{info.nbytes} bytes) to stay within the budget')
            self._publish_event('evict', info.name, info.tier, info.nbytes, 0.0, True,
                                'evicted (least recently used) to stay within the budget')

    @contextlib.contextmanager
    def _exclusive(self):
        """Keep new turns from starting; raise BusyError if a generation runs now."""
        with self._cv:
            if self._current is not None:
                raise BusyError(BUSY_MESSAGE)
            self._holds += 1
        try:
            yield
        finally:
            with self._cv:
                self._holds -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def _turns_held(self):
        """Keep queued turns from starting; yield the running or ending turn (None: idle)."""
        with self._cv:
            self._holds += 1
            turn = self._current or self._ending
        try:
            yield turn
        finally:
            with self._cv:
                self._holds -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def _generation_stopped(self):
        """Stop the running generation at its next step; yield whether it ended in time."""
        with self._turns_held() as turn:
            if self._runtime is not None:
                self._runtime.interrupt()
            # Ended means done, not just counted out: its final chunk is published (a
            # deactivate must not disable ~/tokens before that) and its result is ready.
            yield turn is None or turn.done.wait(self._param('interrupt_timeout'))

    # ---- capsule services ------------------------------------------------------------

    def _snapshot_callback(self, request, response):
        tier = request.tier or 'device'

        def op():
            info = self._runtime.snapshot(request.name, tier, request.pinned)
            _info_msg(info, response.capsule)
            response.latency_ms = info.latency_s * 1e3
            return info, (f'snapshot {info.name!r}: {info.nbytes} bytes in {info.tier} at '
                          f'position {info.position}, {response.latency_ms:.3f} ms')
        return self._serve('snapshot', request.name, tier, response, op)

    def _restore_callback(self, request, response):
        mode = request.mode or Restore.Request.MODE_FULL

        def op():
            with self._exclusive():
                info = self._runtime.restore(request.name, mode)
                self._forget_observations()
            _info_msg(info, response.capsule)
            response.latency_ms = info.latency_s * 1e3
            return info, (f'restored {info.name!r} ({mode}) from {info.tier}: position '
                          f'{info.position}, {response.latency_ms:.3f} ms')
        return self._serve('restore', request.name, '', response, op)

    def _fork_callback(self, request, response):
        def op():
            info = self._runtime.fork(request.source, request.target, request.tier or None)
            _info_msg(info, response.capsule)
            response.latency_ms = info.latency_s * 1e3
            return info, (f'forked {request.source!r} -> {info.name!r} in {info.tier} '
                          f'({info.nbytes} bytes), {response.latency_ms:.3f} ms')
        return self._serve('fork', request.target, request.tier, response, op)

    def _rollback_callback(self, request, response):
        boundaries = max(1, int(request.boundaries))

        def op():
            with self._exclusive():
                info = self._runtime.rollback(boundaries)
                self._forget_observations()
            _info_msg(info, response.capsule)
            response.position = int(info.position)
            response.latency_ms = info.latency_s * 1e3
            return info, (f'rolled back {boundaries} boundaries to position {info.position}, '
                          f'{response.latency_ms:.3f} ms')
        return self._serve('rollback', '', 'device', response, op)

    def _delete_callback(self, request, response):
        def op():
            info = self._runtime.delete_capsule(request.name)
            response.freed_bytes = int(info.nbytes)
            return info, f'deleted {info.name!r} from {info.tier}, freed {info.nbytes} bytes'
        return self._serve('delete', request.name, '', response, op)

    def _list_callback(self, request, response):
        if self._runtime is None:
            response.success, response.message = False, self._not_active_message()
            return response
        try:
            unreadable = []
            infos = self._runtime.list_capsules(request.tier or None, unreadable)
        except FlashRTError as exc:
            response.success, response.message = False, str(exc)
            return response
        except Exception as exc:
            response.success, response.message = False, f'internal error in list: {exc!r}'
            self.get_logger().error(response.message)
            return response
        response.capsules = [_info_msg(i) for i in infos]
        counts = collections.Counter(i.tier for i in infos)
        tiers = ', '.join(f'{t} {counts.get(t, 0)}' for t in ('device', 'host', 'disk'))
        response.success = True
        response.message = (f'{len(infos)} capsules ({tiers}); live position '
                            f'{self._runtime.position}; node {self._state_label()}')
        if unreadable:
            response.message += (
                f'; {len(unreadable)} unreadable capsule files on disk, not listed '
                f'({", ".join(unreadable[:5])}): restore one to see why, delete it to free '
                'its space')
        return response

    def _digest_callback(self, request, response):
        """Answer the sha256 of the live state (waits for the next step boundary)."""
        rt = self._runtime
        if rt is None:
            response.success, response.message = False, self._not_active_message()
            return response
        try:
            response.message = rt.state_digest()
            response.success = True
        except Exception as exc:
            response.success, response.message = False, str(exc)
        return response

    # ---- interrupt and reset topics --------------------------------------------------

    def _interrupt_callback(self, msg, msg_info):
        received = self._received_time(msg_info)
        mode = msg.mode
        if mode == Interrupt.POLICY:
            mode = {'stop': Interrupt.STOP, 'rollback': Interrupt.ROLLBACK,
                    'restore_home': Interrupt.RESTORE}[self._param('interrupt_policy')]
        self._stop_and_apply('interrupt', mode, max(1, msg.boundaries),
                             msg.capsule or self._param('home_capsule'), msg.reason, received)

    def _interrupt_qos_mismatch(self, event):
        policy = qos_policy_name_from_kind(event.last_policy_kind)
        self.get_logger().error(
            f'a publisher on ~/interrupt offers QoS incompatible with this subscription '
            f'(policy {policy}): none of its interrupts will arrive. Publish them RELIABLE, '
            'VOLATILE (flashrt_ros.client.INTERRUPT_QOS).')

    def _reset_callback(self, msg, msg_info):
        received = self._received_time(msg_info)
        self._stop_and_apply('reset', Interrupt.RESTORE, 1, self._param('home_capsule'),
                             'reset', received)

    @staticmethod
    def _received_time(msg_info):
        """Wall time the middleware received the message (falls back to now)."""
        now = time.time()
        stamp = (msg_info or {}).get('received_timestamp') or 0
        received = stamp / 1e9
        return received if now - 10.0 < received <= now + 0.001 else now

    def _forget_observations(self, before=None):
        """Drop observations received before `before` (default now): another episode's."""
        self._interrupted_at = max(self._interrupted_at, before or time.time())
        self._latest_observation = None

    def _stop_and_apply(self, operation, mode, boundaries, capsule, reason, received):
        """
        Stop the generation, then stop/roll back/restore.

        STOP waits for the step in flight to finish (the state stays a clean boundary);
        ROLLBACK and RESTORE replace the state anyway, so they abandon the step in flight at
        its next module call (the runtime's preempt) instead of waiting for it to end.
        """
        if not self._active:
            self.get_logger().warning(f'{operation} ignored: {self._not_active_message()}')
            return
        name, tier, nbytes, success = '', '', 0, True
        self._forget_observations(received)
        rt = self._runtime
        replaced_at = None
        try:
            if mode == Interrupt.STOP:
                with self._generation_stopped() as stopped:
                    if not stopped:
                        raise FlashRTError('the generation did not reach a step boundary '
                                           'within interrupt_timeout; raise it or check the '
                                           'node log')
                    message = f'stopped at position {rt.position}'
            elif mode in (Interrupt.ROLLBACK, Interrupt.RESTORE):
                info, message, replaced_at = self._replace_state(operation, mode, boundaries,
                                                                 capsule)
                name, tier, nbytes = info.name, info.tier, info.nbytes
            else:
                raise FlashRTError(f'interrupt mode {mode} is not valid; use 0 (POLICY), '
                                   '1 (STOP), 2 (ROLLBACK) or 3 (RESTORE)')
            if rt.is_policy:
                # After the restore: a restored capsule may hold an older chunk's queue.
                rt.drop_actions()
                message += '; action queue dropped'
        except Exception as exc:
            success, message = False, f'{operation} failed: {exc}'
            if mode != Interrupt.STOP:  # still stop: an interrupt must not go unheeded
                with self._generation_stopped():
                    message += f'; stopped at position {rt.position} instead'
            self.get_logger().warning(message)
        wall, stamp = replaced_at or (time.time(), None)
        if reason:
            message += f' (reason: {reason})'
        name = name or (capsule if mode == Interrupt.RESTORE else '')  # STOP names none
        self._publish_event(operation, name, tier, nbytes, (wall - received) * 1e3, success,
                            message, stamp)

    def _replace_state(self, operation, mode, boundaries, capsule):
        """
        Roll back or restore now, ending a running turn mid-step; return (info, message, at).

        The running turn is marked first, so that it does not save_as the state put in its
        place. Queued turns are held back until it is over, and only then does the caller
        publish its event: a client that chains a restore or a goal on the event must not
        find the node busy. `at` is (wall time, ROS time) of the restore itself, for the
        event's latency and stamp.
        """
        who = 'a reset' if operation == 'reset' else 'an interrupt'
        what = (f'rolled back {boundaries} boundaries' if mode == Interrupt.ROLLBACK
                else f'restored {capsule!r}')
        with self._turns_held() as turn:
            if turn is not None:
                with self._start_lock:  # after its start_from restore or save_as, if begun
                    turn.replaced = f'{who} {what}'
            try:
                if mode == Interrupt.ROLLBACK:
                    info = self._runtime.rollback(boundaries, preempt=True)
                    message = f'stopped and rolled back {boundaries} to position {info.position}'
                else:
                    info = self._runtime.restore(capsule, preempt=True)
                    message = f'stopped and restored {capsule!r} at position {info.position}'
            except Exception:
                if turn is not None:
                    turn.replaced = ''  # refused (checked before anything stopped)
                raise
            at = time.time(), self.get_clock().now()
            if turn is not None and not turn.done.wait(self._param('interrupt_timeout')):
                message += '; the interrupted turn did not end within interrupt_timeout'
        return info, message, at

    # ---- policy mode: observations in, actions out --------------------------------------

    def _policy_runtime(self):
        """Return the runtime when the node is active in policy mode, else None (and warn)."""
        rt = self._runtime
        if self._active and rt is not None and rt.is_policy:
            return rt
        reason = self._not_active_message() if not self._active else 'the node runs mode lm'
        self.get_logger().warning(f'observation ignored: {reason}', throttle_duration_sec=5.0)
        return None

    def _joint_state_callback(self, msg, msg_info):
        """Build the observation vector from a JointState by the policy's observation_names."""
        rt = self._policy_runtime()
        if rt is None:
            return
        try:
            values = _joint_state_vector(msg, rt.policy_spec.observation_names)
        except ValueError as exc:
            self._reject_observation(str(exc))
            return
        self._observe(rt, values, msg_info)

    def _vector_callback(self, msg, msg_info):
        """Take a Float32MultiArray as the raw observation vector."""
        rt = self._policy_runtime()
        if rt is not None:
            self._observe(rt, list(msg.data), msg_info)

    def _observe(self, rt, values, msg_info):
        if self._received_time(msg_info) <= self._interrupted_at:
            return  # sent before the last interrupt/reset: it belongs to the stopped episode
        if self._control_timer is None:
            self._control_step(rt, values)
            return
        try:
            rt.check_observation(values)
        except FlashRTError as exc:
            self._reject_observation(str(exc))
            return
        self._latest_observation = values

    def _control_step(self, rt, values):
        """Fold one observation in (a committed boundary); observation stepping publishes."""
        try:
            chunk = rt.act(values)
        except InvalidRequestError as exc:  # bad input, refused before the state was touched
            self._reject_observation(str(exc))
            return
        except Exception as exc:  # the model failed mid-step: report it and keep serving
            message = f'control step failed: {exc!r}'
            self.get_logger().error(message)
            self._publish_event('observation', '', '', 0, 0.0, False, message)
            return
        if self._control_timer is None:
            self._publish_actions(chunk.step, chunk.actions.tolist(), chunk.names)

    def _control_tick(self):
        """Timer stepping: step on the newest observation, then publish one queued action."""
        rt = self._runtime
        if not self._active or rt is None:
            return
        values, self._latest_observation = self._latest_observation, None
        if values is not None:
            self._control_step(rt, values)
        try:
            action = rt.next_action()
        except FlashRTError as exc:
            self.get_logger().warning(f'control tick: {exc}', throttle_duration_sec=5.0)
            return
        if action is not None:
            self._publish_actions(rt.position, [action.tolist()], rt.policy_spec.joint_names)

    def _reject_observation(self, reason):
        rt = self._runtime
        message = f'observation rejected: {reason}; state unchanged at step {rt.position}'
        self.get_logger().warning(message, throttle_duration_sec=1.0)
        self._publish_event('observation', '', '', 0, 0.0, False, message)

    def _publish_actions(self, step, rows, names):
        """Publish action rows [[a_0..a_A-1], ...] as an ActionChunk (and a trajectory)."""
        stamp = self.get_clock().now().to_msg()
        msg = ActionChunk(step=int(step), horizon=len(rows), action_dim=len(rows[0]),
                          actions=[float(a) for row in rows for a in row], names=list(names))
        msg.header.stamp = stamp
        self._actions_pub.publish(msg)
        if self._trajectory_pub is None:
            return
        dt = 1.0 / self._param('control_rate')
        field = self._param('trajectory_field')
        trajectory = JointTrajectory(joint_names=list(names) or
                                     [f'action_{i}' for i in range(len(rows[0]))])
        trajectory.header.stamp = stamp
        for i, row in enumerate(rows):
            point = JointTrajectoryPoint(time_from_start=_duration((i + 1) * dt))
            setattr(point, field, [float(a) for a in row])
            trajectory.points.append(point)
        self._trajectory_pub.publish(trajectory)

    # ---- generation: action, ~/prompt, generation thread --------------------------------

    def _reserve_turn(self, source):
        """Count a new turn in, or explain why it is refused ('' when accepted)."""
        with self._cv:
            if not self._active:
                return self._not_active_message()
            if self._runtime is not None and self._runtime.is_policy:
                return (f'{source} rejected: the node runs a robot policy (mode policy); '
                        'publish observations on ~/observation instead')
            if self._reserved > 0 and self._param('goal_policy') == 'reject':
                return (f'{source} rejected: a generation is already running or queued and '
                        'goal_policy is reject; cancel it, wait, or set goal_policy to queue')
            self._reserved += 1
            return ''

    def _goal_callback(self, goal_request):
        refusal = self._reserve_turn('goal')
        if refusal:
            self.get_logger().warning(refusal)
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def _handle_accepted_callback(self, goal_handle):
        # The goal stays ACCEPTED (not EXECUTING) while queued; the generation thread calls
        # goal_handle.execute() when it starts the turn.
        key = bytes(goal_handle.goal_id.uuid)
        turn = _Turn(goal_handle.request, goal_handle)
        with self._cv:
            self._turns_by_goal[key] = turn
            if key in self._early_cancels:
                self._early_cancels.discard(key)
                turn.cancel_requested = True
        self._enqueue(turn)

    def _cancel_callback(self, goal_handle):
        key = bytes(goal_handle.goal_id.uuid)
        with self._cv:
            turn = self._turns_by_goal.get(key)
            if turn is None:
                # rclpy answers a goal before it calls _handle_accepted_callback: a cancel
                # sent as soon as the goal is accepted can come first. Remember it; the
                # turn then ends before it starts.
                if not goal_handle.is_active:
                    return CancelResponse.REJECT
                self._early_cancels.add(key)
                return CancelResponse.ACCEPT
            if turn.settled:  # over, or about to say so: a cancel would only relabel it
                return CancelResponse.REJECT
            turn.cancel_requested = True
            queued = turn in self._queue
            if queued:  # end it now rather than when the running turn ends
                self._queue.remove(turn)
                self._reserved -= 1
                turn.settled = True
            running = self._current is turn
        if queued:
            self._finish_unstarted(turn, True, 'cancelled before it started')
        elif running and self._runtime is not None:
            self._runtime.interrupt()  # takes effect before the next decode step
        return CancelResponse.ACCEPT

    def _execute_callback(self, goal_handle):
        """Wait for the generation thread to finish this goal's turn; report the result."""
        key = bytes(goal_handle.goal_id.uuid)
        with self._cv:
            turn = self._turns_by_goal.get(key)
        if turn is None:
            goal_handle.abort()
            return Generate.Result(success=False, message='unknown goal', stop_reason='error')
        while not turn.done.wait(0.2):
            if not self.context.ok():
                break
        if turn.cancel_requested:
            # rclpy moves the goal to CANCELING only after _cancel_callback returns, and a
            # turn cancelled before it started can be over before that.
            deadline = time.monotonic() + 1.0
            while not goal_handle.is_cancel_requested and time.monotonic() < deadline:
                time.sleep(0.001)
        if goal_handle.is_cancel_requested:
            goal_handle.canceled()
        elif turn.result.success:
            goal_handle.succeed()
        else:
            goal_handle.abort()
        with self._cv:  # after the final status: a cancel until then finds the turn settled
            self._turns_by_goal.pop(key, None)
        return turn.result

    def _prompt_callback(self, msg):
        refusal = self._reserve_turn('prompt')
        if refusal:
            self.get_logger().warning(refusal)
            return
        self._enqueue(_Turn(Generate.Goal(prompt=msg.data)))

    def _enqueue(self, turn):
        with self._cv:
            cancelled = turn.cancel_requested  # see _cancel_callback
            if self._active and self._worker is not None and not cancelled:
                self._queue.append(turn)
                self._cv.notify_all()
                return
            self._reserved -= 1
            turn.settled = True
        if cancelled:
            self._finish_unstarted(turn, True, 'cancelled before it started')
        else:
            self._finish_unstarted(turn, False, self._not_active_message())

    def _finish_unstarted(self, turn, success, message):
        turn.result = Generate.Result(success=success, message=message,
                                      stop_reason='interrupted' if success else 'error',
                                      position=self._position())
        turn.done.set()
        if turn.goal_handle is not None:
            self._execute_goal(turn.goal_handle)

    @staticmethod
    def _execute_goal(goal_handle):
        """Mark the goal executing and schedule _execute_callback, which reports the result."""
        try:
            goal_handle.execute()
        except Exception:
            # A cancel moved the goal to CANCELING between execute()'s check for one and
            # its own move to EXECUTING; called again, it only schedules the callback.
            if not goal_handle.is_cancel_requested:
                raise
            goal_handle.execute()

    def _drop_queued(self, message):
        with self._cv:
            dropped = list(self._queue)
            self._queue.clear()
            self._reserved -= len(dropped)
            for turn in dropped:
                turn.settled = True
            self._cv.notify_all()
        for turn in dropped:
            self._finish_unstarted(turn, False, message)

    def _position(self):
        rt = self._runtime
        return int(rt.position) if rt is not None else 0

    def _start_worker(self):
        with self._cv:
            self._worker_stop = False
        self._worker = threading.Thread(target=self._generation_loop, name='flashrt-generation',
                                        daemon=True)
        self._worker.start()

    def _stop_worker(self):
        worker = self._worker
        if worker is None:
            return
        with self._cv:
            self._worker_stop = True
            self._cv.notify_all()
        if self._runtime is not None:
            self._runtime.interrupt()
        worker.join(timeout=max(1.0, self._param('interrupt_timeout')))
        self._worker = None

    def _generation_loop(self):
        """Run queued turns one at a time (the generation thread)."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._worker_stop or (self._queue and not self._holds))
                if self._worker_stop:
                    return
                turn = self._queue.popleft()
                self._current = turn
                self._turn_id += 1
                turn.turn_id = self._turn_id
            if self.tune_switch_interval:
                sys.setswitchinterval(SWITCH_INTERVAL_DECODING_S)
            try:
                self._run_turn(turn)
            except Exception as exc:  # a bug: end the turn with an error, keep the thread
                self.get_logger().error(f'generation turn failed: {exc!r}')
                turn.result = Generate.Result(success=False, stop_reason='error',
                                              message=f'internal error: {exc!r}',
                                              position=self._position())
                turn.final = turn.final or ([], '', 'error')
            finally:
                with self._cv:  # first: a cancel from here on would only relabel the outcome
                    self._current, self._ending = None, turn
                    self._reserved -= 1
                    turn.settled = True
                    self._cv.notify_all()
                if not turn.result.success:
                    self.get_logger().warning(f'generation turn failed: {turn.result.message}')
                if self.tune_switch_interval:  # the next turn sets the short one again
                    sys.setswitchinterval(SWITCH_INTERVAL_IDLE_S)
                # The final chunk says the turn is over: everything it does (save_as, the
                # cancel policy) is done, and the node takes the next goal or ~/prompt
                # (goal_policy reject counts this turn out before a client can react).
                try:
                    if turn.final is not None:
                        self._publish_chunk(turn, turn.streamed, *turn.final, final=True)
                except Exception as exc:  # e.g. the action server went away: keep the thread
                    self.get_logger().warning(f'could not publish the final chunk: {exc!r}')
                finally:
                    with self._cv:
                        if self._ending is turn:
                            self._ending = None
                    turn.done.set()

    def _run_turn(self, turn):
        goal, rt = turn.goal, self._runtime
        if turn.goal_handle is not None:
            self._execute_goal(turn.goal_handle)
        if turn.cancel_requested:
            turn.result = Generate.Result(success=True, stop_reason='interrupted',
                                          message='cancelled before it started',
                                          position=self._position())
            turn.final = [], '', 'interrupted'
            return
        failure = self._prepare_turn(turn)
        if failure:
            turn.result = Generate.Result(success=False, stop_reason='error', message=failure,
                                          position=self._position())
            turn.final = [], '', 'error'
            return
        try:
            gen = rt.generate(
                prompt=list(goal.token_ids) if len(goal.token_ids) else (goal.prompt or None),
                max_new_tokens=int(goal.max_new_tokens or self._param('max_new_tokens')),
                temperature=float(goal.temperature), top_k=int(goal.top_k),
                top_p=float(goal.top_p), seed=None if goal.seed < 0 else int(goal.seed),
                stop=tuple(goal.stop) or tuple(self._param('stop_strings')))
        except FlashRTError as exc:
            message = BUSY_MESSAGE if isinstance(exc, BusyError) else str(exc)
            turn.result = Generate.Result(success=False, stop_reason='error', message=message,
                                          position=self._position())
            turn.final = [], '', 'error'
            return
        chunk_size = self._param('token_chunk')
        ids, pieces = [], []
        try:
            if turn.cancel_requested or self._holds:
                gen.close()
            for event in gen:
                ids.append(event.token_id)
                pieces.append(event.text)
                if len(ids) >= chunk_size:
                    self._publish_chunk(turn, turn.streamed, ids, ''.join(pieces), '')
                    turn.streamed += len(ids)
                    ids, pieces = [], []
                if turn.cancel_requested or self._holds:
                    gen.close()  # an interrupt or cancel: stop at this step boundary
        except Exception as exc:
            gen.close()
            if gen.result is None:
                raise  # not the model: the generation loop reports it as a bug
            # The model step failed (out of memory, a NaN, ...): the runtime ended the turn
            # and put the state back; say so, and close the stream like any other turn.
            turn.final = ids, ''.join(pieces), gen.result.stop_reason
            where = ('the state is back at the last committed boundary'
                     if gen.result.stop_reason == 'error'
                     else 'a waiting restore/rollback replaced the state')
            turn.result = Generate.Result(
                success=False, stop_reason=gen.result.stop_reason,
                message=f'the model step failed: {exc!r}; {where} (position '
                        f'{self._position()})',
                text=gen.result.text, token_ids=list(gen.result.token_ids),
                position=self._position())
            return
        res = gen.result
        turn.final = ids, ''.join(pieces), res.stop_reason
        success, message = True, f'{len(res.token_ids)} tokens, stop reason {res.stop_reason}'
        with self._start_lock:  # an interrupt marks the turn before it replaces the state
            if goal.save_as and turn.replaced:  # the live state is no longer this turn's
                success = False
                message += (f'; save_as {goal.save_as!r} skipped: {turn.replaced} during '
                            'the turn')
            elif goal.save_as:
                saved = self._save_turn(goal.save_as, goal.save_tier or 'device')
                success = not saved.startswith('save_as')
                message += f'; {saved}'
        with self._cv:  # from here a cancel is refused: it could no longer change the outcome
            turn.settled = True
            cancelled = turn.cancel_requested
        if cancelled:
            message += '; cancelled, ' + self._apply_cancel_policy()
        turn.result = Generate.Result(
            success=success, message=message, text=res.text, token_ids=list(res.token_ids),
            stop_reason=res.stop_reason, time_to_first_token_ms=res.ttft_s * 1e3,
            tokens_per_second=res.tokens_per_s, position=self._position())

    def _prepare_turn(self, turn):
        """Restore the goal's start_from capsule; return an error message or ''."""
        goal = turn.goal
        if not goal.start_from:
            return ''
        with self._start_lock:
            if turn.replaced:  # an interrupt's restore came first: it wins, the turn ends
                return ''
            try:
                info = self._runtime.restore(goal.start_from)
            except FlashRTError as exc:
                message = f'start_from {goal.start_from!r} failed: {exc}'
                self._publish_event('restore', goal.start_from, '', 0, 0.0, False, message)
                return message
        self._publish_event('restore', info.name, info.tier, info.nbytes, info.latency_s * 1e3,
                            True, f'start_from {info.name!r} at position {info.position}')
        return ''

    def _save_turn(self, name, tier):
        try:
            info = self._runtime.snapshot(name, tier)
        except FlashRTError as exc:
            message = f'save_as {name!r} failed: {exc}'
            self._publish_event('snapshot', name, tier, 0, 0.0, False, message)
            return message
        self._publish_event('snapshot', info.name, info.tier, info.nbytes, info.latency_s * 1e3,
                            True, f'save_as {info.name!r} at position {info.position}')
        self._publish_evictions()
        return f'saved as {info.name!r} ({info.tier})'

    def _apply_cancel_policy(self):
        """Apply interrupt_policy after a cancelled goal (on the generation thread)."""
        t0 = time.perf_counter()
        policy = self._param('interrupt_policy')
        name, tier, nbytes, success = '', '', 0, True
        try:
            if policy == 'rollback':
                info = self._runtime.rollback(1)
                name, tier, nbytes = info.name, info.tier, info.nbytes
            elif policy == 'restore_home':
                info = self._runtime.restore(self._param('home_capsule'))
                name, tier, nbytes = info.name, info.tier, info.nbytes
            message = f'interrupt policy {policy} applied at position {self._position()}'
        except FlashRTError as exc:
            success, message = False, f'interrupt policy {policy} failed: {exc}'
        self._publish_event('interrupt', name, tier, nbytes, (time.perf_counter() - t0) * 1e3,
                            success, message + ' (reason: goal cancelled)')
        return message

    def _publish_chunk(self, turn, index, ids, text, stop_reason, final=False):
        chunk = TokenChunk(turn_id=turn.turn_id, index=index, token_ids=list(ids), text=text,
                           final=final, stop_reason=stop_reason)
        chunk.header.stamp = self.get_clock().now().to_msg()
        # The final chunk goes out while deactivating too: the lifecycle publisher stays
        # enabled until the transition ends (and drops what comes later).
        if self._active or final:
            try:
                self._tokens_pub.publish(chunk)
            except Exception as exc:  # e.g. the node is being destroyed
                self.get_logger().warning(f'could not publish a token chunk: {exc!r}')
        if turn.goal_handle is not None:
            turn.goal_handle.publish_feedback(Generate.Feedback(chunk=chunk))

    # ---- diagnostics -----------------------------------------------------------------

    def _diagnostics_callback(self):
        status = DiagnosticStatus(name=f'{self.get_fully_qualified_name()}: capsule runtime')
        rt = self._runtime
        values = {'lifecycle_state': self._state_label()}
        if rt is None:
            status.level, status.message = DiagnosticStatus.WARN, 'unconfigured'
        else:
            try:
                stats = rt.stats()
            except Exception as exc:
                stats = None
                status.level, status.message = DiagnosticStatus.WARN, f'no stats: {exc}'
            if stats is not None:
                status.hardware_id = str(stats.get('device', ''))
                values.update(model=stats.get('model', ''), dtype=stats.get('dtype', ''),
                              state_bytes=stats.get('state_nbytes', 0),
                              position=stats.get('position', 0),
                              generating=self._current is not None)
                for tier, t in stats.get('tiers', {}).items():
                    values[f'{tier}_capsules'] = t.get('count', 0)
                    values[f'{tier}_bytes_used'] = t.get('bytes_used', 0)
                    values[f'{tier}_budget_bytes'] = t.get('budget', 0)
                ring = stats.get('rollback_ring', {})
                values['rollback_ring_capsules'] = ring.get('count', 0)
                values['rollback_ring_bytes'] = ring.get('bytes_used', 0)
                values['last_restore_ms'] = f'{stats.get("last_restore_s", 0.0) * 1e3:.4f}'
                values['p99_restore_ms'] = f'{stats.get("p99_restore_s", 0.0) * 1e3:.4f}'
                values['last_restore_copied_bytes'] = stats.get('last_restore_copied_bytes', 0)
                values['decode_tokens_per_s'] = f'{stats.get("decode_tokens_per_s", 0.0):.1f}'
                values['cuda_graph'] = stats.get('cuda_graph', False)
                if 'control_step_s' in stats:
                    values['control_step_ms'] = f'{stats["control_step_s"] * 1e3:.3f}'
                if self._active:
                    status.level, status.message = DiagnosticStatus.OK, 'active'
                else:
                    status.level, status.message = DiagnosticStatus.WARN, self._state_label()
        status.values = [KeyValue(key=k, value=str(v)) for k, v in values.items()]
        array = DiagnosticArray(status=[status])
        array.header.stamp = self.get_clock().now().to_msg()
        self._diag_pub.publish(array)


def main(args=None):
    """Run the node until SIGINT/SIGTERM; return the process exit code."""
    # rclpy's own handlers are off: a node started in the background from a non-interactive
    # shell inherits SIGINT as ignored, so install handlers explicitly for both signals.
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    sys.setswitchinterval(SWITCH_INTERVAL_IDLE_S)
    stop = threading.Event()

    def request_stop(signum, frame):
        stop.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    node = None
    executor = MultiThreadedExecutor(num_threads=6)
    try:
        node = FlashRTNode()
        node.tune_switch_interval = True
        executor.add_node(node)
        if node.get_parameter('autostart').value and not stop.is_set():
            if node.trigger_configure() == TransitionCallbackReturn.SUCCESS and not stop.is_set():
                node.trigger_activate()

        def spin():
            spin_until_shutdown(executor, node.get_logger(),
                                lambda: stop.is_set() or not rclpy.ok())

        spinner = threading.Thread(target=spin, name='flashrt-executor', daemon=True)
        spinner.start()
        while not stop.wait(0.2) and rclpy.ok():
            pass
        node.get_logger().info('shutting down')
        try:
            node.trigger_shutdown()
        except Exception as exc:  # e.g. a transition was still in progress
            node.get_logger().warning(f'shutdown transition: {exc}')
            node.on_shutdown(None)
        executor.shutdown(timeout_sec=2.0)
        spinner.join(timeout=2.0)
        return 0
    except Exception as exc:
        print(f'flashrt_node: {exc!r}', file=sys.stderr)
        return 1
    finally:
        if node is not None:
            node.destroy_node()
        rclpy.try_shutdown()


if __name__ == '__main__':
    sys.exit(main())
