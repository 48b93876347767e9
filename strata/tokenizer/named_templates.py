"""Chat templates by name, as llama-server's `--chat-template NAME` takes them.

llama.cpp formats a chat for a named template with hand-written code
(`llama_chat_apply_template`); here each name is a Jinja template that gives
the same text, so it goes through the one renderer every template uses.
`tests/tokenizer/test_named_templates.py` checks each against the text
llama.cpp's own function produced for the same messages (recorded by
`tools/llama_templates.py`). Like llama-server, which tokenizes the result
with the model's special tokens, a named template starts with BOS where the
model's tokenizer adds one (`add_bos_token`).
"""

from __future__ import annotations

_BOS = "{%- if add_bos_token and bos_token %}{{ bos_token }}{% endif -%}\n"


_LOOP = "{%- for m in messages -%}{%- set c = m['content'] -%}{%- set role = m['role'] -%}"


def _template(each: str, generation: str | None, prefix: str = "") -> str:
    """BOS, `prefix` (a Jinja statement), `each` inside the loop over the messages (with `c`,
    the content, and `role` set), then `generation` when a generation prompt is asked for."""
    body = prefix + _LOOP + each + "{%- endfor -%}"
    if generation is not None:
        body += f"{{%- if add_generation_prompt -%}}{{{{- {generation} -}}}}{{%- endif -%}}"
    return _BOS + body


def _per_role(parts: dict[str, str], generation: str | None, other: str | None = None) -> str:
    """A template writing each message as `parts[role]` (Jinja expressions over `c` and `role`),
    messages of other roles as `other` (None: left out), and `generation` after them."""
    each = "".join(("{%- if" if i == 0 else "{%- elif") + f" role == '{role}' -%}}{{{{- {expr} -}}}}"
                   for i, (role, expr) in enumerate(parts.items()))
    if other is not None:
        each += f"{{%- else -%}}{{{{- {other} -}}}}"
    return _template(each + "{%- endif -%}", generation)


def _every_role(expr: str, generation: str | None, prefix: str = "") -> str:
    """A template writing every message as `expr`, after `prefix`."""
    return _template(f"{{{{- {expr} -}}}}", generation, prefix)


def _llama2(system: bool, bos_inside: bool, strip: bool) -> str:
    content = "m['content'] | trim" if strip else "m['content']"
    sys = "'<<SYS>>\\n' + c + '\\n<</SYS>>\\n\\n'" if system else "c + '\\n'"
    again = "'<s>[INST] '" if bos_inside else "'[INST] '"
    return _BOS + (
        "{{- '[INST] ' -}}{%- set ns = namespace(inside=true) -%}"
        f"{{%- for m in messages -%}}{{%- set c = {content} -%}}"
        f"{{%- if not ns.inside -%}}{{%- set ns.inside = true -%}}{{{{- {again} -}}}}{{%- endif -%}}"
        f"{{%- if m['role'] == 'system' -%}}{{{{- {sys} -}}}}"
        "{%- elif m['role'] == 'user' -%}{{- c + ' [/INST]' -}}"
        "{%- else -%}{{- c + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}{%- endfor -%}")


def _mistral(lead: str, trail: str, trim_answer: bool) -> str:
    answer = "(c | trim)" if trim_answer else "c"
    return _BOS + (
        "{%- set ns = namespace(inside=false) -%}{%- for m in messages -%}{%- set c = m['content'] -%}"
        f"{{%- if not ns.inside -%}}{{{{- '{lead}[INST]{trail}' -}}}}{{%- set ns.inside = true -%}}{{%- endif -%}}"
        "{%- if m['role'] == 'system' -%}{{- c + '\\n\\n' -}}"
        f"{{%- elif m['role'] == 'user' -%}}{{{{- c + '{lead}[/INST]' -}}}}"
        f"{{%- else -%}}{{{{- '{trail}' + {answer} + '</s>' -}}}}{{%- set ns.inside = false -%}}{{%- endif -%}}"
        "{%- endfor -%}")


def _mistral_v7(trail: str) -> str:
    return _per_role({"system": f"'[SYSTEM_PROMPT]{trail}' + c + '[/SYSTEM_PROMPT]'",
                      "user": f"'[INST]{trail}' + c + '[/INST]'"},
                     None, other=f"'{trail}' + c + '</s>'")


