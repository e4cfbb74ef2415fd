"""Argument checks shared by both stacks: shapes, dtypes and static values, never the data.

Every check reads `.shape` and a numpy-comparable `.dtype` (a jax array, a tracer, a numpy
array, a `jax.ShapeDtypeStruct`, or the Torch stack's `ShapeDtype` view of a tensor) and raises
TypeError / ValueError naming the argument, with the same message in both stacks. The
`host_*` checks read data (numpy arrays copied to the host by the caller): they are the
explicit, optional checks of calls whose hot path never syncs with the host.
`check_output_folders` is the commands' check of the files they will write, before any work.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvq_jax.core.layouts import check_float_dtype
from kvq_jax.core.window import Window, check_window


class ShapeDtype(NamedTuple):
    """A shape and a numpy dtype: what the checks read of an array of any framework."""

    shape: tuple
    dtype: np.dtype


def shape_of(x) -> tuple:
    """The shape of an array of any framework (or of a nested sequence), as a tuple; reads
    `.shape` where there is one (no numpy conversion: torch.compile traces it)."""
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else tuple(np.shape(x))


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool."""
    return not isinstance(value, bool) and isinstance(value, int | np.integer)


def check_int32(x, name: str, ndim: int) -> None:
    """`x` is an int32 array of rank `ndim`."""
    shape, dtype = tuple(shape_of(x)), getattr(x, "dtype", None)
    if len(shape) != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {shape}")
    if dtype is None or np.dtype(dtype) != np.int32:
        raise TypeError(f"{name} must have dtype int32, got {dtype}")


def check_values(x, name: str = "values") -> tuple[tuple[int, int, int], np.dtype]:
    """A [T, H, D] float array; returns its (shape, numpy dtype)."""
    shape = tuple(shape_of(x))
    if len(shape) != 3:
        raise ValueError(f"{name} must have rank 3 [T, H, D], got shape {shape}")
    if shape[1] < 1 or shape[2] < 1:
        raise ValueError(f"{name} must have H >= 1 and D >= 1, got shape {shape}")
    return shape, check_float_dtype(x.dtype, f"{name}.dtype")


def check_pages(pages) -> tuple[int, int, int, int]:
    """[P, page_size, H, D] float pages; returns the shape."""
    shape = tuple(shape_of(pages))
    if len(shape) != 4:
        raise ValueError(f"pages must have rank 4 [P, page_size, H, D], got shape {shape}")
    check_float_dtype(pages.dtype, "pages.dtype")
    num_pages, page_size, h, d = shape
    if page_size < 1 or h < 1 or d < 1:
        raise ValueError(f"pages must have page_size, H, D >= 1, got shape {shape}")
    return num_pages, page_size, h, d


def check_packed_pages(packed, packed_type: type) -> int:
    """A `packed_type` (PackedKV) with exactly one leading page axis; returns P."""
    if not isinstance(packed, packed_type) or len(packed.batch_shape) != 1:
        raise TypeError("packed must be a PackedKV with one leading page axis (from pack_paged)")
    return packed.batch_shape[0]


# -- residuals and loop stacks ----------------------------------------------------------------


def check_positions_layout(shape, dtype, rows: int, num_tokens: int) -> None:
    """Rank, dtype and length of a position map for `rows` compact rows of a `num_tokens`
    loop, from its shape and (numpy-comparable) dtype alone."""
    if len(shape) != 1:
        raise ValueError(f"positions must be rank 1 [N], got shape {tuple(shape)}")
    if np.dtype(dtype) != np.int32:
        raise TypeError(f"positions must have dtype int32, got {np.dtype(dtype)}")
    if shape[0] != rows:
        raise ValueError(f"positions has {shape[0]} entries but current has {rows} rows")
    if rows > num_tokens:
        raise ValueError(f"positions has {rows} entries, more than the {num_tokens} tokens")


