"""`reward.type: python`: the function, from a file or an import path, and the form it takes,
recognised from its parameters (no field says which):

  per response  fn(response, answer, extra_info) -> float | {"reward", "score"?}
                ours: one call per response; `extra_info` holds every column of the row.
  TRL           fn(prompts, completions, completion_ids, **columns) -> list[float | None]
                TRL's GRPOTrainer reward functions as they are: one call per batch, every
                argument a keyword holding one entry per response. `prompts` are the rows'
                prompt texts, or their chat turns for chat data, and `completions` then
                `[{"role": "assistant", "content": text}]`; `completion_ids` the token ids;
                every column of the row (but `prompt`) under its own name, and `answer`
                (data.answerKey's, e.g. a nested field) unless a column has that name. A function
                without `**kwargs` gets only the keywords it names. `None` means "does not
                apply": it adds 0 to the trained reward and is left out of
                `reward/<name>_mean` (TRL's nansum and nanmean).
  veRL          compute_score(data_source, solution_str, ground_truth, extra_info=None)
                -> float | {"score", ...}
                veRL's default_compute_score form, natively: `data_source` is the row's
                column of that name, `solution_str` the response, `ground_truth` the answer
                (`data.answerKey`, e.g. `reward_model.ground_truth`), `extra_info` the row's
                `extra_info` column; a dict's `score` is the reward.

The forms are told apart in this order: a parameter named `solution_str` is veRL's; a
parameter named `prompts`, `completions` or `completion_ids`, or nothing but `**kwargs`, is
TRL's; otherwise the function must accept `(response, answer, extra_info)`. A function that
fits none is a config error (`RewardConfigError`), found by the preflight before any model
loads. Either kind may be `async def`; each call then runs in a fresh event loop.

Simplifications: TRL's `trainer_state` and `log_extra`/`log_metric` keywords are not passed
(a function that requires them fits no form); veRL's batched `compute_score` (lists of
each argument) is not recognised, only the per-response one.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from .custom import RewardError, RewardResult, normalize_result
from .sample import Sample

TRL_KEYWORDS = ("prompts", "completions", "completion_ids")
VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
NOT_COLUMNS = frozenset({"prompt", "completion", *TRL_KEYWORDS})
"""Row columns TRL does not pass as keywords."""
FORMS = ("(response, answer, extra_info) per response; TRL's batched (prompts, completions, completion_ids, "
         "**columns); or veRL's compute_score(data_source, solution_str, ground_truth, extra_info)")


class RewardConfigError(ValueError):
    """A reward function that cannot be loaded or fits no form: no restart can fix it, so the
    trainer ends the job as a config error (exit 2), as the preflight does."""


def load_function(file: str | None, function: str) -> tuple[Callable, str]:
    """(the function, how messages name it): `function` from the Python file `file`, or with
    no file from the import path `package.module:function`."""
    if file:
        return _from_file(file, function), f"reward function {function!r} in {file}"
    module_name, sep, attr = function.partition(":")
    if not sep or not module_name or not attr:
        raise RewardConfigError(f"reward.function: {function!r} is not an import path package.module:function, and "
                                "no reward.file is set; give one of the two")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the module's own import-time error
        raise RewardConfigError(f"reward.function: cannot import {module_name!r} ({type(err).__name__}: {err}); "
                                "install its package in the trainer image") from None
    for part in attr.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise RewardConfigError(f"reward.function: {module_name!r} has no function {attr!r}")
    return target, f"reward function {function}"


def _from_file(path: str, name: str) -> Callable:
    file = Path(path)
    if not file.is_file():
        raise RewardConfigError(f"reward file {path} does not exist; point it at a .py file that defines {name}")
    module_name = "rlhf_user_reward_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise RewardConfigError(f"reward file {path} cannot be imported as Python (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickle in the user file need this
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise RewardConfigError(f"reward file {path} failed to import: {type(err).__name__}: {err}") from err
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = [k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module_name]
        raise RewardConfigError(f"reward file {path} defines no function {name!r}; it defines "
                                f"{', '.join(defined) or 'no functions'}")
    return fn


def _required(sig: inspect.Signature) -> list[inspect.Parameter]:
    return [p for p in sig.parameters.values() if p.default is p.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def form_of(fn: Callable, where: str, columns: set[str] | None = None) -> str:
    """"verl", "trl" or "per_response"; RewardConfigError naming `where` when `fn` fits none.
    `columns` (the data's, when known): a TRL function's required keywords must be among them."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise RewardConfigError(f"{where}: its parameters cannot be read; define it with def") from None
    names = set(sig.parameters)
    keywords_only = all(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()) and names
    if "solution_str" in names:
        extra = [p.name for p in _required(sig) if p.name not in VERL_KEYWORDS or p.kind == p.POSITIONAL_ONLY]
        if extra:
            raise RewardConfigError(f"{where}: a veRL compute_score gets {', '.join(VERL_KEYWORDS)}, but it also "
                                    f"requires {', '.join(extra)}")
        return "verl"
    if names & set(TRL_KEYWORDS) or keywords_only:
        known = {*TRL_KEYWORDS, "answer"} | (columns - NOT_COLUMNS if columns is not None else set())
        bad = [p.name for p in _required(sig) if p.kind == p.POSITIONAL_ONLY
               or (columns is not None and p.name not in known)]
        if bad:
            cols = ", ".join(sorted(columns - NOT_COLUMNS)) if columns else "none"
            raise RewardConfigError(f"{where}: a TRL-style function gets prompts, completions, completion_ids and "
                                    f"the data's columns as keywords, but it requires {', '.join(bad)} (the data's "
                                    f"columns: {cols}); set data.answerKey / the column names, or give it a default")
        return "trl"
    try:
        sig.bind("response", "answer", {})
    except TypeError as err:
        raise RewardConfigError(f"{where} fits no reward form ({err}); it must accept {FORMS}") from None
    return "per_response"


async def _await(value: Awaitable) -> Any:
    return await value


def _call(fn: Callable, where: str, *args: Any, **kwargs: Any) -> Any:
    try:
        value = fn(*args, **kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(_await(value))
    except (Exception, SystemExit) as err:  # exit() in a scoring thread would hang the rollout loop
        raise RewardError(f"{where} raised {type(err).__name__}: {err}") from err
    return value


def _result(value: Any, where: str) -> RewardResult:
    if isinstance(value, dict) and "reward" not in value and "score" in value:  # veRL: {"score", "acc", ...}
        value = {"reward": value["score"]}
    try:
        return normalize_result(value)
    except ValueError as err:
        raise RewardError(f"{where} returned an invalid result: {err}; return a float or a dict with 'reward' "
                          "and optional 'score'") from None


def _accepts(sig: inspect.Signature) -> Callable[[str], bool]:
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return lambda name: True
    return lambda name: name in sig.parameters


def python_reward(file: str | None, function: str) -> Callable[[Sequence[Any]], list[RewardResult | None]]:
    """The batch scorer of a python reward: samples (`Sample`, rewards/__init__.py) -> one
    (reward, score), or None ("does not apply"), per sample."""
    fn, where = load_function(file, function)
    form = form_of(fn, where)
    accepts = _accepts(inspect.signature(fn))

    def per_response(samples: Sequence[Any]) -> list[RewardResult | None]:
        return [_result(_call(fn, where, s.response, s.answer, s.extra_info), where) for s in samples]

    def verl(samples: Sequence[Any]) -> list[RewardResult | None]:
        out = []
        for s in samples:
            args = {"data_source": s.extra_info.get("data_source"), "solution_str": s.response,
                    "ground_truth": s.answer, "extra_info": s.extra_info.get("extra_info")}
            out.append(_result(_call(fn, where, **{k: v for k, v in args.items() if accepts(k)}), where))
        return out

    def trl(samples: Sequence[Any]) -> list[RewardResult | None]:
        values = _call(fn, where, **{k: v for k, v in trl_arguments(samples).items() if accepts(k)})
        return trl_results(values, len(samples), where)

    return {"per_response": per_response, "verl": verl, "trl": trl}[form]


def trl_arguments(samples: Sequence[Any]) -> dict[str, list]:
    """TRL's keywords for a batch: prompts, completions (chat data: one assistant turn each),
    completion_ids, every column but the prompt, and `answer` (unless a column is so named),
    one entry per sample."""
    chat = [isinstance(s.prompt, list) for s in samples]
    args: dict[str, list] = {
        "prompts": [s.prompt for s in samples],
        "completions": [[{"role": "assistant", "content": s.response}] if c else s.response
                        for s, c in zip(samples, chat)],
        "completion_ids": [list(s.completion_ids) for s in samples],
    }
    columns = dict.fromkeys(k for s in samples for k in s.extra_info if k not in NOT_COLUMNS)
    args.update({k: [s.extra_info.get(k) for s in samples] for k in columns})
    args.setdefault("answer", [s.answer for s in samples])  # data.answerKey's, e.g. a nested field
    return args


def trl_results(values: Any, n: int, where: str) -> list[RewardResult | None]:
    """A TRL function's answer, checked: a list of n floats or None."""
    try:
        values = list(values)
    except TypeError:
        raise RewardError(f"{where} returned {type(values).__name__}; a TRL-style function returns a list of "
                          f"floats (or None), one per completion") from None
    if len(values) != n:
        raise RewardError(f"{where} returned {len(values)} rewards for {n} completions; return one per completion")
    out: list[RewardResult | None] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        if isinstance(v, float) and math.isnan(v):
            raise RewardError(f"{where} returned NaN for completion {i}; return None for \"does not apply\"")
        out.append(_result(v, f"{where} (completion {i})"))
    return out


def load_reward_function(path: str | None, name: str = "reward_fn"
                         ) -> Callable[[str, str, dict], RewardResult]:
    """`fn(response, answer, extra_info)` giving `(reward, score)` for the python reward
    `name` in the file `path` (or the import path `name`), whatever its form (forms.py; a
    TRL-style function scores a batch of one, None counts 0). Errors (here and at call time)
    name the file and function."""
    batch = python_reward(path, name)

    def reward(response: str, answer: str, extra_info: dict) -> RewardResult:
        [result] = batch([Sample(response, answer, extra_info)])
        return result if result is not None else (0.0, 0.0)

    reward.__name__ = name
    return reward
