"""A local checkpoint folder built in the test: tokenizers-made tokenizer, chat template, bf16."""

import json
import pydoc_data.topics

from flashrt_ros.runtime.models.builtin import build_builtin
import torch

SPECIALS = ('<|endoftext|>', '<|im_start|>', '<|im_end|>', '<|startoftext|>')
# Qwen style: ChatML turns, a default system message when the first one is not a system.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# LFM2 style: the BOS comes from the template, once, at the start of the conversation.
LFM2_TEMPLATE = (
    "{{- bos_token -}}{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + "
    "m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Qwen3 style: the reasoning of earlier replies is dropped once a user turn follows them,
# so rendering a longer conversation changes the earlier text (not prefix-stable).
THINKING_TEMPLATE = (
    "{%- set last = namespace(i=-1) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    '{%- set last.i = loop.index0 %}{%- endif %}{%- endfor %}'
    "{%- for m in messages %}{%- if m['role'] == 'assistant' and loop.index0 > last.i %}"
    "{{- '<|im_start|>assistant\\n<think></think>' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    '{%- endif %}{%- endfor %}'
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Every turn changes the text before it: refused.
UNSTABLE_TEMPLATE = (
    "{{- messages|length }}{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + "
    "m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def build_tokenizer(template=QWEN_TEMPLATE, bos=False):
    """
    Return a transformers tokenizer trained with `tokenizers` on Python's own docs.

    Byte-level, with the characters of the text only and no merges: any id sequence decodes
    to text that encodes back to the same ids, so a reply re-rendered by the template
    tokenizes as it was generated. bos: a post-processor puts <|startoftext|> first.
    """
    from tokenizers import decoders, models, pre_tokenizers, processors, Tokenizer, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)[:40]]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=1, show_progress=False,
                                                      special_tokens=list(SPECIALS)))
    if bos:
        start = tok.token_to_id('<|startoftext|>')
        tok.post_processor = processors.TemplateProcessing(
            single='<|startoftext|> $A', special_tokens=[('<|startoftext|>', start)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token='<|im_end|>',
                                   pad_token='<|endoftext|>', bos_token='<|startoftext|>')
    fast.chat_template = template
    return fast


def build_checkpoint(path, template=QWEN_TEMPLATE, bos=False, generation=None,
                     dtype=torch.bfloat16):
    """Save a tiny random hybrid (save_pretrained, `dtype`), its tokenizer and gen config."""
    tok = build_tokenizer(template, bos)
    model = build_builtin('tiny-hybrid', dtype)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    if generation is None:
        generation = {'eos_token_id': [tok.convert_tokens_to_ids('<|im_end|>'),
                                       tok.convert_tokens_to_ids('<|endoftext|>')]}
    (path / 'generation_config.json').write_text(json.dumps(generation))
    return path, tok


def whole_ids(tok, messages, generation_prompt=False):
    """Return apply_chat_template's ids of the whole conversation at once."""
    chat = [{'role': r, 'content': c} for r, c in messages]
    out = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=generation_prompt)
    return list(out['input_ids'] if hasattr(out, 'keys') else out)


def state_ids(rt):
    """Return the token ids the live state consumed, in order."""
    return rt.arena.views['tokens'][:rt.position].tolist()
