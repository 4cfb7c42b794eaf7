"""python -m minibatch sweep: a grid of simulate runs in this process and as tasks on a local Ray instance of 2
CPUs gives the same table; a task whose worker dies (os._exit) is reported with its configuration while the other
rows survive; a rerun computes only what is missing; bad grid files get one line naming the problem."""

import json
import os
from pathlib import Path

import pytest

from minibatch.__main__ import main
from minibatch.cluster.sweep import code_version, load_grid, rows_of, run_sweep

ROOT = Path(__file__).resolve().parent.parent
PROFILE = str(ROOT / "data/profiles/smollm2-135m-cpu.json")
BASE = {"profile": PROFILE, "policies": "paged", "num_requests": 8, "replicas": 2}
CRASH = "import os\nos._exit(3)\n"
ROUTER = '''
from minibatch.cluster.routers import register_router
from minibatch.cluster.routers.round_robin import RoundRobin


@register_router
class Again(RoundRobin):
    name = "again"
'''


def write_grid(path: Path, grid: dict, configs: list | None = None) -> Path:
    path.write_text(json.dumps({"command": "simulate", "base": BASE, "grid": grid} |
                               ({"configs": configs} if configs else {})))
    return path


def without_times(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "run_time_s"} for r in rows]


def test_in_process_sweep_and_a_rerun_that_computes_nothing(tmp_path, capsys):
    grid = write_grid(tmp_path / "g.json", {"router": ["round_robin", "least_kv"], "rate": [2, 8]})
    out = tmp_path / "t.json"
    assert main(["sweep", "--grid", str(grid), "--json", str(out), "--no-progress"]) == 0
    first = json.loads(out.read_text())
    assert first["num_configs"] == 4 and first["computed"] == 4 and not first["failed"]
    assert [(r["router"], r["rate"]) for r in first["rows"]] == [("round_robin", 2), ("round_robin", 8),
                                                                ("least_kv", 2), ("least_kv", 8)]
    assert first["varying"] == ["router", "rate"] and "4 computed" in capsys.readouterr().out
    second = run_sweep(str(grid), json_path=str(out), progress=False)
    assert second["cached"] == 4 and second["computed"] == 0 and second["rows"] == first["rows"]
    assert code_version() in first["code_version"] and first["code_version"].startswith("0.")


def test_a_profile_changed_in_place_is_computed_again(tmp_path):
    """The cache key covers the content of the files a configuration names: recalibrating a profile in place (same
    path, same options, same code) must not return the old profile's rows."""
    profile = tmp_path / "profile.json"
    data = json.loads(Path(PROFILE).read_text())
    profile.write_text(json.dumps(data))
    grid = tmp_path / "g.json"
    base = {**BASE, "profile": str(profile)}
    grid.write_text(json.dumps({"command": "simulate", "base": base, "grid": {"rate": [4]}}))
    first = run_sweep(str(grid), progress=False)
    assert run_sweep(str(grid), progress=False)["cached"] == 1
    data["layouts"]["packed"]["curve_s"] = [2 * t for t in data["layouts"]["packed"]["curve_s"]]  # a slower machine
    profile.write_text(json.dumps(data))
    again = run_sweep(str(grid), progress=False)
    assert again["cached"] == 0 and again["computed"] == 1
    assert again["rows"][0]["tpot_p50_s"] > first["rows"][0]["tpot_p50_s"]


def test_an_edited_policy_module_in_a_list_is_computed_again(tmp_path):
    """policy_module as a list of files: each file's content is in the cache key, as a single path's is."""
    router = tmp_path / "again.py"
    router.write_text(ROUTER)
    grid = tmp_path / "g.json"
    grid.write_text(json.dumps({"command": "simulate", "base": BASE | {"policy_module": [str(router)]},
                                "grid": {"router": ["again"]}}))
    assert run_sweep(str(grid), progress=False)["computed"] == 1
    assert run_sweep(str(grid), progress=False)["cached"] == 1
    router.write_text(ROUTER + "# an edit\n")
    again = run_sweep(str(grid), progress=False)
    assert again["cached"] == 0 and again["computed"] == 1


