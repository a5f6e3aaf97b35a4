"""
Preemption: a restore or rollback that replaces the state of a running generation.

Concurrency. One writer: every state access holds the step lock (Runtime._lock), which a
generation takes for each of its steps. restore/rollback(..., preempt=True) checks its
capsule first; then preempt_with (one at a time, under Runtime._preemption_lock) arms a
global forward pre-hook, sets Runtime._preemption and waits for the step lock. The generation
thread meets the request at its next step boundary, or inside the forward at the next
module call (the hook raises StepAborted there, on that thread only), ends its turn and
runs it (serve); when no step runs, the caller runs it itself. An abandoned forward leaves
the state torn, and the capsule written over it also zeroes the rows that forward may have
written (Cursor.extent). A captured CUDA graph replays as one launch, so there the wait is
up to one step; a policy's act() is always waited for.

A forward that fails half-way for any other reason (out of memory, a bug in a custom
module, Ctrl-C) puts the newest committed boundary back (guarded_forward).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time

import torch

from .state.capsule import CapsuleInfo


class StepAborted(Exception):
    """Raised inside the model when a running step is abandoned (the state is then torn)."""


# Preemptions armed in this process. Compiled code that calls no module (models/cpu_step.c)
# polls it between layers and, when set, meets the global hook there as a module call would.
ARMED = ctypes.c_int32(0)
_armed_lock = threading.Lock()


def _arm(step: int) -> None:
    with _armed_lock:
        ARMED.value += step


class Preemption:
    """
    A restore or rollback waiting to replace the state of a running generation.

    Armed from the start (an LM runtime): once it is Runtime._preemption, the next module call
    of the turn's abortable forward raises StepAborted. Module calls read the global hooks
    each time, so that holds at once, also while the turn is inside a forward. The hook
    sees every module call of the process, so it checks the thread; without a waiting
    preemption there is no hook at all, so a step pays nothing for being abortable. A
    policy's act() is not abandoned: the preemption waits for it (one control step).
    """

    def __init__(self, rt, run, stages=None):
        self.run = run  # run(from_newest: bool) -> CapsuleInfo, with the step lock held
        self.stages = {} if stages is None else stages  # stage -> time.perf_counter()
        self.done = False
        self.result: CapsuleInfo | None = None
        self.error: BaseException | None = None
        self.hook = None
        if not rt.is_policy:
            def check(module, args):
                if rt._preemption is not None and rt._abortable_thread == threading.get_ident():
                    raise StepAborted()

            self.hook = torch.nn.modules.module.register_module_forward_pre_hook(check)
            _arm(1)


def preempt_with(rt, run, stages: dict | None = None) -> CapsuleInfo:
    """
    Run run(from_newest) with the step lock held, ending a running generation first.

    run must check first that the runtime is still open (close() may run while this waits).
    stages, when given, gets time.perf_counter() at 'armed' (the request visible to the
    step), 'step_left' (the state is this request's) and 'copied' (run returned).
    """
    with rt._preemption_lock:
        request = Preemption(rt, run, stages)  # armed first: see Preemption
        try:
            rt._preemption = request
            request.stages['armed'] = time.perf_counter()
            with rt._lock:
                rt._preemption = None
                if not request.done:  # no step was running: a boundary or idle
                    request.stages['step_left'] = time.perf_counter()
                    gen = rt._turn
                    result = run(gen is not None and end_turn(gen, torn=False))
                    request.stages['copied'] = time.perf_counter()
                    return result
        finally:
            rt._preemption = None
            if request.hook is not None:
                request.hook.remove()
                _arm(-1)
    if request.error is not None:
        raise request.error
    return request.result


def serve(rt, gen, torn: bool) -> None:
    """
    End `gen` and run the waiting preemption (lock held, on the generation thread).

    torn: a forward was abandoned half-way, so the turn ends uncommitted and the live state
    must be replaced; if the preemption fails anyway (it was checked before it was armed)
    the last committed boundary is put back instead.
    """
    request = rt._preemption
    request.stages['step_left'] = time.perf_counter()
    from_newest = end_turn(gen, torn)
    try:
        request.result = request.run(from_newest)
        request.stages['copied'] = time.perf_counter()
    except Exception as exc:
        request.error = exc
        if torn:
            recover_torn(rt)
    request.done = True
    rt._preemption = None  # served: a turn started before the caller wakes must not see it


def end_turn(gen, torn: bool) -> bool:
    """
    End `gen` for a waiting restore/rollback (lock held); return its run()'s `from_newest`.

    True when the turn committed no end of its own, so a rollback counts from the newest
    boundary: cut mid-step (torn), claimed and never started, or a conversation turn (the
    state is replaced anyway: its end-of-turn tokens are not fed for nothing).
    """
    from_newest = torn or not gen.started or gen.closes_turn
    gen.finish('interrupted', commit=not (torn or gen.closes_turn))
    return from_newest


def recover_torn(rt) -> None:
    """Replace a half-updated state: the newest committed boundary, else a reset."""
    rt.ring.prune(rt.arena.rows_shared)
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
        gen = rt._turn
        if gen is not None and rt._preemption is not None:
            # A restore/rollback waits for this step: it replaces the state as it would
            # have replaced an abandoned one (rollback(1) lands on the prompt's end).
            serve(rt, gen, torn=True)
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


@contextlib.contextmanager
def abortable_forward(rt):
    """Let a waiting preemption abandon the forward run inside (StepAborted)."""
    rt._abortable_thread = threading.get_ident()
    try:
        yield
    finally:
        rt._abortable_thread = 0
