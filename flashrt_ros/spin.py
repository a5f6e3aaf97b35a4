"""Spin an rclpy executor until shutdown, logging a callback that raises instead of dying."""

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
