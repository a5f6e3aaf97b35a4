"""
Engine: prefill and the decode step over arena-bound state, plus the sampler.

On CUDA the decode step is captured once in a CUDA graph: its inputs (the token buffer),
its state (the arena) and its output (the arena's logits view) all have fixed addresses,
so one `replay()` runs a whole step with a single launch. Restores copy INTO the arena,
never re-bind it, so the graph stays valid across snapshot/restore/rollback. On CPU the
same step runs eagerly over the same buffers.
"""

from __future__ import annotations

import torch

from .models.base import CausalLMAdapter

PREFILL_CHUNK = 2048  # tokens per prefill forward: bounds activation memory for long prompts
WARMUP_STEPS = 3  # eager steps on a side stream before capture (lazy inits, allocator)


class Engine:
    """Runs a causal-LM adapter over its bound state and writes last logits into the arena."""

    def __init__(self, adapter: CausalLMAdapter, logits: torch.Tensor, cuda_graphs: bool):
        self.adapter = adapter
        self.logits = logits  # [V] fp32 arena view: the output of every step
        self.device = logits.device
        self.token = torch.zeros(
            (1, 1), dtype=torch.long, device=self.device
        )  # static decode input
        self.cuda_graphs = cuda_graphs and self.device.type == 'cuda'
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_error: str | None = None
        if self.cuda_graphs and getattr(adapter, 'has_sliding_layers', False):
            # Sliding-window layers branch in Python on a host-side counter; a graph would
            # freeze one branch. Run them eagerly rather than risk a wrong step.
            self.cuda_graphs = False
            self.graph_error = 'disabled: sliding-window layers branch on host state'

    @torch.no_grad()
    def prefill(self, ids: list[int], position: int) -> None:
        """Consume ids at `position` (chunked); leaves the next-token logits in the arena."""
        t = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, T]
        for start in range(0, t.shape[1], PREFILL_CHUNK):
            chunk = t[:, start:start + PREFILL_CHUNK]  # [1, <=C]
            out = self.adapter.forward(chunk, kv_len=position + start + chunk.shape[1])  # [1, V]
        self.logits.copy_(out[0])

    @torch.no_grad()
    def _step(self, kv_len: int | None = None) -> None:
        self.logits.copy_(self.adapter.forward(self.token, kv_len)[0])  # [V], cast to fp32

    @torch.no_grad()
    def decode(self, token: int, position: int) -> None:
        """Consume one token at `position`; replays the captured graph when it applies."""
        self.token.fill_(token)
        if self.graph is not None and self.adapter.decode_ready():
            self.graph.replay()
        else:
            self._step(kv_len=position + 1)

    @torch.no_grad()
    def capture(self) -> bool:
        """
        Capture the decode step in a CUDA graph.

        The caller saves and restores the state around this call: warm-up and capture both
        advance it.
        """
        if not self.cuda_graphs or self.graph is not None:
            return self.graph is not None
        self.adapter.prepare_capture()
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_STEPS):
                    self._step()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._step()
            torch.cuda.synchronize(self.device)
            self.graph, self.graph_error = graph, None
        except Exception as exc:  # e.g. a host sync inside the model: stay eager, say why
            self.graph, self.graph_error = None, f'capture failed, running eager: {exc!r}'[:500]
            try:
                torch.cuda.synchronize(self.device)
            except Exception:
                pass
        return self.graph is not None

    def drop_graph(self) -> None:
        self.graph = None

    @torch.no_grad()
    def sample(
        self, temperature: float, top_k: int, top_p: float, generator: torch.Generator
    ) -> int:
        """Pick the next token: argmax when temperature <= 0, else top-k/top-p sampling."""
        if temperature <= 0.0:
            return int(torch.argmax(self.logits))
        x = self.logits / temperature  # [V]
        if 0 < top_k < x.shape[0]:
            kth = torch.topk(x, top_k).values[-1]
            x = x.masked_fill(x < kth, float('-inf'))
        if top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)  # [V]
            probs = torch.softmax(sorted_x, dim=-1)
            # Drop a token once the mass before it exceeds top_p (the best one always stays).
            drop = (torch.cumsum(probs, dim=-1) - probs) > top_p
            x = x.scatter(0, order[drop], float('-inf'))
        probs = torch.softmax(x, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))
