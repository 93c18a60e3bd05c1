"""CLI hygiene: --version, -v/-q on either side of the subcommand, --json on show/export/export-model,
and `hgopt init` writing an instance that loads and plans."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import hgopt
from hgopt.cli import build_parser, main
from hgopt.instances import load_instance
from tests.test_input_errors import GOOD_PLAN, good_instance


def _dump(tmp: Path, name: str, data: object) -> Path:
    p = tmp / name
    p.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return p


def test_version() -> None:
    r = subprocess.run([sys.executable, "-m", "hgopt", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"hgopt {hgopt.__version__}"


@pytest.mark.parametrize("argv, verbose, quiet", [
    (["-v", "show", "default"], True, False),
    (["show", "default", "-v"], True, False),
    (["show", "-q", "default"], False, True),
    (["-q", "show", "default"], False, True),
    (["show", "default"], False, False),
])
def test_verbosity_before_or_after_the_subcommand(argv: list[str], verbose: bool, quiet: bool) -> None:
    args = build_parser().parse_args(argv)
    assert (args.verbose, args.quiet) == (verbose, quiet)


def test_verbose_and_quiet_exclude_each_other() -> None:
    with pytest.raises(SystemExit) as err:
        main(["-v", "show", "default", "-q"])
    assert err.value.code == 2


def test_quiet_sets_warning_level(tmp_path: Path) -> None:
    code = ("import logging, sys; from hgopt.cli import main; main(['show', 'default', '-q']); "
            "print(logging.getLogger().level)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip().splitlines()[-1] == str(logging.WARNING)


def test_show_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "default", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    inst = load_instance("default")
    assert doc["name"] == "default" and doc["model"]["layers"] == inst.model.num_layers
    assert [c["name"] for c in doc["topology"]["clusters"]] == [c.name for c in inst.topology.clusters]
    assert doc["job"]["global_batch"] == inst.job.global_batch


def test_export_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inst, plan = _dump(tmp_path, "i.yaml", good_instance()), _dump(tmp_path, "p.json", GOOD_PLAN)
    assert main(["export", str(plan), "--instance", str(inst), "-o", str(tmp_path / "out"), "--local", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["world_size"] == 4 == len(doc["ranks"])  # 2 stages x dp 2
    assert Path(doc["plan"]).is_file() and all(Path(s).is_file() for s in doc["node_scripts"])


def test_export_model_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.lp"
    assert main(["export-model", str(_dump(tmp_path, "i.yaml", good_instance())), "--format", "lp", "-o", str(out),
                 "--split", "1,8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["split"] == {"k": 1, "microbatch": 8, "num_microbatches": 1} and doc["variables"] > 0
    assert out.read_text().strip()


SHAPE = {"name": "gpt-small", "layers": 4, "hidden": 512, "heads": 8, "vocab": 8000, "seq_len": 256}


def test_init_writes_an_instance_that_loads_and_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shape = _dump(tmp_path, "shape.yaml", SHAPE)
    out = tmp_path / "mine.yaml"
    assert main(["init", "-o", str(out), "--cluster", "a:L4:16@eu-west", "--cluster", "b:A100-40:8@us-east",
                 "--model", str(shape), "--global-batch", "64", "--wan-gbit-s", "5"]) == 0
    text = out.read_text()
    assert "# gpu_memory_gb: 24" in text  # the default, shown as a comment
    inst = load_instance(out)
    a, b = inst.topology.clusters
    assert (a.gpu, a.nodes, a.gpus_per_node, b.gpu, b.nodes) == ("L4", 2, 8, "A100-40", 1)
    assert a.defaults == ("gpu_memory_gb", "intra_node", "inter_node")
    assert inst.topology.link("a", "b").gbyte_s == pytest.approx(5 / 8)
    assert inst.job.global_batch == 64 and inst.model.num_layers == 6 and inst.model.dtype == "bf16"
    capsys.readouterr()
    assert main(["plan", str(out), "--time-limit", "20", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["feasible"] is True


def test_init_picks_fp16_for_gpus_without_bf16(tmp_path: Path) -> None:
    out = tmp_path / "v.yaml"
    assert main(["init", "-o", str(out), "--cluster", "v:V100-16:8@x", "--model", str(_dump(tmp_path, "s.yaml", SHAPE))]) == 0
    assert load_instance(out).job.precision == "fp16"


@pytest.mark.parametrize("cluster, words", [
    ("a:L4:16", "NAME:GPU:COUNT@REGION"),
    ("a:Z9:16@r", "unknown GPU type 'Z9'"),
    ("a:L4:12@r", "whole number of 8-GPU nodes"),
])
def test_init_refuses_bad_clusters(tmp_path: Path, capsys: pytest.CaptureFixture[str], cluster: str, words: str) -> None:
    out = tmp_path / "x.yaml"
    assert main(["init", "-o", str(out), "--cluster", cluster, "--model", str(_dump(tmp_path, "s.yaml", SHAPE))]) == 2
    assert words in capsys.readouterr().err and not out.exists()


def test_init_validates_the_shape_and_does_not_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _dump(tmp_path, "s.yaml", dict(SHAPE, layers=10**7))
    out = tmp_path / "x.yaml"
    assert main(["init", "-o", str(out), "--cluster", "a:L4:8@r", "--model", str(bad)]) == 2
    assert "model.layers" in capsys.readouterr().err and not out.exists()
    out.write_text("keep")
    assert main(["init", "-o", str(out), "--cluster", "a:L4:8@r", "--model", str(_dump(tmp_path, "t.yaml", SHAPE))]) == 2
    assert "exists" in capsys.readouterr().err and out.read_text() == "keep"


def test_the_documented_instance_loads(tmp_path: Path) -> None:
    """docs/instance-format.md's annotated instance loads as written, with the defaults it describes."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "instance-format.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    p = tmp_path / "doc.yaml"
    p.write_text(block)
    inst = load_instance(p)
    us, l4, mine = inst.topology.clusters
    assert us.defaults == ("gpu_memory_gb", "intra_node", "inter_node") and us.gpu_memory_bytes == 80e9
    assert us.inter_node.gbyte_s == pytest.approx(400 / 8) and us.intra_node.gbyte_s == pytest.approx(360)
    assert l4.defaults == () and mine.gpu_memory_bytes == 48e9 and mine.intra_node.gbyte_s == pytest.approx(25.6)
    assert sorted(inst.model.gpu_types()) == ["H100-80", "L4", "MY-GPU"] and inst.model.num_layers == 18


