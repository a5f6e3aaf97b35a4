"""The writer slot on its own: claims, commits and preemption, with no model at all."""

import os
import threading
import time

from flashrt_ros.runtime.preemption import ARMED, StepAborted
from flashrt_ros.runtime.writer import lend_priority, WriterSlot
import pytest
import torch

STAGES = ['armed', 'step_left', 'copied']


class Turn:
    """A stand-in generation loop: steps under the slot's lock, as Generation does."""

    def __init__(self, slot, module=None):
        self.slot, self.module = slot, module
        self.steps = 0
        self.ended = None  # torn, once a preemption ended it
        self.running = threading.Event()
        self.thread = threading.Thread(target=self._loop)

    def _loop(self):
        slot = self.slot
        while True:
            with slot.lock:
                if slot.turn is not self:  # ended by a preemption its caller ran
                    return
                if slot.pending:
                    slot.serve(self, torn=False)
                    return
                try:
                    self._step()
                except StepAborted:
                    slot.serve(self, torn=True)
                    return
            self.running.set()

    def _step(self):
        self.steps += 1
        if self.module is not None:
            with self.slot.abortable():
                for _ in range(1000):  # a long forward: many module calls
                    self.module(torch.zeros(1))


def _slot(log, abortable=True):
    def end_turn(turn, torn, commit):
        turn.ended = torn
        log.append(('end', torn) if commit else ('end', torn, 'uncommitted'))
        slot.release(turn)
        return torn or not commit, not (torn or commit)

    slot = WriterSlot(lambda: log.append('commit'), end_turn, lambda: log.append('recover'),
                      abortable_steps=abortable)
    return slot


def _running(log, abortable=True):
    """Return (slot, turn): a turn stepping on its own thread, claimed."""
    slot = _slot(log, abortable)
    turn = Turn(slot, torch.nn.Identity())
    slot.claim(turn)
    turn.thread.start()
    assert turn.running.wait(10.0)
    return slot, turn


def _fail(from_newest):
    raise ValueError('copy failed')


def test_claim_release_and_stop():
    log = []
    slot = _slot(log)
    first, second = object(), object()
    slot.stop.set()
    slot.claim(first)  # a new claim starts without a stop request
    assert slot.turn is first and not slot.stop.is_set()
    slot.stop.set()
    slot.release(second)  # not the holder: nothing changes
    assert slot.turn is first and slot.stop.is_set()
    slot.release(first)
    assert slot.turn is None and not slot.stop.is_set()
    slot.commit()
    assert log == ['commit']


def test_an_idle_preemption_runs_on_the_caller_with_its_stages():
    log, stages = [], {}
    slot = _slot(log)
    before = ARMED.value
    result = slot.preempt(lambda from_newest: ('ran', from_newest,
                                               slot.lock._is_owned()), stages)
    assert result == ('ran', False, True)  # under the lock, no turn to end
    assert list(stages) == STAGES and sorted(stages.values()) == list(stages.values())
    assert ARMED.value == before and not slot.pending  # disarmed again


def test_a_running_turn_serves_the_preemption_at_its_boundary():
    log, stages = [], {}
    slot = _slot(log)
    turn = Turn(slot)
    slot.claim(turn)
    turn.thread.start()
    assert turn.running.wait(10.0)
    ran_on = []
    result = slot.preempt(lambda from_newest: ran_on.append(threading.current_thread())
                          or from_newest, stages)
    turn.thread.join(10.0)
    assert not turn.thread.is_alive()
    assert slot.turn is None
    assert result is False and turn.ended is False and log == [('end', False)]
    assert ran_on in ([turn.thread], [threading.main_thread()])  # whoever had the lock
    assert list(stages) == STAGES


