"""The ``joynexus`` commands that need no running stack: ``model init`` / ``model pretrain``
write backbone checkpoints, ``data record`` / ``data inspect`` make and summarise offline
datasets, ``env describe`` prints an env's layout. Each imports the model core or the
simulators inside its command, so the other commands do not load them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from clients.clikit import add_command, data_commands

if TYPE_CHECKING:
    from clients.clikit import Subcommands


def _model_init(args: argparse.Namespace) -> int:
    from vla import tiny

    path = tiny.init_checkpoint(args.name, Path(args.out))
    print(f"wrote {args.name} checkpoint to {path}")
    return 0


def _model_pretrain(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from services.envs.frames import collect_frames
    from vla.backbone import Backbone
    from vla.pretrain import FrameSet, PretrainConfig, pretrain, save_pretrained

    config = PretrainConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed
    )
    train_sets, heldout_sets = [], []
    for env_id in args.env:
        total = args.episodes + args.heldout_episodes
        with tqdm(total=total, unit="episode", desc=f"rendering {env_id}") as bar:
            train_sets.append(
                collect_frames(
                    env_id,
                    args.episodes,
                    args.seed,
                    image_size=args.image_size,
                    on_episode=lambda _: bar.update(1),
                )
            )
            # Held-out seeds far from the training ones: the probe scores unseen scenes.
            heldout_sets.append(
                collect_frames(
                    env_id,
                    args.heldout_episodes,
                    args.seed + 1_000_000,
                    image_size=args.image_size,
                    on_episode=lambda _: bar.update(1),
                )
            )
    train, heldout = FrameSet.concat(train_sets), FrameSet.concat(heldout_sets)
    backbone = Backbone.load(args.base)
    with tqdm(total=config.steps, unit="step", desc="pretraining") as bar:

        def progress(step: int, loss: float) -> None:
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{loss:.4f}")

        report = pretrain(backbone, train, heldout, config, base=args.base, on_step=progress)
    out = save_pretrained(backbone, Path(args.out), report)
    print(f"{'target':<16} {'probe R2 before':>16} {'after':>8}")
    for name in report.target_names:
        before, after = report.probe_r2_before[name], report.probe_r2_after[name]
        print(f"{name:<16} {before:>16.3f} {after:>8.3f}")
    if report.constant_targets:
        print(f"constant, left out: {', '.join(report.constant_targets)}")
    print(
        f"{report.train_frames} frames ({report.heldout_frames} held out) from "
        f"{', '.join(report.env_ids)}; loss {report.loss_first:.4f} -> {report.loss_last:.4f}; "
        f"{report.wall_s:.0f} s; checkpoint {out} (load with --backbone {out})"
    )
    return 0


def _data_record(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from services.envs.datasets import record

    with tqdm(total=args.episodes, unit="episode", desc=f"recording {args.env}") as bar:
        failed = 0

        def progress(attempt: int, success: bool) -> None:
            nonlocal failed
            failed += not success
            if success or not args.only_success:
                bar.update(1)
            bar.set_postfix(attempts=attempt + 1, failed=failed)

        info = record(
            args.env,
            args.episodes,
            Path(args.out),
            seed=args.seed,
            max_steps=args.max_steps,
            env_kwargs={
                "image_size": args.image_size,
                **({"proprio_extras": args.proprio_extras} if args.proprio_extras else {}),
            },
            only_success=args.only_success,
            on_episode=progress,
            overwrite=args.overwrite,
        )
    print(
        f"recorded {info.total_episodes} episodes, {info.total_frames} frames to {args.out} "
        f"({failed} expert failures{' dropped' if args.only_success else ' kept'})"
    )
    return 0


def _data_inspect(args: argparse.Namespace) -> int:
    from vla.data import inspect

    print(inspect(Path(args.dir)).format())
    return 0


def _env_describe(args: argparse.Namespace) -> int:
    import json

    from services.envs.adapters import EnvUnavailableError
    from services.envs.describe import describe_env, format_description

    try:
        kwargs = json.loads(args.kwargs)
        description = describe_env(args.env, kwargs, args.image_size)
    except (EnvUnavailableError, ValueError, TypeError) as exc:
        print(f"env describe: {exc}", file=sys.stderr)
        return 2
    print(format_description(description))
    return 0


def add_offline_commands(sub: Subcommands) -> None:
    """``model``, ``env`` and ``data record`` / ``data inspect`` on ``sub``."""
    m = sub.add_parser("model", help="backbone checkpoints")
    msub = m.add_subparsers(dest="model_cmd", required=True, metavar="command")
    mi = add_command(msub, "init", _model_init, help="write a tiny backbone checkpoint directory")
    mi.add_argument(
        "name",
        help="tiny (Idefics3), tiny-224, tiny-llava, tiny-paligemma, tiny-idefics2, "
        "tiny-llava-next",
    )
    mi.add_argument("--out", required=True)
    mp = add_command(
        msub,
        "pretrain",
        _model_pretrain,
        help="train a backbone to see object and goal positions in simulator frames",
    )
    mp.add_argument("--env", action="append", required=True, help="env id (repeatable)")
    mp.add_argument("--base", default="tiny", help="tiny model name or checkpoint directory")
    mp.add_argument("--out", required=True, help="checkpoint directory to write")
    mp.add_argument("--episodes", type=int, default=150, help="training episodes per env")
    mp.add_argument("--heldout-episodes", type=int, default=30, help="probe episodes per env")
    mp.add_argument("--steps", type=int, default=1500)
    mp.add_argument("--batch-size", type=int, default=64)
    mp.add_argument("--lr", type=float, default=1e-3)
    mp.add_argument("--image-size", type=int, default=64)
    mp.add_argument("--seed", type=int, default=0)

    e = sub.add_parser("env", help="simulator environments")
    esub = e.add_subparsers(dest="env_cmd", required=True, metavar="command")
    ed = add_command(
        esub,
        "describe",
        _env_describe,
        help="action space, proprio layout, cameras, episode limit, instruction of an env",
    )
    ed.add_argument("env", help="env id, e.g. JoyNexus/Reach2D-v0 or PickCubeSO100-v1")
    ed.add_argument("--kwargs", default="{}", help="env constructor arguments as JSON")
    ed.add_argument("--image-size", type=int, default=64)

    # The tenant CLI made the ``data`` group (push, list); record and inspect join it.
    dsub = data_commands(sub)
    dr = add_command(dsub, "record", _data_record, help="record scripted-expert demonstrations")
    dr.add_argument("--env", required=True)
    dr.add_argument("--episodes", type=int, required=True)
    dr.add_argument("--out", required=True)
    dr.add_argument("--seed", type=int, default=0, help="episode i starts from seed + i")
    dr.add_argument("--image-size", type=int, default=64, help="camera image side (pixels)")
    dr.add_argument("--max-steps", type=int, default=None, help="episode limit (env's default)")
    dr.add_argument(
        "--only-success",
        action="store_true",
        help="drop episodes the expert failed; record until --episodes succeeded",
    )
    dr.add_argument("--overwrite", action="store_true", help="replace an existing dataset")
    dr.add_argument(
        "--proprio-extras",
        default="",
        help="task extras appended to the proprio, comma-separated (see `env describe`); "
        'train and evaluate with env_kwargs {"proprio_extras": the same}',
    )
    di = add_command(dsub, "inspect", _data_inspect, help="summarise a dataset")
    di.add_argument("dir")
