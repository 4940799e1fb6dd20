"""A tiny decoder-only transformer with dummy, seeded weights that really reads and writes KV slots.

It stands in for SGLang's model runner (``srt/model_executor/model_runner.py``) and attention
backends: every forward writes the K/V of the new tokens into the pool slots it is given, and
attends over the slots of the request's context. Wrong slot bookkeeping therefore changes the
tokens it produces, as it would in a real engine. ``model="none"`` replaces it by
:func:`pseudo_next_token`, with identical memory behaviour.
"""

from __future__ import annotations

import torch

NUM_LAYERS = 2
NUM_HEADS = 2
HEAD_DIM = 8
HIDDEN = NUM_HEADS * HEAD_DIM


def pseudo_next_token(last_token: int, position: int, vocab_size: int) -> int:
    """Deterministic stand-in for sampling when no model runs (``model="none"``)."""
    return (last_token * 31 + position * 7 + 3) % (vocab_size - 2) + 2


class TinyModel:
    """Two layers, two heads, head_dim 8; weights from ``torch.Generator().manual_seed(seed)``."""

    def __init__(self, vocab_size: int, max_positions: int, seed: int = 0, device: str = "cpu"):
        g = torch.Generator().manual_seed(seed)

        def w(*shape):
            return (torch.randn(*shape, generator=g) / shape[0] ** 0.5).to(device)

        self.embed = w(vocab_size, HIDDEN)
        self.pos = w(max_positions, HIDDEN)
        self.layers = [
            {"qkv": w(HIDDEN, 3 * HIDDEN), "o": w(HIDDEN, HIDDEN), "up": w(HIDDEN, 4 * HIDDEN),
             "down": w(4 * HIDDEN, HIDDEN)}
            for _ in range(NUM_LAYERS)
        ]
        self.device = device

    @torch.no_grad()
    def forward(self, kv_pool, tokens: torch.Tensor, positions: torch.Tensor, write_loc: torch.Tensor,
                ctx_loc: torch.Tensor, ctx_pos: torch.Tensor) -> int:
        """Run one request's new tokens and return the greedy next token.

        ``tokens``, ``positions``, ``write_loc``: ``[n] int64`` (new tokens, their positions and the
        slots that receive their K/V). ``ctx_loc``, ``ctx_pos``: ``[m] int64``, the slots and positions
        of every token attended to, including the new ones. ``kv_pool`` has ``set_kv``/``get_kv``.
        """
        x = self.embed[tokens] + self.pos[positions]
        mask = ctx_pos[None, :] <= positions[:, None]  # [n, m] causal by position
        for i, lw in enumerate(self.layers):
            h = torch.nn.functional.layer_norm(x, (HIDDEN,))
            q, k, v = (h @ lw["qkv"]).split(HIDDEN, dim=-1)
            kv_pool.set_kv(i, write_loc, k.view(-1, NUM_HEADS, HEAD_DIM), v.view(-1, NUM_HEADS, HEAD_DIM))
            K, V = kv_pool.get_kv(i, ctx_loc)  # [m, heads, dim]
            s = torch.einsum("nhd,mhd->hnm", q.view(-1, NUM_HEADS, HEAD_DIM), K) / HEAD_DIM ** 0.5
            s = s.masked_fill(~mask[None], float("-inf"))
            a = torch.einsum("hnm,mhd->nhd", s.softmax(-1), V).reshape(-1, HIDDEN)
            x = x + a @ lw["o"]
            x = x + torch.relu(torch.nn.functional.layer_norm(x, (HIDDEN,)) @ lw["up"]) @ lw["down"]
        logits = torch.nn.functional.layer_norm(x[-1], (HIDDEN,)) @ self.embed.T
        logits[:2] = float("-inf")  # 0 is padding, 1 is EOS: sampled only through stop_at
        return int(logits.argmax())
