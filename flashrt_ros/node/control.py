"""
The control path: ~/interrupt and ~/reset on an executor that serves nothing else.

The node's own executor serves services, the generate action, observations, audio and the
diagnostics timer on a pool of threads; an e-stop taken there waits for that pool's wait set
and for a free worker. Here the two control topics belong to a small hidden node in the
same process (no parameter services, no rosout) spun by an executor of its own on its own
thread, so nothing else stands between a message's arrival and its callback.

The hidden node subscribes to the names the main node resolves (its remappings and
namespace applied) and ignores the process's command-line arguments, so a `__node:=`
remapping does not give two nodes one name. `control_executor` picks what takes them:
'waitset' (the default: a wait set of its own over the two subscriptions, a wake-up guard
and the interrupt's QoS event, taken and applied in a few calls per message; rclpy's
executors rebuild their wait set and dispatch through tasks on every wake-up, which costs
more than the rest of the interrupt's path), 'single' (a SingleThreadedExecutor on that
thread) or 'shared' (the topics on the node's own executor, in its `ordered` group: the
configuration before this path existed). The last two are kept for side-by-side
measurements (fig5). rclpy's EventsExecutor is not offered: the one of rclpy 9.1 delivered
nothing and spun a core when tried (docs/architecture.md). `control_priority` > 0 runs the
control thread under SCHED_FIFO at that priority, so the kernel runs it ahead of the
generation thread when an interrupt arrives (it needs CAP_SYS_NICE or an rtprio limit; a
refusal is logged and the thread keeps the normal policy).

Order: interrupts and resets are applied in their arrival order, one at a time (across the
two topics as well with 'waitset': the messages of one wake-up are sorted by receipt; rclpy's
executors take them topic by topic). 'waitset' takes them serialized and reads the
interrupt's fields itself (wire.py), which costs about half of rclpy's conversion. A
prompt, restore or rollback taken by the node's executor first lets the control path take
every interrupt that had arrived by then (barrier()), so "interrupt, then prompt" stays in
order.
"""

import contextlib
import functools
import os
import struct
import threading
import time

from flashrt_ros.msg import Interrupt
from flashrt_ros.qos import COMMAND_QOS, INTERRUPT_QOS
from flashrt_ros.spin import spin_until_shutdown
from rclpy.executors import SingleThreadedExecutor
from rclpy.impl.implementation_singleton import rclpy_implementation as _rclpy
from rclpy.node import Node
from rclpy.subscription import Subscription
from rclpy.waitable import NumberOfEntities
from std_msgs.msg import Empty

from .wire import interrupt_fields

CONTROL_EXECUTORS = ('waitset', 'single', 'shared')
BARRIER_TIMEOUT_S = 0.5
WAIT_TIMEOUT_NS = 200_000_000  # the wait loop looks at stop() and the context this often
# Names of the threads that receive messages: Fast DDS (shared memory, UDP; not its
# shared-memory watchdog), Cyclone DDS.
RECEIVE_THREADS = ('dds.shm.', 'dds.udp.', 'recv')
CPU_LATENCY_FILE = '/dev/cpu_dma_latency'  # Linux's CPU latency QoS, held while it is open
# rclpy passes a MessageInfo (the middleware's receipt time) to two-argument subscription
# callbacks from Iron on; Humble calls callback(msg), and the receipt is then "now".
_MESSAGE_INFO = hasattr(Subscription, 'CallbackType')


def with_info(callback):
    """Return callback(msg, msg_info) in the form this rclpy calls (info None on Humble)."""
    if _MESSAGE_INFO:
        return lambda msg, msg_info: callback(msg, msg_info)
    return lambda msg: callback(msg, None)


def received_time(msg_info):
    """Wall time the middleware received the message (falls back to now)."""
    now = time.time()
    received = ((msg_info or {}).get('received_timestamp') or 0) / 1e9
    return received if now - 10.0 < received <= now + 0.001 else now


