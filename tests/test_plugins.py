"""Plug-in policies: a scheduler subclass plus register_policy in the researcher's own file,
loaded with --policy-module by compare and simulate, with no edit to the package."""

import json
import shutil
from pathlib import Path

import pytest

from minibatch import policies
from minibatch.__main__ import main
from minibatch.plugins import load_policy_module
from minibatch.policies import POLICIES, register_policy
from minibatch.scheduler import PagedScheduler

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PROFILE = Path(__file__).resolve().parents[1] / "data" / "profiles" / "smollm2-135m-cpu.json"


@pytest.fixture(autouse=True)
def policy_table():
    """Each test starts from, and leaves, the built-in policy table."""
    saved = dict(POLICIES)
    yield
    POLICIES.clear()
    POLICIES.update(saved)


@pytest.fixture
def plugin_dir(tmp_path):
    """The examples copied outside the repository, as a researcher's own files."""
    for name in ("srpt.py", "ttft_guard.py"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    return tmp_path


def test_examples_are_short():
    for path in EXAMPLES.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 80, path


def test_compare_runs_plugins_from_outside_the_package(plugin_dir, tmp_path, one_thread):
    out = tmp_path / "out.json"
    main(["compare", "--dtype", "float32", "--model", "tiny-random-llama", "--policy-module",
          str(plugin_dir / "srpt.py"),
          "--policy-module", str(plugin_dir / "ttft_guard.py"), "--policies", "srpt,ttft_guard,paged",
          "--num-requests", "12", "--rate", "20", "--max-num-seqs", "3",
          "--output-scale", "1", "--max-output-len", "64",
          "--clock", "sim", "--figures-dir", "", "--no-progress", "--json", str(out)])
    result = json.loads(out.read_text())["policies"]
    assert {p: r["matches_reference"] for p, r in result.items()} == {"srpt": True, "ttft_guard": True, "paged": True}
    assert result["srpt"]["num_preemptions"] > 0  # shorter arrivals took rows from longer requests


def test_simulate_runs_plugins(plugin_dir, tmp_path):
    out = tmp_path / "sim.json"
    main(["simulate", "--profile", str(PROFILE), "--policy-module", str(plugin_dir / "srpt.py"),
          "--policies", "paged,srpt", "--num-requests", "200", "--rate", "6", "--max-num-seqs", "8",
          "--no-progress", "--json", str(out)])
    result = json.loads(out.read_text())["policies"]
    assert result["srpt"]["num_preemptions"] > 0
    assert result["srpt"]["e2e_p50_s"] < result["paged"]["e2e_p50_s"]  # SRPT's point: shorter response times


@pytest.mark.parametrize("guard_s,guarded", [(0.001, True), (100.0, False)])
def test_a_plugins_own_setting_under_compare_and_simulate(plugin_dir, tmp_path, one_thread, guard_s, guarded):
    """ttft_guard declares --guard-ttft-s (its config class): both commands offer it, the run uses it."""
    common = ["--policy-module", str(plugin_dir / "ttft_guard.py"), "--policies", "ttft_guard,chunked",
              "--num-requests", "12", "--rate", "20", "--max-num-batched-tokens", "32", "--guard-ttft-s", str(guard_s),
              "--no-progress"]
    main(["compare", "--dtype", "float32", "--model", "tiny-random-llama", "--clock", "sim", "--figures-dir", "",
          "--max-output-len", "16", "--json", str(tmp_path / "c.json")] + common)
    main(["simulate", "--profile", str(PROFILE), "--json", str(tmp_path / "s.json")] + common)
    for name in ("c.json", "s.json"):
        row = json.loads((tmp_path / name).read_text())["policies"]["ttft_guard"]
        assert row["settings"]["guard_ttft_s"] == guard_s
        assert (row["num_guard_steps"] > 0) is guarded


def test_a_plugins_own_setting_under_serve(plugin_dir, monkeypatch, capsys):
    """serve loads the plug-in (--policy-module), offers its setting, and serves with it."""
    from fastapi.testclient import TestClient

    from minibatch.serving import launch

    served = {}

    class FakeServer:  # instead of listening on a port: one completion through the app
        def __init__(self, config, engine, drain_timeout_s):
            self.app = config.app

        def run(self):
            with TestClient(self.app) as client:
                reply = client.post("/v1/completions", json={"model": "tiny-random-llama", "prompt": "hi",
                                                             "max_tokens": 3})
            served.update(status=reply.status_code, scheduler=self.app.state.engine.engine.scheduler)

    monkeypatch.setattr(launch, "draining_server", FakeServer)
    serve = ["serve", "--model", "tiny-random-llama", "--dtype", "float32", "--threads", "1",
             "--policy-module", str(plugin_dir / "ttft_guard.py")]
    assert main(serve + ["--policy", "ttft_guard", "--guard-ttft-s", "0.25"]) == 0
    assert served["status"] == 200 and served["scheduler"].guard_ttft_s == 0.25
    with pytest.raises(SystemExit) as e:
        main(serve + ["--policy", "paged", "--guard-ttft-s", "0.25"])
    assert e.value.code == 2
    assert "--guard-ttft-s does not apply to the selected policies (paged); it applies to ttft_guard" in \
        capsys.readouterr().err


def test_srpt_refuses_another_order_of_service(plugin_dir):
    from minibatch.compare import CompareConfig

    load_policy_module(str(plugin_dir / "srpt.py"))
    with pytest.raises(ValueError, match="--queue-policy must be one of remaining.*a setting of policy srpt"):
        CompareConfig(model="tiny-random-llama", policies=("srpt", "paged"), settings={"queue_policy": "sjf"})


def test_an_edited_plugin_file_loaded_again_replaces_what_it_registered(tmp_path):
    """A plug-in file loaded a second time unchanged is not run again; edited (a policy, a backend, a router), its new
    definitions replace its old ones without replace=True (a notebook or a sweep picks up the edit in the same
    process), and a name it no longer registers is gone."""
    from minibatch.cluster.routers.base import ROUTERS
    from minibatch.runner.backends import BACKENDS

    path = tmp_path / "mine.py"
    source = """
from minibatch import PagedScheduler, register_policy
from minibatch.cluster.routers import register_router
from minibatch.cluster.routers.round_robin import RoundRobin
from minibatch.runner.backends import register_backend
from minibatch.runner.backends.sdpa import SdpaBackend

class Edited(PagedScheduler):
    version = {v}

class EditedBackend(SdpaBackend):
    name = "edited_backend"
    version = {v}

@register_router
class EditedRouter(RoundRobin):
    name = "edited_router"
    version = {v}

register_policy("edited", Edited, description="test")
register_backend(EditedBackend())
"""
    path.write_text(source.format(v=1))
    names = load_policy_module(str(path))
    assert sorted(names) == ["edited", "edited_backend", "edited_router"]
    first = POLICIES["edited"]
    assert load_policy_module(str(path)) == names and POLICIES["edited"] is first  # unchanged: not run again
    path.write_text(source.format(v=2) + "register_policy('edited_too', Edited)\n")
    assert sorted(load_policy_module(str(path))) == ["edited", "edited_backend", "edited_router", "edited_too"]
    assert POLICIES["edited"].scheduler.version == BACKENDS["edited_backend"].version == 2
    assert ROUTERS["edited_router"].version == 2
    path.write_text(source.format(v=3))
    load_policy_module(str(path))
    assert "edited_too" not in POLICIES and POLICIES["edited"].scheduler.version == 3
    for name in ("edited", "edited_backend", "edited_router"):  # leave the tables as they were
        POLICIES.pop(name, None), BACKENDS.pop(name, None), ROUTERS.pop(name, None)


def test_a_replaced_builtin_comes_back_and_a_failing_file_leaves_nothing(tmp_path):
    """A plug-in that replaced the built-in paged and, edited, no longer does: paged is the built-in again. A file
    that registers a policy and then raises leaves nothing registered, so the mended file loads."""
    builtin = POLICIES["paged"]
    path = tmp_path / "over.py"
    path.write_text("from minibatch import PagedScheduler, register_policy\n"
                    "register_policy('paged', PagedScheduler, description='mine', replace=True)\n")
    load_policy_module(str(path))
    assert POLICIES["paged"] is not builtin and POLICIES["paged"].description == "mine"
    path.write_text("from minibatch import PagedScheduler, register_policy\n"
                    "register_policy('over_other', PagedScheduler, description='other')\n")
    assert load_policy_module(str(path)) == ["over_other"] and POLICIES["paged"] is builtin
    broken = tmp_path / "broken.py"
    broken.write_text("from minibatch import PagedScheduler, register_policy\n"
                      "register_policy('half_done', PagedScheduler, description='x')\nraise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="RuntimeError: boom"):
        load_policy_module(str(broken))
    assert "half_done" not in POLICIES
    broken.write_text("from minibatch import PagedScheduler, register_policy\n"
                      "register_policy('half_done', PagedScheduler, description='x')\n")
    assert load_policy_module(str(broken)) == ["half_done"]
    POLICIES.pop("over_other"), POLICIES.pop("half_done")


def test_a_queue_policy_of_ones_own_in_a_plugin_file(tmp_path, capsys):
    """register_queue_policy in a --policy-module file: --queue-policy NAME selects it in simulate, and it orders
    service (longest job first finishes the longest request first, at zero arrivals and one running request)."""
    path = tmp_path / "ljf.py"
    path.write_text("""
from minibatch.scheduler import QueuePolicy, register_queue_policy

@register_queue_policy
class LongestFirst(QueuePolicy):
    name = "longest_first"
    static = True

    def key(self, request):
        return (-request.max_num_tokens, request.arrival_time_s)
""")
    out = tmp_path / "ljf.json"
    main(["simulate", "--profile", str(PROFILE), "--policy-module", str(path), "--policies", "paged",
          "--num-requests", "6", "--arrival", "zero", "--queue-policy", "longest_first", "--json", str(out)])
    assert json.loads(out.read_text())["policies"]["paged"]["settings"]["queue_policy"] == "longest_first"
    from minibatch import SimClock, SimExecutor, make_engine
    from minibatch.request import Request

    requests = [Request(k, [3] * p, n) for k, (p, n) in {"a": (5, 2), "b": (30, 9), "c": (12, 4)}.items()]
    make_engine("paged", SimExecutor(), SimClock(), max_num_seqs=1, queue_policy="longest_first").generate(requests)
    assert [r.request_id for r in sorted(requests, key=lambda r: r.first_scheduled_time_s)] == ["b", "c", "a"]
    with pytest.raises(ValueError, match="queue policy 'longest_first' is registered already"):
        from minibatch.scheduler import QueuePolicy, register_queue_policy

        register_queue_policy(type("Other", (QueuePolicy,), {"name": "longest_first"}))
    with pytest.raises(ValueError, match="queue policy 'fcfs' is registered already"):  # a built-in's own name
        register_queue_policy(type("FCFS", (QueuePolicy,), {"name": "fcfs"}))
    with pytest.raises(ValueError, match="a queue policy is a QueuePolicy subclass with a lowercase name"):
        register_queue_policy(type("Bad", (QueuePolicy,), {"name": "Bad Name"}))


def test_register_policy_checks_its_arguments():
    class Mine(PagedScheduler):
        name = "mine"

    spec = register_policy("mine", Mine, description="test")
    assert POLICIES["mine"] is spec and spec.layout == "packed" and "n_slots" in spec.options
    with pytest.raises(ValueError, match="already registered"):
        register_policy("mine", Mine)
    with pytest.raises(ValueError, match="policy name"):
        register_policy("Bad Name", Mine)
    with pytest.raises(TypeError, match="Scheduler subclass"):
        register_policy("other", object)
    with pytest.raises(ValueError, match="proposer"):
        register_policy("other", Mine, proposer="oracle")


@pytest.mark.parametrize("text,message", [
    (None, "no such Python file"),
    ("raise RuntimeError('boom')", "RuntimeError: boom"),
    ("x = 1", "registers no policy"),
    ("", "not a .py file"),  # (written as plugin.txt)
])
def test_bad_policy_module_is_one_line_exit_2(tmp_path, capsys, text, message):
    path = tmp_path / ("plugin.txt" if text == "" else "plugin.py")
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_policy_module(str(path))
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--profile", str(PROFILE), "--policy-module", str(path), "--policies", "paged"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_policy_names_are_compared_only_in_the_policy_table():
    """Outside policies.py and experiment.py (the two tables), no module compares a policy name, or a
    name built on one (such as "orca_max"), nor tests a name's start or end against a part of one
    (``policy.endswith("_prefix")``): a policy's properties come from its row, a variant's from its table."""
    import re

    root = Path(policies.__file__).parent
    names = "|".join(POLICIES)
    literal = rf"""["']\w*({names})\w*["']"""
    compares = re.compile(rf"""(==|!=|\bin)\s*\(?{literal}|{literal}\s*(==|!=)""")
    affix = re.compile(r"""\.(startswith|endswith)\(\s*\(?\s*["']([^"']+)["']""")

    def offends(line: str) -> bool:
        if compares.search(line) and not line.strip().startswith("for "):  # a loop over names is fine
            return True
        return any(getattr(name, method)(part) for method, part in affix.findall(line) for name in POLICIES)

    tables = ("policies.py", "experiment.py")
    files = [p for p in root.rglob("*.py") if p.name not in tables]
    offenders = [f"{p.relative_to(root)}:{i}" for p in files
                 for i, line in enumerate(p.read_text().splitlines(), 1) if offends(line)]
    assert not offenders


def test_shared_help_texts_name_no_policy():
    """A setting shared by several policies is described by what it does, not by who uses it: no help
    text of a config class several policies share (or of the run's CompareConfig) starts a clause
    with a policy's name ("orca: ...", "chunked: ...")."""
    import dataclasses
    import re

    from minibatch.compare import CompareConfig

    users: dict[type, set] = {}
    for name, row in POLICIES.items():
        for cls in row.config_cls.__mro__:
            if dataclasses.is_dataclass(cls):
                users.setdefault(cls, set()).add(name)
    shared = [cls for cls, names in users.items() if len(names) > 1] + [CompareConfig]
    labelled = re.compile(rf"\b({'|'.join(POLICIES)})\s*:")
    offenders = [f"{cls.__name__}.{f.name}: {f.metadata['help']}" for cls in shared
                 for f in dataclasses.fields(cls) if f.metadata.get("help") and labelled.search(f.metadata["help"])
                 and f in cls.__dataclass_fields__.values()]
    assert len(shared) >= 4 and not offenders
