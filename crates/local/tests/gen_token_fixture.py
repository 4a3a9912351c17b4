#!/usr/bin/env python3
"""Regenerate tests/fixtures/smollm2_tokens.json: llama.cpp's token ids for a set of strings.

The Rust tokenizer in src/tokenizer.rs must reproduce these ids exactly (tests/tokenizer.rs).
Run by hand only, when the fixture changes: no test or script runs it, and the test setup
does not install llama-cpp-python (the OpenAI-backend tests use llama.cpp's C++ llama-server,
scripts/llama-server.sh), so install its Python bindings yourself as below.

Usage (from the repository root):

    cache="${LASTCALL_CACHE:-$HOME/.cache/lastcall}"
    python3 -m venv "$cache/venv-llama"
    "$cache/venv-llama/bin/pip" install llama-cpp-python   # builds llama.cpp, ~4 min
    "$cache/venv-llama/bin/python" crates/local/tests/gen_token_fixture.py "$(scripts/setup-model.sh)"
"""

import json
import os
import sys

import llama_cpp

CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is 2+2? Answer in one word.<|im_end|>\n"
    "<|im_start|>assistant\n"
)

CASES = [
    "",
    "Hello",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "12345 and 3.14",
    "x=1_000_000; y = [1, 2, 3] -> 0.5e-3",
    "Grüße, 你好",
    "emoji 🙂🚀 and café naïve",
    "٣٤ Arabic-Indic digits, Ⅻ roman, ½ fraction",
    "  two leading spaces",
    "a    b",
    "trailing spaces   ",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\n  indented\n",
    "windows\r\nline",
    "   \n\n   ",
    "don't I'll we've THEY'RE it's",
    "fn main() {\n    println!(\"hi\");\n}\n",
    "<|im_start|>user\nHello 12345 and 3.14<|im_end|>\n",
    CHAT,
    "<|im_end|><|im_start|>",
    "text<|endoftext|>more",
    "<|im_start|> not special: <|im_start >",
]


def main() -> None:
    model_path = sys.argv[1]
    llm = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
    cases = [
        {"text": text, "ids": llm.tokenize(text.encode(), add_bos=False, special=True)}
        for text in CASES
    ]
    fixture = {
        "generator": "crates/local/tests/gen_token_fixture.py",
        "llama_cpp_python": llama_cpp.__version__,
        "model_file": os.path.basename(model_path),
        "model_bytes": os.path.getsize(model_path),
        "cases": cases,
    }
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "smollm2_tokens.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
