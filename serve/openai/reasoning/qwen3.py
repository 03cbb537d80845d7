"""--reasoning-parser qwen3: Qwen3's <think>...</think>, as vLLM's qwen3 parser splits it.

Qwen3's template leaves the generation prompt plain when thinking is on (the model writes
`<think>\\n` itself, and the <think> is dropped as a marker) and renders an empty
`<think>\\n\\n</think>\\n\\n` when chat_template_kwargs has enable_thinking false: thinking_at_start
reads that from the prompt, and such an output is all answer (vLLM: the request's
enable_thinking). Thinking-model templates (Qwen3-*-Thinking-2507) open the block in the prompt.

Beyond DeepSeek-R1's rules (deepseek_r1.ThinkParser): a <tool_call> inside the thinking ends it -
the call is the answer's, for the tool parser (vLLM's qwen3 engine makes it an implicit end of
reasoning). A second </think> stays in the answer as text, as vLLM's streaming leaves it (its
unary parse drops it).
"""

from __future__ import annotations

from baton.serve.openai.reasoning.deepseek_r1 import ThinkParser


class Parser(ThinkParser):
    name = "qwen3"
    answer_starts = ("<tool_call>",)