def test_an_abortable_step_is_abandoned_at_its_next_module_call():
    log = []
    slot = _slot(log)
    module = torch.nn.Identity()
    turn = Turn(slot, module)
    slot.claim(turn)
    other_calls = []

    def bystander():  # another thread's module calls never raise
        for _ in range(2000):
            other_calls.append(module(torch.zeros(1)))

    turn.thread.start()
    assert turn.running.wait(10.0)
    watcher = threading.Thread(target=bystander)
    watcher.start()
    assert slot.preempt(lambda from_newest: from_newest) is True  # torn: from the newest
    turn.thread.join(10.0)
    assert not turn.thread.is_alive()
    watcher.join(10.0)
    assert turn.ended is True and len(other_calls) == 2000
    assert module(torch.zeros(1)) is not None  # no hook left behind


def test_a_failing_preemption_reaches_the_caller_and_puts_a_torn_state_back():
    log = []
    slot, turn = _running(log)
    with pytest.raises(ValueError, match='copy failed'):
        slot.preempt(_fail)
    turn.thread.join(10.0)
    assert not turn.thread.is_alive()
    # Served by the turn inside its step: the half-updated state is put back. (Served by
    # the caller between steps, nothing was torn and nothing is put back.)
    assert log in ([('end', True), 'recover'], [('end', False)])


def test_steps_that_may_not_be_abandoned_are_waited_for():
    log = []
    slot, turn = _running(log, abortable=False)
    assert slot.preempt(lambda from_newest: from_newest) is False
    turn.thread.join(10.0)
    assert not turn.thread.is_alive()
    assert turn.ended is False  # the step in flight ended whole: never torn


@pytest.mark.parametrize('abortable', [True, False])
def test_a_replacing_preemption_ends_the_turn_uncommitted(abortable):
    log = []
    slot, turn = _running(log, abortable)
    assert slot.preempt(lambda from_newest: from_newest, replaces=True) is True
    turn.thread.join(10.0)
    assert not turn.thread.is_alive() and slot.turn is None
    ends = [[('end', False, 'uncommitted')]]
    assert log in (ends + [[('end', True, 'uncommitted')]] if abortable else ends)


def test_a_failing_replacement_commits_the_end_it_left_out():
    """Served at a boundary or by the caller the state is intact; a torn one is put back."""
    log = []
    slot, turn = _running(log, abortable=False)  # served at its boundary
    with pytest.raises(ValueError, match='copy failed'):
        slot.preempt(_fail, replaces=True)
    turn.thread.join(10.0)
    assert log == [('end', False, 'uncommitted'), 'commit']
    log = []
    slot, turn = _running(log)  # abandoned in its step, or served at its boundary
    with pytest.raises(ValueError, match='copy failed'):
        slot.preempt(_fail, replaces=True)
    turn.thread.join(10.0)
    assert log in ([('end', True, 'uncommitted'), 'recover'],
                   [('end', False, 'uncommitted'), 'commit'])
    log = []
    slot = _slot(log)
    slot.claim(Turn(slot))  # holds the slot, no step runs: the caller runs it
    with pytest.raises(ValueError, match='copy failed'):
        slot.preempt(_fail, replaces=True)
    assert log == [('end', False, 'uncommitted'), 'commit'] and slot.turn is None
    idle = []
    slot = _slot(idle)
    with pytest.raises(ValueError):
        slot.preempt(_fail, replaces=True)  # no turn: nothing was left out
    assert idle == []


def test_an_interrupt_inside_a_replacement_still_commits_and_frees_the_lock():
    log = []
    slot = _slot(log)
    slot.claim(Turn(slot))

    def interrupted(from_newest):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        slot.preempt(interrupted, replaces=True)
    assert log == [('end', False, 'uncommitted'), 'commit']
    assert slot.lock.acquire(timeout=1.0)  # released on the way out
    slot.lock.release()
    assert not slot.pending


