"""Every option a request may carry, in one table, and the typed values built from it.

A request's options either sample (temperature, stop strings: they change one answer) or load
(num_ctx, num_gpu: they change how the model is loaded, so a new value may reload it). Each wire
format (Ollama `options`, an OpenAI body, Anthropic and Responses fields, a Modelfile PARAMETER,
the chat's `/set parameter`, `run`'s flags, a remote model's upstream fields) maps its own names
onto this table and checks values here, so a bound is written once and an out-of-range value
gets the same message everywhere.

Load options at their "auto" value (`num_gpu: -1`, `num_thread: 0`) mean "let the tuner
decide": they become None here, so a client that always sends them never reloads a model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from .errors import UserError
from .speculative import AUTO, LOAD_MODES, SPECULATIVE_CHOICES

SAMPLE, LOAD = "sample", "load"

# A request's `speculative` says the plan's choice (auto) or one mode of localllm/speculative.py;
# a LOAD_MODES one needs a drafter loaded with the model, so it is a load option too.

# ggml's GGML_MAX_N_THREADS: more threads abort the runner.
MAX_THREADS = 512


@dataclass(frozen=True)
class Option:
    name: str
    kind: type  # int, float, str; `list` for stop strings (a string or a list of strings)
    role: str  # SAMPLE or LOAD
    help: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    auto: tuple = ()  # values meaning "the tuner decides" (become None)

    def bounds(self) -> str:
        if self.low is not None and self.high is not None:
            return f"between {_num(self.low)} and {_num(self.high)}"
        if self.low is not None:
            return f"at least {_num(self.low)}"
        return f"at most {_num(self.high)}"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


_TABLE = (
    Option("temperature", float, SAMPLE, "randomness; 0 always picks the likeliest token", 0, 100),
    Option("min_temperature", float, SAMPLE, "the least temperature any request gets (a "
           "model that loops at 0, for clients that force 0)", 0, 100),
    Option("top_k", int, SAMPLE, "sample from the k likeliest tokens (0: all)", 0, 1 << 20),
    Option("top_p", float, SAMPLE, "sample from the smallest set with this much probability",
           0, 1),
    Option("min_p", float, SAMPLE, "drop tokens below this share of the likeliest one", 0, 1),
    Option("typical_p", float, SAMPLE, "locally typical sampling (1: off)", 0, 1),
    Option("repeat_penalty", float, SAMPLE, "penalise repeating recent tokens (1: off)", 0, 100),
    Option("repeat_last_n", int, SAMPLE, "how far back repeat_penalty looks (-1: context)",
           -1, 1 << 24),
    Option("presence_penalty", float, SAMPLE, "penalise tokens already present", -100, 100),
    Option("frequency_penalty", float, SAMPLE, "penalise tokens by how often they appeared",
           -100, 100),
    Option("seed", int, SAMPLE, "random seed, for repeatable answers", -(1 << 63), (1 << 63) - 1),
    Option("num_predict", int, SAMPLE, "most tokens per answer (-1: until the model stops)",
           -2, 1 << 24),
    Option("stop", list, SAMPLE, "stop strings (several allowed)"),
    Option("speculative", str, SAMPLE, f"drafting: {', '.join(SPECULATIVE_CHOICES)} "
           f"({' and '.join(LOAD_MODES)} reload the model)", choices=SPECULATIVE_CHOICES),
    Option("num_ctx", int, LOAD, "context length; reloads the model", 256, 1 << 24),
    Option("num_gpu", int, LOAD, "layers on the GPU (-1: the tuner decides); reloads the model",
           -1, 1 << 16, auto=(-1,)),
    Option("num_thread", int, LOAD, "CPU threads (0: the tuner decides); reloads the model",
           -1, MAX_THREADS, auto=(-1, 0)),
    Option("num_batch", int, LOAD, "prompt batch size (0: the tuner decides); reloads the model",
           -1, 1 << 16, auto=(-1, 0)),
    Option("draft_model", str, LOAD, "the model that drafts for speculative draft; reloads"),
)
OPTIONS: dict[str, Option] = {o.name: o for o in _TABLE}


class OptionError(UserError, ValueError):
    """An option's value is of the wrong type or out of its bounds (a 400 on the API)."""

    def __init__(self, message: str, name: str):
        super().__init__(message)
        self.name = name


