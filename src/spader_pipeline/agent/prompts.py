"""Prompt templates: the first user message of every trajectory.

Templates live in configuration (``conf/base/parameters.yml`` → ``prompt.templates``); this module
only renders them. A template is a string with one ``{question}`` placeholder. The rendered prompt is
a list of chat messages, the shape VERL's ``RLHFDataset`` reads from the ``prompt`` column and every
chat-template tokenizer accepts.
"""

from __future__ import annotations

from collections.abc import Mapping


class PromptTemplateError(ValueError):
    """A template is missing or does not contain exactly the ``{question}`` placeholder."""


def resolve_template(prompt_params: Mapping) -> str:
    """Pick the active template text from the ``prompt`` parameter block.

    ``prompt_params`` is ``{"template": <name>, "templates": {<name>: <text>, ...}}``.
    """
    name = prompt_params.get("template")
    templates = prompt_params.get("templates") or {}
    if name not in templates:
        raise PromptTemplateError(
            f"prompt.template={name!r} is not one of the configured templates {sorted(templates)}"
        )
    return templates[name]


def render_prompt(template: str, question: str, system: str | None = None) -> list[dict[str, str]]:
    """Render ``template`` for ``question`` as chat messages (optional system message first)."""
    if template.count("{question}") != 1:
        raise PromptTemplateError("a prompt template must contain the placeholder {question} exactly once")
    # str.replace, not str.format: templates contain literal JSON braces.
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": template.replace("{question}", question)})
    return messages
