"""~/events: capsule operation telemetry, published by a thread of its own."""

import queue
import threading

from flashrt_ros.msg import CapsuleEvent


class EventPublisher:
    """
    Publish CapsuleEvents from a queue on the events thread.

    Building and publishing an event is off the path of the service response that reports
    the same operation.
    """

    def __init__(self, publisher, logger):
        self._pub = publisher
        self._logger = logger
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name='flashrt-events', daemon=True)
        self._thread.start()

    def put(self, fields, stamp):
        """Queue an event with CapsuleEvent `fields` and a rclpy Time `stamp`."""
        self._queue.put((fields, stamp))

    def flush(self, timeout=1.0):
        """Wait until the events queued so far are published."""
        marker = threading.Event()
        self._queue.put(marker)
        marker.wait(timeout)

    def close(self, timeout=2.0):
        """Publish what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout=timeout)

    def _loop(self):
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):  # a flush marker: all before it is out
                item.set()
                continue
            try:
                fields, stamp = item
                event = CapsuleEvent(**fields)
                event.header.stamp = stamp.to_msg()
                self._pub.publish(event)
            except Exception as exc:  # e.g. the context shut down under us; keep the thread
                self._logger.warning(f'could not publish a capsule event: {exc!r}')