def check_positions_dtype(positions, name: str = "positions") -> None:
    """None or an int32 array (checked before jit, which would narrow int64 silently)."""
    if positions is None:
        return
    dtype = getattr(positions, "dtype", None)
    if dtype is None:
        raise TypeError(f"{name} must be an int32 array, got {type(positions).__name__}")
    if np.dtype(dtype) != np.int32:
        raise TypeError(f"{name} must have dtype int32, got {np.dtype(dtype)}")


def check_pair(current, previous, dense: bool) -> tuple[int, int]:
    """`current` and `previous` can form a residual; returns (N, T)."""
    (n, h, d), dtype = check_values(current, "current")
    (t, hp, dp), dtype_p = check_values(previous, "previous")
    if dtype != dtype_p:
        raise TypeError(f"current.dtype {dtype} != previous.dtype {dtype_p}")
    if (h, d) != (hp, dp):
        raise ValueError(
            f"current [N, H, D] = {(n, h, d)} does not match "
            f"previous [T, H, D] = {(t, hp, dp)} in H, D"
        )
    if dense and n != t:
        raise ValueError(
            f"dense residual: current has {n} rows but previous has {t} "
            f"(pass positions for a sparse residual)"
        )
    return n, t


def check_previous(residual, previous) -> None:
    """`previous` has the shape and dtype the residual was encoded against."""
    shape, dtype = check_values(previous, "previous")
    if tuple(shape) != residual.shape or dtype != residual.dtype:
        raise ValueError(
            f"previous is {dtype}{list(shape)} but the residual was encoded "
            f"against {residual.dtype}{list(residual.shape)}"
        )


def check_loop_stack(loops) -> tuple[int, int, int, int]:
    """[L, T, H, D] float with L >= 1; returns the shape."""
    shape = tuple(shape_of(loops))
    if len(shape) != 4:
        raise ValueError(f"loops must have rank 4 [L, T, H, D], got shape {shape}")
    if shape[0] < 1:
        raise ValueError("loops must hold at least one loop (L >= 1)")
    check_float_dtype(loops.dtype, "loops.dtype")
    return shape


def check_loop_index(loop, num_loops: int) -> int:
    """A static loop index in [0, num_loops)."""
    if not is_int(loop):
        raise TypeError(f"loop must be a static int, got {type(loop).__name__}")
    if not 0 <= loop < num_loops:
        raise ValueError(f"loop must be in [0, {num_loops}), got {loop}")
    return int(loop)


def host_validate_positions(positions, num_tokens: int, *, window: Window | None = None) -> None:
    """Host-side check of a position map (a numpy array); raises ValueError if it is not
    usable: int32, rank 1, strictly increasing, every entry in [0, num_tokens), and with a
    window every window row present."""
    p = np.asarray(positions)
    if p.ndim != 1:
        raise ValueError(f"positions must be rank 1, got shape {p.shape}")
    if p.dtype != np.int32:
        raise ValueError(f"positions must have dtype int32, got {p.dtype}")
    if p.size and (p.min() < 0 or p.max() >= num_tokens):
        raise ValueError(
            f"positions must lie in [0, {num_tokens}), got range [{p.min()}, {p.max()}]"
        )
    if p.size > 1 and not np.all(np.diff(p) > 0):
        bad = int(np.argmax(np.diff(p) <= 0))
        raise ValueError(
            f"positions must be strictly increasing; positions[{bad}] = {p[bad]} "
            f">= positions[{bad + 1}] = {p[bad + 1]}"
        )
    if window is not None:
        head, _, tail = window.split_sizes(num_tokens)
        need = np.concatenate([np.arange(head), np.arange(num_tokens - tail, num_tokens)])
        missing = np.setdiff1d(need, p)
        if missing.size:
            raise ValueError(
                f"with a window, positions must include every window row; "
                f"missing {missing[:8].tolist()}"
            )


# -- the paged cache -----------------------------------------------------------------------------


def check_block_tables(config, block_tables) -> int:
    """int32 [max_seqs, max_pages_per_seq >= 1]; returns max_pages_per_seq."""
    check_int32(block_tables, "block_tables", 2)
    rows, max_pages = shape_of(block_tables)
    if rows != config.max_seqs or max_pages < 1:
        raise ValueError(
            f"block_tables must be [max_seqs={config.max_seqs}, max_pages_per_seq >= 1], "
            f"got shape {tuple(shape_of(block_tables))}"
        )
    return max_pages


