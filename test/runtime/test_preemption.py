"""restore/rollback(preempt=True): a running step is abandoned mid-forward and replaced."""

import threading

from checkpoint_harness import build_checkpoint
from flashrt_ros.runtime import CapsuleNotFoundError, InvalidRequestError
import pytest
from runtime_harness import FAMILIES, greedy, PROMPT
import torch

OTHER = ' and then the arm moves on to the blue one'


def _layers(rt):
    return rt.adapter.model.get_decoder().layers


class _PreemptInsideStep:
    """
    Start `call` on another thread from inside the model's forward, at `layer`.

    The forward waits until the preemption is armed and then goes on, so the next module
    boundary abandons the step: the torn path, deterministically. `after` counts forward
    calls inside the last layer once it fired (0 means the step really stopped half-way).
    The hooks sit on every module of a layer: the decode fast path (models/fastpath.py)
    calls a layer's submodules, not the layer itself.
    """

    def __init__(self, rt, call, layer=1, skip=0):
        self.rt, self.call, self.skip = rt, call, skip
        self.thread, self.result, self.error, self.after = None, None, None, 0
        layers = _layers(rt)
        self.handles = [m.register_forward_pre_hook(self._fire) for m in layers[layer].modules()]
        self.handles += [m.register_forward_hook(self._count) for m in layers[-1].modules()]

    def _fire(self, module, args):
        if self.skip:
            self.skip -= 1
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._run)
            self.thread.start()
            while not self.rt.writer.pending and self.thread.is_alive():  # armed
                self.thread.join(0.001)

    def _count(self, module, args, output):
        self.after += self.thread is not None

    def _run(self):
        try:
            self.result = self.call()
        except Exception as exc:
            self.error = exc

    def join(self):
        for h in self.handles:
            h.remove()
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.mark.parametrize('model', FAMILIES)
def test_preempting_restore_abandons_the_step_and_restores_exactly(make_runtime, model):
    rt = make_runtime(model)
    rt.prefill(PROMPT)
    rt.snapshot('home')
    home = rt.state_digest()
    reference = greedy(rt, 12)
    rt.restore('home')
    gen = rt.generate(prompt=OTHER, max_new_tokens=50, stop=(), eos=False)
    next(gen), next(gen), next(gen)
    probe = _PreemptInsideStep(rt, lambda: rt.restore('home', preempt=True))
    with pytest.raises(StopIteration):
        next(gen)
    probe.join()
    assert probe.error is None and probe.result.name == 'home'
    assert probe.after == 0  # the step never reached its last layer
    assert gen.result.stop_reason == 'interrupted' and len(gen.result.token_ids) == 3
    assert not rt.generating
    assert rt.state_digest() == home  # every byte, incl. the rows the torn step wrote
    assert greedy(rt, 12) == reference


def test_a_preemption_armed_after_the_feed_is_met_before_sampling(make_runtime, monkeypatch):
    """The decode step polls once more after its feed: no token of that step is handed out."""
    from flashrt_ros.runtime.modes.lm import generation
    rt = make_runtime('builtin:tiny-llama')  # no compiled step: this is the poll met
    rt.prefill(PROMPT)
    rt.snapshot('home')
    home = rt.state_digest()
    gen = rt.generate(max_new_tokens=5, stop=(), eos=False)
    first = next(gen).token_id
    threads, feed = [], generation._feed

    def feed_then_arm(rt_, token):
        feed(rt_, token)  # the whole forward ran: only sampling and emitting are left
        thread = threading.Thread(target=lambda: rt.restore('home', preempt=True))
        threads.append(thread)
        thread.start()
        while not rt.writer.pending and thread.is_alive():
            thread.join(0.001)
    monkeypatch.setattr(generation, '_feed', feed_then_arm)
    with pytest.raises(StopIteration):
        next(gen)
    threads[0].join(30)
    assert gen.result.token_ids == [first]  # the step's token was not sampled
    assert rt.state_digest() == home


def test_preempting_a_long_prompt_cuts_its_prefill_short(make_runtime):
    rt = make_runtime(max_seq_len=512)
    rt.prefill(PROMPT)
    rt.snapshot('home')
    home, position = rt.state_digest(), rt.position
    gen = rt.generate(prompt=OTHER * 8, max_new_tokens=5, stop=(), eos=False)
    probe = _PreemptInsideStep(rt, lambda: rt.rollback(1, preempt=True), layer=0)
    with pytest.raises(StopIteration):
        next(gen)  # the prompt's prefill is abandoned: no token at all
    probe.join()
    assert probe.error is None and probe.after == 0
    assert gen.result.token_ids == [] and gen.result.stop_reason == 'interrupted'
    # The abandoned prompt was never committed: one boundary back is where it started.
    assert probe.result.position == rt.position == position
    assert rt.state_digest() == home


