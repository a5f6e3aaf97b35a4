"""
The writer slot: who changes the live state, how a step is preempted, how a boundary is kept.

The single-writer state of a Runtime lives here and nowhere else; it needs no model, so its
tests need none either (test/runtime/test_writer.py).

- `lock` (the step lock) guards every read or write of the arena and its metadata, one
  step at a time; `turn` is the generation that holds the slot from generate() until it
  ends, and `stop` asks it to end at its next step boundary.
- A restore or rollback that must not wait for a running turn preempts it (`preempt`): the
  request is armed first (a global forward pre-hook, and `preemption.ARMED` and `meet()` for
  code between module calls), then it waits for the step lock. The turn's thread meets it
  at its next step boundary (`pending`), or inside the forward at its next module call
  while `abortable()` (the hook raises StepAborted there, on that thread only), and runs
  it itself (`serve`); when no step runs, the caller runs it under the lock.
- When a real-time thread (SCHED_FIFO/RR, the node's control thread) waits in `preempt`
  longer than a step takes, the thread holding the step lock runs just below it (priority
  inheritance) until the caller has the lock: otherwise a normal thread on a busy core
  delays the step it waits for, the restore, and the release of the lock after it.
- `commit()` pushes the live state on the rollback ring: every change ends in one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable

import torch

from .preemption import arm, StepAborted


_log = logging.getLogger(__name__)

# A preemption that has waited this long for a step lends its real-time priority to it; a
# step usually ends sooner, and lending costs the stepping thread a reschedule.
LEND_AFTER_S = 0.0005


class StepLock:
    """A reentrant lock that knows the native id of the thread holding it (lend_priority)."""

    def __init__(self):
        self._lock = threading.RLock()
        self._depth = 0
        self.owner = 0  # native thread id of the holder, 0 when free

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self._depth += 1
        if self._depth == 1:
            self.owner = threading.get_native_id()
        return True

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.owner = 0
        self._lock.release()

    def _is_owned(self) -> bool:
        return self._lock._is_owned()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class Request:
    """A restore or rollback waiting for the step lock: run it, or say how it ended."""

    def __init__(self, run: Callable[[bool], Any], stages: dict | None, replaces: bool):
        self.run = run  # run(from_newest) -> result, with the step lock held
        self.stages = {} if stages is None else stages  # stage -> time.time()
        self.replaces = replaces  # run puts a whole state in place of the live one
        self.done = False
        self.give_back: Callable[[], None] | None = None  # ends a lent priority (preempt)
        self.result = None
        self.error: BaseException | None = None

    def end_lent_priority(self) -> None:
        """Put the lock holder's own priority back (see lend_priority); idempotent."""
        give_back, self.give_back = self.give_back, None
        if give_back is not None:
            give_back()