def check_append_args(config, k, v, block_tables, seq_ids, loop, exited=None) -> tuple[int, int]:
    """Shapes, dtypes and static values of an `append` call; returns (B, n)."""
    check_loop_index(loop, config.num_loops)
    for name, x in (("k", k), ("v", v)):
        shape = tuple(shape_of(x))
        if len(shape) != 4:
            raise ValueError(f"{name} must have rank 4 [B, n, H, D], got shape {shape}")
        if shape[2:] != (config.num_heads, config.head_dim):
            raise ValueError(
                f"{name} must have H={config.num_heads}, D={config.head_dim} "
                f"([B, n, H, D]), got shape {shape}"
            )
        if np.dtype(x.dtype) != config.dtype:
            raise TypeError(f"{name}.dtype {np.dtype(x.dtype)} != cache dtype {config.dtype}")
    if shape_of(k) != shape_of(v):
        raise ValueError(
            f"k {tuple(shape_of(k))} and v {tuple(shape_of(v))} must have the same shape"
        )
    b, n = shape_of(k)[:2]
    check_int32(seq_ids, "seq_ids", 1)
    if shape_of(seq_ids)[0] != b:
        raise ValueError(f"seq_ids has {shape_of(seq_ids)[0]} entries but k has B = {b}")
    max_pages = check_block_tables(config, block_tables)
    if n < 1:
        raise ValueError("k, v must hold at least one token (n >= 1)")
    if n > max_pages * config.page_size:
        raise ValueError(
            f"n = {n} tokens exceed the block table's capacity of "
            f"{max_pages} pages x {config.page_size} tokens per sequence"
        )
    if exited is not None:
        if not config.adaptive_exit:
            raise ValueError("exited needs a cache with PagedCacheConfig(adaptive_exit=True)")
        if loop == 0:
            raise ValueError("exited must be None at loop 0 (a token exits after a loop)")
        if tuple(shape_of(exited)) != (b, n) or np.dtype(exited.dtype) != np.bool_:
            raise ValueError(
                f"exited must be bool [B, n] = [{b}, {n}], got "
                f"{np.dtype(exited.dtype)}{list(shape_of(exited))}"
            )
    return b, n


