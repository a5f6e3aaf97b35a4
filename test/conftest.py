"""Shared fixtures: an isolated rclpy context per test and the installed-package guard."""

import importlib.util
import os
import threading
import time

import pytest


def ros_available():
    """Return True when rclpy and this package's generated interfaces import."""
    return (importlib.util.find_spec('rclpy') is not None
            and importlib.util.find_spec('flashrt_ros.msg') is not None)


@pytest.fixture
def ros_context():
    """Yield a fresh rclpy context (own domain from the environment), shut down after."""
    if not ros_available():
        pytest.skip('rclpy or the generated flashrt_ros interfaces are not importable; '
                    'run through `make test` (or source env.sh after `make setup`)')
    import rclpy
    from rclpy.context import Context
    context = Context()
    rclpy.init(context=context, domain_id=int(os.environ.get('ROS_DOMAIN_ID', '0')))
    try:
        yield context
    finally:
        rclpy.try_shutdown(context=context)


@pytest.fixture
def hold_in_forward():
    """
    Return hold(module): the next forward through `module` waits there for a preemption.

    hold returns an event set once it waits (at most 10 s; later forwards run on); the hooks
    go at teardown. A step held after a layer that wrote its state is torn when a
    preemption abandons it.
    """
    from flashrt_ros.runtime.preemption import ARMED

    handles = []

    def hold(module):
        inside = threading.Event()

        def wait_for_a_preemption(_module, _args, _output):
            if inside.is_set():
                return
            inside.set()
            deadline = time.monotonic() + 10.0
            while ARMED.value == 0 and time.monotonic() < deadline:
                time.sleep(0.001)

        handles.append(module.register_forward_hook(wait_for_a_preemption))
        return inside

    yield hold
    for handle in handles:
        handle.remove()
