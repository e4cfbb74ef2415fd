"""Group layout of the Torch codec (mirrors kvq_jax.codecs._grouping).

axis "tokens":   a group is G consecutive token rows of one (head, channel);
                 metadata shape [ceil(T/G), H, D]; grouped view [nG, G, H, D].
axis "channels": a group is G consecutive channels of one (token, head);
                 metadata shape [T, H, ceil(D/G)]; grouped view [T, H, nG, G].

The last group may be partial: `reduce` computes per-group statistics over the complete groups
(a reshaped view) and over the partial last group (its own slice) separately, so no padding
ever enters a statistic; `expand` broadcasts them back to the elements, and every element-wise
step runs on [T, H, D] directly. kvq_jax instead pads and crops; the bytes are the same. (The
padded formulation is miscompiled by torch.compile's inductor in torch 2.13 on CPU, which
reads garbage for the partial group; so is `repeat_interleave` + slice, see `expand`.)
"""

from __future__ import annotations

import torch

from kvq_jax.core.groups import GroupGeometry


class GroupLayout(GroupGeometry):
    """`GroupGeometry` with the Torch operations: per-group reductions, broadcast back."""

    def reduce(self, reducer, x: torch.Tensor) -> torch.Tensor:
        """`reducer(tensor, dim=..., keepdim=...)` over each group of `x` [T, H, D] (e.g.
        torch.amax, torch.all); returns [metadata_shape]. The complete groups are reduced on
        a reshaped view, a partial last group on its own slice (nothing is padded)."""
        t, h, d = self.shape
        g, dim = self.group_size, self.dim
        complete = self.length // g
        parts = []
        if complete or not self.padding:  # (also the empty T = 0 case: zero groups)
            body = x.narrow(dim, 0, complete * g)
            if dim == 0:
                grouped = body.reshape(complete, g, h, d)
            else:
                grouped = body.reshape(t, h, complete, g)
            parts.append(reducer(grouped, dim=self.member_axis))
        if self.padding:
            tail = x.narrow(dim, complete * g, self.length - complete * g)
            parts.append(reducer(tail, dim=dim, keepdim=True))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def expand(self, meta: torch.Tensor) -> torch.Tensor:
        """Per-group values [metadata_shape] -> per-element values [T, H, D].

        A gather by group index (element // G). (`repeat_interleave` or expand-reshape-narrow
        give the same values in eager mode but are miscompiled by inductor for a partial last
        group on the channel axis, torch 2.13.)
        """
        group_of = torch.arange(self.length, device=meta.device) // self.group_size
        return meta.index_select(self.dim, group_of)
