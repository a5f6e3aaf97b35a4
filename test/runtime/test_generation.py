"""Streaming generation: stop conditions, interrupt, and the one-writer rules across threads."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

from flashrt_ros.runtime import BusyError, InvalidNameError, InvalidRequestError, TokenEvent
from flashrt_ros.runtime import engine
import pytest
from runtime_harness import greedy, PROMPT


def test_stream_events_and_result(make_runtime):
    rt = make_runtime()
    gen = rt.generate(prompt=PROMPT, max_new_tokens=8, stop=(), eos=False)
    assert gen.result is None and rt.generating
    events = list(gen)
    assert all(isinstance(e, TokenEvent) for e in events)
    assert [e.index for e in events] == list(range(8))
    res = gen.result
    assert res.stop_reason == 'max_tokens' and res.token_ids == [e.token_id for e in events]
    assert res.prompt_tokens == len(rt.tokenize(PROMPT))
    assert res.text == rt.detokenize(res.token_ids) == ''.join(e.text for e in events)
    assert res.ttft_s > 0 and res.tokens_per_s > 0
    assert not rt.generating
    assert rt.position == res.prompt_tokens + 7  # the last token is pending, not yet consumed


def test_eos_stops_without_emitting_it(make_runtime, monkeypatch):
    rt = make_runtime()
    rt.prefill(PROMPT)
    rt.snapshot('a')
    ids = greedy(rt, 6)
    rt.restore('a')
    monkeypatch.setattr(type(rt.tokenizer), 'eos_token_ids', property(lambda self: (ids[3],)))
    gen = rt.generate(max_new_tokens=20, stop=(), eos=True)
    assert [e.token_id for e in gen] == ids[:3]
    assert gen.result.stop_reason == 'eos'


def test_stop_string_truncates_text(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    rt.snapshot('a')
    gen = rt.generate(max_new_tokens=24, stop=(), eos=False)
    list(gen)
    text = gen.result.text
    stop = next(
        text[i:i + 2] for i in range(4, len(text) - 2) if '\ufffd' not in text[i:i + 2]
    )
    rt.restore('a')
    gen = rt.generate(max_new_tokens=24, stop=(stop,), eos=False)
    list(gen)
    assert gen.result.stop_reason == 'stop_string'
    assert gen.result.text == text[: text.find(stop)]


def test_max_seq_len_stops_generation(make_runtime):
    rt = make_runtime(max_seq_len=16)
    gen = rt.generate(
        prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], max_new_tokens=50, stop=(), eos=False
    )
    events = list(gen)
    assert gen.result.stop_reason == 'max_seq_len'
    assert rt.position == 16 and len(events) == 7
    with pytest.raises(InvalidRequestError, match='does not fit'):
        rt.prefill([1])


def test_bad_requests_leave_state_untouched(make_runtime):
    rt = make_runtime(max_seq_len=32)
    with pytest.raises(InvalidRequestError, match='nothing to continue'):
        rt.generate()
    rt.prefill(PROMPT[:10])
    live = rt.state_digest()
    for call in (
        lambda: rt.prefill('x' * 40),
        lambda: rt.prefill([]),
        lambda: rt.prefill([10**6]),
        lambda: rt.generate(temperature=-1),
        lambda: rt.generate(top_p=0.0),
        lambda: rt.generate(max_new_tokens=-1),
    ):
        with pytest.raises(InvalidRequestError):
            call()
    assert rt.state_digest() == live and not rt.generating


def _run_in_thread(gen):
    out = []
    thread = threading.Thread(target=lambda: out.extend(gen), daemon=True)
    thread.start()
    return thread, out


def test_interrupt_from_another_thread(make_runtime):
    rt = make_runtime(max_seq_len=4096)
    gen = rt.generate(prompt=PROMPT, max_new_tokens=3000, stop=(), eos=False)
    thread, out = _run_in_thread(gen)
    while len(out) < 3:
        time.sleep(0.005)
    rt.interrupt()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert gen.result.stop_reason == 'interrupted' and len(out) < 3000
    assert gen.result.token_ids == [e.token_id for e in out]
    rt.interrupt()  # no-op when nothing runs
    assert len(greedy(rt, 2)) == 2  # the next turn is not pre-interrupted


def test_restore_during_generation_is_busy_and_never_tears_state(make_runtime):
    rt = make_runtime(max_seq_len=4096)
    rt.prefill(PROMPT)
    rt.snapshot('a')
    reference = greedy(rt, 40)
    rt.restore('a')
    gen = rt.generate(max_new_tokens=40, stop=(), eos=False)
    thread, out = _run_in_thread(gen)
    busy = 0
    while thread.is_alive():
        for call in (
            lambda: rt.restore('a'),
            lambda: rt.rollback(1),
            rt.reset,
            lambda: rt.prefill('x'),
            lambda: rt.generate(prompt='y'),
            lambda: rt.restore('a', mode='kv_only'),
        ):
            try:
                call()
            except BusyError as exc:
                assert 'interrupt()' in str(exc)
                busy += 1
        rt.fork('a', 'copy')  # never touches the live state: allowed
        with pytest.raises(InvalidNameError):  # a bad name is refused as such, at once
            rt.restore('../a')
        time.sleep(0.002)  # let the stream take the step lock between our calls
    thread.join()
    assert busy > 0
    assert [e.token_id for e in out] == reference  # the stream was not disturbed


def test_restore_while_generating_is_refused_before_reading_the_disk(make_runtime):
    rt = make_runtime(max_seq_len=4096)
    rt.prefill(PROMPT)
    rt.snapshot('d', tier='disk')
    path = rt.config.capsule_path / 'd.safetensors'
    os.utime(path, (1_000_000, 1_000_000))  # the disk tier's LRU clock
    thread, out = _run_in_thread(rt.generate(max_new_tokens=3000, stop=(), eos=False))
    while len(out) < 2:
        time.sleep(0.002)
    with pytest.raises(BusyError):
        rt.restore('d')
    rt.interrupt()
    thread.join()
    assert path.stat().st_mtime == 1_000_000  # not read, not counted as a use


def test_snapshot_during_generation_captures_a_step_boundary(make_runtime):
    rt = make_runtime(max_seq_len=4096)
    rt.prefill(PROMPT)
    gen = rt.generate(max_new_tokens=30, stop=(), eos=False)
    thread, out = _run_in_thread(gen)
    while len(out) < 5:
        time.sleep(0.001)
    info = rt.snapshot('mid')
    n_at_snapshot = info.position - len(rt.tokenize(PROMPT)) + 1  # tokens emitted by then
    thread.join()
    full = [e.token_id for e in out]
    rt.restore('mid')
    rest = greedy(rt, len(full) - n_at_snapshot)
    assert full[:n_at_snapshot] + rest == full


def test_close_releases_an_abandoned_generation(make_runtime):
    rt = make_runtime()
    gen = rt.generate(prompt=PROMPT, max_new_tokens=10, stop=(), eos=False)
    next(gen)
    with pytest.raises(BusyError):
        rt.reset()
    gen.close()
    assert gen.result.stop_reason == 'interrupted' and not rt.generating
    rt.reset()


def test_interrupt_ends_a_generation_nobody_iterates(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    before = rt.state_digest()
    dropped = rt.generate(prompt=' more', max_new_tokens=10)  # claimed, never iterated
    with pytest.raises(BusyError, match='interrupt'):
        rt.reset()
    rt.interrupt()  # what the BusyError says to do
    assert not rt.generating and dropped.result.stop_reason == 'interrupted'
    assert rt.state_digest() == before  # its prompt never ran
    with pytest.raises(StopIteration):
        next(dropped)
    for event in rt.generate(prompt=' more', max_new_tokens=10, stop=(), eos=False):
        break  # left after a break, still referenced
    rt.interrupt()
    assert not rt.generating
    rt.reset()


def test_leaving_the_process_in_the_middle_of_a_stream_exits_cleanly(tmp_path):
    # The end of a script (or Ctrl-C) while a turn streams: its generation is dropped at
    # interpreter exit, when committing its boundary would touch half-torn-down torch state.
    script = (
        'import sys\n'
        'from flashrt_ros.runtime import Runtime, RuntimeConfig\n'
        f'rt = Runtime(RuntimeConfig(model="builtin:tiny-hybrid", max_seq_len=128, '
        f'capsule_dir={str(tmp_path)!r}))\n'
        'rt.prefill("You are a helpful robot.")\n'
        'for i, event in enumerate(rt.generate("Hello", max_new_tokens=16)):\n'
        '    if i == 3:\n'
        '        raise KeyboardInterrupt\n'
    )
    env = dict(os.environ, PYTHONWARNINGS='ignore')
    done = subprocess.run([sys.executable, '-c', script], env=env, capture_output=True,
                          text=True, timeout=300)
    # Python ends on an unhandled KeyboardInterrupt by SIGINT (an abort would be SIGABRT).
    assert done.returncode == -signal.SIGINT, done.stderr[-3000:]
    assert 'KeyboardInterrupt' in done.stderr and 'terminate called' not in done.stderr


def test_warmup_leaves_state_clean(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    digest = rt.state_digest()
    rt.warmup()
    assert rt.state_digest() == digest


def test_stats_report_tiers_and_restore_times(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    rt.snapshot('s')
    rt.restore('s')
    stats = rt.stats()
    assert stats.state_nbytes == rt.state_nbytes > 0
    assert stats.position == rt.position
    assert set(stats.tiers) == {'device', 'host', 'disk'}
    assert stats.tiers['device'].count == 1
    assert stats.last_restore_s > 0 and stats.p99_restore_s >= stats.last_restore_s * 0
    assert stats.rollback_ring.count >= 2 and stats.rollback_ring.bytes_used > 0
    as_json = json.loads(json.dumps(stats.to_dict()))  # the nested dict benchmarks write
    assert as_json['tiers']['device']['count'] == 1 and as_json['position'] == rt.position
    assert as_json['rollback_ring']['depth'] == 4 and 'control_step_s' not in as_json
    assert set(rt.components) >= {'kv', 'conv', 'recurrent', 'rng', 'meta'}


def _inside(rt, layer):
    """Return a module of decoder layer `layer` that every step calls (the fast path too)."""
    block = rt.adapter.model.model.layers[layer]
    return getattr(block, 'mlp', block)


class _Fail:
    """A forward hook in one decoder layer that raises once armed (a mid-step failure)."""

    def __init__(self, rt, layer=1):
        self.armed = False
        self.handle = _inside(rt, layer).register_forward_hook(self)

    def __call__(self, module, args, output):
        if self.armed:
            self.armed = False
            raise RuntimeError('simulated out of memory')


@pytest.mark.parametrize('where', ['prefill', 'decode'])
def test_a_step_that_fails_half_way_puts_the_last_boundary_back(make_runtime, where):
    """The failed turn ends 'error'; the state is the newest committed boundary, intact."""
    rt, ref = make_runtime(), make_runtime()
    rt.prefill(PROMPT)
    ref.prefill(PROMPT)
    fail = _Fail(rt)
    gen = rt.generate(' and then', max_new_tokens=8, stop=(), eos=False)
    if where == 'decode':
        next(gen)
        next(gen)  # one decode step ran; the end of the prompt is the newest boundary
        ref.prefill(' and then')
    fail.armed = True
    with pytest.raises(RuntimeError, match='simulated out of memory') as info:
        list(gen)
    assert 'put back to the last committed boundary' in ''.join(
        getattr(info.value, '__notes__', ['put back to the last committed boundary']))
    assert gen.result is not None and gen.result.stop_reason == 'error'
    assert rt.state_digest() == ref.state_digest()
    fail.handle.remove()
    assert greedy(rt, 6, prompt='x') == greedy(ref, 6, prompt='x')


def test_a_failing_step_serves_a_waiting_rollback_as_if_the_step_was_abandoned(make_runtime):
    """rollback(1, preempt=True) lands on the prompt's end whether the step aborts or fails."""
    rt = make_runtime()
    rt.prefill(PROMPT)
    gen = rt.generate(' and then', max_new_tokens=50, stop=(), eos=False)
    next(gen)
    prompt_end = rt.ring[-1].position
    next(gen)
    layer = _inside(rt, 1)

    entered = threading.Event()

    def fail_once_a_preemption_waits(module, args, output):
        handle.remove()
        entered.set()
        deadline = time.monotonic() + 10
        while not rt.writer.pending and time.monotonic() < deadline:
            time.sleep(0.001)
        raise RuntimeError('simulated out of memory')

    handle = layer.register_forward_hook(fail_once_a_preemption_waits)
    errors = []

    def consume():
        try:
            list(gen)
        except RuntimeError as exc:
            errors.append(exc)

    worker = threading.Thread(target=consume)
    worker.start()
    assert entered.wait(10)  # the step is inside the model (past any abort point so far)
    info = rt.rollback(1, preempt=True)
    worker.join(10)
    assert info.position == prompt_end == rt.position
    assert errors and gen.result.stop_reason == 'interrupted'