def host_check_append(config, seq_lens, n: int, block_tables, seq_ids, loop: int) -> None:
    """Data checks of an `append` of `n` tokens per sequence, on host (numpy) copies of the
    cache's seq_lens [L, S], the block tables and the sequence ids. Raises ValueError when:

    - a seq_id lies outside [0, max_seqs), or appears twice;
    - the new tokens run past the block table (the sequence is full);
    - a page the call writes to is not a physical page id in [0, num_pages), or two
      sequences of the call would write to the same physical page;
    - loop > 0 and loop - 1 of a sequence does not yet hold the tokens being appended
      (its pages must be complete before loop `loop`'s deltas are taken against them).
    """
    ids, tables, lens = np.asarray(seq_ids), np.asarray(block_tables), np.asarray(seq_lens)
    if ids.size and (ids.min() < 0 or ids.max() >= config.max_seqs):
        raise ValueError(f"seq_ids must lie in [0, {config.max_seqs}), got {ids.tolist()}")
    if len(np.unique(ids)) != ids.size:
        raise ValueError(f"seq_ids must be distinct, got {ids.tolist()}")
    ps, capacity = config.page_size, tables.shape[1] * config.page_size
    touched = []
    for s in ids.tolist():
        start, end = int(lens[loop, s]), int(lens[loop, s]) + n
        if end > capacity:
            raise ValueError(
                f"sequence {s} is full: positions {start}..{end - 1} run past its block table "
                f"({tables.shape[1]} pages x {ps} = {capacity} tokens)"
            )
        pages = tables[s, start // ps : (end - 1) // ps + 1]
        bad = pages[(pages < 0) | (pages >= config.num_pages)]
        if bad.size:
            raise ValueError(
                f"sequence {s}: block table holds page id(s) {bad.tolist()} outside "
                f"[0, {config.num_pages}) for positions {start}..{end - 1}"
            )
        touched.extend(pages.tolist())
        if loop > 0 and int(lens[loop - 1, s]) < end:
            raise ValueError(
                f"sequence {s}: loop {loop - 1} holds {int(lens[loop - 1, s])} tokens but loop "
                f"{loop} would reach {end}; append loop {loop - 1} first"
            )
    if len(set(touched)) != len(touched):
        raise ValueError("two sequences of one append write to the same physical page")


def check_gather_args(config, seq_len, block_table) -> int:
    """A static seq_len >= 0 and an int32 block-table row long enough for it; returns the
    number of pages seq_len tokens span."""
    if not is_int(seq_len) or seq_len < 0:
        raise ValueError(f"seq_len must be a static int >= 0, got {seq_len!r}")
    check_int32(block_table, "block_table", 1)
    max_pages = -(-int(seq_len) // config.page_size)
    if shape_of(block_table)[0] < max_pages:
        raise ValueError(
            f"block_table has {shape_of(block_table)[0]} entries, fewer than the "
            f"{max_pages} pages of {seq_len} tokens"
        )
    return max_pages


def check_batch(config, seq_lens, seq_ids) -> int:
    """seq_lens int32 [B]; seq_ids None (slots 0..B-1, B <= max_seqs) or int32 [B]; returns B."""
    check_int32(seq_lens, "seq_lens", 1)
    b = shape_of(seq_lens)[0]
    if seq_ids is None:
        if b > config.max_seqs:
            raise ValueError(f"B = {b} exceeds max_seqs = {config.max_seqs}; pass seq_ids")
        return b
    check_int32(seq_ids, "seq_ids", 1)
    if shape_of(seq_ids)[0] != b:
        raise ValueError(f"seq_ids has {shape_of(seq_ids)[0]} entries but seq_lens has {b}")
    return b


def check_q(q, num_heads: int, head_dim: int) -> tuple[int, int]:
    """Decode queries [B, Hq, D] with Hq a positive multiple of the KV heads; returns (B, Hq)."""
    shape = tuple(shape_of(q))
    if len(shape) != 3:
        raise ValueError(f"q must have rank 3 [B, Hq, D], got shape {shape}")
    b, hq, d = shape
    if d != head_dim:
        raise ValueError(f"q has D = {d} but the KV has D = {head_dim}")
    if hq < 1 or hq % num_heads:
        raise ValueError(f"q heads Hq = {hq} must be a positive multiple of KV heads {num_heads}")
    return b, hq


def check_dense_attention_args(q, k, v, seq_lens) -> tuple[int, int, int, int, int]:
    """q [B, Hq, D], k and v [B, T, H, D], seq_lens int32 [B]; returns (B, T, H, D, Hq)."""
    k_shape, v_shape = tuple(shape_of(k)), tuple(shape_of(v))
    if len(k_shape) != 4 or k_shape != v_shape:
        raise ValueError(f"k, v must both be [B, T, H, D], got {k_shape} and {v_shape}")
    b, t, h, d = k_shape
    bq, hq = check_q(q, h, d)
    if bq != b:
        raise ValueError(f"q has B = {bq} but k, v have B = {b}")
    check_int32(seq_lens, "seq_lens", 1)
    if shape_of(seq_lens)[0] != b:
        raise ValueError(f"seq_lens has {shape_of(seq_lens)[0]} entries, expected B = {b}")
    return b, t, h, d, hq


def check_decode_args(config, q, block_tables, seq_lens, loop, seq_ids) -> int:
    """A `paged_decode_attention` call; returns B."""
    check_q(q, config.num_heads, config.head_dim)
    if shape_of(q)[0] != shape_of(seq_lens)[0]:
        raise ValueError(f"q has B = {shape_of(q)[0]} but seq_lens has {shape_of(seq_lens)[0]}")
    check_loop_index(loop, config.num_loops)
    check_block_tables(config, block_tables)
    return check_batch(config, seq_lens, seq_ids)


def _loop_positions(positions, num_residuals: int) -> tuple:
    """One entry (None or int32 [N]) per later loop."""
    if positions is None:
        return (None,) * num_residuals
    if not isinstance(positions, Sequence) or isinstance(positions, str):
        raise TypeError(
            "positions must be None or a sequence with one entry (None or int32[N]) "
            f"per later loop, got {type(positions).__name__}"
        )
    if len(positions) != num_residuals:
        raise ValueError(
            f"positions must have one entry per later loop ({num_residuals}), got {len(positions)}"
        )
    return tuple(positions)


def resolve_loop_args(
    shape, base_format, residual_format, group_size, residual_group_size, positions, window,
    get_codec,
):  # fmt: skip
    """Static arguments of `encode_loops` for a stack of `shape` [L, T, H, D], checked and
    defaulted; `get_codec` is the calling stack's registry lookup (validates the names).
    Returns (residual_format, residual_group_size, positions per later loop, window)."""
    residual_format = base_format if residual_format is None else residual_format
    get_codec(base_format)
    get_codec(residual_format)
    if residual_group_size is None and residual_format == base_format:
        residual_group_size = group_size  # a different format keeps its own default (None)
    return (
        residual_format,
        residual_group_size,
        _loop_positions(positions, shape[0] - 1),
        check_window(window),
    )


def residual_formats(residual_format, base_format, num_residuals: int) -> tuple[str, ...]:
    """The format of each later loop: `residual_format` None (the base's), one name (every
    later loop) or a sequence of exactly `num_residuals` names (loop 1, 2, ...)."""
    if residual_format is None:
        return (base_format,) * num_residuals
    if isinstance(residual_format, str):
        return (residual_format,) * num_residuals
    if not isinstance(residual_format, Sequence):
        raise TypeError(
            "residual_format must be None, a format name or a sequence of names (one per later "
            f"loop), got {type(residual_format).__name__}"
        )
    if len(residual_format) != num_residuals:
        raise ValueError(
            f"residual_format must name one format per later loop ({num_residuals}), got "
            f"{len(residual_format)}: {list(residual_format)!r}"
        )
    return tuple(residual_format)


def absolute_flags(absolute, num_loops: int) -> tuple[bool, ...]:
    """One flag per later loop (loop 1 .. L - 1): True for a loop listed in `absolute`.

    `absolute`: None (every later loop a delta) or a sequence of distinct int loop indices
    (0-based) in [1, num_loops). Loop 0 is the base, always stored whole, so listing it is an
    error, as is an index out of range, a repeated one or a non-int; ValueError/TypeError
    naming `absolute`."""
    if absolute is None:
        return (False,) * (num_loops - 1)
    if isinstance(absolute, str) or not isinstance(absolute, Sequence):
        raise TypeError(
            "absolute must be None or a sequence of loop indices (0-based, in [1, L)), got "
            f"{type(absolute).__name__}"
        )
    loops = []
    for loop in absolute:
        if not is_int(loop):
            raise TypeError(f"absolute must hold int loop indices, got {loop!r} in {absolute!r}")
        loop = int(loop)
        if loop == 0:
            raise ValueError(
                "absolute: loop 0 is the base, always stored whole; list later loops, in "
                f"[1, {num_loops}) (got {list(absolute)!r})"
            )
        if not 1 <= loop < num_loops:
            raise ValueError(
                f"absolute: loop {loop} is out of range [1, {num_loops}) for a stack of "
                f"{num_loops} loops (got {list(absolute)!r})"
            )
        if loop in loops:
            raise ValueError(f"absolute: loop {loop} is listed twice in {list(absolute)!r}")
        loops.append(loop)
    return tuple(i in loops for i in range(1, num_loops))


def resolve_loop_streams(
    shape, base_format, residual_format, group_size, residual_group_size, positions, window,
    get_codec,
):  # fmt: skip
    """Static arguments of `encode_loops` for a stack of `shape` [L, T, H, D], checked and
    defaulted, with one residual format per later loop (`residual_formats`). A residual
    loop in the base's format takes `group_size` unless `residual_group_size` is given; one
    in another format its own default. `get_codec` is the calling stack's registry lookup.
    Returns (((format, group_size) per later loop), positions per later loop, window)."""
    get_codec(base_format)
    formats = residual_formats(residual_format, base_format, shape[0] - 1)
    streams = []
    for fmt in formats:
        get_codec(fmt)
        group = residual_group_size
        if group is None and fmt == base_format:
            group = group_size  # a different format keeps its own default (None)
        streams.append((fmt, group))
    return tuple(streams), _loop_positions(positions, shape[0] - 1), check_window(window)


def check_slot(config, slot, name: str = "slot") -> int:
    """A sequence slot: an int in [0, max_seqs); ValueError naming `name` otherwise."""
    if not is_int(slot) or not 0 <= slot < config.max_seqs:
        raise ValueError(f"{name} must be a slot in [0, {config.max_seqs}), got {slot!r}")
    return int(slot)


def host_check_fork(config, seq_lens, parent, child, num_tokens) -> None:
    """Data checks of a `fork` on a host copy of seq_lens [L, S]: distinct slots in range,
    num_tokens within the parent's length in every loop, and a partial last page that is the
    parent's current partial page (its raw rows are what the child copies); otherwise fork a
    page-aligned prefix and append the rest."""
    check_slot(config, parent, "parent")
    check_slot(config, child, "child")
    if parent == child:
        raise ValueError(f"fork: parent and child are the same slot {parent}")
    lens = np.asarray(seq_lens)[:, parent]
    if not is_int(num_tokens) or not 0 <= num_tokens <= lens.min():
        raise ValueError(
            f"fork: num_tokens = {num_tokens!r} must lie in [0, {int(lens.min())}] (sequence "
            f"{parent} holds {lens.tolist()} tokens per loop)"
        )
    ps = config.page_size
    if num_tokens % ps and (lens // ps != num_tokens // ps).any():
        raise ValueError(
            f"fork: the first {num_tokens} tokens end inside page {num_tokens // ps}, which is "
            f"already quantized in sequence {parent}: fork {num_tokens // ps * ps} tokens "
            f"and append the rest"
        )


def check_page_ids(config, pages) -> np.ndarray:
    """Distinct integer physical page ids in [0, num_pages) (a host array); returns int32."""
    pages = np.asarray(pages)
    if pages.ndim != 1 or pages.dtype.kind not in "iu":
        raise ValueError(
            f"pages must be a rank-1 integer array, got {pages.dtype}{list(pages.shape)}"
        )
    if pages.size and (pages.min() < 0 or pages.max() >= config.num_pages):
        raise ValueError(f"pages must lie in [0, {config.num_pages}), got {pages.tolist()}")
    if len(set(pages.tolist())) != pages.size:
        raise ValueError(f"pages must be distinct, got {pages.tolist()}")
    return pages.astype(np.int32)


def check_swap_in(config, sequence, slot, pages) -> np.ndarray:
    """A `HostSequence` of this configuration, a slot in range and one distinct in-range
    physical page per page it holds; returns the pages as int32."""
    from_config = getattr(sequence, "config", None)
    if from_config is None or not hasattr(sequence, "arrays"):
        raise TypeError(f"sequence must be a HostSequence, got {type(sequence).__name__}")
    if from_config != config:
        raise ValueError("sequence was swapped out of a cache with another configuration")
    if shape_of(pages) != (sequence.num_pages,):
        raise ValueError(
            f"pages must be {sequence.num_pages} page ids (one per page the sequence holds), "
            f"got shape {shape_of(pages)}"
        )
    check_slot(config, slot)
    return check_page_ids(config, pages)


def check_output_folders(**options) -> None:
    """ValueError naming the option (`out_json="x/y.json"` is "--out-json") whose file's
    folder does not exist; None: the option is not given. A command calls it before its
    work, so a run is never lost at the end to a file it cannot write."""
    for name, path in options.items():
        if path is None:
            continue
        folder = pathlib.Path(path).resolve().parent
        if not folder.is_dir():
            raise ValueError(f"--{name.replace('_', '-')}: folder {folder} does not exist")
