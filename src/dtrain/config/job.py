"""The whole job's config: the sections together, read from TOML and `key=value` overrides, checked,
written back as TOML and listed for the README's reference. Keys that were renamed still work alone,
with a note (returned by `read_config`, a FutureWarning from `load_config`) saying their new name."""

from __future__ import annotations

import dataclasses
import difflib
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from dtrain.config.checkpoint import CheckpointConfig
from dtrain.config.data import DataConfig
from dtrain.config.ddp import DDPConfig
from dtrain.config.distributed import DistributedConfig
from dtrain.config.foreign import foreign_hint
from dtrain.config.model import DATA_GIVES, ModelConfig, kind_problem
from dtrain.config.monitor import MonitorConfig, ProfileConfig
from dtrain.config.optimizer import OptimizerConfig
from dtrain.config.parallel import ParallelConfig
from dtrain.config.run import RunConfig
from dtrain.config.scheduler import SchedulerConfig
from dtrain.config.section import Section
from dtrain.config.settings import coerce, describe, inline, key_name, parse_value, tomllib, where
from dtrain.config.training import TrainingConfig
from dtrain.errors import ConfigError

# Old name -> new name. The old one alone still sets the new one, and a note says so; both is refused.
# [distributed] held ~20 keys that were three things: the process group's (still [distributed]), how the
# model is spread ([parallel]) and DDP's knobs ([ddp]); a config or a run.dir written before says them there.
_MOVED_TO_PARALLEL = (
    "strategy",
    "reshard_after_forward",
    "fsdp_cpu_offload",
    "hsdp_shard_size",
    "tp_size",
    "pp_size",
    "pp_schedule",
    "pp_stages_per_rank",
    "pp_split",
    "cp_size",
)
_MOVED_TO_DDP = (
    "bucket_cap_mb",
    "gradient_as_bucket_view",
    "static_graph",
    "find_unused_parameters",
    "shared_memory_allreduce",
    "comm_hook",
)
RENAMED = {
    "distributed.fsdp_units": "model.blocks",
    **{f"distributed.{key}": f"parallel.{key}" for key in _MOVED_TO_PARALLEL},
    **{f"distributed.{key}": f"ddp.{key}" for key in _MOVED_TO_DDP},
}


