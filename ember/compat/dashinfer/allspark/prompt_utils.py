"""DashInfer's PromptTemplate: wrap one user message in a ChatML conversation (system, user, open assistant turn)."""

from __future__ import annotations

from jinja2 import Template

_CHATML = Template("<|im_start|>system\n{{ system }}<|im_end|>\n"
                   "<|im_start|>user\n{{ user }}<|im_end|>\n"
                   "<|im_start|>assistant \n")


class PromptTemplate:
    @staticmethod
    def apply_chatml_template(inputs: str, system: str = "You are a helpful assistant.") -> str:
        """The ChatML prompt DashInfer builds for one user input (its text, not token ids)."""
        return _CHATML.render(system=system, user=inputs)
