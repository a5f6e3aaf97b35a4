"""Conversations over a local checkpoint: chat-template turns, its dtype, generation config."""

from checkpoint_harness import build_checkpoint, LFM2_TEMPLATE, QWEN_TEMPLATE, state_ids
from checkpoint_harness import THINKING_TEMPLATE, UNSTABLE_TEMPLATE, whole_ids
from flashrt_ros.runtime import BusyError, InvalidRequestError
from flashrt_ros.runtime.models.builtin import VOCAB
import pytest
import torch

SYSTEM = 'You are a careful robot arm.'
TURNS = ('Pick up the red cup.', 'Now put it on the shelf.', 'What did you just do?')


@pytest.fixture
def chat_rt(make_runtime, tmp_path):
    """Return (runtime, tokenizer) of a Qwen-style bf16 checkpoint loaded by path."""
    path, tok = build_checkpoint(tmp_path / 'qwen')
    return make_runtime(str(path), dtype='auto', max_seq_len=512), tok


def _turn(rt, prompt, n=6, **kw):
    gen = rt.generate(prompt, max_new_tokens=n, stop=(), **kw)
    events = list(gen)
    assert [e.token_id for e in events] == gen.result.token_ids[:len(events)]
    return gen


def test_local_checkpoint_loads_by_path_in_its_own_dtype(chat_rt):
    rt, tok = chat_rt
    assert rt.dtype == torch.bfloat16 and rt.stats().dtype == 'bfloat16'
    assert next(rt.adapter.model.parameters()).dtype == torch.bfloat16
    assert rt.chat is not None and rt.tokenizer.vocab_size == len(tok) < VOCAB


@pytest.mark.parametrize('template', [QWEN_TEMPLATE, LFM2_TEMPLATE, THINKING_TEMPLATE])
def test_turns_prefill_what_the_whole_conversation_renders(make_runtime, tmp_path, template):
    path, tok = build_checkpoint(tmp_path / 'ckpt', template, bos=template is LFM2_TEMPLATE)
    rt = make_runtime(str(path), max_seq_len=512)
    rt.prefill(SYSTEM)
    messages = [('system', SYSTEM)]
    assert state_ids(rt) == whole_ids(tok, messages)
    if template is LFM2_TEMPLATE:
        assert state_ids(rt)[0] == tok.convert_tokens_to_ids('<|startoftext|>')
    for prompt in TURNS:
        before = rt.position
        gen = _turn(rt, prompt)
        # The turn prefilled only its own tokens: the conversation's rendering with the
        # user message and the generation prompt, past what the state held before.
        rendered = whole_ids(tok, messages + [('user', prompt)], generation_prompt=True)
        assert gen.prompt_ids == rendered[before:]
        reply = tok.decode(gen.result.token_ids, skip_special_tokens=False)
        assert tok.encode(reply, add_special_tokens=False) == gen.result.token_ids, \
            'the fixture needs replies that tokenize back to themselves'
        messages += [('user', prompt), ('assistant', reply)]
        assert rt.conversation == tuple(messages)
        if template is not THINKING_TEMPLATE:
            # The committed state is the whole conversation as apply_chat_template gives
            # it: the reply closed by <|im_end|>\n, whatever stopped it.
            assert state_ids(rt) == whole_ids(tok, messages)
    if template is THINKING_TEMPLATE:
        # Not prefix-stable: later turns are rendered after the system message, so the
        # state is the conversation as it was fed, each reply with its empty think block.
        assert state_ids(rt)[-2:] == tok.encode('<|im_end|>\n', add_special_tokens=False)


def test_restore_continues_the_dialogue_token_identically(chat_rt):
    rt, tok = chat_rt
    rt.prefill(SYSTEM)
    home = rt.snapshot('home')
    assert home.roles == ('system',)
    first = _turn(rt, TURNS[0]).result.token_ids
    after_one = rt.snapshot('one')
    assert after_one.roles == ('system', 'user', 'assistant')
    second = _turn(rt, TURNS[1]).result.token_ids
    third = _turn(rt, TURNS[2]).result.token_ids
    digest, conversation = rt.state_digest(), rt.conversation
    rt.restore('one')
    assert rt.conversation == conversation[:3] and rt.position == after_one.position
    assert _turn(rt, TURNS[1]).result.token_ids == second
    assert _turn(rt, TURNS[2]).result.token_ids == third
    assert rt.state_digest() == digest and rt.conversation == conversation
    rt.restore('home')
    assert _turn(rt, TURNS[0]).result.token_ids == first
    # The disk tier keeps the conversation too; the listing says how many turns it holds.
    rt.snapshot('on_disk', tier='disk')
    listed = {i.name: i for i in rt.list_capsules()}
    assert listed['on_disk'].roles == ('system', 'user', 'assistant')
    rt.store._mem.pop('on_disk', None)  # forget the cached copy: read it back from the file
    rt.reset()
    assert rt.conversation == ()
    rt.restore('on_disk')
    assert rt.conversation == conversation[:3]


def test_rollback_and_fork_carry_the_conversation(chat_rt):
    rt, tok = chat_rt
    rt.prefill(SYSTEM)
    _turn(rt, TURNS[0])
    one = rt.conversation
    _turn(rt, TURNS[1])
    rt.rollback(1)  # a whole exchange back: the prompt's end is no boundary of its own
    assert rt.conversation == one
    assert state_ids(rt)[-2:] == tok.encode('<|im_end|>\n', add_special_tokens=False)
    rt.snapshot('a')
    rt.fork('a', 'b')
    rt.reset()
    rt.restore('b')
    assert rt.conversation == one


