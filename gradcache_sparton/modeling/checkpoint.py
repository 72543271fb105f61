"""The checkpoint format: a standard masked-LM folder plus a ``splade_config.json`` sidecar, read and
checked before any weights load, and weights loaded only when every tensor of the model is there.

``SpladeEncoder.save_pretrained`` writes what the backbone writes (one tied [V, D] matrix, safetensors)
and ``splade_config.json`` (pooling, masked ids, the decoder-only options, the head's activation when it
is not the default ``"relu"``, how it was trained, the model's ``query_encoder``), which
``AutoModelForMaskedLM`` ignores. A file without ``activation_function`` (every folder written before it
existed) reads as ``"relu"``; one without ``query_encoder`` has the query encoder its files hold
(:mod:`.query_encoder`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from gradcache_sparton.kernels import DEFAULT_HEAD_ACTIVATION, HEAD_ACTIVATIONS
from gradcache_sparton.primitives.query_encoders import QUERY_ENCODERS

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "CONFIG_LOCATION_KWARGS",
    "QUERY_ENCODER_FIELD",
    "SPLADE_CONFIG_NAME",
    "TRAINING_OPTIONS",
    "backbone_state_dict",
    "check_checkpoint_files",
    "load_backbone",
    "read_json_file",
    "read_splade_config",
    "record_query_encoder",
]

logger = logging.getLogger(__name__)

#: File written next to the backbone's checkpoint holding the SPLADE options (pooling, masked ids).
SPLADE_CONFIG_NAME = "splade_config.json"

# Options beyond pooling and masked ids, saved in splade_config.json only when set (off their defaults).
_DECODER_OPTIONS = ("prefix_length", "bidirectional", "echo")
_HEAD_OPTIONS = ("activation_function",)
# Tokens kept per text in training: readers such as ``evaluate`` use them as their defaults, so a checkpoint
# is scored as it was trained.
_MAX_LENGTHS = ("query_max_length", "document_max_length")
# The keys of the ``lora`` record: the LoRA settings (the CLI's flags) whose adapters were merged into the
# weights. A record only: the checkpoint is a plain model and loads without peft.
_LORA_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
#: How the checkpoint was trained (max lengths, ``lora``), saved in splade_config.json when known.
TRAINING_OPTIONS = (*_MAX_LENGTHS, "lora")
#: The field of splade_config.json recording what encodes the model's queries (one of ``QUERY_ENCODERS``):
#: a record of the folder, not an encoder option.
QUERY_ENCODER_FIELD = "query_encoder"

# Hub-location arguments of ``from_pretrained`` that also apply to reading the config alone.
CONFIG_LOCATION_KWARGS = ("cache_dir", "revision", "subfolder", "token", "local_files_only")


def backbone_state_dict(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An encoder state dict -> the backbone's: strip ``model.``, drop the head's aliases."""
    backbone: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        if key.startswith("model."):
            backbone[key.removeprefix("model.")] = value
        elif key not in ("head.weight", "head.bias"):
            raise ValueError(
                "state_dict must be a SpladeEncoder state dict (keys 'model.*' and 'head.*'), "
                f"got key {key!r}"
            )
    return backbone


def read_splade_config(path: str, **location: Any) -> dict[str, Any]:
    """The options of a checkpoint's ``splade_config.json`` (``{}`` if it has none), checked.

    ``path`` is a local folder or a hub id; ``location`` are ``from_pretrained``'s hub arguments
    (``revision``, ``cache_dir``, ``token``, ``subfolder``, ``local_files_only``). A local
    sentence-transformers ``SparseEncoder`` folder without that file (saved by sentence-transformers itself)
    gives the activation its ``SpladePooling`` names, so an OpenSearch v3 model (``"log1p_relu"``) loads with
    its own activation, not the default one.
    """
    folder = os.path.join(path, location.get("subfolder") or "")
    file = os.path.join(folder, SPLADE_CONFIG_NAME)
    if not os.path.isdir(path):
        file = _hub_file(path, **location)
    if file is None or not os.path.isfile(file):
        return _sentence_transformers_activation(folder) if os.path.isdir(path) else {}
    options = read_json_file(file)
    optional = (*_DECODER_OPTIONS, *_HEAD_OPTIONS, *TRAINING_OPTIONS, QUERY_ENCODER_FIELD)
    if not isinstance(options, dict) or set(options) - {"pooling", "special_token_ids", *optional}:
        raise ValueError(
            f"{file} must hold a JSON object with pooling and special_token_ids (and optionally "
            f"{', '.join(optional)}), got {options!r}"
        )
    activation = options.get("activation_function", DEFAULT_HEAD_ACTIVATION)
    if activation not in HEAD_ACTIVATIONS:
        raise ValueError(
            f"{file}: activation_function must be one of {list(HEAD_ACTIVATIONS)}, got {activation!r}"
        )
    for name in _MAX_LENGTHS:
        value = options.get(name)
        if value is not None and not _is_positive_int(value):
            raise ValueError(f"{file}: {name} must be a positive int, got {value!r}")
    if "lora" in options:
        _check_lora_record(options["lora"], file)
    if QUERY_ENCODER_FIELD in options and options[QUERY_ENCODER_FIELD] not in QUERY_ENCODERS:
        raise ValueError(
            f"{file}: {QUERY_ENCODER_FIELD} must be one of {list(QUERY_ENCODERS)}, got {options[QUERY_ENCODER_FIELD]!r}"
        )
    return options