def test_one_preemption_at_a_time():
    log = []
    slot = _slot(log)
    inside, release, order = threading.Event(), threading.Event(), []

    def slow(from_newest):
        inside.set()
        assert release.wait(10.0)
        order.append('first')

    first = threading.Thread(target=lambda: slot.preempt(slow))
    first.start()
    assert inside.wait(10.0)
    second = threading.Thread(target=lambda: slot.preempt(lambda f: order.append('second')))
    second.start()
    second.join(0.2)
    assert second.is_alive() and order == []
    release.set()
    first.join(10.0)
    second.join(10.0)
    assert order == ['first', 'second']


def test_a_call_holding_no_turn_serves_the_preemption_that_abandons_it():
    log = []
    slot = _slot(log)
    module = torch.nn.Identity()
    started, outcome, ran_on = threading.Event(), [], []

    def call():  # as a policy's act(): the lock, no claim
        with slot.lock:
            try:
                with slot.abortable():
                    started.set()
                    deadline = time.monotonic() + 10.0
                    while time.monotonic() < deadline:
                        module(torch.zeros(1))
                outcome.append('ran to its end')
            except StepAborted:
                slot.serve(None, torn=True)
                outcome.append('abandoned')

    thread = threading.Thread(target=call)
    thread.start()
    assert started.wait(10.0)
    result = slot.preempt(lambda from_newest: ran_on.append(threading.current_thread())
                          or from_newest)
    thread.join(10.0)
    assert outcome == ['abandoned'] and ran_on == [thread]
    assert result is True and log == []  # torn: from the newest boundary; no turn ended


def _in_thread(fn):
    """Return fn()'s result, run on a thread of its own (scheduling changes stay there)."""
    out = []

    def run():
        try:
            out.append((fn(), None))
        except BaseException as exc:  # noqa: B902 - a skip too: raised again below
            out.append((None, exc))
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10.0)
    result, error = out[0]
    if error is not None:
        raise error
    return result


def _real_time(fn, priority=10):
    """Run fn() under SCHED_FIFO `priority` on a thread of its own; skip where not allowed."""
    def run():
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
        except (OSError, AttributeError) as exc:
            return exc
        return fn()
    out = _in_thread(run)
    if isinstance(out, (OSError, AttributeError)):
        pytest.skip(f'SCHED_FIFO not allowed here ({out})')
    return out


class Slow(torch.nn.Module):
    """A module call that goes on 50 ms after a preemption arrives (it lends after 0.5 ms)."""

    def __init__(self, slot):
        super().__init__()
        self.slot, self.entered = slot, threading.Event()

    def forward(self, x):
        self.entered.set()
        deadline = time.monotonic() + 10.0
        while not self.slot.pending and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.05)
        return x


@pytest.mark.parametrize('lend', [True, False])
def test_a_real_time_caller_lends_its_priority_to_a_slow_step(lend):
    log = []
    slot = _slot(log)
    if not lend:
        slot.lend_after_s = None
    turn = Turn(slot, Slow(slot))
    tid, leave = [], threading.Event()
    loop = turn._loop

    def stepping():  # a normal thread with a nice value of its own, kept after the turn
        tid.append(threading.get_native_id())
        os.setpriority(os.PRIO_PROCESS, 0, 3)
        loop()
        leave.wait(10.0)
    turn.thread = threading.Thread(target=stepping)
    slot.claim(turn)
    turn.thread.start()
    assert turn.module.entered.wait(10.0)  # inside its step

    def policy_of_the_stepper(from_newest):
        return os.sched_getscheduler(tid[0]), os.sched_getparam(tid[0]).sched_priority

    try:
        during = _real_time(lambda: slot.preempt(policy_of_the_stepper), priority=10)
        after = os.sched_getscheduler(tid[0]), os.getpriority(os.PRIO_PROCESS, tid[0])
    finally:
        leave.set()
        turn.thread.join(10.0)
    # Served by the turn's thread (at its next module call), just below the caller; threads
    # it starts meanwhile do not inherit that (or at its own policy: lend off).
    lent = (os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, 9)
    assert during == (lent if lend else (os.SCHED_OTHER, 0))
    assert after == (os.SCHED_OTHER, 3)  # and back to its own policy and nice value
    assert turn.ended is not None


