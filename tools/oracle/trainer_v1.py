"""verl 0.9's v1 trainer code with ``ingest_trainer``'s dataloaders, run inside the 0.9.1 oracle (``verl_runner.py
trainer_v1 SPEC``) on CPU, without worker groups: its own ``_init_dataloader`` (datasets through
``data.custom_cls``, ``gen_batch_size``, steps per epoch, the optimizers' step counts), its own
``_add_batch_to_generate`` each step (the dataloader fetches, the uids, the TensorDict, the prompts registered in a
real TransferQueue on a local Ray cluster, then the agent loop manager's ``generate_sequences``, recorded here), and
the dataloader lines of its own ``_save_checkpoint`` / ``_load_checkpoint`` (``data.pt``) followed by a resume.
"""

from __future__ import annotations

import os

from tools.oracle.verl_runner import _lines, _processor, _tokenizer, run_save_lines

SAVE_FROM = "local_mkdir_safe(local_global_step_folder)"
SAVE_TO = "torch.save(self.train_dataloader.state_dict(), dataloader_local_path)"
LOAD_FROM = 'dataloader_local_path = os.path.join(global_step_folder, "data.pt")'
LOAD_TO = 'logger.warning(f"Warning: No dataloader state found at {dataloader_local_path}, will start from scratch")'


class _RolloutRecorder:
    """Stands where ``AgentLoopManagerTQ`` is: the batches handed to the rollout."""

    def __init__(self):
        self.batches = []

    def generate_sequences(self, batch) -> None:
        self.batches.append(batch)


def _agent_loop_vision(data) -> dict:
    """What verl's agent loop gets from the dataset class it resolves (``get_dataset_class(config.data)``) for a
    prompt with two images, against ``RLHFDataset``'s own helper."""
    import asyncio

    import numpy as np
    from PIL import Image
    from verl.utils.dataset.rl_dataset import RLHFDataset, get_dataset_class

    dataset_cls = get_dataset_class(data)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((200, 300), (57, 1000))]
    messages = [
        {"role": "user", "content": [*({"type": "image", "image": i} for i in images), {"type": "text", "text": "?"}]}
    ]

    def extract(cls):
        return asyncio.run(cls.process_multi_modal_info(messages, image_patch_size=14, config=data))

    ours, verls = extract(dataset_cls), extract(RLHFDataset)
    same = len(ours[0]) == len(verls[0]) and all(
        a.size == b.size and a.mode == b.mode and a.tobytes() == b.tobytes()
        for a, b in zip(ours[0], verls[0], strict=True)
    )
    return {"dataset_class": dataset_cls.__name__, "images": len(ours[0]), "equal": same, "videos": ours[1]}


def trainer_v1(spec: dict) -> dict:
    import logging
    import sys

    import ray
    import torch
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import get_trainer_cls, trainer_base

    from ingest.verl import ingest_trainer

    # TransferQueue's controller and storage units take one CPU each; the pipeline's actors need theirs beside them
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    tq.init()
    source = open(sys.modules[trainer_base.__name__].__file__).read()
    save_lines = _lines(source, SAVE_FROM, SAVE_TO)
    load_lines = _lines(source, LOAD_FROM, LOAD_TO)
    mode = spec["trainer_config"]["trainer"]["v1"]["trainer_mode"]
    trainer_cls = ingest_trainer(get_trainer_cls(mode))

    def new_trainer():
        trainer = object.__new__(trainer_cls)  # no worker groups: only the data side of the trainer runs
        trainer.config = OmegaConf.create(spec["trainer_config"])
        trainer.tokenizer = _tokenizer(spec["tokenizer"])
        trainer.processor = _processor(spec.get("processor"))
        trainer.trainer_mode = mode  # what PPOTrainer.__init__ sets
        trainer.parameter_sync_step = trainer.config.trainer.v1.get(mode, {}).get("parameter_sync_step", 1)
        trainer.global_steps = 0
        trainer.agent_loop_manager = _RolloutRecorder()
        trainer._init_dataloader()
        return trainer

    def run(trainer, stop_after=None) -> list[dict]:
        steps = []
        while trainer.global_steps < trainer.total_training_steps:
            trainer.global_steps += 1
            trainer._add_batch_to_generate()  # verl's own: fetch, uid, TensorDict, TransferQueue, generate_sequences
            batch = trainer.agent_loop_manager.batches[-1]
            uids = list(batch["uid"])
            stored = tq.kv_list("train")["train"]
            step = {
                "keys": sorted(batch.keys()),
                "index": [int(i) for i in batch["index"]],
                "registered": all(stored[u]["global_steps"] == trainer.global_steps for u in uids),
            }
            if mode != "sync":  # async modes also persist the prompt fields in TransferQueue
                fields = tq.kv_batch_get(keys=uids, partition_id="train", select_fields=["index"])
                step["stored_index"] = [int(i) for i in fields["index"]]
            steps.append(step)
            if trainer.global_steps == stop_after:
                run_save_lines(save_lines, trainer, spec["checkpoint_dir"])
                break
        return steps

    first = new_trainer()
    data = first.config.data
    result = {
        "dataset_classes": [type(first.train_dataset).__name__, type(first.val_dataset).__name__],
        "gen_batch_size": data.get("gen_batch_size"),
        "media_handoff_held": first.train_dataloader.config.media_handoff_held,
        "len_train_dataset": len(first.train_dataset),
        "len_train": len(first.train_dataloader),
        "len_val": len(first.val_dataloader),
        "steps_per_epoch": first.steps_per_epoch,
        "total_training_steps": first.total_training_steps,
        "optim_steps": first.config.actor_rollout_ref.actor.optim.total_training_steps,
        "critic_steps": first.config.critic.optim.total_training_steps,
        "val_batches": [len(b["raw_prompt"]) for b in first.val_dataloader],
    }
    result["agent_loop"] = _agent_loop_vision(first.config.data)
    result["uninterrupted"] = run(first)
    tq.kv_clear(keys=list(tq.kv_list("train")["train"]), partition_id="train")
    before = new_trainer()
    result["before"] = run(before, stop_after=spec["save_after"])
    resumed = new_trainer()
    resumed.global_steps = spec["save_after"]
    folder = os.path.join(spec["checkpoint_dir"], f"global_step_{spec['save_after']}")
    exec(load_lines, {"self": resumed, "os": os, "torch": torch, "global_step_folder": folder, "logger": logging})
    result["after"] = run(resumed)
    result["save_lines"], result["load_lines"] = save_lines, load_lines
    tq.close()
    ray.shutdown()
    return result
