"""``ingest.verl``: the dataloader adapter inside verl's own trainer code, each release in its oracle environment, on
CPU. ``RayPPOTrainer`` of verl 0.5.0, 0.6.1, 0.7.1 and 0.9.1 (legacy): datasets from its ``TaskRunner``'s
``create_rl_dataset`` with ``data.custom_cls`` = ``IngestDataset``, ``_create_dataloader`` and its steps arithmetic,
``fit``'s lines on every batch up to the rollout hand-off. verl 0.9.1's v1 trainers: ``_init_dataloader``, each
step's ``_add_batch_to_generate`` into a real TransferQueue. Both: ``data.pt`` saved and loaded by verl's own lines,
and an exact resume."""

from __future__ import annotations

import pytest
import torch

from ingest.demo import write_gsm8k_parquet
from ingest.verl import IngestDataset, VerlDataLoader
from ingest.verl.dataset import CUSTOM_CLS
from ingest.verl.length import CACHE_FILE
from tests.support import formats
from tests.support.tiers import first_fast, slow
from tools.oracle import oracle_available, run_verl

BATCH, EPOCHS, SAVE_AFTER = 8, 2, 5
# verl's generation pops per release: 0.5 / 0.6 pop the id tensors, 0.9 rows have none (dummy_tensor stays)
GEN_TENSORS = {"verl-0.5": ["attention_mask", "input_ids", "position_ids"], "verl-0.7": [], "verl-0.9": []}
GEN_TENSORS["verl-0.6"] = GEN_TENSORS["verl-0.5"]
# what stays in the batch: 0.5 pops its generation keys only (the uid comes later), 0.6 on keep the reward keys
REST = {"verl-0.5": ["ability", "data_source", "extra_info", "reward_model"]}
REST["verl-0.6"] = REST["verl-0.7"] = REST["verl-0.9"] = ["data_source", "extra_info", "reward_model", "uid"]


@pytest.fixture(scope="module")
def trainer_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer-data")
    train = write_gsm8k_parquet(root / "train", 120, num_files=2, row_group_size=20, long_every=7)
    val = write_gsm8k_parquet(root / "val", 20, num_files=1, row_group_size=20)
    return train, val


def _data_config(train, val, row_format, cache_dir) -> dict:
    return {
        "train_files": train,
        "val_files": val,
        "train_batch_size": BATCH,
        "val_batch_size": None,
        "max_prompt_length": 160,  # the long rows are filtered: the footers overcount
        "filter_overlong_prompts": True,
        "truncation": "left",
        "shuffle": True,
        "seed": 7,
        "dataloader_num_workers": 0,
        "validation_shuffle": False,
        "cache_dir": str(cache_dir),
        "row_format": row_format,
        "custom_cls": dict(CUSTOM_CLS),  # verl's own create_rl_dataset builds IngestDataset, not RLHFDataset
        "sampler": None,  # as verl's data config: no curriculum sampler
    }


@pytest.mark.parametrize("row_format", first_fast(["verl-0.5", "verl-0.6", "verl-0.7", "verl-0.9"]))
def test_adapter_in_verls_own_trainer_code(ray_session, trainer_data, model_dir, tmp_path, row_format):
    if not oracle_available(row_format):
        pytest.skip(f"the {row_format} oracle is not installed (make oracle)")
    train, val = trainer_data
    data = _data_config(train, val, row_format, tmp_path / "cache")
    ours = VerlDataLoader(train, model_dir, data, BATCH)
    rows = sum(len(next(iter(batch.values()))) for batch in VerlDataLoader(train, model_dir, data, 1, drop_last=False))
    assert rows == ours.num_rows < 120  # exact: the filter's rows are not counted (and now cached)
    assert (tmp_path / "cache" / CACHE_FILE).is_file()
    spec = {
        "trainer_config": {
            "data": data,
            "trainer": {"total_epochs": EPOCHS, "total_training_steps": None, "default_local_dir": str(tmp_path)},
            "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}}, "rollout": {"n": 2, "temperature": 1.0}},
            "critic": {"optim": {"lr": 1e-5}},
        },
        "checkpoint_dir": str(tmp_path / "checkpoints"),
        "save_after": SAVE_AFTER,
    }
    result = run_verl("trainer", [], model_dir, None, row_format=row_format, timeout=900, **spec)
    assert result["dataset_classes"] == ["IngestDataset", "IngestDataset"]
    steps_per_epoch = rows // BATCH
    assert result["len_train"] == steps_per_epoch and result["len_val"] == 1
    assert result["total_training_steps"] == steps_per_epoch * EPOCHS
    assert result["optim_steps"] == result["critic_steps"] == steps_per_epoch * EPOCHS
    assert result["val_batches"] == [20]
    whole = result["uninterrupted"]
    assert len(whole) == steps_per_epoch * EPOCHS  # len() promised exactly the batches the epochs gave
    for step in whole:
        assert step["gen_tensors"] == GEN_TENSORS[row_format]
        assert step["rest_non_tensors"] == REST[row_format]
        assert step["repeated"] == 2 * BATCH
    for epoch in range(EPOCHS):
        indices = [i for step in whole[epoch * steps_per_epoch : (epoch + 1) * steps_per_epoch] for i in step["index"]]
        assert len(set(indices)) == len(indices)  # no row twice in an epoch
    assert [s["index"] for s in whole[:steps_per_epoch]] != [s["index"] for s in whole[steps_per_epoch:]]
    # data.pt by verl's own save and load lines: the resumed trainer runs exactly the steps not yet run
    assert len(result["before"]) == SAVE_AFTER
    assert [s["index"] for s in result["before"] + result["after"]] == [s["index"] for s in whole]
    assert "torch.save(dataloader_state_dict" in result["save_lines"]
    assert "load_state_dict(dataloader_state_dict)" in result["load_lines"]
    assert ("sampler.update" in result["sampler_lines"]) == (row_format != "verl-0.9")  # ran after every step


