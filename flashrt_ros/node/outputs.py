"""The session's outputs on ROS: ~/tokens and goal feedback, ~/events, ~/actions, the log."""

import sys
import time

from flashrt_ros.action import Generate
from flashrt_ros.session import Outputs

from . import messages


class RosOutputs(Outputs):
    """Publish what the session reports through the node's publishers."""

    def __init__(self, node):
        self._node = node
        self._throttled = {}  # (file, line) of a throttled log call -> when it last logged

    def event(self, operation, name, tier, size_bytes, latency_ms, success, message,
              stamp=None, stages=()):
        self._node.publish_event(operation, name, tier, size_bytes, latency_ms, success,
                                 message, stamp, stages)

    def evictions(self):
        self._node.publish_evictions()

    def chunk(self, turn, index, ids, text, stop_reason, final=False):
        node = self._node
        chunk = messages.token_chunk(turn, index, ids, text, stop_reason, final,
                                     node.get_clock().now().to_msg())
        # The final chunk goes out while deactivating too: the lifecycle publisher stays
        # enabled until the transition ends (and drops what comes later).
        if node.active or final:
            try:
                node.tokens_pub.publish(chunk)
            except Exception as exc:  # e.g. the node is being destroyed
                self.log('warning', f'could not publish a token chunk: {exc!r}')
        if turn.handle is not None:
            turn.handle.publish_feedback(Generate.Feedback(chunk=chunk))

    def actions(self, step, rows, names):
        self._node.publish_actions(step, rows, names)

    def transcript(self, utterance, index, ids, text, final):
        try:
            self._node.publish_transcript(utterance, index, ids, text, final)
        except Exception as exc:  # e.g. the node is being destroyed
            self.log('warning', f'could not publish a transcript chunk: {exc!r}')

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