class ControlPath:
    """The ~/interrupt and ~/reset subscriptions and the thread that takes them."""

    def __init__(self, node, kind, on_interrupt, on_reset, event_callbacks, group=None):
        """
        Subscribe for `node`; on_interrupt(msg, received, callback_at) and on_reset(...).

        kind: a CONTROL_EXECUTORS value; group: the node's callback group for 'shared'.
        """
        if kind not in CONTROL_EXECUTORS:
            raise ValueError(f'control_executor {kind!r} is not valid; use one of '
                             f'{", ".join(CONTROL_EXECUTORS)}')
        self.kind = kind
        self._node = node
        self._on_interrupt, self._on_reset = on_interrupt, on_reset
        self._executor = None
        self._thread = None
        self._latency_fd = None  # the CPU latency request (start), dropped by stop
        self._stopping = False
        self._barrier = None
        self._barrier_lock = threading.Lock()
        interrupt_topic = node.resolve_topic_name('~/interrupt')
        reset_topic = node.resolve_topic_name('~/reset')
        if kind == 'shared':
            self.host = node
            create = functools.partial(node.create_subscription, callback_group=group)
        else:
            self.host = Node(f'_{node.get_name()}_control', namespace=node.get_namespace(),
                             context=node.context, use_global_arguments=False,
                             start_parameter_services=False, enable_rosout=False)
            create = self.host.create_subscription
        self._subscriptions = (
            create(Interrupt, interrupt_topic, with_info(self._interrupt_callback),
                   INTERRUPT_QOS, event_callbacks=event_callbacks),
            create(Empty, reset_topic, with_info(self._reset_callback), COMMAND_QOS))
        if kind != 'shared':
            # Woken by barrier() and stop(): runs after the messages of the same wake-up.
            self._wake = self.host.create_guard_condition(self._barrier_callback)

    def start(self, logger, stopping, priority=0, cpu_latency_us=-1):
        """
        Take the control topics on a thread of their own (nothing to do for 'shared').

        cpu_latency_us >= 0 holds a CPU latency request (hold_cpu_latency) until stop(),
        whatever the kind.
        """
        if cpu_latency_us >= 0 and self._latency_fd is None:
            try:
                self._latency_fd = hold_cpu_latency(cpu_latency_us)
                logger.info(f'cpu_latency_us {cpu_latency_us}: idle CPUs stay in states they '
                            f'leave within {cpu_latency_us} us until the node is destroyed')
            except OSError as exc:
                logger.warning(f'cpu_latency_us {cpu_latency_us}: {CPU_LATENCY_FILE} refused '
                               f'({exc}); idle CPUs keep their sleep states (run as root or '
                               'give the node write access to it: docs/setup.md)')
        if self.kind == 'shared':
            return
        if self.kind == 'single':
            self._executor = SingleThreadedExecutor(context=self._node.context)
            self._executor.add_node(self.host)

        if priority > 0:
            raised = raise_receive_threads(max(1, priority - 1))
            if raised:
                logger.info(f'control_priority {priority}: the middleware threads '
                            f'{", ".join(raised)} run under SCHED_FIFO {max(1, priority - 1)}')

        def run():
            if priority > 0:
                try:  # this thread only: pid 0 is the calling thread
                    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
                except (OSError, AttributeError) as exc:
                    logger.warning(f'control_priority {priority}: SCHED_FIFO refused ({exc}); '
                                   'the control thread runs at normal priority (grant '
                                   'CAP_SYS_NICE or an rtprio limit)')
            if self._executor is not None:
                spin_until_shutdown(self._executor, logger, stopping)
            else:
                self._wait_loop(logger, stopping)

        self._thread = threading.Thread(target=run, name='flashrt-control', daemon=True)
        self._thread.start()

    def _wait_loop(self, logger, stopping):
        """Wait on the control topics alone; apply what came in receipt order ('waitset')."""
        context = self._node.context
        waitables = list(self.host.waitables)  # the interrupt's QoS event handler
        with contextlib.ExitStack() as handles:  # nothing is destroyed while this waits
            for entity in self._subscriptions + (self._wake,):
                handles.enter_context(entity.handle)
            for waitable in waitables:
                handles.enter_context(waitable)
            handles.enter_context(context.handle)
            count = NumberOfEntities(len(self._subscriptions), 1)
            for waitable in waitables:
                count += waitable.get_num_entities()
            wait_set = _rclpy.WaitSet(
                count.num_subscriptions, count.num_guard_conditions, count.num_timers,
                count.num_clients, count.num_services, count.num_events, context.handle)
            while not self._stopping and context.ok():
                try:
                    barrier, ready = self._wait_once(wait_set, waitables)
                except Exception as exc:  # noqa: B902 - e.g. the context shutting down
                    if self._stopping or stopping():
                        return
                    logger.error(f'the control path could not wait: {exc!r}')
                    continue
                if self._stopping or not context.ok():
                    return
                try:
                    self._take_all(logger)
                    for waitable in ready:
                        _run_to_end(waitable.execute(waitable.take_data()))
                    if barrier is not None:
                        self._take_all(logger)  # what arrived before barrier() was called
                except Exception as exc:  # noqa: B902 - a QoS event callback, or shutting down
                    if self._stopping or stopping():
                        return
                    logger.error(f'the control path skipped a failure: {exc!r}')
                finally:
                    if barrier is not None:
                        barrier.set()

    def _wait_once(self, wait_set, waitables):
        """Wait; return the barrier that woke it (or None) and the ready waitables."""
        wait_set.clear_entities()
        for sub in self._subscriptions:
            wait_set.add_subscription(sub.handle)
        wait_set.add_guard_condition(self._wake.handle)
        for waitable in waitables:
            waitable.add_to_wait_set(wait_set)
        wait_set.wait(WAIT_TIMEOUT_NS)
        # Read before the takes: a barrier set later waits for the next wake-up, whose takes
        # come after its call.
        woken = self._wake.handle.pointer in wait_set.get_ready_entities('guard_condition')
        return (self._barrier if woken else None), [w for w in waitables
                                                    if w.is_ready(wait_set)]

    def _take_all(self, logger):
        """Take every message waiting on both topics and apply them in receipt order."""
        taken = []
        for sub, callback, read in zip(self._subscriptions,
                                       (self._interrupt_callback, self._reset_callback),
                                       (interrupt_fields, _empty)):
            while True:
                message = sub.handle.take_message(sub.msg_type, True)  # serialized: wire.py
                if message is None:
                    break
                data, info = message
                taken.append((received_time(info), callback, read, data, info))
        taken.sort(key=lambda item: item[0])
        for _, callback, read, data, info in taken:
            try:  # each message on its own: one failing callback loses none after it
                callback(read(data), info)
            except Exception as exc:  # noqa: B902 - whatever the callback raised
                logger.error(f'a control callback failed and was skipped: {exc!r}')

    def barrier(self, timeout=BARRIER_TIMEOUT_S):
        """
        Return once the interrupts and resets that had arrived by now are applied.

        Called from the node's executor before a prompt, a restore or a rollback. Never from
        the control thread itself.
        """
        if self.kind == 'shared' or self._thread is None:
            return True
        with self._barrier_lock:  # one at a time: a guard condition triggers once per wake
            done = threading.Event()
            self._barrier = done
            self._wake.trigger()
            return done.wait(timeout)

    def _barrier_callback(self):
        done = self._barrier
        if done is not None:
            done.set()

    def _interrupt_callback(self, msg, msg_info):
        callback_at = time.time()
        self._on_interrupt(msg, received_time(msg_info), callback_at)

    def _reset_callback(self, msg, msg_info):
        callback_at = time.time()
        self._on_reset(msg, received_time(msg_info), callback_at)

    def stop(self):
        """Drop the CPU latency request; stop the thread that takes the topics and its node."""
        fd, self._latency_fd = self._latency_fd, None
        if fd is not None:
            os.close(fd)  # drops the request
        self._stopping = True
        if self._executor is not None:
            self._executor.shutdown(timeout_sec=2.0)
        elif self.host is not self._node:
            self._wake.trigger()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self.host is not self._node:
            self.host.destroy_node()


