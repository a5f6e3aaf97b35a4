"""
Interrupts, resets and the cancel policy: stop the running turn, then bring the state back.

STOP waits for the step in flight to finish (the state stays a clean boundary). ROLLBACK
and RESTORE replace the state anyway, so they abandon the step in flight at its next module
call (the runtime's preempt) instead of waiting for it. Either way the event is published
only once the interrupted turn is over, so a client that chains a restore or a goal on it
does not find the node busy; its latency and stamp are those of the restore itself.

Each interrupt's event carries where its time went, stage by stage after the middleware's
receipt (STAGES, then 'published', which the node adds when the event goes out).
"""

import enum
import time

from flashrt_ros.runtime import FlashRTError


class InterruptMode(enum.IntEnum):
    """What an interrupt does after stopping (the values of flashrt_ros/msg/Interrupt)."""

    POLICY = 0      # the interrupt_policy parameter
    STOP = 1
    ROLLBACK = 2
    RESTORE = 3


# The e-stop path's stages, in order: the callback started; the session's checks done (the
# mode quiet, the turn marked); the runtime's preemption armed; the step in flight left (or
# the lock taken where none ran); the capsule's bytes copied; the state restored, as reported;
# the turn a restore or rollback interrupted over (the event goes out after it).
STAGES = ('callback', 'checked', 'armed', 'step_left', 'copied', 'restored', 'ended')

# interrupt_policy parameter value -> the mode it stands for
POLICY_MODES = {'stop': InterruptMode.STOP, 'rollback': InterruptMode.ROLLBACK,
                'restore_home': InterruptMode.RESTORE}


class Interrupts:
    """Applies ~/interrupt, ~/reset and the cancel policy over the turn scheduler."""

    def __init__(self, runtime, turns, mode, param, outputs):
        self._rt = runtime
        self._turns = turns
        self._mode = mode
        self._param = param
        self._out = outputs

    def apply(self, operation, mode, boundaries, capsule, reason, received, callback_at=None):
        """
        Stop the running turn, then stop/roll back/restore; publish the event.

        operation: 'interrupt' or 'reset'; received: wall time the request arrived (the
        event's latency counts from it); callback_at: wall time its callback started.
        """
        stages = {'callback': callback_at or time.time()}
        if mode == InterruptMode.POLICY:
            mode = POLICY_MODES[self._param('interrupt_policy')]
        capsule = capsule or self._param('home_capsule')
        replaces = mode in (InterruptMode.ROLLBACK, InterruptMode.RESTORE)
        with self._mode.interrupting(received, replaces):
            name, tier, nbytes, success, message, replaced_at = self._stop_and_replace(
                operation, mode, boundaries, capsule, stages)
        wall, stamp = replaced_at or (time.time(), None)
        stages['restored'] = wall
        if reason:
            message += f' (reason: {reason})'
        name = name or (capsule if mode == InterruptMode.RESTORE else '')  # STOP names none
        self._out.event(operation, name, tier, nbytes, (wall - received) * 1e3, success,
                        message, stamp, stages=_after(received, stages))

    def _stop_and_replace(self, operation, mode, boundaries, capsule, stages):
        """Stop, then roll back or restore; return (name, tier, bytes, ok, message, at)."""
        name, tier, nbytes, success = '', '', 0, True
        replaced_at = None
        try:
            if mode == InterruptMode.STOP:
                stages['checked'] = time.time()
                with self._turns.stopped() as stopped:
                    if not stopped:
                        raise FlashRTError('the generation did not reach a step boundary '
                                           'within interrupt_timeout; raise it or check the '
                                           'node log')
                    message = f'stopped at position {self._rt.position}'
            elif mode in (InterruptMode.ROLLBACK, InterruptMode.RESTORE):
                info, message, replaced_at = self._replace_state(operation, mode, boundaries,
                                                                 capsule, stages)
                name, tier, nbytes = info.name, info.tier, info.nbytes
            else:
                raise FlashRTError(f'interrupt mode {mode} is not valid; use 0 (POLICY), '
                                   '1 (STOP), 2 (ROLLBACK) or 3 (RESTORE)')
            message += self._mode.after_interrupt()
        except Exception as exc:
            success, message = False, f'{operation} failed: {exc}'
            if mode != InterruptMode.STOP:  # still stop: an interrupt must not go unheeded
                with self._turns.stopped():
                    message += f'; stopped at position {self._rt.position} instead'
                try:
                    message += self._mode.after_interrupt()  # a policy's queue goes too
                except Exception as again:
                    message += f'; {again}'
            self._out.log('warning', message)
        return name, tier, nbytes, success, message, replaced_at

    def _replace_state(self, operation, mode, boundaries, capsule, stages):
        """
        Roll back or restore now, ending a running turn mid-step; return (info, message, at).

        The running turn is marked first, so that it does not save_as the state put in its
        place; queued turns wait until it is over. `at` is (wall time, stamp) of the restore
        itself.
        """
        who = 'a reset' if operation == 'reset' else 'an interrupt'
        what = (f'rolled back {boundaries} boundaries' if mode == InterruptMode.ROLLBACK
                else f'restored {capsule!r}')
        with self._turns.held() as turn:
            if turn is not None:
                with self._turns.replace_lock:  # after its start_from or save_as, if begun
                    turn.replaced_by = f'{who} {what}'
            stages['checked'] = time.time()
            try:
                if mode == InterruptMode.ROLLBACK:
                    info = self._rt.rollback(boundaries, preempt=True, stages=stages)
                    message = f'stopped and rolled back {boundaries} to position {info.position}'
                else:
                    info = self._rt.restore(capsule, preempt=True, stages=stages)
                    message = f'stopped and restored {capsule!r} at position {info.position}'
            except Exception:
                if turn is not None:
                    turn.replaced_by = ''  # refused (checked before anything stopped)
                raise
            at = time.time(), self._out.now()
            if turn is not None:
                if turn.done.wait(self._param('interrupt_timeout')):
                    stages['ended'] = time.time()
                else:
                    message += '; the interrupted turn did not end within interrupt_timeout'
        return info, message, at

    def after_cancel(self, turn):
        """
        Apply interrupt_policy after a cancelled turn (generation thread); say what it did.

        Under replace_lock: an interrupt or reset that replaced the state meanwhile wins, and
        one that comes now waits, so the policy never undoes it.
        """
        with self._turns.replace_lock:
            if turn.replaced_by:
                return f'interrupt policy skipped: {turn.replaced_by} during the turn'
            return self._apply_cancel_policy()

    def _apply_cancel_policy(self):
        t0 = time.perf_counter()
        policy = self._param('interrupt_policy')
        name, tier, nbytes, success = '', '', 0, True
        try:
            if policy == 'rollback':
                info = self._rt.rollback(1)
                name, tier, nbytes = info.name, info.tier, info.nbytes
            elif policy == 'restore_home':
                info = self._rt.restore(self._param('home_capsule'))
                name, tier, nbytes = info.name, info.tier, info.nbytes
            message = f'interrupt policy {policy} applied at position {self._rt.position}'
        except FlashRTError as exc:
            success, message = False, f'interrupt policy {policy} failed: {exc}'
        self._out.event('interrupt', name, tier, nbytes, (time.perf_counter() - t0) * 1e3,
                        success, message + ' (reason: goal cancelled)')
        return message


def _after(received, stages):
    """Return [('received', wall time), (stage, wall time), ...] in STAGES order."""
    return [('received', received)] + [(k, stages[k]) for k in STAGES if k in stages]
