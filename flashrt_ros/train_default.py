"""
Train the embedded default model: `python -m flashrt_ros.train_default [--out DIR]`.

A small Qwen3-Next-style hybrid (gated DeltaNet + full attention, dense MLPs) over a
byte-level vocabulary, with its multi-token-prediction head trained jointly, on English text
that ships with Python itself: the `pydoc_data` help topics and the docstrings of the
standard library's sources (read with `ast`, never imported, so nothing runs). Part of the
data is rendered as ChatML conversations (a question about a name, the documentation as the
answer). Everything is seeded; a fixed step count makes a run reproducible on one machine.
The result is a normal local checkpoint folder (config, safetensors, tokenizer with a chat
template, generation config) that the runtime loads like any user's checkpoint.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
from pathlib import Path
import random
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F

SEED = 19
VOCAB = 264  # 256 bytes + 3 specials, padded up to a multiple of 8
SPECIALS = {'<|endoftext|>': 256, '<|im_start|>': 257, '<|im_end|>': 258}
EOT, IM_START, IM_END = 256, 257, 258
DEFAULT_OUT = Path(__file__).parent / 'models' / 'default'
CHAT_TEMPLATE = (
    '{% for message in messages %}'
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    '{% endfor %}'
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM_PROMPTS = ('You are a helpful assistant.', 'You answer questions about Python.',
                  'You are a reference manual for the Python standard library.')
QUESTIONS = ('What does {} do?', 'Explain {}.', 'What is {}?', 'Tell me about {}.', '{}')

_LIN, _FULL = 'linear_attention', 'full_attention'
MODEL = {
    'hidden_size': 128, 'intermediate_size': 384, 'num_hidden_layers': 4, 'head_dim': 32,
    'num_attention_heads': 4, 'num_key_value_heads': 2, 'max_position_embeddings': 32768,
    'layer_types': [_LIN, _LIN, _LIN, _FULL], 'mlp_only_layers': [0, 1, 2, 3],
    'linear_num_key_heads': 2, 'linear_num_value_heads': 4, 'linear_key_head_dim': 32,
    'linear_value_head_dim': 32, 'linear_conv_kernel_dim': 4,
}
HPARAMS = {
    'steps': 640, 'batch': 8, 'seq_len': 256, 'lr': 3e-3, 'min_lr': 3e-4, 'warmup': 40,
    'weight_decay': 0.1, 'betas': (0.9, 0.95), 'grad_clip': 1.0, 'mtp_weight': 0.5,
    'chat_fraction': 0.35, 'heldout_every': 25, 'eval_batches': 16, 'threads': 2,
}


# ---- data ---------------------------------------------------------------------------------

def _signature(node: ast.AST) -> str:
    try:
        return f'({ast.unparse(node.args)})'
    except Exception:  # an exotic argument list is not worth a document
        return '()'


def _source_docs(path: Path, module: str):
    """(name, text) of the module's, classes' and functions' docstrings, read with ast."""
    try:
        tree = ast.parse(path.read_text(encoding='utf-8'))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    doc = ast.get_docstring(tree)
    if doc:
        yield module, f'{module}\n\n{doc}'
    stack = [(module, n) for n in tree.body]
    while stack:
        prefix, node = stack.pop(0)
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name.startswith('_') and node.name != '__init__':
            continue
        name = f'{prefix}.{node.name}'
        doc = ast.get_docstring(node)
        if doc:
            head = f'class {name}' if isinstance(node, ast.ClassDef) else name
            sig = '' if isinstance(node, ast.ClassDef) else _signature(node)
            yield name, f'{head}{sig}\n\n{doc}'
        if isinstance(node, ast.ClassDef):
            stack.extend((name, n) for n in node.body)


def documents() -> list[tuple[str, str]]:
    """Every (name, text) document, deduplicated by text, in a fixed order."""
    from pydoc_data.topics import topics

    docs = [(name, text.strip()) for name, text in sorted(topics.items())]
    stdlib = Path(sysconfig.get_paths()['stdlib'])
    for path in sorted(stdlib.rglob('*.py')):
        rel = path.relative_to(stdlib)
        parts = rel.parts
        if any(p in ('site-packages', 'test', 'tests', 'idle_test', '__pycache__') or
               p.startswith('test_') for p in parts):
            continue
        module = '.'.join(parts[:-1] + (() if rel.stem == '__init__' else (rel.stem,)))
        docs.extend(_source_docs(path, module))
    seen, out = set(), []
    for name, text in docs:
        key = ' '.join(text.split()[1:])  # the body, so a re-exported copy counts once
        if len(text) < 80 or key in seen:
            continue
        seen.add(key)
        out.append((name, text))
    return out


