"""
llama.cpp side of the peer benchmark (fig7); run as a script by the peer environment's Python.

    build/peer-venv/bin/python peer_worker.py

Reads one JSON request per line on stdin and answers one JSON line on stdout; the timing
loops run here, so the pipe is never inside a timed region. It imports only llama_cpp,
numpy and (for `convert`) llama.cpp's own converter, never flashrt_ros. Requests:
  {"op": "convert", "checkpoint": dir, "out": file.gguf}   Qwen3.5-layout checkpoint -> GGUF
  {"op": "load", "gguf": file, "n_ctx": n, "threads": t}
  {"op": "prefill", "ids": [...]}           cold: memory cleared, ids consumed, argmax taken
  {"op": "save", "name": s}                 the live state kept as a sequence and a whole blob
  {"op": "restore", "name": s, "kind": "seq"|"whole"}  one timed restore
  {"op": "restore_first", "name": s, "token": t}       restore + one token + argmax, timed
  {"op": "decode", "name": s, "steps": n}   restore, then n greedy single-token steps, timed
"""

import ctypes
import glob
import json
import os
import sys
import time

import llama_cpp
import numpy as np

GGML_TYPE_F32 = 0
SEQ = 0


@llama_cpp.llama_log_callback
def _quiet(level, text, user_data):
    """Drop llama.cpp's log lines (the binding's default prints inside every state call)."""


