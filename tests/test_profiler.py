"""``hgopt profile`` on a tiny runner model: the output is a valid model profile, times are positive and
grow with the microbatch size; link measurement on loopback; the paced device."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hgopt.cli import main  # noqa: E402
from hgopt.spec import instance_from_dict, model_profile_from_dict  # noqa: E402

TINY = ["--blocks", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--warmup", "2", "--repeat", "5"]


def _profile(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "profile.json"
    assert main(["profile", *TINY, *extra, "-o", str(out)]) == 0
    return json.loads(out.read_text())


def test_profile_loads_and_times_grow_with_microbatch_size(tmp_path: Path) -> None:
    # thread CPU time (--pace 1): what the layers cost, not what the machine's other load adds
    data = _profile(tmp_path, "--mbs", "1,16,64", "--pace", "1")
    prof = model_profile_from_dict(data, source="profile.json")
    assert [layer.kind for layer in prof.layers] == ["embedding", "block", "block", "head"]
    assert prof.seq_len == 16 and prof.dtype == "fp32"
    entries = sorted(prof.timings, key=lambda t: t.mbs)
    assert [t.mbs for t in entries] == [1, 16, 64]
    for t in entries:
        assert all(x > 0 for x in t.fwd + t.bwd)
        assert all(x > 0 for x in t.update)
        assert t.update == entries[0].update  # the optimizer step does not depend on mbs
    total = [sum(t.fwd) + sum(t.bwd) for t in entries]
    assert total[0] < total[1] < total[2]
    assert total[2] > 2 * total[0]  # 64x the samples
    for i in (1, 2, 3):  # every block and the head take longer at mbs 64 than at mbs 1
        assert entries[2].fwd[i] + entries[2].bwd[i] > entries[0].fwd[i] + entries[0].bwd[i]


def test_profile_sizes_match_the_runner_model(tmp_path: Path) -> None:
    from hgopt.export.runner_plan import ModelConfig
    from hgopt.runner.model import build_stage

    prof = model_profile_from_dict(_profile(tmp_path, "--mbs", "1"))
    emb, block, _, head = prof.layers
    h, seq, vocab = 32, 16, 256
    cfg = ModelConfig(layers=("embedding", "block", "block", "head"), hidden=h, heads=2, vocab=vocab, seq=seq)
    for i, layer in enumerate(prof.layers):  # the runner's own layer i
        assert layer.params == sum(p.numel() for p in build_stage(cfg, i, i + 1).parameters())
    assert emb.params == vocab * h + seq * h  # token + position embeddings
    assert head.params == 2 * h + h * vocab + vocab  # final norm + output projection
    assert block.activation_bytes == seq * h * 4  # one fp32 (seq, hidden) activation per sample
    assert block.act_mem_bytes > block.activation_bytes  # attention/MLP intermediates are kept


def test_profile_is_usable_in_an_instance_and_by_evaluate(tmp_path: Path) -> None:
    from hgopt.cost import evaluate
    from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage

    data = _profile(tmp_path, "--mbs", "1,2")
    topo = {"clusters": [{"name": "a", "region": "r", "gpu": "cpu", "gpu_memory_gb": 4, "nodes": 1,
                          "gpus_per_node": 2, "intra_node": {"gbyte_s": 1}, "inter_node": {"gbyte_s": 1}}]}
    inst = instance_from_dict({"name": "t", "model": data, "topology": topo,
                               "job": {"global_batch": 4, "seq_len": 16, "precision": "fp32"}})
    plan = Plan(pipelines=(Pipeline(stages=(Stage(start=0, end=2, groups=(ReplicaGroup(cluster="a", mbs=2),)),
                                            Stage(start=2, end=4, groups=(ReplicaGroup(cluster="a", mbs=2),))),
                                    num_microbatches=2),))
    ev = evaluate(plan, inst)
    assert ev.feasible and ev.iteration_time_s > 0


def test_profile_rejects_bad_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "x.json")
    assert main(["profile", "--blocks", "1", "--mbs", "0", "-o", out]) == 2
    assert "--mbs" in capsys.readouterr().err
    assert main(["profile", "--blocks", "1", "--hidden", "30", "--heads", "4", "-o", out]) == 2
    assert "--heads" in capsys.readouterr().err
    assert main(["profile", "-o", out]) == 2
    assert "--blocks" in capsys.readouterr().err


def test_links_on_loopback_write_positive_figures_and_a_topology(tmp_path: Path) -> None:
    topo = tmp_path / "topo.json"
    topo.write_text(json.dumps({"clusters": [{"name": "a", "region": "r", "gpu": "cpu", "gpu_memory_gb": 4,
                                              "nodes": 1, "gpus_per_node": 2, "intra_node": {"gbyte_s": 1},
                                              "inter_node": {"gbyte_s": 1}}]}))
    out = tmp_path / "links.json"
    assert main(["profile", "--links", "--ranks", "2", "--repeat", "3", "--sizes", "1048576,16777216,67108864",
                 "--topology", str(topo), "--clusters", "a", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    p2p = doc["point_to_point"]
    assert p2p["gbyte_s"] > 0 and p2p["latency_ms"] >= 0
    assert doc["allreduce"]["gbyte_s"] > 0
    measured = doc["measured"]["pairs"][0]
    assert measured["sizes"] == [1048576, 16777216, 67108864]
    assert measured["one_way_s"][2] > measured["one_way_s"][0]  # 64x the bytes take longer
    assert doc["topology"]["clusters"][0]["intra_node"]["gbyte_s"] == pytest.approx(p2p["gbyte_s"])


def test_paced_clock_turns_cpu_time_into_device_time() -> None:
    from hgopt.profiler.paced import PacedClock

    clock = PacedClock(0.5)
    t0 = time.perf_counter()
    c0 = time.thread_time()
    x = 0
    while time.thread_time() - c0 < 0.05:  # 50 ms of CPU work
        x += 1
    clock.settle()
    wall = time.perf_counter() - t0
    cpu = time.thread_time() - c0
    assert wall >= cpu / 0.5 * 0.98  # the settle waited until the device time (cpu / speed) had passed
    assert clock.report()["device_s"] == pytest.approx(clock.report()["cpu_s"] / 0.5)
    with pytest.raises(ValueError, match="speed"):
        PacedClock(1.5)


def test_tensor_parallel_profile_has_per_shard_sizes(tmp_path: Path) -> None:
    prof = model_profile_from_dict(_profile(tmp_path, "--mbs", "2", "--tp", "1,2"))
    assert sorted((t.tp, t.mbs) for t in prof.timings) == [(1, 2), (2, 2)]
    assert all(x > 0 for t in prof.timings for x in t.fwd + t.bwd)
    (mem,) = prof.tp_memory
    assert mem.tp == 2
    emb, block = prof.layers[0], prof.layers[1]
    # hfrec: the token table (256 x 32) is vocabulary-parallel over the tp group, the positions (16 x 32) replicated
    assert emb.params == 256 * 32 + 16 * 32 and mem.params[0] == 256 * 32 / 2 + 16 * 32
    assert block.params / 2 < mem.params[1] < block.params  # matrices split, norms and some biases not


def test_links_over_an_emulated_link_measure_its_rate(tmp_path: Path) -> None:
    from hgopt.export import netns

    if not netns.available():
        pytest.skip("needs root and ip/tc (network namespaces)")
    out = tmp_path / "wan.json"
    # the rate is a slope over sizes 16x apart (197 ms of transfer between them at 40 Mbit/s), each the
    # fastest of 3 round trips: a 15 ms scheduling delay of a loaded machine (load only adds time) on
    # every small message raises it by 8 % (by 20 % with the former 2 repeats of sizes 8x apart)
    assert main(["profile", "--links", "--emulate", "40", "--burst", "3000", "--repeat", "3",
                 "--sizes", "65536,1048576", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    mbit = doc["point_to_point"]["gbyte_s"] * 8e3
    assert 30 < mbit < 45  # tbf at 40 Mbit/s on the wire; TCP/IP headers take ~4 %
    measured = doc["measured"]["pairs"][0]
    for size, t in zip(measured["sizes"], measured["one_way_s"]):  # load-proof: no message beats the shaper
        assert t >= (size - 3000) * 8 / 40e6, (size, t)
    assert main(["profile", "--links", "--emulate", "40", "--burst", "100", "-o", str(out)]) == 2


def test_identical_blocks_get_one_pooled_timing_unless_asked_not_to(tmp_path: Path) -> None:
    pooled = model_profile_from_dict(_profile(tmp_path, "--mbs", "2"))
    (t,) = pooled.timings
    assert t.fwd[1] == t.fwd[2] and t.bwd[1] == t.bwd[2] and t.update[1] == t.update[2]
    assert "pooled" in pooled.source
    raw = model_profile_from_dict(_profile(tmp_path, "--mbs", "2", "--no-pool-blocks"))
    assert "pooled" not in raw.source
    assert all(x > 0 for x in raw.timings[0].fwd)


def test_pool_layers_takes_the_median_of_the_given_layers() -> None:
    from hgopt.profiler.run import pool_layers
    from hgopt.profiler.writer import TimingMeasurement

    t = TimingMeasurement(gpu="cpu", tp=1, mbs=1, fwd=(9.0, 1.0, 2.0, 6.0, 9.0), bwd=(1.0,) * 5, update=(0.0,) * 5)
    p = pool_layers(t, [1, 2, 3])
    assert p.fwd == (9.0, 2.0, 2.0, 2.0, 9.0)


def test_paced_clock_with_device_regions_paces_only_the_work_inside_them() -> None:
    from hgopt.profiler.paced import PacedClock

    def burn(seconds: float) -> None:
        c0 = time.thread_time()
        while time.thread_time() - c0 < seconds:
            pass

    clock = PacedClock(0.5)
    clock.regions = True
    clock.reset()
    burn(0.03)  # host work: not device time
    clock.enter()
    burn(0.02)
    clock.enter()  # a nested region counts once
    burn(0.02)
    clock.exit()
    clock.exit()
    burn(0.03)
    clock.settle()
    rep = clock.report()
    assert 0.04 <= rep["cpu_s"] < 0.055  # the 40 ms of CPU inside the region, not the 60 ms outside
    assert rep["host_s"] >= 0.055
    # settling inside a region takes the region's time so far and goes on counting from there
    clock.enter()
    burn(0.02)
    clock.settle()
    burn(0.02)
    clock.exit()
    clock.settle()
    assert 0.08 <= clock.report()["cpu_s"] < 0.1


def test_profile_with_paced_co_tenants_and_companions_stop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os

    from hgopt.profiler.tenants import companions

    data = _profile(tmp_path, "--mbs", "1", "--pace", "1", "--tenants", "2")
    assert "1 paced co-tenant" in data["source"]
    model_profile_from_dict(data, source="profile.json")
    payload = {"model": {"layers": ["embedding", "block", "head"], "hidden": 32, "heads": 2, "vocab": 64, "seq": 16},
               "names": ["embedding", "block1", "head"], "mbss": [1], "seed": 0, "dtype": "float32",
               "timing": {"gpu": "cpu", "pace": 1.0, "warmup": 0, "repeat": 1}}
    with companions(payload, 2) as pids:
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, 0)  # running
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # stopped and reaped
            os.kill(pid, 0)
    out = str(tmp_path / "x.json")
    assert main(["profile", *TINY, "--tenants", "2", "-o", out]) == 2  # co-tenants need a paced profile
    assert "tenants" in capsys.readouterr().err
