"""
The `flashrt` lifecycle node: ROS 2 entities mapped onto the session layer and the runtime.

Callbacks convert a message, call the session (who may touch the state, and when) or the
runtime, and convert back. ~/interrupt and ~/reset are taken on the control path
(control.py); the mode's inputs are subscribed on configure (inputs.py); what the session
publishes goes through outputs.py. Two mutually exclusive callback groups: `ordered` takes
what replaces the state or starts a turn (~/restore, ~/rollback, ~/prompt), one at a time
in arrival order; `state` takes the mode's inputs and the control timer. ~/snapshot, ~/fork
and ~/delete_capsule run side by side in a reentrant group, so an e-stop or a memory
snapshot never waits behind a disk snapshot's write. Cheap queries (list, digest,
diagnostics) use a reentrant group, and capsule transfers one of their own (transfer.py).
docs/architecture.md has more.
"""

import collections
import gc
import time

from diagnostic_msgs.msg import DiagnosticArray
from flashrt_ros.action import Generate
from flashrt_ros.qos import COMMAND_QOS, DIAGNOSTICS_QOS, FEEDBACK_QOS
from flashrt_ros.runtime import BusyError, FlashRTError, Runtime
from flashrt_ros.runtime.config import TIERS
from flashrt_ros.session import BUSY_MESSAGE, InterruptMode, Session, Turn, TurnRequest
from flashrt_ros.srv import DeleteCapsule, Fork, ListCapsules, Restore, Rollback, Snapshot
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
try:
    from rclpy.event_handler import PublisherEventCallbacks, SubscriptionEventCallbacks
except ImportError:  # Humble: the same classes before their module was renamed in Iron
    from rclpy.qos_event import PublisherEventCallbacks, SubscriptionEventCallbacks
from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn
from rclpy.qos import qos_policy_name_from_kind
from std_msgs.msg import String
from std_srvs.srv import Trigger
import torch

from . import messages, parameters
from .control import ControlPath
from .inputs import mode_inputs
from .outputs import RosOutputs
from .transfer import CapsuleTransfer

NODE_NAME = 'flashrt'
# With control_priority set, the generation thread's nice value: on a busy CPU a normal one
# is preempted holding the interpreter lock that a waking control thread needs.
GENERATION_NICE = -10
# No QoS event handlers on the node's entities (rclpy's own /parameter_events publisher
# included) except ~/interrupt's: each is a waitable that the executor walks on every
# wake-up, a cost on every service call. The peer's own handlers still report a mismatch.
NO_PUB_EVENTS = PublisherEventCallbacks(use_default_callbacks=False)
NO_SUB_EVENTS = SubscriptionEventCallbacks(use_default_callbacks=False)


