"""Megatron-LM's 3-D configuration as a value: ``megatron:dp=D,tp=T,pp=P[,mb=M][,virtual=V]``.

``dp`` data-parallel replicas, ``tp`` tensor-parallel devices per replica, ``pp`` pipeline
stages, ``mb`` the micro-batch size per replica (Megatron's ``--micro-batch-size``; searched when
absent), ``virtual`` the virtual stages per device of interleaved 1F1B. Which devices a stage
takes and how the configuration is priced: `manual.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.planner.inter.placement import place_submeshes
from meshplan.planner.inter.stage_problem import Submesh

PREFIX = "megatron:"
SPEC_FORM = "megatron:dp=D,tp=T,pp=P[,mb=M][,virtual=V]"
_KEYS = ("dp", "tp", "pp", "mb", "virtual")
_REQUIRED = ("dp", "tp", "pp")


@dataclass(frozen=True)
class MegatronSpec:
    """A Megatron-LM configuration (module docstring). Raises ValueError for a count that is
    not a positive int, or ``virtual`` > 1 with one stage."""

    dp: int
    tp: int
    pp: int
    mb: int | None = None
    virtual: int = 1

    def __post_init__(self) -> None:
        for key in _KEYS:
            value = getattr(self, key)
            if key == "mb" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"megatron {key}={value!r}: must be a positive integer")
        if self.virtual > 1 and self.pp < 2:
            raise ValueError(f"megatron virtual={self.virtual} interleaves the chunks of a "
                             f"pipeline's stages; pp={self.pp} has none: give pp >= 2 or "
                             "virtual=1")

    def __str__(self) -> str:
        mb = "" if self.mb is None else f",mb={self.mb}"
        virtual = "" if self.virtual == 1 else f",virtual={self.virtual}"
        return f"megatron:dp={self.dp},tp={self.tp},pp={self.pp}{mb}{virtual}"

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp * self.pp

    def as_dict(self) -> dict[str, int | None]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "mb": self.mb,
                "virtual": self.virtual}


def is_megatron_spec(method: object) -> bool:
    """Whether ``method`` is of the form ``megatron:...`` (valid or not)."""
    return isinstance(method, str) and method.startswith(PREFIX)


def parse_megatron_spec(text: str) -> MegatronSpec:
    """``"megatron:dp=2,tp=4,pp=2,mb=1"`` -> MegatronSpec. Raises ValueError naming the bad
    part (not key=value, an unknown or repeated key, a value that is not a positive integer,
    dp/tp/pp missing, virtual > 1 without a pipeline)."""
    if not is_megatron_spec(text):
        raise ValueError(f"not a megatron spec: {text!r}; expected {SPEC_FORM}")
    fields: dict[str, int] = {}
    for item in text.removeprefix(PREFIX).split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            raise ValueError(f"bad megatron spec {text!r}: {item!r} is not key=value; "
                             f"expected {SPEC_FORM}")
        if key not in _KEYS:
            raise ValueError(f"bad megatron spec {text!r}: unknown key {key!r}; valid keys: "
                             f"{', '.join(_KEYS)}")
        if key in fields:
            raise ValueError(f"bad megatron spec {text!r}: {key} given twice")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"bad megatron spec {text!r}: {key}={value!r} must be a positive "
                             "integer")
        fields[key] = int(value)
    missing = [k for k in _REQUIRED if k not in fields]
    if missing:
        raise ValueError(f"bad megatron spec {text!r}: missing {', '.join(missing)}; expected "
                         f"{SPEC_FORM}")
    return MegatronSpec(**fields)


def factorizations(num_devices: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp * tp * pp = ``num_devices``."""
    divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
    return [(d, t, num_devices // (d * t)) for d in divisors for t in divisors
            if (num_devices // d) % t == 0]


def stage_submesh(num_devices: int, devices_per_host: int) -> Submesh:
    """The submesh of a stage on ``num_devices`` (dp * tp) devices: ``(1, n)`` within one host,
    else whole hosts ``(n / M, M)``. Raises ValueError when n spans part of a host."""
    if num_devices <= devices_per_host:
        return (1, num_devices)
    if num_devices % devices_per_host:
        raise ValueError(f"a stage of dp*tp = {num_devices} devices spans more than one host "
                         f"of {devices_per_host} devices, so it must take whole hosts "
                         f"(dp*tp at most {devices_per_host} or a multiple of it)")
    return (num_devices // devices_per_host, devices_per_host)


def check_on_cluster(spec: MegatronSpec, num_hosts: int, devices_per_host: int) -> Submesh:
    """The submesh of each of ``spec``'s stages on the cluster. Raises ValueError when dp * tp
    * pp is not the device count (naming the valid factorizations), or when ``pp`` such
    submeshes do not tile the hosts."""
    n = num_hosts * devices_per_host
    if spec.num_devices != n:
        valid = ", ".join(f"dp={d},tp={t},pp={p}" for d, t, p in factorizations(n))
        raise ValueError(f"{spec}: dp*tp*pp = {spec.num_devices}, but the cluster has {n} "
                         f"devices; valid factorizations: {valid}")
    submesh = stage_submesh(spec.dp * spec.tp, devices_per_host)
    try:
        place_submeshes([submesh] * spec.pp, num_hosts, devices_per_host)
    except ValueError as e:
        raise ValueError(f"{spec}: {spec.pp} stages of {submesh[0]}x{submesh[1]} devices do not "
                         f"tile the cluster ({e})") from None
    return submesh