def test_preempting_rollback_mid_turn_lands_on_the_end_of_the_prompt(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    rt.prefill(OTHER)
    after_prompt = rt.state_digest()
    rt.rollback(1)
    gen = rt.generate(prompt=OTHER, max_new_tokens=50, stop=(), eos=False)
    next(gen), next(gen)
    probe = _PreemptInsideStep(rt, lambda: rt.rollback(1, preempt=True))
    with pytest.raises(StopIteration):
        next(gen)
    probe.join()
    assert probe.error is None and probe.after == 0
    # The same place a plain interrupt + rollback(1) reaches.
    assert rt.state_digest() == after_prompt
    rt.rollback(1)  # and the ring below it is intact
    assert rt.position == len(rt.tokenize(PROMPT))


def test_a_served_preemption_does_not_hit_the_next_turn(make_runtime):
    # The generation thread serves the preemption and may start the next turn before the
    # caller wakes up: that turn must run, and the rollback must happen once.
    rt = make_runtime()
    rt.prefill(PROMPT)
    rt.prefill(OTHER)
    gen = rt.generate(prompt=OTHER, max_new_tokens=50, stop=(), eos=False)
    next(gen), next(gen)
    probe = _PreemptInsideStep(rt, lambda: rt.rollback(1, preempt=True))
    gate, step_lock = threading.Event(), rt.writer.lock

    class GatedLock:
        """The step lock, but the preempting thread may take it only once the gate opens."""

        def acquire(self, blocking=True, timeout=-1):
            if threading.current_thread() is probe.thread:
                gate.wait(30)
            return step_lock.acquire(blocking, timeout)

        def release(self):
            step_lock.release()

        @property
        def owner(self):
            return step_lock.owner

        def __enter__(self):
            return self.acquire()

        def __exit__(self, *exc):
            self.release()

    rt.writer.lock = GatedLock()
    try:
        with pytest.raises(StopIteration):
            next(gen)
        after = rt.generate(max_new_tokens=3, stop=(), eos=False)  # the caller still waits
        tokens = [ev.token_id for ev in after]
    finally:
        gate.set()
        probe.join()
        rt.writer.lock = step_lock
    assert probe.error is None and after.result.stop_reason == 'max_tokens'
    assert len(tokens) == 3
    # Boundaries now: PROMPT, +OTHER, the cut turn's prompt (where the rollback landed), the
    # turn above. Two back is +OTHER: the rollback ran once.
    rt.rollback(2)
    assert rt.position == len(rt.tokenize(PROMPT)) + len(rt.tokenize(OTHER))


def test_preempt_between_steps_and_when_idle(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    rt.snapshot('home')
    home = rt.state_digest()
    gen = rt.generate(prompt=OTHER, max_new_tokens=50, stop=(), eos=False)
    next(gen)
    info = rt.restore('home', preempt=True)  # same thread, between two steps
    assert info.name == 'home' and gen.result.stop_reason == 'interrupted'
    with pytest.raises(StopIteration):
        next(gen)
    assert rt.state_digest() == home
    rt.prefill(OTHER)
    rt.restore('home', preempt=True)  # nothing runs: a plain restore
    assert rt.state_digest() == home
    rt.prefill(OTHER)
    rt.rollback(1, preempt=True)
    assert rt.state_digest() == home


def test_a_preempting_restore_leaves_the_turns_text_to_its_first_reader(make_runtime):
    """The turn a restore cuts is not detokenized on the restore's path, only when read."""
    rt = make_runtime()
    rt.prefill(PROMPT)
    rt.snapshot('home')
    home = rt.state_digest()
    gen = rt.generate(prompt=OTHER, max_new_tokens=50, stop=(), eos=False)
    for _ in range(30):
        next(gen)
    seen, decode = [], rt.tokenizer.decode
    rt.tokenizer.decode = lambda ids: seen.append(len(ids)) or decode(ids)
    preempt = _PreemptInsideStep(rt, lambda: rt.restore('home', preempt=True))
    with pytest.raises(StopIteration):
        next(gen)
    preempt.join()
    assert preempt.error is None and rt.state_digest() == home
    assert gen.result.stop_reason == 'interrupted' and len(gen.result.token_ids) == 30
    assert seen == []
    assert gen.result.text == decode(gen.result.token_ids) and seen == [30]
    assert gen.result.text is gen.result.text and seen == [30]  # decoded once
    assert repr(gen.result).startswith(f'GenerationResult(text={gen.result.text!r}, token_ids=')


def test_a_restore_that_ends_a_turn_commits_nothing_it_would_drop(make_runtime):
    """The ring and the rollbacks after it are those of a turn ended, committed, then cut."""
    outcomes = []
    for preempt in (True, False):
        rt = make_runtime(rollback_depth=8)  # room for all: at 4 that commit evicts the oldest
        rt.prefill(PROMPT)
        rt.snapshot('home')
        rt.prefill(OTHER)  # a boundary past home's rows: the restore drops it either way
        gen = rt.generate(prompt=' and the tray', max_new_tokens=50, stop=(), eos=False)
        next(gen), next(gen)
        drops = rt.stats().rollback_ring.lineage_drops
        if preempt:
            rt.restore('home', preempt=True)  # between two steps, on this thread
        else:
            gen.close()  # the turn's end is committed, then the restore drops it
            rt.restore('home')
        assert gen.result.stop_reason == 'interrupted' and not rt.generating
        ring = rt.stats().rollback_ring
        digests = [rt.state_digest()]
        while len(rt.ring) > 1:
            rt.rollback(1)
            digests.append(rt.state_digest())
        outcomes.append((ring.count, ring.lineage_drops - drops, digests))
    (entries, drops, digests), (entries_b, drops_b, digests_b) = outcomes
    assert entries == entries_b and digests == digests_b
    assert drops == drops_b - 1  # the turn's end: never committed, so never dropped


def test_a_failed_preempting_restore_leaves_the_turns_end_committed(make_runtime, monkeypatch):
    """Failed after it was armed (nothing copied): the state is the turn's, a boundary."""
    rt = make_runtime(rollback_depth=8)
    rt.prefill(PROMPT)
    rt.snapshot('home')
    gen = rt.generate(prompt=OTHER, max_new_tokens=50, stop=(), eos=False)
    next(gen), next(gen)
    live, count = rt.state_digest(), rt.stats().rollback_ring.count

    def fail(*args):
        raise RuntimeError('the copy could not start')
    monkeypatch.setattr(rt, '_restore_checked', fail)
    with pytest.raises(RuntimeError, match='could not start'):
        rt.restore('home', preempt=True)  # between two steps, on this thread
    monkeypatch.undo()
    assert gen.result.stop_reason == 'interrupted' and not rt.generating
    assert rt.state_digest() == live
    assert rt.stats().rollback_ring.count == count + 1  # the turn's end, as before a restore


@pytest.mark.parametrize('served_by', ['caller', 'turn'])
def test_preempting_rollback_of_an_unstarted_turn_undoes_nothing_before_it(make_runtime,
                                                                           served_by):
    rt = make_runtime()
    rt.prefill(PROMPT)
    rt.prefill(OTHER)  # two committed boundaries; rollback(1) must not undo this one
    digest = rt.state_digest()
    gen = rt.generate(prompt=' and', max_new_tokens=5)  # claimed; no step has run
    if served_by == 'caller':
        info = rt.rollback(1, preempt=True)
    else:  # the turn's first step wins the lock and serves the rollback itself
        out = []
        with rt.writer.lock:  # the preemption arms, then waits for it: the next step serves it
            thread = threading.Thread(target=lambda: out.append(rt.rollback(1, preempt=True)))
            thread.start()
            while not rt.writer.pending:
                thread.join(0.001)
            with pytest.raises(StopIteration):
                next(gen)
        thread.join(30)
        info = out[0]
    assert rt.state_digest() == digest and info.position == rt.position
    rt.rollback(1)  # the ring still holds the earlier boundary
    assert rt.position == len(rt.tokenize(PROMPT))


def test_a_bad_preemption_leaves_the_generation_running(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    rt.snapshot('home')
    reference = greedy(rt, 6, prompt=OTHER)
    rt.restore('home')
    gen = rt.generate(prompt=OTHER, max_new_tokens=6, stop=(), eos=False)
    got = [next(gen).token_id]
    with pytest.raises(CapsuleNotFoundError):
        rt.restore('nope', preempt=True)
    with pytest.raises(InvalidRequestError, match='full restore'):
        rt.restore('home', mode='kv_only', preempt=True)
    with pytest.raises(InvalidRequestError, match='earlier boundaries'):
        rt.rollback(99, preempt=True)
    assert rt.generating
    got += [e.token_id for e in gen]
    assert got == reference and gen.result.stop_reason == 'max_tokens'


def test_a_preemption_waits_for_no_longer_than_the_step_it_cuts(make_runtime):
    # Two threads: the stream, and a preemptor that fires while the stream runs freely.
    rt = make_runtime(max_seq_len=4096)
    rt.prefill(PROMPT)
    rt.snapshot('home')
    home = rt.state_digest()
    for _ in range(3):
        gen = rt.generate(prompt=OTHER, max_new_tokens=4000, stop=(), eos=False)
        out = []
        thread = threading.Thread(target=lambda: out.extend(gen))
        thread.start()
        while len(out) < 4:
            thread.join(0.001)
        rt.restore('home', preempt=True)
        thread.join(30)
        assert not thread.is_alive() and gen.result.stop_reason == 'interrupted'
        assert rt.state_digest() == home and not rt.generating


def test_an_armed_preemption_never_aborts_another_runtime(make_runtime):
    # The abort hook is process-wide while armed; only the preempted runtime's generation
    # thread may be cut. Here runtime A's step is held inside its forward with the hook
    # armed, and runtime B decodes a whole turn meanwhile on another thread.
    a, b = make_runtime(), make_runtime('builtin:tiny-lfm2')
    a.prefill(PROMPT)
    a.snapshot('home')
    home = a.state_digest()
    b.prefill(PROMPT)
    b.snapshot('start')
    reference = greedy(b, 8)
    b.restore('start')

    hold, held, go = threading.Event(), threading.Event(), threading.Event()

    def block(module, args):
        if hold.is_set() and not go.is_set():
            held.set()
            go.wait(30)

    handle = _layers(a)[0].register_forward_pre_hook(block)
    gen = a.generate(prompt=OTHER, max_new_tokens=200, stop=(), eos=False)
    a_thread = threading.Thread(target=lambda: [None for _ in gen])
    # Held from the first module call: its decode steps run compiled (no layer calls), so a
    # prompt that got through before the hold was set would never be met.
    hold.set()
    a_thread.start()
    assert held.wait(30), 'runtime A never reached its forward'
    outcome = {}
    preempt = threading.Thread(target=lambda: outcome.update(
        info=a.restore('home', preempt=True)))
    preempt.start()
    while not a.writer.pending and preempt.is_alive():
        preempt.join(0.001)
    assert a.writer.pending  # armed, and A cannot serve it while held
    b_tokens = []
    b_thread = threading.Thread(target=lambda: b_tokens.extend(greedy(b, 8)))
    b_thread.start()
    b_thread.join(60)
    go.set()
    preempt.join(30)
    a_thread.join(30)
    handle.remove()
    assert b_tokens == reference  # B decoded a whole turn under the armed hook, untouched
    assert outcome['info'].name == 'home' and gen.result.stop_reason == 'interrupted'
    assert a.state_digest() == home
    assert not torch.nn.modules.module._global_forward_pre_hooks  # disarmed again


def test_a_preemption_abandons_a_conversation_turns_closing(make_runtime, tmp_path):
    # A reply's end feeds the template's end-of-turn tokens (a forward of a few tokens):
    # a restore that comes meanwhile replaces the state anyway, so it cuts that forward.
    path, _ = build_checkpoint(tmp_path / 'qwen', dtype=torch.float32)
    rt = make_runtime(str(path), max_seq_len=512)
    rt.prefill('You are a careful robot arm.')
    rt.snapshot('home')
    home, conversation = rt.state_digest(), rt.conversation
    gen = rt.generate('Pick up the red cup.', max_new_tokens=4, stop=())
    probes, close = [], gen._close_turn

    def closing(reason):
        probes.append(_PreemptInsideStep(rt, lambda: rt.restore('home', preempt=True)))
        close(reason)

    gen._close_turn = closing
    events = list(gen)
    probe, = probes
    probe.join()
    assert probe.error is None and probe.result.name == 'home'
    assert probe.after == 0  # the closing forward never reached its last layer
    assert len(events) == len(gen.result.token_ids) == 4
    assert gen.result.stop_reason == 'max_tokens' and not rt.generating
    assert rt.state_digest() == home and rt.conversation == conversation
    gen = rt.generate('Pick up the red cup.', max_new_tokens=4, stop=())
    assert [e.token_id for e in gen] == [e.token_id for e in events]
