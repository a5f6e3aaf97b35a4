"""Self-speculative decoding: MTP state in the arena and rounds that commit exactly."""

import random

from flashrt_ros.runtime import InvalidRequestError
from flashrt_ros.runtime.errors import FingerprintMismatchError
from flashrt_ros.runtime.models.hf import save_builtin
from flashrt_ros.runtime.models.mtp import sequence_logits
from flashrt_ros.runtime.models.tokenizer import ByteTokenizer
from flashrt_ros.runtime.modes.lm.speculation import Speculator
import pytest
from runtime_harness import greedy, PROMPT
import torch

MODELS = ['builtin:tiny-hybrid', 'builtin:tiny-qwen3-5']
K = 3
N = 20  # tokens per turn


def spec_runtime(make_runtime, verify='sequential', k=K, **kw):
    kw.setdefault('model', 'builtin:tiny-hybrid')
    return make_runtime(speculation=True, speculative_tokens=k, speculative_verify=verify, **kw)


def plain_trace(rt, n=N):
    """
    Plain greedy decode on a speculation runtime (same arena layout), a token per turn.

    Returns (all ids: prompt + tokens, {position: state digest after the step to it}).
    """
    rt.speculator = None  # Generation then steps plainly (the head state is still kept)
    greedy(rt, 1, PROMPT)
    digests = {rt.position: rt.state_digest()}
    for _ in range(n - 1):
        greedy(rt, 1)
        digests[rt.position] = rt.state_digest()
    ids = rt.arena.views['tokens'][:rt.position].tolist() + [rt.cursor.pending]
    return ids, digests


def scripted(ids, kind, vocab=264, seed=0):
    """Drafts from the true continuation `ids`: always right, always wrong or seeded mix."""
    def script(position, pending, k):
        assert ids[position] == pending
        true = ids[position + 1:position + 1 + k]
        if kind == 'right':
            return true
        rnd = random.Random(seed * 100003 + position)  # a function of the position only
        wrong = [(t + 1 + rnd.randrange(vocab - 1)) % vocab for t in true]
        if kind == 'wrong':
            return wrong
        return [t if rnd.random() < 0.6 else w for t, w in zip(true, wrong)]
    return script


def record_rounds(rt):
    """Record (position, state digest) after every round of rt's speculator."""
    seen, run = [], rt.speculator.run_round

    def round_and_record(accept, limit):
        accepted = run(accept, limit)
        seen.append((rt.position, rt.state_digest()))
        return accepted

    rt.speculator.run_round = round_and_record
    return seen


@pytest.mark.parametrize('model,kind', [(MODELS[0], 'right'), (MODELS[0], 'wrong'),
                                        (MODELS[0], 'mixed'), (MODELS[1], 'mixed')])
def test_sequential_rounds_are_plain_greedy_at_every_commit(make_runtime, model, kind):
    ids, digests = plain_trace(spec_runtime(make_runtime, model=model))
    rt = spec_runtime(make_runtime, model=model)
    rt.speculator.script = scripted(ids, kind)
    seen = record_rounds(rt)
    tokens = greedy(rt, N, PROMPT)
    assert tokens == ids[-N:]
    assert seen and all(d == digests[p] for p, d in seen)
    trace = list(rt.speculator.trace)
    if kind == 'right':
        assert set(trace[:-1]) == {K}  # the last round is cut short by max_new_tokens
    elif kind == 'wrong':
        assert set(trace) == {0}
    else:
        assert set(trace) == set(range(K + 1))  # every acceptance count 0..k was exercised


def test_always_right_sequential_commits_k_plus_one_per_round(make_runtime):
    ids, _ = plain_trace(spec_runtime(make_runtime))
    rt = spec_runtime(make_runtime)
    rt.speculator.script = scripted(ids, 'right')
    assert greedy(rt, N, PROMPT) == ids[-N:]
    # The first token comes from the prompt's logits; then rounds of k + 1 tokens.
    assert list(rt.speculator.trace)[:-1] == [K] * (len(rt.speculator.trace) - 1)
    assert rt.stats().speculation['acceptance_by_depth'] == [1.0] * K


