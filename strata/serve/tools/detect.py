"""Which tool-call format a chat template speaks, read off the template's text."""

from __future__ import annotations

import re

from strata.serve.tools.format import ToolFormat
from strata.serve.tools.generic import GenericFormat
from strata.serve.tools.hermes import OPEN, HermesFormat
from strata.serve.tools.llama3_json import PYTHON_TAG, Llama3JsonFormat
from strata.serve.tools.mistral import ARGS, TOOL_CALLS, MistralFormat

_TOOLS = re.compile(r"\btools\b")


def template_supports_tools(template: str | None) -> bool:
    """Whether the template reads a `tools` variable at all."""
    return template is not None and _TOOLS.search(template) is not None


def format_for_template(template: str | None) -> ToolFormat:
    """The format the template renders calls in; generic when it shows none we know.

    A template that reads `tools` but writes calls in a syntax not listed
    here also gets the generic format: it is then prompted and parsed in the
    Hermes style, with the tools described in a system message.
    """
    if template is None or not template_supports_tools(template):
        return GenericFormat()
    if OPEN in template:
        return HermesFormat()
    if TOOL_CALLS in template:
        return MistralFormat(named_calls=ARGS in template)
    if PYTHON_TAG in template or "ipython" in template or '"parameters": ' in template:
        return Llama3JsonFormat()
    return GenericFormat()
