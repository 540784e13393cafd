"""Reading settings from the environment, one variable at a time: each type's parsing and the
error that names the variable and its bad value (config.Settings.from_env uses it)."""

from __future__ import annotations

import math
from typing import Mapping


class ConfigError(ValueError):
    """An environment variable has a value the server cannot use."""


class EnvReader:
    """Parses one variable at a time; every error names the variable and the bad value."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env

    def _raw(self, name: str) -> str | None:
        v = self.env.get(name)
        return None if v is None or v.strip() == "" else v.strip()

    def str(self, name: str, default: str) -> str:
        return self._raw(name) or default

    def choice(self, name: str, default: str, allowed: tuple[str, ...]) -> str:
        v = (self._raw(name) or default).lower()
        if v not in allowed:
            raise ConfigError(f"{name}={v!r}: expected one of {', '.join(allowed)}")
        return v

    def int(self, name: str, default: int, low: int = 0) -> int:
        v = self._raw(name)
        try:
            n = default if v is None else int(v)
        except ValueError:
            raise ConfigError(f"{name}={v!r}: expected an integer") from None
        if n < low:
            raise ConfigError(f"{name}={n}: must be >= {low}")
        return n

    def optional_int(self, name: str) -> int | None:
        return None if self._raw(name) is None else self.int(name, 0)

    def float(self, name: str, default: float, positive: bool = False, low: float = 0.0) -> float:
        """A finite number >= `low` (`positive`: > 0, where 0 would break what it sizes, e.g. a
        drain budget). NaN passed every comparison, infinity most."""
        v = self._raw(name)
        try:
            x = default if v is None else float(v)
        except ValueError:
            raise ConfigError(f"{name}={v!r}: expected a number") from None
        if not math.isfinite(x):
            raise ConfigError(f"{name}={v}: expected a finite number")
        if x < low or (positive and x == 0):
            raise ConfigError(f"{name}={x}: must be {'>' if positive else '>='} {low:g}")
        return x

    def bool(self, name: str, default: bool) -> bool:
        v = self._raw(name)
        if v is None:
            return default
        if v.lower() in ("1", "true", "yes", "on"):
            return True
        if v.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}={v!r}: expected true or false")

    def optional_bool(self, name: str) -> bool | None:
        return None if self._raw(name) is None else self.bool(name, False)

    def pooling(self, name: str, modes: tuple[str, ...], aliases: Mapping[str, str]) -> str:
        """`modes` (or an alias of one), several joined by +."""
        v = (self._raw(name) or "").lower()
        bad = [m for m in v.split("+") if v and aliases.get(m, m) not in modes]
        if bad:
            raise ConfigError(f"{name}={v!r}: expected one of {', '.join(modes)} (several joined by +)")
        return v

    def keys(self, name: str) -> tuple[str, ...]:
        """Comma-separated keys; set and holding none (API_KEYS="") is an error, not an open server."""
        keys = self.str_list(name)
        if name in self.env and not keys:
            raise ConfigError(f"{name} is set but holds no key (comma-separated keys; unset it to serve without keys)")
        return keys

    def file(self, name: str) -> str:
        """A path the server must be able to read (a mounted Secret's file), or empty."""
        path = self._raw(name) or ""
        if path:
            try:
                with open(path, "rb") as f:
                    f.read(1)
            except OSError as e:
                raise ConfigError(f"{name}={path!r}: cannot read it ({e.strerror or e})") from None
        return path

    def str_list(self, name: str) -> tuple[str, ...]:
        v = self._raw(name)
        return tuple(t.strip() for t in v.split(",") if t.strip()) if v else ()

    def int_list(self, name: str, default: tuple[int, ...]) -> tuple[int, ...]:
        items = self.str_list(name)
        try:
            values = tuple(int(t) for t in items) if items else default
        except ValueError:
            raise ConfigError(f"{name}={self._raw(name)!r}: expected comma-separated integers") from None
        if any(b < 2 for b in values) or list(values) != sorted(set(values)):
            raise ConfigError(f"{name}={values}: expected ascending distinct lengths >= 2")
        return values

    def caps(self, name: str) -> dict[int, int] | None:
        items = self.str_list(name)
        if not items:
            return None
        try:
            pairs = [t.split(":") for t in items]
            caps = {int(k): int(v) for k, v in pairs}
        except ValueError:
            raise ConfigError(f"{name}={self._raw(name)!r}: expected len:rows,...") from None
        if any(v < 1 for v in caps.values()):
            raise ConfigError(f"{name}: every cap must be >= 1")
        return caps
