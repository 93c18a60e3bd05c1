"""Importers (Sailor, Metis) against the real files of eth-easl/sailor and SamsungLabs/Metis (a copy in
../shared/anchors next to the checkout; skipped without it), the GPU table and the ``generate``
dispatch. Expected values come from the raw JSON (read here independently), the figures docs/sources.md
quotes and hand computation — never from the importers' own output."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from hgopt.cost.tables import bandwidth_bytes_per_s
from hgopt.errors import SpecError
from hgopt.profiles import generate
from hgopt.profiles.gpus import GPUS, gpu_spec
from hgopt.profiles.metis import FWD_SHARE, import_metis_profile, metis_topology
from hgopt.profiles.sailor import SailorCluster, import_sailor_profile, sailor_topology
from hgopt.spec import (
    instance_from_dict,
    model_profile_from_dict,
    model_profile_to_dict,
    topology_from_dict,
    topology_to_dict,
)

ANCHORS = Path(__file__).resolve().parents[1].parent / "shared" / "anchors"
SAILOR = ANCHORS / "sailor"
METIS = ANCHORS / "metis"
needs_sailor = pytest.mark.skipif(not SAILOR.is_dir(), reason=f"Sailor's data not found at {SAILOR}")
needs_metis = pytest.mark.skipif(not METIS.is_dir(), reason=f"Metis's data not found at {METIS}")
ZONES = ("us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f", "us-west1-b")


def _raw(path: Path) -> dict:
    return json.loads(path.read_text())


# ---- Sailor: model profiles ---------------------------------------------------------------------
@needs_sailor
@pytest.mark.parametrize("gpu", ["A100-40", "V100-16", "GH-96"])
def test_sailor_times_equal_raw_json(gpu: str) -> None:
    prof = import_sailor_profile(SAILOR, "OPT-350", [gpu])
    raw = _raw(SAILOR / "profiles" / "OPT-350" / gpu / "profile.json")
    expected = {(int(m), int(t)) for m in raw for t in raw[m]}
    assert {(e.mbs, e.tp) for e in prof.timings} == expected
    for e in prof.timings:
        rows = raw[str(e.mbs)][str(e.tp)]
        assert e.gpu == gpu
        assert list(e.fwd) == [rows[str(i)][0] for i in range(26)]
        assert list(e.bwd) == [rows[str(i)][1] for i in range(26)]
        assert list(e.update) == [rows[str(i)][2] for i in range(26)]


@needs_sailor
def test_sailor_sizes_from_llm_info() -> None:
    prof = import_sailor_profile(SAILOR, "OPT-350", ["A100-40"])
    info = _raw(SAILOR / "llm_info.json")["OPT-350"]
    assert [layer.kind for layer in prof.layers] == ["embedding"] + ["block"] * 24 + ["head"]
    assert prof.dtype == "fp32" and prof.seq_len == 2048  # training_config_opt_350.json
    for i, layer in enumerate(prof.layers):
        assert layer.params == info["1"][str(i)]["params_floats"]
        assert layer.activation_bytes == info["1"][str(i)]["act_output_bytes"]
        assert layer.act_mem_bytes == info["1"][str(i)]["act_mem_bytes"]
    assert sorted(m.tp for m in prof.tp_memory) == [2, 4, 8]
    for m in prof.tp_memory:
        assert list(m.params) == [info[str(m.tp)][str(i)]["params_floats"] for i in range(26)]
        assert list(m.act_mem_bytes) == [info[str(m.tp)][str(i)]["act_mem_bytes"] for i in range(26)]
    # OPT-350: 24 blocks of 12·h² + 13·h parameters with h = 1024 (weights and biases, hand count)
    assert prof.layers[1].params == 12 * 1024**2 + 13 * 1024


@needs_sailor
@pytest.mark.parametrize("model,gpus", [("OPT-350", None), ("GPT-Neo-2.7", ["A100-40", "A100-80", "V100-16"])])
def test_sailor_profile_round_trips(model: str, gpus: list[str] | None) -> None:
    prof = import_sailor_profile(SAILOR, model, gpus)
    again = model_profile_from_dict(json.loads(json.dumps(model_profile_to_dict(prof))))
    assert again == prof


@needs_sailor
def test_sailor_refuses_gpt_neo_on_gh96() -> None:
    with pytest.raises(SpecError) as err:
        import_sailor_profile(SAILOR, "GPT-Neo-2.7", ["GH-96"])
    msg = str(err.value)
    assert "GH-96" in msg and "26 layers" in msg and "34" in msg
    with pytest.raises(SpecError):  # all GPUs (the default) includes GH-96
        import_sailor_profile(SAILOR, "GPT-Neo-2.7")


def _copy_sailor(tmp: Path) -> Path:
    root = tmp / "sailor"
    shutil.copytree(SAILOR / "simulations", root / "simulations")
    shutil.copy(SAILOR / "llm_info.json", root / "llm_info.json")
    shutil.copytree(SAILOR / "profiles" / "OPT-350" / "A100-40", root / "profiles" / "OPT-350" / "A100-40")
    return root


@needs_sailor
def test_sailor_refuses_config_contradicting_sizes(tmp_path: Path) -> None:
    root = _copy_sailor(tmp_path)
    cfg_path = root / "simulations" / "configs" / "training_config_opt_350.json"
    cfg = _raw(cfg_path)
    cfg["sequence_length"] = 1024
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(SpecError, match="act_output_floats"):
        import_sailor_profile(root, "OPT-350", ["A100-40"])


@needs_sailor
def test_sailor_missing_gpu_is_a_clear_error() -> None:
    with pytest.raises(SpecError, match="cannot read"):
        import_sailor_profile(SAILOR, "OPT-350", ["H100-80"])


# ---- Sailor: bandwidths and topologies ------------------------------------------------------------
def _mean_fit_gbs(bws: list, nbytes: float) -> float:
    """Mean of the raw quadratic fits (the README quotes the fits, before the clamp to the maximum)."""
    u = math.log2(nbytes / 1e6)
    return sum(b.curve[0] * u * u + b.curve[1] * u + b.curve[2] for b in bws) / len(bws)


@needs_sailor
@pytest.mark.parametrize(
    "gpus_per_vm,kind,expected",
    [
        # docs/sources.md (means of the fits): A100 one GPU per VM same zone / cross-zone / cross-region, four per VM.
        # The README's figures are means over the zones (pairs) of that kind.
        (1, "same", (1.18, 1.88, 2.41)),
        (1, "cross-zone", (1.20, 1.89, 2.49)),
        (1, "cross-region", (0.22, 0.43, 0.47)),
        (4, "same", (4.75, 6.18, 5.56)),
        (4, "cross-region", (0.35, 0.68, 0.92)),
    ],
)
def test_sailor_curves_match_readme(gpus_per_vm: int, kind: str, expected: tuple[float, ...]) -> None:
    topo = sailor_topology(
        SAILOR, [SailorCluster(zone=z, gpu="A100-40", count=gpus_per_vm, gpus_per_vm=gpus_per_vm) for z in ZONES]
    )
    region = {c.name: c.region.rsplit("-", 1)[0] for c in topo.clusters}
    if kind == "same":
        bws = [c.inter_node for c in topo.clusters]
    else:
        want_same_region = kind == "cross-zone"
        bws = [link.bandwidth for link in topo.links if (region[link.src] == region[link.dst]) == want_same_region]
    got = tuple(_mean_fit_gbs(bws, x) for x in (1e6, 64e6, 1e9))
    assert got == pytest.approx(expected, abs=0.006)
    for b in bws:  # the cost model clamps each fit to its measured maximum
        assert bandwidth_bytes_per_s(b, 64e6) == pytest.approx(min(_mean_fit_gbs([b], 64e6), b.gbyte_s) * 1e9)


@needs_sailor
def test_sailor_topology_het_32_96() -> None:
    topo = sailor_topology(SAILOR, [SailorCluster(zone="us-central1-a", gpu="A100-40", count=32),
                                    SailorCluster(zone="us-central1-a", gpu="V100-16", count=96)])
    a, v = topo.clusters
    cfg = _raw(SAILOR / "simulations" / "configs" / "basic_cluster_config.json")
    assert (a.nodes, a.gpus_per_node, a.gpu_memory_bytes) == (8, 4, cfg["A100-40"]["mem_per_gpu"])
    assert (v.nodes, v.gpus_per_node, v.gpu_memory_bytes) == (24, 4, cfg["V100-16"]["mem_per_gpu"])
    het = _raw(SAILOR / "providers" / "multizone_bandwidths_het.json")
    (c0, c1, c2), top = het["us-central1-a"]["A100-40"]["4"]["us-central1-a"]["V100-16"]["4"]
    link = topo.link(a.name, v.name)
    assert link.curve == (c0, c1, c2) and link.gbyte_s == top / 1e9
    intra = _raw(SAILOR / "providers" / "intra_node_bandwidths.json")["V100-16"]["4"]
    assert v.intra_node.curve == tuple(intra[0]) and v.intra_node.gbyte_s == intra[1] / 1e9
    # GB/s at 64 MB by hand: u = log2(64) = 6
    assert bandwidth_bytes_per_s(link, 64e6) / 1e9 == pytest.approx(c0 * 36 + c1 * 6 + c2)
    assert topology_from_dict(topology_to_dict(topo)) == topo


@needs_sailor
def test_sailor_topology_rejects_partial_vm() -> None:
    with pytest.raises(ValueError, match="multiple"):
        sailor_topology(SAILOR, [SailorCluster(zone="us-central1-a", gpu="A100-40", count=6)])


# ---- Metis ----------------------------------------------------------------------------------------
@needs_metis
def test_metis_times_equal_raw_json() -> None:
    prof = import_metis_profile(METIS, seq_len=2048, hidden=2048)
    files = sorted(METIS.glob("DeviceType.A100_tp*_bs*.json"))
    assert len(prof.timings) == len(files) == 9
    for e in prof.timings:
        raw = _raw(METIS / f"DeviceType.A100_tp{e.tp}_bs{e.mbs}.json")
        total = raw["execution_time"]["layer_compute_total_ms"]
        assert e.gpu == "A100"
        for f, b, t in zip(e.fwd, e.bwd, total):
            assert f + b == pytest.approx(t / 1e3, rel=1e-12)
            assert b == pytest.approx(2 * f, rel=1e-12)  # the documented 1:2 split
        assert sum(e.update) == pytest.approx(raw["execution_time"]["optimizer_time_ms"] / 1e3, rel=1e-12)
        p = raw["model"]["parameters"]["parameters_per_layer_bytes"]
        assert e.update[1] / e.update[0] == pytest.approx(p[1] / p[0], rel=1e-12)
    assert FWD_SHARE == pytest.approx(1 / 3)


@needs_metis
def test_metis_activation_memory_is_the_batch_slope() -> None:
    prof = import_metis_profile(METIS, seq_len=2048, hidden=2048)
    for tp in (1, 2, 4):
        mems = {bs: _raw(METIS / f"DeviceType.A100_tp{tp}_bs{bs}.json")["execution_memory"]["layer_memory_total_mb"]
                for bs in (1, 2, 4)}
        got = next(m for m in prof.tp_memory if m.tp == tp).act_mem_bytes
        for i in range(10):
            slope = np.polyfit([1, 2, 4], [mems[bs][i] for bs in (1, 2, 4)], 1)[0]  # second implementation
            assert got[i] == pytest.approx(max(slope, 0.0) * 2**20, rel=1e-9, abs=1e-3)
    # tp 1, a block, by hand: points (1, 4146), (2, 4838.5), (4, 6259) -> slope 3290.833.../4.666...
    assert prof.layers[1].act_mem_bytes == pytest.approx(3290.8333333 / (42 / 9) * 2**20, rel=1e-8)
    assert prof.layers[1].params == 202383360 / 2  # fp16 parameters by default
    assert prof.layers[1].activation_bytes == 2048 * 2048 * 2


@needs_metis
def test_metis_profile_round_trips_and_needs_two_batch_sizes(tmp_path: Path) -> None:
    prof = import_metis_profile(METIS, seq_len=2048, hidden=2048)
    assert model_profile_from_dict(json.loads(json.dumps(model_profile_to_dict(prof)))) == prof
    shutil.copy(METIS / "DeviceType.A100_tp1_bs1.json", tmp_path)
    with pytest.raises(SpecError, match="batch size"):
        import_metis_profile(tmp_path, seq_len=2048, hidden=2048)


def test_metis_cluster_file(tmp_path: Path) -> None:
    hosts = {
        "10.0.0.1": {"instance_type": "A100", "inter_bandwidth": 1.25e9, "intra_bandwidth": 3e11, "memory": 80},
        "10.0.0.2": {"instance_type": "A100", "inter_bandwidth": 1.25e9, "intra_bandwidth": 3e11, "memory": 80},
        "10.0.0.3": {"instance_type": "V100", "inter_bandwidth": 3.125e8, "intra_bandwidth": 5.3125e9, "memory": 16},
    }
    (tmp_path / "clusterfile.json").write_text(json.dumps(hosts))
    (tmp_path / "hostfile").write_text("10.0.0.1 8\n10.0.0.2 8\n10.0.0.3 4\n")
    topo = metis_topology(tmp_path / "clusterfile.json", tmp_path / "hostfile")
    a, v = topo.clusters
    assert (a.name, a.nodes, a.gpus_per_node, a.gpu_memory_bytes) == ("A100", 2, 8, 80e9)
    assert (v.name, v.nodes, v.gpus_per_node, v.gpu_memory_bytes) == ("V100", 1, 4, 16e9)
    assert a.inter_node.gbyte_s == 1.25 and a.intra_node.gbyte_s == 300.0
    assert topo.link("A100", "V100").gbyte_s == 0.3125 == topo.link("V100", "A100").gbyte_s  # the slower end
    assert topology_from_dict(topology_to_dict(topo)) == topo
    (tmp_path / "hostfile").write_text("10.0.0.1 8\n")
    with pytest.raises(SpecError, match="10.0.0.2"):
        metis_topology(tmp_path / "clusterfile.json", tmp_path / "hostfile")


# ---- GPU table ---------------------------------------------------------------------------------------
def test_gpu_table() -> None:
    for name in ("H100-80", "A100-80", "A100-40", "V100-16", "V100-32", "L40S", "T4"):
        g = gpu_spec(name)
        assert g.source.startswith("https://")
        assert g.fp16_flops > g.fp32_flops > 0 and 0 < g.efficiency <= 1
    assert gpu_spec("A100-40").bf16_flops == 312e12 and gpu_spec("A100-40").memory_gbyte_s == 1555
    assert gpu_spec("V100-16").peak_flops("bf16") is None and gpu_spec("T4").peak_flops("bf16") is None
    assert gpu_spec("H100-80").intra_node_gbyte_s == pytest.approx(900 / 2 * 0.8)
    with pytest.raises(ValueError, match="known"):
        gpu_spec("B200")
    with pytest.raises(TypeError):
        GPUS["X"] = GPUS["T4"]  # type: ignore[index]


# ---- generate() ------------------------------------------------------------------------------------
def test_generate_rejects_unknown_generator() -> None:
    with pytest.raises(SpecError) as err:
        generate({"generator": "magic"}, "f.yaml", "model")
    assert err.value.field == "model.generator" and "analytic" in err.value.problem


@needs_sailor
def test_generate_sailor_and_metis_in_an_instance(tmp_path: Path) -> None:
    direct = import_sailor_profile(SAILOR, "OPT-350", ["A100-40"])
    assert generate({"generator": "sailor", "root": str(SAILOR), "model": "OPT-350", "gpus": ["A100-40"]}) == direct
    src = tmp_path / "inst.yaml"
    src.write_text("")
    data = {
        "name": "t",
        "model": {"generator": "sailor", "root": str(SAILOR), "model": "OPT-350", "gpus": ["A100-40"]},
        "topology": {"clusters": [{"name": "a", "region": "r", "gpu": "A100-40", "gpu_memory_gb": 40, "nodes": 1,
                                   "gpus_per_node": 4, "intra_node": {"gbyte_s": 100}, "inter_node": {"gbyte_s": 10}}]},
        "job": {"global_batch": 8, "seq_len": 2048, "precision": "fp32"},
    }
    assert instance_from_dict(data, str(src), tmp_path).model == direct
    with pytest.raises(SpecError) as err:
        generate({"generator": "sailor", "root": "no/such/dir", "model": "OPT-350"}, str(src), "model")
    assert err.value.field == "model.root"
    with pytest.raises(SpecError) as err:
        generate({"generator": "sailor", "root": str(SAILOR), "model": "OPT-350", "seq_len": 1024}, str(src), "model")
    assert err.value.field == "model" and "1024" in err.value.problem
    if METIS.is_dir():
        got = generate({"generator": "metis", "dir": str(METIS), "seq_len": 2048, "hidden": 2048})
        assert got == import_metis_profile(METIS, seq_len=2048, hidden=2048)


def test_generate_names_unknown_fields() -> None:
    with pytest.raises(SpecError) as err:
        generate({"generator": "sailor", "root": ".", "model": "OPT-350", "gpu": "A100-40"}, "f.yaml", "model")
    assert err.value.field == "model.gpu"
    assert math.isfinite(len(err.value.problem))
