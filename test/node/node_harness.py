"""Helpers of the node tests: clients, activation waits, the event log, in-process nodes."""

import contextlib
import threading
import time

import pytest

HOME = 'home'
# The process tests act on turns in flight (interrupts, cancels, deactivation during a
# 600-token turn): they run the exact decode path, whose steps take milliseconds, not the
# compiled CPU step, which finishes such a turn before a request crosses DDS.
# test_node_default_model.py serves the compiled step over ROS.
NODE_A_PARAMS = {
    'model': 'builtin:tiny-hybrid',
    'cpu_step': False,
    'max_seq_len': 1024,
    'host_budget_bytes': 400000,       # room for a few host capsules: the full-budget test
    'interrupt_policy': 'restore_home',
    'max_new_tokens': 16,
    'token_chunk': 1,
    'diagnostics_period': 0.5,
    'system_prompt': 'You are a helpful robot.',
}


def wait_until(predicate, timeout=10.0):
    """Poll predicate every 10 ms; return whether it came true within timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def start_client(node='flashrt', timeout=20.0):
    """Return a FlashRTClient with its own rclpy context."""
    from flashrt_ros.client import FlashRTClient
    return FlashRTClient(node, timeout=timeout)


def wait_active(client, proc, timeout=120.0):
    """Wait until the node is active; fail with its log otherwise."""
    if not client.wait_until_active(timeout=timeout):
        code = proc.proc.poll()
        pytest.fail(f'node {proc.name} did not become active (exit code {code}); log:\n'
                    + proc.log()[-4000:])


class EventLog:
    """Collect CapsuleEvent messages and wait for one that matches."""

    def __init__(self, client):
        self.events = []
        self._sub = client.subscribe_events(self.events.append)
        self._client = client
        client.wait_for_publishers(self._sub, timeout=5.0)  # a node not up yet matches later

    def wait_for(self, predicate, timeout=10.0, start=0):
        """Return the first event from index `start` on that satisfies predicate, or None."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events[start:]:
                if predicate(event):
                    return event
            time.sleep(0.02)
        return None

    def close(self):
        """Destroy the subscription."""
        self._client.node.destroy_subscription(self._sub)


def set_parameter(client, name, value):
    """Set one parameter of the client's node over ROS; return its SetParametersResult."""
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import SetParameters
    if isinstance(value, bool):
        value = ParameterValue(type=ParameterType.PARAMETER_BOOL, bool_value=value)
    elif isinstance(value, int):
        value = ParameterValue(type=ParameterType.PARAMETER_INTEGER, integer_value=value)
    elif isinstance(value, float):
        value = ParameterValue(type=ParameterType.PARAMETER_DOUBLE, double_value=value)
    elif isinstance(value, list) and not value:  # what `ros2 param set x '[]'` sends
        value = ParameterValue(type=ParameterType.PARAMETER_BOOL_ARRAY, bool_array_value=[])
    elif isinstance(value, list):
        value = ParameterValue(type=ParameterType.PARAMETER_STRING_ARRAY,
                               string_array_value=value)
    else:
        value = ParameterValue(type=ParameterType.PARAMETER_STRING, string_value=value)
    cli = client.node.create_client(SetParameters, f'{client.base}/set_parameters')
    try:
        request = SetParameters.Request(parameters=[Parameter(name=name, value=value)])
        return client._call(cli, request).results[0]
    finally:
        client.node.destroy_client(cli)


@contextlib.contextmanager
def node_in_process(name, params, prepare=None):
    """
    Run a FlashRTNode in this process (own context and executor); yield (client, node).

    prepare(node), if given, runs before configure: a test hooks the node's seams there.
    """
    from flashrt_ros.node import FlashRTNode
    from flashrt_ros.spin import PoolExecutor, spin_until_shutdown
    import rclpy
    from rclpy.parameter import Parameter
    from rclpy.signals import SignalHandlerOptions
    context = rclpy.Context()
    rclpy.init(context=context, signal_handler_options=SignalHandlerOptions.NO)
    node = FlashRTNode(context=context, cli_args=['--ros-args', '-r', f'__node:={name}'],
                       parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    executor = PoolExecutor(num_threads=6, context=context)  # as node/main.py
    executor.add_node(node)
    stopping = threading.Event()
    spinner = threading.Thread(target=spin_until_shutdown, daemon=True,
                               args=(executor, node.get_logger(), stopping.is_set))
    client = None
    try:
        if prepare is not None:
            prepare(node)
        node.trigger_configure()
        node.trigger_activate()
        spinner.start()
        client = start_client(name)
        assert client.wait_until_active(60.0) and client.wait_for_subscribers(10.0)
        yield client, node
    finally:
        if client is not None:
            client.close()
        stopping.set()
        node.trigger_shutdown()
        executor.shutdown(timeout_sec=2.0)
        spinner.join(timeout=2.0)
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def diagnostics(client):
    """Return the key-values of the client's node in its next /diagnostics message."""
    from diagnostic_msgs.msg import DiagnosticArray
    seen = []
    name = client.base.strip('/')
    sub = client.node.create_subscription(
        DiagnosticArray, '/diagnostics',
        lambda msg: seen.extend({kv.key: kv.value for kv in s.values}
                                for s in msg.status if name in s.name), 10)
    try:
        assert wait_until(lambda: seen, 20.0), 'no /diagnostics message from the node'
    finally:
        client.node.destroy_subscription(sub)
    return seen[0]
