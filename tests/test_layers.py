"""The package's layering: no import cycles, imports point down the layer table, no private names shared.

Imports are read with ``ast`` at any depth, so a lazy import inside a function counts like a module-level one.
``from minibatch.x import y`` is an import of ``minibatch.x.y`` when that is a submodule, else of ``minibatch.x``
(a name re-exported by a package ``__init__`` is an import of the package).
"""

import ast
import re
from pathlib import Path

import networkx as nx  # installed with torch

ROOT = Path(__file__).resolve().parents[1]

# Layers from lowest to highest; a module may import its own layer and the ones before it. Names are relative to
# the package ("__init__" is minibatch/__init__.py); a name covers its submodules, the longest matching name wins.
LAYERS = {
    # request types, argument checks and configs, atomic files; prompt text, trace files and workload build
    # Requests from these only; the published numbers with their sources (claims); the CPU model and instruction
    # sets (machine)
    "base": "request checks files config prompts trace_io workload claims cluster.multiturn machine",
    "kv": "kv",  # block manager: free list, prefix hashing
    "scheduler": "scheduler",  # plans (SchedulerOutput) and results (StepResult); no tensors
    # clocks and step shapes; execute a plan on a model; speculation; Triton kernels; model loading (models, the
    # SmolLM2 GGUF conversion and cache in gguf, quiet from_pretrained and the cache root in hf_load); dtypes; the
    # roofline (a machine's peak and bandwidth, measured or from a datasheet)
    "runner": "clock runner spec hf_load gguf models kernels precision roofline",
    "engine": "records engine metrics",  # StepRecords; Engine.step(); metrics reads only the records
    "viz": "viz",  # plots, KV maps, Chrome traces, step widget: read records and requests
    # the policy table, make_engine; the routers' table and the cluster's event loop over engines; loading a
    # researcher's file that registers policies, attention backends or routers (plugins)
    "policies": "policies cluster.routers cluster.cluster plugins",
    # the simulator's executor and cost model; the package facade re-exports up to here
    "sim": "sim.executor sim.cost_model sim.profile_format sim __init__",
    # experiments: run(), compare, HF baselines, reference outputs, reports, calibration and validation
    "experiment": "experiment compare baselines sharegpt reference equivalence report sim.calibrate sim.workloads "
                  "sim.validate sim.simulator experiments cluster",  # cluster: its simulate and sweep
    "serving": "serving",  # live traffic: the async engine front end, the OpenAI-compatible server, bench-serve
    "cli": "__main__ gpu_check gpu_steps",  # the command line; gpu-check runs compare and the kernels
    "lessons": "lessons",  # notebook helpers: may use anything
}



