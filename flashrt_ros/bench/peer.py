"""
Figure 7: the runtime against llama.cpp on the same weights, side by side in one run.

llama.cpp (llama-cpp-python, compiled from source by `make bench-peer` into build/peer-venv)
runs in a worker process of that environment (peer_worker.py); this side converts the
model, sends it requests and interleaves them with the runtime's own measurements, so both
see the same machine. Both get the same token-id prompts and the same thread count.

The bench model is a dense Qwen3-Next; llama.cpp's qwen3next loader wants MoE tensors, so
the weights are re-laid into the Qwen3.5 layout (q/k/v and z, b and a projections apart
instead of interleaved per key-head group: the same numbers) and converted as `qwen35`.
"""

import json
import os
from pathlib import Path
import subprocess
import sys

import torch

from .common import ratio, summarize
from .measure import (cpu_info, first_token_s, restored_first_token_s, sample_interleaved_s,
                      token_ids)

PEER_LENGTHS = (512, 2048, 8192, 16384)
GGUF_TYPES = {torch.float32: 'f32', torch.bfloat16: 'bf16'}  # the model's dtype, unchanged
BF16_TOKENS_NOTE = ('same tokens: in bf16 each side rounds differently (llama.cpp rounds the '
                    'activations to bf16 before every product, ours keep them float32), so '
                    'greedy tokens may part where two logits are close; docs/architecture.md '
                    "gives the compiled step's agreement with transformers in bf16")
PEER_ENV = 'FLASHRT_PEER_PYTHON'
# Decode rounds per length, each side first in half of them: a round is tens of ms, so one
# side's turn can meet the other's threads still winding down; few rounds leave the median
# to that.
DECODE_ROUNDS = 8
WORKER = Path(__file__).with_name('peer_worker.py')


def peer_refusal(python):
    """Say why llama.cpp cannot be measured with `python` (None: it can)."""
    if not python:
        return (f'no peer environment: run `make bench-peer` (builds llama.cpp into '
                f'build/peer-venv) or pass --peer-python / set {PEER_ENV}')
    if not os.access(python, os.X_OK):
        return f'peer Python {python} does not exist (run `make bench-peer`)'
    out = subprocess.run([python, '-c', 'import llama_cpp, numpy'], capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        return (f'llama_cpp is not importable by {python}: '
                f'{out.stderr.strip().splitlines()[-1:]} (run `make bench-peer`)')
    return None


def qwen35_checkpoint(model, directory):
    """
    Save a dense Qwen3-Next model as a Qwen3.5 text checkpoint computing the same function.

    Qwen3-Next interleaves [q, k, v, z] and [b, a] per key-head group in two projections;
    Qwen3.5 has one projection each for qkv, z, b and a, heads in the same order. The
    weights keep the model's dtype (float32 or bf16): llama.cpp gets the same numbers.
    """
    cfg = model.config
    if cfg.model_type != 'qwen3_next':
        raise ValueError(f'the peer figure converts qwen3_next models, not {cfg.model_type!r}')
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    r, dv = cfg.linear_num_value_heads // hk, cfg.linear_value_head_dim
    tensors, tied = {}, bool(cfg.tie_word_embeddings)
    for name, t in model.state_dict().items():
        if tied and name == 'lm_head.weight':  # the embedding's own rows, written once
            continue
        t = t.detach().clone()  # its own memory: safetensors refuses shared storage
        if name.endswith('in_proj_qkvz.weight'):
            q, k, v, z = t.view(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], 1)
            base = name.removesuffix('in_proj_qkvz.weight')
            tensors[base + 'in_proj_qkv.weight'] = torch.cat(
                [x.reshape(-1, t.shape[1]) for x in (q, k, v)]).contiguous()
            tensors[base + 'in_proj_z.weight'] = z.reshape(-1, t.shape[1]).contiguous()
        elif name.endswith('in_proj_ba.weight'):
            b, a = t.view(hk, 2 * r, -1).split([r, r], 1)
            base = name.removesuffix('in_proj_ba.weight')
            tensors[base + 'in_proj_b.weight'] = b.reshape(-1, t.shape[1]).contiguous()
            tensors[base + 'in_proj_a.weight'] = a.reshape(-1, t.shape[1]).contiguous()
        else:
            tensors[name] = t
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / 'model.safetensors'))
    config = {k: v for k, v in cfg.to_dict().items()
              if not k.startswith(('num_experts', 'moe_', 'shared_expert', 'decoder_sparse',
                                   'norm_topk', 'output_router', 'router_aux', 'mlp_only'))}
    config.update(architectures=['Qwen3_5ForCausalLM'], model_type='qwen3_5_text',
                  torch_dtype=str(model.dtype).removeprefix('torch.'), tie_word_embeddings=tied)
    (out / 'config.json').write_text(json.dumps(config, indent=1, default=str))
    return out