class WriterSlot:
    """The step lock, the turn holding the slot, its stop flag and a waiting preemption."""

    def __init__(self, commit: Callable[[], None],
                 end_turn: Callable[[Any, bool, bool], tuple[bool, bool]],
                 recover_torn: Callable[[], None], abortable_steps: bool = True):
        """
        commit(): push the live state on the rollback ring (lock held).

        end_turn(turn, torn, commit) ends `turn` for a preemption and returns its run's
        from_newest and whether it left out a commit of its end that it would have made
        (commit False); recover_torn() puts a half-updated state back when a preemption
        that was to replace it fails. abortable_steps False: steps are waited for, never
        abandoned (a policy's act()).
        """
        self.lock = StepLock()
        self.turn = None
        self.stop = threading.Event()
        self._commit = commit
        self._end_turn = end_turn
        self._recover_torn = recover_torn
        self._abortable_steps = abortable_steps
        self._request: Request | None = None
        self._preempting = threading.Lock()  # one preemption at a time
        self._abortable_thread = 0  # the thread whose forward may be abandoned now, or 0
        self.lend_after_s: float | None = LEND_AFTER_S  # None: never lend (a measurement's A/B)

    # ---- the turn --------------------------------------------------------------------

    def claim(self, turn) -> None:
        """Give the slot to `turn` (lock held; the caller checked it was free)."""
        self.stop.clear()
        self.turn = turn

    def release(self, turn) -> None:
        """Free the slot if `turn` holds it (lock held)."""
        if self.turn is turn:
            self.turn = None
            self.stop.clear()

    def commit(self) -> None:
        """Mark the live state as a committed boundary (lock held)."""
        self._commit()

    @contextlib.contextmanager
    def abortable(self):
        """Let a waiting preemption abandon the forward run inside (StepAborted)."""
        self._abortable_thread = threading.get_ident()
        try:
            yield
        finally:
            self._abortable_thread = 0

    # ---- preemption ------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether a preemption waits for the step boundary (checked there, lock held)."""
        return self._request is not None

    def preempt(self, run: Callable[[bool], Any], stages: dict | None = None,
                replaces: bool = False):
        """
        Return run(from_newest) run with the step lock held, ending a running turn first.

        run must check first that the runtime is still open (close may run while this
        waits). A caller under a real-time policy that waits past lend_after_s lends it to
        the lock's holder until it holds the lock itself (lend_priority).
        stages, when given, gets time.time() at 'armed' (the request visible to the step),
        'step_left' (the state is this request's) and 'copied' (run returned).
        replaces: run puts a capsule's whole state in place of the live one (a restore).
        The turn it ends then commits no end of its own, which the restore would drop at
        once (its rows are past those the capsule shares with the live state); if run
        fails, that end is committed then, as it would have been.
        """
        with self._preempting:
            request = Request(run, stages, replaces)
            hook = None
            if self._abortable_steps:  # armed first: the next module call meets it
                hook = torch.nn.modules.module.register_module_forward_pre_hook(self._check)
                arm(1, self._check)
            try:
                self._request = request
                request.stages['armed'] = time.time()
                self._take_lock(request)
                try:
                    request.end_lent_priority()  # the lock is the caller's: nothing to wait for
                    self._request = None
                    if not request.done:  # no step was running: a boundary, or idle
                        self._run(request, self.turn, False)
                finally:
                    self.lock.release()
            finally:
                self._request = None
                request.end_lent_priority()
                if hook is not None:
                    hook.remove()
                    arm(-1, self._check)
        if request.error is not None:
            raise request.error
        return request.result

    def _take_lock(self, request: Request) -> None:
        """Take the step lock; after lend_after_s lend the caller's priority to its holder."""
        after = self.lend_after_s
        if after is None:
            self.lock.acquire()
            return
        if self.lock.acquire(timeout=after):
            return
        request.give_back = lend_priority(self.lock.owner)  # whoever holds it: a step or not
        self.lock.acquire()

    def _check(self, module, args) -> None:
        """Abandon this thread's step (the forward pre-hook of an armed preemption, meet())."""
        if self._request is not None and self._abortable_thread == threading.get_ident():
            raise StepAborted()

    def serve(self, turn, torn: bool) -> None:
        """
        End `turn` and run the waiting preemption (lock held, on the turn's thread).

        turn None: a call that holds no turn (a policy's act()) was abandoned. torn: a
        forward was abandoned half-way, so the turn ends uncommitted and the live state must
        be replaced; if the preemption fails anyway (it was checked before it was armed)
        the last committed boundary is put back instead. A replacing preemption (see
        preempt) ends the turn uncommitted too.
        """
        try:
            self._run(self._request, turn, torn)
        finally:
            self._request = None  # served: a turn started before the caller wakes must not see it

    def _run(self, request: Request, turn, torn: bool) -> None:
        """
        End `turn` (None: no turn) and run `request`; keep its result or error (lock held).

        Done even when putting a state back fails: the caller must not run it again.
        """
        request.stages['step_left'] = time.time()
        from_newest, owed = torn, False
        if turn is not None:
            from_newest, owed = self._end_turn(turn, torn, not request.replaces)
        try:
            request.result = request.run(from_newest)
            request.stages['copied'] = time.time()
        except BaseException as exc:
            request.error = exc
            if torn:
                self._recover_torn()
            elif owed:
                self._commit()  # the state was not replaced: its end is a boundary after all
            if not isinstance(exc, Exception):
                raise  # e.g. KeyboardInterrupt: on this thread, as it came
        finally:
            request.done = True


def lend_priority(tid: int) -> Callable[[], None] | None:
    """
    Run thread `tid` one priority below the calling real-time thread; return what undoes it.

    One below: once `tid` releases the lock the caller waits for, the caller runs at once,
    on a single core too. Threads `tid` starts meanwhile do not inherit the lent policy
    (SCHED_RESET_ON_FORK). None when there is nothing to lend (the caller runs under a
    normal policy or at priority 1, `tid` is 0, the caller itself or already as high) or the
    kernel refuses (no CAP_SYS_NICE or rtprio limit, the thread has ended). Undoing puts
    back the policy and priority read here; the kernel keeps a thread's nice value across
    policies.
    """
    if not tid or tid == threading.get_native_id() or not hasattr(os, 'sched_setscheduler'):
        return None
    real_time = (os.SCHED_FIFO, os.SCHED_RR)
    try:
        policy = os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK
        priority = os.sched_getparam(0).sched_priority
        if policy not in real_time or priority < 2:
            return None
        old_policy, old_param = os.sched_getscheduler(tid), os.sched_getparam(tid)
        if old_policy & ~os.SCHED_RESET_ON_FORK in real_time and (
                old_param.sched_priority >= priority - 1):
            return None
        os.sched_setscheduler(tid, policy | os.SCHED_RESET_ON_FORK,
                              os.sched_param(priority - 1))
    except OSError:
        return None

    def give_back():
        for flags in (0, os.SCHED_RESET_ON_FORK):  # only CAP_SYS_NICE may clear the flag
            try:
                os.sched_setscheduler(tid, old_policy | flags, old_param)
                return
            except ProcessLookupError:  # the thread has ended
                return
            except OSError as exc:
                error = exc
        _log.error(f'thread {tid} keeps the real-time priority lent to it: {error!r}')
    return give_back
