"""The Torch codec stack: kvq_jax.codecs' API and bytes in Torch (imports no JAX)."""