def is_heldout(name: str, every: int) -> bool:
    """Return whether a document is held out: one in `every`, by a hash of its name."""
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % every == 0


def encode(text: str) -> list[int]:
    return list(text.encode('utf-8'))


def render(name: str, text: str, rng: random.Random, chat_fraction: float) -> list[int]:
    """Render a document as raw text or as a ChatML conversation, ending in <|endoftext|>."""
    if rng.random() >= chat_fraction:
        return encode(text) + [EOT]
    ids = []
    if rng.random() < 0.5:
        system = rng.choice(SYSTEM_PROMPTS)
        ids += [IM_START] + encode(f'system\n{system}') + [IM_END] + encode('\n')
    question = rng.choice(QUESTIONS).format(name)
    ids += [IM_START] + encode(f'user\n{question}') + [IM_END] + encode('\n')
    ids += [IM_START] + encode(f'assistant\n{text}') + [IM_END] + encode('\n')
    return ids + [EOT]


class Stream:
    """Endless packed [batch, seq_len + 1] windows over reshuffled rendered documents."""

    def __init__(self, docs, seed: int, chat_fraction: float):
        self.docs, self.rng, self.chat_fraction = docs, random.Random(seed), chat_fraction
        self.buffer: list[int] = []

    def _fill(self, n: int) -> None:
        while len(self.buffer) < n:
            order = list(self.docs)
            self.rng.shuffle(order)
            for name, text in order:
                self.buffer += render(name, text, self.rng, self.chat_fraction)

    def batch(self, batch: int, seq_len: int) -> torch.Tensor:
        n = batch * (seq_len + 1)
        self._fill(n)
        chunk, self.buffer = self.buffer[:n], self.buffer[n:]
        return torch.tensor(chunk, dtype=torch.long).view(batch, seq_len + 1)


# ---- model --------------------------------------------------------------------------------

def build_model(seed: int):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from .runtime.models.mtp import MTPHead

    config = Qwen3NextConfig(vocab_size=VOCAB, bos_token_id=None, eos_token_id=[IM_END, EOT],
                             pad_token_id=EOT, tie_word_embeddings=True, **MODEL)
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config)
    head = MTPHead(model)
    head.apply(model._init_weights)
    return model, head


def losses(model, head, window: torch.Tensor):
    """Return (main CE, MTP CE, main logits, MTP logits) of one [B, T + 1] window (nats)."""
    from .runtime.models.mtp import sequence_logits

    ids, targets = window[:, :-1], window[:, 1:]
    main, mtp = sequence_logits(model, head, ids)
    main_ce = F.cross_entropy(main.reshape(-1, VOCAB), targets.reshape(-1))
    mtp_ce = F.cross_entropy(mtp.reshape(-1, VOCAB), window[:, 2:].reshape(-1))
    return main_ce, mtp_ce, main, mtp


@torch.no_grad()
def evaluate(model, head, windows) -> dict[str, float]:
    """Held-out bits per byte, and MTP top-1 vs the true i+2 byte and vs the main model."""
    model.eval(), head.eval()
    main_sum = mtp_sum = agree = correct = count = 0.0
    for window in windows:
        main_ce, mtp_ce, main, mtp = losses(model, head, window)
        main_sum += main_ce.item()
        mtp_sum += mtp_ce.item()
        mtp_top = mtp.argmax(-1)  # row i predicts t_{i+2}
        # The main model's greedy token after t_{i+1}, i.e. its own guess for position i+2.
        next_next = main[:, 1:].argmax(-1)
        agree += (mtp_top == next_next).float().sum().item()
        correct += (mtp_top == window[:, 2:]).float().sum().item()
        count += mtp_top.numel()
    model.train(), head.train()
    n = len(windows)
    return {'bpb': main_sum / n / math.log(2), 'mtp_bpb': mtp_sum / n / math.log(2),
            'mtp_agreement': agree / count, 'mtp_accuracy': correct / count}


