"""
The multi-token-prediction (MTP) head of Qwen3-Next / Qwen3.5 checkpoints, named as they ship it.

transformers drops the `mtp.*` weights at load, so this module rebuilds the head from the main
model's config and reads those weights itself. The head predicts token i+2 from the main
model's post-final-norm hidden h_i and the embedding of token i+1:

    x = fc([pre_fc_norm_embedding(embed(t_{i+1})); pre_fc_norm_hidden(h_i)])   2H -> H
    x = layers[0](x)            one full-attention decoder layer of the family, at position i+1
    logits = lm_head(norm(x))   embedding and lm_head shared with the main model
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import torch
from torch import nn

PREFIX = 'mtp.'
# model_type -> (decoder layer class, RMSNorm class) in the family's modeling module
FAMILIES = {
    'qwen3_next': ('Qwen3NextDecoderLayer', 'Qwen3NextRMSNorm'),
    'qwen3_5_text': ('Qwen3_5DecoderLayer', 'Qwen3_5RMSNorm'),
    'qwen3_5': ('Qwen3_5DecoderLayer', 'Qwen3_5RMSNorm'),
}


def _layer_config(config):
    """Return the main config re-shaped for the head's single full-attention layer."""
    mtp = copy.deepcopy(config)
    mtp.num_hidden_layers = 1
    mtp.layer_types = ['full_attention']
    if hasattr(mtp, 'mlp_only_layers'):
        # Dense when the main model is dense; a MoE checkpoint's head is MoE like its layers.
        dense = (getattr(config, 'num_experts', 0) == 0
                 or set(range(config.num_hidden_layers)) <= set(config.mlp_only_layers))
        mtp.mlp_only_layers = [0] if dense else []
    return mtp


class MTPHead(nn.Module):
    """One MTP depth; `forward` returns the post-norm hidden (apply the shared lm_head to it)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        config = model.config
        if config.model_type not in FAMILIES:
            raise ValueError(f'no MTP head for model_type {config.model_type!r} '
                             f'(known: {", ".join(sorted(FAMILIES))})')
        modeling = importlib.import_module(type(model).__module__)
        layer_cls, norm_cls = (getattr(modeling, n) for n in FAMILIES[config.model_type])
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.config = _layer_config(config)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([layer_cls(self.config, 0)])
        self.norm = norm_cls(hidden, eps=eps)

    def forward(self, embeds, hidden, position_embeddings, attention_mask=None, cache=None,
                **kwargs) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds),
                               self.pre_fc_norm_hidden(hidden)], dim=-1))
        x = self.layers[0](x, position_embeddings=position_embeddings,
                           attention_mask=attention_mask, cache=cache, **kwargs)
        return self.norm(x)


def sequence_logits(model: nn.Module, head: MTPHead, input_ids: torch.Tensor):
    """
    Return main and MTP logits over whole sequences, without a cache (training, reference checks).

    Returns (main [B, T, V] predicting t_{i+1}, mtp [B, T-1, V] predicting t_{i+2} at row i).
    """
    from transformers.masking_utils import create_causal_mask

    inner = model.model
    hidden = inner(input_ids=input_ids).last_hidden_state
    embeds = inner.embed_tokens(input_ids[:, 1:])
    positions = torch.arange(1, input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    mask = create_causal_mask(config=head.config, inputs_embeds=embeds, attention_mask=None,
                              cache=None, position_ids=positions)
    rotary = inner.rotary_emb(embeds, positions)
    mtp_hidden = head(embeds, hidden[:, :-1], rotary, attention_mask=mask, position_ids=positions)
    return model.lm_head(hidden), model.lm_head(mtp_hidden)


def checkpoint_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Return the `mtp.*` tensors of a local safetensors checkpoint, prefix stripped (or {})."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / 'model.safetensors.index.json'
    if index.is_file():
        weight_map = json.loads(index.read_text())['weight_map']
        files = sorted({f for k, f in weight_map.items() if k.startswith(PREFIX)})
    else:
        files = [p.name for p in sorted(directory.glob('*.safetensors'))]
    tensors = {}
    for name in files:
        with safe_open(str(directory / name), framework='pt') as f:
            for key in f.keys():
                if key.startswith(PREFIX):
                    tensors[key[len(PREFIX):]] = f.get_tensor(key)
    return tensors


def load_head(model: nn.Module, directory: str | Path) -> MTPHead | None:
    """Return the checkpoint's MTP head on the model's device and dtype (None if it has none)."""
    tensors = checkpoint_tensors(directory)
    if not tensors or model.config.model_type not in FAMILIES:
        return None
    param = next(model.parameters())
    head = MTPHead(model)
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f'MTP weights in {directory} do not match the head: missing '
                         f'{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}')
    return head.to(device=param.device, dtype=param.dtype).eval()


def seeded_head(model: nn.Module, seed: int, std: float) -> MTPHead:
    """Return a random head from a private RNG (built-ins and tests)."""
    param = next(model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = MTPHead(model)
        for p in head.parameters():
            nn.init.normal_(p, std=std) if p.dim() > 1 else nn.init.zeros_(p)
    return head.to(device=param.device, dtype=param.dtype).eval()