@slow
@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_adapter_in_verl_09_v1_trainer(ray_session, trainer_data, model_dir, tmp_path, mode):
    """verl 0.9.1's default trainer (``trainer.use_v1``). ``sync`` fetches ``train_batch_size`` prompts per step;
    the async modes make verl set ``gen_batch_size`` to 1 (one prompt per fetch) and persist each prompt's fields in
    TransferQueue. Steps straddle epochs there as with verl's own loader (batches of one drop no row)."""
    if not oracle_available("verl-0.9"):
        pytest.skip("the verl-0.9 oracle is not installed (make oracle)")
    train, val = trainer_data
    data = _data_config(train, val, "verl-0.9", tmp_path / "cache")
    rows = IngestDataset(train, model_dir, None, data).num_rows
    spec = {
        "trainer_config": {
            "data": data,
            "trainer": {
                "total_epochs": EPOCHS,
                "total_training_steps": None,
                "v1": {"trainer_mode": mode, "sampler": {}, mode: {"num_warmup_batches": 1.5}},
            },
            "algorithm": {"filter_groups": None},
            "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}}},
            "critic": {"optim": {"lr": 1e-5}},
        },
        "checkpoint_dir": str(tmp_path / "checkpoints"),
        "save_after": SAVE_AFTER,
    }
    result = run_verl("trainer_v1", [], model_dir, None, row_format="verl-0.9", timeout=900, **spec)
    assert result["dataset_classes"] == ["IngestDataset", "IngestDataset"]
    # verl's agent loop extracts each prompt's media through the class data.custom_cls names: verl's own helper
    assert result["agent_loop"] == {"dataset_class": "IngestDataset", "images": 2, "equal": True, "videos": None}
    gen_batch = BATCH if mode == "sync" else 1
    assert result["gen_batch_size"] == (None if mode == "sync" else 1)
    # single-prompt fetches: handed-off media stay held for two steps and the warm-up's (not for two prompts)
    assert result["media_handoff_held"] == (None if mode == "sync" else BATCH * (2 + 2))
    steps_per_epoch = rows // BATCH
    assert result["len_train_dataset"] == rows and result["len_train"] == rows // gen_batch
    assert result["steps_per_epoch"] == steps_per_epoch
    assert result["total_training_steps"] == result["optim_steps"] == steps_per_epoch * EPOCHS
    assert result["val_batches"] == [20] and result["len_val"] == 1
    whole = result["uninterrupted"]
    assert len(whole) == steps_per_epoch * EPOCHS
    for step in whole:
        assert "raw_prompt" in step["keys"] and "uid" in step["keys"] and len(step["index"]) == BATCH
        assert step["registered"]  # every prompt of the step is in TransferQueue, tagged with the step
        assert step.get("stored_index", step["index"]) == step["index"]
    indices = [i for step in whole for i in step["index"]]
    epoch_rows = rows // gen_batch * gen_batch  # what one pass of the loader yields (drop_last)
    first_epoch, second = indices[:epoch_rows], indices[epoch_rows:]
    assert len(set(first_epoch)) == epoch_rows and len(set(second)) == len(second)  # no row twice in an epoch
    assert first_epoch != second[: len(first_epoch)]
    # data.pt by the v1 trainer's own save and load lines: the resumed trainer fetches exactly what was left
    assert len(result["before"]) == SAVE_AFTER
    assert [s["index"] for s in result["before"] + result["after"]] == [s["index"] for s in whole]
    assert "torch.save(self.train_dataloader.state_dict()" in result["save_lines"]
    assert "load_state_dict(dataloader_state_dict)" in result["load_lines"]


