"""Chat templates written for the tests, each named for the behaviour of a model family it exercises.

    HERMES_TOOLS          ChatML; tools listed in the system block; assistant tool calls as
                          <tool_call> blocks with the arguments re-serialized by `tojson`; tool
                          results grouped into one user turn of <tool_response> blocks (Qwen 2.5,
                          Hermes).
    DROPS_OLD_REASONING   HERMES_TOOLS, but an assistant turn before the last user message loses
                          its <think>...</think> (Qwen3, DeepSeek-R1).
    DEFAULT_SYSTEM_DATE   HERMES_TOOLS, plus a default system prompt with today's date when the
                          conversation has none (Llama 3.x, Qwen 2.5).
    R1_STYLE              DeepSeek's markers (bos, <｜User｜>, <｜Assistant｜>, eos after each answer),
                          the system prompt bare at the start, and every earlier assistant turn's
                          <think>...</think> dropped (DeepSeek-R1).
    LLAMA3_JSON_TOOLS     Llama 3.1 headers; a tool call is the whole answer, <|python_tag|> then
                          {"name", "parameters"}; results come back in "ipython" turns.
    MISTRAL_TOOLS         [INST] ... [/INST] turns; tool calls as [TOOL_CALLS] and a JSON list of
                          {"name", "arguments"}; results in [TOOL_RESULTS] ... [/TOOL_RESULTS].
    MARKS_LAST_MESSAGE    ChatML that tags the final message: appending a message changes how an
                          earlier one renders, so no rendering of "only the new messages" exists.
"""

from __future__ import annotations

_TEXT = (
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c -%}{%- for p in c -%}{{ p.text }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
)

_SYSTEM = (
    "{%- set first_system = messages and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if first_system -%}{{- text(messages[0].content) + '\\n\\n' -}}"
    "{%- elif default_system is defined -%}{{- default_system + '\\n\\n' -}}{%- endif -%}"
    "{{- 'You may call these functions, listed in <tools></tools>:\\n<tools>' -}}"
    "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\nCall one as <tool_call>\\n{\"name\": NAME, \"arguments\": ARGS}\\n"
    "</tool_call>.<|im_end|>\\n' -}}"
    "{%- elif first_system -%}"
    "{{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' -}}"
    "{%- elif default_system is defined -%}"
    "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
)

# `content` is set before this runs (DROPS_OLD_REASONING edits it).
_ASSISTANT = (
    "{{- '<|im_start|>assistant\\n' + content -}}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set args = f.arguments if f.arguments is string else (f.arguments | tojson) -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + args + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
)

_TOOL = (
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + text(m.content) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}"
)


def _hermes(*, drop_old_reasoning: bool = False, default_system: bool = False) -> str:
    head = _TEXT
    if default_system:
        head += (
            "{%- set default_system = 'You are a helpful assistant. Today is ' + "
            "strftime_now('%d %B %Y') + '.' -%}"
        )
    head += _SYSTEM
    last_user = ""
    if drop_old_reasoning:
        last_user = (
            "{%- set ns = namespace(last_user=-1) -%}"
            "{%- for m in messages -%}{%- if m.role == 'user' -%}"
            "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
        )
    content = "{%- set content = text(m.content) -%}"
    if drop_old_reasoning:
        content += (
            "{%- if loop.index0 < ns.last_user and '</think>' in content -%}"
            "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
            "{%- endif -%}"
        )
    return (
        head
        + last_user
        + "{%- for m in messages -%}"
        + "{%- if loop.first and m.role == 'system' -%}"
        + "{%- elif m.role == 'tool' -%}"
        + _TOOL
        + "{%- elif m.role == 'assistant' -%}"
        + content
        + _ASSISTANT
        + "{%- else -%}"
        + "{{- '<|im_start|>' + m.role + '\\n' + text(m.content) + '<|im_end|>\\n' -}}"
        + "{%- endif -%}"
        + "{%- endfor -%}"
        + "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


HERMES_TOOLS = _hermes()
DROPS_OLD_REASONING = _hermes(drop_old_reasoning=True)
DEFAULT_SYSTEM_DATE = _hermes(default_system=True)

R1_STYLE = (
    _TEXT
    + "{{- bos_token -}}"
    "{%- if messages and messages[0].role == 'system' -%}{{- text(messages[0].content) -}}{%- endif -%}"
    "{%- if tools -%}"
    "{{- '\n\nTools, one JSON schema per line; call one as <tool_call>{\"name\": NAME, "
    "\"arguments\": ARGS}</tool_call>:' -}}"
    "{%- for t in tools -%}{{- '\n' + (t | tojson) -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{- '<｜User｜>' + text(m.content) -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<｜User｜><tool_response>' + text(m.content) + '</tool_response>' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = text(m.content).split('</think>')[-1] -%}"
    "{{- '<｜Assistant｜>' + content -}}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{%- set args = f.arguments if f.arguments is string else (f.arguments | tojson) -%}"
    "{{- '<tool_call>{\"name\": \"' + f.name + '\", \"arguments\": ' + args + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}"
)

LLAMA3_JSON_TOOLS = (
    _TEXT
    + "{%- for m in messages -%}"
    "{%- set role = 'ipython' if m.role == 'tool' else m.role -%}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' -}}"
    "{%- if loop.first and tools -%}"
    "{{- 'Call a function by answering with its JSON {\"name\": ..., \"parameters\": ...}:' -}}"
    "{%- for t in tools -%}{{- '\n' + (t | tojson) -}}{%- endfor -%}{{- '\n\n' -}}"
    "{%- endif -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}"
    "{%- for tc in m.tool_calls -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{%- set args = f.arguments if f.arguments is string else (f.arguments | tojson) -%}"
    "{{- '<|python_tag|>{\"name\": \"' + f.name + '\", \"parameters\": ' + args + '}' -}}"
    "{%- endfor -%}"
    "{%- else -%}{{- text(m.content) -}}{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"
)

MISTRAL_TOOLS = (
    _TEXT
    + "{%- for m in messages -%}"
    "{%- if m.role == 'user' or m.role == 'system' -%}"
    "{%- if loop.first and tools -%}"
    "{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' -}}{%- endif -%}"
    "{{- '[INST] ' + text(m.content) + ' [/INST]' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '[TOOL_RESULTS]' + text(m.content) + '[/TOOL_RESULTS]' -}}"
    "{%- else -%}"
    "{{- text(m.content) -}}"
    "{%- if m.tool_calls -%}{{- '[TOOL_CALLS][' -}}"
    "{%- for tc in m.tool_calls -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{%- set args = f.arguments if f.arguments is string else (f.arguments | tojson) -%}"
    "{{- ('' if loop.first else ', ') + '{\"name\": \"' + f.name + '\", \"arguments\": ' + args + '}' -}}"
    "{%- endfor -%}{{- ']' -}}{%- endif -%}"
    "{{- eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

MARKS_LAST_MESSAGE = (
    _TEXT
    + "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + ('*' if loop.last else '') + '\\n' + text(m.content) -}}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

TEMPLATES = {
    "hermes_tools": HERMES_TOOLS,
    "drops_old_reasoning": DROPS_OLD_REASONING,
    "default_system_date": DEFAULT_SYSTEM_DATE,
}


def with_template(tokenizer, template: str):
    """A copy of `tokenizer` whose chat template is `template` (the original is shared by tests)."""
    import copy

    tok = copy.copy(tokenizer)
    tok.chat_template = template
    return tok
