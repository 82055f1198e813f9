"""The prepared data kept in the run directory: reused only when every input matches, a damaged
or foreign file is one line and a fresh preparation, never an error."""

import json
import shutil

import numpy as np
import pytest

from tests.data.conftest import write_jsonl
from workloads.data import pipeline, prepared_cache, synthetic


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "codev.jsonl"
    synthetic.write_synthetic_codev(str(path), 40, seed=3)
    return path


@pytest.fixture
def model_dir(tmp_path, tiny_tokenizer_dir):
    out = tmp_path / "model"
    shutil.copytree(tiny_tokenizer_dir, out)
    (out / "model-00001-of-00001.safetensors").write_bytes(b"weights are not in the key")
    return out


class Tokenizers:
    """make_tokenizer that counts its calls (a call = the data was prepared, not read back)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.tokenizer


def run(cfg, model_dir, tokenizers, lines=None, *, host_index=0, host_count=1, write=True):
    return prepared_cache.prepare_cached(
        cfg,
        str(model_dir),
        tokenizers,
        host_index=host_index,
        host_count=host_count,
        write=write,
        log=(lines.append if lines is not None else None),
    )


def same_data(a, b):
    assert a.stats == b.stats
    assert a.rows == b.rows
    assert len(a.samples) == len(b.samples)
    for x, y in zip(a.samples, b.samples, strict=True):
        assert x.prompt_len == y.prompt_len
        np.testing.assert_array_equal(x.tokens, y.tokens)
    for epoch in (0, 1):
        for p, q in zip(a.batches(epoch), b.batches(epoch), strict=True):
            for field in ("tokens", "segment_ids", "positions", "loss_mask"):
                np.testing.assert_array_equal(getattr(p, field), getattr(q, field))


def test_a_restart_reads_the_prepared_data_back(dataset, model_dir, make_config, tiny_tokenizer):
    cfg = make_config(dataset, max_seq_len=512, micro_batch=2, max_rows=30)
    tokenizers = Tokenizers(tiny_tokenizer)
    first = run(cfg, model_dir, tokenizers)
    assert tokenizers.calls == 1
    lines = []
    second = run(cfg, model_dir, tokenizers, lines)
    assert tokenizers.calls == 1, "the second start tokenized again"
    same_data(first, second)
    same_data(second, pipeline.prepare(cfg, tiny_tokenizer, log=None))
    assert any("read back from" in line and "not tokenized again" in line for line in lines)
    assert any(line.startswith("data: ") and "rows read" in line for line in lines)


def test_each_host_gets_its_own_slice_of_the_read_back_data(
    dataset, model_dir, make_config, tiny_tokenizer
):
    cfg = make_config(dataset, max_seq_len=512, micro_batch=2)
    tokenizers = Tokenizers(tiny_tokenizer)
    run(cfg, model_dir, tokenizers)
    for host in (0, 1):
        read_back = run(cfg, model_dir, tokenizers, host_index=host, host_count=2)
        fresh = pipeline.prepare(cfg, tiny_tokenizer, host_index=host, host_count=2, log=None)
        assert (read_back.host_index, read_back.host_count) == (host, 2)
        same_data(read_back, fresh)
    assert tokenizers.calls == 1


def rewrite_row(dataset, index, **changes):
    rows = [json.loads(line) for line in dataset.read_text().splitlines()]
    rows[index].update(changes)
    write_jsonl(dataset, rows)


@pytest.mark.parametrize(
    "change",
    [
        "a row's response",
        "a row's prompt",
        "more rows read",
        "data.max_seq_len",
        "data.packing",
        "data.seed",
        "train.micro_batch",
        "the chat template",
        "the tokenizer's vocabulary file",
    ],
)
def test_any_changed_input_prepares_the_data_again(
    change, dataset, model_dir, make_config, tiny_tokenizer
):
    fields = {"max_seq_len": 512, "max_rows": 30}
    micro_batch = 2
    cfg = make_config(dataset, micro_batch=micro_batch, **fields)
    tokenizers = Tokenizers(tiny_tokenizer)
    run(cfg, model_dir, tokenizers)
    if change == "a row's response":
        rows = [json.loads(line) for line in dataset.read_text().splitlines()]
        rewrite_row(dataset, 5, response=rows[5]["response"] + "\n// changed")
    elif change == "a row's prompt":
        rewrite_row(dataset, 29, prompt="Write a different module.")
    elif change == "more rows read":
        fields["max_rows"] = 31
    elif change == "data.max_seq_len":
        fields["max_seq_len"] = 640
    elif change == "data.packing":
        fields["packing"] = False
    elif change == "data.seed":
        fields["seed"] = 1
    elif change == "train.micro_batch":
        micro_batch = 4
    elif change == "the chat template":
        template = next(p for p in model_dir.iterdir() if "template" in p.name)
        template.write_text(template.read_text() + "\n")
    else:
        vocabulary = model_dir / "tokenizer.json"
        vocabulary.write_text(vocabulary.read_text() + " ")
    cfg = make_config(dataset, micro_batch=micro_batch, **fields)
    lines = []
    again = run(cfg, model_dir, tokenizers, lines)
    assert tokenizers.calls == 2, f"{change}: the old preparation was reused"
    assert any("prepared from other inputs" in line for line in lines)
    same_data(again, pipeline.prepare(cfg, tiny_tokenizer, log=None))
    # ... and the file now holds the new preparation.
    run(cfg, model_dir, tokenizers)
    assert tokenizers.calls == 2


def test_rows_past_max_rows_and_the_weights_are_not_in_the_key(
    dataset, model_dir, make_config, tiny_tokenizer
):
    cfg = make_config(dataset, max_seq_len=512, max_rows=30)
    tokenizers = Tokenizers(tiny_tokenizer)
    run(cfg, model_dir, tokenizers)
    rewrite_row(dataset, 35, prompt="A row the run never reads.")
    (model_dir / "model-00001-of-00001.safetensors").write_bytes(b"other weights")
    run(cfg, model_dir, tokenizers)
    assert tokenizers.calls == 1


# Damage to the arrays of a well-formed file: name -> the arrays as written afterwards.
ARRAY_DAMAGE = {
    "a pickled array": lambda a: {**a, "tokens": np.array([object()], dtype=object)},
    "offsets past the tokens": lambda a: {**a, "sample_offsets": a["sample_offsets"] + 1},
    "a row naming a missing sample": lambda a: {**a, "row_items": a["row_items"] + 10_000},
    "an array missing": lambda a: {k: v for k, v in a.items() if k != "prompt_lens"},
    "metadata that is not an object": lambda a: {**a, "meta": np.frombuffer(b"[1]", np.uint8)},
}


def damage(path, kind):
    data = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "random bytes":
        path.write_bytes(np.random.default_rng(0).bytes(len(data)))
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        with np.load(path) as arrays:
            content = ARRAY_DAMAGE[kind](dict(arrays))
        with path.open("wb") as handle:
            np.savez(handle, **content)


@pytest.mark.parametrize(
    "kind",
    [
        "truncated",
        "random bytes",
        "empty",
        "a pickled array",
        "offsets past the tokens",
        "a row naming a missing sample",
        "an array missing",
        "metadata that is not an object",
    ],
)
def test_a_damaged_file_is_one_line_and_a_fresh_preparation(
    kind, dataset, model_dir, make_config, tiny_tokenizer
):
    cfg = make_config(dataset, max_seq_len=512, micro_batch=2)
    tokenizers = Tokenizers(tiny_tokenizer)
    first = run(cfg, model_dir, tokenizers)
    path = model_dir.parent / "run" / prepared_cache.FILE_NAME
    assert path.is_file()
    damage(path, kind)
    lines = []
    again = run(cfg, model_dir, tokenizers, lines)
    assert tokenizers.calls == 2
    notes = [line for line in lines if str(path) in line]
    assert len(notes) == 1 and "preparing the data again" in notes[0], lines
    assert "\n" not in notes[0] and "Traceback" not in notes[0]
    same_data(first, again)
    run(cfg, model_dir, tokenizers)  # repaired by the fresh preparation
    assert tokenizers.calls == 2


def test_a_run_directory_that_cannot_be_written_still_trains(
    dataset, model_dir, make_config, tiny_tokenizer, tmp_path
):
    cfg = make_config(dataset, max_seq_len=512)
    (tmp_path / "run").write_text("a file where the run directory should be")
    lines = []
    prepared = run(cfg, model_dir, Tokenizers(tiny_tokenizer), lines)
    same_data(prepared, pipeline.prepare(cfg, tiny_tokenizer, log=None))
    assert sum("could not keep the prepared data" in line for line in lines) == 1


def test_only_the_writing_host_stores_it(dataset, model_dir, make_config, tiny_tokenizer):
    cfg = make_config(dataset, max_seq_len=512, micro_batch=2)
    run(cfg, model_dir, Tokenizers(tiny_tokenizer), host_index=1, host_count=2, write=False)
    assert not (model_dir.parent / "run" / prepared_cache.FILE_NAME).exists()