def heldout_windows(docs, hp) -> list[torch.Tensor]:
    stream = Stream(docs, SEED + 1, hp['chat_fraction'])
    return [stream.batch(4, hp['seq_len']) for _ in range(hp['eval_batches'])]


def learning_rate(step: int, hp) -> float:
    if step < hp['warmup']:
        return hp['lr'] * (step + 1) / hp['warmup']
    progress = (step - hp['warmup']) / max(1, hp['steps'] - hp['warmup'])
    return hp['min_lr'] + 0.5 * (hp['lr'] - hp['min_lr']) * (1 + math.cos(math.pi * progress))


def _progress(total: int):
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc='train', unit='step', miniters=1, mininterval=10)
    except ImportError:
        return None


# ---- output -------------------------------------------------------------------------------

def save(model, head, out: Path, report: dict) -> None:
    """Write the checkpoint folder: config, weights (main + mtp.*), tokenizer, card."""
    from safetensors.torch import save_file
    from tokenizers import decoders, models, pre_tokenizers, Tokenizer
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    model.config.architectures = ['Qwen3NextForCausalLM']
    model.config.dtype = 'float32'
    model.config.save_pretrained(str(out))
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()
               if k != 'lm_head.weight'}  # tied to the embedding
    tensors.update({f'mtp.{k}': v.detach().contiguous() for k, v in head.state_dict().items()})
    save_file(tensors, str(out / 'model.safetensors'), metadata={'format': 'pt'})
    GenerationConfig(eos_token_id=[IM_END, EOT], pad_token_id=EOT,
                     do_sample=False).save_pretrained(str(out))

    # Each byte is one token, so any text round-trips: a byte-level vocabulary of exactly
    # the 256 byte symbols, no merges, and the specials after them.
    table = _byte_table()
    vocab = {table[b]: b for b in range(256)}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token='<|im_end|>',
                                   pad_token='<|endoftext|>', bos_token=None,
                                   chat_template=CHAT_TEMPLATE, model_max_length=32768)
    fast.save_pretrained(str(out))
    (out / 'training.json').write_text(json.dumps(report, indent=1) + '\n')
    (out / 'README.md').write_text(model_card(report))


def model_card(r: dict) -> str:
    return f"""# flashrt_ros default model

A tiny model trained for a few minutes on Python's own documentation. Its text looks like
documentation and means nothing: do not ask it anything. It exists so that the node, the
demo and the examples show readable words out of the box (`model: default`) while
everything they do with execution state works as on a real model.

- Architecture: Qwen3-Next-style hybrid (`Qwen3NextForCausalLM`), {r['model']['num_hidden_layers']}
  layers (gated DeltaNet, gated DeltaNet, gated DeltaNet, full attention), dense MLPs,
  hidden size {r['model']['hidden_size']}, {r['parameters']:,} parameters, plus a
  multi-token-prediction head (`mtp.*`, {r['mtp_parameters']:,} parameters) trained jointly.
- Vocabulary: one token per byte (256) + `<|endoftext|>` (256), `<|im_start|>` (257),
  `<|im_end|>` (258), padded to {VOCAB}; any text round-trips. ChatML chat template.
- Data: the `pydoc_data` help topics and the docstrings of the standard library of Python
  {r['python']} ({r['documents']:,} documents, {r['data_bytes'] / 1e6:.2f} MB), about a
  third rendered as ChatML conversations; {r['heldout_documents']} documents held out.
- Training: {r['hparams']['steps']} steps of {r['hparams']['batch']} x
  {r['hparams']['seq_len']} bytes, seed {r['seed']}, {r['train_seconds'] / 60:.0f} minutes of
  wall time on a shared CPU; `python -m flashrt_ros.train_default --threads
  {r['hparams']['threads']}` rebuilds this folder.
- Held-out: {r['bpb']:.3f} bits per byte; MTP head {r['mtp_bpb']:.3f} bits per byte for the
  byte after next, top-1 agreement with the main model's next-next greedy byte
  {r['mtp_agreement']:.1%}, top-1 accuracy {r['mtp_accuracy']:.1%}.
- Weights: float32 safetensors (the runtime's default dtype, exact on CPU).
"""