class Peer:
    """One llama.cpp context and the states saved from it, by name."""

    def __init__(self):
        self.llm = None
        self.saved = {}  # name -> (n_tokens, seq blob, whole blob)

    def convert(self, checkpoint, out, outtype='f32'):
        """Write `checkpoint` as a GGUF (f32 or bf16) with llama.cpp's converter, byte vocab."""
        roots = glob.glob(os.path.join(sys.prefix, 'src', 'llama_cpp_python-*', 'vendor',
                                       'llama.cpp'))
        if not roots:
            raise RuntimeError(f'no llama.cpp source under {sys.prefix}/src (scripts/peer_env.sh)')
        sys.path.insert(0, roots[0])
        import convert_hf_to_gguf
        from conversion import get_model_class
        import gguf

        with open(os.path.join(checkpoint, 'config.json')) as f:
            config = json.load(f)
        cls = get_model_class(config['architectures'][0])

        def set_vocab(model):
            # The converter does not know a byte-level vocabulary; write it here: one token
            # per byte (GPT-2's byte-to-text map), then the specials, then padding.
            n = config['vocab_size']
            to_text = _gpt2_bytes()
            ids = {key: v if isinstance(v, list) else [] if v is None else [v]
                   for key, v in ((k, config.get(f'{k}_token_id')) for k in ('bos', 'eos', 'pad'))}
            special = {i: f'<{key}{i}>' for key, values in ids.items() for i in values}
            tokens = [to_text[i] if i < 256 else special.get(i, f'<unused{i}>')
                      for i in range(n)]
            types = [gguf.TokenType.NORMAL if i < 256 else gguf.TokenType.CONTROL
                     for i in range(n)]
            w = model.gguf_writer
            w.add_tokenizer_model('gpt2')
            w.add_tokenizer_pre('default')
            w.add_token_list(tokens)
            w.add_token_types(types)
            # llama.cpp refuses a BPE vocab without merges; one suffices (ids are fed directly)
            w.add_token_merges([f'{tokens[33]} {tokens[33]}'])
            for key, add in (('bos', w.add_bos_token_id), ('eos', w.add_eos_token_id),
                             ('pad', w.add_pad_token_id)):
                if ids[key]:
                    add(ids[key][0])
            w.add_add_bos_token(False)

        cls.set_vocab = set_vocab
        argv = sys.argv
        sys.argv = ['convert_hf_to_gguf.py', checkpoint, '--outfile', out, '--outtype', outtype,
                    '--no-mtp']
        try:
            convert_hf_to_gguf.main()
        finally:
            sys.argv = argv
        return {'bytes': os.path.getsize(out)}

    def load(self, gguf, n_ctx, threads, sampled=None, n_batch=2048):
        llama_cpp.llama_log_set(_quiet, ctypes.c_void_p())
        self.llm = llama_cpp.Llama(
            model_path=gguf, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_batch, 512),
            n_threads=threads, n_threads_batch=threads, type_k=GGML_TYPE_F32,
            type_v=GGML_TYPE_F32, verbose=False)
        llama_cpp.llama_log_set(_quiet, ctypes.c_void_p())
        self.ctx = self.llm._ctx.ctx
        self.n_vocab = self.llm.n_vocab()
        # Greedy over the ids the runtime samples (its tokenizer's), not the padding rows.
        self.sampled = min(self.n_vocab, sampled or self.n_vocab)
        return {'n_vocab': self.n_vocab, 'n_ctx': self.llm.n_ctx(), 'threads': threads,
                'system_info': llama_cpp.llama_print_system_info().decode(errors='replace')}

    def _argmax(self):
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        return int(np.argmax(logits[:self.sampled])), logits

    def prefill(self, ids, logits=False):
        t0 = time.perf_counter()
        self.llm.reset()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        self.llm.eval(ids)
        token, values = self._argmax()
        seconds = time.perf_counter() - t0
        out = {'s': seconds, 'token': token}
        if logits:
            out['logits'] = values.astype(float).tolist()
        return out

    def save(self, name):
        n = llama_cpp.llama_state_seq_get_size(self.ctx, SEQ)
        seq = (ctypes.c_uint8 * n)()
        t0 = time.perf_counter()
        got = llama_cpp.llama_state_seq_get_data(self.ctx, seq, n, SEQ)
        seq_s = time.perf_counter() - t0
        m = llama_cpp.llama_state_get_size(self.ctx)
        whole = (ctypes.c_uint8 * m)()
        t0 = time.perf_counter()
        got_whole = llama_cpp.llama_state_get_data(self.ctx, whole, m)
        whole_s = time.perf_counter() - t0
        if got != n or got_whole != m:
            raise RuntimeError(f'state get wrote {got}/{n} and {got_whole}/{m} bytes')
        self.saved[name] = (self.llm.n_tokens, seq, whole, self._argmax()[0])
        return {'seq_bytes': n, 'whole_bytes': m, 'seq_get_s': seq_s, 'whole_get_s': whole_s}

    def _restore(self, name, kind='seq'):
        n_tokens, seq, whole, _ = self.saved[name]
        # Cleared first: a restore into a context holding later cells would keep them.
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        if kind == 'seq':
            done = llama_cpp.llama_state_seq_set_data(self.ctx, seq, len(seq), SEQ)
            ok = done == len(seq)
        else:
            done = llama_cpp.llama_state_set_data(self.ctx, whole, len(whole))
            ok = done == len(whole)
        if not ok:
            raise RuntimeError(f'{kind} restore of {name!r} read {done} bytes')
        self.llm.n_tokens = n_tokens  # where the binding's next eval() continues

    def restore(self, name, kind):
        t0 = time.perf_counter()
        self._restore(name, kind)
        return {'s': time.perf_counter() - t0}

    def restore_first(self, name, token):
        t0 = time.perf_counter()
        self._restore(name)
        self.llm.eval([token])
        first, _ = self._argmax()
        return {'s': time.perf_counter() - t0, 'token': first}

    def decode(self, name, steps, kind='seq'):
        """Greedy from a restored state: its own argmax first, as the runtime's generate()."""
        self._restore(name, kind)
        token = self.saved[name][3]  # a restore brings back the cache, not the last logits
        tokens = [token]
        t0 = time.perf_counter()
        for _ in range(steps):
            self.llm.eval([token])
            token, _ = self._argmax()
            tokens.append(token)
        seconds = time.perf_counter() - t0
        return {'s': seconds, 'tokens_per_s': steps / seconds, 'tokens': tokens}


def _gpt2_bytes():
    """GPT-2's byte -> printable text map (the byte-level BPE convention)."""
    keep = (list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1))
            + list(range(ord('®'), ord('ÿ') + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def main():
    # Replies go to the original stdout; anything else that prints (the converter, C code)
    # goes to stderr, so it cannot break the protocol.
    replies = os.fdopen(os.dup(1), 'w')
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    peer = Peer()
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop('op')
        try:
            reply = getattr(peer, op)(**request)
        except Exception as exc:  # answered, not raised: the caller records it
            reply = {'error': f'{type(exc).__name__}: {exc}'}
        replies.write(json.dumps(reply) + '\n')
        replies.flush()


if __name__ == '__main__':
    main()