def test_a_refused_prompt_leaves_even_the_sampler_alone(make_runtime):
    rt = make_runtime(max_seq_len=64)
    rt.prefill(PROMPT)
    before = rt.state_digest()
    with pytest.raises(InvalidRequestError, match='does not fit'):
        list(rt.generate('x' * 60, seed=7))
    assert rt.state_digest() == before


def test_sampling_that_fails_ends_the_turn_and_frees_the_runtime(make_runtime):
    rt = make_runtime()
    rt.prefill(PROMPT)
    head = rt.adapter.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, a, out: out * float('nan'))
    gen = rt.generate(' and', max_new_tokens=4, temperature=1.0, stop=(), eos=False)
    with pytest.raises(RuntimeError):
        list(gen)
    handle.remove()
    assert gen.result.stop_reason == 'error'
    assert len(greedy(rt, 3, prompt=' again')) == 3  # not busy, and it decodes again


def _bpe_checkpoint(tmp_path):
    """tiny-hybrid saved with a real (byte-level BPE) transformers tokenizer instead."""
    from flashrt_ros.runtime.models.hf import save_builtin
    from flashrt_ros.runtime.models.tokenizer import MARKER_FILE
    from tokenizers import decoders, models, pre_tokenizers, Tokenizer, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [PROMPT + ' ünïcode ✓ 机器人 ' + str(i) for i in range(50)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=259, special_tokens=['<eos>'],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = save_builtin('builtin:tiny-hybrid', tmp_path / 'bpe')
    (path / MARKER_FILE).unlink()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token='<eos>').save_pretrained(path)
    return path


