"""spin.PoolExecutor: a task waiting in the pool is submitted to it once."""

import threading

from flashrt_ros.spin import PoolExecutor
import rclpy
from rclpy.context import Context


def test_a_queued_task_is_submitted_once_and_runs_once():
    context = Context()
    rclpy.init(context=context)
    node = rclpy.create_node('pool_executor_test', context=context)
    executor = PoolExecutor(num_threads=1, context=context)
    executor.add_node(node)
    submitted = []
    submit = executor._executor.submit

    def counted(fn, *args):  # the task submitted: the argument, or the callable itself
        submitted.append(args[-1] if args else fn)
        return submit(fn, *args)
    executor._executor.submit = counted
    gate, runs = threading.Event(), []
    try:
        executor.create_task(gate.wait)  # holds the pool's one thread
        executor.spin_once(timeout_sec=0.5)
        queued = executor.create_task(lambda: runs.append(1))
        for _ in range(20):  # rclpy's own executor submits it again on every one of these
            executor.spin_once(timeout_sec=0.01)
        assert submitted.count(queued) == 1
        assert not runs
        gate.set()
        for _ in range(50):
            if queued.done():
                break
            executor.spin_once(timeout_sec=0.05)
        assert queued.done() and runs == [1]
    finally:
        gate.set()
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown(context=context)
