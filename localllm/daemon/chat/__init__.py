"""The chat layer: between the API routes and the runner.

Templates (with tools), `format` to grammar, fill-in-the-middle, thinking, and the parsers that
split model output into content, thinking and tool calls.
"""
