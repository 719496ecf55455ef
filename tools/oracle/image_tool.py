"""A verl tool that returns an image mid-trajectory (``ToolResponse(image=...)``), for the agent-loop comparisons of
``agent_loop.py``: the trajectory's media grow past the prompt's, so the hand-off must leave its training inputs to
verl. Imported by verl's tool loop from the tool config (``IMAGE_TOOL_CONFIG``), inside a verl oracle environment."""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from tools.oracle.agent_loop import tool_config

try:
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import ToolResponse
except ImportError:  # outside a verl environment (the tests' own): the image and the config only
    BaseTool = None

# the tool call the stand-in server makes on a session's first turn (hermes format, verl's default)
TOOL_CALL = '<tool_call>\n{"name": "crop_figure", "arguments": {"label": "ABC"}}\n</tool_call><|im_end|>'

IMAGE_TOOL_CONFIG = tool_config(
    "tools.oracle.image_tool.FigureCropTool", "crop_figure", "Crop the figure around an angle."
)


def cropped_figure() -> Image.Image:
    """The tool's image: the same pixels every call (a gradient, 84 x 56)."""
    y, x = np.mgrid[0:56, 0:84]
    return Image.fromarray(np.stack([x * 3, y * 4, (x + y) * 2], axis=-1).astype(np.uint8), "RGB")


if BaseTool is not None:

    class FigureCropTool(BaseTool):
        """Returns a text and one image for any call."""

        async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[Any, float, dict]:
            text = f"The figure around {parameters.get('label')}."
            return ToolResponse(text=text, image=[cropped_figure()]), 0.0, {}
