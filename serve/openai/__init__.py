"""The OpenAI-compatible HTTP front of `baton serve --http-port` (FastAPI on uvicorn).

Kept import-light: serve/llm.py uses chat.py for `LLM.chat` without pulling in the web stack.
"""
