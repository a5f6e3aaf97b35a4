"""
Decode fast path: one token through a Qwen3-Next / Qwen3.5 hybrid over the arena views.

A transformers forward of one token spends most of its time around the math, not in it:
mask building, cache-object dispatch, keyword plumbing and decorators on every layer, and
the reference gated-DeltaNet code's layout changes. This path runs the same math for
seq_len 1 with the model's own modules and functions (projections, norms, rotary, the
reference conv update, SDPA) in the same order, so its output and the state it writes are
the same bytes as transformers' path (test/runtime/test_fastpath.py checks logits and state
digests bit for bit), and writes the state in place into the same arena views the
StaticCache holds:
  - attention KV rows at the step's position (index_copy_) and the layer's length (add_);
  - the conv window (copy_) and the recurrent state (mul_/add_, elementwise ops whose
    results equal transformers' out-of-place ones).
It runs only at a decode boundary (every linear-attention layer has a previous state) with
the live length known on the host; everything else (prefill, a first token on an empty
state, a captured CUDA graph) takes transformers' path. Module calls are kept, so a
waiting preemption still abandons the step at its next module (preemption.py).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from .binding import WINDOW_QUANTUM
from ..inference import inference

# model_type -> the transformers modeling module whose functions the path calls
FAMILIES = {
    'qwen3_next': 'transformers.models.qwen3_next.modeling_qwen3_next',
    'qwen3_5_text': 'transformers.models.qwen3_5.modeling_qwen3_5',
}


def refusal(model, config) -> str | None:
    """Say why `model` cannot take the fast path (None: it can)."""
    family = str(getattr(config, 'model_type', ''))
    if family not in FAMILIES:
        return f'model type {family!r} has no decode fast path (it has: {", ".join(FAMILIES)})'
    if getattr(config, '_attn_implementation', None) != 'sdpa':
        return f'attention implementation {config._attn_implementation!r} is not sdpa'
    if getattr(config, 'hidden_act', 'silu') != 'silu':
        return f'activation {config.hidden_act!r} is not silu'
    for i, layer in enumerate(model.model.layers):
        if not hasattr(layer.mlp, 'gate_proj'):
            return f'layer {i} has a mixture-of-experts block'
        if getattr(layer, 'linear_attn', None) is not None and layer.linear_attn.training:
            return 'the model is in training mode'
    return None


def _taps_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias):
    """
    Run transformers' causal_conv1d_update for one token without the convolution call.

    x [1, C, 1], conv_state [1, C, K] (shifted in place), weight [C, 1, K] -> [1, C, 1].
    The result is the second column of a [1, C, 2] buffer, the layout of the reference's
    sliced conv output: the activation then runs the same (strided) loop over it.
    """
    conv_state.copy_(torch.cat([conv_state, x], dim=-1)[:, :, 1:])
    acc = conv_state[:, :, 0:1] * weight[:, 0, 0:1]
    for k in range(1, conv_state.shape[-1]):
        acc = torch.addcmul(acc, conv_state[:, :, k:k + 1], weight[:, 0, k:k + 1])
    if bias is not None:
        acc = acc + bias[:, None]
    out = conv_state.new_empty(conv_state.shape[:2] + (2,))[:, :, 1:]  # [1, C, 1], stride 2
    return F.silu(out.copy_(acc))


class DecodeFastPath:
    """Single-token decode of a Qwen3-Next-style hybrid, writing only arena views."""

    def __init__(self, model, config, views: dict[str, torch.Tensor], max_len: int):
        self.ops = importlib.import_module(FAMILIES[config.model_type])
        self.model = model
        self.embed = model.model.embed_tokens
        self.rotary = model.model.rotary_emb
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.max_len = max_len
        device = views['logits'].device
        self.position = torch.zeros((1, 1), dtype=torch.long, device=device)  # [1, 1]
        self.slots = torch.arange(max_len, device=device)  # [L] key positions, for the mask
        self.layers = []
        for i, layer in enumerate(model.model.layers):
            if hasattr(layer, 'linear_attn'):
                state = (views[f'L{i}.conv0'], views[f'L{i}.recurrent0'])
            else:
                state = (views[f'L{i}.key'], views[f'L{i}.value'], views[f'L{i}.length'])
            self.layers.append((layer, state))
        self.taps_exact = self._taps_match(views)

    def _taps_match(self, views) -> bool:
        """
        Whether _taps gives the bits of transformers' conv update on this machine.

        A depthwise conv of one output is a K-term multiply-add per channel; oneDNN computes
        it as a chain of fused multiply-adds, which a few addcmul calls reproduce at a
        fraction of a convolution call's cost. That order is the library's choice, so it is
        checked here on random data of each layer's shape; where it differs the reference
        call runs.
        """
        g = torch.Generator(device='cpu').manual_seed(0)
        for layer, state in self.layers:
            if len(state) != 2:
                continue
            m, live = layer.linear_attn, state[0]
            if live.dtype != m.conv1d.weight.dtype or m.activation != 'silu':
                return False
            for _ in range(4):
                x = torch.randn(live.shape[:2] + (1,), generator=g).to(live)  # [1, C, 1]
                ref_state = torch.randn(live.shape, generator=g).to(live)  # [1, C, K]
                taps_state = ref_state.clone()
                ref = self.ops.causal_conv1d_update(x, ref_state, m.conv1d.weight.squeeze(1),
                                                    m.conv1d.bias, m.activation)
                out = _taps_update(x, taps_state, m.conv1d.weight, m.conv1d.bias)
                if not (torch.equal(out, ref) and torch.equal(taps_state, ref_state)):
                    return False
        return True

    @inference
    def step(self, token: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Consume token [1, 1] at position kv_len - 1; return its logits [1, V]."""
        self.position.fill_(kv_len - 1)
        h = self.embed(token)  # [1, 1, H]
        rotary = self.rotary(h, self.position)
        window = min(-(-kv_len // WINDOW_QUANTUM) * WINDOW_QUANTUM, self.max_len)
        mask = (self.slots[:window] < kv_len).view(1, 1, 1, window)  # [1, 1, 1, W] bool
        for layer, state in self.layers:
            x = layer.input_layernorm(h)
            if len(state) == 2:
                x = self._gated_delta(layer.linear_attn, x, *state)
            else:
                x = self._attention(layer.self_attn, x, rotary, mask, window, *state)
            h = h + x
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h))[:, -1]  # [1, V]

    def _gated_delta(self, m, x, conv_state, recurrent_state):
        """One token through a gated DeltaNet block (the seq_len-1 branch of its forward)."""
        if hasattr(m, 'in_proj_qkvz'):  # Qwen3-Next: q, k, v, z interleaved per key head
            q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x), m.in_proj_ba(x))
            q, k, v = (t.reshape(1, 1, -1) for t in (q, k, v))
            qkv = torch.cat((q, k, v), dim=-1)  # [1, 1, C]
        else:  # Qwen3.5: separate projections
            qkv = m.in_proj_qkv(x)  # [1, 1, C]
            z = m.in_proj_z(x).reshape(1, 1, -1, m.head_v_dim)
            b, a = m.in_proj_b(x), m.in_proj_a(x)
        qkv = self._conv(m, qkv.transpose(1, 2), conv_state).transpose(1, 2)  # [1, 1, C]
        q, k, v = torch.split(qkv, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q = q.reshape(1, 1, -1, m.head_k_dim)  # [1, 1, Hk, Dk]
        k = k.reshape(1, 1, -1, m.head_k_dim)
        v = v.reshape(1, 1, -1, m.head_v_dim)  # [1, 1, Hv, Dv]
        beta = b.sigmoid()
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        out, new_state = self.ops.torch_recurrent_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=recurrent_state, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        recurrent_state.copy_(new_state)
        out = m.norm(out.reshape(-1, out.shape[-1]), z.reshape(-1, z.shape[-1]))
        return m.out_proj(out.reshape(1, 1, -1))  # [1, 1, H]

    def _conv(self, m, x, conv_state):
        """Shift one token into the conv state; return its conv output [1, C, 1]."""
        if not self.taps_exact:
            return self.ops.causal_conv1d_update(x, conv_state, m.conv1d.weight.squeeze(1),
                                                 m.conv1d.bias, m.activation)
        return _taps_update(x, conv_state, m.conv1d.weight, m.conv1d.bias)

    def _attention(self, m, x, rotary, mask, window, keys, values, length):
        """One token through a gated attention block, its KV row written at the position."""
        d = m.head_dim
        q, gate = torch.chunk(m.q_proj(x).view(1, 1, -1, d * 2), 2, dim=-1)
        gate = gate.reshape(1, 1, -1)
        q = m.q_norm(q.view(1, 1, -1, d)).transpose(1, 2)  # [1, Hq, 1, D]
        k = m.k_norm(m.k_proj(x).view(1, 1, -1, d)).transpose(1, 2)  # [1, Hkv, 1, D]
        v = m.v_proj(x).view(1, 1, -1, d).transpose(1, 2)
        q, k = self.ops.apply_rotary_pos_emb(q, k, *rotary)
        at = self.position[0]  # [1]
        length.add_(1)
        keys.index_copy_(2, at, k)
        values.index_copy_(2, at, v)
        groups = m.num_key_value_groups
        # Queries packed per KV head: attention reads the buffer once, not once per head.
        q = q.reshape(1, q.shape[1] // groups, groups, d)  # [1, Hkv, G, D]
        out = F.scaled_dot_product_attention(q, keys[:, :, :window], values[:, :, :window],
                                             attn_mask=mask, dropout_p=0.0, scale=m.scaling)
        out = out.reshape(1, -1, 1, d).transpose(1, 2).contiguous()  # [1, 1, Hq, D]
        out = out.reshape(1, 1, -1).contiguous() * torch.sigmoid(gate)
        return m.o_proj(out)  # [1, 1, H]