@pytest.mark.parametrize('model,kind', [(MODELS[0], 'right'), (MODELS[0], 'mixed'),
                                        (MODELS[1], 'mixed')])
@pytest.mark.parametrize('path', ['compiled', 'torch', 'torch-static'])
def test_batched_rounds_are_token_identical_in_fp32(make_runtime, model, kind, path):
    # torch-static: the device round in the shapes a CUDA graph captures (whole buffers,
    # positions from the state's counters), run eagerly.
    compiled = path == 'compiled'
    ids, _ = plain_trace(spec_runtime(make_runtime, model=model, cpu_step=compiled))
    rt = spec_runtime(make_runtime, verify='batched', model=model, cpu_step=compiled)
    assert rt.adapter.compiled() == compiled
    rt.speculator.device.static = path == 'torch-static'
    rt.speculator.script = scripted(ids, kind)
    assert greedy(rt, N, PROMPT) == ids[-N:]
    if kind == 'mixed':
        assert set(rt.speculator.trace) == set(range(K + 1))


@pytest.mark.parametrize('model,kind', [(MODELS[0], 'right'), (MODELS[0], 'wrong'),
                                        (MODELS[0], 'mixed'), (MODELS[1], 'mixed')])
def test_compiled_batched_rounds_are_plain_greedy_at_every_commit(make_runtime, model, kind):
    # The compiled verify's logits and kept states are bit for bit single compiled steps'.
    ids, digests = plain_trace(spec_runtime(make_runtime, model=model))
    rt = spec_runtime(make_runtime, verify='batched', model=model)
    assert rt.adapter.compiled()
    rt.speculator.script = scripted(ids, kind)
    calls, compiled = [], rt.speculator._compiled
    rt.speculator._compiled = lambda *a: calls.append(1) or compiled(*a)
    seen = record_rounds(rt)
    assert greedy(rt, N, PROMPT) == ids[-N:]
    assert calls and seen and all(d == digests[p] for p, d in seen)
    if kind == 'mixed':
        assert set(rt.speculator.trace) == set(range(K + 1))


class Replayed:
    """On CPU, what a captured CUDA graph stands for: replay() runs its step eagerly."""

    def __init__(self, step):
        self.replay = step


def as_if_graphed(rt):
    """Put rt in the state CUDA graphs run it in: every step and phase in captured shapes."""
    rt.engine.graph = Replayed(rt.engine._step)  # Engine.decode replays it: kv_len None
    dev = rt.speculator.device
    dev.graphs = {(phase, count): Replayed(lambda p=phase, c=count: getattr(dev, p)(c, None))
                  for phase, count in dev.phases()}


@pytest.mark.parametrize('kind', ['right', 'wrong', 'mixed', 'head'])
def test_rounds_in_the_graphed_configuration_are_plain_greedy(make_runtime, kind):
    # What the CUDA path runs once captured, run eagerly on CPU: the decode step and every
    # round phase over whole buffers with positions from the counters, the drafted head
    # rows all zeroed (the decode graph writes x's), the history written from the device.
    ids, digests = plain_trace(spec_runtime(make_runtime, cpu_step=False))
    rt = spec_runtime(make_runtime, verify='batched', cpu_step=False)
    as_if_graphed(rt)
    if kind != 'head':
        rt.speculator.script = scripted(ids, kind)
    seen = record_rounds(rt)
    assert greedy(rt, N, PROMPT) == ids[-N:]
    assert rt.speculator.device.replays > 0 and rt.stats().speculation['cuda_graphs']
    if kind == 'wrong':  # every round is x fed alone: the plain step's bytes
        assert all(d == digests[p] for p, d in seen)
    if kind == 'mixed':
        assert set(rt.speculator.trace) == set(range(K + 1))