def record_query_encoder(folder: str | os.PathLike, query_encoder: str) -> None:
    """Set ``query_encoder`` in the local ``folder``'s ``splade_config.json``, its other keys kept as they are;
    nothing where the folder has no such file (its query encoder is then what its files hold)."""
    folder = os.fspath(folder)
    file = os.path.join(folder, SPLADE_CONFIG_NAME)
    if not os.path.isfile(file):
        return
    options = read_splade_config(folder)
    options[QUERY_ENCODER_FIELD] = query_encoder
    with open(file, "w", encoding="utf-8") as f:
        json.dump(options, f, indent=2)
        f.write("\n")


def _sentence_transformers_activation(folder: str) -> dict[str, Any]:
    """``{"activation_function": name}`` where ``folder`` is a sentence-transformers folder whose
    ``SpladePooling`` (in ``modules.json``, or in the document route of a ``Router``'s ``router_config.json``)
    names an activation other than the default; else ``{}``. ``ValueError`` naming the file for one the
    head does not compute."""
    modules = os.path.join(folder, "modules.json")
    if not os.path.isfile(modules):
        return {}
    entries = read_json_file(modules)
    paths = {entry.get("path"): entry.get("type", "") for entry in entries if isinstance(entry, dict)}
    router = os.path.join(folder, "router_config.json")
    if any(str(kind).endswith("Router") for kind in paths.values()) and os.path.isfile(router):
        types = read_json_file(router)
        paths = types.get("types", {}) if isinstance(types, dict) else {}
    pooling = [
        path for path, kind in paths.items() if isinstance(kind, str) and kind.endswith("SpladePooling")
    ]
    config = os.path.join(folder, pooling[0], "config.json") if len(pooling) == 1 else ""
    if not os.path.isfile(config):
        return {}
    options = read_json_file(config)
    activation = options.get("activation_function") if isinstance(options, dict) else None
    activation = activation or DEFAULT_HEAD_ACTIVATION
    if activation not in HEAD_ACTIVATIONS:
        raise ValueError(
            f"{config}: activation_function must be one of {list(HEAD_ACTIVATIONS)}, got {activation!r}"
        )
    return {} if activation == DEFAULT_HEAD_ACTIVATION else {"activation_function": activation}


def _is_positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _check_lora_record(lora: Any, file: str) -> None:
    """``ValueError`` naming the file unless ``lora`` is a record of the LoRA settings (``_LORA_KEYS``)."""
    record = lora if isinstance(lora, dict) and set(lora) == set(_LORA_KEYS) else None
    dropout = None if record is None else record["lora_dropout"]
    targets = None if record is None else record["lora_target_modules"]
    if not (
        record is not None
        and _is_positive_int(record["lora_r"])
        and _is_positive_int(record["lora_alpha"])
        and isinstance(dropout, (int, float))
        and not isinstance(dropout, bool)
        and 0 <= dropout < 1
        and isinstance(targets, list)
        and len(targets) > 0
        and all(isinstance(name, str) and name for name in targets)
    ):
        raise ValueError(
            f"{file}: lora must be an object of {', '.join(_LORA_KEYS)} (positive ints, a dropout in [0, 1), a "
            f"non-empty list of module names), got {lora!r}"
        )


