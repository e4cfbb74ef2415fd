"""The structure of docs/LAYERS.md: layers as folders, no cycles, and stacks that load alone.

- Every module lies in a layer folder of docs/LAYERS.md's table (parsed here; a cell is a
  package directory); the package roots only re-export.
- Every import of every kvq module (module level and inside functions) goes to its own layer
  or one below it; the neutral layer imports neither JAX nor Torch, the Torch stack never
  imports JAX, the JAX layers never import Torch.
- No module builds a file path from `__file__` (shipped files come from `kvq_jax.data`).
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
    "codecs": ("torch",),
    "models": ("torch",),
    "kernels": ("torch",),
    "cache": ("torch",),
    "engine": ("torch",),
    "torch_codecs": ("jax", "jaxlib"),
    "torch_cache": ("jax", "jaxlib"),
    "torch_serving": ("jax", "jaxlib"),
}


#: What each package root may re-export from (kvq_jax's root is lazy and imports nothing).
ROOT_IMPORTS = {
    "kvq_jax": (),
    "kvq_torch_bridge": ("neutral", "torch_codecs", "torch_cache", "torch_serving"),
}
FORBIDDEN["kvq_jax"] = ("jax", "jaxlib", "torch")
FORBIDDEN["kvq_torch_bridge"] = ("jax", "jaxlib")


def layer_table() -> dict[str, tuple[list[str], set[str]]]:
    """{layer: (folders as dotted names, layers it may import)} from docs/LAYERS.md."""
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
    """The layer whose folder holds `module` (folders do not nest in the table)."""
    for layer, (folders, _) in table.items():
        if any(module == f or module.startswith(f + ".") for f in folders):
            return layer
    return None


def folder_errors(table) -> list[str]:
    """Table cells that are not package directories, and folders in more than one layer."""
    errors, seen = [], {}
    for layer, (folders, _) in table.items():
        for f in folders:
            if not (ROOT.joinpath(*f.split(".")) / "__init__.py").is_file():
                errors.append(f"{layer}: {f} is not a package folder")
            if f in seen:
                errors.append(f"{f} is in layers {seen[f]} and {layer}")
            seen[f] = layer
    return errors


def path_errors(mods: dict[str, pathlib.Path]) -> list[str]:
    """Modules that build a file path from `__file__` (a read of another folder's files)."""
    return [
        f"{path.name}: module {module} builds a path from __file__"
        for module, path in mods.items()
        if any(
            isinstance(n, ast.Name) and n.id == "__file__"
            for n in ast.walk(ast.parse(path.read_text()))
        )
    ]


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
        if module in PACKAGES:  # a package root re-exports its stack's public names
            layer = module
            table = {**table, module: ([], set(ROOT_IMPORTS[module]))}
        if layer is None:
            errors.append(f"{module}: in no layer folder of docs/LAYERS.md")
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


LAYERS = (
    "neutral",
    "codecs",
    "models",
    "kernels",
    "cache",
    "torch_codecs",
    "torch_cache",
    "torch_serving",
    "engine",
    "top",
)


def test_every_import_respects_the_layers():
    mods = modules()
    table = layer_table()
    assert set(LAYERS) == set(table)
    assert len(mods) > 80
    assert folder_errors(table) == []
    assert violations(mods, table) == []


def test_package_roots_hold_no_loose_module():
    """Only `__init__.py` lies directly in kvq_jax/ and kvq_torch_bridge/."""
    loose = [p.name for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py")]
    assert sorted(loose) == ["__init__.py", "__init__.py"]


def test_no_module_reads_files_by_path():
    assert path_errors(modules()) == []


def test_no_import_cycle():
    assert cycles(modules()) == []


def test_checks_catch_planted_violations(tmp_path):
    """A neutral module importing jax, a kernel importing a cache module, a Torch module
    importing kvq_jax.codecs.api, a loose module at the package root, a module reading a
    file by a path from `__file__`, a table cell that is no folder, and a two-module cycle
    are all reported."""
    table = layer_table()
    planted = {
        "kvq_jax.core.bad": "import jax\n",
        "kvq_jax.kernels.bad": "def f():\n    from kvq_jax.cache.paged_cache import append\n",
        "kvq_torch_bridge.codecs.bad": "from kvq_jax.codecs.api import pack_kv\n",
        "kvq_jax.loose": "from kvq_jax.core import checks\n",
        "kvq_jax.core.reads": "import pathlib\nP = pathlib.Path(__file__).parents[1] / 'report'\n",
        "kvq_jax.codecs.cyc_a": "import kvq_jax.codecs.cyc_b\n",
        "kvq_jax.codecs.cyc_b": "import kvq_jax.codecs.cyc_a\n",
    }
    mods = dict(modules())
    for name, source in planted.items():
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        mods[name] = path
    errors = "\n".join(violations(mods, table))
    assert "neutral module kvq_jax.core.bad imports jax" in errors
    assert "kernels module kvq_jax.kernels.bad imports cache kvq_jax.cache.paged_cache" in errors
    assert (
        "torch_codecs module kvq_torch_bridge.codecs.bad imports codecs kvq_jax.codecs.api"
        in errors
    )
    assert "kvq_jax.loose: in no layer folder of docs/LAYERS.md" in errors
    assert "module kvq_jax.core.reads builds a path from __file__" in "\n".join(path_errors(mods))
    table["kernels"][0].append("kvq_jax.kernels.launch")
    assert "kernels: kvq_jax.kernels.launch is not a package folder" in folder_errors(table)
    assert ["kvq_jax.codecs.cyc_a", "kvq_jax.codecs.cyc_b", "kvq_jax.codecs.cyc_a"] in cycles(mods)


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
        from kvq_torch_bridge.cache import paged_cache
        from kvq_torch_bridge.cache import paged_attention
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
