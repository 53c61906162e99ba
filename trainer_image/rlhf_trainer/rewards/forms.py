"""`reward.type: python`: the function, from a file or an import path, and the form it takes,
recognised from its parameters (no field says which):

  per response  fn(response, answer, extra_info) -> float | {"reward", "score"?} | None
                ours: one call per response; `extra_info` holds every column of the row.
  TRL           fn(prompts, completions, completion_ids, **columns) -> list[float | None]
                TRL's GRPOTrainer reward functions as they are (its `_calculate_rewards`):
                one call per batch (a prompt's group of responses), every argument a keyword
                holding one entry per response. `prompts` are the rows' prompt texts, or their
                chat turns for chat data, and `completions` then
                `[{"role": "assistant", "content": text}]`; `completion_ids` the token ids;
                every column of the row (but `prompt`) under its own name, and `answer`
                (data.answerKey's, e.g. a nested field) unless a column has that name; and
                TRL's three context keywords: `trainer_state` (a `transformers.TrainerState`:
                `global_step` = the steps already trained, `max_steps` = schedule.totalSteps,
                `epoch` = passes over the data so far, `num_train_epochs`), `log_metric(name,
                value)` (averaged over the step's calls, logged as `reward/<function>/<name>`)
                and `log_extra(column, values)` (one value per response: a column of the
                tracker's samples table and of the saved rollouts).
                A function without `**kwargs` gets only the keywords it names.
  veRL          compute_score(data_source, solution_str, ground_truth, extra_info=None)
                -> float | {"score", ...}
                veRL's default_compute_score form, natively: `data_source` is the row's
                column of that name, `solution_str` the response, `ground_truth` the answer
                (`data.answerKey`, e.g. `reward_model.ground_truth`), `extra_info` the row's
                `extra_info` column; a dict's `score` is the reward.

Every form also gets `reward.kwargs` as keyword arguments (veRL's `reward_kwargs`), and may
return None or NaN for a response: "does not apply" (TRL turns None into NaN and sums with
nansum): it adds 0 to the trained reward and is left out of `reward/<name>_mean`.

The function: `function` in the file `file`, or without a file an import path, dotted as
TRL's CLI takes it (`my_pkg.rewards.accuracy`, `trl.rewards.accuracy_reward`) or
`package.module:function`. A `get_*` factory of `trl.rewards` (`get_soft_overlong_punishment`,
`get_cosine_scaled_reward`, `get_repetition_penalty_reward`) is called once with
`reward.kwargs` and the function it returns is the reward.

The forms are told apart in this order: a parameter named `solution_str` is veRL's; a
parameter named `prompts`, `completions` or `completion_ids`, or nothing but `**kwargs`, is
TRL's; otherwise the function must accept `(response, answer, extra_info)`. A function that
fits none is a config error (`RewardConfigError`), found by the preflight before any model
loads. Either kind may be `async def`: its calls run on one event loop for the process (a
daemon thread, TRL's `async_loop`), a batch's per-response calls together (asyncio.gather),
and the sampler scores several groups at once when every function is async
(`PythonReward.concurrent`).

Simplifications: veRL's batched `compute_score` (lists of each argument) is not recognised,
only the per-response one. `trainer_state` is built for the call, not TRL's live object:
changing it changes nothing. TRL's `environments` keyword (its tool environments) is not
passed. What a function logs while `spec.evaluation` sets are scored goes into the next
step's metrics and is not kept apart as eval metrics.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .calls import call, call_each, is_async
from .custom import RewardError, RewardResult, normalize_result

TRL_KEYWORDS = ("prompts", "completions", "completion_ids")
TRL_CONTEXT = ("trainer_state", "log_metric", "log_extra")
"""The keywords TRL's GRPOTrainer adds to every call besides the batch and the columns."""
VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
NOT_COLUMNS = frozenset({"prompt", "completion", *TRL_KEYWORDS})
"""Row columns TRL does not pass as keywords."""
FORMS = ("(response, answer, extra_info) per response; TRL's batched (prompts, completions, completion_ids, "
         "**columns); or veRL's compute_score(data_source, solution_str, ground_truth, extra_info)")
TRL_FACTORY_MODULE = "trl.rewards"


class RewardConfigError(ValueError):
    """A reward function that cannot be loaded or fits no form: no restart can fix it, so the
    trainer ends the job as a config error (exit 2), as the preflight does."""