@dataclass(slots=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config") -> Config:
        """Build and validate a config from nested dicts (as TOML gives them)."""
        moved: dict[str, str] = {}
        config = _reading(moved, lambda: _from_dict(raw, source, moved))
        _warn(_moved_notes(moved))
        return config

    def to_dict(self) -> dict[str, Any]:
        return {
            section: {key_name(name): value for name, value in values.items()}
            for section, values in dataclasses.asdict(self).items()
        }

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    def with_overrides(self, overrides: Sequence[str]) -> Config:
        """A copy with `section.key=value` overrides applied (values parse as TOML, else as text)."""
        moved: dict[str, str] = {}
        config = _reading(moved, lambda: _with_overrides(self, overrides, moved))
        _warn(_moved_notes(moved))
        return config


SECTIONS = [f.name for f in dataclasses.fields(Config)]


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a TOML job description (or start from defaults) and apply command-line overrides. A
    renamed key is taken under its new name, with a FutureWarning."""
    config, notes = read_config(path, overrides)
    _warn(notes)
    return config


def read_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> tuple[Config, list[str]]:
    """`load_config`, with the notes it would warn returned instead: a command says them once per job,
    not once in every process that loads the config."""
    moved: dict[str, str] = {}  # each old key name met → where it was given

    def read() -> Config:
        config = Config() if path is None else _from_dict(_read_toml(Path(path)), str(path), moved)
        return _with_overrides(config, overrides, moved)

    config = _reading(moved, read)
    return config, _moved_notes(moved)


def all_keys() -> list[str]:
    """Every `section.key` a config accepts."""
    config = Config()
    return [f"{s}.{key_name(f.name)}" for s in SECTIONS for f in dataclasses.fields(getattr(config, s))]


def reference_rows() -> list[tuple[str, str, str]]:
    """(key, default, help) for every setting: the README's config reference comes from here."""
    config = Config()
    rows = []
    for s in SECTIONS:
        section = getattr(config, s)
        for f in dataclasses.fields(section):
            key, help_ = f"{s}.{key_name(f.name)}", f.metadata["help"]
            formerly = [old for old, new in RENAMED.items() if new == key]
            rows.append((key, inline(getattr(section, f.name)), help_ + "".join(f" Formerly {o}." for o in formerly)))
    return rows


def validate(config: Config) -> None:
    """Each section's own checks, then those across sections."""
    for name in SECTIONS:
        getattr(config, name).check()
    if config.run.overwrite and config.checkpoint.resume == "yes":
        raise ConfigError(
            "run.overwrite=true starts afresh and --resume (checkpoint.resume=yes) continues "
            "from a checkpoint: choose one"
        )
    if config.checkpoint.resume_from and config.checkpoint.resume == "no":
        raise ConfigError(
            "checkpoint.resume = 'no' starts fresh and --resume-from (checkpoint.resume_from) continues from a "
            "checkpoint: choose one"
        )
    weights = config.model.weights
    if weights and config.run.overwrite and _inside(weights[1], config.run.dir):
        raise ConfigError(
            f"{weights[0]} = '{weights[1]}' is inside run.dir, whose outputs run.overwrite=true deletes before "
            f"a new run reads them; copy the weights out of {config.run.dir} first, or give another run.dir"
        )


def with_global_batch(config: Config, world_size: int) -> Config:
    """`config` with training.grad_accum_steps made up from training.global_batch_size for `world_size`
    processes (the same object when it is off): the global batch stays what it says on any number of
    processes, as nanoGPT divides its accumulation by the world size. A grad_accum_steps of its own (not 1)
    must agree."""
    training, batch_size = config.training, config.data.batch_size
    wanted = training.global_batch_size
    if not wanted:
        return config
    per_step = batch_size * world_size
    if wanted % per_step:
        raise ConfigError(
            f"training.global_batch_size = {wanted} is not a multiple of data.batch_size × processes = "
            f"{batch_size} × {world_size} = {per_step}; give a multiple of {per_step}, or another data.batch_size"
        )
    accum = wanted // per_step
    if training.grad_accum_steps not in (1, accum):
        raise ConfigError(
            f"training.grad_accum_steps = {training.grad_accum_steps} and training.global_batch_size = {wanted} "
            f"disagree on {world_size} process(es) ({accum} would make it); give only one of them"
        )
    return dataclasses.replace(config, training=dataclasses.replace(training, grad_accum_steps=accum))


def _inside(path: str, folder: str) -> bool:
    resolved = Path(path).expanduser().resolve()
    return Path(folder).expanduser().resolve() in (resolved, *resolved.parents)


def check_model_fits_data(config: Config) -> None:
    """For a job whose model dtrain builds from model.name (`dtrain run`, `dtrain config`): refuse a built-in
    model for a built-in data set whose samples it does not take. Not part of validate(): a script that
    hands Trainer its own model leaves model.name unused, whatever the data."""
    problem = kind_problem(config.model.name, config.data.name, DATA_GIVES.get(config.data.name))
    if problem:
        raise ConfigError(problem)


# What only DDP uses, and what only the sharded strategies use (hsdp_shard_size: hsdp alone).
_DDP_ONLY = (
    "bucket_cap_mb",
    "gradient_as_bucket_view",
    "static_graph",
    "find_unused_parameters",
    "shared_memory_allreduce",
)
_SHARDED_ONLY = ("reshard_after_forward", "fsdp_cpu_offload")


def idle_settings(config: Config) -> list[str]:
    """A note (one line, or none) naming each setting given a value of its own that does nothing in this
    job — another strategy's option, the mlp's width for another model, blocks nothing works on — so
    that it is not taken for having had an effect. Said once, as a renamed key's note is (cli)."""
    default, strategy = Config(), config.parallel.strategy
    is_ddp, training = strategy == "ddp", config.training

    def given(section: str, key: str) -> bool:
        return getattr(getattr(config, section), key) != getattr(getattr(default, section), key)

    def said(section: str, key: str, why: str) -> str:
        return f"{section}.{key} = {inline(getattr(getattr(config, section), key))} ({why})"

    idle = [
        said("ddp", key, f"a DDP setting; parallel.strategy = {strategy}")
        for key in _DDP_ONLY
        if not is_ddp and given("ddp", key)
    ]
    idle += [
        said("parallel", key, "an FSDP setting; parallel.strategy = ddp")
        for key in _SHARDED_ONLY
        if is_ddp and given("parallel", key)
    ]
    if strategy != "hsdp" and given("parallel", "hsdp_shard_size"):
        idle.append(said("parallel", "hsdp_shard_size", f"an hsdp setting; parallel.strategy = {strategy}"))
    if is_ddp and config.model.blocks and training.activation_checkpointing == "none" and training.compile != "blocks":
        why = "DDP uses blocks only for training.activation_checkpointing and training.compile=blocks, both off"
        idle.append(said("model", "blocks", why))
    if config.data.padding == "none":
        why = "a padding setting; data.padding = none"
        idle += [said("data", key, why) for key in ("pad_to_multiple_of", "pad_token_id") if given("data", key)]
    if config.data.sampling == "random" and given("data", "shuffle"):
        idle.append(said("data", "shuffle", "random windows are drawn at random; data.sampling = random"))
    if config.parallel.pp_size == 1:
        why = "a pipeline setting; parallel.pp_size = 1"
        idle += [
            said("parallel", key, why)
            for key in ("pp_schedule", "pp_stages_per_rank", "pp_split")
            if given("parallel", key)
        ]
    if config.model.name != "mlp" and given("model", "hidden_size"):
        idle.append(said("model", "hidden_size", f"the built-in mlp's width; model.name = {config.model.name}"))
    return [f"these settings do nothing in this job and are ignored: {'; '.join(idle)}"] if idle else []


# --- reading ------------------------------------------------------------------------------------


def _read_toml(path: Path) -> dict[str, Any]:
    if path.exists() and not path.is_dir() and not path.is_file():  # a device, a FIFO: endless or blocking
        raise ConfigError(f"config file {path} is not a regular file; pass a TOML file")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path} does not exist; pass a TOML file such as examples/digits_mlp.toml"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; pass a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}); TOML files are UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror or exc})") from None


