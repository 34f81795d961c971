"""loadgen's options as data: the argument types the flags share, and ``TrafficOptions``, what
planning a run reads (``orchestrate.plan``), built from the ``run`` flags or by ``sweep``."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from typing import Any

from loadgen.profiles import Profiles
from loadgen.shapes import shaped_profiles


def positive(kind: type) -> Any:
    """An argparse type: a number of ``kind`` above 0."""

    def conv(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from exc
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return v

    return conv


def non_negative(text: str) -> float:
    try:
        v = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from exc
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from exc
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def id_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"want LO,HI, got {text!r}") from exc
    if not 0 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 0 <= LO <= HI, got {text!r}")
    return lo, hi


def setup(
    parser: argparse.ArgumentParser, args: argparse.Namespace, shapes: str = "realistic"
) -> Profiles:
    """What ``run`` and ``sweep`` do first with their parsed flags: logging at ``--log-level``,
    then the profiles with the named shape set (``loadgen.shapes``) and every ``--set`` override
    applied (a bad one is a usage error)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=args.log_level,
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    try:
        return shaped_profiles(shapes, args.overrides)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # parser.error exits; this line is for the type checker


@dataclass(frozen=True)
class TrafficOptions:
    """What a plan is made of: a trace to replay, or a profile's synthetic traffic."""

    profile: str
    seed: int
    rate: float | None = None
    arrival: str | None = None
    burstiness: float | None = None
    ramp: float = 0.0
    ramp_from: float = 0.0
    duration: float | None = None
    num_requests: int | None = None
    trace: str | None = None
    trace_format: str | None = None
    time_scale: float = 1.0
    trace_block_size: int = 512

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrafficOptions:
        """The options of parsed ``python -m loadgen`` (or ``sweep``) flags."""
        return cls(
            profile=args.profile,
            seed=args.seed,
            rate=args.rate,
            arrival=args.arrival,
            burstiness=args.burstiness,
            ramp=getattr(args, "ramp", 0.0),
            ramp_from=getattr(args, "ramp_from", 0.0),
            duration=args.duration if hasattr(args, "duration") else None,
            num_requests=getattr(args, "num_requests", None),
            trace=args.trace,
            trace_format=args.trace_format,
            time_scale=args.time_scale,
            trace_block_size=args.trace_block_size,
        )