def module_name(path):
    """Dotted module name of a .py file under ROOT ("minibatch/kv/__init__.py" -> "minibatch.kv")."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


PACKAGE_FILES = {module_name(p): p for p in sorted((ROOT / "minibatch").rglob("*.py"))}


def resolved(node, own):
    """(imported module, name taken from it or None, line) for each name of an import node in module ``own``."""
    if isinstance(node, ast.Import):
        return [(alias.name, None, node.lineno) for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    package = own if PACKAGE_FILES.get(own, Path()).name == "__init__.py" else own.rpartition(".")[0]
    base = package.rsplit(".", node.level - 1)[0] if node.level else ""  # "from .. import x": one package up
    module = ".".join(filter(None, [base, node.module]))
    subs = [f"{module}.{alias.name}" for alias in node.names]
    return [(sub, None, node.lineno) if sub in PACKAGE_FILES else (module, alias.name, node.lineno)
            for sub, alias in zip(subs, node.names)]


def walk(path):
    """Every ast node of the file at ``path``."""
    return ast.walk(ast.parse(path.read_text(), str(path)))


def imports(path):
    """(imported module, name or None, line) for every import in ``path``, function-level ones included."""
    return [imp for node in walk(path) for imp in resolved(node, module_name(path))]


def graph():
    """Directed graph of minibatch modules; each edge carries the line of its (first) import."""
    g = nx.DiGraph()
    g.add_nodes_from(PACKAGE_FILES)
    for mod, path in PACKAGE_FILES.items():
        for target, _, line in sorted(imports(path), key=lambda imp: imp[2]):
            if target in PACKAGE_FILES and target != mod and not g.has_edge(mod, target):
                g.add_edge(mod, target, line=line)
    return g


def where(g, a, b):
    """"file:line" of the import behind edge a -> b."""
    return f"{PACKAGE_FILES[a].relative_to(ROOT)}:{g.edges[a, b]['line']}"


def test_no_import_cycles():
    # Every edge is kept, a package __init__'s edges to its own submodules included: a submodule importing a name
    # from its own package's __init__ while that __init__ imports the submodule is a real circular import, one that
    # works only while the __init__ defines the name above its submodule imports. No edge is implied from a
    # module to its parent packages (Python runs them first), or every module would reach minibatch/__init__.py.
    g = graph()
    cycles = []
    for cycle in sorted(nx.simple_cycles(g)):
        chain = cycle + cycle[:1]
        cycles.append(" -> ".join(chain) + "  (" + ", ".join(where(g, a, b) for a, b in zip(chain, chain[1:])) + ")")
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def layer_of(mod):
    """(index, name) of the layer whose longest entry matches ``mod``, or None when no entry does."""
    rel = "__init__" if mod == "minibatch" else mod.removeprefix("minibatch.")
    matches = [(len(entry), i, name) for i, (name, entries) in enumerate(LAYERS.items())
               for entry in entries.split() if rel == entry or rel.startswith(entry + ".")]
    return max(matches)[1:] if matches else None


def test_layers_import_downward():
    unplaced = [mod for mod in PACKAGE_FILES if layer_of(mod) is None]
    assert not unplaced, f"modules missing from LAYERS: {unplaced}"
    g = graph()
    upward = [f"{where(g, a, b)}: {a} ({layer_of(a)[1]}) imports {b} ({layer_of(b)[1]})"
              for a, b in sorted(g.edges) if layer_of(b)[0] > layer_of(a)[0]]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def is_private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def dotted(node):
    """"a.b.c" for a Name/Attribute chain, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return base and f"{base}.{node.attr}"
    return None


def private_uses(path):
    """Yield (line, text) for each private name ``path`` takes from another minibatch module."""
    own, bound = module_name(path), {}  # bound: local name -> the minibatch module it names
    for node in walk(path):
        if isinstance(node, ast.Import):  # "import a.b" binds a; "import a.b as m" binds m to a.b
            bound.update((a.asname, a.name) if a.asname else (a.name.split(".")[0],) * 2 for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            bound.update((a.asname or a.name, mod) for a, (mod, name, _) in zip(node.names, resolved(node, own))
                         if name is None)
    for node in walk(path):
        for target, name, line in resolved(node, own) if isinstance(node, ast.ImportFrom) else []:
            if name and is_private(name) and target in PACKAGE_FILES and target != own:
                yield line, f"from {target} import {name}"
        if isinstance(node, ast.Attribute) and is_private(node.attr) and (chain := dotted(node.value)):
            head, _, rest = chain.partition(".")
            target = ".".join(filter(None, [bound.get(head), rest]))
            if head in bound and target in PACKAGE_FILES and target != own:
                yield node.lineno, f"{chain}.{node.attr} (in {target})"


def test_no_private_names_across_modules():
    files = sorted(p for d in ("minibatch", "benchmarks", "scripts") for p in (ROOT / d).rglob("*.py"))
    found = [f"{p.relative_to(ROOT)}:{line}: {text}" for p in files for line, text in sorted(private_uses(p))]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_callers_ask_schedulers_and_executors_instead_of_probing_them():
    """Outside kv/ and scheduler/ nothing reaches for a scheduler's block_manager (dotted or by getattr), checks a
    scheduler's class, or probes an executor's stats with getattr: they ask (kv_geometry, kv_capacity_slots,
    make_stats, block_ref_counts, pages_kv; executor.make_stats)."""
    probes = re.compile(r"\.block_manager\b|getattr\([^)]*\"(?:block_manager|stats|batch_size)\"|"
                        r"isinstance\([^)]*Scheduler\)")
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
             for path in sorted((ROOT / "minibatch").rglob("*.py"))
             if path.relative_to(ROOT / "minibatch").parts[0] not in ("kv", "scheduler")
             for i, line in enumerate(path.read_text().splitlines(), 1) if probes.search(line)]
    assert not found, "\n".join(found)