def _gemma() -> str:
    return _BOS + (
        "{%- set ns = namespace(system='') -%}{%- for m in messages -%}"
        "{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + (m['content'] | trim) -%}"
        "{%- else -%}{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
        "{{- '<start_of_turn>' + role + '\\n' -}}"
        "{%- if ns.system and role != 'model' -%}{{- ns.system + '\\n\\n' -}}{%- set ns.system = '' -%}{%- endif -%}"
        "{{- (m['content'] | trim) + '<end_of_turn>\\n' -}}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}")


def _monarch() -> str:
    return _every_role("('' if loop.first else '<s>') + role + '\\n' + c + '</s>\\n'", "'<s>assistant\\n'")


def _vicuna(orca: bool) -> str:
    system = "'SYSTEM: ' + c + '\\n'" if orca else "c + '\\n\\n'"
    return _per_role({"system": system, "user": "'USER: ' + c + '\\n'",
                      "assistant": "'ASSISTANT: ' + c + '</s>\\n'"}, "'ASSISTANT:'")


_CMD_R = "'<|START_OF_TURN_TOKEN|><|{}|>' + (c | trim) + '<|END_OF_TURN_TOKEN|>'"

NAMED: dict[str, str] = {
    "chatml": _every_role("'<|im_start|>' + role + '\\n' + c + '<|im_end|>\\n'", "'<|im_start|>assistant\\n'"),
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "llama3": _every_role("'<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + (c | trim) + '<|eot_id|>'",
                          "'<|start_header_id|>assistant<|end_header_id|>\\n\\n'"),
    "mistral-v1": _mistral(" ", " ", trim_answer=False),
    "mistral-v3": _mistral("", " ", trim_answer=True),
    "mistral-v3-tekken": _mistral("", "", trim_answer=False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _every_role("'<|' + role + '|>\\n' + c + '<|end|>\\n'", "'<|assistant|>\\n'"),
    "phi4": _every_role("'<|im_start|>' + role + '<|im_sep|>' + c + '<|im_end|>'", "'<|im_start|>assistant<|im_sep|>'"),
    "falcon3": _every_role("'<|' + role + '|>\\n' + c + '\\n'", "'<|assistant|>\\n'"),
    "zephyr": _every_role("'<|' + role + '|>\\n' + c + '<|endoftext|>\\n'", "'<|assistant|>\\n'"),
    "monarch": _monarch(),
    "gemma": _gemma(),
    "openchat": _per_role({"system": "c + '<|end_of_turn|>'"}, "'GPT4 Correct Assistant:'",
                          other="'GPT4 Correct ' + role[:1] | upper + role[1:] + ': ' + c + '<|end_of_turn|>'"),
    "vicuna": _vicuna(orca=False),
    "vicuna-orca": _vicuna(orca=True),
    "deepseek": _per_role({"system": "c", "user": "'### Instruction:\\n' + c + '\\n'",
                           "assistant": "'### Response:\\n' + c + '\\n<|EOT|>\\n'"}, "'### Response:\\n'"),
    "deepseek2": _per_role({"system": "c + '\\n\\n'", "user": "'User: ' + c + '\\n\\n'",
                            "assistant": "'Assistant: ' + c + '<｜end▁of▁sentence｜>'"}, "'Assistant:'"),
    "deepseek3": _per_role({"system": "c + '\\n\\n'", "user": "'<｜User｜>' + c",
                            "assistant": "'<｜Assistant｜>' + c + '<｜end▁of▁sentence｜>'"}, "'<｜Assistant｜>'"),
    "command-r": _per_role({"system": _CMD_R.format("SYSTEM_TOKEN"), "user": _CMD_R.format("USER_TOKEN"),
                            "assistant": _CMD_R.format("CHATBOT_TOKEN")},
                           "'<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>'"),
    "chatglm4": _every_role("'<|' + role + '|>\\n' + c", "'<|assistant|>\\n'", prefix="{{- '[gMASK]<sop>' -}}"),
    "exaone3": _per_role({"system": "'[|system|]' + (c | trim) + '[|endofturn|]\\n'",
                          "user": "'[|user|]' + (c | trim) + '\\n'",
                          "assistant": "'[|assistant|]' + (c | trim) + '[|endofturn|]\\n'"}, "'[|assistant|]'"),
}


def named_template(name: str) -> str | None:
    """The Jinja text of llama-server's template `name`, or None if Strata does not have it."""
    return NAMED.get(name)
