"""~/events: capsule operation telemetry, published in order by a thread of its own."""

import collections
import queue
import threading
import time

from flashrt_ros.msg import CapsuleEvent
import numpy as np
# np.median imports numpy.ma on its first call: compiling it on the first diagnostics tick
# after an interrupt held the interpreter lock for milliseconds (bench/gil_stalls.py).
import numpy.ma  # noqa: F401,I100


class EventPublisher:
    """
    Publish CapsuleEvents in the order they are put, from a queue on the events thread.

    Building and publishing an event is off the path of the service response that reports
    the same operation. An interrupt's event is the answer its sender waits for: put with
    now=True it is published on the caller's thread when no event waits before it (handing
    it to the events thread took a quarter of a millisecond at the median, fig5).
    """

    def __init__(self, publisher, logger):
        self._pub = publisher
        self._logger = logger
        self._queue = queue.SimpleQueue()
        self._publishing = threading.Lock()  # one publish at a time, in the order put
        self._count_lock = threading.Lock()
        self._queued = 0  # events put on the queue and not yet published
        self._thread = threading.Thread(target=self._loop, name='flashrt-events', daemon=True)
        self._thread.start()

    def put(self, fields, stamp, stages=(), now=False):
        """
        Publish an event with CapsuleEvent `fields` and a rclpy Time `stamp`.

        stages: [('received', wall time), (stage, wall time), ...] of an interrupt; the event
        says each stage's time after receipt, and 'published' last. now: publish it on this
        thread unless events put before it are still queued.
        """
        if now and not self._queued:  # (else it would only wait for the lock to queue it)
            with self._publishing:  # after the event being published, if any
                if not self._queued:
                    self._publish(fields, stamp, stages)
                    return
        with self._count_lock:
            self._queued += 1
            self._queue.put((fields, stamp, stages))

    def flush(self, timeout=1.0):
        """Wait until the events put so far are published."""
        marker = threading.Event()
        self._queue.put(marker)
        if marker.wait(timeout):
            with self._publishing:  # one published on its caller's thread meanwhile
                pass

    def close(self, timeout=2.0):
        """Publish what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout=timeout)

    def _loop(self):
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):  # a flush marker: all before it is out
                item.set()
                continue
            with self._publishing:
                self._publish(*item)
                with self._count_lock:
                    self._queued -= 1

    def _publish(self, fields, stamp, stages):
        try:
            event = CapsuleEvent(**fields)
            event.header.stamp = stamp.to_msg()
            if stages:
                after = after_receipt(stages + [('published', time.time())])
                event.stage_names = list(after)
                event.stage_ms = list(after.values())
            self._pub.publish(event)
        except Exception as exc:  # e.g. the context shut down under us; keep the thread
            self._logger.warning(f'could not publish a capsule event: {exc!r}')


def after_receipt(stages):
    """Return {stage: ms after receipt} of [('received', wall), (stage, wall), ...]."""
    received = stages[0][1]
    return {name: (t - received) * 1e3 for name, t in stages[1:]}


class StageStats:
    """The last interrupts' stages, for /diagnostics: median and p99 after receipt."""

    def __init__(self, keep=1000):
        self._recent = collections.deque(maxlen=keep)  # {stage: ms after receipt}
        self._lock = threading.Lock()

    def add(self, stages):
        """Count one interrupt's [('received', wall), (stage, wall), ...]."""
        after = after_receipt(stages)
        with self._lock:
            self._recent.append(after)

    def values(self):
        """Return {key: text} for /diagnostics (empty before the first interrupt)."""
        with self._lock:
            recent = list(self._recent)
        if not recent:
            return {}
        out = {'interrupts_timed': len(recent)}
        for name in recent[-1]:
            ms = np.array([r[name] for r in recent if name in r])
            out[f'interrupt_{name}_ms'] = (f'last {recent[-1][name]:.3f}, median '
                                           f'{np.median(ms):.3f}, p99 {np.percentile(ms, 99):.3f}')
        return out