def test_profile_json_and_bad_output(tmp_path: Path) -> None:
    """`hgopt profile --json`: the document on stdout, progress on stderr; a bad -o fails before measuring."""
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "hgopt", "profile", "--blocks", "1", "--mbs", "1", "--repeat", "1", "--warmup", "0",
           "--hidden", "16", "--heads", "2", "--seq", "8"]
    out = tmp_path / "p.json"
    r = subprocess.run([*cmd, "-o", str(out), "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["output"] == str(out) and doc["document"] == json.loads(out.read_text())
    assert "forward" in r.stderr
    r = subprocess.run([*cmd, "-o", str(tmp_path / "missing" / "p.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_init_from_a_hugging_face_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config.json (model_type key) becomes `model: {hf_config: ...}` with a path relative to the
    written file, read by hgopt.profiles.hf (run from an unrelated folder: the path must not depend on it)."""
    config = Path(__file__).resolve().parents[1] / "instances" / "hf" / "llama-tiny" / "config.json"
    (tmp_path / "cwd" / "deeper").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "cwd" / "deeper")
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "hf.yaml"
    assert main(["init", "-o", str(out), "--cluster", "a:A100-80:2@r1", "--cluster", "b:A100-40:2@r2",
                 "--model", str(config), "--seq-len", "32", "--precision", "fp32", "--global-batch", "8"]) == 0
    assert "hf_config:" in out.read_text()
    inst = load_instance(out)
    ref = load_instance("hf-llama-tiny-2r")
    assert inst.model.num_layers == ref.model.num_layers and inst.job.seq_len == 32
    assert inst.model.total_params() == ref.model.total_params()
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf.yaml"]  # no temporary file left