def test_streamed_text_is_decoded_incrementally_and_adds_up(make_runtime, tmp_path):
    rt = make_runtime(str(_bpe_checkpoint(tmp_path)), max_seq_len=512)
    seen = []
    decode = rt.tokenizer.decode
    rt.tokenizer.decode = lambda ids: seen.append(len(ids)) or decode(ids)
    gen = rt.generate(PROMPT, max_new_tokens=200, stop=(), eos=False)
    pieces = [event.text for event in gen]
    during = len(seen)
    text = gen.result.text
    rt.tokenizer.decode = decode
    assert len(pieces) == 200
    assert ''.join(pieces) == text == gen.result.text == decode(gen.result.token_ids)
    # Each step decodes a window of the newest tokens; the whole turn is decoded once, when
    # the result's text is first read (not while the turn ends).
    assert max(seen[:during]) < 20 and seen[during:] == [200]
    stop = gen.result.text[150:153]
    rt.reset()
    gen = rt.generate(PROMPT, max_new_tokens=200, stop=(stop,), eos=False)
    pieces = [event.text for event in gen]
    assert gen.result.stop_reason == 'stop_string' and stop in ''.join(pieces)
    assert gen.result.text == ''.join(pieces)[:''.join(pieces).find(stop)]


@pytest.mark.parametrize('pending', [False, True], ids=['fresh', 'after-a-turn'])
def test_interrupt_stops_a_long_prefill_at_the_next_chunk(make_runtime, monkeypatch, pending):
    monkeypatch.setattr(engine, 'PREFILL_CHUNK', 8)
    ids = [(7 * i + 3) % 200 for i in range(40)]  # five chunks
    rt, ref = make_runtime(), make_runtime()
    if pending:  # the pending token is the first of the first chunk
        for r in (rt, ref):
            greedy(r, 3, prompt=PROMPT[:12])
    start = rt.position
    forward, chunks = rt.adapter.forward, []

    def forward_then_interrupt(x, **kw):
        out = forward(x, **kw)
        chunks.append(x.shape[1])
        if len(chunks) == 1:  # a STOP from another thread while the first chunk ran
            stopper = threading.Thread(target=rt.interrupt)
            stopper.start()
            stopper.join(5)
        return out

    rt.adapter.forward = forward_then_interrupt
    gen = rt.generate(prompt=ids, max_new_tokens=5, stop=(), eos=False)
    assert list(gen) == []
    del rt.adapter.forward
    res = gen.result
    assert chunks == [8] and res.stop_reason == 'interrupted' and not rt.generating
    assert res.prompt_tokens == 40 and res.prompt_consumed == 8 - pending
    # Exactly the state of a prefill of the chunk that ran, committed: rollback(1) lands
    # on it (the end of the turn's prompt), rollback(2) on the boundary before the turn.
    ref_boundary = ref.state_digest()
    ref.prefill(ids[:8 - pending])
    assert rt.position == ref.position == start + 8
    assert rt.state_digest() == ref.state_digest()
    assert rt.rollback(1).position == start + 8
    assert rt.state_digest() == ref.state_digest()
    assert rt.rollback(1).position == start and rt.state_digest() == ref_boundary


def test_a_prompt_longer_than_max_seq_len_is_refused_by_generate(make_runtime):
    rt = make_runtime(max_seq_len=32)
    with pytest.raises(InvalidRequestError, match='prompt of 33 tokens does not fit'):
        rt.generate(prompt=[5] * 33)
    greedy(rt, 4, prompt=[5] * 10)  # leaves position 13 and a pending token
    live = rt.state_digest()
    with pytest.raises(InvalidRequestError, match=r'position 13 \+ 1 pending token'):
        rt.generate(prompt=[5] * 19)  # 13 + 1 + 19 > 32
    assert rt.state_digest() == live and not rt.generating
    gen = rt.generate(prompt=[5] * 18, max_new_tokens=4, stop=(), eos=False)  # fits exactly
    assert len(list(gen)) == 1 and gen.result.stop_reason == 'max_seq_len'
