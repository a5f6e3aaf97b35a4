"""The control path (node/control.py) on each of its executors, in one process over DDS."""

import contextlib
import os
import struct
import threading
import time

from flashrt_ros.msg import Interrupt
from flashrt_ros.node.control import CONTROL_EXECUTORS, ControlPath, raise_receive_threads
from flashrt_ros.node.control import CPU_LATENCY_FILE, RECEIVE_THREADS
from flashrt_ros.qos import COMMAND_QOS, INTERRUPT_QOS
from flashrt_ros.spin import spin_until_shutdown
from node_harness import wait_until
import pytest
import rclpy
from rclpy.event_handler import PublisherEventCallbacks, SubscriptionEventCallbacks
from rclpy.executors import MultiThreadedExecutor
from rclpy.qos import QoSProfile, ReliabilityPolicy
from rclpy.signals import SignalHandlerOptions
from std_msgs.msg import Empty


class _Log:
    """The logger the control path is given: what it said, by level."""

    def __init__(self):
        self.lines = []

    def info(self, text):
        self.lines.append(('info', text))

    def warning(self, text):
        self.lines.append(('warning', text))

    def error(self, text):
        self.lines.append(('error', text))


class _Harness:
    """A node with its control path of `kind`, a sender node, and what the path applied."""

    def __init__(self, kind, name, cpu_latency_us=-1):
        self.context = rclpy.Context()
        rclpy.init(context=self.context, signal_handler_options=SignalHandlerOptions.NO)
        self.node = rclpy.create_node(name, context=self.context)
        self.sender = rclpy.create_node(f'{name}_sender', context=self.context)
        self.applied = []     # (what, payload, received, callback_at, thread name)
        self.mismatches = []
        self.hold = None      # an Event the next callback waits for, when set
        self.started = threading.Event()
        self.failing = set()  # interrupt reasons whose callback raises
        self.log = _Log()
        events = SubscriptionEventCallbacks(incompatible_qos=self.mismatches.append,
                                            use_default_callbacks=False)
        group = self.node.default_callback_group
        self.path = ControlPath(self.node, kind, self._apply('interrupt'), self._apply('reset'),
                                events, group=group)
        self.executor = MultiThreadedExecutor(num_threads=2, context=self.context)
        self.executor.add_node(self.node)  # the node's own executor ('shared' is taken here)
        self.stopping = threading.Event()
        self.spinner = threading.Thread(target=spin_until_shutdown, daemon=True, args=(
            self.executor, self.log, self.stopping.is_set))
        self.spinner.start()
        self.path.start(self.log, self.stopping.is_set, cpu_latency_us=cpu_latency_us)
        self.interrupts = self.sender.create_publisher(Interrupt, f'/{name}/interrupt',
                                                       INTERRUPT_QOS)
        self.resets = self.sender.create_publisher(Empty, f'/{name}/reset', COMMAND_QOS)
        assert wait_until(lambda: self.interrupts.get_subscription_count() == 1
                          and self.resets.get_subscription_count() == 1)

    def _apply(self, what):
        def apply(msg, received, callback_at):
            self.started.set()
            if self.hold is not None:
                self.hold.wait(10.0)
            payload = msg.reason if what == 'interrupt' else ''
            if payload in self.failing:
                raise RuntimeError(f'the callback of {payload!r} fails')
            self.applied.append((what, payload, received, callback_at,
                                 threading.current_thread().name))
        return apply

    def close(self):
        self.stopping.set()
        self.path.stop()
        self.executor.shutdown(timeout_sec=2.0)
        self.spinner.join(timeout=2.0)
        self.sender.destroy_node()
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)


@pytest.fixture(params=CONTROL_EXECUTORS)
def path(request):
    harness = _Harness(request.param, f'control_{request.param}')
    yield harness
    harness.close()


def test_each_message_is_applied_once_in_the_order_sent(path):
    sent = []
    for i in range(30):
        if i % 3 == 2:
            path.resets.publish(Empty())
            sent.append(('reset', ''))
        else:
            path.interrupts.publish(Interrupt(mode=Interrupt.RESTORE, reason=str(i)))
            sent.append(('interrupt', str(i)))
        time.sleep(0.002)
    assert wait_until(lambda: len(path.applied) >= len(sent))
    time.sleep(0.1)  # nothing is applied twice
    applied = [(what, payload) for what, payload, *_ in path.applied]
    if path.path.kind == 'waitset':  # in receipt order across both topics
        assert applied == sent
    else:  # rclpy's executors keep each topic's order, not the order between them
        assert sorted(applied) == sorted(sent)
        for what in ('interrupt', 'reset'):
            assert [a for a in applied if a[0] == what] == [a for a in sent if a[0] == what]
    own_thread = path.path.kind != 'shared'
    for _, _, received, callback_at, thread in path.applied:
        assert received <= callback_at  # the receipt is the middleware's, not the callback's
        assert (thread == 'flashrt-control') == own_thread


