"""
A bare rclpy std_srvs/Trigger server: the baseline round-trip of figure 5.

Run as a plain script (it imports nothing from flashrt_ros); stops on SIGINT or SIGTERM.
`--multi-threaded` serves from a MultiThreadedExecutor with as many threads as the flashrt
node's, to tell the executor's cost apart from the node's own.
"""

import argparse
import signal
import sys
import threading

import rclpy
from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor
from rclpy.signals import SignalHandlerOptions
from std_srvs.srv import Trigger

NODE_NAME = 'flashrt_bench_trigger'
NODE_THREADS = 6  # the flashrt node's MultiThreadedExecutor(num_threads=6)


def trigger_callback(request, response):
    """Answer at once: the round-trip is all middleware and rclpy."""
    response.success = True
    return response


def main(argv=None):
    """Serve ~/trigger until SIGINT or SIGTERM."""
    parser = argparse.ArgumentParser(description='bare std_srvs/Trigger server')
    parser.add_argument('--multi-threaded', action='store_true')
    args = parser.parse_args(argv)
    # Explicit handlers: a process started from a non-interactive shell may inherit SIGINT
    # as ignored.
    rclpy.init(signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    node = rclpy.create_node(NODE_NAME + ('_mt' if args.multi_threaded else ''))
    node.create_service(Trigger, '~/trigger', trigger_callback)
    if args.multi_threaded:
        executor = MultiThreadedExecutor(num_threads=NODE_THREADS)
    else:
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