def test_an_interrupted_reply_is_closed_as_a_whole_turn(chat_rt):
    rt, tok = chat_rt
    rt.prefill(SYSTEM)
    gen = rt.generate(TURNS[0], max_new_tokens=50, stop=(), eos=False)
    taken = [next(gen).token_id for _ in range(3)]
    with pytest.raises(BusyError, match='whole turns'):
        rt.snapshot('mid_turn')  # a capsule never holds half a turn
    rt.interrupt()
    assert gen.result.stop_reason == 'interrupted' and gen.result.token_ids == taken
    end = tok.encode('<|im_end|>\n', add_special_tokens=False)
    assert state_ids(rt)[-len(end) - 3:] == taken + end  # the last token was fed too
    assert rt.conversation[-1] == ('assistant', tok.decode(taken, skip_special_tokens=False))
    assert rt.snapshot('after').roles == ('system', 'user', 'assistant')


def test_generation_config_eos_ends_the_reply(make_runtime, tmp_path):
    path, tok = build_checkpoint(tmp_path / 'probe')
    probe = make_runtime(str(path), max_seq_len=512)
    probe.prefill(SYSTEM)
    first = _turn(probe, TURNS[0], n=4, eos=False).result.token_ids[0]
    # The same checkpoint whose generation_config.json names that token as an EOS.
    path, _ = build_checkpoint(tmp_path / 'eos', generation={'eos_token_id': [first]})
    rt = make_runtime(str(path), max_seq_len=512)
    assert first in rt.tokenizer.eos_token_ids
    rt.prefill(SYSTEM)
    gen = _turn(rt, TURNS[0], n=4)
    assert (gen.result.stop_reason, gen.result.token_ids) == ('eos', [])
    # The EOS is not fed: the turn closes with the template's end-of-turn instead.
    assert state_ids(rt) == whole_ids(tok, [('system', SYSTEM), ('user', TURNS[0]),
                                            ('assistant', '')])


def test_sampling_defaults_come_from_the_checkpoint(make_runtime, tmp_path):
    path, _ = build_checkpoint(tmp_path / 's', generation={
        'do_sample': True, 'temperature': 0.7, 'top_k': 20, 'top_p': 0.8, 'eos_token_id': 2})
    rt = make_runtime(str(path), max_seq_len=512)
    gen = rt.generate('Hi', max_new_tokens=1, temperature=None, top_k=None, top_p=None)
    s = gen.sampling
    assert (s.temperature, s.top_k, s.top_p) == (0.7, 20, 0.8)
    list(gen)
    gen = rt.generate('Hi', max_new_tokens=1, temperature=0.0, top_k=None, top_p=1.0)
    assert (gen.sampling.temperature, gen.sampling.top_k, gen.sampling.top_p) == (0.0, 20, 1.0)
    list(gen)


def test_ids_outside_the_tokenizer_are_refused_and_never_sampled(chat_rt):
    rt, tok = chat_rt
    n = len(tok)
    with pytest.raises(InvalidRequestError, match=f'outside the vocabulary \\[0, {n}\\)'):
        rt.generate([5, n], max_new_tokens=2)
    assert rt.position == 0
    # Greedy and sampled tokens alike stay inside the tokenizer's ids, though the model's
    # output layer has VOCAB rows.
    rt.engine.logits[n:].fill_(1e4)
    assert rt.engine.sample(0.0, 0, 1.0, rt.generator) < n
    assert rt.engine.sample(1.0, 0, 1.0, rt.generator) < n


def test_raw_text_and_token_ids_bypass_the_template(chat_rt):
    rt, tok = chat_rt
    rt.prefill(SYSTEM)
    before = rt.position
    gen = rt.generate('plain text', max_new_tokens=2, stop=(), raw=True)
    list(gen)
    assert gen.prompt_ids == tok.encode('plain text', add_special_tokens=False)
    assert rt.conversation[-1] == ('raw', '')
    assert state_ids(rt)[before:before + len(gen.prompt_ids)] == gen.prompt_ids
    with pytest.raises(InvalidRequestError, match='needs a user message'):
        rt.generate(None)


def test_the_first_raw_segment_gets_the_tokenizer_bos(make_runtime, tmp_path):
    path, tok = build_checkpoint(tmp_path / 'bos', bos=True)
    rt = make_runtime(str(path), max_seq_len=256, prompt_format='raw')
    assert rt.chat is None
    bos = tok.convert_tokens_to_ids('<|startoftext|>')
    rt.prefill('first')
    rt.prefill('second')
    assert state_ids(rt) == [bos] + tok.encode('firstsecond', add_special_tokens=False)
    assert rt.conversation == ()  # raw text outside a conversation records nothing


def test_a_template_that_is_not_prefix_stable_is_refused(make_runtime, tmp_path):
    path, _ = build_checkpoint(tmp_path / 'unstable', UNSTABLE_TEMPLATE)
    rt = make_runtime(str(path), max_seq_len=256)
    rt.prefill(SYSTEM)
    position, digest = rt.position, rt.state_digest()
    with pytest.raises(InvalidRequestError, match='not prefix-stable'):
        rt.generate(TURNS[0])
    assert (rt.position, rt.state_digest()) == (position, digest)
    list(rt.generate(TURNS[0], max_new_tokens=2, raw=True))  # raw still works


def test_a_turn_at_max_seq_len_still_closes(make_runtime, tmp_path):
    path, tok = build_checkpoint(tmp_path / 'short')
    rt = make_runtime(str(path), max_seq_len=96)
    rt.prefill(SYSTEM)
    gen = _turn(rt, TURNS[0], n=500, eos=False)
    assert gen.result.stop_reason == 'max_seq_len' and rt.position <= 96
    assert state_ids(rt)[-2:] == tok.encode('<|im_end|>\n', add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match='for the end of the turn'):
        rt.generate(TURNS[1])
