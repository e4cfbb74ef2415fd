"""The KV codecs the attention hook calls: kvq's Torch codec in-process, or the jitted JAX
codec reached through the DLPack bridge. Both code one [T, H, D] tensor per call with the
semantics of `encode_loops`: loop 0 packed whole in the base format, loop l >= 1 a residual
against the reconstructed loop l - 1 in that loop's format (`Policy.stream`: K and V may
differ, and so may the loops), or packed on its own where the policy stores loop l absolute,
the policy's BF16 window kept raw in every loop.
"""

from __future__ import annotations

import functools
import warnings

import torch

from kvq_jax.core.policies import Policy
from kvq_torch_bridge.codecs.api import pack_kv, unpack_kv
from kvq_torch_bridge.codecs.residual import decode_residual, encode_residual

CODECS = ("torch", "jax")


class TorchLoopCoder:
    """kvq_torch_bridge's codec, on the tensors' own device."""

    name = "torch"

    @staticmethod
    def register_intb(table) -> str:
        """Register the INTB format of bit table `table` in the Torch registry (once);
        returns its name."""
        from kvq_torch_bridge.codecs.formats.intb import register_table

        return register_table(table)

    def base(self, x: torch.Tensor, policy: Policy, kind: str) -> torch.Tensor:
        fmt, group = policy.stream(kind, 0)
        packed = pack_kv(x, kind=kind, format=fmt, group_size=group, window=policy.window)
        return unpack_kv(packed)

    def residual(
        self, x: torch.Tensor, previous: torch.Tensor, policy: Policy, kind: str, loop: int = 1
    ) -> torch.Tensor:
        fmt, group = policy.stream(kind, loop)
        code = encode_residual(
            x,
            previous,
            kind=kind,
            format=fmt,
            group_size=group,
            window=policy.window,
            absolute=loop in policy.absolute_loops(kind, loop + 1),
        )
        return decode_residual(code, previous)

    def heavy(self, k: torch.Tensor, v: torch.Tensor, policy: Policy, table):
        """(k_hat, v_hat) of one loop of a heavy-row policy (one layer's): every loop whole,
        with its own rows (`kvq_torch_bridge.codecs.heavy.heavy_kv`). table: bfloat16 [H, R, D]."""
        from kvq_torch_bridge.codecs.heavy import heavy_kv

        k_hat, v_hat, _, _ = heavy_kv(
            k,
            v,
            table.to(k.device),
            key_format=policy.base_format,
            value_format=policy.formats("value")[0],
            group_size=policy.heavy,
            window=policy.window,
            rope=_rope(policy, k, lambda a: torch.from_numpy(a).to(k.device)),
        )
        return k_hat, v_hat


class JaxLoopCoder:
    """kvq_jax's jitted codec; tensors cross by DLPack (`torch_to_jax` / `jax_to_torch`).

    JAX is imported on first use (`--codec jax`), so the Torch report runs without it.
    """

    name = "jax"

    @staticmethod
    def register_intb(table) -> str:
        """Register the INTB format of bit table `table` in the JAX registry (once); returns
        its name."""
        from kvq_jax.codecs.formats.intb import register_table

        return register_table(table)

    @staticmethod
    def _to_jax(x: torch.Tensor):
        from kvq_torch_bridge.bridge.dlpack import CopyWarning, torch_to_jax

        with warnings.catch_warnings():
            # XLA:CPU needs 64-byte-aligned buffers: an unaligned tensor is copied, which is
            # expected here (the values are what matter, not the sharing).
            warnings.simplefilter("ignore", CopyWarning)
            return torch_to_jax(x.contiguous())

    @staticmethod
    def _to_torch(a) -> torch.Tensor:
        from kvq_torch_bridge.bridge.dlpack import jax_to_torch

        return jax_to_torch(a)

    def base(self, x: torch.Tensor, policy: Policy, kind: str) -> torch.Tensor:
        import kvq_jax

        fmt, group = policy.stream(kind, 0)
        packed = kvq_jax.pack_kv(
            self._to_jax(x), kind=kind, format=fmt, group_size=group, window=policy.window
        )
        return self._to_torch(kvq_jax.unpack_kv(packed))

    def residual(
        self, x: torch.Tensor, previous: torch.Tensor, policy: Policy, kind: str, loop: int = 1
    ) -> torch.Tensor:
        import kvq_jax

        fmt, group = policy.stream(kind, loop)
        prev = self._to_jax(previous)
        code = kvq_jax.encode_residual(
            self._to_jax(x),
            prev,
            kind=kind,
            format=fmt,
            group_size=group,
            window=policy.window,
            absolute=loop in policy.absolute_loops(kind, loop + 1),
        )
        return self._to_torch(kvq_jax.decode_residual(code, prev))

    def heavy(self, k: torch.Tensor, v: torch.Tensor, policy: Policy, table):
        """`TorchLoopCoder.heavy` through kvq_jax (`kvq_jax.codecs.heavy.heavy_kv`, jitted)."""
        import jax.numpy as jnp

        k_hat, v_hat = _jax_heavy(
            self._to_jax(k),
            self._to_jax(v),
            self._to_jax(table),
            _rope(policy, k, jnp.asarray),
            key_format=policy.base_format,
            value_format=policy.formats("value")[0],
            group_size=policy.heavy,
            window=policy.window,
        )
        return self._to_torch(k_hat), self._to_torch(v_hat)


@functools.cache
def _jax_heavy_fn():
    import jax

    from kvq_jax.codecs.heavy import heavy_kv

    def fn(k, v, table, rope, *, key_format, value_format, group_size, window):
        k_hat, v_hat, _, _ = heavy_kv(
            k,
            v,
            table,
            key_format=key_format,
            value_format=value_format,
            group_size=group_size,
            window=window,
            rope=rope,
        )
        return k_hat, v_hat

    return jax.jit(fn, static_argnames=("key_format", "value_format", "group_size", "window"))


def _jax_heavy(k, v, table, rope, **static):
    return _jax_heavy_fn()(k, v, table, rope, **static)


def _rope(policy: Policy, k: torch.Tensor, convert):
    """(cos, sin) of positions 0 .. T-1 for a pre-RoPE policy's keys [T, H, D], else None."""
    if policy.rope_theta is None:
        return None
    from kvq_jax.core.rope import rope_tables

    return tuple(convert(a) for a in rope_tables(k.shape[0], k.shape[2], policy.rope_theta))


def get_loop_coder(name: str):
    """ "torch" or "jax" -> a coder object with `base` and `residual`."""
    if name == "torch":
        return TorchLoopCoder()
    if name == "jax":
        return JaxLoopCoder()
    raise ValueError(f"codec must be one of {CODECS}, got {name!r}")