def _byte_table() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what ByteLevel maps bytes to)."""
    keep = list(range(ord('!'), ord('~') + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# ---- main ---------------------------------------------------------------------------------

def train(out: Path, **overrides) -> dict:
    hp = dict(HPARAMS)
    hp.update({k: v for k, v in overrides.items() if v is not None})
    torch.set_num_threads(hp['threads'])
    random.seed(SEED)
    docs = documents()
    train_docs = [d for d in docs if not is_heldout(d[0], hp['heldout_every'])]
    test_docs = [d for d in docs if is_heldout(d[0], hp['heldout_every'])]
    n_bytes = sum(len(t.encode()) for _, t in docs)
    print(f'data: {len(docs)} documents, {n_bytes / 1e6:.2f} MB; held out {len(test_docs)} '
          f'documents; python {sys.version.split()[0]}', flush=True)
    model, head = build_model(SEED)
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in head.parameters())
    print(f'model: {n_main / 1e6:.2f}M parameters + MTP head {n_mtp / 1e6:.2f}M', flush=True)
    params = [*model.parameters(), *head.parameters()]
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() <= 1]
    opt = torch.optim.AdamW([{'params': decay, 'weight_decay': hp['weight_decay']},
                             {'params': no_decay, 'weight_decay': 0.0}],
                            lr=hp['lr'], betas=hp['betas'])
    stream = Stream(train_docs, SEED, hp['chat_fraction'])
    heldout = heldout_windows(test_docs, hp)
    model.train(), head.train()
    bar = _progress(hp['steps'])
    start = time.time()
    for step in range(hp['steps']):
        for group in opt.param_groups:
            group['lr'] = learning_rate(step, hp)
        main_ce, mtp_ce, _, _ = losses(model, head, stream.batch(hp['batch'], hp['seq_len']))
        loss = main_ce + hp['mtp_weight'] * mtp_ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, hp['grad_clip'])
        opt.step()
        bpb = main_ce.item() / math.log(2)
        if bar is not None:
            bar.set_postfix(bpb=f'{bpb:.3f}', mtp=f'{mtp_ce.item() / math.log(2):.3f}',
                            refresh=False)
            bar.update(1)
        elif step % 20 == 0:
            print(f'step {step}/{hp["steps"]} train bpb {bpb:.3f} '
                  f'{time.time() - start:.0f}s', flush=True)
        if (step + 1) % 200 == 0 and step + 1 < hp['steps']:
            print(f'\nstep {step + 1}: held-out {evaluate(model, head, heldout)}', flush=True)
    wall = time.time() - start
    if bar is not None:
        bar.close()
    result = evaluate(model, head, heldout)
    report = {'seed': SEED, 'hparams': hp, 'model': MODEL, 'python': sys.version.split()[0],
              'torch': torch.__version__, 'documents': len(docs), 'heldout_documents':
              len(test_docs), 'data_bytes': n_bytes, 'parameters': n_main,
              'mtp_parameters': n_mtp, 'train_seconds': round(wall, 1),
              **{k: round(v, 4) for k, v in result.items()}}
    print(json.dumps(report, indent=1), flush=True)
    model.eval(), head.eval()
    out.mkdir(parents=True, exist_ok=True)
    save(model, head, out, report)
    print(f'saved {out}', flush=True)
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[1])
    parser.add_argument('--out', type=Path, default=DEFAULT_OUT, help='checkpoint folder')
    parser.add_argument('--steps', type=int, help=f'default {HPARAMS["steps"]}')
    parser.add_argument('--seq-len', type=int, help=f'default {HPARAMS["seq_len"]}')
    parser.add_argument('--batch', type=int, help=f'default {HPARAMS["batch"]}')
    parser.add_argument('--threads', type=int, help=f'CPU threads, default {HPARAMS["threads"]} '
                        '(1 runs faster on an oversubscribed machine)')
    args = parser.parse_args(argv)
    train(args.out, steps=args.steps, seq_len=args.seq_len, batch=args.batch,
          threads=args.threads)


if __name__ == '__main__':
    main()
