"""The trained default checkpoint: loads by name and by path, decodes like transformers, reads."""

import json

from flashrt_ros import robot_corpus, train_default
from flashrt_ros.runtime.models import mtp
from flashrt_ros.runtime.models.hf import DEFAULT_DIR, HFCausalLMAdapter
from flashrt_ros.runtime.models.tokenizer import HFTokenizer
import pytest
from runtime_harness import greedy
import torch

PROMPT = 'Return the number of items in a container.\n\n'
# Measured on the committed weights (docs/default-model.md); the floors sit at about half.
MIN_AGREEMENT = 0.48
MIN_ACCURACY = 0.45


@pytest.fixture(scope='module')
def transformers_model():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(DEFAULT_DIR), local_files_only=True).eval()


@pytest.fixture(scope='module')
def heldout_ids():
    """Held-out conversations: instructions on (object, place) pairs training never saw."""
    ids = []
    for messages, obj, place in robot_corpus.heldout_tasks(40, seed=7):
        ids += train_default.render(messages + [('assistant', robot_corpus.plan(obj, place))])
    return ids


def test_the_folder_is_a_normal_checkpoint():
    names = {p.name for p in DEFAULT_DIR.iterdir()}
    assert {'config.json', 'model.safetensors', 'generation_config.json', 'tokenizer.json',
            'tokenizer_config.json', 'README.md'} <= names
    assert (DEFAULT_DIR / 'model.safetensors').stat().st_size <= 10 * 2**20
    config = json.loads((DEFAULT_DIR / 'config.json').read_text())
    assert config['model_type'] == 'qwen3_next'
    assert set(config['layer_types']) == {'linear_attention', 'full_attention'}
    generation = json.loads((DEFAULT_DIR / 'generation_config.json').read_text())
    assert sorted(generation['eos_token_id']) == [256, 258]


def test_loads_by_name_and_by_path(make_runtime):
    by_name = make_runtime('default')
    by_path = make_runtime(str(DEFAULT_DIR))
    assert isinstance(by_name.adapter, HFCausalLMAdapter)
    assert isinstance(by_name.tokenizer, HFTokenizer)  # the folder's own tokenizer.json
    assert by_name.fingerprint == by_path.fingerprint
    assert greedy(by_name, 12, prompt=PROMPT) == greedy(by_path, 12, prompt=PROMPT)


def test_tokenizer_is_one_token_per_byte_and_round_trips():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_DIR), local_files_only=True)
    text = 'héllo\tworld\n\x00\x7f ✓ 日本 \U0001f916'
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode('utf-8'))
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == '<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n'
    assert tok.convert_tokens_to_ids(['<|endoftext|>', '<|im_start|>', '<|im_end|>']) == [
        256, 257, 258]


@pytest.mark.parametrize('prompt_format', ['raw', 'chat'])
def test_greedy_decode_equals_transformers_generate(make_runtime, transformers_model,
                                                    prompt_format):
    rt = make_runtime('default', max_seq_len=256, prompt_format=prompt_format)
    if prompt_format == 'raw':
        ids = rt.tokenize(PROMPT)
    else:  # the folder's own template, rendered by transformers
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(DEFAULT_DIR), local_files_only=True)
        ids = tok.apply_chat_template([{'role': 'user', 'content': PROMPT}], tokenize=True,
                                      add_generation_prompt=True, return_dict=False)
    ours = greedy(rt, 40, prompt=PROMPT)
    out = transformers_model.generate(torch.tensor([list(ids)]), max_new_tokens=40,
                                      do_sample=False, eos_token_id=None, pad_token_id=256)
    assert ours == out[0, len(ids):].tolist()


def test_replies_are_printable_text(make_runtime):
    rt = make_runtime('default', max_seq_len=512)
    scene = robot_corpus.system_prompt({'red cup': 'table', 'green ball': 'left tray'})
    for prompt in ('put the red cup in the bin', 'where is the green ball?', PROMPT):
        rt.reset()
        rt.prefill(scene)
        ids = greedy(rt, 60, prompt=prompt)
        assert all(i < 256 for i in ids[:20]), ids  # bytes, not specials, at first
        text = rt.detokenize([i for i in ids if i < 256])
        assert '\ufffd' not in text
        assert all(c.isprintable() or c in '\n\t' for c in text), repr(text)
        words = [w for w in text.split() if w.isalpha()]
        assert len(words) >= 4, repr(text)


@torch.no_grad()
def test_mtp_head_agrees_with_the_main_model(transformers_model, heldout_ids):
    head = mtp.load_head(transformers_model, DEFAULT_DIR)
    assert head is not None
    ids = torch.tensor([heldout_ids[:4096]])
    main, draft = mtp.sequence_logits(transformers_model, head, ids)
    guess = draft.argmax(-1)  # row i guesses t_{i+2}
    agreement = (guess == main[:, 1:].argmax(-1)).float().mean().item()
    accuracy = (guess[:, :-1] == ids[:, 2:]).float().mean().item()
    assert agreement > MIN_AGREEMENT and accuracy > MIN_ACCURACY, (agreement, accuracy)
