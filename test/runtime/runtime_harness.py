"""Helpers of the runtime tests: the model families, prompts and a greedy turn."""

HYBRIDS = [
    'builtin:tiny-hybrid',
    'builtin:tiny-qwen3-5',
    'builtin:tiny-lfm2',
    'builtin:tiny-mamba2',
]
ATTENTION_ONLY = 'builtin:tiny-llama'
FAMILIES = HYBRIDS + [ATTENTION_ONLY]
DTYPES = ['float32', 'bfloat16']
PROMPT = 'The robot arm picks up the red cube and'
OTHER_PROMPT = 'zz 9071 something else entirely ###'


def greedy(rt, n=10, prompt=None, **kw):
    """Token ids of one greedy turn with no stop conditions except the token count."""
    kw.setdefault('stop', ())
    kw.setdefault('eos', False)
    gen = rt.generate(prompt=prompt, max_new_tokens=n, **kw)
    return [ev.token_id for ev in gen]


def decode_steps(rt, n):
    """Run n greedy single-token steps through the engine; return the logits and the digest."""
    out = []
    for _ in range(n):
        token = rt.engine.sample(0.0, 0, 1.0, rt.generator)
        rt.engine.decode(token, rt.position)
        rt.cursor.position += 1
        out.append(rt.engine.logits.clone())
    return out, rt.state_digest()
