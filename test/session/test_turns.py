"""The turn scheduler: states, admission, cancels, and the races at a turn's start and end."""

import os
import threading

from flashrt_ros.runtime import BusyError, InvalidRequestError
from flashrt_ros.session import BUSY_MESSAGE, Turn, TurnRequest, TurnState
import pytest
from session_harness import LONG_PROMPT, wait_until

GOAL = object()  # a caller's handle: the scheduler only passes it to start_goal


def _turn(prompt=LONG_PROMPT, handle=GOAL, **request):
    return Turn(TurnRequest(prompt=prompt, **request), handle)


def _start(session, turn, key=None):
    assert session.reserve_turn('goal') == ''
    session.turns.enqueue(turn, key)
    return turn


def test_a_turn_walks_its_states_in_order(make_session):
    session, out = make_session()
    running = out.hold('chunk:1')
    turn = _start(session, _turn(max_new_tokens=4))
    assert running.reached.wait(10.0)
    assert turn.state is TurnState.RUNNING and session.turns.running is turn
    assert out.started == [turn], 'a goal turn is started once, when it runs'
    running.opened.set()
    assert turn.done.wait(10.0)
    assert turn.state is TurnState.DONE
    assert [c['state'] for c in out.chunks] == [TurnState.RUNNING] * 4 + [TurnState.ENDING]
    assert out.chunks[-1]['final'] and out.chunks[-1]['stop_reason'] == 'max_tokens'
    assert turn.result.success and len(turn.result.token_ids) == 4
    assert turn.result.token_ids == [t for c in out.chunks for t in c['ids']]


def test_a_turns_text_is_decoded_by_its_first_reader_not_as_it_ends(make_session):
    session, out = make_session()
    rt = session.runtime
    seen, decode = [], rt.tokenizer.decode
    rt.tokenizer.decode = lambda ids: seen.append(len(ids)) or decode(ids)
    turn = _start(session, _turn(max_new_tokens=40))
    assert turn.done.wait(10.0) and turn.result.success
    ids = turn.result.token_ids
    assert len(ids) > 20 and max(seen) < len(ids)  # the steps' windows, not the whole turn
    assert turn.result.text == decode(ids) and seen[-1] == len(ids)
    assert turn.result.text == decode(ids) and seen.count(len(ids)) == 1


def test_reject_policy_counts_a_turn_out_before_its_final_chunk(make_session):
    """A client that chains the next goal on the final chunk is admitted."""
    session, out = make_session()
    final = out.hold('final')
    turn = _start(session, _turn(max_new_tokens=2))
    assert final.reached.wait(10.0)
    assert session.reserve_turn('goal') == '', 'refused while the last turn only sends its end'
    session.turns.drop_queued('unused')
    final.opened.set()
    assert turn.done.wait(10.0)


def test_reject_policy_refuses_a_second_request(make_session):
    session, out = make_session()
    running = out.hold('chunk:0')
    turn = _start(session, _turn())
    assert running.reached.wait(10.0)
    refusal = session.reserve_turn('goal')
    assert 'goal_policy is reject' in refusal
    running.opened.set()
    assert session.turns.cancel(b'none', goal_active=False) is False
    session.turns.stop()
    assert turn.done.wait(10.0)


def test_cancel_before_the_turn_is_registered(make_session):
    """A cancel may come before the goal is handed over (rclpy answers it first), and wins."""
    session, out = make_session()
    assert session.reserve_turn('goal') == ''
    assert session.turns.cancel(b'early', goal_active=True)
    turn = _turn()
    session.turns.enqueue(turn, b'early')
    assert turn.done.wait(10.0)
    assert turn.result.success and turn.result.stop_reason == 'interrupted'
    assert turn.result.message == 'cancelled before it started' and not turn.result.token_ids
    assert out.started == [turn], 'its caller is told, so it can report the result'
    assert session.turns.goal_turn(b'early') is turn
    assert session.reserve_turn('goal') == '', 'the early-cancelled turn was not counted out'


def test_a_cancel_of_a_finished_goal_is_refused(make_session):
    session, _ = make_session()
    assert session.turns.cancel(b'gone', goal_active=False) is False


