"""
Preemption, the model's side: what a preempting restore or rollback does to a running step.

The writer slot (writer.py) decides when a preemption runs; this module says how a step is
abandoned and how the state is put back.

A waiting preemption abandons the step in flight at its next module call (StepAborted);
compiled code that calls no module (models/cpu_step.c) polls ARMED between layers and meets
the same hook there, and a long operation run in pieces (models/pieces.py) calls meet()
between them. An abandoned forward leaves the state torn, and the capsule written
over it also zeroes the rows that forward may have written (Cursor.extent). A captured CUDA
graph replays as one launch, so there the wait is up to one step. A policy's act() holds no
turn: it serves the preemption itself and raises PreemptedError (modes/policy.py).

A forward that fails half-way for any other reason (out of memory, a bug in a custom
module, Ctrl-C) puts the newest committed boundary back (guarded_forward).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading


class StepAborted(Exception):
    """Raised inside the model when a running step is abandoned (the state is then torn)."""


# Preemptions armed in this process. Compiled code that calls no module (models/cpu_step.c)
# polls it between layers and, when set, meets the global hook there as a module call would.
ARMED = ctypes.c_int32(0)
_armed_lock = threading.Lock()
_checks: list = []  # what meet() asks: each armed preemption's check(module, args)


def arm(step: int, check=None) -> None:
    """Count a preemption armed (1) or disarmed (-1) in ARMED; add or remove its `check`."""
    with _armed_lock:
        ARMED.value += step
        if check is not None and step > 0:
            _checks.append(check)
        elif check is not None:
            _checks.remove(check)


def meet() -> None:
    """Let an armed preemption abandon this thread's forward here, as a module call would."""
    if ARMED.value:
        for check in tuple(_checks):
            check(None, ())


def end_turn(gen, torn: bool, commit: bool = True) -> tuple[bool, bool]:
    """
    End `gen` for a waiting restore/rollback (lock held); return (from_newest, owed).

    from_newest, for the run: True when the turn committed no end of its own, so a
    rollback counts from the newest boundary: cut mid-step (torn), claimed and never
    started, or a conversation turn (the state is replaced anyway: its end-of-turn tokens
    are not fed for nothing). commit False: a restore replaces the state, which would drop
    the turn's end from the ring at once; owed says whether an end was left out that
    would have been committed (the writer commits it if the restore fails).
    """
    ends = not (torn or gen.closes_turn)
    owed = ends and not commit and gen.started and gen.result is None
    gen.finish('interrupted', commit=ends and commit)
    return not (ends and commit and gen.started), owed


def recover_torn(rt) -> None:
    """Replace a half-updated state: the newest committed boundary, else a reset."""
    rt.ring.prune(rt.arena)
    if rt.ring and rt.ring.depth > 0:
        rt.codec.apply(rt.ring[-1])
    else:
        rt.reset()


@contextlib.contextmanager
def guarded_forward(rt):
    """
    Put the state back when a forward fails half-way (lock held).

    An error from inside the model can leave some layers stepped and others not. The newest
    committed boundary comes back (the state before the call, outside a turn; a reset when
    rollback_depth is 0), a running turn ends uncommitted, and the error goes on to the
    caller. A preemption's StepAborted has its own path (serve).
    """
    try:
        yield
    except StepAborted:
        raise
    except BaseException as exc:
        gen = rt.writer.turn
        if gen is not None and rt.writer.pending:
            # A restore/rollback waits for this step: it replaces the state as it would
            # have replaced an abandoned one (rollback(1) lands on the prompt's end).
            rt.writer.serve(gen, torn=True)
            where = 'the waiting preemption replaced the state'
        else:
            if gen is not None:
                gen.finish('error', commit=False)
            recover_torn(rt)
            where = (f'the state was put back to the last committed boundary (position '
                     f'{rt.cursor.position})' if rt.ring.depth > 0
                     else 'the state was reset (rollback_depth is 0)')
        if hasattr(exc, 'add_note'):  # Python 3.11+
            exc.add_note(f'flashrt: the step failed half-way; {where}')
        raise
