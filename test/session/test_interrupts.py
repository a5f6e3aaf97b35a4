"""Interrupts and resets: what they leave, when their event comes, and who wins a race."""

import threading
import time

from flashrt_ros.session import InterruptMode, Turn, TurnRequest
import pytest
from session_harness import HOME, LONG_PROMPT, wait_until

GOAL = object()


def _start(session, prompt=LONG_PROMPT, **request):
    assert session.reserve_turn('goal') == ''
    turn = Turn(TurnRequest(prompt=prompt, **request), GOAL)
    session.turns.enqueue(turn)
    return turn


def _apply_in_thread(session, mode, **kw):
    args = {'boundaries': 1, 'capsule': HOME, 'reason': 'test'}
    args.update(kw)
    thread = threading.Thread(target=session.interrupts.apply, args=(
        'interrupt', mode, args['boundaries'], args['capsule'], args['reason'], time.time()))
    thread.start()
    return thread


def test_stop_keeps_the_boundary_and_says_where(make_session):
    session, out = make_session()
    running = out.hold('chunk:2')
    turn = _start(session)
    assert running.reached.wait(10.0)
    thread = _apply_in_thread(session, InterruptMode.STOP)
    running.opened.set()
    thread.join(10.0)
    assert turn.done.is_set() and turn.result.stop_reason == 'interrupted'
    event = out.events[-1]
    assert event['operation'] == 'interrupt' and event['success'] and event['name'] == ''
    assert event['message'] == (f'stopped at position {session.runtime.position} '
                                '(reason: test)')


@pytest.mark.parametrize('mode', [InterruptMode.RESTORE, InterruptMode.ROLLBACK])
def test_the_event_comes_after_the_turn_with_the_restores_latency(make_session, mode):
    """A client that chains a restore or a goal on the interrupt's event is not refused."""
    session, out = make_session()
    home = session.runtime.state_digest()
    prompt_end = session.runtime.position + len(session.runtime.tokenize(LONG_PROMPT))
    running = out.hold('chunk:2')  # the interrupt lands while the turn runs
    final = out.hold('final')  # the interrupted turn is slow to end
    turn = _start(session)
    assert running.reached.wait(10.0)
    received = time.time()
    thread = threading.Thread(target=session.interrupts.apply, args=(
        'interrupt', mode, 1, HOME, 'chained', received))
    thread.start()
    assert wait_until(lambda: turn.replaced_by)  # the interrupt reached the turn
    running.opened.set()
    assert final.reached.wait(10.0)
    time.sleep(0.2)
    assert not [e for e in out.events if e['operation'] == 'interrupt'], 'event before the end'
    final.opened.set()
    thread.join(10.0)
    event = next(e for e in out.events if e['operation'] == 'interrupt')
    assert event['success'], event
    assert turn.done.is_set() and turn.result.stop_reason == 'interrupted'
    assert event['latency_ms'] < 200.0, 'latency counts the wait for the turn'
    assert event['at'] - event['stamp'] > 0.15, 'stamp is not the restore time'
    assert session.reserve_turn('goal') == ''
    session.turns.drop_queued('unused')
    if mode == InterruptMode.RESTORE:
        assert session.runtime.state_digest() == home
    else:  # the turn's tokens were never committed: one boundary back is the prompt's end
        assert session.runtime.position == prompt_end


def test_a_refused_restore_still_stops_the_turn(make_session):
    session, out = make_session()
    running = out.hold('chunk:1')
    turn = _start(session)
    assert running.reached.wait(10.0)
    thread = _apply_in_thread(session, InterruptMode.RESTORE, capsule='missing')
    assert wait_until(lambda: turn.cancel_requested or session.turns.should_stop(turn))
    running.opened.set()
    thread.join(10.0)
    event = out.events[-1]
    assert not event['success'] and event['name'] == 'missing'
    assert 'interrupt failed' in event['message'] and 'instead' in event['message']
    assert turn.done.is_set() and turn.replaced_by == ''