def load_function(file: str | None, function: str, kwargs: Mapping[str, Any] | None = None
                  ) -> tuple[Callable, str]:
    """(the function, how messages name it): `function` from the Python file `file`, or with
    no file from the import path `package.module.function` or `package.module:function`. A
    `trl.rewards.get_*` factory is called with `kwargs` (module docstring)."""
    if file:
        return _from_file(file, function), f"reward function {function!r} in {file}"
    if ":" in function:
        module_name, _, attr = function.partition(":")
    else:
        module_name, _, attr = function.rpartition(".")
    if not module_name or not attr:
        raise RewardConfigError(f"reward.function: {function!r} is not an import path (package.module.function, "
                                "e.g. trl.rewards.accuracy_reward, or package.module:function), and no reward.file "
                                "is set; give one of the two")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the module's own import-time error
        raise RewardConfigError(f"reward.function: cannot import {module_name!r} ({type(err).__name__}: {err}); "
                                "install its package in the trainer image") from None
    for part in attr.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise RewardConfigError(f"reward.function: {module_name!r} has no function {attr!r}")
    where = f"reward function {function}"
    if is_factory(file, function):
        try:
            target = target(**(kwargs or {}))
        except TypeError as err:
            raise RewardConfigError(f"reward.kwargs: {function} makes the reward function from reward.kwargs: "
                                    f"{err}") from None
    return target, where


def is_factory(file: str | None, function: str) -> bool:
    """A `trl.rewards.get_*` factory: called once with reward.kwargs, which calls then lack."""
    return not file and function.replace(":", ".").startswith(TRL_FACTORY_MODULE + ".get_")


