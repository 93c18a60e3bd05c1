"""Real data for the runner (``--data text``): a local corpus tokenised with a ``tokenizer.json``
(``tokenizers``) or as bytes, sharded over data-parallel replicas by their heterogeneous sample
shares, the stream continued exactly on resume; training on the shipped corpus lowers the loss."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from hgopt.export import ExportOptions, build_runner_plan  # noqa: E402
from hgopt.instances import load_instance  # noqa: E402
from hgopt.runner.data import Dataset, replica_rows, token_stream  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "hgopt" / "data" / "corpus.txt"


def _rp(**kw):  # type: ignore[no-untyped-def]
    from tests.test_runner_hf import _plan_dp_tp

    return build_runner_plan(_plan_dp_tp(), load_instance("hf-llama-tiny-2r"), ExportOptions(data="text", **kw))


def _tokenizer(tmp_path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(CORPUS)], trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_bytes_and_tokenizer_streams(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    text = CORPUS.read_text(encoding="utf-8")
    assert token_stream((), "").tolist() == list(text.encode("utf-8"))
    tj = _tokenizer(tmp_path)
    ids = token_stream((str(CORPUS),), str(tj))
    assert ids.tolist() == Tokenizer.from_file(str(tj)).encode(text).ids and int(ids.max()) < 200
    rp = _rp(data_files=(str(CORPUS),), tokenizer=str(tj))
    assert rp.train.tokenizer == str(tj.resolve())
    ds = Dataset(rp.model, rp.train, rp.global_batch)
    x, y = ds.sample(0, 5)
    window = ds._window(0, 5)
    assert torch.equal(x, window[:-1]) and torch.equal(y, window[1:])
    assert any(torch.equal(x, ids[k : k + rp.model.seq]) for k in range(0, ids.numel() - rp.model.seq, rp.model.seq))


def test_replica_shares_tile_each_step_and_epochs_cover_every_window() -> None:
    """dp 3 + 1 on stage 0: per step the replicas read 6 and 2 samples, disjoint, together the step's
    stream positions; every window is read once per epoch."""
    rp = _rp()
    pipe = rp.pipelines[0]
    reps = pipe.stages[0].replicas
    ds = Dataset(rp.model, rp.train, rp.global_batch)
    for step in range(3):
        rows = [[ds.position(step, i) for m in range(pipe.num_microbatches) for i in replica_rows(pipe, r, m)]
                for r in reps]
        assert [len(r) for r in rows] == [6, 2]
        assert sorted(rows[0] + rows[1]) == list(range(step * 8, step * 8 + 8))
    seen = [int(ds._perm(0)[p]) for p in range(ds.windows)]
    assert sorted(seen) == list(range(ds.windows)) and seen != list(range(ds.windows))  # shuffled, complete


def test_vocabulary_and_option_errors(tmp_path: Path) -> None:
    big = tmp_path / "u.txt"
    big.write_text("\u00e9" * 100, encoding="utf-8")  # bytes 195, 169: fine for vocab 256
    rp = _rp(data_files=(str(big),))
    Dataset(rp.model, rp.train, rp.global_batch)
    from tests.test_runner_hf import _plan_dp_tp

    with pytest.raises(ValueError, match="--data-file and --tokenizer need --data text"):
        build_runner_plan(_plan_dp_tp(), load_instance("hf-llama-tiny-2r"), ExportOptions(data_files=(str(big),)))
    with pytest.raises(ValueError, match="nope.txt: no such file"):
        _rp(data_files=(str(tmp_path / "nope.txt"),))


def test_text_training_lowers_the_loss_and_resume_continues_the_stream(tmp_path: Path) -> None:
    from hgopt.runner.checkpoint import load_full_state
    from hgopt.runner.summary import read_metrics
    from tests.test_runner_hf import _run

    rp = _rp(lr=3e-3, steps=6, dtype="float32")
    _run(rp, tmp_path / "full")
    losses = [r["loss"] for r in read_metrics(tmp_path / "full")]
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0]
    _run(rp, tmp_path / "resumed", steps=3)
    _run(rp, tmp_path / "resumed", steps=6, resume=True)
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["loss"] for r in resumed] == losses  # steps 4-6 read the same samples as the uninterrupted run
    a, b = load_full_state(tmp_path / "full"), load_full_state(tmp_path / "resumed")
    assert all(torch.equal(a[n], b[n]) for n in a)