def test_lend_priority_lends_only_a_real_time_policy_to_a_lower_thread():
    ended = _in_thread(threading.get_native_id)  # a thread that has ended
    assert lend_priority(0) is None
    assert _in_thread(lambda: lend_priority(threading.get_native_id())) is None  # normal
    assert _real_time(lambda: lend_priority(ended)) is None  # no such thread any more
    assert _real_time(lambda: lend_priority(threading.get_native_id())) is None  # itself

    def lend_to_one_as_high():
        higher = threading.get_native_id()
        return _real_time(lambda: lend_priority(higher), priority=6)  # would lend 5
    assert _real_time(lend_to_one_as_high, priority=5) is None

    def lend_at_priority(priority):  # to a normal thread waiting on an event
        waiting, leave, tid = threading.Event(), threading.Event(), []

        def wait():
            tid.append(threading.get_native_id())
            waiting.set()
            leave.wait(10.0)
        thread = threading.Thread(target=wait)
        thread.start()
        waiting.wait(10.0)
        try:
            give_back = _real_time(lambda: lend_priority(tid[0]), priority)
            lent = os.sched_getscheduler(tid[0]), os.sched_getparam(tid[0]).sched_priority
            if give_back is not None:
                give_back()
            return give_back is not None, lent, os.sched_getscheduler(tid[0])
        finally:
            leave.set()
            thread.join(10.0)
    assert lend_at_priority(1) == (False, (os.SCHED_OTHER, 0), os.SCHED_OTHER)  # none below
    lent_policy = os.SCHED_FIFO | os.SCHED_RESET_ON_FORK  # its new threads do not inherit it
    assert lend_at_priority(2) == (True, (lent_policy, 1), os.SCHED_OTHER)


def test_the_holder_of_the_lock_is_lent_the_priority_not_the_last_stepper():
    log = []
    slot = _slot(log)
    held, leave, seen = threading.Event(), threading.Event(), []

    def snapshot():  # a service thread holding the lock outside any step
        with slot.lock:
            seen.append(threading.get_native_id())
            held.set()
            deadline = time.monotonic() + 10.0
            while not slot.pending and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.05)  # the preemption lends after 0.5 ms
            seen.append(os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK)
            child = _in_thread(lambda: os.sched_getscheduler(0))  # started while lent
            seen.append(child)
        leave.wait(10.0)
        seen.append(os.sched_getscheduler(0))
    holder = threading.Thread(target=snapshot)
    holder.start()
    assert held.wait(10.0)
    try:
        assert _real_time(lambda: slot.preempt(lambda from_newest: 'ran')) == 'ran'
    finally:
        leave.set()
        holder.join(10.0)
    assert seen[1:] == [os.SCHED_FIFO, os.SCHED_OTHER, os.SCHED_OTHER]
    assert slot.lock.owner == 0


def test_a_failing_preemption_gives_the_lent_priority_back():
    log = []
    slot = _slot(log)
    turn = Turn(slot, Slow(slot))
    tid, leave = [], threading.Event()
    loop = turn._loop

    def stepping():
        tid.append(threading.get_native_id())
        loop()
        leave.wait(10.0)
    turn.thread = threading.Thread(target=stepping)
    slot.claim(turn)
    turn.thread.start()
    assert turn.module.entered.wait(10.0)

    def fail(from_newest):
        assert os.sched_getscheduler(tid[0]) & ~os.SCHED_RESET_ON_FORK == os.SCHED_FIFO
        raise ValueError('capsule went away')

    def preempt():
        with pytest.raises(ValueError, match='went away'):
            slot.preempt(fail)
        return os.sched_getscheduler(tid[0])
    try:
        assert _real_time(preempt) == os.SCHED_OTHER
    finally:
        leave.set()
        turn.thread.join(10.0)
