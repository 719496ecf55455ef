"""``python -m ingest.verl.main_ppo``: verl's own entry point (Hydra config, checks, task runner) of 0.5.0, 0.6.1,
0.7.1 and 0.9.1 (v1 and legacy trainers), each in its oracle environment, with the command line a verl user runs. On
this CPU machine the run goes through everything verl does before it places its GPU workers: the task runner, the
datasets (``IngestDataset`` through ``data.custom_cls``, counted by the pipeline), the trainer class (ours), verl's
dataloader code and step arithmetic; then verl's own resource check stops it, which is the expected end here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from ingest.demo import write_gsm8k_parquet
from tests.support.tiers import first_fast, matrix
from tools.oracle import oracle_available, oracle_environment

ROWS_KEPT, BATCH, EPOCHS = 103, 8, 2  # 120 rows, every 7th too long for 160 tokens
# a tiny Qwen2 config beside the offline tokenizer: verl 0.9 reads the model's config before it builds anything
MODEL_CONFIG = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
CASES = {  # id: (row format of the oracle, trainer class verl builds, overrides of that release)
    "verl-0.5": ("verl-0.5", "IngestRayPPOTrainer", ["ray_init.num_cpus=8"]),
    "verl-0.6": ("verl-0.6", "IngestRayPPOTrainer", ["ray_kwargs.ray_init.num_cpus=8"]),
    "verl-0.7": ("verl-0.7", "IngestRayPPOTrainer", ["ray_kwargs.ray_init.num_cpus=8"]),
    "verl-0.9-v1": (
        "verl-0.9",
        "IngestPPOTrainerSync",
        # TransferQueue's storage units take a CPU each (8 by default)
        ["ray_kwargs.ray_init.num_cpus=8", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"],
    ),
    "verl-0.9-legacy": ("verl-0.9", "IngestRayPPOTrainer", ["ray_kwargs.ray_init.num_cpus=8", "trainer.use_v1=false"]),
}


@matrix
@pytest.mark.parametrize("case", first_fast(list(CASES)))
def test_verls_entry_point_runs_on_the_pipeline(model_dir, tmp_path, case):
    row_format, trainer_name, release_overrides = CASES[case]
    if not oracle_available(row_format):
        pytest.skip(f"the {row_format} oracle is not installed (make oracle)")
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    train = write_gsm8k_parquet(tmp_path / "train", 120, num_files=2, row_group_size=20, long_every=7)
    val = write_gsm8k_parquet(tmp_path / "val", 20, num_files=1, row_group_size=20)
    overrides = [
        f"data.train_files=[{','.join(train)}]",
        f"data.val_files=[{','.join(val)}]",
        f"data.train_batch_size={BATCH}",
        "data.max_prompt_length=160",
        "data.filter_overlong_prompts=true",
        "data.truncation=left",
        f"data.cache_dir={tmp_path / 'cache'}",  # a key verl's config lacks, typed as the user types it
        "data.tokenizer_pool_max_size=1",
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        "critic.ppo_micro_batch_size_per_gpu=1",
        "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_epochs={EPOCHS}",
        "trainer.logger=[console]",
        *release_overrides,
    ]
    run = subprocess.run(
        [sys.executable, "-m", "ingest.verl.main_ppo", *overrides],
        env=oracle_environment(row_format, tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = run.stdout + run.stderr
    assert run.returncode != 0 and "Total available GPUs 0 is less than total desired GPUs 1" in output, output[-3000:]
    assert f"[ingest] verl's task runner trains with {trainer_name}" in output
    assert output.count("Using dataset class: IngestDataset") == 2 and "RLHFDataset" not in output
    assert f"counted {ROWS_KEPT} rows per epoch" in output
    steps = ROWS_KEPT // BATCH
    assert f"Total training steps: {steps * EPOCHS}" in output  # verl's own arithmetic over our length
    assert f"{trainer_name}: the train and val dataloaders are the ingest pipeline's ({steps} and 1 batches" in output


@matrix
@pytest.mark.parametrize("release", first_fast(["verl-0.9", "verl-0.5", "verl-0.6", "verl-0.7"]))
def test_the_embedded_tokenizer_folder_is_a_model_path_verl_loads(model_dir, tmp_path, release):
    """``python -m ingest make-tokenizer``'s folder as ``actor_rollout_ref.model.path``: the release's own
    ``hf_tokenizer`` and ``hf_processor`` load it (``hf_processor`` reads the model type from ``config.json``:
    without one, verl 0.9.1's returns None)."""
    if not oracle_available(release):
        pytest.skip(f"the {release} oracle is not installed (make oracle)")
    code = (
        "import sys; from verl.utils import hf_processor, hf_tokenizer; "
        "print(type(hf_processor(sys.argv[1])).__name__, hf_tokenizer(sys.argv[1]).encode('Hello world'))"
    )
    env = oracle_environment(release, tmp_path)
    done = subprocess.run([sys.executable, "-c", code, model_dir], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "Qwen2VLProcessor [9707, 1879]", done.stdout[-2000:]


def test_the_pipelines_data_keys_work_typed_plain_or_with_a_plus():
    """Hydra refuses ``data.media_handoff=true`` (verl's config lacks the key) and ``+data.max_prompt_length=...``
    (it has that one): ``main_ppo`` makes each ``DataConfig`` key ``++`` (add or override), so both forms work."""
    from ingest.verl.main_ppo import with_data_keys_added

    given = ["data.media_handoff=true", "+data.cache_dir=/c", "data.max_prompt_length=64", "trainer.use_v1=false"]
    given += ["data.media_handoff_ahead=8", "data.unknown=1", "actor_rollout_ref.model.path=/m", "~data.seed"]
    assert with_data_keys_added(given) == [
        "++data.media_handoff=true",
        "+data.cache_dir=/c",
        "++data.max_prompt_length=64",
        "trainer.use_v1=false",
        "++data.media_handoff_ahead=8",
        "data.unknown=1",
        "actor_rollout_ref.model.path=/m",
        "~data.seed",
    ]


def test_max_samples_draw_is_seeded_as_verls_and_made_once(model_dir, tmp_path):
    """verl 0.9.1 draws ``max_samples`` rows seeded by ``data.seed`` where ``data.shuffle`` (unseeded where the seed
    is null), else takes the first rows: ``IngestDataset`` keeps that seed, or draws one once, so the count and every
    epoch read the same rows; the trainer's stand-ins take each split's ``*_max_samples``."""
    from omegaconf import OmegaConf

    from ingest.verl import IngestDataset
    from ingest.verl.trainer import _stand_in

    files = write_gsm8k_parquet(tmp_path / "data", 8, num_files=1)
    seeded = IngestDataset(files, model_dir, None, {"shuffle": True, "seed": 7}, max_samples=5)
    assert seeded.config["max_samples"] == 5 and seeded.config["max_samples_seed"] == 7
    assert (
        IngestDataset(files, model_dir, None, {"shuffle": False, "seed": 7}, max_samples=5).config["max_samples_seed"]
        is None
    )
    unseeded = [IngestDataset(files, model_dir, None, {"shuffle": True, "seed": None}, max_samples=5) for _ in "ab"]
    assert len({dataset.config["max_samples_seed"] for dataset in unseeded}) == 2  # verl's draw is unseeded there
    assert "max_samples" not in IngestDataset(files, model_dir, None, {}, max_samples=-1).config
    data = OmegaConf.create({"train_max_samples": 6, "val_max_samples": -1, "shuffle": False})
    assert _stand_in(None, files, model_dir, None, data, "train").config["max_samples"] == 6
    assert "max_samples" not in _stand_in(None, files, model_dir, None, data, "val").config


def test_another_dataset_class_is_refused(model_dir, tmp_path):
    """The pipeline makes the rows: a ``data.custom_cls`` naming another class is an error before anything is read
    (verl 0.9's ``train_max_samples``: ``tests/test_parity_verl09.py``)."""
    from omegaconf import OmegaConf

    from ingest.verl import IngestDataset
    from ingest.verl.dataset import select_ingest_dataset

    config = OmegaConf.create({"data": {"custom_cls": {"path": "pkg://my.datasets", "name": "Mine"}}})
    with pytest.raises(ValueError, match="selects Mine from pkg://my.datasets"):
        select_ingest_dataset(config)
    config = OmegaConf.create({"data": {"custom_cls": {"path": None, "name": None}}})
    select_ingest_dataset(config)
    assert config.data.custom_cls == {"path": "pkg://ingest.verl.dataset", "name": "IngestDataset"}
    files = write_gsm8k_parquet(tmp_path / "data", 8, num_files=1)
    with pytest.raises(TypeError, match="holds no rows"):
        IngestDataset(files, model_dir, None, {}, max_samples=-1)[0]
