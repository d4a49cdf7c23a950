"""The runner's preallocated KV cache: one tensor of slots, and the per-forward view transformers writes to.

    kv [2, num_layers, num_slots, num_kv_heads, max_rows, head_dim]

Each request owns one slot for its lifetime. Rows a packed step reads but no request wrote (past a short
request's own rows) are masked out, but a masked NaN still poisons attention (0 x NaN), so rows are
zeroed once, the first time a step reads them (``ensure_finite``); after that they only ever hold finite
values written by some request. A slot's rows ``[0, length)`` hold the committed context
(minus the root token, whose KV is computed by the next step). A forward pass writes the step's rows at
``length .. length + Q`` and attention reads ``[0, max(length) + Q)``. ``max_rows`` is the context limit
plus headroom for one step's padded rows, so a packed step never writes out of bounds.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class KVPool:
    """The preallocated cache of every slot; ``torch.empty``, so untouched pages cost no memory."""

    def __init__(self, config, *, num_slots: int, max_rows: int, dtype: torch.dtype, device) -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = text.num_attention_heads
        self.num_layers = text.num_hidden_layers
        self.num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        self.num_slots = num_slots
        self.max_rows = max_rows
        shape = (2, self.num_layers, num_slots, self.num_kv_heads, max_rows, self.head_dim)
        self.kv = torch.empty(shape, dtype=dtype, device=device)
        self._finite_rows = [0] * num_slots  # rows [0, n) of each slot hold finite values

    def ensure_finite(self, slots: list[int], num_rows: int) -> None:
        """Zero each slot's never-written rows below ``num_rows`` (each row at most once per pool)."""
        for slot in slots:
            start = self._finite_rows[slot]
            if start < num_rows:
                self.kv[:, :, slot, :, start:num_rows] = 0
                self._finite_rows[slot] = num_rows

    def mark_written(self, slot: int, num_rows: int) -> None:
        """Rows ``[0, num_rows)`` of ``slot`` were written by a copy (the prefix cache): finite now."""
        self._finite_rows[slot] = max(self._finite_rows[slot], num_rows)

    @property
    def bytes_per_row(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv.element_size()

    def slot_view(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one slot's first ``length`` rows, per layer: ``[num_layers, H, length, D]``."""
        return self.kv[0, :, slot, :, :length], self.kv[1, :, slot, :, :length]


class StepCache(Cache):
    """A transformers ``Cache`` over the pool for one forward pass.

    ``update`` writes the new keys/values of every request at its own rows, then returns, per request,
    the first ``kv_len`` rows of its slot: ``[B, H, kv_len, D]`` (a view for one request or consecutive
    slots, a gather otherwise). Masking of what each row may see is the attention's business.
    """

    def __init__(self, pool: KVPool, slots: torch.Tensor, write_positions: torch.Tensor, kv_len: int) -> None:
        super().__init__(layers=[])
        self.pool = pool
        self.slots = slots  # [B] long
        self.write_positions = write_positions  # [B, Q] long
        self.kv_len = kv_len
        first = int(slots[0])
        n = len(slots)
        consecutive = bool(torch.equal(slots, torch.arange(first, first + n, device=slots.device)))
        self._slice = slice(first, first + n) if consecutive else None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        keys = self.pool.kv[0, layer_idx]  # [S, H, R, D]
        values = self.pool.kv[1, layer_idx]
        rows = self.slots[:, None]  # [B, 1] broadcast against [B, Q]
        keys[rows, :, self.write_positions] = key_states.transpose(1, 2).to(keys.dtype)  # [B, Q, H, D]
        values[rows, :, self.write_positions] = value_states.transpose(1, 2).to(values.dtype)
        if self._slice is not None:
            return keys[self._slice, :, : self.kv_len], values[self._slice, :, : self.kv_len]
        return keys[:, :, : self.kv_len].index_select(0, self.slots), values[
            :, :, : self.kv_len
        ].index_select(0, self.slots)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.pool.max_rows