class FlashRTNode(LifecycleNode):
    """Managed node serving capsule services, the generate action and the control topics."""

    def __init__(self, **kwargs):
        super().__init__(NODE_NAME, **kwargs)
        parameters.declare(self)
        self._session = None                # Session while configured
        self._goal_turns = None             # the last session's scheduler: goals it ended
        # What the session publishes through (lifecycle publishers: only while active).
        self.outputs = RosOutputs(self, self._param('publish_joint_trajectory'))
        self._control_timer = None
        self._stage = ''                    # what a configure/activate in progress is doing
        self.tune_switch_interval = False   # main() sets it (session/turns.py says why)

        self._state_group = MutuallyExclusiveCallbackGroup()
        # ~/snapshot, ~/fork, ~/delete_capsule: side by side (the runtime and the store are
        # thread-safe), so a memory snapshot never waits for a disk snapshot's write.
        self._capsule_group = ReentrantCallbackGroup()
        self._ordered_group = MutuallyExclusiveCallbackGroup()
        self._query_group = ReentrantCallbackGroup()
        self._action_group = ReentrantCallbackGroup()

        # Diagnostics report in every state (also why the node is not active).
        self._diag_pub = self.create_publisher(DiagnosticArray, '/diagnostics', DIAGNOSTICS_QOS)

        capsules, ordered, query = self._capsule_group, self._ordered_group, self._query_group
        for srv_type, name, callback, group in (
                (Snapshot, '~/snapshot', self._snapshot_callback, capsules),
                (Restore, '~/restore', self._restore_callback, ordered),
                (Fork, '~/fork', self._fork_callback, capsules),
                (Rollback, '~/rollback', self._rollback_callback, ordered),
                (DeleteCapsule, '~/delete_capsule', self._delete_callback, capsules),
                (ListCapsules, '~/list_capsules', self._list_callback, query),
                (Trigger, '~/state_digest', self._digest_callback, query)):
            self.create_service(srv_type, name, callback, callback_group=group)

        self._action_server = ActionServer(
            self, Generate, '~/generate', self._execute_callback,
            callback_group=self._action_group,
            goal_callback=self._goal_callback,
            handle_accepted_callback=self._handle_accepted_callback,
            cancel_callback=self._cancel_callback, feedback_pub_qos_profile=FEEDBACK_QOS)

        # ~/interrupt and ~/reset: the control path (control.py). A silent QoS mismatch on
        # ~/interrupt would lose every interrupt: it is reported.
        interrupt_events = SubscriptionEventCallbacks(
            incompatible_qos=self._interrupt_qos_mismatch, use_default_callbacks=False)
        self._control = ControlPath(self, self._param('control_executor'),
                                    self._interrupt_callback, self._reset_callback,
                                    interrupt_events, group=ordered)
        self._control.start(self.get_logger(), lambda: not self.context.ok(),
                            self._param('control_priority'), self._param('cpu_latency_us'))
        self.create_subscription(String, '~/prompt', self._prompt_callback, COMMAND_QOS,
                                 callback_group=ordered)
        self._inputs = None  # the mode's own subscriptions (inputs.py), while configured
        self.create_timer(self._param('diagnostics_period'), self._diagnostics_callback,
                          callback_group=query)
        # ~/export_manifest, ~/export_chunk, ~/import_capsule: a reentrant group of their own
        self._transfer = CapsuleTransfer(self)

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

    def _param(self, name):
        return self.get_parameter(name).value

    @property
    def session(self):
        """Return the session layer over the configured runtime (None while unconfigured)."""
        return self._session

    @property
    def active(self):
        session = self._session
        return session is not None and session.active

    @property
    def _runtime(self):
        session = self._session
        return session.runtime if session is not None else None

    # ---- lifecycle -------------------------------------------------------------------

    def on_configure(self, state):
        """Load the model, allocate the state arena and start the session."""
        runtime = None
        try:
            for name in parameters.CHOICES:
                problem = parameters.choice_problem(name, self._param(name))
                if problem:
                    raise FlashRTError(problem)
            config = parameters.runtime_config(self, self.get_fully_qualified_name())
            if self._param('compute_threads') > 0:  # process-wide, before the model loads
                torch.set_num_threads(self._param('compute_threads'))
            t0 = time.perf_counter()
            runtime = Runtime(config, progress=self._progress)
            session = Session(runtime, self._param('mode'), self._param, self.outputs)
            inputs = mode_inputs(self, session.mode, self._state_group)
        except Exception as exc:  # FlashRTError, or an import/OS error loading the model
            self._stage = ''
            self.get_logger().error(f'configure failed: {exc}; fix the parameters and configure '
                                    'again (lifecycle ~/change_state), or restart the node '
                                    'with them if they are read-only')
            if runtime is not None:
                runtime.close()
            return TransitionCallbackReturn.FAILURE
        self._stage = ''
        chat = 'conversation (chat template)' if runtime.chat is not None else 'raw text'
        self.get_logger().info(
            f'configured {config.model} on {config.device} ({runtime.stats().dtype}, {chat}): '
            f'state {runtime.state_nbytes} bytes {list(runtime.components)} in '
            f'{time.perf_counter() - t0:.1f} s')
        if config.speculation:
            self.get_logger().info(
                f'speculation: {messages.speculation_values(runtime.stats().speculation)}')
        period = session.mode.tick_period()
        if period is not None:
            self._control_timer = self.create_timer(period, self._control_tick,
                                                    callback_group=self._state_group)
        self._inputs = inputs
        session.turns.tune_switch_interval = self.tune_switch_interval
        if self._param('control_priority') > 0:  # the robot settings (docs/setup.md)
            session.turns.generation_nice = GENERATION_NICE
        session.turns.start()
        self._session, self._goal_turns = session, session.turns
        return super().on_configure(state)

    def on_activate(self, state):
        """Warm up, prefill the system prompt and snapshot the home capsule."""
        session = self._session
        home = self._param('home_capsule')
        try:
            info = session.warm_up(home, self._param('system_prompt'), self._progress)
        except Exception as exc:
            self.get_logger().error(f'activate failed: {exc}')
            return TransitionCallbackReturn.FAILURE
        finally:
            self._stage = ''
        result = super().on_activate(state)  # activates the lifecycle publishers
        session.turns.set_active(True)
        if info is not None:
            self.outputs.event('snapshot', info.name, info.tier, info.nbytes,
                               info.latency_s * 1e3, True,
                               f'home capsule at position {info.position}')
        # The model, arena and warm-up left many long-lived objects; a full collection over
        # them is slow and could land in the middle of a decode step or an interrupt. Move
        # them out of the collector's reach.
        gc.collect()
        gc.freeze()
        self.get_logger().info(f'active: home capsule {home!r} at position '
                               f'{session.runtime.position}')
        return result

    def on_deactivate(self, state):
        """Stop the running generation at its next step and drop queued turns."""
        if not self._session.deactivate('the node was deactivated before the turn started'):
            self.get_logger().warning('the generation did not stop within interrupt_timeout')
        self.outputs.flush_events()  # the active phase's events go out before ~/events stops
        return super().on_deactivate(state)

    def on_cleanup(self, state):
        """Free the model, arena and memory capsules (disk capsules stay)."""
        self._release_session()
        return super().on_cleanup(state)

    def on_shutdown(self, state):
        """Stop everything, from any state."""
        if self._session is not None:
            self._session.deactivate('the node is shutting down')
        self._release_session()
        return super().on_shutdown(state)

    def on_error(self, state):
        """Free what is left; the node goes back to unconfigured."""
        self.get_logger().error(f'lifecycle error in state {state.label}; cleaning up')
        self._release_session()
        return TransitionCallbackReturn.SUCCESS

    def _release_session(self):
        session, self._session = self._session, None
        if self._inputs is not None:
            self._inputs.destroy()
            self._inputs = None
        if self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = None
        if session is not None:
            try:
                session.close()
            except Exception as exc:
                self.get_logger().warning(f'closing the runtime: {exc}')
            # The closed runtime's objects were frozen at activate: give them back to the
            # collector (the next activate collects and freezes again).
            gc.unfreeze()

    def destroy_node(self):
        """Stop the control path and the events thread, then destroy the node."""
        # Also called on a node whose __init__ failed (rclpy's shutdown destroys every node
        # of the context): only what was built is stopped.
        control, outputs = getattr(self, '_control', None), getattr(self, 'outputs', None)
        if control is not None:
            control.stop()
        if outputs is not None:
            outputs.close()
        super().destroy_node()

    def state_label(self):
        if self.active:
            return 'active'
        return 'inactive' if self._session is not None else 'unconfigured'

    def not_active_message(self):
        return (f'the node is {self.state_label()}; configure and activate it '
                '(lifecycle ~/change_state) first')

    # ---- outputs -----------------------------------------------------------------------

    # ---- capsule services ------------------------------------------------------------

    def _call(self, operation, name, tier, response, call):
        """Return call()'s CapsuleInfo, or None with the failure in response and ~/events."""
        if not self.active:
            response.success, response.message = False, self.not_active_message()
            return None
        try:
            return call()
        except FlashRTError as exc:
            message = BUSY_MESSAGE if isinstance(exc, BusyError) else str(exc)
            self.get_logger().warning(f'{operation} {name!r} failed: {message}')
        except Exception as exc:  # a bug, not bad input: report it and keep serving
            message = f'internal error in {operation}: {exc!r}'
            self.get_logger().error(message)
        self.outputs.event(operation, name, tier, 0, 0.0, False, message)
        response.success, response.message = False, message
        return None

    def _succeed(self, operation, info, response, message):
        """Fill response (its capsule and latency, where it has them) and report the success."""
        if hasattr(response, 'capsule'):
            messages.info_msg(info, response.capsule)
            response.latency_ms = info.latency_s * 1e3
        response.success, response.message = True, message
        self.outputs.event(operation, info.name, info.tier, info.nbytes, info.latency_s * 1e3,
                           True, message)
        self.outputs.evictions()
        return response

    def _snapshot_callback(self, request, response):
        tier = request.tier or 'device'
        info = self._call('snapshot', request.name, tier, response,
                          lambda: self._session.snapshot(request.name, tier, request.pinned))
        if info is None:
            return response
        return self._succeed('snapshot', info, response, (
            f'snapshot {info.name!r}: {info.nbytes} bytes in {info.tier} at position '
            f'{info.position}, {info.latency_s * 1e3:.3f} ms'))

    def _restore_callback(self, request, response):
        mode = request.mode or Restore.Request.MODE_FULL
        self._control.barrier()  # after the interrupts that came first
        info = self._call('restore', request.name, '', response,
                          lambda: self._session.restore(request.name, mode))
        if info is None:
            return response
        return self._succeed('restore', info, response, (
            f'restored {info.name!r} ({mode}) from {info.tier}: position {info.position}, '
            f'{info.latency_s * 1e3:.3f} ms'))

    def _fork_callback(self, request, response):
        info = self._call('fork', request.target, request.tier, response,
                          lambda: self._session.fork(request.source, request.target,
                                                     request.tier or None))
        if info is None:
            return response
        return self._succeed('fork', info, response, (
            f'forked {request.source!r} -> {info.name!r} in {info.tier} ({info.nbytes} bytes), '
            f'{info.latency_s * 1e3:.3f} ms'))

    def _rollback_callback(self, request, response):
        boundaries = max(1, int(request.boundaries))
        self._control.barrier()
        info = self._call('rollback', '', 'device', response,
                          lambda: self._session.rollback(boundaries))
        if info is None:
            return response
        response.position = int(info.position)
        return self._succeed('rollback', info, response, (
            f'rolled back {boundaries} boundaries to position {info.position}, '
            f'{info.latency_s * 1e3:.3f} ms'))

    def _delete_callback(self, request, response):
        info = self._call('delete', request.name, '', response,
                          lambda: self._session.delete(request.name))
        if info is None:
            return response
        response.freed_bytes = int(info.nbytes)
        return self._succeed('delete', info, response, (
            f'deleted {info.name!r} from {info.tier}, freed {info.nbytes} bytes'))

    def _list_callback(self, request, response):
        rt = self._runtime
        if rt is None:
            response.success, response.message = False, self.not_active_message()
            return response
        try:
            unreadable, foreign = [], []
            infos = rt.list_capsules(request.tier or None, unreadable, foreign)
        except FlashRTError as exc:
            response.success, response.message = False, str(exc)
            return response
        except Exception as exc:
            response.success, response.message = False, f'internal error in list: {exc!r}'
            self.get_logger().error(response.message)
            return response
        response.capsules = [messages.info_msg(i) for i in infos]
        counts = collections.Counter(i.tier for i in infos)
        tiers = ', '.join(f'{t} {counts.get(t, 0)}' for t in TIERS)
        response.success = True
        response.message = (f'{len(infos)} capsules ({tiers}); live position {rt.position}; '
                            f'node {self.state_label()}')
        if unreadable:
            response.message += (
                f'; {len(unreadable)} unreadable capsule files on disk, not listed '
                f'({", ".join(unreadable[:5])}): restore one to see why, delete it to free '
                'its space')
        if foreign:
            response.message += (
                f'; {len(foreign)} files in capsule_dir that are not capsules, left alone '
                f'({", ".join(foreign[:5])})')
        return response

    def _digest_callback(self, request, response):
        """Answer the sha256 of the live state (waits for the next step boundary)."""
        rt = self._runtime
        if rt is None:
            response.success, response.message = False, self.not_active_message()
            return response
        try:
            response.message = rt.state_digest()
            response.success = True
        except Exception as exc:
            response.success, response.message = False, str(exc)
        return response

    # ---- interrupt and reset topics --------------------------------------------------

    def _interrupt_callback(self, msg, received, callback_at):
        self._apply_interrupt('interrupt', msg.mode, max(1, msg.boundaries), msg.capsule,
                              msg.reason, received, callback_at)

    def _reset_callback(self, msg, received, callback_at):
        self._apply_interrupt('reset', InterruptMode.RESTORE, 1, '', 'reset', received,
                              callback_at)

    def _apply_interrupt(self, operation, mode, boundaries, capsule, reason, received,
                         callback_at):
        session = self._session
        if session is None or not session.active:
            self.get_logger().warning(f'{operation} ignored: {self.not_active_message()}')
            return
        session.interrupts.apply(operation, mode, boundaries, capsule, reason, received,
                                 callback_at)

    def _interrupt_qos_mismatch(self, event):
        policy = qos_policy_name_from_kind(event.last_policy_kind)
        self.get_logger().error(
            f'a publisher on ~/interrupt offers QoS incompatible with this subscription '
            f'(policy {policy}): none of its interrupts will arrive. Publish them RELIABLE, '
            'VOLATILE (flashrt_ros.qos.INTERRUPT_QOS).')

    # ---- the control timer -------------------------------------------------------------

    def _control_tick(self):
        session = self._session
        if session is not None and session.active:
            session.mode.tick()

    # ---- generation: the action and ~/prompt -------------------------------------------

    def _reserve(self, session, source):
        refusal = (session.reserve_turn(source) if session is not None
                   else self.not_active_message())
        if refusal:
            self.get_logger().warning(refusal)
        return not refusal

    def _goal_callback(self, goal_request):
        self._control.barrier()
        return GoalResponse.ACCEPT if self._reserve(self._session, 'goal') else GoalResponse.REJECT

    def _handle_accepted_callback(self, goal_handle):
        # The goal stays ACCEPTED (not EXECUTING) while queued; the generation thread has
        # it executed when the turn starts.
        turn = Turn(messages.turn_request(goal_handle.request), goal_handle)
        session = self._session
        if session is None:  # cleaned up since it was accepted: report it unknown
            self.outputs.start_goal(turn)
            return
        session.turns.enqueue(turn, bytes(goal_handle.goal_id.uuid))

    def _cancel_callback(self, goal_handle):
        session = self._session
        accepted = session is not None and session.turns.cancel(
            bytes(goal_handle.goal_id.uuid), goal_handle.is_active)
        return CancelResponse.ACCEPT if accepted else CancelResponse.REJECT

    def _execute_callback(self, goal_handle):
        """Wait for the generation thread to finish this goal's turn; report the result."""
        key = bytes(goal_handle.goal_id.uuid)
        turns = self._goal_turns  # still there after a cleanup or shutdown ended the goal
        turn = turns.goal_turn(key) if turns is not None else None
        if turn is None:
            goal_handle.abort()
            return Generate.Result(success=False, message='unknown goal', stop_reason='error')
        while not turn.done.wait(0.2):
            if not self.context.ok():
                break
        if turn.cancel_requested:
            # rclpy moves the goal to CANCELING only after the cancel callback returns, and a
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
        turns.forget_goal(key)  # after the final status: a cancel until then finds it settled
        return messages.result_msg(turn.result)

    def _prompt_callback(self, msg):
        self._control.barrier()  # an interrupt sent before the prompt applies first
        session = self._session
        if self._reserve(session, 'prompt'):
            session.turns.enqueue(Turn(TurnRequest(prompt=msg.data)))

    # ---- diagnostics -----------------------------------------------------------------

    def _progress(self, stage):
        """Say what configure/activate is doing now: in the log and on /diagnostics at once."""
        self._stage = stage
        self.get_logger().info(f'{self.state_label()}: {stage}')
        self._diagnostics_callback()  # a transition blocks the timer until it ends

    def _diagnostics_callback(self):
        status = messages.diagnostic_status(
            f'{self.get_fully_qualified_name()}: capsule runtime', self.state_label(),
            self._session, self._stage, self.outputs.interrupt_stages.values())
        array = DiagnosticArray(status=[status])
        array.header.stamp = self.get_clock().now().to_msg()
        self._diag_pub.publish(array)
