"""
Turns: generation requests, run one at a time on the generation thread.

A turn's states (`Turn.state`, changed only under the scheduler's condition):

    reserve() ......... a request is counted in (no Turn yet: rclpy answers a goal first)
    QUEUED ----------> RUNNING -------> SETTLED -------> ENDING ---------> DONE
      |  start()        outcome fixed     counted out      final chunk out
      +------------------------------------------------------------------> DONE
         cancelled, dropped or refused before it started

    RUNNING   on the generation thread; a cancel interrupts it at the next step boundary.
    SETTLED   its outcome is fixed (save_as done or skipped): a cancel is refused, since it
              could only relabel the outcome. The cancel policy may still run.
    ENDING    counted out, so the next request is admitted; its final chunk goes out.
    DONE      result final, `done` set.

Concurrency rules
  * `TurnScheduler._cv` (a Condition) guards the queue, the running and ending turns, the
    hold count, the reservation count, the goal registry and early cancels, `active`,
    and every Turn's `state` and `cancel_requested`.
  * `TurnScheduler.replace_lock` serializes the state a turn owns with an interrupt that
    replaces it: a turn's start_from restore and save_as snapshot run under it, and an
    interrupt marks the turn `replaced_by` under it before it restores. Neither lock is
    ever taken while the other is held.
  * The live state itself is guarded by the runtime's step lock (runtime/runtime.py): the
    session only decides who may ask for a change, and when.
  * The generation thread never waits for a ROS executor, so a client calling a service
    from its token callback cannot deadlock the node.
"""

import collections
import contextlib
import dataclasses
import enum
import os
import sys
import threading
from typing import Callable

from flashrt_ros.runtime import BusyError, FlashRTError
from flashrt_ros.runtime.state.capsule import validate_name, validate_tier

# The executor, the generation thread and torch share the GIL. While a turn decodes, a short
# switch interval lets an interrupt be dispatched and preempt quickly; when idle, a longer one
# keeps the executor thread and a service callback from trading the GIL back and forth.
SWITCH_INTERVAL_DECODING_S = 0.00002
SWITCH_INTERVAL_IDLE_S = 0.0005
CANCELLED_UNSTARTED = 'cancelled before it started'
GOAL_POLICIES = ('reject', 'queue')  # a request while one runs or waits: refuse it, or queue it


class TurnState(enum.Enum):
    """Where a turn is in its life (see the module docstring)."""

    QUEUED = 'queued'
    RUNNING = 'running'
    SETTLED = 'settled'
    ENDING = 'ending'
    DONE = 'done'


@dataclasses.dataclass(frozen=True)
class TurnRequest:
    """What a turn is asked to do (a ~/generate goal, or a ~/prompt message)."""

    prompt: str = ''
    token_ids: tuple = ()          # used instead of prompt when non-empty
    raw: bool = False              # prompt appended as it is (no chat template)
    max_new_tokens: int = 0        # 0: the max_new_tokens parameter
    temperature: float = -1.0      # negative (here and below): the checkpoint's default
    top_k: int = -1
    top_p: float = -1.0
    seed: int = -1                 # -1 keeps the live sampler state
    stop: tuple = ()               # empty: the stop_strings parameter
    start_from: str = ''
    save_as: str = ''
    save_tier: str = ''


@dataclasses.dataclass
class TurnResult:
    """How a turn ended (the action's result)."""

    success: bool = False
    message: str = ''
    token_ids: list = dataclasses.field(default_factory=list)
    stop_reason: str = ''
    time_to_first_token_ms: float = 0.0
    tokens_per_second: float = 0.0
    position: int = 0
    # The reply's text, or a callable that gives it on the first read of `text`: a turn's
    # whole text is decoded by its first reader (a goal's result), not as the turn ends,
    # where an interrupt's event waits for it; a ~/prompt turn's is never read.
    text_source: str | Callable[[], str] = dataclasses.field(default='', repr=False)

    @property
    def text(self) -> str:
        """Return the reply's text, decoding it on the first read."""
        if callable(self.text_source):
            self.text_source = self.text_source()
        return self.text_source

    @text.setter
    def text(self, value: str) -> None:
        self.text_source = value


