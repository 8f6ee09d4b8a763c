"""``joynexus chaos``'s config and flags (here, away from the chaos run's imports, for the
CLI's parser)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChaosConfig:
    """What ``joynexus chaos`` runs."""

    home: Path
    #: SIGKILLs during the chaos phase.
    kills: int = 20
    #: Spread the kills over this many seconds (0: one every ``gap_s`` on average).
    duration_s: float = 0.0
    #: Also kill the NATS server (and start it again on the same store).
    broker: bool = False
    #: Run a 3-node JetStream cluster and also kill one node at a time (started again after a
    #: few seconds: it rejoins).
    cluster: bool = False
    seed: int = 0
    json_path: Path | None = None
    #: The workload's size: SFT steps, RL iterations (sized to outlast the kills by default).
    sft_steps: int = 0
    rl_iterations: int = 0
    #: Mean seconds between one kill's recovery and the next kill.
    gap_s: float = 2.0

    @property
    def steps(self) -> int:
        return self.sft_steps or max(40, 40 * self.kills)

    @property
    def iterations(self) -> int:
        return self.rl_iterations or max(3, 3 * self.kills)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``joynexus chaos``'s flags."""
    p.add_argument("--kills", type=int, default=20, help="SIGKILLs in the chaos phase")
    p.add_argument("--duration", type=float, default=0.0, help="spread the kills over S s")
    p.add_argument("--broker", action="store_true", help="also kill and restart the NATS server")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="a 3-node JetStream cluster; kill one node at a time too",
    )
    p.add_argument("--seed", type=int, default=0, help="the kill schedule's and the jobs' seed")
    p.add_argument("--json", type=Path, help="write the result here")
    p.add_argument("--sft-steps", type=int, default=0, help="default: 40 per kill, at least 40")
    p.add_argument("--rl-iterations", type=int, default=0, help="default: 3 per kill, at least 3")


def config_of(args: argparse.Namespace, home: Path) -> ChaosConfig:
    if args.cluster and args.broker:
        raise SystemExit("joynexus chaos: --broker (one server) and --cluster are either-or")
    if args.kills < 0:
        raise SystemExit("joynexus chaos: --kills must be 0 or more")
    return ChaosConfig(
        home=home,
        kills=args.kills,
        duration_s=args.duration,
        broker=args.broker,
        cluster=args.cluster,
        seed=args.seed,
        json_path=args.json,
        sft_steps=args.sft_steps,
        rl_iterations=args.rl_iterations,
    )
