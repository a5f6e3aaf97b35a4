"""The events publisher (node/events.py): order kept, an interrupt's event sent at once."""

import threading

from flashrt_ros.msg import CapsuleEvent
from flashrt_ros.node.events import EventPublisher
import rclpy
from rclpy.signals import SignalHandlerOptions

STAGES = [('received', 0.0)]


class _Recording:
    """A real publisher that also notes which thread published each event."""

    def __init__(self, publisher):
        self._pub = publisher
        self.published = []  # (name, thread name)

    def publish(self, msg):
        self.published.append((msg.name, threading.current_thread().name))
        self._pub.publish(msg)


def _put(events, name, now=False):
    events.put({'operation': 'interrupt' if now else 'snapshot', 'name': name},
               rclpy.clock.Clock().now(), STAGES if now else (), now=now)


def test_an_interrupts_event_goes_out_on_its_own_thread_after_those_before_it():
    context = rclpy.Context()
    rclpy.init(context=context, signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node('events_order', context=context)
    try:
        publisher = node.create_publisher(CapsuleEvent, '~/events', 100)
        recording = _Recording(publisher)
        events = EventPublisher(recording, node.get_logger())
        for name in ('a', 'b'):
            _put(events, name)
        events.flush(10.0)
        _put(events, 'c', now=True)  # nothing queued: published here, at once
        assert recording.published == [('a', 'flashrt-events'), ('b', 'flashrt-events'),
                                       ('c', threading.current_thread().name)]
        events.close()

        frozen = _Recording(publisher)
        events = EventPublisher(frozen, node.get_logger())
        events.close()  # no events thread: what is queued from now on stays queued
        _put(events, 'd')
        _put(events, 'e', now=True)  # 'd' waits before it: it waits too, not overtaking
        assert frozen.published == []
    finally:
        node.destroy_node()
        rclpy.try_shutdown(context=context)
