"""The tool schemas verl 0.6 and later give the chat template in their overlong filter (``data.tool_config_path``).

verl instantiates each tool of its tool config (YAML: ``tools: [{class_name, config: {type: native}, tool_schema}]``)
and passes ``tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)`` as ``tools=`` to
``apply_chat_template`` when it measures a prompt; only there: the rows' ids are rendered without them. The dump is a
pydantic model's (``OpenAIFunctionToolSchema``): the fields the file sets, in the model's field order, None values and
keys the model does not know dropped. A template that prints the tools (``tool | tojson``) then counts the same
tokens here only if the dicts are the same, key order included, so ``tool_schemas`` builds them that way, from the
file alone: no tool class is imported.

Where verl falls back to no tools (a tool whose class supplies its schema, a tool type other than ``native``, a null
where the model allows none, a file that does not load: it logs a warning and measures without tools), this is an
error naming the file and the tool.
"""

from __future__ import annotations

import os
from typing import Any

# OpenAIFunctionToolSchema and its parts (verl/tools/schemas.py), field order as declared
_FIELDS = {
    "tool": ("type", "function"),
    "function": ("name", "description", "parameters", "strict"),
    "parameters": ("type", "properties", "required"),
    "property": ("type", "description", "enum"),
}
_REQUIRED = {
    "tool": ("type", "function"),
    "function": ("name", "description"),
    "parameters": ("type", "properties"),
    "property": ("type",),
}
_PARTS = {("tool", "function"): "function", ("function", "parameters"): "parameters"}
_NULLABLE = {("property", "description"), ("property", "enum")}  # the model's only optional fields


def tool_schemas(path: str | os.PathLike) -> list[dict]:
    """The schemas of the tools in verl tool config ``path``, as verl passes them to the chat template."""
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"data.tool_config_path {os.fspath(path)!r} does not load: {exc}") from exc
    tools = (config or {}).get("tools") if isinstance(config, dict) else None
    if not isinstance(tools, list):
        raise ValueError(f"data.tool_config_path {os.fspath(path)!r} has no 'tools' list")
    schemas = []
    for k, tool in enumerate(tools):
        name = f"tool {k} ({tool.get('class_name')})" if isinstance(tool, dict) else f"tool {k}"
        where = f"data.tool_config_path {os.fspath(path)!r}, {name}"
        if not isinstance(tool, dict) or (tool.get("config") or {}).get("type") != "native":
            raise ValueError(f"{where}: only config.type 'native' tools are read (verl 0.6-0.9 supports no other)")
        if tool.get("tool_schema") is None:
            raise ValueError(
                f"{where} has no tool_schema: its class would supply one, which needs verl's code; write the schema "
                "in the file"
            )
        schemas.append(_dump(tool["tool_schema"], "tool", where))
    return schemas


def _dump(value: Any, part: str, where: str) -> dict:
    """``model_dump(exclude_unset=True, exclude_none=True)`` of ``value`` validated as schema part ``part``."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: the tool schema's {part} must be a mapping, got {type(value).__name__}")
    missing = [key for key in _REQUIRED.get(part, ()) if value.get(key) is None]
    if missing:
        raise ValueError(f"{where}: the tool schema's {part} has no {', '.join(missing)}")
    nulls = [key for key in _FIELDS[part] if key in value and value[key] is None and (part, key) not in _NULLABLE]
    if nulls:
        raise ValueError(f"{where}: the tool schema's {part} has a null {', '.join(nulls)}")
    out = {}
    for key in _FIELDS[part]:
        if value.get(key) is None:  # unset, or a null the model allows: not in its dump (exclude_none)
            continue
        item = value[key]
        if (part, key) in _PARTS:
            item = _dump(item, _PARTS[part, key], where)
        elif (part, key) == ("parameters", "properties"):
            item = {name: _dump(prop, "property", where) for name, prop in item.items()}
        out[key] = item
    return out