@pytest.mark.parametrize('kind', ['waitset', 'single'])
def test_barrier_returns_once_the_interrupt_in_progress_is_applied(kind):
    harness = _Harness(kind, f'barrier_{kind}')
    try:
        harness.hold = threading.Event()
        harness.interrupts.publish(Interrupt(mode=Interrupt.RESTORE, reason='first'))
        assert harness.started.wait(10.0)
        passed = []
        waiter = threading.Thread(target=lambda: passed.append(harness.path.barrier(5.0)))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive() and not harness.applied  # waits for the callback
        harness.hold.set()
        waiter.join(10.0)
        assert passed == [True] and [a[1] for a in harness.applied] == ['first']
        assert harness.path.barrier(1.0)  # and with nothing in flight, at once
    finally:
        harness.hold.set()
        harness.close()


def test_a_failing_callback_is_logged_and_loses_none_after_it(path):
    # The three after the first arrive while its callback runs: taken at one wake-up.
    path.failing.add('fails')
    path.hold = threading.Event()
    path.interrupts.publish(Interrupt(mode=Interrupt.RESTORE, reason='first'))
    assert path.started.wait(10.0)
    path.interrupts.publish(Interrupt(mode=Interrupt.RESTORE, reason='fails'))
    path.interrupts.publish(Interrupt(mode=Interrupt.RESTORE, reason='after'))
    path.resets.publish(Empty())
    time.sleep(0.3)
    path.hold.set()
    assert wait_until(lambda: len(path.applied) == 3)
    applied = [a[1] for a in path.applied]
    if path.path.kind == 'waitset':  # one batch, in receipt order across both topics
        assert applied == ['first', 'after', '']
    else:  # rclpy's executors take a batch topic by topic
        assert sorted(applied) == ['', 'after', 'first']
    assert [level for level, _ in path.log.lines] == ['error']
    assert "the callback of 'fails' fails" in path.log.lines[0][1]


def test_an_incompatible_interrupt_publisher_is_reported(path):
    qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.BEST_EFFORT)
    pub = path.sender.create_publisher(
        Interrupt, f'/{path.node.get_name()}/interrupt', qos,
        event_callbacks=PublisherEventCallbacks(use_default_callbacks=False))
    try:
        assert wait_until(lambda: path.mismatches)
    finally:
        path.sender.destroy_publisher(pub)


@pytest.mark.parametrize('kind', ['waitset', 'single'])
def test_stop_ends_the_control_thread(kind):
    harness = _Harness(kind, f'control_stop_{kind}')
    thread = harness.path._thread
    harness.close()
    assert not thread.is_alive()


def test_control_priority_raises_the_middleware_receive_threads():
    harness = _Harness('waitset', 'control_receive')
    try:
        raised = raise_receive_threads(1)
        if not raised:
            pytest.skip('SCHED_FIFO is refused here (no CAP_SYS_NICE or rtprio limit)')
        policies = {}
        for tid in os.listdir('/proc/self/task'):
            with open(f'/proc/self/task/{tid}/comm') as f:
                policies[f.read().strip()] = os.sched_getscheduler(int(tid))
        assert all(policies[name] == os.SCHED_FIFO for name in raised)
        assert all(name.startswith(RECEIVE_THREADS) for name in raised)
        others = [name for name, policy in policies.items() if name not in raised]
        assert others and all(policies[name] != os.SCHED_FIFO for name in others)
    finally:
        for tid in os.listdir('/proc/self/task'):  # this test process goes on as it was
            with contextlib.suppress(OSError):
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        harness.close()


def _cpu_latency_now():
    """Return the CPU latency bound in force now (us): the least of every request held."""
    with open(CPU_LATENCY_FILE, 'rb') as f:
        return struct.unpack('=i', f.read(4))[0]


@pytest.mark.parametrize('kind', CONTROL_EXECUTORS)
def test_cpu_latency_is_requested_until_the_path_stops(kind):
    harness = _Harness(kind, f'control_latency_{kind}', cpu_latency_us=7)
    fd = harness.path._latency_fd
    try:
        if not os.access(CPU_LATENCY_FILE, os.W_OK):  # refused: said, and it runs on
            assert fd is None
            assert [level for level, text in harness.log.lines
                    if 'cpu_latency_us 7' in text and 'refused' in text] == ['warning']
            return
        assert os.readlink(f'/proc/self/fd/{fd}') == CPU_LATENCY_FILE
        if os.access(CPU_LATENCY_FILE, os.R_OK):
            assert _cpu_latency_now() <= 7  # the least request of every holder is in force
        assert any('cpu_latency_us 7' in text for level, text in harness.log.lines
                   if level == 'info')
    finally:
        harness.close()
    assert harness.path._latency_fd is None
    with contextlib.suppress(OSError):  # closed (the number may have been reused since)
        assert os.readlink(f'/proc/self/fd/{fd}') != CPU_LATENCY_FILE