def _hub_file(repo_id: str, **location: Any) -> str | None:
    """``splade_config.json`` of a hub checkpoint (cached or downloaded), None if the repo has none."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return hf_hub_download(repo_id, SPLADE_CONFIG_NAME, **location)
    except (EntryNotFoundError, LocalEntryNotFoundError):
        # No such file, or offline and not cached: the default options. (A repo or network that is not
        # there fails clearly in AutoConfig.from_pretrained right after.)
        return None


# Weight files a checkpoint folder may hold, in the order transformers prefers them.
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def read_json_file(file: str | os.PathLike) -> Any:
    """The JSON value in ``file``; ``ValueError`` naming the file and line if it is cut short or malformed."""
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{os.fspath(file)} line {exc.lineno}: not valid JSON ({exc.msg}); the file is truncated or corrupted"
        ) from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{os.fspath(file)}: not a UTF-8 text file ({exc.reason})") from None


def _weight_files(folder: str) -> list[str]:
    """The weight files of a local checkpoint folder (every shard of a sharded one); [] if it has none."""
    for name in _WEIGHT_FILES:
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            continue
        if not name.endswith(".index.json"):
            return [file]
        index = read_json_file(file)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{file} has no weight_map: the shard index is truncated or corrupted")
        return [os.path.join(folder, shard) for shard in sorted(set(weight_map.values()))]
    return []


def check_checkpoint_files(folder: str | os.PathLike) -> None:
    """``ValueError`` naming the file unless a local checkpoint folder has a readable ``config.json`` and
    complete weight files (safetensors headers checked against the file sizes: a cut file is caught here,
    before any weights load). Reads headers only."""
    from safetensors import SafetensorError, safe_open

    folder = os.fspath(folder)
    config_file = os.path.join(folder, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(
            f"checkpoint folder {folder!r} has no config.json: it is not a complete model checkpoint "
            "(save_pretrained writes config.json next to the weights)"
        )
    read_json_file(config_file)
    files = _weight_files(folder)
    if not files:
        raise ValueError(
            f"checkpoint folder {folder!r} has no weights: expected one of {', '.join(_WEIGHT_FILES)}"
        )
    for file in files:
        if not os.path.isfile(file):
            raise ValueError(f"checkpoint folder {folder!r}: shard {os.path.basename(file)} is missing")
        if file.endswith(".safetensors"):
            try:
                with safe_open(file, framework="pt"):
                    pass
            except (SafetensorError, OSError) as exc:
                raise ValueError(
                    f"{file} is truncated or corrupted ({str(exc).strip().splitlines()[0]}): the checkpoint "
                    "cannot be loaded; copy or save it again"
                ) from None


def _names(keys: Sequence[str], limit: int = 8) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def _common_prefix(missing: Sequence[str], unexpected: Sequence[str]) -> str | None:
    """The one prefix that makes every unexpected key a missing one (a wrapper's keys), else None."""
    needed = set(missing)
    prefixes = {key[: -len(name)] for name in needed for key in unexpected if key.endswith(f".{name}")}
    if len(prefixes) != 1:
        return None
    prefix = prefixes.pop()
    return prefix if all(key.removeprefix(prefix) in needed for key in unexpected) else None


def load_backbone(auto_class: type, path: str | os.PathLike, **model_kwargs: Any) -> PreTrainedModel:
    """``auto_class.from_pretrained(path, **model_kwargs)``, refused unless every tensor of the model was in
    the checkpoint with its shape.

    ``ValueError`` naming the checkpoint's weight files and the missing, mismatched and unexpected tensors when
    any model tensor is missing or of another shape (it would otherwise start random: a renamed tensor, a
    wrapper's ``state_dict()`` with prefixed keys). Tensors tied to another (the decoder to the input
    embeddings) are not counted as missing: transformers ties them. Extra tensors alone (e.g. a pre-training
    checkpoint's pooler) are only logged, as every model weight then loaded.
    """
    path = os.fspath(path)
    model_kwargs.pop("output_loading_info", None)
    files = _weight_files(path) if os.path.isdir(path) else []
    where = ", ".join(files) if files else path
    try:
        model, info = auto_class.from_pretrained(path, output_loading_info=True, **model_kwargs)
    except RuntimeError as exc:
        if "ignore_mismatched_sizes" not in str(exc):
            raise
        # transformers refuses tensors of another shape itself, after logging a report of them.
        raise ValueError(
            f"checkpoint {where} does not match the model its config.json describes: tensors of another shape "
            "(listed in the loading report above)"
        ) from None
    missing = sorted(info.get("missing_keys") or ())
    mismatched = [key for key, *_ in info.get("mismatched_keys") or ()]
    unexpected = sorted(info.get("unexpected_keys") or ())
    errors = list(info.get("error_msgs") or ())
    if missing or mismatched or errors:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s) the model needs: {_names(missing)}")
        if mismatched:
            parts.append(f"{len(mismatched)} of another shape: {_names(mismatched)}")
        if unexpected:
            parts.append(f"{len(unexpected)} tensor(s) the model does not have: {_names(unexpected)}")
        parts.extend(errors[:2])
        prefix = _common_prefix(missing, unexpected)
        hint = (
            f"the file's keys carry the prefix {prefix!r}: it is a wrapper's state_dict(), not the model's"
            if prefix
            else "a wrapper's state_dict() has prefixed keys"
        )
        raise ValueError(
            f"checkpoint {where} does not match {type(model).__name__} ({'; '.join(parts)}): those weights would "
            f"start random. A checkpoint must be written by save_pretrained ({hint})"
        )
    if unexpected:
        logger.warning(
            "checkpoint %s holds %d tensor(s) %s has no use for (ignored; every model tensor loaded): %s",
            where,
            len(unexpected),
            type(model).__name__,
            _names(unexpected),
        )
    return model