def _from_dict(raw: Mapping[str, Any], source: str, moved: dict[str, str]) -> Config:
    config = Config()
    for section_name, table in _renamed_in_tables(raw, source, moved).items():
        section = _section(config, section_name, source)
        if not isinstance(table, Mapping):
            raise ConfigError(
                f"'{section_name}' {where(source)} must be a table of keys ([{section_name}]), got {describe(table)}"
            )
        for key, value in table.items():
            _assign(section, f"{section_name}.{key}", value, source)
    validate(config)
    return config


def _with_overrides(config: Config, overrides: Sequence[str], moved: dict[str, str]) -> Config:
    config = _from_dict(config.to_dict(), "config", moved)
    given = {item.partition("=")[0].strip() for item in overrides}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override '{item}' is not key=value; e.g. training.epochs=3")
        key = _renamed_key(key.strip(), given, "on the command line", moved)
        section_name, _, name = key.partition(".")
        section = _section(config, section_name, "on the command line", full_key=key)
        if not name:
            raise ConfigError(
                f"override '{item}' names a section, not a key; e.g. {section_name}.{_field_names(section)[0]}=..."
            )
        _assign(section, key, parse_value(key, text), "on the command line", raw_text=text)
    validate(config)
    return config


# --- renamed keys -------------------------------------------------------------------------------


def _renamed_in_tables(raw: Mapping[str, Any], source: str, moved: dict[str, str]) -> Mapping[str, Any]:
    """`raw` with each old key of RENAMED moved to its new place (and noted in `moved`)."""
    for old, new in RENAMED.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        table, target = raw.get(old_section), raw.get(new_section, {})
        if not (isinstance(table, Mapping) and old_key in table and isinstance(target, Mapping)):
            continue
        given = {f"{old_section}.{k}" for k in table} | {f"{new_section}.{k}" for k in target}
        _renamed_key(old, given, source, moved)
        left = {k: v for k, v in table.items() if k != old_key}
        raw = {**raw, old_section: left, new_section: {**raw.get(new_section, {}), new_key: table[old_key]}}
    return raw


def _renamed_key(key: str, given: set[str], source: str, moved: dict[str, str]) -> str:
    """The name `key` now has, an old name noted in `moved`; an old name given beside its new one is refused."""
    new = RENAMED.get(key)
    if new is None:
        return key
    if new in given:
        raise ConfigError(f"{key} and {new} {where(source)} are one setting ({key} is its old name); give only {new}")
    moved.setdefault(key, source)
    return new


def _reading(moved: dict[str, str], read: Callable[[], Config]) -> Config:
    """`read()`, whose refusal of a key given under its old name says that name too."""
    try:
        return read()
    except ConfigError as exc:
        for old in moved:
            if str(exc).startswith(f"{RENAMED[old]} "):
                raise ConfigError(f"{exc} (given as {old}, its old name)") from None
        raise


