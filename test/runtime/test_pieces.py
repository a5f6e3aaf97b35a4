"""A prefill's long operations in pieces (models/pieces.py): the same bytes, preemptible inside."""

import threading

from flashrt_ros.runtime.models import pieces
import pytest
from runtime_harness import PROMPT

# A first prompt (a causal attention without a mask, past one key block and long enough
# for the kernel's larger query tiles; the rule from a zero state) and a second one on top
# of it (the cache's mask, the rule from the state the first left); neither a multiple of a
# piece.
FIRST = [(i * 7) % 200 + 3 for i in range(900)]
SECOND = [(i * 11) % 200 + 3 for i in range(201)]


@pytest.fixture
def meets(monkeypatch):
    """Count pieces.meet() calls (made between pieces) and still run them."""
    calls = []
    real = pieces.meet

    def counted():
        calls.append(threading.get_ident())
        real()
    monkeypatch.setattr(pieces, 'meet', counted)
    return calls


@pytest.mark.parametrize('model,dtype', [
    ('builtin:tiny-hybrid', 'float32'), ('builtin:tiny-hybrid', 'bfloat16'),
    ('builtin:tiny-qwen3-5', 'float32'), ('builtin:tiny-llama', 'float32')])
def test_a_prefill_in_pieces_gives_the_bytes_of_whole_operations(
        make_runtime, meets, model, dtype):
    digests = {}
    for on in (False, True):
        rt = make_runtime(model, dtype=dtype, max_seq_len=2048)
        rt.engine.prefill_pieces = on
        meets.clear()
        rt.prefill(FIRST, raw=True)
        first = rt.state_digest()
        rt.prefill(SECOND, raw=True)
        digests[on] = first, rt.state_digest(), rt.engine.logits.clone()
        assert bool(meets) == on  # in pieces, or not
        rt.close()
    assert digests[True][:2] == digests[False][:2]
    assert digests[True][2].equal(digests[False][2])


@pytest.mark.parametrize('model', ['builtin:tiny-hybrid', 'builtin:tiny-llama'])
def test_a_preemption_is_met_between_pieces_of_one_operation(make_runtime, monkeypatch, model):
    """Armed while the first piece runs, the restore abandons the prefill before the second."""
    rt = make_runtime(model, max_seq_len=1024)
    rt.prefill(PROMPT)
    rt.snapshot('home')
    home = rt.state_digest()
    preempting, met = [], []
    real = pieces.meet

    def meet():
        met.append(1)
        if not preempting:  # the first meet(): arm a restore now, then meet it here
            thread = threading.Thread(target=lambda: preempting.append(
                rt.restore('home', preempt=True)))
            preempting.append(thread)
            thread.start()
            while not rt.writer.pending and thread.is_alive():
                thread.join(0.001)
        real()
    monkeypatch.setattr(pieces, 'meet', meet)
    gen = rt.generate(prompt=FIRST, raw=True, max_new_tokens=3, stop=(), eos=False)
    with pytest.raises(StopIteration):
        next(gen)  # the prefill is abandoned at the first meet(): no token at all
    preempting[0].join(30)
    assert len(met) == 1  # met inside the first operation, between its first two pieces
    assert preempting[1].name == 'home'
    assert gen.result.token_ids == [] and gen.result.stop_reason == 'interrupted'
    assert rt.state_digest() == home