def test_interrupt_during_start_from_wins(make_session):
    """A RESTORE interrupt that lands before a goal's start_from restore is the state after."""
    session, out = make_session()
    home = session.runtime.state_digest()
    session.runtime.prefill('Go somewhere else.')
    session.runtime.snapshot('elsewhere')
    session.restore(HOME)
    starting = out.hold('start')  # before its start_from restore
    turn = _start(session, 'Go on.', max_new_tokens=50, start_from='elsewhere')
    assert starting.reached.wait(10.0)
    thread = _apply_in_thread(session, InterruptMode.RESTORE, reason='barge-in')
    assert wait_until(lambda: turn.replaced_by != '')
    starting.opened.set()
    thread.join(10.0)
    assert turn.result.stop_reason == 'interrupted' and not turn.result.token_ids
    assert session.runtime.state_digest() == home, "start_from replaced the interrupt's restore"
    assert out.events[-1]['operation'] == 'interrupt' and out.events[-1]['success']


def test_an_interrupt_during_save_as_waits_for_it(make_session):
    """save_as holds the turn's own state even when an interrupt restores during it."""
    session, out = make_session()
    home = session.runtime.state_digest()
    saving = out.hold('event:snapshot')  # save_as has taken its snapshot, under the lock
    turn = _start(session, 'Go.', max_new_tokens=3, save_as='mine')
    assert saving.reached.wait(10.0)
    thread = _apply_in_thread(session, InterruptMode.RESTORE, reason='barge-in')
    time.sleep(0.1)
    assert thread.is_alive() and turn.replaced_by == '', 'the interrupt did not wait'
    saving.opened.set()
    thread.join(10.0)
    assert turn.result.success, turn.result.message
    assert session.runtime.state_digest() == home  # the interrupt's restore
    session.restore('mine')
    assert session.runtime.state_digest() != home, "save_as holds the interrupt's state"


def test_save_as_after_an_interrupt_replaced_the_state_is_skipped(make_session):
    session, out = make_session()
    running = out.hold('chunk:1')
    turn = _start(session, max_new_tokens=40, save_as='late')
    assert running.reached.wait(10.0)
    thread = _apply_in_thread(session, InterruptMode.ROLLBACK, reason='undo')
    assert wait_until(lambda: turn.replaced_by != '')
    running.opened.set()
    thread.join(10.0)
    assert not turn.result.success
    assert "save_as 'late' skipped: an interrupt rolled back 1 boundaries" in turn.result.message
    assert 'late' not in [c.name for c in session.runtime.list_capsules()]


def test_reset_restores_home_and_an_invalid_mode_is_refused(make_session):
    session, out = make_session()
    home = session.runtime.state_digest()
    session.runtime.prefill('Something else.')
    session.interrupts.apply('reset', InterruptMode.RESTORE, 1, '', 'reset', time.time())
    assert session.runtime.state_digest() == home
    assert out.events[-1]['operation'] == 'reset' and out.events[-1]['name'] == HOME
    session.interrupts.apply('interrupt', 7, 1, '', '', time.time())
    assert not out.events[-1]['success'] and 'interrupt mode 7 is not valid' in \
        out.events[-1]['message']


def test_policy_mode_follows_the_interrupt_policy_parameter(make_session, settings):
    settings['interrupt_policy'] = 'rollback'
    session, out = make_session()
    home = session.runtime.state_digest()
    session.runtime.prefill('One more boundary.')
    session.interrupts.apply('interrupt', InterruptMode.POLICY, 1, '', '', time.time())
    assert out.events[-1]['message'].startswith('stopped and rolled back 1')
    assert session.runtime.state_digest() == home


def test_a_stop_cuts_a_long_prompt_and_the_result_says_so(make_session, monkeypatch):
    """A STOP during a prefill of several chunks ends it at the next chunk boundary."""
    from flashrt_ros.runtime import engine
    monkeypatch.setattr(engine, 'PREFILL_CHUNK', 8)
    session, out = make_session()
    adapter = session.runtime.engine.adapter
    forward, calls = adapter.forward, []

    def forward_then_interrupt(*args, **kwargs):
        result = forward(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:  # after the first chunk, a STOP from another thread, as a node's
            stop = threading.Thread(target=session.runtime.interrupt)
            stop.start()
            stop.join(5.0)
        return result

    monkeypatch.setattr(adapter, 'forward', forward_then_interrupt)
    turn = _start(session, 'x' * 40, max_new_tokens=4)
    assert turn.done.wait(20.0)
    assert turn.result.stop_reason == 'interrupted' and not turn.result.token_ids
    assert 'the prompt was cut after 8 of 40 tokens' in turn.result.message, \
        turn.result.message
