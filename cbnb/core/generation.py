"""Request defaults from a transformers `GenerationConfig`, and how a request's own arguments override them
(torch-free: the config is read through its attributes, so transformers is not imported here).

``Engine(model, generation_config=GenerationConfig(...))`` gives every request its defaults, as transformers'
``init_continuous_batching(generation_config=...)`` does; without one, the model's own ``model.generation_config``
is used (as there, and as ``model.generate``). A request's argument that is not None overrides its default; the
neutral value turns a default off (``top_k=0``, ``top_p=1.0``, ``repetition_penalty=1.0``,
``no_repeat_ngram_size=0``...).

Fields of the config, by what cbnb does with them:

- `DEFAULT_FIELDS`: request defaults (sampling, the logits processors of `cbnb.core.sampling_params`, EOS, stop strings
  from ``stop_strings``). cbnb's own names that are not GenerationConfig fields (``frequency_penalty``,
  ``presence_penalty``, ``logit_bias``, ``seed``) are read too when the config carries them as extra attributes.
- `UNSUPPORTED_PROCESSORS`: logits processors transformers would build that cbnb does not implement. They follow
  ``ContinuousBatchingConfig.drop_unsupported_processors`` as transformers documents it ("remove unsupported logits
  processors instead of erroring"): True drops them with a warning, False raises `ValueError` naming them.
- `UNSUPPORTED_MODES`: generation modes continuous batching does not run (beam search, several sequences per
  prompt, assisted decoding, ``max_time``): always a `ValueError`, since dropping them changes what is generated.
- ``max_length``: not used by continuous batching (transformers' continuous batching reads ``max_new_tokens`` only):
  a warning when it is set without ``max_new_tokens``.
- anything else (output flags, cache and compile settings, token ids other than EOS): not needed here, ignored.

``per_request_processors`` is where cbnb departs: transformers turns only temperature / top-k / top-p into
per-request parameters, and only when that flag is set; in cbnb every processor reads its parameters per request
(per-row tensors cost the same), whatever the flag says.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping

from .sampling_params import SamplingParams

__all__ = ["DEFAULT_FIELDS", "UNSUPPORTED_PROCESSORS", "UNSUPPORTED_MODES", "GenerationDefaults",
           "REQUEST_ARGS"]

#: GenerationConfig field -> `SamplingParams` field it gives the default of.
DEFAULT_FIELDS: dict[str, str] = {
    "max_new_tokens": "max_new_tokens", "do_sample": "do_sample", "temperature": "temperature", "top_k": "top_k",
    "top_p": "top_p", "min_p": "min_p", "min_new_tokens": "min_new_tokens", "min_length": "min_length",
    "repetition_penalty": "repetition_penalty", "no_repeat_ngram_size": "no_repeat_ngram_size",
    "bad_words_ids": "bad_words_ids", "sequence_bias": "sequence_bias", "suppress_tokens": "suppress_tokens",
    "begin_suppress_tokens": "begin_suppress_tokens", "forced_bos_token_id": "forced_bos_token_id",
    "forced_eos_token_id": "forced_eos_token_id", "stop_strings": "stop",
    # cbnb / OpenAI names, read when a config carries them as extra attributes
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty", "logit_bias": "logit_bias",
    "seed": "seed",
}

#: The request arguments of `Engine.submit` that take a default (SamplingParams names), besides EOS.
REQUEST_ARGS = tuple(dict.fromkeys(list(DEFAULT_FIELDS.values()) + ["ignore_eos", "logprobs"]))


def _set(v: Any) -> bool:
    return v is not None


#: Logits processors cbnb does not implement -> when transformers would build one from the field's value.
UNSUPPORTED_PROCESSORS: dict[str, Callable[[Any], bool]] = {
    "typical_p": lambda v: v is not None and v < 1.0,
    "top_h": _set,
    "epsilon_cutoff": lambda v: v is not None and 0.0 < v < 1.0,
    "eta_cutoff": lambda v: v is not None and 0.0 < v < 1.0,
    "encoder_repetition_penalty": lambda v: v is not None and v != 1.0,
    "encoder_no_repeat_ngram_size": lambda v: v is not None and v > 0,
    "exponential_decay_length_penalty": _set,
    "guidance_scale": lambda v: v is not None and v != 1,
    "watermarking_config": _set,
    "renormalize_logits": lambda v: v is True,
    "remove_invalid_values": lambda v: v is True,
}

#: Generation modes continuous batching does not run -> when the field's value asks for one.
UNSUPPORTED_MODES: dict[str, Callable[[Any], bool]] = {
    "num_beams": lambda v: v is not None and v > 1,
    "num_return_sequences": lambda v: v is not None and v > 1,
    "num_beam_groups": lambda v: v is not None and v > 1,
    "diversity_penalty": lambda v: v is not None and v != 0,
    "penalty_alpha": lambda v: v is not None and v > 0,
    "constraints": _set,
    "force_words_ids": _set,
    "prompt_lookup_num_tokens": _set,
    "assistant_early_exit": _set,
    "dola_layers": _set,
    "max_time": _set,
}


def _read(config: Any, name: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


class GenerationDefaults:
    """The request defaults of one generation config (see the module docstring).

    Args:
        config: a transformers `GenerationConfig`, a mapping of its field names, or None (no defaults).

    Attributes:
        values: SamplingParams field -> default, for the fields the config sets.
        eos_token_id: the config's EOS id(s), or None.
        unsupported: field -> value of the logits processors cbnb does not implement.

    Raises:
        ValueError: a generation mode continuous batching cannot run (naming the field), or a bad default value
            (naming the field, as a request argument would).
    """

    def __init__(self, config: Any = None) -> None:
        self.values: dict[str, Any] = {}
        self.eos_token_id: Any = None
        self.unsupported: dict[str, Any] = {}
        if config is None:
            return
        for name, active in UNSUPPORTED_MODES.items():
            v = _read(config, name)
            if active(v):
                raise ValueError(f"generation_config.{name}={v!r} is not supported by continuous batching (cbnb "
                                 "generates one sequence per request, by greedy decoding or sampling)")
        for name, active in UNSUPPORTED_PROCESSORS.items():
            v = _read(config, name)
            if active(v):
                self.unsupported[name] = v
        for name, field in DEFAULT_FIELDS.items():
            v = _read(config, name)
            if v is not None:
                self.values[field] = v
        self.eos_token_id = _read(config, "eos_token_id")
        if _read(config, "max_length") is not None and "max_new_tokens" not in self.values:
            warnings.warn(f"generation_config.max_length={_read(config, 'max_length')} is not used by continuous "
                          "batching (as in transformers); set max_new_tokens", UserWarning, stacklevel=3)
        try:
            SamplingParams(**self.resolve({}))
        except ValueError as e:
            raise ValueError(f"generation_config: {e}") from None

    def check(self, drop_unsupported: bool) -> list[str]:
        """Apply ``drop_unsupported_processors`` to the unsupported processors: warn and drop them (True), or raise
        (False). Returns the names dropped.

        Raises:
            ValueError: naming each unsupported processor, when `drop_unsupported` is False.
        """
        if not self.unsupported:
            return []
        listed = ", ".join(f"{k}={v!r}" for k, v in self.unsupported.items())
        if not drop_unsupported:
            raise ValueError(f"generation_config sets logits processors cbnb does not implement: {listed}; set "
                             "ContinuousBatchingConfig(drop_unsupported_processors=True) to drop them")
        warnings.warn(f"dropping logits processors cbnb does not implement: {listed} "
                      "(drop_unsupported_processors=True)", UserWarning, stacklevel=3)
        return list(self.unsupported)

    def resolve(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """SamplingParams keyword arguments: each of `args` (request arguments, SamplingParams names) that is not
        None, else the config's default. Neutral values turn a processor off (``top_k=0`` means no top-k:
        `SamplingParams` stores it as None)."""
        out = dict(self.values)
        for k, v in args.items():
            if v is not None:
                out[k] = v
        return out