def call_kwargs(file: str | None, function: str, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The keywords of reward.kwargs each call gets (none after a factory took them)."""
    return {} if is_factory(file, function) else dict(kwargs or {})


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


def form_of(fn: Callable, where: str, columns: set[str] | None = None, kwargs: Sequence[str] = ()) -> str:
    """"verl", "trl" or "per_response"; RewardConfigError naming `where` when `fn` fits none.
    `columns` (the data's, when known): a TRL function's required keywords must be among them.
    `kwargs`: the names in `reward.kwargs`, passed to every form."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise RewardConfigError(f"{where}: its parameters cannot be read; define it with def") from None
    names = set(sig.parameters)
    keywords_only = all(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()) and names
    given = set(kwargs)
    if "solution_str" in names:
        extra = [p.name for p in _required(sig) if p.name not in {*VERL_KEYWORDS, *given}
                 or p.kind == p.POSITIONAL_ONLY]
        if extra:
            raise RewardConfigError(f"{where}: a veRL compute_score gets {', '.join(VERL_KEYWORDS)} and reward.kwargs, "
                                    f"but it also requires {', '.join(extra)}")
        return "verl"
    if names & set(TRL_KEYWORDS) or keywords_only:
        known = {*TRL_KEYWORDS, *TRL_CONTEXT, "answer", *given} | (columns - NOT_COLUMNS if columns is not None else set())
        bad = [p.name for p in _required(sig) if p.kind == p.POSITIONAL_ONLY
               or (columns is not None and p.name not in known)]
        if bad:
            cols = ", ".join(sorted(columns - NOT_COLUMNS)) if columns else "none"
            raise RewardConfigError(f"{where}: a TRL-style function gets prompts, completions, completion_ids, "
                                    f"{', '.join(TRL_CONTEXT)}, reward.kwargs and the data's columns as keywords, but "
                                    f"it requires {', '.join(bad)} (the data's columns: {cols}); set data.answerKey / "
                                    "the column names or reward.kwargs, or give it a default")
        return "trl"
    try:
        sig.bind("response", "answer", {}, **dict.fromkeys(given))
    except TypeError as err:
        raise RewardConfigError(f"{where} fits no reward form ({err}); it must accept {FORMS}"
                                + (f", and the keywords of reward.kwargs ({', '.join(sorted(given))})" if given else "")
                                ) from None
    return "per_response"


def _not_applicable(value: Any) -> bool:
    """None, or NaN: TRL's "does not apply" (it turns None into NaN and sums with nansum)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _result(value: Any, where: str) -> RewardResult | None:
    if isinstance(value, dict) and "reward" not in value and "score" in value:  # veRL: {"score", "acc", ...}
        value = {"reward": value["score"]}
    if _not_applicable(value) or (isinstance(value, dict) and _not_applicable(value.get("reward"))):
        return None
    try:
        return normalize_result(value)
    except ValueError as err:
        raise RewardError(f"{where} returned an invalid result: {err}; return a float or a dict with 'reward' "
                          "and optional 'score' (None: does not apply)") from None


def _accepts(sig: inspect.Signature) -> Callable[[str], bool]:
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return lambda name: True
    return lambda name: name in sig.parameters


class PythonReward:
    """The batch scorer of a python reward: samples (`Sample`, rewards/sample.py) -> one
    (reward, score), or None ("does not apply"), per sample. `name` prefixes what the function
    logs with `log_metric` (`<name>/<metric>`, see `drain_metrics`); `kwargs` is
    `reward.kwargs`."""

    def __init__(self, file: str | None, function: str, *, name: str = "python",
                 kwargs: Mapping[str, Any] | None = None):
        self.fn, self.where = load_function(file, function, kwargs)
        self.kwargs = call_kwargs(file, function, kwargs)
        self.form = form_of(self.fn, self.where, kwargs=list(self.kwargs))
        self.name = name
        self.accepts = _accepts(inspect.signature(self.fn))
        self.trainer_state: Any = trainer_state()
        """TRL's `trainer_state` for the calls of this step (`begin_step`; step 0 until then)."""
        self._metrics: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    @property
    def concurrent(self) -> bool:
        """An async function: groups may be scored at once (on the shared loop)."""
        return is_async(self.fn)

    def begin_step(self, trainer_state: Any) -> None:
        self.trainer_state = trainer_state

    def log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric`: one value of the metric `name` for this call."""
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise RewardError(f"{self.where} called log_metric({name!r}, {value!r:.100}); the value must be a "
                              "number") from None
        with self._lock:
            self._metrics.setdefault(f"{self.name}/{name}", []).append(number)

    def drain_metrics(self) -> dict[str, float]:
        """Each metric logged since the last call, averaged over its values (TRL's rule)."""
        with self._lock:
            metrics, self._metrics = self._metrics, {}
        return {k: sum(v) / len(v) for k, v in metrics.items() if v}

    def __call__(self, samples: Sequence[Any], columns: dict[str, list] | None = None) -> list[RewardResult | None]:
        """Scores `samples`; what the function gives `log_extra` lands in `columns` (column ->
        one value per sample) when a dict is given."""
        n = len(samples)

        def log_extra(column: str, values: Sequence[Any]) -> None:
            values = list(values)
            if len(values) != n:
                raise RewardError(f"{self.where} called log_extra({column!r}, ...) with {len(values)} values for "
                                  f"{n} completions; give one per completion")
            if columns is not None:
                columns[str(column)] = values

        context = {"trainer_state": self.trainer_state, "log_metric": self.log_metric, "log_extra": log_extra}
        if self.form == "trl":
            args = {**trl_arguments(samples), **context, **self.kwargs}
            values = call(self.fn, self.where, **{k: v for k, v in args.items() if self.accepts(k)})
            return trl_results(values, n, self.where)
        if self.form == "verl":
            calls = [((), {k: v for k, v in {"data_source": s.extra_info.get("data_source"), "solution_str": s.response,
                                             "ground_truth": s.answer, "extra_info": s.extra_info.get("extra_info"),
                                             **self.kwargs}.items() if self.accepts(k)}) for s in samples]
        else:  # positional: a per-response function may name its three parameters as it likes
            calls = [((s.response, s.answer, s.extra_info), self.kwargs) for s in samples]
        return [_result(v, self.where) for v in call_each(self.fn, self.where, calls)]


def trainer_state(*, global_step: int = 0, max_steps: int = 0, epoch: float = 0.0, num_train_epochs: int = 0,
                  save_steps: int = 0, train_batch_size: int | None = None) -> Any:
    """TRL's `trainer_state`: a `transformers.TrainerState` holding where the run is."""
    from transformers import TrainerState

    return TrainerState(global_step=global_step, max_steps=max_steps, epoch=epoch, num_train_epochs=num_train_epochs,
                        save_steps=save_steps, train_batch_size=train_batch_size)


def python_reward(file: str | None, function: str, *, name: str = "python",
                  kwargs: Mapping[str, Any] | None = None) -> PythonReward:
    """The batch scorer of a python reward (`PythonReward`)."""
    return PythonReward(file, function, name=name, kwargs=kwargs)


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
    """A TRL function's answer, checked: a list of n floats, None or NaN (does not apply)."""
    try:
        values = list(values)
    except TypeError:
        raise RewardError(f"{where} returned {type(values).__name__}; a TRL-style function returns a list of "
                          f"floats (or None), one per completion") from None
    if len(values) != n:
        raise RewardError(f"{where} returned {len(values)} rewards for {n} completions; return one per completion")
    return [_result(v, f"{where} (completion {i})") for i, v in enumerate(values)]

