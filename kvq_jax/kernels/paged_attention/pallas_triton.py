"""The fused kernel: decode attention over the quantized paged cache, K/V dequantized in registers.

Grid (B, H, num_splits): one program per (sequence, KV head, split of the sequence's pages).
A program holds the G = Hq / H query heads of its KV head ([Gp, D] float32, zero rows padding
G to Gp) and walks logical pages [split * pps, (split + 1) * pps) of its sequence, clipped to
the attended pages ceil(seq_len / page_size):

  - a page complete in the cache (page i with (i + 1) * page_size <= stored length): its
    physical id is a scalar load from the block table; the K and V tiles [page_size, D] of
    its KV head are dequantized (`_tile_decode.decode_tile`, bit-exact with the codecs),
    rounded to the cache dtype and taken through the loop's chain
    (`_tile_decode.reconstruct_tile`: from loop 0 or the last absolute loop at or before
    `loop`, per-loop formats, each delta added with the rounding of `decode_residual`; an
    adaptive-exit cache's chain from loop 0, each row kept at its exit loop by the page's
    depth map), so the values attended are exactly `gather_batch`'s; HINT values stay in the
    rotated space (the output is un-rotated once, as the XLA path does);
    Heavy-row pages (FORMAT.md 5a) decode their payload rows straight into the page's rows
    and put the INT8 heavy rows in (`_tile_decode.load_heavy_tile`); over HINT values the
    heavy rows, plain, go to a second accumulator that is added after the un-rotation.
    Keys stored before RoPE (`rope_theta`) get RoPE back on the reconstructed page: the
    halves x_lo, x_hi of each row turn by the page's float32 cos / sin (binary64 tables of
    `cache_state.key_rope`, program constants: no cosines per call), x_lo cos - x_hi sin
    and x_hi cos + x_lo sin in float32 (never fused), rounded to the cache dtype (the
    reference rounds the binary64 result: the keys agree but for rare last-place ties); scores
    are then taken on the halves;
  - the partial page (i == stored // page_size) comes from the staging rows (raw, cache dtype;
    rotated float32 for HINT values);
  - positions < sink come from the raw sink rows (padded to whole pages outside the kernel;
    rotated float32 for HINT values);
  - positions >= seq_len are masked (score -inf, V row 0).

Scores are q k^T / sqrt(D) in float32: `pltriton.dot` (HIGHEST precision, rows padded to 16) for
G >= 8, a broadcast multiply-sum for smaller groups (Ouro: G = 1). The online softmax keeps a
running max m, sum l and accumulator acc per query row (float32); each split writes (acc, m, l)
and `combine` merges the splits (log-sum-exp weights, XLA). Dequantized K/V never leave
registers. On Triton every block shape is a power of two (page_size, D, the metadata tiles);
`api.config_support` rejects other configurations.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kvq_jax.codecs import cache_state
from kvq_jax.codecs.formats.hadamard import rotate, unrotate
from kvq_jax.core import registry
from kvq_jax.kernels import _exact, _tile_decode
from kvq_jax.kernels import launch as _launch
from kvq_jax.kernels._tile_decode import chain_steps, reconstruct_tile, rotated_format

#: Query heads per KV head from which scores use pltriton.dot (Triton dots need M, N, K >= 16).
DOT_MIN_GROUP = _launch.DOT_MIN_GROUP
_HIGHEST = lax.Precision.HIGHEST


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def query_rows(group: int) -> tuple[int, bool]:
    """(rows Gp of a program's query block, whether scores use pltriton.dot) for G query heads."""
    if group >= DOT_MIN_GROUP:
        return max(16, _next_pow2(group)), True
    return _next_pow2(group), False


#: uint8 arrays of at least this many bytes go to the kernel as uint16 pairs (see `_widen`).
WIDE_INDEX_BYTES = 2**31


def _widen(a):
    """uint8 [..., 2n] -> uint16 [..., n] (byte 2j low, 2j + 1 high; a bitcast in XLA).

    Pallas' Triton lowering indexes arrays of at most 2**32 bytes with int32 element offsets,
    which wrap for uint8 arrays of 2**31 bytes or more (e.g. the residual codes of a 3-plane
    32k-token x 32-sequence cache); their uint16 view has half the elements."""
    return lax.bitcast_convert_type(a.reshape(*a.shape[:-1], a.shape[-1] // 2, 2), jnp.uint16)


def _kernel_view(a):
    """A packed array as the kernel takes it: E4M3 arrays as their uint8 bits (a same-width
    bitcast, free; the tile decoder reads the bits), uint8 arrays of WIDE_INDEX_BYTES or more
    as uint16 pairs (`_widen`)."""
    if a.dtype == jnp.float8_e4m3fn:
        a = lax.bitcast_convert_type(a, jnp.uint8)
    if a.dtype == jnp.uint8 and a.size >= WIDE_INDEX_BYTES and a.ndim and a.shape[-1] % 2 == 0:
        a = _widen(a)
    return a


def _plane_arrays(packed) -> list:
    """The kernel's arrays of one packed plane (`_tile_decode.kernel_arrays`: its fields as
    `_kernel_view`s, an INTB plane's code maps)."""
    return _tile_decode.kernel_arrays(packed, _kernel_view)


def _load_tile(ref, prefix: tuple, page, head):
    """One (page, head) tile of a packed array [*prefix, P, ...] (the page axis after the
    static prefix): codes/metadata [P, rows, H, cols] -> [rows, cols]; fp8 scale [P, ps, H]
    -> [ps]; NVFP4 global scale [P] -> scalar."""
    rest = len(ref.shape) - len(prefix) - 1
    if rest == 0:
        return ref[(*prefix, page)]
    if rest == 2:
        return ref[(*prefix, page, slice(None), head)]
    tile = ref[(*prefix, page, slice(None), head, slice(None))]
    return _tile_decode.unwiden(tile) if ref.dtype == jnp.uint16 else tile


def _kernel(*refs, chains, rotated, plain_heavy, rope, stage_loop, dtype, page_size,
            pages_per_split, use_dot, sink, adaptive, interpret):  # fmt: skip
    """chains: {"key"/"value": (steps, arrays per plane)}: each kind's loop chain
    (`_tile_decode.chain_steps`) and how many refs each of its planes takes. rotated: the
    values are attended in the rotated space (their staging and sink rows come rotated,
    float32). plain_heavy: the rotated value chain starts with heavy rows, attended into a
    second accumulator (plain space). rope: keys stored before RoPE (cos / sin tables [max
    positions, D / 2] follow the sink rows). stage_loop: {kind: the loop index of the
    staging rows handed over}. adaptive: the depth map uint8 [P, page_size] follows the
    layer (adaptive exits)."""
    it = iter(refs)
    q_ref, tab_ref, lens_ref, stored_ref, sid_ref, layer_ref = (next(it) for _ in range(6))
    depth_ref = next(it) if adaptive else None
    plane_refs = {
        kind: [[next(it) for _ in range(n)] for n in chains[kind][1]] for kind in ("key", "value")
    }
    stage_refs = {"key": next(it), "value": next(it)}
    sink_refs = {"key": next(it), "value": next(it)} if sink else None
    cos_ref, sin_ref = (next(it), next(it)) if rope else (None, None)
    acc_ref, m_ref, l_ref = next(it), next(it), next(it)
    plain_ref = next(it) if plain_heavy else None

    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ps = page_size
    seq_len, stored, sid = lens_ref[b], stored_ref[b], sid_ref[b]
    q = q_ref[...].astype(jnp.float32)  # [Gp, D]
    rows, d = q.shape
    scale = jnp.float32(1.0 / math.sqrt(d))

    def reconstruct(kind, page):
        def load(fmt, plane, lead):
            refs_ = plane_refs[kind][plane]
            meta = lambda r: _load_tile(r, lead, page, h)  # noqa: E731
            if _tile_decode.heavy_layout(fmt) is not None:
                return _tile_decode.load_heavy_tile(fmt, refs_, lead, page, h, layer_ref[0], meta)
            if _tile_decode.is_intb(fmt):
                return _tile_decode.load_intb_tile(refs_, lead, page, h, layer_ref[0], meta)
            return {n: meta(r) for n, r in zip(_tile_decode.FIELDS[fmt], refs_, strict=True)}

        rot = rotated and kind == "value"
        return reconstruct_tile(chains[kind][0], load, dtype, rotated=rot,
                                depth=_tile_decode.depth_tile(depth_ref, page),
                                interpret=interpret)  # fmt: skip

    def sink_mask(i, width):
        """bool [ps, width]: the rows of logical page i that are sink rows."""
        return i * ps + lax.broadcasted_iota(jnp.int32, (ps, width), 0) < sink

    def sink_rows(kind, i, x):
        """(in_sink [ps, D], the raw sink rows there) of logical page i."""
        in_sink = sink_mask(i, d)
        # A masked load, no branch: past the sink pages every lane is masked (no memory
        # access). A lax.cond returning the tile kept both branches' tiles live: 0.5-20 KB
        # of register spills (docs/kernel_resources.md).
        ref = sink_refs[kind].at[b, pl.ds(i * ps, ps), h, :]
        return in_sink, pltriton.load(ref, mask=in_sink, other=jnp.zeros((), x.dtype))

    def with_sink(kind, i, x):
        if not sink:
            return x
        in_sink, rows_ = sink_rows(kind, i, x)
        return jnp.where(in_sink, rows_, x)

    def halves(x):
        return tuple(jnp.split(x.astype(jnp.float32), 2, axis=-1))

    def roped_keys(i, k):
        """A reconstructed key page (stored before RoPE) with RoPE back at positions
        i * ps .., then its sink rows (raw: RoPE'd as handed over), as halves."""
        c, s_ = (r[pl.ds(i * ps, ps), :] for r in (cos_ref, sin_ref))  # [ps, D / 2]
        lo, hi = halves(k)
        mul = functools.partial(_exact.multiply, interpret=interpret)
        add = functools.partial(_exact.add, interpret=interpret)
        out = (add(mul(lo, c), -mul(hi, s_)), add(mul(hi, c), mul(lo, s_)))
        out = tuple(_exact.round_to(a, dtype, interpret=interpret).astype(jnp.float32) for a in out)
        if not sink:
            return out
        _, rows_ = sink_rows("key", i, k)
        in_sink = sink_mask(i, d // 2)
        return tuple(jnp.where(in_sink, r, a) for r, a in zip(halves(rows_), out, strict=True))

    def scores(k_parts):
        """[Gp, ps] q k^T over the key parts (the whole rows, or RoPE's halves)."""
        q_all = q_ref[...].astype(jnp.float32) if use_dot else q
        q_parts = halves(q_all) if len(k_parts) == 2 else (q_all,)
        s = None
        for qp, kp in zip(q_parts, k_parts, strict=True):
            if use_dot:
                # q read again per page (an L1 hit): held across the loop in the FMA dot's
                # operand layout it took a full row of D registers per thread
                # (nvfp4-gqa8-p32-d128 spilled).
                part = pltriton.dot(qp, kp, trans_b=True, precision=_HIGHEST)  # [Gp, ps]
            else:
                part = jnp.sum(qp[:, None, :] * kp[None, :, :], axis=-1)
            s = part if s is None else s + part
        return s

    def weighted(p, v):
        if use_dot:
            return pltriton.dot(p, v, precision=_HIGHEST)  # [Gp, D]
        return jnp.sum(p[:, :, None] * v[None, :, :], axis=1)

    def attend(i, k_parts, v, v_plain, carry):
        m_prev, l_prev, acc_prev = carry[:3]
        pos = i * ps + lax.broadcasted_iota(jnp.int32, (ps,), 0)
        valid = pos < seq_len
        k_parts = tuple(kp.astype(jnp.float32) for kp in k_parts)
        v = jnp.where(valid[:, None], v.astype(jnp.float32), jnp.float32(0.0))
        s = jnp.where(valid[None, :], scores(k_parts) * scale, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new[:, None])
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        out = (m_new, l_new, alpha[:, None] * acc_prev + weighted(p, v))
        if plain_heavy:
            vp = jnp.where(valid[:, None], v_plain, jnp.float32(0.0))
            out += (alpha[:, None] * carry[3] + weighted(p, vp),)
        return out

    def full_page(i, carry):
        page = tab_ref[b, i]
        k = reconstruct("key", page)
        k_parts = roped_keys(i, k) if rope else (with_sink("key", i, k),)
        v = reconstruct("value", page)
        v, v_plain = v if rotated else (v, None)
        v = with_sink("value", i, v)
        if plain_heavy and sink:  # sink rows are raw (rotated): no plain part
            v_plain = jnp.where(sink_mask(i, d), jnp.float32(0.0), v_plain)
        return attend(i, k_parts, v, v_plain, carry)

    def partial_page(carry):
        i = stored // ps
        k = with_sink("key", i, stage_refs["key"][stage_loop["key"], sid, :, h, :])
        v = with_sink("value", i, stage_refs["value"][stage_loop["value"], sid, :, h, :])
        k_parts = halves(k) if rope else (k,)
        return attend(i, k_parts, v, jnp.zeros((ps, d), jnp.float32), carry)

    attended = (seq_len + ps - 1) // ps
    start = split * pages_per_split
    end = jnp.minimum(start + pages_per_split, attended)
    full_end = jnp.maximum(jnp.minimum(stored // ps, end), start)
    carry = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, d), jnp.float32),
    ) + ((jnp.zeros((rows, d), jnp.float32),) if plain_heavy else ())
    carry = lax.fori_loop(start, full_end, full_page, carry)
    partial = stored // ps
    has_partial = (partial >= start) & (partial < end)
    carry = lax.cond(has_partial, partial_page, lambda c: c, carry)
    m_ref[...] = carry[0]
    l_ref[...] = carry[1]
    acc_ref[...] = carry[2]
    if plain_heavy:
        plain_ref[...] = carry[3]


def combine(acc, m, l_sum):
    """Merge the splits: acc [..., S, Gp, D], m and l_sum [..., S, Gp] -> [..., Gp, D].

    out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s with M = max_s m_s (empty splits
    have m = -inf and weigh 0)."""
    top = jnp.max(m, axis=-2, keepdims=True)
    w = jnp.exp(m - top)
    num = jnp.sum(w[..., None] * acc, axis=-3)
    den = jnp.sum(w * l_sum, axis=-2)
    return num / den[..., None]


def paged_decode_attention(
    q,
    cache,
    block_tables,
    seq_lens,
    seq_ids,
    *,
    loop: int,
    num_splits: int,
    interpret: bool,
    launch=None,
):
    """The kernel call (arguments already checked by `api`; seq_ids an int32 [B] array;
    launch None: `default_launch`). Returns float32 [B, Hq, D]."""
    config = cache.config
    b, hq, d = q.shape
    h, ps = config.num_heads, config.page_size
    group = hq // h
    rows, use_dot = query_rows(group)
    max_pages = block_tables.shape[1]
    pages_per_split = -(-max_pages // num_splits)
    num_splits = -(-max_pages // pages_per_split)  # no split past the table

    qf = jnp.asarray(q, jnp.float32).reshape(b, h, group, d)
    if rows > group:
        qf = jnp.pad(qf, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    # Per-sequence scalars, as `cache_state.read_batch` reads them (slots clamp, rows fill -1).
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    slots = jnp.clip(seq_ids, 0, config.max_seqs - 1)
    tables = jnp.asarray(block_tables).at[seq_ids].get(mode="fill", fill_value=-1)
    tables = jnp.clip(tables, 0, config.num_pages - 1)
    stored = cache.seq_lens[loop][slots]

    chains, arrays = {}, []
    for kind in ("key", "value"):
        steps, planes = chain_steps(cache, kind, loop)
        chains[kind] = (steps, tuple(len(_tile_decode.fields(p.format)) for p in planes))
        for plane in planes:
            arrays += _plane_arrays(plane)
    # Values of a rotated chain are attended in the rotated space: their raw rows (this loop's
    # staging rows of every slot, the batch's sink rows) are rotated here, float32. A chain
    # mixing rotated and plain planes, or rotated keys, has no kernel plan (config_support).
    v_rotated = {rotated_format(step[0]) for step in chains["value"][0]}
    if len(v_rotated) > 1 or any(rotated_format(step[0]) for step in chains["key"][0]):
        raise ValueError(
            f"loop {loop}: rotated keys or a value chain mixing rotated and plain formats "
            "(config_support declines it; XLA path)"
        )
    rotated = v_rotated == {True}
    plain_heavy = _plain_heavy(config, loop)
    v_stage, stage_loop = cache.v_stage, {"key": loop, "value": loop}
    if rotated:
        v_stage, stage_loop["value"] = rotate(v_stage[loop : loop + 1].astype(jnp.float32)), 0
    arrays += [cache.k_stage, v_stage]
    if config.sink:
        n_sink_pages = -(-config.sink // ps)
        for kind, rows_ in (("key", cache.k_sink), ("value", cache.v_sink)):
            x = rows_[loop][slots]  # [B, sink, H, D]
            if rotated and kind == "value":
                x = rotate(x.astype(jnp.float32))
            pad = n_sink_pages * ps - config.sink
            arrays.append(jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))))
    rope = config.rope_theta is not None
    if rope:  # float32 cos, sin [positions, D / 2] (the halves share their angles)
        tables_ = cache_state.key_rope(config, np.arange(max_pages * ps))
        arrays += [a[:, 0, : d // 2] for a in tables_]

    kernel = functools.partial(
        _kernel,
        chains=chains,
        rotated=rotated,
        plain_heavy=plain_heavy,
        rope=rope,
        stage_loop=stage_loop,
        dtype=jnp.dtype(config.dtype),
        page_size=ps,
        pages_per_split=pages_per_split,
        use_dot=use_dot,
        sink=config.sink,
        adaptive=config.adaptive_exit,
        interpret=interpret,
    )
    layer = _tile_decode.layer_operand(cache.layer)
    inputs = [qf, tables, jnp.asarray(seq_lens, jnp.int32), stored, slots, layer]
    inputs += [cache.depth] if config.adaptive_exit else []
    inputs += arrays
    in_specs = [pl.BlockSpec((None, None, rows, d), lambda i, j, s: (i, j, 0, 0))]
    in_specs += [pl.no_block_spec] * (len(inputs) - 1)
    acc_shape = jax.ShapeDtypeStruct((b, h, num_splits, rows, d), jnp.float32)
    acc_spec = pl.BlockSpec((None, None, None, rows, d), lambda i, j, s: (i, j, s, 0, 0))
    out_shape = (
        acc_shape,
        jax.ShapeDtypeStruct((b, h, num_splits, rows), jnp.float32),
        jax.ShapeDtypeStruct((b, h, num_splits, rows), jnp.float32),
    ) + ((acc_shape,) if plain_heavy else ())
    out_specs = (
        acc_spec,
        pl.BlockSpec((None, None, None, rows), lambda i, j, s: (i, j, s, 0)),
        pl.BlockSpec((None, None, None, rows), lambda i, j, s: (i, j, s, 0)),
    ) + ((acc_spec,) if plain_heavy else ())
    if launch is None:
        launch = default_launch(config, group, loop)
    params = None
    if not interpret:
        params = pltriton.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages)
    acc, m, l_sum, *plain = pl.pallas_call(
        kernel,
        grid=(b, h, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=params,
        name="kvq_paged_decode_attention",
    )(*inputs)
    out = combine(acc, m, l_sum)[:, :, :group]  # [B, H, G, D]
    out = unrotate(out) if rotated else out
    if plain_heavy:  # the heavy rows' share, plain (linear in the accumulator)
        out = out + combine(plain[0], m, l_sum)[:, :, :group]
    return out.reshape(b, hq, d)


def _plain_heavy(config, loop: int) -> bool:
    """The value chain of loop `loop` starts with heavy rows over a rotated (HINT) format: the
    kernel attends those rows, plain, into a second accumulator."""
    first = config.loop_format("value", config.chain("value", loop)[0])
    return _tile_decode.heavy_layout(first) is not None and rotated_format(first)


def more_tiles(config, loop: int) -> bool:
    """True when the kernel keeps more than one K and one V tile per page for loop `loop` of
    caches with `config`: a second value accumulator (`_plain_heavy`) or keys stored before
    RoPE (turned in halves)."""
    return config.rope_theta is not None or _plain_heavy(config, loop)


def default_launch(config, group: int, loop: int) -> _launch.Launch:
    """The launch `paged_decode_attention` uses without `launch` (`launch.paged_attention`)."""
    return _launch.paged_attention(group, config.head_dim, config.page_size,
                                   more_tiles=more_tiles(config, loop))  # fmt: skip


def kv_bytes_read(config, seq_lens, *, loop: int) -> int:
    """Bytes of K and V the kernel reads for attended lengths `seq_lens` (host numbers, each
    sequence assumed to attend all it stores): per complete page the packed K + V tiles of
    the planes of each kind's loop chain (every head; `PagedCacheConfig.chain`), per
    sequence with a partial page its K + V staging page (cache dtype), and per sequence the
    K + V sink rows padded to whole pages. Block tables, queries and outputs are not counted."""

    def page_bytes(kind, i):
        args = config.loop_pack_args(kind, i)
        layout = registry.layout(args["format"])
        return layout.storage_bytes(config.page_shape, args["axis"], args["group_size"])

    per_page = sum(
        page_bytes(kind, i) for kind in ("key", "value") for i in config.chain(kind, loop)
    )
    ps = config.page_size
    row = config.num_heads * config.head_dim * np.dtype(config.dtype).itemsize
    lens = np.asarray(seq_lens)
    total = int((lens // ps).sum()) * per_page + int(((lens % ps) > 0).sum()) * 2 * ps * row
    total += len(lens) * 2 * ps * -(-config.sink // ps) * row
    return total
