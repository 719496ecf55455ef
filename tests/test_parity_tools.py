"""``tool_config_path``: the tool schemas verl 0.6.1 and 0.9.1 give the chat template in their overlong filter, against
those releases themselves. A Qwen2.5 template (it prints the tools into the system turn) makes the schemas count: with
them some prompts are over the limit that are under it without. The rows themselves are rendered without tools, as
verl renders them. Image prompts too: the processor's template with a tools block in front."""

from __future__ import annotations

import shutil

import pytest
import yaml

from ingest.config import DataConfig
from ingest.demo import write_gsm8k_parquet
from ingest.tokenizer.chat import ChatTokenizer
from ingest.tool_schemas import tool_schemas
from tests.support import formats
from tests.support.compare import assert_same_batches
from tests.support.templates import QWEN25_TEMPLATE, template_dir
from tests.support.tiers import slow
from tools.oracle import oracle_available

BATCH = 8
LIMIT = 300  # the gsm8k prompts here: 72-106 tokens without the tools, 291-325 with them
TOOL_CONFIG = {
    "tools": [
        {
            "class_name": "verl.tools.base_tool.BaseTool",
            "config": {"type": "native"},
            "tool_schema": {
                "function": {  # keys out of verl's field order, an unknown key, a None: verl's dump reorders / drops
                    "description": "Score an answer to a grade-school math problem (1.0 if it is right, else 0.0).",
                    "name": "calc_gsm8k_reward",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "answer": {"description": "The answer, digits only.", "type": "string", "default": "0"},
                            "unit": {"type": "string", "enum": ["apples", "dollars"], "description": None},
                        },
                        "required": ["answer"],
                    },
                },
                "type": "function",
            },
        },
        {
            "class_name": "verl.tools.base_tool.BaseTool",
            "config": {"type": "native"},
            "tool_schema": {"type": "function", "function": {"name": "noop", "description": "Does nothing."}},
        },
    ]
}


@pytest.fixture(scope="module")
def tool_data(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tools")
    path = out / "tools.yaml"
    path.write_text(yaml.safe_dump(TOOL_CONFIG, sort_keys=False))
    model = template_dir(out / "qwen25", model_dir, QWEN25_TEMPLATE)
    files = [str(f) for f in write_gsm8k_parquet(out / "data", 120, num_files=1, variety=True, long_every=0)]
    return files, model, str(path)


def test_schemas_are_verls_dump_of_the_file(tmp_path):
    formats.skip_unless_formats_allowed("verl-0.5", "verl-0.6")
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump(TOOL_CONFIG, sort_keys=False))
    first, second = tool_schemas(path)
    assert list(first) == ["type", "function"] and list(first["function"]) == ["name", "description", "parameters"]
    assert first["function"]["parameters"]["properties"] == {
        "answer": {"type": "string", "description": "The answer, digits only."},
        "unit": {"type": "string", "enum": ["apples", "dollars"]},
    }
    assert second == {"type": "function", "function": {"name": "noop", "description": "Does nothing."}}
    assert DataConfig(tool_config_path=str(path), row_format="verl-0.6").tool_schemas == [first, second]
    assert DataConfig(tool_config_path=str(path)).tool_schemas is None  # verl 0.5.0 does not read it


def test_tool_files_verl_would_drop_are_errors(tmp_path):
    formats.skip_unless_formats_allowed("verl-0.6", "verl-0.9")
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [{"class_name": "my.Tool", "config": {"type": "native"}}]}))
    with pytest.raises(ValueError, match="tool 0 \\(my.Tool\\) has no tool_schema"):
        DataConfig(tool_config_path=str(path), row_format="verl-0.9")
    path.write_text(yaml.safe_dump({"tools": [{**TOOL_CONFIG["tools"][1], "tool_schema": {"type": "function",
        "function": {"name": "f", "description": "d", "strict": None}}}]}))  # fmt: skip
    with pytest.raises(ValueError, match="function has a null strict"):  # verl's validation fails on it too
        DataConfig(tool_config_path=str(path), row_format="verl-0.6")
    with pytest.raises(ValueError, match="function_tool_path"):
        DataConfig(function_tool_path="tools.py", row_format="verl-0.9")


@slow
@pytest.mark.parametrize("row_format", ["verl-0.6", "verl-0.7", "verl-0.9"])
def test_filter_with_tools_equals_verl(ray_session, tool_data, tmp_path, row_format):
    if not oracle_available(row_format):
        pytest.skip(f"the {row_format} oracle is not installed (make oracle)")
    files, model, tools = tool_data
    config = {"max_prompt_length": LIMIT, "filter_overlong_prompts": True, "truncation": "right"}
    with_tools = {**config, "tool_config_path": tools}
    expected = formats.verl(files, model, [with_tools, config], tmp_path, row_format, BATCH)
    assert not any("error" in run for run in expected), [run.get("error") for run in expected]
    ours = formats.ours(files, model, with_tools, row_format, BATCH)
    assert_same_batches(ours, expected[0]["batches"])
    kept_with, kept_without = (sum(len(b["index"]) for b in run["batches"]) for run in expected)
    assert 0 < kept_with < kept_without == 120  # the schemas decide some rows: the check above is not vacuous
    prompt = [{"role": "user", "content": "hi"}]
    tokenizer = ChatTokenizer(model)
    assert "calc_gsm8k_reward" in tokenizer.render(prompt, tools=tool_schemas(tools))


# the tools block of the Qwen2.5 template, in front of the offline processor's own (Qwen2-VL) template
TOOLS_BLOCK = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "\n</tools><|im_end|>\n{%- endif %}"
)


@slow
@pytest.mark.parametrize("row_format", ["verl-0.6", "verl-0.9"])
def test_filter_with_tools_on_image_prompts_equals_verl(ray_session, geo3k_files, model_dir, tmp_path, row_format):
    """verl's processor path renders the image prompt with the tools where it measures it; ours adds the schemas'
    tokens to the expanded length measured from the image headers."""
    if not oracle_available(row_format):
        pytest.skip(f"the {row_format} oracle is not installed (make oracle)")
    model = tmp_path / "vl-tools"
    shutil.copytree(model_dir, model)
    template = model / "chat_template.jinja"
    template.write_text(TOOLS_BLOCK + template.read_text())
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump(TOOL_CONFIG, sort_keys=False))
    config = {"max_prompt_length": 900, "filter_overlong_prompts": True, "truncation": "right"}
    with_tools = {**config, "tool_config_path": str(tools)}
    runs = formats.verl(geo3k_files, str(model), [with_tools, config], tmp_path, row_format, BATCH, str(model))
    assert not any("error" in run for run in runs), [run.get("error") for run in runs]
    ours = formats.ours(geo3k_files, str(model), with_tools, row_format, BATCH, processor=str(model))
    assert_same_batches(ours, runs[0]["batches"])
    kept_with, kept_without = (sum(len(b["index"]) for b in run["batches"]) for run in runs)
    assert 0 < kept_with < kept_without  # the schemas decide some image rows
