"""localllm: an Ollama-style local LLM service that plans how to run a model on the GPU you have."""

__version__ = "0.1.0"