class Turn:
    """One generation turn: its request, its state, and what it streamed."""

    def __init__(self, request, handle=None):
        self.request = request
        self.handle = handle            # the caller's (the node's goal handle); None: ~/prompt
        self.state = TurnState.QUEUED
        self.cancel_requested = False
        self.replaced_by = ''           # an interrupt or reset that replaced the live state
        self.result = TurnResult()
        self.done = threading.Event()
        self.turn_id = 0                # set when it starts
        self.streamed = 0               # tokens published in chunks before the final one
        self.final = None               # (ids, text, stop_reason) of the final chunk

    @property
    def settled(self):
        """Whether its outcome is fixed, so that a cancel is refused."""
        return self.state in (TurnState.SETTLED, TurnState.ENDING, TurnState.DONE)

    def fail(self, message, position, stop_reason='error', ids=(), text=''):
        """End with success=false before any result of the runtime's (final chunk included)."""
        self.result = TurnResult(success=False, message=message, stop_reason=stop_reason,
                                 position=position)
        self.final = list(ids), text, stop_reason


class TurnScheduler:
    """Admission, queue, cancels and the generation thread (see the module docstring)."""

    def __init__(self, runtime, param, outputs, run_turn, after_cancel, check_turn):
        """
        Schedule turns over `runtime`.

        run_turn(turn, should_stop) runs a turn's generation (the mode's); after_cancel(turn)
        applies the cancel policy to a cancelled turn and returns what it did; check_turn(request)
        says why a request's own parameters are refused ('' if fine) before start_from runs.
        """
        self._rt = runtime
        self._param = param
        self._out = outputs
        self._run_generation = run_turn
        self._check_turn = check_turn
        self._after_cancel = after_cancel
        self._cv = threading.Condition()
        self._queue = collections.deque()
        self._running = None            # the turn on the generation thread
        self._ending = None             # counted out, final chunk not yet out
        self._holds = 0                 # state operations that keep queued turns waiting
        self._stops = 0                 # of those, the ones that also end the running turn
        self._reserved = 0              # admitted requests not yet counted out
        self._goals = {}                # goal key -> Turn, until its status is final
        self._early_cancels = set()     # goal keys cancelled before their turn existed
        self._active = False
        self._stopping = False
        self._thread = None
        self._last_turn_id = 0
        self.replace_lock = threading.Lock()
        self.tune_switch_interval = False
        # Nice value of the generation thread (0: as started). Below 0, a busy CPU preempts
        # it less often while it holds the interpreter lock an interrupt needs.
        self.generation_nice = 0

    # ---- admission -------------------------------------------------------------------

    @property
    def active(self):
        return self._active

    @property
    def running(self):
        """Return the turn on the generation thread, or None."""
        return self._running

    def set_active(self, active):
        with self._cv:
            self._active = bool(active)

    def reserve(self, source, refusal=''):
        """Count a request in, or return why it is refused ('' when admitted)."""
        with self._cv:
            if not self._active:
                return self._out.not_active_message()
            if refusal:
                return refusal
            if self._reserved > 0 and self._param('goal_policy') == 'reject':
                return (f'{source} rejected: a generation is already running or queued and '
                        'goal_policy is reject; cancel it, wait, or set goal_policy to queue')
            self._reserved += 1
            return ''

    def enqueue(self, turn, goal_key=None):
        """Queue a reserved turn (registered under goal_key for cancels and results)."""
        with self._cv:
            if goal_key is not None:
                self._goals[goal_key] = turn
                if goal_key in self._early_cancels:
                    self._early_cancels.discard(goal_key)
                    turn.cancel_requested = True
            cancelled = turn.cancel_requested
            if self._active and self._thread is not None and not cancelled:
                self._queue.append(turn)
                self._cv.notify_all()
                return
            self._reserved -= 1
            turn.state = TurnState.SETTLED
        if cancelled:
            self._finish_unstarted(turn, True, CANCELLED_UNSTARTED)
        else:
            self._finish_unstarted(turn, False, self._out.not_active_message())

    def goal_turn(self, goal_key):
        with self._cv:
            return self._goals.get(goal_key)

    def forget_goal(self, goal_key):
        """Drop a goal's turn once its status is final (a later cancel finds nothing)."""
        with self._cv:
            self._goals.pop(goal_key, None)

    def cancel(self, goal_key, goal_active=True):
        """Cancel a goal's turn; return whether the cancel is accepted."""
        with self._cv:
            turn = self._goals.get(goal_key)
            if turn is None:
                # rclpy answers a goal before its turn is queued, so a cancel sent at once
                # can come first: remember it, and the turn ends before it starts.
                if not goal_active:
                    return False
                self._early_cancels.add(goal_key)
                return True
            if turn.settled:
                return False
            turn.cancel_requested = True
            queued = turn in self._queue
            if queued:  # end it now, not when the running turn ends
                self._queue.remove(turn)
                self._reserved -= 1
                turn.state = TurnState.SETTLED
            running = self._running is turn
        if queued:
            self._finish_unstarted(turn, True, CANCELLED_UNSTARTED)
        elif running:
            self._rt.interrupt()  # takes effect before the next decode step
        return True

    def drop_queued(self, message):
        """End every queued turn unstarted, with success=false and `message`."""
        with self._cv:
            dropped = list(self._queue)
            self._queue.clear()
            self._reserved -= len(dropped)
            for turn in dropped:
                turn.state = TurnState.SETTLED
            self._cv.notify_all()
        for turn in dropped:
            self._finish_unstarted(turn, False, message)

    def _finish_unstarted(self, turn, success, message):
        turn.result = TurnResult(success=success, message=message,
                                 stop_reason='interrupted' if success else 'error',
                                 position=self._rt.position)
        with self._cv:
            turn.state = TurnState.DONE
        turn.done.set()
        if turn.handle is not None:
            self._out.start_goal(turn)  # its caller then reports the result

    # ---- holds: state operations between turns ---------------------------------------

    @contextlib.contextmanager
    def held(self):
        """Keep queued turns from starting; yield the running or ending turn (None: idle)."""
        with self._cv:
            self._holds += 1
            turn = self._running or self._ending
        try:
            yield turn
        finally:
            with self._cv:
                self._holds -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def exclusive(self, busy_message):
        """Keep turns from starting; raise BusyError(busy_message) if one runs now."""
        with self.held():  # held first: no turn can start between the check and the yield
            if self._running is not None:
                raise BusyError(busy_message)
            yield

    @contextlib.contextmanager
    def stopped(self):
        """Stop the running turn at its next step; yield whether it ended in time."""
        with self.held() as turn:
            with self._cv:
                self._stops += 1
            try:
                self._rt.interrupt()
                # Ended means done, not just counted out: its final chunk is out (a
                # deactivate must not disable ~/tokens before that) and its result is ready.
                yield turn is None or turn.done.wait(self._param('interrupt_timeout'))
            finally:
                with self._cv:
                    self._stops -= 1

    def should_stop(self, turn):
        """
        Whether the running turn should end at this step boundary.

        A cancel or a stop (stopped(): also a turn that had not begun its generation when
        the runtime's interrupt came). Not a hold, nor an interrupt that replaces the state:
        the runtime's preemption ends the turn inside its step, and a turn closed here would
        first commit its end (a conversation turn's closing tokens, a forward) while the
        interrupt waits. A mode checks `replaced_by` once its generation holds the writer
        slot: a replace that came before that ends the turn there.
        """
        return turn.cancel_requested or self._stops > 0

    # ---- the generation thread -------------------------------------------------------

    def start(self):
        with self._cv:
            self._stopping = False
        self._thread = threading.Thread(target=self._loop, name='flashrt-generation',
                                        daemon=True)
        self._thread.start()

    def stop(self):
        """End the generation thread (the running turn stops at its next step)."""
        thread = self._thread
        if thread is None:
            return
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._rt.interrupt()
        thread.join(timeout=max(1.0, self._param('interrupt_timeout')))
        self._thread = None

    def _loop(self):
        if self.generation_nice:
            try:  # Linux: this thread only
                os.setpriority(os.PRIO_PROCESS, 0, self.generation_nice)
            except OSError as exc:
                self._out.log('warning', f'generation thread nice {self.generation_nice} '
                                         f'refused ({exc}); it keeps its nice value')
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopping or (self._queue and not self._holds))
                if self._stopping:
                    return
                turn = self._queue.popleft()
                self._running = turn
                self._last_turn_id += 1
                turn.turn_id = self._last_turn_id
                turn.state = TurnState.RUNNING
            if self.tune_switch_interval:
                sys.setswitchinterval(SWITCH_INTERVAL_DECODING_S)
            try:
                self._run(turn)
            except Exception as exc:  # a bug: end the turn with an error, keep the thread
                self._out.log('error', f'generation turn failed: {exc!r}')
                final = turn.final
                turn.fail(f'internal error: {exc!r}', self._rt.position)
                turn.final = final or turn.final
            finally:
                self._end(turn)

    def _end(self, turn):
        with self._cv:  # first: a cancel from here on could only relabel the outcome
            self._running, self._ending = None, turn
            self._reserved -= 1
            turn.state = TurnState.ENDING
            self._cv.notify_all()
        if not turn.result.success:
            self._out.log('warning', f'generation turn failed: {turn.result.message}')
        if self.tune_switch_interval:  # the next turn sets the short one again
            sys.setswitchinterval(SWITCH_INTERVAL_IDLE_S)
        # The final chunk says the turn is over: save_as and the cancel policy are done,
        # and the next request is admitted (goal_policy reject counted this one out).
        try:
            if turn.final is not None:
                self._out.chunk(turn, turn.streamed, *turn.final, final=True)
        except Exception as exc:  # e.g. the action server went away: keep the thread
            self._out.log('warning', f'could not publish the final chunk: {exc!r}')
        finally:
            with self._cv:
                if self._ending is turn:
                    self._ending = None
                turn.state = TurnState.DONE
            turn.done.set()

    def _run(self, turn):
        """Run one turn: start_from, the mode's generation, save_as, the cancel policy."""
        if turn.handle is not None:
            self._out.start_goal(turn)
        position = self._rt.position
        if turn.cancel_requested:
            turn.result = TurnResult(success=True, stop_reason='interrupted',
                                     message=CANCELLED_UNSTARTED, position=position)
            turn.final = [], '', 'interrupted'
            return
        failure = (self._check_save_as(turn.request) or self._check_turn(turn.request)
                   or self.start_from(turn))
        if failure:
            turn.fail(failure, self._rt.position)
            return
        res = self._run_generation(turn, self.should_stop)
        if res is None:  # it failed and said why (turn.result, turn.final)
            return
        if turn.final is None:  # every turn ends with a final chunk, even an empty one
            turn.final = [], '', res.stop_reason
        success, message = True, f'{len(res.token_ids)} tokens, stop reason {res.stop_reason}'
        if 0 < res.prompt_consumed < res.prompt_tokens:  # a STOP cut a long prefill short
            message += (f'; the prompt was cut after {res.prompt_consumed} of '
                        f'{res.prompt_tokens} tokens (committed there)')
        if turn.request.save_as:
            saved, note = self.save_as(turn)
            success, message = saved, f'{message}; {note}'
        with self._cv:  # from here a cancel is refused: it could no longer change the outcome
            turn.state = TurnState.SETTLED
            cancelled = turn.cancel_requested
        if cancelled:
            message += '; cancelled, ' + self._after_cancel(turn)
        turn.result = TurnResult(
            success=success, message=message, text_source=lambda: res.text,
            token_ids=list(res.token_ids),
            stop_reason=res.stop_reason, time_to_first_token_ms=res.ttft_s * 1e3,
            tokens_per_second=res.tokens_per_s, position=self._rt.position)

    @staticmethod
    def _check_save_as(request):
        """Refuse a bad save_as name or tier before the turn changes anything ('' if fine)."""
        if not request.save_as:
            return ''
        try:
            validate_name(request.save_as)
            validate_tier(request.save_tier or 'device')
        except FlashRTError as exc:
            return f'save_as {request.save_as!r} refused before the turn: {exc}'
        return ''

    def start_from(self, turn):
        """Restore the request's start_from capsule; return an error message or ''."""
        name = turn.request.start_from
        if not name:
            return ''
        with self.replace_lock:
            if turn.replaced_by:  # an interrupt's restore came first: it wins, the turn ends
                return ''
            try:
                info = self._rt.restore(name)
            except FlashRTError as exc:
                message = f'start_from {name!r} failed: {exc}'
                self._out.event('restore', name, '', 0, 0.0, False, message)
                return message
        self._out.event('restore', info.name, info.tier, info.nbytes, info.latency_s * 1e3,
                        True, f'start_from {info.name!r} at position {info.position}')
        return ''

    def save_as(self, turn):
        """Snapshot the turn's end state as save_as; return (success, what happened)."""
        name, tier = turn.request.save_as, turn.request.save_tier or 'device'
        with self.replace_lock:  # an interrupt marks the turn before it replaces the state
            if turn.replaced_by:  # the live state is no longer this turn's
                return False, f'save_as {name!r} skipped: {turn.replaced_by} during the turn'
            try:
                info = self._rt.snapshot(name, tier)
            except FlashRTError as exc:
                message = f'save_as {name!r} failed: {exc}'
                self._out.event('snapshot', name, tier, 0, 0.0, False, message)
                return False, message
            self._out.event('snapshot', info.name, info.tier, info.nbytes,
                            info.latency_s * 1e3, True,
                            f'save_as {info.name!r} at position {info.position}')
            self._out.evictions()
        return True, f'saved as {info.name!r} ({info.tier})'
