"""verl 0.9 text rows (``ingest/stages/raw_prompt.py``): prompts short enough in ASCII characters are kept without
being encoded, and the rows and the filter's choices are exactly those of encoding every prompt."""

from __future__ import annotations

import pyarrow as pa

from ingest.config import DataConfig
from ingest.datasets.local import DriverUnits
from ingest.datasets.plan import plan_input


def _epoch(files: list[str], model_dir: str, config: DataConfig, *, char_bound: bool) -> tuple[pa.Table, int]:
    plan = plan_input(files, config)
    driver = DriverUnits(plan, config, plan.context(None, True, config.image_key), model_dir)
    tokenizer = driver.stage.tokenizer
    tokenizer.__dict__["ascii_ids_at_most_chars"] = char_bound and tokenizer.ascii_ids_at_most_chars
    encode, encoded = tokenizer.encode_batch, []
    tokenizer.encode_batch = lambda texts: encoded.extend(texts) or encode(texts)
    blocks = [block for unit in plan.units for block in driver(unit)]
    return pa.concat_tables(blocks), len(encoded)


def test_char_bound_changes_no_row_and_no_choice(variety_files, model_dir):
    # a limit that cuts through the prompts' lengths in characters (about 330-440 rendered): some pass by characters,
    # the others are encoded, and the long ones are filtered
    config = DataConfig.from_any(
        {"row_format": "verl-0.9", "filter_overlong_prompts": True, "max_prompt_length": 340, "shuffle": False}
    )
    bounded, bounded_encoded = _epoch(variety_files, model_dir, config, char_bound=True)
    exact, exact_encoded = _epoch(variety_files, model_dir, config, char_bound=False)
    assert bounded.equals(exact)
    assert 0 < bounded.num_rows < 210  # the filter dropped rows
    assert 0 < bounded_encoded < exact_encoded  # some prompts were kept unencoded, some needed their ids