def test_two_different_uncommitted_edits_are_two_code_versions(tmp_path):
    """The code version of a dirty tree names a hash of its code's changes: results cached under one edit are not
    served for another; the same edit gives the same version, a clean tree (or one whose only change is a result
    written into data/) none."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    code, result = tmp_path / "minibatch" / "policy.py", tmp_path / "data" / "table.json"
    code.parent.mkdir()
    result.parent.mkdir()
    code.write_text("x = 1\n")
    result.write_text("{}\n")
    git("init", "-q")
    git("add", "minibatch", "data")
    git("commit", "-q", "-m", "one")
    clean = code_version(tmp_path)
    result.write_text('{"code_version": "a sweep wrote its table here"}\n')  # a result is not code
    assert code_version(tmp_path) == clean
    code.write_text("x = 2\n")
    first = code_version(tmp_path)
    code.write_text("x = 3\n")
    second = code_version(tmp_path)
    assert "-dirty" not in clean and first.startswith(clean + "-dirty.") and second.startswith(clean + "-dirty.")
    assert first != second and code_version(tmp_path) == second


def test_a_contended_wall_clock_run_keeps_its_warning_in_its_rows():
    result = {"contended": "load 3.1 on 2 cores", "policies": {"paged": {"output_throughput_tok_s": 10.0}}}
    assert rows_of({"seed": 0}, result) == [{"seed": 0, "policy": "paged", "output_throughput_tok_s": 10.0,
                                             "contended": "load 3.1 on 2 cores"}]
    assert "contended" not in rows_of({"seed": 0}, result | {"contended": None})[0]


def test_a_failing_configuration_is_reported_and_the_rest_survive(tmp_path):
    grid = write_grid(tmp_path / "g.json", {"rate": [2, 4]}, configs=[{"router": "nowhere"}])
    result = run_sweep(str(grid), progress=False)
    assert len(result["rows"]) == 2 and result["failed"][0]["config"]["router"] == "nowhere"
    assert "--router must be one of" in result["failed"][0]["error"]


def test_grid_values_of_their_yaml_types_and_a_damaged_cache_entry(tmp_path):
    """acceptance_rate as a number or list (as YAML writes them) runs; threads out of range fails naming it; a
    cache entry cut short (an interrupted write) is computed again, not an error that blocks every rerun."""
    grid = write_grid(tmp_path / "g.json", {"acceptance_rate": [0.5, [0.6, 0.3]]},
                      configs=[{"threads": -1}, {"threads": 0}])
    base = {**BASE, "policies": "spec", "num_speculative_tokens": 2}
    grid.write_text(json.dumps(json.loads(grid.read_text()) | {"base": base}))
    result = run_sweep(str(grid), cache_dir=str(tmp_path / "cache"), progress=False)
    assert len(result["rows"]) == 2 and [f["config"]["threads"] for f in result["failed"]] == [-1, 0]
    assert all("threads must be an int in [1, 1024]" in f["error"] for f in result["failed"])
    entry = sorted((tmp_path / "cache").glob("*.json"))[0]
    for damaged in (entry.read_text()[:20], "{}", "[1]", '{"config": {}, "result": []}'):  # (the others crashed)
        entry.write_text(damaged)
        again = run_sweep(str(grid), cache_dir=str(tmp_path / "cache"), progress=False)
        assert again["cached"] == 1 and again["computed"] == 1
        assert without_times(again["rows"]) == without_times(result["rows"])


def test_a_json_named_like_its_own_cache_is_refused_before_any_runs(tmp_path, capsys):
    """sweep --json r.cache ran every configuration, then could not write the table over its own cache folder."""
    grid = write_grid(tmp_path / "g.json", {"max_num_seqs": [2]})
    with pytest.raises(SystemExit):
        main(["sweep", "--grid", str(grid), "--json", str(tmp_path / "r.cache"), "--no-progress"])
    assert "the folder of finished configurations would have this name too" in capsys.readouterr().err
    (tmp_path / "q.cache").write_text("a file where the default cache folder goes")
    with pytest.raises(SystemExit):
        main(["sweep", "--grid", str(grid), "--json", str(tmp_path / "q.json"), "--no-progress"])
    assert "--cache (default " in capsys.readouterr().err and not (tmp_path / "q.json").exists()


@pytest.fixture
def local_ray():
    ray = pytest.importorskip("ray")
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    except Exception as e:  # noqa: BLE001 - only a Ray that cannot start skips the test
        pytest.skip(f"ray.init() failed: {e}")
    yield ray
    ray.shutdown()


def test_ray_sweep_equals_in_process_and_survives_a_dying_worker(tmp_path, local_ray):
    plugin = tmp_path / "plugin.py"
    plugin.write_text(CRASH)  # the 12th configuration's worker dies while loading it
    grid = {"router": ["round_robin", "least_outstanding", "least_kv", "prefix_affinity"], "rate": [2, 6],
            "max_outstanding": [None, 2]}
    configs = [{"router": "round_robin", "rate": 2, "max_outstanding": None}]  # placeholder, replaced below
    spec = write_grid(tmp_path / "ray.json", grid)
    command, all_configs = load_grid(str(spec))
    assert len(all_configs) == 16
    configs = all_configs[:11] + [dict(all_configs[11], router="again", policy_module=str(plugin))]
    spec.write_text(json.dumps({"command": "simulate", "configs": configs}))
    on_ray = run_sweep(str(spec), use_ray=True, cache_dir=str(tmp_path / "cache"), progress=False)
    assert [f["index"] for f in on_ray["failed"]] == [11] and on_ray["failed"][0]["config"]["router"] == "again"
    assert len(on_ray["rows"]) == 11 and on_ray["computed"] == 11
    local_spec = tmp_path / "local.json"
    local_spec.write_text(json.dumps({"command": "simulate", "configs": configs[:11]}))
    local = run_sweep(str(local_spec), cache_dir=str(tmp_path / "local_cache"), progress=False)
    assert without_times(local["rows"]) == without_times(on_ray["rows"])
    plugin.write_text(ROUTER)  # fixed: a rerun computes only the configuration that failed
    again = run_sweep(str(spec), use_ray=True, cache_dir=str(tmp_path / "cache"), progress=False)
    assert again["cached"] == 11 and again["computed"] == 1 and not again["failed"] and len(again["rows"]) == 12


@pytest.mark.parametrize("text,message", [
    ("[1, 2]", "a mapping of command, base, grid and configs"),
    ('{"command": "serve", "grid": {"rate": [1]}}', "command must be one of simulate, compare"),
    ('{"grid": {"rate": 3}}', "grid.rate must be a non-empty list"),
    ('{"base": {"rate": 1}}', "no configuration"),
    ("{: :", "ParserError: while parsing"),
])
def test_bad_grid_files_get_one_line(tmp_path, text, message, capsys):
    grid = tmp_path / "bad.yaml"
    grid.write_text(text)
    with pytest.raises(SystemExit):
        main(["sweep", "--grid", str(grid), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_an_option_the_command_lacks_is_refused_with_its_configuration_before_any_runs(tmp_path):
    """Every configuration's keys are checked before the first runs (a typo in base failed every run, one by one,
    and then replaced the table with an empty one)."""
    grid = write_grid(tmp_path / "g.json", {"rate": [2]}, configs=[{"colour": "red"}, {"max_num_seqs": 4}])
    with pytest.raises(ValueError, match="configuration 1 .*'colour' is not an option of simulate"):
        run_sweep(str(grid), cache_dir=str(tmp_path / "cache"), progress=False)
    assert not list((tmp_path / "cache").glob("*.json")) and os.path.exists(PROFILE)


def test_the_sweeps_own_options_in_a_configuration_are_refused(tmp_path):
    """json_path and progress in a configuration were silently overridden by the sweep's own; trace_out and
    figures_dir were shared by every configuration; threads did nothing in a simulation; a grid value listed
    twice ran twice."""
    for config, message in [({"json_path": str(tmp_path / "x.json")}, "'json_path' is the sweep's"),
                            ({"progress": True}, "--no-progress"), ({"trace_out": str(tmp_path / "t")},
                                                                    "'trace_out' is the sweep's")]:
        with pytest.raises(ValueError, match=message):  # before anything runs
            run_sweep(str(write_grid(tmp_path / "g.json", {"rate": [2]}, configs=[config])), progress=False)
    result = run_sweep(str(write_grid(tmp_path / "g.json", {"rate": [2]}, configs=[{"threads": 2}])), progress=False)
    assert "'threads' applies to compare" in result["failed"][0]["error"]
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "t").exists()
    with pytest.raises(ValueError, match="grid.rate lists a value twice"):
        run_sweep(str(write_grid(tmp_path / "twice.json", {"rate": [1, 1]})), progress=False)


def test_a_sweep_that_fails_everywhere_keeps_the_earlier_table_and_big_or_odd_grids_are_named(tmp_path):
    """A sweep whose every configuration fails leaves an earlier --json as it was (it was replaced by an empty
    table); a grid of more than MAX_CONFIGS configurations is refused before it is expanded; YAML's base-60 reading
    of an unquoted 1:2 and an acceptance_rate of true are named, not an AttributeError."""
    out = tmp_path / "table.json"
    out.write_text('{"rows": ["earlier"]}')
    failing = write_grid(tmp_path / "g.json", {"n_slots": [10, 20]})
    result = run_sweep(str(failing), json_path=str(out), progress=False)
    assert len(result["failed"]) == 2 and json.loads(out.read_text()) == {"rows": ["earlier"]}
    huge = write_grid(tmp_path / "h.json", {"rate": list(range(1, 1001)), "seed": list(range(1000))})
    with pytest.raises(ValueError, match="1000000 configurations, more than 100000"):
        load_grid(str(huge))
    yaml_grid = tmp_path / "g.yaml"
    yaml_grid.write_text(f"command: simulate\nbase: {{profile: {PROFILE}, policies: paged}}\n"
                         "configs: [{disaggregate: 1:2}]\n")
    with pytest.raises(ValueError, match='got 62: YAML reads 1:2 unquoted as a number.*write "1:2"'):
        load_grid(str(yaml_grid))
    with pytest.raises(ValueError, match="grid.rate lists a value twice"):  # 1 and 1.0 are one run
        load_grid(str(write_grid(tmp_path / "r.json", {"rate": [1, 1.0]})))
    spec = write_grid(tmp_path / "s.json", {"acceptance_rate": [True]})
    with pytest.raises(ValueError, match="acceptance_rate must be a number in \\[0, 1\\] or a list"):
        load_grid(str(spec))
