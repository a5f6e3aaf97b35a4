"""
The session's outputs on ROS, whose publishers RosOutputs owns.

~/tokens and goal feedback, ~/events, ~/actions (and ~/joint_trajectory), ~/transcript,
~/end_of_utterance, and the log.
"""

import sys
import time

from flashrt_ros.action import Generate
from flashrt_ros.msg import ActionChunk, CapsuleEvent, EndOfUtterance, TokenChunk
from flashrt_ros.qos import ACTIONS_QOS, STREAM_QOS
from flashrt_ros.session import Outputs
from trajectory_msgs.msg import JointTrajectory

from . import messages
from .events import EventPublisher, StageStats


class RosOutputs(Outputs):
    """Publish what the session reports; lifecycle publishers, so only while active."""

    def __init__(self, node, joint_trajectory=False):
        self._node = node
        self._throttled = {}  # (file, line) of a throttled log call -> when it last logged
        lifecycle = node.create_lifecycle_publisher
        self._tokens = lifecycle(TokenChunk, '~/tokens', STREAM_QOS)
        self._events = EventPublisher(lifecycle(CapsuleEvent, '~/events', STREAM_QOS),
                                      node.get_logger())
        self._actions = lifecycle(ActionChunk, '~/actions', ACTIONS_QOS)
        self._transcript = lifecycle(TokenChunk, '~/transcript', STREAM_QOS)
        self._end_of_utterance = lifecycle(EndOfUtterance, '~/end_of_utterance', STREAM_QOS)
        self._trajectory = (lifecycle(JointTrajectory, '~/joint_trajectory', ACTIONS_QOS)
                            if joint_trajectory else None)
        self.interrupt_stages = StageStats()  # for /diagnostics

    def _stamp(self):
        return self._node.get_clock().now().to_msg()

    def event(self, operation, name, tier, size_bytes, latency_ms, success, message,
              stamp=None, stages=()):
        """
        Publish a CapsuleEvent, stamped now (or `stamp`), in order with the others.

        An interrupt's (it has `stages`) goes out from the calling thread when nothing is
        queued before it; the others from the events thread.
        """
        node = self._node
        if not node.active:
            return
        rt = node.session.runtime if node.session is not None else None
        fields = {'operation': operation, 'name': name or '', 'tier': tier or '',
                  'size_bytes': max(0, int(size_bytes)), 'latency_ms': float(latency_ms),
                  'position': int(rt.position) if rt is not None else 0,
                  'success': bool(success), 'message': message}
        if stages:
            self.interrupt_stages.add(stages)
        self._events.put(fields, stamp or node.get_clock().now(), stages, now=bool(stages))

    def evictions(self):
        """Report capsules the lru budget policy evicted to make room."""
        session = self._node.session
        if session is None:
            return
        for info in session.runtime.drain_evictions():
            self.log('info', f'evicted capsule {info.name!r} ({info.tier}, {info.nbytes} '
                     'bytes) to stay within the budget')
            self.event('evict', info.name, info.tier, info.nbytes, 0.0, True,
                       'evicted (least recently used) to stay within the budget')

    def flush_events(self, timeout=1.0):
        """Wait until the events queued so far are published."""
        self._events.flush(timeout)

    def close(self):
        """Publish what is queued, then end the events thread."""
        self._events.close()

    def chunk(self, turn, index, ids, text, stop_reason, final=False):
        node = self._node
        chunk = messages.token_chunk(turn, index, ids, text, stop_reason, final, self._stamp())
        # The final chunk goes out while deactivating too: the lifecycle publisher stays
        # enabled until the transition ends (and drops what comes later).
        if node.active or final:
            try:
                self._tokens.publish(chunk)
            except Exception as exc:  # e.g. the node is being destroyed
                self.log('warning', f'could not publish a token chunk: {exc!r}')
        if turn.handle is not None:
            turn.handle.publish_feedback(Generate.Feedback(chunk=chunk))

    def actions(self, step, rows, names, stamp=None):
        """Publish action rows as an ActionChunk (and a JointTrajectory if enabled)."""
        param = self._node.get_parameter
        when = self._stamp() if stamp is None else messages.time_of(stamp)
        dt = 1.0 / param('control_rate').value
        self._actions.publish(messages.action_chunk(step, rows, names, when, dt))
        if self._trajectory is not None:
            self._trajectory.publish(messages.joint_trajectory(
                rows, names, dt, param('trajectory_field').value, when))

    def transcript(self, utterance, index, ids, text, final, words=(), stamp=None):
        when = self._stamp() if stamp is None else messages.time_of(stamp)
        try:
            self._transcript.publish(messages.transcript_chunk(
                utterance, index, ids, text, final, words, when))
        except Exception as exc:  # e.g. the node is being destroyed
            self.log('warning', f'could not publish a transcript chunk: {exc!r}')

    def end_of_utterance(self, utterance, index, end, stamp=None):
        when = self._stamp() if stamp is None else messages.time_of(stamp)
        try:
            self._end_of_utterance.publish(messages.end_of_utterance(utterance, index, end, when))
        except Exception as exc:  # e.g. the node is being destroyed
            self.log('warning', f'could not publish an end of utterance: {exc!r}')

    def start_goal(self, turn):
        """Mark the goal executing and schedule the execute callback, which reports it."""
        goal_handle = turn.handle
        try:
            goal_handle.execute()
        except Exception:
            # A cancel moved the goal to CANCELING between execute()'s check for one and
            # its own move to EXECUTING; called again, it only schedules the callback.
            if not goal_handle.is_cancel_requested:
                raise
            goal_handle.execute()

    def not_active_message(self):
        return self._node.not_active_message()

    def now(self):
        return self._node.get_clock().now()

    def log(self, level, message, throttle_s=None):
        if throttle_s is not None:
            # Throttled per call site, as rclpy's own throttling is.
            caller = sys._getframe(1)
            key = (caller.f_code.co_filename, caller.f_lineno)
            now = time.monotonic()
            if now - self._throttled.get(key, -throttle_s) < throttle_s:
                return
            self._throttled[key] = now
        getattr(self._node.get_logger(), level)(message)
