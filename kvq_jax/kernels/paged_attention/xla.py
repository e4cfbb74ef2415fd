"""The XLA reference of quantized paged decode attention (what the kernel is held to).

`kvq_jax.paged_attention.xla_paged_decode_attention`: every sequence's K and V are
reconstructed (`gather_batch`: quantized pages through the residual chain up to `loop`,
staging rows for the partial page, raw sink rows, rows >= seq_len zeroed), then
`dense_decode_attention` in float32 at HIGHEST precision. `paged_decode_attention_jit` is
the jitted public function (call it with backend="xla").
"""

from __future__ import annotations

from kvq_jax.paged_attention import paged_decode_attention as paged_decode_attention_jit
from kvq_jax.paged_attention import xla_paged_decode_attention as paged_decode_attention

__all__ = ["paged_decode_attention", "paged_decode_attention_jit"]
