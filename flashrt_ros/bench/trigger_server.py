"""
A bare rclpy std_srvs/Trigger server: the baseline round-trip of figure 5.

Run as a plain script (it imports nothing from flashrt_ros); stops on SIGINT or SIGTERM.
"""

import signal
import sys
import threading

import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.signals import SignalHandlerOptions
from std_srvs.srv import Trigger

NODE_NAME = 'flashrt_bench_trigger'


def trigger_callback(request, response):
    """Answer at once: the round-trip is all middleware and rclpy."""
    response.success = True
    return response


def main(args=None):
    """Serve ~/trigger until SIGINT or SIGTERM."""
    # Explicit handlers: a process started from a non-interactive shell may inherit SIGINT
    # as ignored.
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    node = rclpy.create_node(NODE_NAME)
    node.create_service(Trigger, '~/trigger', trigger_callback)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    try:
        while not stop.is_set():
            executor.spin_once(timeout_sec=0.1)
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
    return 0


if __name__ == '__main__':
    sys.exit(main())
