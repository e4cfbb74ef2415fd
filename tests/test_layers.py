"""The import structure of docs/LAYERS.md: layers, no cycles, and stacks that load alone.

- Every import of every kvq module (module level and inside functions) goes to its own layer
  or one below it (the table in docs/LAYERS.md, parsed here); the neutral layer imports
  neither JAX nor Torch, the Torch stack never imports JAX, the JAX layers never import Torch.
- The module-level imports form no cycle.
- In a fresh interpreter, `import kvq_torch_bridge` (and a Torch paged cache driven through
  append and attention) leaves `jax` out of `sys.modules`; `import kvq_jax.core` loads neither
  JAX nor Torch.
Each check is shown to catch a planted violation (`test_checks_catch_planted_violations`).
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kvq_jax", "kvq_torch_bridge")
#: Third-party frameworks a layer may not import: layer -> forbidden top-level names.
FORBIDDEN = {
    "neutral": ("jax", "jaxlib", "torch"),
    "jax": ("torch",),
    "kernels": ("torch",),
    "public": ("torch",),
    "models": ("torch",),
    "torch": ("jax", "jaxlib"),
}


def layer_table() -> dict[str, tuple[list[str], set[str]]]:
    """{layer: (module prefixes, layers it may import)} from docs/LAYERS.md."""
    text = (ROOT / "docs" / "LAYERS.md").read_text()
    table = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[1].startswith("`"):
            continue
        prefixes = re.findall(r"`([\w.]+)`", cells[1])
        table[cells[0]] = (prefixes, {c.strip() for c in cells[2].split(",")})
    return table


def layer_of(module: str, table) -> str | None:
    best, best_len = None, -1
    for layer, (prefixes, _) in table.items():
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = layer, len(p)
    return best


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(path: pathlib.Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported name, line, at module level) for every import in the file; a
    `from a.b import c` names the module a.b.c when it is one, else a.b."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                for a in node.names
            ]
        else:
            continue
        out += [(n, node.lineno, id(node) in top) for n in names]
    return out


def violations(mods: dict[str, pathlib.Path], table) -> list[str]:
    known = set(mods)
    errors = []
    for module, path in mods.items():
        layer = layer_of(module, table)
        if module in PACKAGES and not any(n in known for n, _, _ in imports(path, known)):
            continue  # a package root that imports nothing of its own (kvq_jax's lazy init)
        if layer is None:
            errors.append(f"{module}: in no layer of docs/LAYERS.md")
            continue
        allowed = table[layer][1]
        for name, line, _ in imports(path, known):
            where = f"{path.name}:{line}"
            root = name.split(".")[0]
            if root in FORBIDDEN.get(layer, ()):
                errors.append(f"{where}: {layer} module {module} imports {name}")
            if root in PACKAGES and name not in PACKAGES:
                target = layer_of(name, table)
                if target not in allowed:
                    errors.append(f"{where}: {layer} module {module} imports {target} {name}")
    return errors


def cycles(mods: dict[str, pathlib.Path]) -> list[list[str]]:
    known = set(mods)
    graph = {
        m: {n for n, _, top in imports(p, known) if top and n in known and n != m}
        for m, p in mods.items()
    }
    found, state = [], {}

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                found.append([*stack[stack.index(n) :], n])
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return found


def test_every_import_respects_the_layers():
    mods = modules()
    table = layer_table()
    assert {"neutral", "jax", "kernels", "public", "models", "torch", "top"} <= set(table)
    assert len(mods) > 80
    assert violations(mods, table) == []


def test_no_import_cycle():
    assert cycles(modules()) == []


def test_checks_catch_planted_violations(tmp_path):
    """A neutral module importing jax, a kernel importing a public module, a Torch module
    importing kvq_jax.api, and a two-module cycle are all reported."""
    table = layer_table()
    planted = {
        "kvq_jax.core.bad": "import jax\n",
        "kvq_jax.kernels.bad": "def f():\n    from kvq_jax.paged_cache import append\n",
        "kvq_torch_bridge.bad": "from kvq_jax.api import pack_kv\n",
        "kvq_jax.cyc_a": "import kvq_jax.cyc_b\n",
        "kvq_jax.cyc_b": "import kvq_jax.cyc_a\n",
    }
    mods = dict(modules())
    for name, source in planted.items():
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        mods[name] = path
    table["jax"][0].extend(["kvq_jax.cyc_a", "kvq_jax.cyc_b"])
    errors = "\n".join(violations(mods, table))
    assert "neutral module kvq_jax.core.bad imports jax" in errors
    assert "kernels module kvq_jax.kernels.bad imports public kvq_jax.paged_cache" in errors
    assert "torch module kvq_torch_bridge.bad imports jax kvq_jax.api" in errors
    assert ["kvq_jax.cyc_a", "kvq_jax.cyc_b", "kvq_jax.cyc_a"] in cycles(mods)


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_torch_stack_runs_without_jax():
    out = _run(
        """
        import sys
        import numpy as np, torch
        import kvq_torch_bridge as kvt
        from kvq_torch_bridge import paged_cache, paged_attention
        k = torch.randn(40, 2, 16)
        packed = kvt.pack_kv(k, kind="key", format="nvfp4")
        config = kvt.PagedCacheConfig(num_pages=4, page_size=8, num_heads=2, head_dim=16,
                                      num_loops=2, max_seqs=1, sink=2)
        cache = paged_cache.init_cache(config)
        tables = torch.tensor([[2, 0, 1, 3]], dtype=torch.int32)
        ids = torch.zeros(1, dtype=torch.int32)
        x = torch.randn(1, 11, 2, 16)
        for loop in range(2):
            cache = paged_cache.append(cache, x, x, block_tables=tables, seq_ids=ids, loop=loop)
        out = paged_attention.paged_decode_attention(
            torch.randn(1, 4, 16), cache, tables, torch.tensor([11], dtype=torch.int32), loop=1)
        assert out.shape == (1, 4, 16) and bool(torch.isfinite(out).all())
        print(sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib"))))
        """
    )
    assert out.strip() == "[]"


def test_neutral_layer_imports_no_framework():
    out = _run(
        """
        import sys
        import kvq_jax
        from kvq_jax.core import cache_config, checks, policies, registry
        config = cache_config.PagedCacheConfig(num_pages=2, page_size=16, num_heads=1, head_dim=8)
        assert config.pack_args("key", "base")["group_size"] == 16
        print(sorted(m for m in ("jax", "jaxlib", "torch") if m in sys.modules))
        """
    )
    assert out.strip() == "[]"


def test_bridge_imports_jax_on_first_use():
    out = _run(
        """
        import sys
        import kvq_torch_bridge as kvt
        before = "jax" in sys.modules
        kvt.from_torch
        print(before, "jax" in sys.modules)
        """
    )
    assert out.split() == ["False", "True"]
