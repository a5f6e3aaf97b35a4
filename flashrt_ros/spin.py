"""Spin an rclpy executor until shutdown, logging a callback that raises instead of dying."""

from rclpy.exceptions import InvalidHandle
from rclpy.executors import ExternalShutdownException


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
