"""
Spin an rclpy executor until shutdown, logging a callback that raises instead of dying.

PoolExecutor is the MultiThreadedExecutor the node and the client spin.
"""

import time

from rclpy.exceptions import InvalidHandle
from rclpy.executors import ConditionReachedException, ExternalShutdownException
from rclpy.executors import MultiThreadedExecutor, ShutdownException, TimeoutException


class PoolExecutor(MultiThreadedExecutor):
    """
    A MultiThreadedExecutor that hands each task to its thread pool once.

    rclpy's (up to 9.x, ros2/rclpy#1452) yields a task that waits in the pool, not started
    yet, again on every pass and submits it again each time; the spinning thread then holds
    the interpreter lock in that loop, and the pool's threads, which need it to start the
    task, wait. Callbacks came up to 2 s late on two busy cores (docs/benchmarks.md). Here a
    task is submitted once until a pool thread starts it; meanwhile the spinning thread lets
    the lock go. A task that started and awaits something is submitted again, as before.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._queued = set()  # tasks submitted to the pool that no pool thread started yet

    def _start(self, task):
        self._queued.discard(task)
        task()

    def _spin_once_impl(self, timeout_sec=None, wait_condition=lambda: False):
        try:
            task, _, _ = self.wait_for_ready_callbacks(timeout_sec, None, wait_condition)
        except (ExternalShutdownException, ShutdownException, TimeoutException,
                ConditionReachedException):
            return
        if task in self._queued:
            time.sleep(0)  # let a pool thread take the interpreter lock and start it
            return
        self._queued.add(task)
        self._executor.submit(self._start, task)
        self._futures.append(task)
        for done in [t for t in self._futures if t.done()]:
            self._futures.remove(done)
            done.result()  # raise what a callback raised (spin_until_shutdown logs it)


def spin_until_shutdown(executor, logger, stopping) -> None:
    """
    Run executor.spin() until it returns, the context shuts down, or stopping() is true.

    rclpy re-raises a callback's exception in the spinning thread (a user callback, or a QoS
    event taken from an entity being destroyed). Without this loop that thread ends and the
    node or client stays up answering nothing. stopping() tells an error of shutting down
    from one of a callback.
    """
    while True:
        try:
            executor.spin()
            return
        except ExternalShutdownException:
            return
        except Exception as exc:  # noqa: B902 - whatever a callback raised
            if stopping():
                return
            logger.error(f'a callback failed and was skipped: {exc!r}')


def stop_spinning(executor, spinner, logger, timeout_sec=2.0) -> None:
    """
    Shut `executor` down and join the thread `spinner` that spins it.

    rclpy (9.x) destroys the executor's guard condition without waiting for the callbacks in
    flight; one of them then fails on it (InvalidHandle), and its failure, retrieved by no
    one once the spin has ended, is printed when collected ("The following exception was
    never retrieved"). Those are marked seen here; any other failure found is logged.
    """
    executor.shutdown(timeout_sec=timeout_sec)
    spinner.join(timeout=timeout_sec)
    for task in list(getattr(executor, '_futures', ())):  # MultiThreadedExecutor's handlers
        if task.done() and not task.cancelled():
            exc = task.exception()  # seen from now on
            if exc is not None and not isinstance(exc, InvalidHandle):
                logger.error(f'a callback failed while shutting down: {exc!r}')