def test_cancel_queued_turn_ends_at_once(make_session, settings):
    settings['goal_policy'] = 'queue'
    session, out = make_session()
    running = out.hold('chunk:1')
    first = _start(session, _turn(), b'first')
    assert running.reached.wait(10.0)
    second = _start(session, _turn('Two.', max_new_tokens=5), b'second')
    assert second.state is TurnState.QUEUED
    assert session.turns.cancel(b'second')
    assert second.done.wait(1.0), 'the queued turn waited for the running one'
    assert second.result.message == 'cancelled before it started'
    assert first.state is TurnState.RUNNING
    assert session.turns.cancel(b'first')
    running.opened.set()
    assert first.done.wait(10.0)
    assert first.result.stop_reason == 'interrupted'


def test_cancel_after_the_turn_settled_is_refused(make_session):
    """A turn that has said it is over stays as it ended: a late cancel cannot relabel it."""
    session, out = make_session()
    final = out.hold('final')
    turn = _start(session, _turn('Short.', max_new_tokens=4), b'short')
    assert final.reached.wait(10.0)
    assert turn.settled
    assert session.turns.cancel(b'short') is False
    final.opened.set()
    assert turn.done.wait(10.0)
    assert turn.result.success and turn.result.stop_reason == 'max_tokens'


def test_cancel_applies_the_cancel_policy(make_session, settings):
    settings['interrupt_policy'] = 'restore_home'
    session, out = make_session()
    home = session.runtime.state_digest()
    running = out.hold('chunk:2')
    turn = _start(session, _turn(), b'run')
    assert running.reached.wait(10.0)
    assert session.turns.cancel(b'run')
    running.opened.set()
    assert turn.done.wait(10.0)
    assert turn.result.stop_reason == 'interrupted' and len(turn.result.token_ids) == 3
    assert 'cancelled, interrupt policy restore_home applied' in turn.result.message
    assert session.runtime.state_digest() == home
    event = out.events[-1]
    assert event['operation'] == 'interrupt' and event['name'] == 'home'
    assert event['message'].endswith('(reason: goal cancelled)')


def test_restore_service_is_busy_during_a_turn(make_session):
    session, out = make_session()
    running = out.hold('chunk:0')
    turn = _start(session, _turn())
    assert running.reached.wait(10.0)
    digest = session.runtime.state_digest()
    with pytest.raises(BusyError, match=BUSY_MESSAGE):
        session.restore('home')
    with pytest.raises(BusyError, match=BUSY_MESSAGE):
        session.rollback(1)
    assert session.runtime.state_digest() == digest
    running.opened.set()
    session.turns.stop()
    assert turn.done.wait(10.0)


def test_start_from_and_save_as(make_session):
    session, out = make_session()
    home = session.runtime.state_digest()
    turn = _start(session, _turn('Go.', max_new_tokens=3, save_as='mine', save_tier='host'))
    assert turn.done.wait(10.0) and turn.result.success, turn.result.message
    assert "saved as 'mine' (host)" in turn.result.message
    after = session.runtime.state_digest()
    session.restore('home')
    again = _start(session, _turn('', max_new_tokens=1, start_from='mine'))
    assert again.done.wait(10.0) and again.result.success
    assert any(e['operation'] == 'restore' and e['success']
               and e['message'].startswith("start_from 'mine' at position") for e in out.events)
    session.restore('mine')
    assert session.runtime.state_digest() == after != home


def test_start_from_a_missing_capsule_fails_the_turn(make_session):
    session, out = make_session()
    digest = session.runtime.state_digest()
    turn = _start(session, _turn(start_from='nope'))
    assert turn.done.wait(10.0)
    assert not turn.result.success and turn.result.stop_reason == 'error'
    assert "start_from 'nope' failed" in turn.result.message
    assert out.finals()[-1]['stop_reason'] == 'error'
    assert session.runtime.state_digest() == digest


def test_a_refused_sampling_parameter_leaves_start_from_unapplied(make_session):
    """A goal whose own parameters are refused changes nothing, not even its start_from."""
    session, out = make_session()
    turn = _start(session, _turn('Go.', max_new_tokens=3, save_as='mine', save_tier='host'))
    assert turn.done.wait(10.0) and turn.result.success, turn.result.message
    session.restore('home')
    home = session.runtime.state_digest()
    bad = _start(session, _turn('Go on.', start_from='mine', temperature=1e-45))
    assert bad.done.wait(10.0)
    assert not bad.result.success and 'temperature' in bad.result.message
    assert not any(e['message'].startswith("start_from 'mine'") for e in out.events)
    assert session.runtime.state_digest() == home


