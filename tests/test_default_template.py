"""Chat with a model that brings no chat template (the Gemma 3 270M base model): Ollama's
default template `{{ .Prompt }}`, which sends the user turns' text as it is."""

from __future__ import annotations

import ollama
import openai

GREEDY = {"num_predict": 8, "temperature": 0}


def test_chat_on_a_base_model_reads_the_user_text_as_a_raw_prompt(daemon):
    oc = ollama.Client(host=daemon.url)
    plain = oc.generate(model="gemma3-270m", prompt="The capital of France is", raw=True,
                        options=GREEDY)
    chat = oc.chat(model="gemma3-270m", options=GREEDY, messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "The capital of France is"}])
    assert chat.message.content == plain.response and chat.eval_count > 0
    # The conversation's user turns, one after another (Ollama leaves out the answers).
    turns = oc.chat(model="gemma3-270m", options=GREEDY, messages=[
        {"role": "user", "content": "One, two,"},
        {"role": "assistant", "content": "three"},
        {"role": "user", "content": " three, four,"}])
    both = oc.generate(model="gemma3-270m", prompt="One, two, three, four,", raw=True,
                       options=GREEDY)
    assert turns.message.content == both.response


def test_openai_chat_on_a_base_model_answers(daemon):
    ai = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused")
    r = ai.chat.completions.create(model="gemma3-270m", max_tokens=8, temperature=0,
                                   messages=[{"role": "user", "content": "Once upon a time"}])
    plain = ai.completions.create(model="gemma3-270m", prompt="Once upon a time", max_tokens=8,
                                  temperature=0)
    assert r.choices[0].message.content == plain.choices[0].text
    assert r.usage.completion_tokens > 0


def test_show_says_the_base_model_uses_the_default_template(daemon):
    shown = ollama.Client(host=daemon.url).show("gemma3-270m")
    assert shown.template == "{{ .Prompt }}"
    assert "<|im_start|>" in ollama.Client(host=daemon.url).show("smollm2").template
    out = daemon.cli("show", "gemma3-270m")
    assert out.returncode == 0
    row = next(line for line in out.stdout.splitlines() if "chat template" in line)
    assert "default" in row and "{{ .Prompt }}" in row
