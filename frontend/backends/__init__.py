"""Backends a program runs on besides a radixflow server: an offline Engine in this process
(`engine`), and hosted APIs (`openai`, `anthropic`, `litellm`; `vertexai` only says it is not
supported), which share `api`. `radixflow.OpenAI` and the others name them."""
