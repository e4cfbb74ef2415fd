"""Group geometry: which elements of a [T, H, D] tensor share one set of quantization metadata.

axis "tokens":   a group is G consecutive token rows of one (head, channel);
                 metadata shape [ceil(T/G), H, D]; grouped view [nG, G, H, D].
axis "channels": a group is G consecutive channels of one (token, head);
                 metadata shape [T, H, ceil(D/G)]; grouped view [T, H, nG, G].

The last group may be partial. Each stack's `GroupLayout` adds its array operations to this
shared, shape-only description.
"""

from __future__ import annotations

import dataclasses

from kvq_jax.core.constants import metadata_shape, num_groups


@dataclasses.dataclass(frozen=True)
class GroupGeometry:
    """Static description of the groups of a [T, H, D] tensor."""

    shape: tuple[int, int, int]
    axis: str
    group_size: int

    @property
    def metadata_shape(self) -> tuple[int, ...]:
        return metadata_shape(self.shape, self.axis, self.group_size)

    @property
    def dim(self) -> int:
        """Axis of [T, H, D] along which groups run."""
        return 0 if self.axis == "tokens" else 2

    @property
    def length(self) -> int:
        """Elements along the grouping axis."""
        return self.shape[self.dim]

    @property
    def num_groups(self) -> int:
        return num_groups(self.length, self.group_size)

    @property
    def padding(self) -> int:
        """Missing members of a partial last group."""
        return self.num_groups * self.group_size - self.length

    @property
    def member_axis(self) -> int:
        """Axis of the grouped view that runs over the members of one group."""
        return 1 if self.axis == "tokens" else 3