def _moved_notes(moved: dict[str, str]) -> list[str]:
    """One note for every old key name a config gave (a run.dir's config.toml written before [distributed]
    was split gives sixteen): what each is now, and that it was read so."""
    if not moved:
        return []
    places = list(dict.fromkeys(moved.values()))
    said_where = where(places[0]) if len(places) == 1 else f"{where(places[0])} and {where(places[1])}"
    if len(moved) == 1:
        key, new = next(iter(moved)), RENAMED[next(iter(moved))]
        return [f"{key} is now {new}; the value {said_where} was used as {new}: write {new} instead"]
    sections: dict[tuple[str, str], list[str]] = {}  # keys that kept their name in another section
    said = []
    for key in moved:
        (old_section, name), (new_section, new_name) = key.split("."), RENAMED[key].split(".")
        if name == new_name:
            sections.setdefault((old_section, new_section), []).append(name)
        else:
            said.append(f"{key} is now {RENAMED[key]}")
    said += [f"{', '.join(names)} from [{old}] to [{new}]" for (old, new), names in sections.items()]
    return [
        f"{len(moved)} keys {said_where} have moved ({'; '.join(said)}): read under their new names; write "
        f"them there instead"
    ]


def _warn(notes: list[str]) -> None:
    for note in notes:
        warnings.warn(note, FutureWarning, stacklevel=3)


# --- one key --------------------------------------------------------------------------------------


def _section(config: Config, name: str, source: str, full_key: str | None = None) -> Section:
    if name in SECTIONS:
        return getattr(config, name)
    wanted = full_key or name
    close = _closest(wanted) if "." in wanted else difflib.get_close_matches(wanted, SECTIONS, n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f"; sections are {', '.join(SECTIONS)}"
    hint = f"; {foreign}" if (foreign := foreign_hint(wanted, close[0] if close else None)) else hint
    what = "key" if "." in wanted or foreign else "section"  # a bare `learning_rate = 0.1` is meant as a key
    raise ConfigError(f"unknown {what} '{wanted}' {where(source)}{hint}")


def _closest(key: str) -> list[str]:
    """[the key `key` likely meant, by its name now], or []. A key named right in the wrong section is found
    by its name (`parallel.timeout_s`); old names count too (a typo of `distributed.strategy` means
    `parallel.strategy`)."""
    known = [*all_keys(), *RENAMED]
    name = key.partition(".")[2]
    close = [k for k in known if k.partition(".")[2] == name][:1] or difflib.get_close_matches(
        key, known, n=1, cutoff=0.6
    )
    return [RENAMED.get(close[0], close[0])] if close else []


def _field_names(section: Section) -> list[str]:
    return [key_name(f.name) for f in dataclasses.fields(section)]  # type: ignore[arg-type]


_TYPE_HINTS: dict[type, dict[str, Any]] = {}


def _type_hints(section_type: type) -> dict[str, Any]:
    # Resolving a section's string annotations costs ~1 ms; a config assigns every key of every section.
    if section_type not in _TYPE_HINTS:
        _TYPE_HINTS[section_type] = typing.get_type_hints(section_type)
    return _TYPE_HINTS[section_type]


def _assign(section: Section, key: str, value: Any, source: str, raw_text: str | None = None) -> None:
    section_name, _, name = key.partition(".")
    name, _, subkey = name.partition(".")
    fields_by_name = {key_name(f.name): f for f in dataclasses.fields(section)}  # type: ignore[arg-type]
    if name not in fields_by_name:
        close = _closest(key)
        hint = f"; did you mean '{close[0]}'?" if close else f"; [{section_name}] has {', '.join(fields_by_name)}"
        hint = f"; {foreign}" if (foreign := foreign_hint(key, close[0] if close else None)) else hint
        raise ConfigError(f"unknown key '{key}' {where(source)}{hint}")
    f = fields_by_name[name]
    type_ = _type_hints(type(section))[f.name]
    if subkey:  # a key inside a free table, e.g. model.options.depth=3
        if type_ is not dict:
            raise ConfigError(f"'{key}' {where(source)}: {section_name}.{name} is not a table")
        getattr(section, f.name)[subkey] = value
        return
    setattr(section, f.name, coerce(f"{section_name}.{name}", value, type_, f.metadata, raw_text))