def test_a_watched_model_verifies_with_torch_and_keeps_its_tokens(make_runtime):
    ids, _ = plain_trace(spec_runtime(make_runtime))
    rt = spec_runtime(make_runtime, verify='batched')
    rt.speculator.script = scripted(ids, 'mixed')
    calls, torch_round = [], rt.speculator._device_round
    rt.speculator._device_round = lambda *a: calls.append(1) or torch_round(*a)
    handle = rt.adapter.head.fc.register_forward_hook(lambda m, a, out: None)
    try:
        assert not rt.adapter.compiled()
        assert greedy(rt, N, PROMPT) == ids[-N:]
    finally:
        handle.remove()
    assert calls and rt.adapter.compiled()


def test_batched_rejected_round_is_byte_identical_to_a_plain_step(make_runtime):
    # All drafts wrong: the round restores the head, zeroes the rows and feeds x alone,
    # which is the plain step's forward.
    ids, digests = plain_trace(spec_runtime(make_runtime, cpu_step=False))
    rt = spec_runtime(make_runtime, verify='batched', cpu_step=False)
    rt.speculator.script = scripted(ids, 'wrong')
    seen = record_rounds(rt)
    assert greedy(rt, N, PROMPT) == ids[-N:]
    assert len(seen) == N - 1 and all(d == digests[p] for p, d in seen)


@pytest.mark.parametrize('verify', ['sequential', 'batched', 'batched-torch',
                                    'batched-torch-static'])
def test_mtp_drafts_decode_like_plain_greedy(make_runtime, verify):
    # batched-torch: the head drafts on the device too (device_round.py), argmax in place.
    compiled = not verify.startswith('batched-torch')
    plain = greedy(make_runtime(cpu_step=compiled), N, PROMPT)
    rt = spec_runtime(make_runtime, verify=verify.split('-')[0], cpu_step=compiled)
    if verify.endswith('static'):
        rt.speculator.device.static = True
    assert greedy(rt, N, PROMPT) == plain
    assert rt.speculator.rounds == N - 1
    if verify == 'sequential':
        ref = spec_runtime(make_runtime)
        ref.speculator = None
        greedy(ref, N, PROMPT)
        assert ref.state_digest() == rt.state_digest()


