"""Prompt formatting through the tokenizer's chat template; the same prompt for every method."""
from __future__ import annotations

import re

CODE_INSTRUCTION = {
    "python": "Complete the following Python function. Reply with the whole function in one ```python code block.",
    "cpp": "Complete the following C++ function. Reply with the whole function in one ```cpp code block.",
    "java": "Complete the following Java code. Reply with the whole class in one ```java code block.",
    "js": "Complete the following JavaScript function. Reply with the whole function in one ```javascript code block.",
    "go": "Complete the following Go function. Reply with the whole function in one ```go code block.",
    "rust": "Complete the following Rust function. Reply with the whole function in one ```rust code block.",
}


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` (role/content dicts) rendered by the tokenizer's chat template.

    Falls back to "role: content" lines when the tokenizer has no template.
    """
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt else "")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def code_prompt(code: str, language: str = "python") -> str:
    """User message for a HumanEval(-X) style completion task."""
    return f"{CODE_INSTRUCTION[language]}\n\n```{language}\n{code.rstrip()}\n```"


def mbpp_prompt(text: str, code: str, tests: list[str] | None = None) -> str:
    """User message for an MBPP task: the task and the function signature taken from the solution."""
    sig = re.search(r"^def .*?:\s*$", code.replace("\r", ""), flags=re.M)
    lines = [f"Write a Python function for this task: {text.strip()}"]
    if sig:
        lines.append(f"Use this signature: `{sig.group(0).strip()}`")
    if tests:
        lines.append("It must pass: " + tests[0])
    lines.append("Reply with the code in one ```python code block.")
    return "\n".join(lines)