class PeerProcess:
    """The llama.cpp worker: one JSON request per line, one reply per line."""

    def __init__(self, python):
        self.proc = subprocess.Popen([python, str(WORKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def __call__(self, op, **kwargs):
        self.proc.stdin.write(json.dumps({'op': op, **kwargs}) + '\n')
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()[-2000:]
            raise RuntimeError(f'the llama.cpp worker exited during {op!r}: {err}')
        reply = json.loads(line)
        if 'error' in reply:
            raise RuntimeError(f'llama.cpp {op}: {reply["error"]}')
        return reply

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _ms(samples):
    return summarize(samples, scale=1e3)


def _runtime_decode(rt, name, steps):
    """Greedy tokens and tokens/s from capsule `name`: the same steps the peer runs."""
    rt.restore(name)
    gen = rt.generate(max_new_tokens=steps + 1, stop=(), eos=False)
    tokens = [event.token_id for event in gen]
    return gen.result.tokens_per_s, tokens


def open_peer(rt, plan, python, n_ctx, log):
    """Convert rt's model to GGUF and load it in a llama.cpp worker; return (peer, about)."""
    threads = torch.get_num_threads()
    workdir = Path(plan.workdir) / 'peer'
    peer = PeerProcess(python)
    try:
        qwen35_checkpoint(rt.adapter.model, workdir / 'qwen35')
        gguf = str(workdir / 'bench.gguf')
        outtype = GGUF_TYPES[rt.adapter.dtype]
        converted = peer('convert', checkpoint=str(workdir / 'qwen35'), out=gguf, outtype=outtype)
        sampled = min(rt.adapter.vocab_size, rt.tokenizer.vocab_size)  # as Engine.limit_vocab
        loaded = peer('load', gguf=gguf, n_ctx=n_ctx, threads=threads, sampled=sampled)
    except BaseException:
        peer.close()
        raise
    log(f'llama.cpp: the model converted to a {outtype} GGUF '
        f'({converted["bytes"] / 2**20:.1f} MiB), {threads} threads')
    return peer, {'threads': threads, 'gguf_bytes': converted['bytes'], 'gguf_type': outtype,
                  'llama_cpp_system': loaded['system_info']}


def peer_decode_tps(peer, ids, steps, name='bench-peer-decode'):
    """Return a tokens/s function for paired_decode_rounds: llama.cpp from the state after ids."""
    peer('prefill', ids=ids)
    peer('save', name=name)
    return lambda: peer('decode', name=name, steps=steps)['tokens_per_s']


def skip_reason(rt, python):
    """Say why llama.cpp cannot run beside `rt` (None: it can)."""
    reason = peer_refusal(python)
    if reason is None and rt.adapter.config.model_type != 'qwen3_next':
        reason = f'the peer figure converts qwen3_next models; this one is {rt.adapter.family}'
    if reason is None and rt.device.type != 'cpu':
        reason = 'the peer runs on CPU (llama.cpp is built for the CPU here)'
    if reason is None and rt.adapter.dtype not in GGUF_TYPES:
        reason = f'llama.cpp gets float32 or bf16 weights here; this model is {rt.adapter.dtype}'
    return reason


def fig7_peer(rt, plan, log, python=None):
    """Cold prefill, state save/restore, restore + first token and decode vs llama.cpp."""
    python = python or os.environ.get(PEER_ENV)
    dtype = str(rt.adapter.dtype).removeprefix('torch.')
    title = f'The runtime vs llama.cpp on the same weights ({dtype}, same threads)'
    reason = skip_reason(rt, python)
    if reason is not None:
        log(f'fig7 skipped: {reason}')
        return {'title': title, 'dtype': dtype, 'cpu_info': cpu_info(rt), 'skipped': [reason]}
    lengths = [n for n in plan.lengths if n in PEER_LENGTHS] or list(plan.lengths)
    lengths = [n for n in lengths if n + plan.decode_steps + 2 <= rt.config.max_seq_len]
    peer, loaded = open_peer(rt, plan, python, max(lengths) + plan.decode_steps + 16, log)
    try:
        rows = [_peer_row(rt, peer, plan, n, log) for n in lengths]
    finally:
        peer.close()
        for info in rt.list_capsules():
            if info.name.startswith('bench-peer-'):
                rt.delete_capsule(info.name)
        rt.reset()
    at = {r['tokens']: r for r in rows}
    return {
        'title': title,
        'dtype': dtype,
        'note': BF16_TOKENS_NOTE if rt.adapter.dtype == torch.bfloat16 else None,
        'cpu_info': cpu_info(rt),
        **loaded,
        'rows': rows,
        'same_greedy_tokens': all(r['same_greedy_tokens'] for r in rows),
        'target': 'decode tokens/s >= llama.cpp at 512 and 16k; full restore >= 5x faster than '
                  'state_seq_set_data up to 8k (3x at 16k); restore + first token <= llama.cpp',
        'target_holds': all((at[n]['decode_vs_peer'] or 0) >= 1.0 for n in (512, 16384))
        if {512, 16384} <= set(at) else None,
    }


def _peer_row(rt, peer, plan, length, log):
    prefix, new = token_ids(length, seed=7), token_ids(1, seed=8)[0]
    name = f'bench-peer-{length}'
    # Cold prefill + first token, alternating; the runtime's last one leaves the state.
    n_cold = max(1, min(plan.repeats, int(plan.budget_s // max(1, length / 1024))))
    cold, peer_cold, firsts = [], [], set()
    for _ in range(n_cold):
        rt.reset()
        sec, token = first_token_s(rt, prefix)
        cold.append(sec)
        reply = peer('prefill', ids=prefix)
        peer_cold.append(reply['s'])
        firsts.add((token, reply['token']))
    rt.reset()
    rt.prefill(prefix)
    snap = sample_interleaved_s([lambda: rt.snapshot(name, 'device')], 1, rt.device)[0]
    state_bytes = next(i.nbytes for i in rt.list_capsules() if i.name == name)
    peer('prefill', ids=prefix)
    saved = peer('save', name=name)
    # Restores: the runtime's full one (lineage forgotten: every byte copied) and its
    # same-lineage one (the interrupt path), llama.cpp's sequence and whole-context ones.
    full, same, seq, whole = [], [], [], []
    for _ in range(plan.fast_repeats):
        forget_full = sample_interleaved_s(
            [rt.arena.begin_epoch, lambda: rt.restore(name), lambda: rt.restore(name)], 1,
            rt.device)
        full += forget_full[1]
        same += forget_full[2]
        seq.append(peer('restore', name=name, kind='seq')['s'])
        whole.append(peer('restore', name=name, kind='whole')['s'])
    first, peer_first, first_tokens = [], [], set()
    for _ in range(plan.fast_repeats):
        sec, token = restored_first_token_s(rt, name, [new])
        first.append(sec)
        reply = peer('restore_first', name=name, token=new)
        peer_first.append(reply['s'])
        first_tokens.add((token, reply['token']))
    tps, peer_tps, same_tokens = [], [], True
    for i in range(max(DECODE_ROUNDS, plan.repeats)):
        if i % 2:  # each side goes first in half the rounds
            reply = peer('decode', name=name, steps=plan.decode_steps)
            ours, ids = _runtime_decode(rt, name, plan.decode_steps)
        else:
            ours, ids = _runtime_decode(rt, name, plan.decode_steps)
            reply = peer('decode', name=name, steps=plan.decode_steps)
        tps.append(ours)
        peer_tps.append(reply['tokens_per_s'])
        same_tokens = same_tokens and ids == reply['tokens']
    row = {
        'tokens': length,
        'state_bytes': state_bytes,
        'peer_seq_bytes': saved['seq_bytes'], 'peer_whole_bytes': saved['whole_bytes'],
        'cold_prefill_ms': _ms(cold), 'peer_cold_prefill_ms': _ms(peer_cold),
        'snapshot_ms': _ms(snap), 'peer_seq_get_ms': saved['seq_get_s'] * 1e3,
        'peer_whole_get_ms': saved['whole_get_s'] * 1e3,
        'restore_ms': _ms(full), 'restore_same_lineage_ms': _ms(same),
        'peer_seq_restore_ms': _ms(seq), 'peer_whole_restore_ms': _ms(whole),
        'restore_first_token_ms': _ms(first), 'peer_restore_first_token_ms': _ms(peer_first),
        'decode_tokens_per_s': summarize(tps), 'peer_decode_tokens_per_s': summarize(peer_tps),
        'same_first_token': all(a == b for a, b in firsts | first_tokens),
        'same_greedy_tokens': same_tokens,
    }
    med = {k: v['median'] for k, v in row.items() if isinstance(v, dict)}
    row['decode_vs_peer'] = ratio(med['decode_tokens_per_s'], med['peer_decode_tokens_per_s'])
    row['peer_seq_restore_over_ours'] = ratio(med['peer_seq_restore_ms'], med['restore_ms'])
    row['peer_seq_restore_over_same_lineage'] = ratio(med['peer_seq_restore_ms'],
                                                      med['restore_same_lineage_ms'])
    row['peer_first_token_over_ours'] = ratio(med['peer_restore_first_token_ms'],
                                              med['restore_first_token_ms'])
    row['peer_cold_over_ours'] = ratio(med['peer_cold_prefill_ms'], med['cold_prefill_ms'])
    log(f'fig7 {length} tokens: decode {med["decode_tokens_per_s"]:.1f} vs llama.cpp '
        f'{med["peer_decode_tokens_per_s"]:.1f} tok/s; restore {med["restore_ms"]:.3f} vs '
        f'{med["peer_seq_restore_ms"]:.3f} ms; restore + first token '
        f'{med["restore_first_token_ms"]:.2f} vs {med["peer_restore_first_token_ms"]:.2f} ms; '
        f'same greedy tokens {same_tokens}')
    return row


if __name__ == '__main__':
    sys.exit('run through python -m flashrt_ros.bench --only fig7')
