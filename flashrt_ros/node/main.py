"""`flashrt_node` and `python -m flashrt_ros`: run the node until SIGINT or SIGTERM."""

import signal
import sys
import threading

from flashrt_ros.session.turns import SWITCH_INTERVAL_IDLE_S
from flashrt_ros.spin import PoolExecutor, spin_until_shutdown, stop_spinning
import rclpy
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.signals import SignalHandlerOptions

from .node import FlashRTNode


def main(args=None):
    """Run the node until SIGINT/SIGTERM; return the process exit code."""
    # rclpy's own handlers are off: a node started in the background from a non-interactive
    # shell inherits SIGINT as ignored, so install handlers explicitly for both signals.
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    sys.setswitchinterval(SWITCH_INTERVAL_IDLE_S)
    stop = threading.Event()

    def request_stop(signum, frame):
        stop.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    node = None
    executor = PoolExecutor(num_threads=6)
    try:
        node = FlashRTNode()
        node.tune_switch_interval = True
        executor.add_node(node)
        if node.get_parameter('autostart').value and not stop.is_set():
            if node.trigger_configure() == TransitionCallbackReturn.SUCCESS and not stop.is_set():
                node.trigger_activate()

        def spin():
            spin_until_shutdown(executor, node.get_logger(),
                                lambda: stop.is_set() or not rclpy.ok())

        spinner = threading.Thread(target=spin, name='flashrt-executor', daemon=True)
        spinner.start()
        while not stop.wait(0.2) and rclpy.ok():
            pass
        node.get_logger().info('shutting down')
        try:
            node.trigger_shutdown()
        except Exception as exc:  # e.g. a transition was still in progress
            node.get_logger().warning(f'shutdown transition: {exc}')
            node.on_shutdown(None)
        stop_spinning(executor, spinner, node.get_logger())
        return 0
    except Exception as exc:
        print(f'flashrt_node: {exc!r}', file=sys.stderr)
        return 1
    finally:
        if node is not None:
            node.destroy_node()
        rclpy.try_shutdown()


if __name__ == '__main__':
    sys.exit(main())