def test_deactivate_publishes_the_final_chunk(make_session):
    """A deactivate stops the running turn, or waits for one that is ending, to its end."""
    session, out = make_session()
    running = out.hold('chunk:1')
    turn = _start(session, _turn())
    assert running.reached.wait(10.0)
    threading.Timer(0.05, running.opened.set).start()
    assert session.deactivate('deactivated')
    assert turn.state is TurnState.DONE
    assert out.chunks[-1]['final'] and out.chunks[-1]['stop_reason'] == 'interrupted'

    session.turns.set_active(True)
    final = out.hold('final')
    ending = _start(session, _turn('Go.', max_new_tokens=3))
    assert final.reached.wait(10.0) and ending.state is TurnState.ENDING
    threading.Timer(0.1, final.opened.set).start()
    assert session.deactivate('deactivated')
    assert ending.state is TurnState.DONE, 'deactivate returned before the final chunk'
    assert out.chunks[-1]['final'] and out.chunks[-1]['stop_reason'] == 'max_tokens'


def test_deactivate_drops_queued_turns_and_refuses_new_ones(make_session, settings):
    settings['goal_policy'] = 'queue'
    session, out = make_session()
    running = out.hold('chunk:0')
    first = _start(session, _turn())
    assert running.reached.wait(10.0)
    queued = _start(session, _turn('Two.'))
    threading.Timer(0.05, running.opened.set).start()
    assert session.deactivate('the node was deactivated before the turn started')
    assert queued.done.is_set() and not queued.result.success
    assert queued.result.message == 'the node was deactivated before the turn started'
    assert first.done.is_set()
    assert session.reserve_turn('goal') == 'the session is not active'
    late = _turn()
    session.turns.enqueue(late)
    assert late.done.is_set() and late.result.message == 'the session is not active'


def test_a_failing_turn_reports_an_internal_error_and_the_thread_goes_on(make_session):
    session, out = make_session()
    turn = _start(session, Turn(TurnRequest(prompt='x', max_new_tokens='many'), GOAL))
    assert turn.done.wait(10.0)
    assert not turn.result.success and turn.result.message.startswith('internal error')
    assert out.finals()[-1]['stop_reason'] == 'error'
    assert any(level == 'error' for level, _ in out.logs)
    nxt = _start(session, _turn('Go.', max_new_tokens=2))
    assert nxt.done.wait(10.0) and nxt.result.success


def test_the_home_capsule_is_protected_unless_allowed(make_session, settings):
    session, _ = make_session()
    session.snapshot('mine')
    for call in (lambda: session.snapshot('home'), lambda: session.delete('home'),
                 lambda: session.fork('mine', 'home')):
        with pytest.raises(InvalidRequestError, match='protect_home'):
            call()
    settings['protect_home'] = False
    session.runtime.prefill('Something else.')
    assert session.snapshot('home').position == session.runtime.position


def test_the_cancel_policy_never_undoes_an_interrupt(make_session, settings):
    """A cancelled turn whose state an interrupt replaced skips its cancel policy."""
    settings['interrupt_policy'] = 'rollback'
    session, _ = make_session()
    digest = session.runtime.state_digest()
    turn = _turn()
    turn.replaced_by = 'a reset restored home'
    note = session.interrupts.after_cancel(turn)
    assert note == 'interrupt policy skipped: a reset restored home during the turn'
    assert session.runtime.state_digest() == digest


@pytest.mark.parametrize('save_as, save_tier', [('../x', ''), ('fine', 'gpu'), ('a\0b', '')])
def test_a_bad_save_as_is_refused_before_the_turn_changes_anything(make_session, save_as,
                                                                   save_tier):
    session, out = make_session()
    digest = session.runtime.state_digest()
    turn = _start(session, _turn(save_as=save_as, save_tier=save_tier))
    assert turn.done.wait(10.0)
    assert not turn.result.success and 'refused before the turn' in turn.result.message
    assert session.runtime.state_digest() == digest
    assert out.finals()[-1]['stop_reason'] == 'error'


def test_generation_nice_applies_to_the_generation_thread_alone(make_session):
    session, out = make_session()
    turns = session.turns
    turns.stop()
    turns.generation_nice = -1
    turns.start()
    tid, own = turns._thread.native_id, os.getpriority(os.PRIO_PROCESS, 0)
    assert wait_until(lambda: os.getpriority(os.PRIO_PROCESS, tid) == -1
                      or [m for level, m in out.logs if 'nice -1 refused' in m])
    if os.getpriority(os.PRIO_PROCESS, tid) != -1:
        pytest.skip('a lower nice value is refused here (no CAP_SYS_NICE); the node says so')
    assert os.getpriority(os.PRIO_PROCESS, 0) == own  # this thread keeps its own