def test_state_survives_torch_save_and_load(ray_session, trainer_data, model_dir, tmp_path):
    """``data.pt`` as verl writes and reads it (``torch.save``; ``torch.load(weights_only=False)``, and the safe
    ``weights_only=True`` too: the state is plain JSON values)."""
    formats.skip_unless_formats_allowed("verl-0.5")
    train, _ = trainer_data
    data = _data_config(train, train, "verl-0.5", tmp_path / "cache")
    loader = VerlDataLoader(train, model_dir, data, BATCH)
    seen = []
    for i, batch in enumerate(loader):
        seen.append(batch["input_ids"])
        if i == 2:
            torch.save(loader.state_dict(), tmp_path / "data.pt")
            break
    whole = [b["input_ids"] for b in VerlDataLoader(train, model_dir, data, BATCH)]
    for weights_only in (False, True):
        resumed = VerlDataLoader(train, model_dir, data, BATCH, num_rows=loader.num_rows)
        resumed.load_state_dict(torch.load(tmp_path / "data.pt", weights_only=weights_only))
        rest = [b["input_ids"] for b in resumed]
        assert len(seen) + len(rest) == len(whole) == len(loader)
        assert all(torch.equal(a, b) for a, b in zip(seen[:3] + rest, whole, strict=True))


def test_epoch_count_is_cached_and_recounted_when_the_data_changes(ray_session, model_dir, tmp_path):
    """``len()``'s count is kept per files + config + models; a file rewritten with the same row groups but other
    prompts (more of them overlong) is counted again, never answered from the stale entry."""
    formats.skip_unless_formats_allowed("verl-0.5")
    import os

    from ingest.config import DataConfig
    from ingest.verl.length import count_rows

    config = DataConfig(max_prompt_length=160, filter_overlong_prompts=True, cache_dir=str(tmp_path / "cache"))
    files = write_gsm8k_parquet(tmp_path / "a", 60, num_files=1, row_group_size=20, long_every=10)
    first = count_rows(files, model_dir, config)
    assert first == count_rows(files, model_dir, config) < 60  # the second answer comes from the cache
    stat = os.stat(files[0])
    write_gsm8k_parquet(tmp_path / "a", 60, num_files=1, row_group_size=20, long_every=3)  # same path and row groups
    os.utime(files[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert count_rows(files, model_dir, config) < first
    unfiltered = DataConfig(filter_overlong_prompts=False, truncation="left", cache_dir=str(tmp_path / "cache"))
    assert count_rows(files, model_dir, unfiltered) == 60  # another config: its own count


@pytest.mark.parametrize("media", [False, True], ids=["text", "images"])
def test_epoch_count_through_the_pipeline_on_several_nodes_equals_the_drivers(
    ray_session, model_dir, variety_files, geo3k_files, tmp_path, monkeypatch, media
):
    """On a multi-node cluster the count runs through the pipeline (``PromptStream``) instead of in the driver; both
    give the rows the epoch yields."""
    formats.skip_unless_formats_allowed("verl-0.5")
    from ingest.config import DataConfig
    from ingest.datasets.plan import plan_input
    from ingest.verl import length

    files, processor = (geo3k_files, model_dir) if media else (variety_files, None)
    config = DataConfig(max_prompt_length=400, truncation="left", cache_dir=str(tmp_path / "cache"))
    here = length.count_rows_here(plan_input(files, config, multimodal=media), model_dir, config, processor)
    monkeypatch.setattr(length, "_on_several_nodes", lambda: True)
    streamed = []
    monkeypatch.setattr(length, "_num_rows", lambda table: streamed.append(table.num_rows) or table.num_rows)
    assert length.count_rows(files, model_dir, config, processor, cache=False) == here
    assert sum(streamed) == here  # counted from the stream's blocks
