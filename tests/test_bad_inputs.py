"""The bad-input corpus of issue 13: each case exits 2 (1 for an infeasible plan) without a traceback,
names the file and the field, and fails fast. "Fast" is guarded by the subprocess timeout (30 s; the
cases take well under a second when handled), never asserted on elapsed time."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hgopt.errors import SpecError
from hgopt.spec import LIMITS, MAX_ALIAS_EXPANSION, load_document
from tests.factories import tiny_model, tiny_topology
from tests.test_input_errors import GOOD_PLAN, good_instance

GUARD_S = 30


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hgopt", *args], capture_output=True, text=True, timeout=GUARD_S)


def _dump(tmp: Path, name: str, data: Any) -> Path:
    p = tmp / name
    p.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return p


def _refused(r: subprocess.CompletedProcess[str], *words: str, status: int = 2) -> None:
    assert r.returncode == status, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr) < 2000, f"error output of {len(r.stderr)} characters"
    for w in words:
        assert w in r.stderr, (w, r.stderr)


def _bomb(levels: int = 9) -> str:
    """A "billion laughs" mapping in flow style: level k lists level k-1 nine times (9**levels strings)."""
    parts = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for k in range(1, levels + 1):
        parts.append(f"l{k}: &l{k} [" + ",".join([f"*l{k - 1}"] * 9) + "]")
    return "{" + ", ".join(parts) + "}"


def _instance_text(**replace: str) -> str:
    """The good instance as YAML with top-level (or job.*) values replaced by raw YAML text."""
    data = good_instance()
    lines = []
    for key, value in data.items():
        if key in replace:
            lines.append(f"{key}: {replace[key]}")
        elif key == "job":
            job = dict(value)
            lines.append("job:")
            for k, v in job.items():
                lines.append(f"  {k}: {replace.get('job.' + k, json.dumps(v))}")
        else:
            lines.append(yaml.safe_dump({key: value}).rstrip())
    return "\n".join(lines) + "\n"


# ---- YAML alias bombs ---------------------------------------------------------------------------
@pytest.mark.parametrize("where, field", [("name", "name"), ("job.global_batch", "job.global_batch")])
def test_alias_bomb_is_refused_naming_the_field(tmp_path: Path, where: str, field: str) -> None:
    p = tmp_path / "bomb.yaml"
    p.write_text(_instance_text(**{where: _bomb()}))
    r = run_cli("show", str(p))
    _refused(r, str(p), f": {field}", "alias")  # e.g. name.l9: the deepest entry holding the bomb


def test_small_alias_bomb_loads_then_fails_validation_with_a_short_message(tmp_path: Path) -> None:
    """Below the expansion bound the document loads; the validation error shows a bounded repr."""
    p = tmp_path / "small.yaml"
    p.write_text(_instance_text(name=_bomb(levels=4)))  # 9**4 = 6561 strings: allowed
    r = run_cli("show", str(p))
    _refused(r, str(p), ": name: ", "expected a non-empty string")


def test_recursive_alias_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "loop.yaml"
    p.write_text(_instance_text(name="&a [1, *a]"))
    _refused(run_cli("show", str(p)), str(p), "refers to itself")


def test_alias_bound_counts_added_nodes(tmp_path: Path) -> None:
    """Aliases adding MAX_ALIAS_EXPANSION nodes or fewer load; more do not. Hand count: ``b``, a list of
    n aliases of the (k + 1)-node list ``a``, adds n·(k + 1) nodes to the k + 5 written ones."""
    k = 1000
    base = "[" + ",".join(["x"] * k) + "]"  # k + 1 nodes
    n_ok = MAX_ALIAS_EXPANSION // (k + 1)  # each alias re-uses k + 1 nodes
    ok = tmp_path / "ok.yaml"
    ok.write_text(f"a: &a {base}\nb: [" + ",".join(["*a"] * n_ok) + "]\n")
    assert len(load_document(ok)["b"]) == n_ok
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"a: &a {base}\nb: [" + ",".join(["*a"] * (n_ok + 1)) + "]\n")
    with pytest.raises(SpecError) as err:
        load_document(bad)
    assert err.value.field == "b" and "alias" in err.value.problem


# ---- sizes ----------------------------------------------------------------------------------------
def _analytic_instance(layers: int) -> dict[str, Any]:
    return {
        "name": "big",
        "model": {"generator": "analytic", "name": "m", "layers": layers, "hidden": 1024, "heads": 16,
                  "vocab": 32000, "seq_len": 128, "dtype": "fp16", "gpus": ["A100-40"], "tps": [1], "mbss": [1]},
        "topology": tiny_topology(clusters=(("a", "A100-40", 1, 8, 40.0),)),
        "job": {"global_batch": 8, "seq_len": 128, "precision": "fp16"},
    }


SIZE_CASES = [
    ("analytic-layers-1e7", lambda d: d, "model.layers", str(int(LIMITS["layers"]))),
    ("global-batch-1e15", lambda d: d["job"].update(global_batch=10**15), "job.global_batch", "sane limit"),
    ("nodes-1e12", lambda d: d["topology"]["clusters"][0].update(nodes=10**12), "topology.clusters[0].nodes", "sane limit"),
    ("memory-1e308", lambda d: d["topology"]["clusters"][0].update(gpu_memory_gb=1e308),
     "topology.clusters[0].gpu_memory_gb", "sane limit"),
    ("wan-1e12-gbit", lambda d: d["topology"]["links"]["default"].update(gbit_s=1e12), "topology.links.default.gbit_s",
     "sane limit"),
    ("latency-1e9-ms", lambda d: d["topology"]["links"]["default"].update(latency_ms=1e9),
     "topology.links.default.latency_ms", "sane limit"),
    ("nic-1e9-gbyte", lambda d: d["topology"]["clusters"][1].update(inter_node={"gbyte_s": 1e9}),
     "topology.clusters[1].inter_node.gbyte_s", "sane limit"),
    ("empty-model", lambda d: d.update(model=""), "model", "non-empty string"),
    ("model-is-a-folder", lambda d: d.update(model="."), "model", "is a folder"),
]


@pytest.mark.parametrize("case", SIZE_CASES, ids=[c[0] for c in SIZE_CASES])
def test_sizes_and_paths_are_refused(tmp_path: Path, case: tuple[str, Any, str, str]) -> None:
    name, edit, field, words = case
    data = _analytic_instance(10**7) if name.startswith("analytic") else good_instance()
    edit(data)
    p = _dump(tmp_path, "inst.yaml", data)
    _refused(run_cli("plan", str(p), "--time-limit", "5"), str(p), f": {field}: ", words)


def test_largest_allowed_analytic_model_still_loads(tmp_path: Path) -> None:
    from hgopt.instances import load_instance

    inst = load_instance(_dump(tmp_path, "inst.yaml", _analytic_instance(int(LIMITS["layers"]))))
    assert inst.model.num_layers == LIMITS["layers"] + 2


def test_all_zero_timings_are_refused(tmp_path: Path) -> None:
    data = good_instance()
    for t in data["model"]["timings"]:
        t["fwd"] = t["bwd"] = t["update"] = [0.0] * 4
    p = _dump(tmp_path, "zero.yaml", data)
    _refused(run_cli("plan", str(p), "--time-limit", "5"), str(p), ": model.timings[0].fwd: ", "zero forward and backward")


def test_one_zero_layer_next_to_timed_ones_is_fine(tmp_path: Path) -> None:
    """Only a layer with neither forward nor backward time is refused; zero update time is legal."""
    data = good_instance()
    for t in data["model"]["timings"]:
        t["update"] = [0.0] * 4
        t["fwd"][0] = 0.0
    r = run_cli("evaluate", str(_dump(tmp_path, "i.yaml", data)), str(_dump(tmp_path, "p.json", GOOD_PLAN)))
    assert r.returncode == 0, r.stderr


# ---- encodings ------------------------------------------------------------------------------------
def test_non_utf8_instance_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "latin1.yaml"
    text = yaml.safe_dump(good_instance()).replace("tiny", "t\xefny", 1)
    line = text[: text.index("\xef")].count("\n") + 1
    p.write_bytes(text.encode("latin-1"))
    _refused(run_cli("show", str(p)), str(p), "not UTF-8", f"byte 0xef at offset {text.index(chr(0xef))}, line {line})")


def test_non_utf8_model_file_names_that_file(tmp_path: Path) -> None:
    model = tmp_path / "model.json"
    model.write_bytes(json.dumps(tiny_model()).encode() + b"\xff")
    data = good_instance()
    data["model"] = "model.json"
    _refused(run_cli("show", str(_dump(tmp_path, "i.yaml", data))), str(model), "not UTF-8")


def test_non_utf8_plan_names_the_file(tmp_path: Path) -> None:
    plan = tmp_path / "p.json"
    plan.write_bytes(b'{"version": 1, "x": "\xff"}')
    _refused(run_cli("evaluate", str(_dump(tmp_path, "i.yaml", good_instance())), str(plan)), str(plan), "utf-8")


# ---- export options ---------------------------------------------------------------------------------
@pytest.mark.parametrize("option, value, words", [
    ("--timeout", "-1", "--timeout must be > 0"),
    ("--timeout", "nan", "--timeout must be > 0"),
    ("--heartbeat-timeout", "0", "--heartbeat-timeout must be >="),
    ("--master-port", "99999", "--master-port must be a TCP port"),
    ("--master-port", "0", "--master-port must be a TCP port"),
    ("--lr", "nan", "--lr must be > 0"),
    ("--link-scale", "inf", "--link-scale must be > 0"),
])
def test_export_refuses_bad_communication_options(tmp_path: Path, option: str, value: str, words: str) -> None:
    inst, plan = _dump(tmp_path, "i.yaml", good_instance()), _dump(tmp_path, "p.json", GOOD_PLAN)
    out = tmp_path / "out"
    _refused(run_cli("export", str(plan), "--instance", str(inst), "-o", str(out), option, value), words)
    assert not out.exists()


def test_export_with_good_options_still_works(tmp_path: Path) -> None:
    inst, plan = _dump(tmp_path, "i.yaml", good_instance()), _dump(tmp_path, "p.json", GOOD_PLAN)
    r = run_cli("export", str(plan), "--instance", str(inst), "-o", str(tmp_path / "out"), "--local",
                "--master-port", "65535", "--heartbeat-timeout", "2")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "out" / "plan.json").read_text())["comm"]["master_port"] == 65535


# ---- output paths, checked before any work -----------------------------------------------------------
def test_plan_output_into_a_missing_folder_fails_before_the_search(tmp_path: Path) -> None:
    """The instance takes minutes to plan with this time limit: only a check before the search
    answers within the guard."""
    target = tmp_path / "missing" / "p.json"
    r = run_cli("plan", "scale-8r-1024-llama70b", "-o", str(target), "--time-limit", "600")
    _refused(r, "-o/--output", str(tmp_path / "missing"), "does not exist")


def test_plan_output_under_a_file_fails(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    r = run_cli("plan", str(_dump(tmp_path, "i.yaml", good_instance())), "-o", str(tmp_path / "f" / "p.json"))
    _refused(r, "-o/--output", "is not a folder")


def test_plan_output_that_is_a_folder_fails(tmp_path: Path) -> None:
    r = run_cli("plan", str(_dump(tmp_path, "i.yaml", good_instance())), "-o", str(tmp_path))
    _refused(r, "-o/--output", "is a folder")


def test_export_output_under_a_file_fails(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    inst, plan = _dump(tmp_path, "i.yaml", good_instance()), _dump(tmp_path, "p.json", GOOD_PLAN)
    r = run_cli("export", str(plan), "--instance", str(inst), "-o", str(tmp_path / "f" / "out"))
    _refused(r, "-o/--out", "is not a folder")


def test_export_model_output_into_a_missing_folder_fails(tmp_path: Path) -> None:
    r = run_cli("export-model", str(_dump(tmp_path, "i.yaml", good_instance())), "-o",
                str(tmp_path / "missing" / "m.mps"), "--split", "1,8")
    _refused(r, "-o/--output", "does not exist")


@pytest.mark.skipif(sys.platform == "win32" or __import__("os").geteuid() == 0,
                    reason="root may write into any folder")
def test_plan_output_into_an_unwritable_folder_fails(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    r = run_cli("plan", str(_dump(tmp_path, "i.yaml", good_instance())), "-o", str(ro / "p.json"))
    _refused(r, "-o/--output", "not writable")


# ---- every field, every odd value -------------------------------------------------------------------
ODD_VALUES = [None, [], {}, "x", "", -1, 0, 1e308, 10**30, 10**400, -(10**400), True, "nan", "inf", float("nan"),
              float("inf"), [1, 2], {"a": 1}, 2.5, "1e5"]


def _paths(d: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    items = d.items() if isinstance(d, dict) else enumerate(d[:3]) if isinstance(d, list) else []
    for k, v in items:
        out.append(path + (k,))
        out.extend(_paths(v, path + (k,)))
    return out


@pytest.mark.parametrize("which", ["measured", "analytic"])
def test_every_field_with_every_odd_value_is_a_spec_error_or_accepted(which: str) -> None:
    """Replace each field (and list item) of a good instance by each odd value: loading either succeeds
    or raises SpecError (exit 2 at the CLI), never another exception (a traceback at the CLI)."""
    from hgopt.spec import instance_from_dict

    base = good_instance() if which == "measured" else _analytic_instance(4)
    others: list[str] = []
    for path in _paths(base):
        for v in ODD_VALUES:
            d = copy.deepcopy(base)
            x = d
            for k in path[:-1]:
                x = x[k]
            x[path[-1]] = v
            try:
                instance_from_dict(d, "f.yaml")
            except SpecError as exc:
                assert len(str(exc)) < 1500
            except Exception as exc:  # noqa: BLE001 - the point of the test
                others.append(f"{path} = {v!r}: {type(exc).__name__}: {exc}")
    assert not others, others[:5]


@pytest.mark.parametrize("name, text", [
    ("deep.yaml", "name: " + "[" * 100_000 + "]" * 100_000 + "\n"),
    ("deep.json", '{"name": ' + "[" * 100_000 + "]" * 100_000 + "}"),
])
def test_deep_nesting_is_a_syntax_error_naming_the_file(tmp_path: Path, name: str, text: str) -> None:
    p = tmp_path / name
    p.write_text(text)
    _refused(run_cli("show", str(p)), str(p), "not valid")
