"""A checkpoint's transformers processor. Processors that also hold a video processor (Qwen2-VL) fail to load
without torchvision, though images alone never need it: then the processor class is built from its tokenizer and
image processor with no video processor (ember takes images only), so the same transformers code expands and
preprocesses each image."""

from __future__ import annotations

import json
import os
from typing import Any


def load_processor(path: str) -> Any:
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=False)  # an auto_map is never run
    except ImportError as e:
        if "orchvision" not in str(e):
            raise
        return _without_video(path)


def _without_video(path: str) -> Any:
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    cls = getattr(transformers, PROCESSOR_MAPPING_NAMES[model_type])

    class ImagesOnly(cls):  # the class check of the absent video processor is the one thing skipped
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    images = AutoImageProcessor.from_pretrained(path, trust_remote_code=False)
    return ImagesOnly(image_processor=images, tokenizer=tokenizer,
                      video_processor=None, chat_template=getattr(tokenizer, "chat_template", None))
