"""Plan JSON round trip and the validator."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hgopt.plan import Boundary, Pipeline, Plan, ReplicaGroup, Stage, validate
from tests.factories import tiny_instance

groups = st.builds(
    ReplicaGroup,
    cluster=st.sampled_from(["a", "b"]),
    tp=st.integers(1, 4),
    dp=st.integers(1, 8),
    mbs=st.integers(1, 8),
)
stages = st.builds(Stage, start=st.integers(0, 10), end=st.integers(1, 20),
                   groups=st.lists(groups, min_size=1, max_size=3).map(tuple), zero=st.integers(0, 1))
precisions = st.sampled_from(["native", "fp32", "bf16", "fp16", "fp8"])
pipelines = st.builds(
    Pipeline,
    stages=st.lists(stages, min_size=1, max_size=4).map(tuple),
    num_microbatches=st.integers(1, 64),
    boundaries=st.lists(st.builds(Boundary, fwd=precisions, bwd=precisions), max_size=3).map(tuple),
    schedule=st.sampled_from(["1f1b", "gpipe"]),
)
plans = st.builds(Plan, pipelines=st.lists(pipelines, min_size=1, max_size=3).map(tuple),
                  planner=st.text(max_size=8), meta=st.just((("solver", "highs"),)))


@given(plans)
def test_json_round_trip_is_identity(plan: Plan) -> None:
    assert Plan.from_json(plan.to_json()) == plan


def test_validate_reports_every_violation() -> None:
    inst = tiny_instance(global_batch=8)
    plan = Plan(pipelines=(Pipeline(
        stages=(Stage(start=0, end=2, groups=(ReplicaGroup(cluster="a", tp=2, dp=1, mbs=2),)),
                Stage(start=3, end=4, groups=(ReplicaGroup(cluster="b", tp=1, dp=1, mbs=1),))),
        num_microbatches=4,
        boundaries=(Boundary(), Boundary()),
    ),))
    problems = [str(v) for v in validate(plan, inst)]
    text = "\n".join(problems)
    assert "starts at layer 3, expected 2" in text
    assert "processes 1 samples per microbatch, stage 0 processes 2" in text
    assert "has 2 entries, expected 1" in text
    assert "global batch" not in text  # 4 microbatches x 2 samples (stage 0) = 8: right
    assert len(problems) == 3


def test_wider_link_precision_than_training_dtype_is_rejected() -> None:
    from tests.factories import tiny_model

    model = tiny_model()
    model["dtype"] = "bf16"
    inst = tiny_instance(global_batch=8, model=model, precision="bf16")
    plan = Plan(pipelines=(Pipeline(
        stages=(Stage(start=0, end=2, groups=(ReplicaGroup(cluster="a", mbs=2),)),
                Stage(start=2, end=4, groups=(ReplicaGroup(cluster="b", mbs=2),))),
        num_microbatches=4, boundaries=(Boundary(fwd="fp32", bwd="fp8"),)),))
    problems = [str(v) for v in validate(plan, inst)]
    assert problems == ["pipelines[0].boundaries[0].fwd: fp32 is wider than the training dtype bf16"]


def test_model_profile_round_trip_with_empty_source() -> None:
    from hgopt.spec import model_profile_from_dict, model_profile_to_dict

    inst = tiny_instance()
    d = model_profile_to_dict(inst.model)
    assert d["source"] == ""
    assert model_profile_from_dict(d) == inst.model