def check(name: str, value, label: str | None = None):
    """A JSON value of option `name` in its type, checked against the table. `label` is the
    name the client used (OpenAI's max_tokens for num_predict) for the message."""
    option = OPTIONS[name]
    label = label or name
    if option.kind is list:
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise OptionError(f"{label} must be a string or a list of strings", label)
    if option.kind is str:
        if not isinstance(value, str) or not value:
            what = f"one of {', '.join(option.choices)}" if option.choices else "a name"
            raise OptionError(f"{label} must be {what}", label)
        if option.choices and value not in option.choices:
            raise OptionError(f"{label} must be one of {', '.join(option.choices)}, not "
                              f"{value!r}", label)
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or (option.kind is int
                                                  and not float(value).is_integer()):
        kind = "a whole number" if option.kind is int else "a number"
        raise OptionError(f"{label} must be {kind}, not {value!r}", label)
    value = option.kind(value)
    if (option.low is not None and value < option.low) or (
            option.high is not None and value > option.high):
        raise OptionError(f"{label} must be {option.bounds()}, not {_num(value)}", label)
    return value


def from_text(name: str, texts: list[str] | str, label: str | None = None):
    """A value typed as text (Modelfile PARAMETER, `/set parameter`, a command-line flag) in
    its type, checked against the same bounds as a JSON value."""
    option = OPTIONS[name]
    texts = [texts] if isinstance(texts, str) else list(texts)
    label = label or name
    if option.kind is list:
        return check(name, texts, label)
    if len(texts) != 1:
        raise OptionError(f"{label} takes one value", label)
    text = texts[0]
    if option.kind is str:
        return check(name, text, label)
    try:
        value = int(text) if option.kind is int else float(text)
    except ValueError:
        kind = "a whole number" if option.kind is int else "a number"
        raise OptionError(f"{label} must be {kind}, not {text!r}", label) from None
    return check(name, value, label)



@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    num_predict: int = -1  # -1: until the context is full or the model stops
    stop: tuple[str, ...] = ()
    speculative: str = AUTO  # one of SPECULATIVE_CHOICES


@dataclass(frozen=True)
class LoadOptions:
    """What a request asks of the loaded model; None everywhere means "as planned"."""

    num_ctx: int | None = None
    num_gpu: int | None = None
    num_thread: int | None = None
    num_batch: int | None = None
    speculative: str | None = None  # a LOAD_MODES drafter to load with, else None
    draft_model: str | None = None

    def given(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


_SAMPLING_FIELDS = {f.name for f in fields(SamplingOptions)}


def checked(values: Mapping, labels: Mapping[str, str] | None = None) -> dict:
    """The table's options present in `values` (unknown keys ignored, as Ollama does; None
    means absent), each checked and typed. `labels` maps an option to the client's name."""
    labels = labels or {}
    return {name: check(name, values[name], labels.get(name)) for name in OPTIONS
            if values.get(name) is not None}


def build(given: Mapping) -> tuple[SamplingOptions, LoadOptions]:
    """Checked option values (see `checked`) -> the typed sampling and load options. A
    `min_temperature` (a Modelfile PARAMETER, typically) raises a lower temperature to it:
    Copilot CLI sends 0 to every model it is given, and small models loop at 0."""
    sampling = SamplingOptions(**{k: v for k, v in given.items() if k in _SAMPLING_FIELDS})
    if sampling.temperature < given.get("min_temperature", 0):
        sampling = replace(sampling, temperature=given["min_temperature"])
    load = {name: value for name, value in given.items() if reloads(name, value)}
    return sampling, LoadOptions(**load)


def reloads(name: str, value) -> bool:
    """Whether a request's `name` = `value` changes what is loaded: a load option's own value
    (not its "the tuner decides"), or a speculative mode that loads a drafter (LOAD_MODES).
    The one table of load options: LoadOptions' fields, the TUI's "reloads" note."""
    option = OPTIONS.get(name)
    if option is not None and option.role == LOAD:
        return value not in option.auto
    return name == "speculative" and value in LOAD_MODES


def parse(values: Mapping, labels: Mapping[str, str] | None = None
          ) -> tuple[SamplingOptions, LoadOptions]:
    return build(checked(values, labels))
