"""The zero-copy DLPack bridge between the Torch and JAX stacks (`dlpack`); imports JAX."""

from kvq_torch_bridge.bridge.dlpack import (
    CopyWarning,
    from_torch,
    jax_to_torch,
    to_torch,
    torch_to_jax,
)

__all__ = ["CopyWarning", "from_torch", "jax_to_torch", "to_torch", "torch_to_jax"]
