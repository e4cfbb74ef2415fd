"""Group layout: which elements of a [T, H, D] tensor share one set of quantization metadata.

axis "tokens":   a group is G consecutive token rows of one (head, channel);
                 metadata shape [ceil(T/G), H, D]; grouped view [nG, G, H, D].
axis "channels": a group is G consecutive channels of one (token, head);
                 metadata shape [T, H, ceil(D/G)]; grouped view [T, H, nG, G].

The last group may be partial (`kvq_jax.core.groups` has the geometry). `split` pads it with a
caller-chosen fill value (an identity of the reduction, so padding never enters a statistic)
and `merge` crops the padding away. `split_edge` pads with copies of the last real member
instead: min, max and "all finite" of a group are unchanged by it, in any dtype.
"""

from __future__ import annotations

import jax.numpy as jnp

from kvq_jax.core.groups import GroupGeometry


class GroupLayout(GroupGeometry):
    """`GroupGeometry` with the JAX operations: pad-and-reshape into groups, crop back."""

    def split(self, x: jnp.ndarray, fill) -> jnp.ndarray:
        """[T, H, D] -> grouped view; the missing members of a partial group hold `fill`."""
        t, h, d = self.shape
        g = self.group_size
        pad = self.padding
        if self.axis == "tokens":
            if pad:
                x = jnp.pad(x, [(0, pad), (0, 0), (0, 0)], constant_values=fill)
            return x.reshape(self.num_groups, g, h, d)
        if pad:
            x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)], constant_values=fill)
        return x.reshape(t, h, self.num_groups, g)

    def split_edge(self, x: jnp.ndarray) -> jnp.ndarray:
        """[T, H, D] -> grouped view; a partial group repeats its last member (any dtype)."""
        if self.padding:
            widths = [(0, 0)] * 3
            widths[self.dim] = (0, self.padding)
            x = jnp.pad(x, widths, mode="edge")
        return GroupLayout(x.shape, self.axis, self.group_size).split(x, 0)

    def merge(self, xg: jnp.ndarray) -> jnp.ndarray:
        """Grouped view -> [T, H, D], dropping the padding of a partial last group."""
        t, h, d = self.shape
        n = self.num_groups * self.group_size
        if self.axis == "tokens":
            return xg.reshape(n, h, d)[:t]
        return xg.reshape(t, h, n)[..., :d]

    def expand(self, meta: jnp.ndarray) -> jnp.ndarray:
        """Metadata [metadata_shape] -> broadcastable against the grouped view."""
        return jnp.expand_dims(meta, self.member_axis)
