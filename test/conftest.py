"""Shared fixtures: an isolated rclpy context per test and the installed-package guard."""

import importlib.util
import os

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