@pytest.mark.parametrize('compiled', [True, False])
@pytest.mark.parametrize('model', MODELS)
def test_cached_head_matches_the_whole_sequence_reference(make_runtime, model, compiled):
    rt = spec_runtime(make_runtime, model=model, cpu_step=compiled)
    a = rt.adapter
    assert a.compiled() == compiled
    ids = rt.tokenize(PROMPT)
    main_ref, mtp_ref = sequence_logits(a.model, a.head, torch.tensor([ids]))
    # Token by token: each position drafts from the state, then consumes the token.
    rt.prefill(ids[:1])
    drafts = []
    for p in range(1, len(ids)):
        if compiled:
            drafts.append(a.cpu_head.forward([ids[p]], a.hidden.view(1, -1), p)[0][0].clone())
        else:
            hidden = a.draft_step(torch.tensor([[ids[p]]]), a.hidden.view(1, 1, -1), p)
            drafts.append(a.lm_head(hidden)[0, -1])
        a.skip_first_upkeep = True  # the draft wrote the head row of ids[p]
        rt.prefill(ids[p:p + 1])
    torch.testing.assert_close(torch.stack(drafts), mtp_ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rt.engine.logits, main_ref[0, -1], rtol=1e-4, atol=1e-4)
    # One prefill writes the same head rows.
    other = spec_runtime(make_runtime, model=model)
    other.prefill(ids[:-1])
    b = other.adapter
    hidden = b.draft_step(torch.tensor([[ids[-1]]]), b.hidden.view(1, 1, -1), len(ids) - 1)
    torch.testing.assert_close(b.lm_head(hidden)[0, -1], mtp_ref[0, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('verify', ['sequential', 'batched'])
def test_snapshot_fork_restore_between_rounds_repeat_tokens_and_trace(make_runtime, verify):
    ids, _ = plain_trace(spec_runtime(make_runtime), n=2 * N)
    rt = spec_runtime(make_runtime, verify=verify)
    rt.speculator.script = scripted(ids, 'mixed', seed=3)
    greedy(rt, 7, PROMPT)
    rt.snapshot('a')
    digest = rt.state_digest()
    rt.fork('a', 'b', tier='host')
    start = len(rt.speculator.trace)
    first = greedy(rt, N)
    trace = list(rt.speculator.trace)[start:]
    rt.restore('b')
    assert rt.state_digest() == digest
    start = len(rt.speculator.trace)
    assert greedy(rt, N) == first == ids[-2 * N + 7:][:N]
    assert list(rt.speculator.trace)[start:] == trace
    rt.rollback(1)  # the turn's start: a committed boundary like any other
    assert rt.state_digest() == digest


def test_kv_only_restore_still_diverges_with_speculation(make_runtime):
    rt = spec_runtime(make_runtime, verify='batched')
    rt.prefill(PROMPT)
    rt.snapshot('a')
    first = greedy(rt, 16)
    greedy(rt, 16, 'zz 9071 something else entirely ###')
    rt.restore('a', mode='kv_only')
    assert greedy(rt, 16) != first
    rt.restore('a')
    assert greedy(rt, 16) == first


class _EosAt(ByteTokenizer):
    def __init__(self, token):
        self.token = token

    @property
    def eos_token_ids(self):
        return (self.token,)


@pytest.mark.parametrize('verify', ['sequential', 'batched'])
def test_stop_conditions_cut_a_round_where_plain_decoding_stops(make_runtime, verify):
    ids, _ = plain_trace(spec_runtime(make_runtime))
    gen = ids[-N:]
    eos = gen[9]
    cut = gen.index(eos)
    stop = next(chr(t) for t in gen[5:] if 32 < t < 127)
    cases = [{'max_new_tokens': 11}, {'eos': True, 'tokenizer': _EosAt(eos)},
             {'stop': (stop,)}]
    for case in cases:
        results = []
        for speculative in (False, True):
            rt = spec_runtime(make_runtime, verify=verify)
            if not speculative:
                rt.speculator = None
            else:
                rt.speculator.script = scripted(ids, 'right')
            if 'tokenizer' in case:
                rt.tokenizer = case['tokenizer']
            g = rt.generate(PROMPT, max_new_tokens=case.get('max_new_tokens', N),
                            stop=case.get('stop', ()), eos=case.get('eos', False))
            streamed = [e.token_id for e in g]
            results.append((streamed, g.result.stop_reason, g.result.text, rt.position,
                            rt.cursor.pending, rt.state_digest() if verify == 'sequential'
                            else None))
        assert results[0] == results[1], case
    assert results[0][1] == 'stop_string'
    assert cut < N


@pytest.mark.parametrize('verify', ['sequential', 'batched'])
def test_max_seq_len_cuts_a_round(make_runtime, verify):
    n_prompt = len(PROMPT.encode())
    limit = n_prompt + 10
    ref = spec_runtime(make_runtime, max_seq_len=limit)
    ref.speculator = None
    ids, _ = plain_trace(spec_runtime(make_runtime))
    rt = spec_runtime(make_runtime, verify=verify, max_seq_len=limit)
    rt.speculator.script = scripted(ids, 'right')
    results = []
    for r in (ref, rt):
        g = r.generate(PROMPT, max_new_tokens=40, stop=(), eos=False)
        results.append(([e.token_id for e in g], g.result.stop_reason, r.position))
    assert results[0] == results[1]
    assert results[0][1] == 'max_seq_len' and results[0][2] == limit


def test_interrupt_and_preempting_restore_between_rounds(make_runtime):
    rt = spec_runtime(make_runtime, verify='batched')
    rt.speculator.script = lambda position, pending, k: [0] * k
    rt.prefill(PROMPT)
    rt.snapshot('a')
    first = greedy(rt, 12)
    rt.restore('a')
    gen = rt.generate(max_new_tokens=12, stop=(), eos=False)
    head = [next(gen).token_id for _ in range(3)]
    rt.restore('a', preempt=True)  # between rounds: the caller runs it itself
    assert gen.result.stop_reason == 'interrupted'
    assert head == first[:3]
    assert greedy(rt, 12) == first
    gen = rt.generate(max_new_tokens=12, stop=(), eos=False)
    next(gen)
    rt.interrupt()
    assert gen.result.stop_reason == 'interrupted' and not rt.generating


def test_sampled_speculative_turn_is_refused(make_runtime):
    rt = spec_runtime(make_runtime)
    rt.prefill(PROMPT)
    digest = rt.state_digest()
    with pytest.raises(InvalidRequestError, match='greedy only'):
        rt.generate(max_new_tokens=4, temperature=0.7)
    assert rt.state_digest() == digest and not rt.generating


def test_mtp_state_is_in_the_arena_capsule_and_fingerprint(make_runtime):
    plain = make_runtime()
    rt = spec_runtime(make_runtime)
    assert 'mtp' in rt.components and 'mtp' not in plain.components
    assert rt.state_nbytes > plain.state_nbytes
    assert rt.fingerprint != plain.fingerprint
    mtp_rows = [e for e in rt.arena.manifest if e.kind == 'mtp' and e.strides is not None]
    assert len(mtp_rows) == 2  # the head's K and V, append-only in the row block
    plain.prefill(PROMPT)
    plain.snapshot('p', tier='disk')
    with pytest.raises(FingerprintMismatchError):
        rt.restore('p')
    rt.prefill(PROMPT)
    p = rt.position
    hidden = rt.adapter.hidden.clone()
    assert rt.adapter.meta.tolist() == [p, p - 1]
    assert hidden.abs().sum() > 0
    key = rt.arena.views['mtp.L0.key']  # row p: the head's K for (h_{p-1}, t_p)
    assert (key[:, :, 1:p].abs().sum((0, 1, 3)) > 0).all()
    assert key[:, :, :1].abs().sum() == 0 and key[:, :, p:].abs().sum() == 0
    rt.snapshot('s', tier='disk')
    greedy(rt, 8)
    rt.restore('s')
    assert torch.equal(rt.adapter.hidden, hidden)


def test_model_without_mtp_head_runs_plain_and_says_so(make_runtime, tmp_path):
    path = save_builtin('builtin:tiny-hybrid', tmp_path / 'ckpt')
    rt = make_runtime(model=str(path), speculation=True)
    info = rt.stats().speculation
    assert info['enabled'] is False and 'ships no mtp.* weights' in info['note']
    assert rt.speculator is None and 'mtp' not in rt.components
    assert greedy(rt, 5, PROMPT) == greedy(make_runtime(), 5, PROMPT)
    llama = make_runtime(model='builtin:tiny-llama', speculation=True)
    assert 'has no MTP head' in llama.stats().speculation['note']
    assert make_runtime().stats().speculation == {'enabled': False, 'note': 'off'}


def test_speculator_stats_report_acceptance_by_depth(make_runtime):
    ids, _ = plain_trace(spec_runtime(make_runtime))
    rt = spec_runtime(make_runtime, verify='batched', k=2)
    right = scripted(ids, 'right')

    def script(position, pending, k):  # depth 1 always right, depth 2 always wrong
        true = right(position, pending, k)
        return true[:1] + [(t + 1) % 264 for t in true[1:]]

    rt.speculator.script = script
    greedy(rt, 21, PROMPT)
    stats = rt.stats().speculation
    assert stats['enabled'] and stats['draft_tokens'] == 2
    assert stats['acceptance_by_depth'] == [1.0, 0.0]
    assert stats['mean_accepted_length'] == 2.0
    assert isinstance(rt.speculator, Speculator)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('verify', ['sequential', 'batched'])
def test_cuda_rounds_beside_the_captured_decode_graph(make_runtime, verify):
    plain = make_runtime(device='cuda')
    plain.warmup()
    expected = greedy(plain, N, PROMPT)
    rt = spec_runtime(make_runtime, verify=verify, device='cuda')
    rt.warmup()  # captures the plain step (with the head's upkeep) as a graph
    ids, _ = plain_trace(spec_runtime(make_runtime, device='cuda'))
    rt.speculator.script = scripted(ids, 'mixed')
    assert greedy(rt, N, PROMPT) == expected == ids[-N:]
    assert set(rt.speculator.trace) == set(range(K + 1))
    stats = rt.stats().speculation
    if verify == 'batched':  # draft, verify and feed were captured beside the decode step
        assert stats['cuda_graphs'], stats['cuda_graph_note']
        assert stats['cuda_graph_replays'] >= rt.speculator.rounds
    else:
        assert not stats['cuda_graphs'] and stats['cuda_graph_replays'] == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_cuda_graphed_round_reads_the_device_once(make_runtime):
    plain = make_runtime(device='cuda')
    plain.warmup()
    expected = greedy(plain, N, PROMPT)
    rt = spec_runtime(make_runtime, verify='batched', device='cuda')
    rt.warmup()
    assert rt.stats().speculation['cuda_graphs'], rt.stats().speculation['cuda_graph_note']
    syncs, run = [], rt.speculator.run_round

    def counted(accept, limit):
        import warnings
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter('always')
            torch.cuda.set_sync_debug_mode('warn')
            try:
                accepted = run(accept, limit)
            finally:
                torch.cuda.set_sync_debug_mode('default')
        syncs.append(sum('synchroniz' in str(w.message) for w in seen))
        return accepted

    rt.speculator.run_round = counted
    assert greedy(rt, N, PROMPT) == expected  # the head's own drafts, graphed
    # The last round of a turn may hand out one token only: a plain step, which samples.
    drafted = syncs[:-1]
    assert drafted and all(n == 1 for n in drafted), syncs


def test_checkpoint_mtp_weights_are_loaded(make_runtime, tmp_path):
    from safetensors.torch import save_file

    built = spec_runtime(make_runtime, verify='batched')
    path = save_builtin('builtin:tiny-hybrid', tmp_path / 'ckpt')
    head = {f'mtp.{k}': v.contiguous() for k, v in built.adapter.head.state_dict().items()}
    save_file(head, str(path / 'mtp.safetensors'))
    rt = spec_runtime(make_runtime, verify='batched', model=str(path))
    assert rt.stats().speculation['enabled']
    assert rt.fingerprint == built.fingerprint  # same weights, same head, same layout
    assert greedy(rt, 8, PROMPT) == greedy(built, 8, PROMPT)
    assert list(rt.speculator.trace) == list(built.speculator.trace)


@pytest.mark.parametrize('cpu_step', [True, False])
def test_rounds_verify_among_the_ids_plain_decoding_samples(make_runtime, cpu_step):
    # Models have rows past the tokenizer's ids (padding), which plain decoding never
    # samples; a verify or draft that took them would leave plain decoding's tokens.
    limit = 60  # a narrow vocabulary: the unrestricted argmax falls outside it often
    plain = spec_runtime(make_runtime, cpu_step=cpu_step)
    plain.speculator = None
    plain.engine.limit_vocab(limit)
    expected = greedy(plain, N, PROMPT)
    assert max(expected) < limit
    ids = plain.arena.views['tokens'][:plain.position].tolist() + [plain.cursor.pending]
    rt = spec_runtime(make_runtime, verify='batched', cpu_step=cpu_step)
    rt.engine.limit_vocab(limit)
    rt.speculator.script = scripted(ids, 'right')
    assert greedy(rt, N, PROMPT) == expected
    assert set(list(rt.speculator.trace)[:-1]) == {K}  # every right draft accepted
    head = spec_runtime(make_runtime, verify='batched', cpu_step=cpu_step)
    head.engine.limit_vocab(limit)
    assert greedy(head, N, PROMPT) == expected  # the head's own drafts, limited too