def raise_receive_threads(priority, prefixes=RECEIVE_THREADS):
    """
    Run this process's middleware receive threads under SCHED_FIFO `priority`.

    A message is stamped and handed on by such a thread; on a busy CPU a normal-policy one
    waits for a time slice behind the model's compute before the control thread can wake.
    Returns the names of the threads raised (none where the policy is refused).
    """
    raised = []
    for tid in os.listdir('/proc/self/task'):
        try:
            with open(f'/proc/self/task/{tid}/comm') as f:
                name = f.read().strip()
            if name.startswith(prefixes) and not name.endswith('.wdog'):
                os.sched_setscheduler(int(tid), os.SCHED_FIFO, os.sched_param(priority))
                raised.append(name)
        except (OSError, AttributeError):  # gone meanwhile, or no permission
            continue
    return sorted(raised)


def hold_cpu_latency(us):
    """
    Keep every CPU out of idle states slower than `us` microseconds to leave; return the fd.

    The request holds until the fd is closed (or the process ends). A control thread woken
    from a core in a deep sleep state (on a VM: a halted vCPU the host must run again) starts
    tens of microseconds later, at each hand-off of an interrupt's path; 0 keeps idle cores
    polling, at the price of their power. Raises OSError where refused (the file is root's
    by default) or absent.
    """
    fd = os.open(CPU_LATENCY_FILE, os.O_WRONLY)
    try:
        os.write(fd, struct.pack('=i', us))
    except OSError:
        os.close(fd)
        raise
    return fd


def _empty(data):
    """Return the reset message: it has no field to read."""
    return _EMPTY


_EMPTY = Empty()


def _run_to_end(coroutine):
    """Run a waitable's execute() coroutine, which awaits nothing of an executor."""
    try:
        coroutine.send(None)
    except StopIteration:
        return
    coroutine.close()
    raise RuntimeError('a control waitable awaited an executor; it cannot run here')
